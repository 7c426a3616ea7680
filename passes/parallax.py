"""Parallax's sparse/dense split of gradient synchronisation (Kim et al., EuroSys'19).

An embedding's gradient touches only the rows of the tokens in the batch. Parallax sends such *sparse*
gradients as (row index, values) pairs and all-reduces the *dense* rest; the choice per variable comes
from the traffic each route costs per worker (Parallax §3, w = row width, V = rows, u = rows touched):

    sparse (push the touched rows, pull them back):  2 · u · w
    dense  (ring all-reduce of the whole variable):  2 (N-1)/N · V · w

:func:`classify` decides it per gradient from the captured graph (``u`` is bounded by the tokens of the
rank's batch, the only static bound), the planner records it (``Plan.grad_sync``), and the pass carries
it out. The sparse route here has no separate server processes: every rank all-gathers every rank's
(index, per-token row) pairs and sums them into the gradient with ``index_add`` -- each rank acts as the
server of the whole variable. Dense gradients stay in the DDP-style buckets. Before / after::

    embedding_dense_backward = embedding_dense_backward(grad_out, idx, 1000, -1, False)   # [1000, 16]
    all_reduce = all_reduce(embedding_dense_backward, 'sum', 'fxpar:dp'); wait = wait_tensor(all_reduce)

    ids = reshape(idx, [-1]); rows = reshape(grad_out, [-1, 16])                        # [T], [T, 16]
    a = all_gather_into_tensor(ids, 2, 'fxpar:dp'); r = all_gather_into_tensor(rows, 2, 'fxpar:dp')
    grad = index_add(new_zeros(rows, [1000, 16]), 0, wait_tensor(a), wait_tensor(r))
"""
from __future__ import annotations

import torch

from fxpar import meta as M
from fxpar.collectives import C10D, group_tag
from fxpar.pass_manager import Pass, PassContext, PassResult

from .bucket import _chains

__all__ = ["classify", "SparseGradSync"]

aten = torch.ops.aten
_EDB = aten.embedding_dense_backward.default


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


class SparseGradSync(Pass):
    """Carry out ``Plan.grad_sync["sparse"]``: those gradients travel as (row index, row) pairs."""
    name = "parallax"
    requires = ("data_parallel",)

    def run(self, gm, ctx: PassContext) -> PassResult:
        gs = ctx.plan.grad_sync or {}
        keys = gs.get("sparse", []) if gs.get("method") == "parallax" else []
        if not keys:
            return PassResult(gm, False)
        g = gm.graph
        n = ctx.plan.dp
        ranks = ctx.plan.group_of("dp", ctx.rank)
        chains = _chains(gm)
        for key in keys:
            raw, ar, wt, avg = chains[key]
            edb = _embedding_grad(raw)
            grad_out, idx, rows_n = edb.args[0], edb.args[1], int(edb.args[2])
            gv, iv = grad_out.meta["val"], idx.meta["val"]
            w = gv.shape[-1]
            t = iv.numel()
            mod = M.get(edb, M.MODULE, "")

            def meta(x, v, mod=mod):
                x.meta.update({"val": v, M.PHASE.name: "backward", M.MODULE.name: mod})
            with g.inserting_before(ar):
                ids = g.call_function(aten.reshape.default, (idx, [-1]))
                rows = g.call_function(aten.reshape.default, (grad_out, [-1, w]))
                if avg is not wt:                               # backward's seed was not scaled by 1/dp
                    rows = g.call_function(aten.div.Tensor, (rows, n))
                a = g.call_function(C10D.all_gather_into_tensor.default, (ids, n, group_tag("dp")))
                r = g.call_function(C10D.all_gather_into_tensor.default, (rows, n, group_tag("dp")))
                wa = g.call_function(C10D.wait_tensor.default, (a,))
                wr = g.call_function(C10D.wait_tensor.default, (r,))
                zeros = g.call_function(aten.new_zeros.default, (wr, [rows_n, w]))
                grad = g.call_function(aten.index_add.default, (zeros, 0, wa, wr))
            for x in (ids, a, wa):
                meta(x, iv.new_empty([t * (n if x is not ids else 1)]))
            for x in (rows, r, wr):
                meta(x, gv.new_empty([t * (n if x is not rows else 1), w]))
            meta(zeros, gv.new_empty([rows_n, w]))
            meta(grad, gv.new_empty([rows_n, w]))
            meta(ids, iv.new_empty([t]))
            M.set_meta(a, M.COMM, M.CommInfo("all_gather", "dp", tuple(ranks), t * iv.element_size()))
            M.set_meta(r, M.COMM, M.CommInfo("all_gather", "dp", tuple(ranks), t * w * gv.element_size()))
            M.set_meta(grad, M.GRAD_OF, key)
            avg.replace_all_uses_with(grad)
            for dead in dict.fromkeys((avg, wt, ar)):
                g.erase_node(dead)
            for dead in dict.fromkeys((raw, edb)):
                if not dead.users and dead.op == "call_function":
                    g.erase_node(dead)
        from .zero import _one_in_flight        # gloo: one gather / reduce-scatter in flight (see passes/zero.py)
        _one_in_flight(g)
        g.lint()
        ctx.notes.append(f"parallax: {len(keys)} sparse gradient(s) {keys} sent as (row index, row) pairs; "
                         "the rest in all-reduce buckets")
        return PassResult(gm, True, {"sparse": len(keys)})
