"""Run the traced Adam/AdamW update as one fused kernel, in place: ``aten._fused_adamw_`` (``_fused_adam_``).

Capture traces the optimizer as a chain of ``torch._foreach_*`` ops over the parameter lists
(``fxpar.optim._adam``: ten list ops for AdamW), which every pass can cut, shard and move as
element-wise ops. On a CPU each of them is a pass over memory: for the 4-layer GPT of
``benchmarks/`` (3.7 M parameters, one thread) the chain takes about 16 ms a step in place (51 ms
functional), against about 3 ms for ATen's fused kernel, which reads parameter, gradient and both
moments once and writes parameter and moments once (torch.optim's ``fused=True``; the same update,
rounded once per element where the chain rounds per op: float64 results agree to 1e-16).

:func:`fuse_adam` runs where ``passes.reinplace`` makes the update in place (the pass list of a
synchronous program, and the graphs the cross-iteration split makes), before it: each chain
becomes one in-place fused call; its results' readers read those buffers instead. A parameter or
moment the update may not overwrite (ZeRO-1/2's chunk cut from the whole parameter, a tensor read
after the update) is copied first and the copy updated. A chain that does not match exactly
(other hyperparameters, an intermediate another op reads) is left to ``reinplace``. Before / after
(AdamW, one parameter; ``lr``, ``step`` graph inputs)::

    mul = mul(lr, 0.01); rsub = rsub(mul, 1); _foreach_mul = _foreach_mul([w], rsub)
    _foreach_lerp = _foreach_lerp([exp_avg_w], [g], 0.1); ... _foreach_sqrt(...); ... _foreach_div(...)
    _foreach_sub = _foreach_sub([_foreach_mul[0]], [_foreach_mul_2[0]])
    return (..., _foreach_sub[0], _foreach_lerp[0], _foreach_addcmul[0], ...)

    _fused_adamw_ = _fused_adamw_.tensor_lr([w], [g], [exp_avg_w], [exp_avg_sq_w], [], [step],
                        lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-08, amsgrad=False, maximize=False)
    return (..., w, exp_avg_w, exp_avg_sq_w, ...)

``Plan.optimizer['kernel']`` says whether a program fuses (``fxpar.optim.OptimizerSpec.kernel``):
the CPU kernel only so far; on CUDA the chain stays (the fused CUDA kernel wants its step tensors on
the device, which fxpar's runtime does not place there yet).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from fxpar import meta as M

from .graph_utils import OWNED_ROLES, is_alias, last_read
from cost_models.compute import OpCost, fused_adam_cost, node_time

__all__ = ["AdamChain", "find_adam_chains", "fuse_adam", "fused_chain_times"]

aten = torch.ops.aten


@dataclass
class AdamChain:
    """One traced Adam/AdamW update over lists of ``n`` tensors (nodes of the graph)."""
    decoupled: bool                 # AdamW
    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list
    lr: torch.fx.Node
    step: torch.fx.Node
    hyper: dict                     # beta1, beta2, eps, weight_decay
    last: torch.fx.Node             # the final _foreach_sub
    results: dict                   # "param" / "exp_avg" / "exp_avg_sq" -> the op whose getitems are the new values
    ops: list = field(default_factory=list)     # every list op of the chain
    scalars: list = field(default_factory=list)  # its scalar ops on lr and step (bias corrections, decay)


def _items(lst, n=None):
    """If every element of ``lst`` is ``getitem(op, i)`` of one op in order, that op."""
    if not isinstance(lst, (list, tuple)) or not lst:
        return None
    first = lst[0]
    if not (isinstance(first, torch.fx.Node) and first.target is operator.getitem):
        return None
    op = first.args[0]
    for i, x in enumerate(lst):
        if not (isinstance(x, torch.fx.Node) and x.target is operator.getitem and x.args[0] is op and x.args[1] == i):
            return None
    if n is not None and len(lst) != n:
        return None
    return op


def _is(n, target) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target == target


def _scalar(n, *args) -> bool:
    return all(a == b for a, b in zip(n.args, args)) and len(n.args) == len(args)


def _match(sub, hyper: dict, decoupled: bool) -> AdamChain | None:
    """The chain ``fxpar.optim._adam`` traces, ending at ``sub`` (``_foreach_sub.List``), or None."""
    b1, b2 = hyper["beta1"], hyper["beta2"]
    eps, wd = hyper["eps"], hyper["weight_decay"]
    if not _is(sub, aten._foreach_sub.List) or len(sub.args) != 2 or sub.kwargs:
        return None
    a_list, u_list = sub.args
    n = len(a_list)
    mul_step = _items(u_list, n)
    if not _is(mul_step, aten._foreach_mul.Tensor):
        return None
    div_l = _items(mul_step.args[0], n)
    step_size = mul_step.args[1]
    if not _is(div_l, aten._foreach_div.List):
        return None
    lerp, add_eps = _items(div_l.args[0], n), _items(div_l.args[1], n)
    if not (_is(lerp, aten._foreach_lerp.Scalar) and _is(add_eps, aten._foreach_add.Scalar)
            and len(lerp.args) == 3 and lerp.args[2] == 1 - b1 and _scalar(add_eps, add_eps.args[0], eps)):
        return None
    exp_avgs, grads = list(lerp.args[0]), list(lerp.args[1])
    div_t = _items(add_eps.args[0], n)
    if not _is(div_t, aten._foreach_div.Tensor):
        return None
    sqrt = _items(div_t.args[0], n)
    bc2_sqrt = div_t.args[1]
    if not _is(sqrt, aten._foreach_sqrt.default):
        return None
    addcmul = _items(sqrt.args[0], n)
    if not _is(addcmul, aten._foreach_addcmul.Scalar) or list(addcmul.args[1]) != grads \
            or list(addcmul.args[2]) != grads:
        return None
    value = addcmul.args[3] if len(addcmul.args) > 3 else addcmul.kwargs.get("value", 1)
    if value != 1 - b2:
        return None
    mul_b2 = _items(addcmul.args[0], n)
    if not (_is(mul_b2, aten._foreach_mul.Scalar) and len(mul_b2.args) == 2 and mul_b2.args[1] == b2):
        return None
    exp_avg_sqs = list(mul_b2.args[0])
    # step_size = lr / (1 - beta1 ** step); bc2_sqrt = (1 - beta2 ** step) ** 0.5
    if not (_is(step_size, aten.div.Tensor) and _is(step_size.args[1], aten.rsub.Scalar)):
        return None
    lr, pow1 = step_size.args[0], step_size.args[1].args[0]
    if not (_scalar(step_size.args[1], pow1, 1) and _is(pow1, aten.pow.Scalar) and pow1.args[0] == b1):
        return None
    step = pow1.args[1]
    if not (_is(bc2_sqrt, aten.pow.Tensor_Scalar) and bc2_sqrt.args[1] == 0.5 and _is(bc2_sqrt.args[0], aten.rsub.Scalar)):
        return None
    pow2 = bc2_sqrt.args[0].args[0]
    if not (_scalar(bc2_sqrt.args[0], pow2, 1) and _is(pow2, aten.pow.Scalar) and _scalar(pow2, b2, step)):
        return None
    ops = [mul_b2, addcmul, sqrt, div_t, add_eps, lerp, div_l, mul_step, sub]
    scalars = [pow1, step_size.args[1], step_size, pow2, bc2_sqrt.args[0], bc2_sqrt]
    params = list(a_list)
    if decoupled and wd:      # p * (1 - lr * wd) first
        decay_op = _items(a_list, n)
        if not _is(decay_op, aten._foreach_mul.Tensor):
            return None
        decay = decay_op.args[1]
        if not (_is(decay, aten.rsub.Scalar) and _is(decay.args[0], aten.mul.Tensor)
                and _scalar(decay, decay.args[0], 1) and _scalar(decay.args[0], lr, wd)):
            return None
        params = list(decay_op.args[0])
        ops.insert(0, decay_op)
        scalars += [decay.args[0], decay]
    elif not decoupled and wd:   # g + wd * p
        add_wd = _items(grads, n)
        if not (_is(add_wd, aten._foreach_add.List) and list(add_wd.args[1]) == params
                and add_wd.kwargs.get("alpha") == wd and len(add_wd.args) == 2):
            return None
        grads = list(add_wd.args[0])
        ops.insert(0, add_wd)
    if not (isinstance(lr, torch.fx.Node) and isinstance(step, torch.fx.Node)):
        return None
    return AdamChain(decoupled, params, grads, exp_avgs, exp_avg_sqs, lr, step, dict(hyper), sub,
                     {"param": sub, "exp_avg": lerp, "exp_avg_sq": addcmul}, ops, scalars)


def hyper_of(cfg: dict) -> tuple:
    """(hyperparameters, decoupled) from ``Plan.optimizer`` (``fxpar.optim.OptimizerSpec.adam_hyper``)."""
    return dict(cfg["hyper"]), cfg.get("name") == "AdamW"


def find_adam_chains(gm, cfg: dict) -> list:
    """Every traced Adam/AdamW chain of ``gm`` (``cfg``: ``Plan.optimizer``), in graph order."""
    hyper, decoupled = hyper_of(cfg)
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == aten._foreach_sub.List and M.get(n, M.PHASE) == "optimizer":
            c = _match(n, hyper, decoupled)
            if c is not None:
                out.append(c)
    return out


def _dead_view(n) -> bool:
    """A view nobody reads, through views (capture leaves a dead ``detach`` per optimizer result)."""
    return is_alias(n) and all(_dead_view(u) for u in n.users)


def _erase_dead_views(g, n) -> None:
    for u in list(n.users):
        _erase_dead_views(g, u)
        g.erase_node(u)


def _contiguous(x) -> bool:
    """Whether ``x``'s traced value is contiguous. ATen's CPU fused kernel walks each tensor's memory in order,
    whatever its strides: a transposed gradient beside a contiguous parameter gets the wrong elements paired."""
    v = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    return isinstance(v, torch.Tensor) and v.is_contiguous()


def _copied(c: AdamChain, pos: dict, out_node) -> dict:
    """``{list position: why}`` of the parameters and moments the fused call must not write in place, so it
    updates a copy of them instead: not the runtime's own buffer (a placeholder of role param / opt_state: ZeRO-1/2
    update a chunk the runtime cuts out of the whole parameter), not contiguous (:func:`_contiguous`), returned as
    is, read (or a view of it read) after the update, or listed twice. Positions count over params + exp_avgs +
    exp_avg_sqs."""
    chain = set(c.ops)
    at = pos[c.last]
    nodes = list(pos)
    bufs = c.params + c.exp_avgs + c.exp_avg_sqs
    returned = set(out_node.args[0]) if isinstance(out_node.args[0], (list, tuple)) else {out_node.args[0]}
    out, seen = {}, set(c.grads)
    for i, x in enumerate(bufs):
        if not (isinstance(x, torch.fx.Node) and x.op == "placeholder" and M.get(x, M.ROLE) in OWNED_ROLES):
            out[i] = "not a parameter or optimizer-state input"
        elif not _contiguous(x):
            out[i] = "not contiguous"
        elif x in returned:
            out[i] = "returned as is"
        elif x in seen:
            out[i] = "listed twice"
        else:
            last = last_read(x, pos, chain)
            if last > at:
                out[i] = f"{nodes[last].name} reads it after the update"
        seen.add(x)
    return out


def _why_not_fused(c: AdamChain, pos: dict) -> str:
    """Why the chain cannot become one call ('' if it can): its intermediate values are read by the chain alone
    and its new values only after the update, where the fused call puts them."""
    chain = set(c.ops)
    at = pos[c.last]
    results = set(c.results.values())
    for op in c.ops:
        for g in op.users:
            if g.target is not operator.getitem:
                return f"{g.name} reads the whole list {op.name}"
            for u in g.users:
                if u in chain or _dead_view(u):
                    continue
                if op not in results:
                    return f"{u.name} reads {g.name}, an intermediate of the update"
                if pos[u] < at:
                    return f"{u.name} reads {g.name} before the update ends"
    return ""


def fuse_adam(gm, cfg: dict) -> tuple:
    """Rewrite every traced Adam/AdamW chain of ``gm`` into one fused in-place call. ``cfg``: ``Plan.optimizer``
    (its ``name`` and ``hyper``). The call writes into the parameter and moment buffers where the update may
    (:func:`_copied`), into a copy of them where not (one ``clone`` each: still one pass over memory against the
    chain's ten). Returns (fused, notes): a note per chain left as list ops, and one per tensor copied."""
    g = gm.graph
    chains = find_adam_chains(gm, cfg)
    if not chains:
        return 0, []
    pos = {n: i for i, n in enumerate(g.nodes)}
    out_node = g.find_nodes(op="output")[0]
    fused, notes = 0, []
    for c in chains:
        reason = _why_not_fused(c, pos)
        if reason:
            notes.append(f"{c.last.name}: left as foreach ops: {reason}")
            continue
        copied = _copied(c, pos, out_node)
        bufs = c.params + c.exp_avgs + c.exp_avg_sqs
        grads = list(c.grads)

        def copy_of(x):                # a contiguous copy (the kernel ignores strides)
            cl = g.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
            cl.meta.update({k: v for k, v in c.last.meta.items() if k in (M.PHASE.name, M.MODULE.name)})
            if isinstance(x.meta.get("val"), torch.Tensor):
                cl.meta["val"] = x.meta["val"].clone(memory_format=torch.contiguous_format)
            return cl
        with g.inserting_before(c.last):
            for i, why in copied.items():
                notes.append(f"{c.last.name}: updates a copy of {bufs[i].name} ({why})")
                bufs[i] = copy_of(bufs[i])
            for i, x in enumerate(grads):
                if not _contiguous(x):
                    notes.append(f"{c.last.name}: reads a contiguous copy of gradient {x.name}")
                    grads[i] = copy_of(x)
        n = len(c.params)
        params, exp_avgs, exp_avg_sqs = bufs[:n], bufs[n:2 * n], bufs[2 * n:]
        op = (aten._fused_adamw_ if c.decoupled else aten._fused_adam_).tensor_lr
        h = c.hyper
        with g.inserting_before(c.last):
            m = g.call_function(op, (list(params), grads, list(exp_avgs), list(exp_avg_sqs), [],
                                     [c.step] * n),
                                {"lr": c.lr, "beta1": h["beta1"], "beta2": h["beta2"], "weight_decay": h["weight_decay"],
                                 "eps": h["eps"], "amsgrad": False, "maximize": False})
        m.meta.update({k: v for k, v in c.last.meta.items() if k in (M.PHASE.name, M.MODULE.name)})
        m.meta["val"] = None
        for what, lst in (("param", params), ("exp_avg", exp_avgs), ("exp_avg_sq", exp_avg_sqs)):
            for gi in list(c.results[what].users):
                gi.replace_all_uses_with(lst[gi.args[1]])
        for op_node in reversed(c.ops):                 # consumers first: each op's getitems, then the op
            for gi in list(op_node.users):
                _erase_dead_views(g, gi)
                g.erase_node(gi)
            g.erase_node(op_node)
        for x in reversed(c.scalars):                   # what only the chain read (chains cut per bucket share them)
            if not x.users:
                g.erase_node(x)
        fused += 1
        pos = {x: i for i, x in enumerate(g.nodes)}
    if fused:
        gm.recompile()
    return fused, notes


def fused_chain_times(gm, times: dict, device, cfg: dict) -> dict:
    """``times`` (``cost_models.compute.graph_compute(gm).times``) as the program will run where it fuses: each
    chain's list ops cost one fused call (``cost_models.compute``'s rule for ``_fused_adamw_``), booked on its last
    op. For planning on the captured (functional) graph before the passes fuse it."""
    times = dict(times)
    for c in find_adam_chains(gm, cfg):
        vals = [x.meta.get("val") for x in c.params]
        if any(v is None for v in vals):
            continue
        for op in c.ops:
            times[op] = 0.0
        flops, nbytes = fused_adam_cost(vals)
        times[c.last] = node_time(OpCost(flops, nbytes, "elementwise", "table"), device) + \
            getattr(device, "op_overhead_s", 0.0)
    return times
