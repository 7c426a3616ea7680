"""Data parallelism: average gradients over the dp axis; keep buffers in step like DDP.

Each dp rank traces and runs the step on its shard of the global batch (the runtime slices
the batch, the graph is traced at the shard's shape). With a mean-reduced loss over equal
shards, the global-batch gradient is the mean of the shards' gradients, so this pass puts one
``all_reduce(sum)`` behind every gradient and divides by dp. The division costs nothing where
the graph seeds backward with ``ones_like(loss)`` (what capture produces): the seed becomes
``full_like(loss, 1/dp)``, so backward itself yields gradients already divided by dp, as DDP's
pre-division does (bitwise equal for dp a power of two; otherwise within rounding). Graphs
without that seed get an explicit ``div`` after the wait instead. Before / after (the
explicit form)::

    mm_5 = aten.mm(t_7, view_3)                       # grad of fc.weight  (fxpar_grad_of)
    sub_2 = aten.sub(fc_weight, mul_4 ... mm_5 ...)   # optimizer

    mm_5 = aten.mm(t_7, view_3)
    all_reduce = _c10d_functional.all_reduce(mm_5, 'sum', 'fxpar:dp')
    wait_tensor = _c10d_functional.wait_tensor(all_reduce)
    div = aten.div(wait_tensor, 2)
    sub_2 = aten.sub(fc_weight, mul_4 ... div ...)

With the seed scaled, ``div`` is absent and ``wait_tensor`` is the gradient
(``fxpar_grad_of``). ``BucketGradients`` then fuses these per-gradient collectives into buckets.
"""
from __future__ import annotations

import torch

from fxpar import meta as M
from fxpar.collectives import insert_all_reduce, insert_broadcast
from fxpar.pass_manager import Pass, PassContext, PassResult

__all__ = ["DataParallelGradSync", "SyncBuffers"]


def grad_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if M.get(n, M.GRAD_OF) is not None]


def loss_seed(gm) -> torch.fx.Node | None:
    """The ``ones_like(loss)`` that seeds backward, when there is exactly one (else None)."""
    sig = gm.meta.get("fxpar_signature")
    out = gm.graph.find_nodes(op="output")
    if sig is None or not out:
        return None
    try:
        (li,) = sig.index("loss", outputs=True)
    except (ValueError, KeyError, TypeError):
        return None
    loss = out[0].args[0][li]
    seeds = [u for u in getattr(loss, "users", {}) if u.op == "call_function"
             and u.target is torch.ops.aten.ones_like.default and M.get(u, M.PHASE) == "backward"]
    return seeds[0] if len(seeds) == 1 else None


def _prescale_seed(gm, dp: int) -> bool:
    """Seed backward with 1/dp instead of 1, so every gradient comes out divided by dp."""
    seed = loss_seed(gm)
    if seed is None:
        return False
    g = gm.graph
    with g.inserting_after(seed):
        new = g.call_function(torch.ops.aten.full_like.default, (seed.args[0], 1.0 / dp), dict(seed.kwargs))
    new.meta.update(seed.meta)
    seed.replace_all_uses_with(new)
    g.erase_node(seed)
    gm.meta["fxpar_grad_prescale"] = dp
    return True


class DataParallelGradSync(Pass):
    name = "data_parallel"

    def run(self, gm, ctx: PassContext) -> PassResult:
        dp = ctx.mesh.axis_size("dp")
        if dp == 1:
            return PassResult(gm, False)
        ranks = ctx.mesh.group(ctx.rank, "dp")
        g = gm.graph
        grads = grad_nodes(gm)
        prescaled = bool(grads) and _prescale_seed(gm, dp)
        n_sync = 0
        for grad in grads:
            users = list(grad.users)
            ar, w = insert_all_reduce(g, grad, "dp", ranks)
            if prescaled:
                avg = w
            else:
                with g.inserting_after(w):
                    avg = g.call_function(torch.ops.aten.div.Tensor, (w, dp))
                avg.meta.update({"val": grad.meta.get("val"), M.PHASE.name: "backward",
                                 M.MODULE.name: M.get(grad, M.MODULE, "")})
            M.set_meta(avg, M.GRAD_OF, M.get(grad, M.GRAD_OF))
            del grad.meta[M.GRAD_OF.name]          # the synchronised node is now the gradient
            for u in users:
                u.replace_input_with(grad, avg)
            n_sync += 1
        how = "backward seeded with 1/dp, then all_reduce(sum)" if prescaled else "all_reduce(sum)/dp"
        ctx.notes.append(f"data_parallel: {n_sync} gradients averaged over dp={dp} ({how})")
        return PassResult(gm, n_sync > 0, {"gradients": n_sync})


class SyncBuffers(Pass):
    """DDP's ``broadcast_buffers``: every dp rank leaves the step with dp-rank 0's buffers."""
    name = "sync_buffers"

    def run(self, gm, ctx: PassContext) -> PassResult:
        dp = ctx.mesh.axis_size("dp")
        if dp == 1 or not ctx.plan.broadcast_buffers:
            return PassResult(gm, False)
        sig = gm.meta["fxpar_signature"]
        out = gm.graph.find_nodes(op="output")[0]
        outs = list(out.args[0])
        ranks = ctx.mesh.group(ctx.rank, "dp")
        changed = 0
        for i in sig.index("new_buffer", outputs=True):
            node = outs[i]
            v = node.meta.get("val")
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                continue      # integer counters (num_batches_tracked) are equal on every rank
            # at the end of the step: buffers may be updated in place (batch norm) after they are made
            _, w = insert_broadcast(gm.graph, node, "dp", ranks, src=ranks[0], before=out)
            outs[i] = w
            changed += 1
        out.args = (tuple(outs),)
        if changed:
            ctx.notes.append(f"sync_buffers: {changed} floating buffers broadcast from dp-rank 0 after the step (DDP semantics)")
        return PassResult(gm, changed > 0, {"buffers": changed})
