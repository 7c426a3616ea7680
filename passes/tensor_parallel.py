"""tensor_parallel: split each operator's tensors over the tp mesh axes, on each stage's joint graph.

The stage's joint graph (forward, backward, optimizer) is decided and lowered in one go: every
node's sharding comes from the mode in the Plan's ``tensor_parallel`` section --

* ``megatron``: the Linear pairs of the graph (:func:`megatron_layouts`): a Linear whose output
  reaches another's input through elementwise ops, views and attention only is column-parallel,
  the other row-parallel (Shoeybi et al. 2019: one all-reduce per pair in forward, one in backward);
* ``layouts``: Mesh-TensorFlow layouts, parameter globs -> a mesh axis or None per dim;
* ``annotations``: only the model's ``fxpar.shard`` annotations;
* ``auto``: Tofu's search (``passes.tofu``), recursive halving over ``tp0``, ``tp1`` ...;

then propagation (GShard, ``passes.propagate_sharding``) for everything not fixed, and the lowering
(``passes.lower_sharding``): collectives where a producer's layout differs from its consumer's,
local sizes in views, local shapes checked with fake tensors. Batch inputs come in whole and the
loss and stage outputs leave whole; parameters, their gradients and optimizer state stay split as
decided, so the optimizer updates pieces. The graph is the same on every rank of the stage (slices
and partial-sum zeros read the rank's coordinate at run time, ``fxpar.local_ops``), and the passes
after this one (recompute, data_parallel, bucket, ...) see local shapes. Megatron's MLP on tp=2::

    before                                        after
    t = aten.t(fc1_weight)          # [64, 16]    t = aten.t(fc1_weight)                            # [32, 16]
    addmm = aten.addmm(fc1_bias, view, t)         addmm = aten.addmm(fc1_bias, view, t)             # [24, 32]
    gelu = aten.gelu(view_1)                      gelu = aten.gelu(view_1)
    ...                                           ...
    addmm_1 = aten.addmm(fc2_bias, view_2, t_1)   first_on_axis = fxpar.first_on_axis(fc2_bias, 'fxpar:tp')
                                                  addmm_1 = aten.addmm(first_on_axis, view_2, t_1) # partial sums
                                                  all_reduce = _c10d_functional.all_reduce(view_3, 'sum', 'fxpar:tp')
                                                  wait_tensor = _c10d_functional.wait_tensor(all_reduce)
"""
from __future__ import annotations

import operator

import torch

from fxpar import meta as M
from fxpar.annotate import annotated_value, is_shard_node
from fxpar.errors import PassError
from fxpar.mesh import Mesh
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.sharding import Sharding, ShardingError

from .lower_sharding import lower_shardings
from .propagate_sharding import ShardingResult, propagate_shardings
from .tofu import TofuCost, plan_cost, tofu_search

__all__ = ["TensorParallel", "megatron_layouts", "linears"]

SECTION = "tensor_parallel"          # the Plan section (fxpar.features.tensor_parallel) this pass carries out

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
_SDPA = {aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_efficient_attention.default,
         aten._scaled_dot_product_flash_attention.default, aten.scaled_dot_product_attention.default}


def _param_of(n):
    """The parameter key ``n`` is (through transposes and views), or None."""
    while n.op == "call_function" and n.target in _THROUGH_W:
        n = n.args[0]
    if n.op == "placeholder" and M.get(n, M.ROLE) == "param":
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
    """The Linears (by matmul node) whose input ``start`` reaches through ops in ``_PASS`` only, and the SDPA
    nodes on the way."""
    seen, todo, hit, sdpa = {start}, [start], [], []
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or M.get(u, M.PHASE) != "forward":
                continue
            seen.add(u)
            if u in targets:
                hit.append(targets[u])
            if u.target in _SDPA:
                sdpa.append(u)
            if u.target in _PASS:
                todo.append(u)
    return hit, sdpa


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


def _strip_annotations(gm) -> None:
    """Tofu decides everything itself: drop ``fxpar.shard`` markers (the annotated value is the plain one)."""
    for n in list(gm.graph.nodes):
        if is_shard_node(n):
            for u in list(n.users):
                val = annotated_value(n)
                if val is u:
                    u.replace_all_uses_with(u.args[0])
                    gm.graph.erase_node(u)
            gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _gradients_laid_out(gm, sig) -> None:
    """A gradient leaves laid out as its parameter; where the lowering redistributed it for that (a partial sum
    all-reduced over tp), the redistributed value is the gradient (``fxpar_grad_of``: what microbatches sum and
    data parallelism reduces), computed in backward."""
    out = gm.graph.output_node()
    leaves = [a for a in torch.utils._pytree.tree_flatten(out.args[0])[0] if isinstance(a, torch.fx.Node)]
    for (role, key), x in zip(sig.outputs, leaves):
        if role != "grad" or M.get(x, M.GRAD_OF) == key:
            continue
        chain, n = [], x
        while M.get(n, M.GRAD_OF) != key:
            if M.get(n, M.PASS) != "lower_sharding" or not n.args or not isinstance(n.args[0], torch.fx.Node):
                raise PassError(f"tensor_parallel: the gradient of {key!r} reaches the step's output through "
                                f"{n.name} ({n.target}), not a redistribution of its raw gradient -- please report it")
            chain.append(n)
            n = n.args[0]
        anchor = n                                   # the raw gradient: the chain runs right after it
        for c in reversed(chain):
            M.set_meta(c, M.PHASE, "backward")
            anchor.append(c)
            anchor = c
        M.set_meta(x, M.GRAD_OF, key)


def _tied_layouts(ctx, sig) -> dict:
    """``{(role, key): dims}`` of this stage's parameters (and their optimizer state) that an earlier stage holds
    too (a tied embedding and LM head): laid out as that stage decided, so the pieces the tied group sums
    match."""
    stages = ctx.plan.section(SECTION).stages
    out = {}
    for role, key in sig.inputs:
        if role not in ("param", "opt_state"):
            continue
        pkey = key.split(":", 1)[-1]
        if pkey not in (ctx.plan.tied or {}):
            continue
        for t in range(ctx.stage):
            part = stages[t].get("params" if role == "param" else "opt_state", {}) if t < len(stages) else {}
            if key in part:
                out[(role, key)] = part[key]
                break
    return out


def _versus_megatron(gm, ctx, mesh, sig, found, cost) -> str:
    """Tofu's choice against Megatron's split of the same graph, by the same cost model (Tofu, §6: the search
    finds Megatron's split or a cheaper one)."""
    try:
        layouts = megatron_layouts(gm, mesh.size, "tp")
        if not layouts:
            return "tofu: the graph has no Linear pair, so there is no Megatron split to compare with"
        meg = propagate_shardings(gm, Mesh((("tp", mesh.size),)), layouts,
                                  aliases=getattr(ctx.captured, "aliases", None) or {}, signature=sig, whole_io=True)
    except ShardingError as e:
        return f"tofu: Megatron's split does not apply to this graph ({str(e).splitlines()[0]})"
    m = sum(plan_cost(gm, meg, cost, sig).values())
    p = found.predicted
    verdict = "cheaper than" if p < m * (1 - 1e-9) else "as cheap as" if p <= m * (1 + 1e-9) else "dearer than"
    return (f"tofu: its plan ({found.predicted:.4g} s predicted) is {verdict} Megatron's split ({m:.4g} s) by the "
            "same cost model")


def result_from_plan(d: dict, mesh: Mesh) -> ShardingResult:
    """A ShardingResult from the ``{"out": ..., "need": ...}`` a Plan stored (Tofu's choice handed back)."""
    load = lambda v: tuple(Sharding.from_json(x) for x in v)     # noqa: E731
    return ShardingResult(dict(mesh.axes), out={k: load(v) for k, v in d["out"].items()},
                          need={k: load(v) for k, v in d["need"].items()})


class TensorParallel(Pass):
    name = "tensor_parallel"

    def run(self, gm, ctx: PassContext) -> PassResult:
        sh = ctx.plan.section(SECTION)     # each stage's layouts (and Tofu's choice) are recorded into it
        mesh = Mesh(tuple((a, int(n)) for a, n in sh.axes))
        sig = gm.meta["fxpar_signature"]
        stages = sh.stages
        while len(stages) <= ctx.stage:
            stages.append({})
        entry = stages[ctx.stage]
        try:
            res, extra = self._decide(gm, ctx, sh, mesh, sig, entry)
            new = lower_shardings(gm, res, mesh, rank=ctx.rank, world=ctx.plan.mesh)
        except ShardingError as e:
            raise PassError(f"tensor parallelism over {dict(mesh.axes)} (sharding={sh.mode!r}), stage {ctx.stage}: "
                            f"{e}") from None
        new.meta.update(gm.meta)
        _gradients_laid_out(new, sig)
        roles = dict(zip([p.name for p in gm.graph.find_nodes(op="placeholder")], sig.inputs))
        entry["params"] = {k: list(res.out[n][0].dims) for n, (r, k) in roles.items() if r == "param"}
        entry["opt_state"] = {k: list(res.out[n][0].dims) for n, (r, k) in roles.items() if r == "opt_state"}
        entry.update(extra)
        split = sum(1 for v in entry["params"].values() if any(v))
        n_coll = sum(1 for n in new.graph.nodes if M.COMM.name in n.meta)
        whole = ", ".join(f"{n} ({op.split('.')[-2] if '.' in op else op} in {mod or '<root>'})"
                          for n, op, mod in res.no_rule[:6]) + (" ..." if len(res.no_rule) > 6 else "")
        ctx.notes.append(f"tensor_parallel: {split} of {len(entry['params'])} parameter(s) split over "
                         f"{dict(mesh.axes)}, {n_coll} collective(s) inserted"
                         + (f"; ops without a sharding rule, run whole: {whole}" if res.no_rule else ""))
        new.meta["fxpar_shardings"] = res                 # program.shardings(rank) reads it
        new.meta["fxpar_tp_modules"] = {n.name: M.get(n, M.MODULE) or (M.get(n, M.PARAM) or "").split(":")[-1]
                                        .rpartition(".")[0] for n in gm.graph.nodes}
        return PassResult(new, True, {"split_params": split, "collectives": n_coll})

    def _decide(self, gm, ctx, sh, mesh, sig, entry) -> tuple:
        tp = mesh.size
        if sh.mode == "auto":
            _strip_annotations(gm)
        if entry.get("auto"):                              # a handed-back Plan: Tofu's stored choice
            return result_from_plan(entry["auto"], mesh), {}
        tied = _tied_layouts(ctx, sig)
        if sh.mode == "auto":
            cost = TofuCost()
            if ctx.cluster is not None:
                cost = TofuCost(link_bytes_per_s=ctx.cluster.intra_node.bandwidth,
                                flops_per_s=ctx.cluster.device.peak_flops, latency_s=ctx.cluster.intra_node.latency)
            phs = {(r, k): p.name for p, (r, k) in zip(gm.graph.find_nodes(op="placeholder"), sig.inputs)}
            fixed = {phs[rk]: Sharding(tuple(dims)) for rk, dims in tied.items() if rk in phs}
            found = tofu_search(gm, tp, cost, signature=sig, whole_io=True, fixed=fixed)
            ctx.notes.append(found.explain(limit=0).splitlines()[0])
            ctx.notes.append(_versus_megatron(gm, ctx, mesh, sig, found, cost))
            dump = lambda d: {k: [s.to_json() for s in v] for k, v in d.items()}      # noqa: E731
            return found.sharding, {"auto": {"out": dump(found.sharding.out), "need": dump(found.sharding.need)},
                                    "predicted_s": found.predicted}
        layouts = dict(sh.layouts or {})
        extra = {}
        if sh.mode == "megatron":
            preset = megatron_layouts(gm, tp, mesh.names[0])
            extra["megatron"] = {k: list(v) for k, v in preset.items()}
            layouts = {**preset, **layouts}
        layouts.update({k: tuple(dims) for (r, k), dims in tied.items() if r == "param"})
        res = propagate_shardings(gm, mesh, layouts, aliases=getattr(ctx.captured, "aliases", None) or {},
                                  signature=sig, whole_io=True)
        return res, extra
