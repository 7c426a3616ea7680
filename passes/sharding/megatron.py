"""Megatron's split of a joint graph's Linear pairs (Shoeybi et al. 2019), the ``megatron`` preset of tensor
parallelism: which parameters are column- and row-parallel, found in the graph itself.

A Linear whose output reaches other Linears' inputs through elementwise ops, views and attention only is
column-parallel (weight rows and bias split), those others row-parallel (weight columns split, bias whole);
attention between them runs split by heads; an embedding tied to an LM head is split over the vocabulary. The
result is layouts (``{param key: spec}``) that ``passes.propagate_sharding`` completes for every node; the
tensor-parallel feature's planning (``fxpar.features.tensor_parallel``) calls it, and Tofu's search is compared
with it by the same cost model.
"""
from __future__ import annotations

import operator

import torch

from fxpar import meta as M
from fxpar.roles import Role
from fxpar.sharding import ShardingError

__all__ = ["megatron_layouts", "megatron_whole", "linears"]

aten = torch.ops.aten
_MATMUL = (aten.mm.default, aten.addmm.default)
_THROUGH_W = (aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
              aten.expand.default)
# ops a column-parallel output may pass on its way to a row-parallel Linear, without communication
_PASS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int, aten.permute.default,
         aten.clone.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.gelu.default, aten.relu.default, aten.silu.default, aten.tanh.default,
         aten.sigmoid.default, aten.mul.Tensor, aten.div.Tensor, aten.native_dropout.default, aten.expand.default,
         aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_efficient_attention.default,
         aten._scaled_dot_product_flash_attention.default, aten.scaled_dot_product_attention.default,
         aten.contiguous.default, operator.getitem}
# ops that join tensors (a rotary embedding: q·cos + rotate_half(q)·sin, halves cut by slice and joined by cat): a
# column-parallel output passes them only where every tensor they join comes from that same output, never a residual
_JOIN = {aten.add.Tensor, aten.sub.Tensor, aten.cat.default}
# ops a rotary embedding applies to a head-split tensor on the way, one input each
_PASS |= {aten.neg.default, aten.slice.Tensor, aten.detach.default, aten.alias.default, aten.select.int,
          aten.stack.default, aten.flatten.using_ints}
_SDPA = {aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_efficient_attention.default,
         aten._scaled_dot_product_flash_attention.default, aten.scaled_dot_product_attention.default}


def _param_of(n):
    """The parameter key ``n`` is (through transposes and views), or None."""
    while n.op == "call_function" and n.target in _THROUGH_W:
        n = n.args[0]
    if n.op == "placeholder" and M.get(n, M.ROLE) == Role.PARAM:
        return M.get(n, M.PARAM)
    return None


def linears(gm) -> list:
    """The forward's Linear layers: ``[(matmul node, weight key, bias key or None, activation input node)]``."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in _MATMUL or M.get(n, M.PHASE) != "forward":
            continue
        x, w = (n.args[1], n.args[2]) if n.target is aten.addmm.default else (n.args[0], n.args[1])
        key = _param_of(w)
        if key is None or w.target not in (aten.t.default, aten.transpose.int, aten.permute.default):
            continue
        bias = _param_of(n.args[0]) if n.target is aten.addmm.default else None
        while x.op == "call_function" and x.target in (aten.view.default, aten._unsafe_view.default,
                                                       aten.reshape.default):
            x = x.args[0]
        out.append((n, key, bias, x))
    return out


def _reaches(start, targets: dict) -> tuple:
    """The Linears (by matmul node) whose input ``start`` reaches through ops in ``_PASS`` only (and ``_JOIN``
    ops whose every tensor input ``start`` reaches), and the SDPA nodes on the way."""
    return _walk(start, targets)[:2]


def _walk(start, targets: dict) -> tuple:
    """``_reaches``, and the ops the walk stopped at (outside ``_PASS`` and ``_JOIN``, or joins with other inputs)."""
    seen, todo, hit, sdpa, waiting, stops = {start}, [start], [], [], set(), set()

    def visit(u):
        seen.add(u)
        if u in targets:
            hit.append(targets[u])
        if u.target in _SDPA:
            sdpa.append(u)
        if u.target in _PASS or u.target in _JOIN:
            todo.append(u)
        elif u not in targets:
            stops.add(u)

    while todo:
        for u in todo.pop().users:
            if u in seen or M.get(u, M.PHASE) != "forward":
                continue
            if u.target in _JOIN and not all(a in seen for a in u.all_input_nodes):
                waiting.add(u)                # its other inputs may be reached later
                continue
            visit(u)
        if not todo:                          # the joins whose inputs have all been reached since
            for u in [u for u in waiting if u not in seen and all(a in seen for a in u.all_input_nodes)]:
                visit(u)
    return hit, sdpa, stops | {u for u in waiting if u not in seen}


def megatron_layouts(gm, tp: int, axis: str = "tp") -> dict:
    """Megatron's split of the graph's Linear pairs (Shoeybi et al. 2019, §3): ``{param key: spec}``. A Linear
    whose output reaches other Linears' inputs through elementwise ops, views and attention only is
    column-parallel (weight rows and bias split), those others row-parallel (weight columns split, bias whole);
    attention between them runs split by heads; an embedding tied to an LM head is split over the vocabulary.
    Raises ``ShardingError`` naming the module where tp does not divide a split dim or the head count."""
    lins = linears(gm)
    by_input = {}
    for n, key, bias, x in lins:
        by_input.setdefault(x, []).append(n)
    targets = {x: tuple(ns) for x, ns in by_input.items()}      # a Linear's input -> the Linears reading it
    info = {n: (key, bias) for n, key, bias, _ in lins}
    role = {}
    for n, key, bias, _ in lins:
        if n in role:
            continue
        hits, sdpa = _reaches(n, targets)
        down = [m for ns in hits for m in ns if m is not n]
        if not down or any(role.get(m) == "col" for m in down):
            continue
        mod = M.get(n, M.MODULE) or key
        out_dim = n.meta["val"].shape[-1]
        if out_dim % tp:
            raise ShardingError(f"sharding='megatron': Linear {mod!r} ({key}) has {out_dim} output features, which "
                                f"tp={tp} does not divide; use a tp dividing {out_dim}, or layouts that leave it whole")
        for s in sdpa:
            heads = s.args[0].meta["val"].shape[1]
            if heads % tp:
                raise ShardingError(f"sharding='megatron': attention in {M.get(s, M.MODULE) or '<root>'!r} has {heads} "
                                    f"heads, which tp={tp} does not divide; use a tp dividing {heads}, or layouts")
        role[n] = "col"
        for m in down:
            role[m] = "row"
    out = {}
    for n, r in role.items():
        key, bias = info[n]
        out[key] = (axis, None) if r == "col" else (None, axis)
        if bias is not None and r == "col":
            out[bias] = (axis,)
    return {**_tied_vocabulary(gm, lins, tp, axis), **out}


def megatron_whole(gm, layouts: dict) -> list:
    """The forward's Linears the preset left whole (weight not in ``layouts``), each with why:
    ``[(module, "meets aten.bmm, aten._softmax")]`` -- the ops its output met before any other Linear, outside the
    elementwise ops, views and attention the preset splits by heads (an output meeting none is the model's last)."""
    lins = linears(gm)
    targets = {}
    for n, _, _, x in lins:
        targets[x] = targets.get(x, ()) + (n,)
    out = []
    for n, key, _, _ in lins:
        if key in layouts:
            continue
        hits, _, stops = _walk(n, targets)
        ops = sorted({_op_name(u) for u in stops if M.get(u, M.PHASE) == "forward" and u.op == "call_function"})
        if hits:
            why = "the Linears its output reaches are split another way"
        elif ops:
            why = f"its output meets {', '.join(ops[:4])}{' ...' if len(ops) > 4 else ''} before any other Linear"
        else:
            why = "its output reaches no other Linear"
        out.append((M.get(n, M.MODULE) or key.rpartition(".")[0], why))
    return out


def _op_name(n) -> str:
    t = n.target
    return f"aten.{t._overloadpacket.__name__}" if hasattr(t, "_overloadpacket") else getattr(t, "__name__", str(t))


def _tied_vocabulary(gm, lins, tp: int, axis: str) -> dict:
    """An embedding whose weight is also a Linear's (a tied LM head) split over the vocabulary (Shoeybi et al.
    2019, §3): the lookup gives partial sums (``fxpar.vocab_embedding``), the head's logits come out split over
    the vocabulary. A vocabulary tp does not divide stays whole (Megatron pads it to a multiple of tp)."""
    heads = {key for _, key, _, _ in lins}
    out = {}
    for n in gm.graph.find_nodes(op="call_function", target=aten.embedding.default):
        key = _param_of(n.args[0])
        if key in heads and M.get(n, M.PHASE) == "forward" and n.args[0].meta["val"].shape[0] % tp == 0:
            out[key] = (axis, None)
    return out
