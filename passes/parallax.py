"""Parallax's sparse/dense split of gradient synchronisation (Kim et al., EuroSys'19).

An embedding's gradient touches only the rows of the tokens in the batch. Parallax sends such *sparse*
gradients as (row index, values) pairs and all-reduces the *dense* rest; the choice per variable comes
from the traffic each route costs per worker (Parallax §3, w = row width, V = rows, u = rows touched):

    sparse (push the touched rows, pull them back):  2 · u · w
    dense  (ring all-reduce of the whole variable):  2 (N-1)/N · V · w

:func:`classify` decides it per gradient from the captured graph (``u`` is bounded by the tokens of the
rank's batch, the only static bound), the planner records it (``Plan.section("parallax")``), and the pass carries
it out. The sparse route here has no separate server processes: every rank all-gathers every rank's
(index, per-token row) pairs and sums them into the gradient with ``index_add`` -- each rank acts as the
server of the whole variable. Dense gradients stay in the DDP-style buckets. Before / after::

    embedding_dense_backward = embedding_dense_backward(grad_out, idx, 1000, -1, False)   # [1000, 16]
    all_reduce = all_reduce(embedding_dense_backward, 'sum', 'fxpar:dp'); wait = wait_tensor(all_reduce)

    ids = reshape(idx, [-1]); rows = reshape(grad_out, [-1])                            # [T], [T*16]
    packed = cat([view(ids, uint8), view(rows, uint8)])       # one rank's pairs as bytes: T*8 + T*16*4
    a = all_gather_into_tensor(packed, 2, 'fxpar:dp'); per = view(wait_tensor(a), [2, -1])
    wa = view(view(clone(per[:, :T*8]), int64), [2*T]); wr = view(view(clone(per[:, T*8:]), float32), [2*T, 16])
    grad = index_add(new_zeros(wr, [1000, 16]), 0, wa, wr)

One all-gather carries both halves of every pair (a step pays each collective's latency once, and on a
2-core machine a small one costs 0.4-1.5 ms back to back: more than the bytes).

The update then goes one of two ways (:func:`update_routes` decides, the planner records it in
``Plan.section("parallax").sparse_update``). Where the traced optimizer's update of the parameter is linear in the
gradient and leaves a row with zero gradient unchanged -- plain SGD, ``p - lr * g``: no momentum, no weight
decay -- the pairs go straight into the touched rows and the dense gradient is never made (route ``rows``;
the parameter is cut out of the optimizer's ``_foreach_`` lists and its gradient is no longer a graph
output). Any other update (AdamW, SGD with momentum or weight decay, an eager optimizer, several
microbatches whose gradients the runtime sums densely) keeps the dense gradient above (route ``dense``).
Before / after, route ``rows``::

    _foreach_mul = _foreach_mul([grad, g_pos, ...], lr); _foreach_sub([emb, pos, ...], [_foreach_mul[0], ...])

    _foreach_mul = _foreach_mul([g_pos, ...], lr);       _foreach_sub([pos, ...], [_foreach_mul[0], ...])
    index_add_(emb, 0, wa, mul(wr, neg(lr)))                                  # only the gathered rows move
"""
from __future__ import annotations

import operator

import torch

from fxpar import meta as M
from fxpar.collectives import C10D, group_tag
from fxpar.errors import PassError
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.roles import GraphKind, Role

from .graph_utils import grad_sync_chains, is_alias, one_collective_in_flight

__all__ = ["classify", "update_routes", "SparseGradSync"]

aten = torch.ops.aten
_EDB = aten.embedding_dense_backward.default
_MUL, _SUB = aten._foreach_mul.Tensor, aten._foreach_sub.List


def _embedding_grad(raw):
    """The ``embedding_dense_backward`` that alone makes gradient ``raw`` (through views), or None."""
    x = raw
    while x.op == "call_function" and x.target in (aten.view.default, aten._unsafe_view.default,
                                                   aten.reshape.default):
        x = x.args[0]
    if x.op == "call_function" and x.target is _EDB:
        padding_idx, scale = x.args[3], x.args[4]
        if padding_idx == -1 and not scale:
            return x
    return None


def classify(gm, dp: int) -> dict:
    """Per gradient an embedding backward makes alone: its traffic on each route and the route chosen."""
    out = {}
    grads = {}
    for n in gm.graph.nodes:
        k = M.get(n, M.GRAD_OF)
        if k is not None and k not in grads:
            grads[k] = n
    for k, raw in grads.items():
        edb = _embedding_grad(raw)
        if edb is None:
            continue
        grad_out, idx, rows = edb.args[0], edb.args[1], int(edb.args[2])
        u = idx.meta["val"].numel()
        w = grad_out.meta["val"].shape[-1]
        b = grad_out.meta["val"].element_size()
        sparse_b = 2 * u * w * b
        dense_b = 2 * (dp - 1) / dp * rows * w * b
        out[k] = {"route": "sparse" if sparse_b < dense_b else "dense", "rows": rows, "touched_at_most": u,
                  "width": w, "sparse_bytes": sparse_b, "dense_bytes": dense_b}
    return out


def _spec_reason(spec) -> str:
    """Why the optimizer's update moves rows whose gradient is zero (or needs the dense gradient); '' if it does not."""
    if not spec.traced:
        return f"the optimizer runs eagerly on each rank ({spec.why_not_traced}) and reads a dense gradient"
    if spec.cls is not torch.optim.SGD:
        return (f"{spec.name} keeps per-row state ({', '.join(spec.state_names)}) that moves every row each step, "
                "zero gradient or not")
    for k, why in (("momentum", "the momentum buffer keeps moving rows whose gradient is zero"),
                   ("weight_decay", "every row decays each step")):
        if spec.hyper(k, 0):
            return f"SGD {k}={spec.hyper(k, 0)}: {why}"
    return ""


def _sgd_update(grad, param):
    """The traced plain-SGD update of one parameter, ``p - lr * g``: ``_foreach_mul(grads, lr)[i]`` read only by
    ``_foreach_sub(params, .)[i]`` with ``params[i]`` the parameter, which no other optimizer op reads.
    Returns ``(mul, sub, i)``, or a string saying which node breaks the pattern."""
    opt = [u for u in grad.users if M.get(u, M.PHASE) == "optimizer"]
    if len(opt) != 1 or opt[0].target is not _MUL:
        return f"the optimizer reads the gradient in {[u.name for u in opt]}, not one _foreach_mul by lr"
    mul = opt[0]
    grads, lr = mul.args[0], mul.args[1]
    if not isinstance(lr, torch.fx.Node) or M.get(lr, M.ROLE) != Role.LR or list(grads).count(grad) != 1:
        return f"{mul.name} scales the gradient by {getattr(lr, 'name', lr)}, not by the learning rate"
    i = list(grads).index(grad)
    scaled = [u for u in mul.users if u.target is operator.getitem and u.args[1] == i]
    subs = [u for x in scaled for u in x.users]
    if len(scaled) != 1 or len(subs) != 1 or subs[0].target is not _SUB:
        return f"lr * gradient ({mul.name}[{i}]) is read by {[u.name for u in subs]}, not by one _foreach_sub"
    sub = subs[0]
    if sub.args[0][i] is not param or sub.args[1][i] is not scaled[0]:
        return f"{sub.name} does not subtract lr * gradient from {param.name}"
    other = [u.name for u in param.users if M.get(u, M.PHASE) == "optimizer" and u is not sub]
    if other:
        return f"the optimizer also reads {param.name} in {other}"
    return mul, sub, i


def _param_node(gm, key):
    return next(n for n in gm.graph.find_nodes(op="placeholder")
                if M.get(n, M.ROLE) == Role.PARAM and M.get(n, M.PARAM) == key)


def update_routes(gm, spec, keys, microbatches: int) -> dict:
    """Per sparse gradient ``key``: ``{"route": "rows" | "dense", "why": ...}`` -- whether its update can go
    straight into the touched rows (module docstring). ``gm``: the captured joint step; ``spec``: its
    ``OptimizerSpec``."""
    grads = {}
    for n in gm.graph.nodes:
        k = M.get(n, M.GRAD_OF)
        if k in keys and k not in grads:
            grads[k] = n
    out = {}
    for k in keys:
        why = _spec_reason(spec)
        if not why and microbatches > 1:
            why = (f"microbatches={microbatches}: the runtime sums each microbatch's gradient as a dense tensor "
                   "before the update")
        if not why:
            found = _sgd_update(grads[k], _param_node(gm, k))
            why = "" if isinstance(found, tuple) else f"the traced update is not p - lr * g: {found}"
        out[k] = ({"route": "dense", "why": why} if why else
                  {"route": "rows", "why": "plain SGD (p - lr * g) leaves a row with zero gradient unchanged: the "
                                          "gathered rows are subtracted from the touched rows, no dense gradient"})
    return out


def _drop_element(g, n, i) -> None:
    """Rebuild the ``_foreach_`` op ``n`` without element ``i`` of its lists (an element-wise op: the others keep
    their values bit for bit); its ``getitem`` users follow their element. ``getitem(n, i)`` must be unread."""
    for u in list(n.users):
        if u.args[1] == i:
            g.erase_node(u)
    lists = [j for j, a in enumerate(n.args) if isinstance(a, (list, tuple))]
    if len(n.args[lists[0]]) == 1:
        g.erase_node(n)
        return
    args = tuple([x for k, x in enumerate(a) if k != i] if j in lists else a for j, a in enumerate(n.args))
    with g.inserting_before(n):
        m = g.call_function(n.target, args, dict(n.kwargs))
    m.meta.update({k: v for k, v in n.meta.items() if k != "val"})
    if isinstance(n.meta.get("val"), (list, tuple)):
        m.meta["val"] = [v for k, v in enumerate(n.meta["val"]) if k != i]
    for u in list(n.users):
        u.args = (m, u.args[1] - (u.args[1] > i))
    g.erase_node(n)


def _meta(x, v, mod, phase="backward"):
    x.meta.update({"val": v, M.PHASE.name: phase, M.MODULE.name: mod})


def _gather_pairs(g, chain, n, ranks):
    """Before the gradient's all-reduce: every rank's (row index, row) pairs, all-gathered in *one* collective
    (the ids' and the rows' bytes side by side in a uint8 buffer: a step pays each collective's latency and
    the ranks' skew once, and these are small). Returns the waited ids [n*T] and rows [n*T, w] (rows already
    carry the mean's 1/dp)."""
    raw, ar, wt, avg = chain
    edb = _embedding_grad(raw)
    grad_out, idx = edb.args[0], edb.args[1]
    gv, iv = grad_out.meta["val"], idx.meta["val"]
    w, t = gv.shape[-1], iv.numel()
    ib, rb = t * iv.element_size(), t * w * gv.element_size()       # bytes of one rank's ids, rows
    u8 = torch.uint8
    mod = M.get(edb, M.MODULE, "")
    made = []

    def op(target, args, val, **kwargs):
        x = g.call_function(target, args, kwargs)
        made.append((x, val))
        return x

    def flat(x, v, shape):           # 1-D with stride 1 (view(dtype) needs it): a copy only if x is strided
        if not v.is_contiguous():
            x = op(aten.clone.default, (x,), v.new_empty(v.shape), memory_format=torch.contiguous_format)
        return op(aten.reshape.default, (x, [-1]), v.new_empty(shape))

    with g.inserting_before(ar):
        ids = flat(idx, iv, [t])
        rows = flat(grad_out, gv, [t * w])
        if avg is not wt:                               # backward's seed was not scaled by 1/dp
            rows = op(aten.div.Tensor, (rows, n), gv.new_empty([t * w]))
        packed = op(aten.cat.default, ([op(aten.view.dtype, (ids, u8), iv.new_empty([ib], dtype=u8)),
                                        op(aten.view.dtype, (rows, u8), iv.new_empty([rb], dtype=u8))],),
                    iv.new_empty([ib + rb], dtype=u8))
        a = op(C10D.all_gather_into_tensor.default, (packed, n, group_tag("dp")), iv.new_empty([n * (ib + rb)], dtype=u8))
        got = op(C10D.wait_tensor.default, (a,), iv.new_empty([n * (ib + rb)], dtype=u8))
        per = op(aten.view.default, (got, [n, ib + rb]), iv.new_empty([n, ib + rb], dtype=u8))

        def part(lo, hi, like, shape):
            cut = op(aten.slice.Tensor, (per, 1, lo, hi), iv.new_empty([n, hi - lo], dtype=u8))
            dense = op(aten.clone.default, (cut,), iv.new_empty([n, hi - lo], dtype=u8))
            typed = op(aten.view.dtype, (dense, like.dtype), like.new_empty([n, (hi - lo) // like.element_size()]))
            return op(aten.view.default, (typed, shape), like.new_empty(shape))
        wa = part(0, ib, iv, [n * t])
        wr = part(ib, ib + rb, gv, [n * t, w])
    for x, v in made:
        _meta(x, v, mod)
    M.set_meta(a, M.COMM, M.CommInfo("all_gather", "dp", tuple(ranks), ib + rb))
    return wa, wr, mod


def _dense_grad(g, key, chain, wa, wr, mod):
    """Route ``dense``: the pairs summed into a [V, w] gradient, which the optimizer reads as before."""
    raw, ar, wt, avg = chain
    v = avg.meta["val"]
    with g.inserting_before(ar):
        zeros = g.call_function(aten.new_zeros.default, (wr, list(v.shape)))
        grad = g.call_function(aten.index_add.default, (zeros, 0, wa, wr))
    _meta(zeros, v.new_empty(v.shape), mod)
    _meta(grad, v.new_empty(v.shape), mod)
    M.set_meta(grad, M.GRAD_OF, key)
    avg.replace_all_uses_with(grad)


def _read_after(g, param, node, skip) -> list:
    """Nodes after ``node`` that read ``param`` or a view of it (an in-place write at ``node`` would change them)."""
    order = {x: j for j, x in enumerate(g.nodes)}
    late, stack, seen = [], [param], set()
    while stack:
        x = stack.pop()
        for u in x.users:
            if u.op == "output" or u in skip or u in seen:
                continue
            seen.add(u)
            if order[u] > order[node]:
                late.append(u.name)
            if is_alias(u):
                stack.append(u)
    return late


def _row_update(gm, ctx, key, chain, wa, wr, mod):
    """Route ``rows``: ``index_add_(p, 0, ids, -lr * rows)`` in place of the parameter's share of the
    optimizer's foreach ops; its gradient leaves the graph's outputs (nothing makes it any more)."""
    g, avg = gm.graph, chain[3]
    param = _param_node(gm, key)
    found = _sgd_update(avg, param)
    fix = (f"set Plan.section('parallax').sparse_update[{key!r}]['route'] to 'dense' (or set sparse_update to None "
           "and let the planner decide)")
    if isinstance(found, str):
        raise PassError(f"parallax: the plan updates {key} in its touched rows only, but {found}; {fix}, or train "
                        "with plain SGD (no momentum, no weight decay)")
    if tuple(ctx.kinds) != (GraphKind.FULL,):
        raise PassError(f"parallax: the plan updates {key} in its touched rows only, but this step is cut into "
                        f"{ctx.kinds} (microbatches > 1: the runtime sums the gradients densely); {fix}, or "
                        "use microbatches=1")
    mul, sub, i = found
    lr = mul.args[1]
    with g.inserting_before(sub):
        # -lr * rows added with alpha 1: ATen's CPU index_add_ takes a slower path per row for any other alpha
        # (4096 rows of 32 into a 200000-row table: 0.63 ms with alpha=-1, 0.19 ms with 1)
        neg = g.call_function(aten.neg.default, (lr,))
        scaled = g.call_function(aten.mul.Tensor, (wr, neg))
        upd = g.call_function(aten.index_add_.default, (param, 0, wa, scaled))
    _meta(neg, lr.meta["val"].new_empty(lr.meta["val"].shape), mod, "optimizer")
    _meta(scaled, wr.meta["val"].new_empty(wr.meta["val"].shape), mod, "optimizer")
    _meta(upd, param.meta["val"], mod, "optimizer")
    late = _read_after(g, param, upd, skip=(sub, upd))
    if late:
        raise PassError(f"parallax: {late} read {key} after its in-place row update; {fix}")
    for x in [u for u in sub.users if u.args[1] == i]:     # the new parameter is the parameter, updated in place
        x.replace_all_uses_with(param)
    _drop_element(g, sub, i)
    _drop_element(g, mul, i)
    sig = gm.meta[M.SIGNATURE.name]
    out = g.find_nodes(op="output")[0]
    keep = [j for j, rk in enumerate(sig.outputs) if tuple(rk) != (Role.GRAD, key)]
    out.args = (tuple(out.args[0][j] for j in keep),)
    sig.outputs = [sig.outputs[j] for j in keep]


class SparseGradSync(Pass):
    """Carry out ``Plan.section("parallax").sparse``: those gradients travel as (row index, row) pairs; each one's
    update follows its ``sparse_update`` (``rows``: into the touched rows; else dense)."""
    name = "parallax"
    requires = ("data_parallel",)

    def run(self, gm, ctx: PassContext) -> PassResult:
        section = ctx.plan.section("parallax")
        keys = list(section.sparse) if section is not None else []
        if not keys:
            return PassResult(gm, False)
        g = gm.graph
        n = ctx.plan.dp
        ranks = ctx.plan.group_of("dp", ctx.rank)
        chains = grad_sync_chains(gm)
        routes = {k: (section.sparse_update or {}).get(k, {}).get("route", "dense") for k in keys}
        for key in keys:
            chain = chains[key]
            wa, wr, mod = _gather_pairs(g, chain, n, ranks)
            if routes[key] == "rows":
                _row_update(gm, ctx, key, chain, wa, wr, mod)
            else:
                _dense_grad(g, key, chain, wa, wr, mod)
            raw, ar, wt, avg = chain
            edb = _embedding_grad(raw)
            for dead in dict.fromkeys((avg, wt, ar)):
                g.erase_node(dead)
            for dead in dict.fromkeys((raw, edb)):
                if not dead.users and dead.op == "call_function":
                    g.erase_node(dead)
        one_collective_in_flight(g)        # gloo: one gather / reduce-scatter in flight (see passes/graph_utils.py)
        g.lint()
        rows = [k for k in keys if routes[k] == "rows"]
        ctx.notes.append(f"parallax: {len(keys)} sparse gradient(s) {keys} sent as (row index, row) pairs; "
                         + (f"{rows} updated in the touched rows only (index_add_ of -lr * rows, no dense gradient); "
                            if rows else "")
                         + (f"{[k for k in keys if k not in rows]} summed into a dense gradient for the optimizer; "
                            if len(rows) < len(keys) else "")
                         + "the rest in all-reduce buckets")
        return PassResult(gm, True, {"sparse": len(keys), "rows": len(rows)})
