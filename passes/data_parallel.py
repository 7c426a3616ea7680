"""Data parallelism: average gradients over the dp axis; keep buffers in step like DDP.

Each dp rank traces and runs the step on its shard of the global batch (the runtime slices
the batch, the graph is traced at the shard's shape). With a mean-reduced loss over equal
shards, the global-batch gradient is the mean of the shards' gradients, so this pass puts one
``all_reduce(sum)`` and a division by dp behind every gradient. Before / after::

    mm_5 = aten.mm(t_7, view_3)                       # grad of fc.weight  (fxpar_grad_of)
    sub_2 = aten.sub(fc_weight, mul_4 ... mm_5 ...)   # optimizer

    mm_5 = aten.mm(t_7, view_3)
    all_reduce = _c10d_functional.all_reduce(mm_5, 'sum', 'fxpar:dp')
    wait_tensor = _c10d_functional.wait_tensor(all_reduce)
    div = aten.div(wait_tensor, 2)
    sub_2 = aten.sub(fc_weight, mul_4 ... div ...)

``BucketGradients`` then fuses these per-gradient collectives into buckets.
"""
from __future__ import annotations

import torch

from fxpar import meta as M
from fxpar.collectives import insert_all_reduce, insert_broadcast
from fxpar.pass_manager import Pass, PassContext, PassResult

__all__ = ["DataParallelGradSync", "SyncBuffers"]


def grad_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if M.get(n, M.GRAD_OF) is not None]


class DataParallelGradSync(Pass):
    name = "data_parallel"

    def run(self, gm, ctx: PassContext) -> PassResult:
        dp = ctx.mesh.axis_size("dp")
        if dp == 1:
            return PassResult(gm, False)
        ranks = ctx.mesh.group(ctx.rank, "dp")
        g = gm.graph
        n_sync = 0
        for grad in grad_nodes(gm):
            users = list(grad.users)
            ar, w = insert_all_reduce(g, grad, "dp", ranks)
            with g.inserting_after(w):
                avg = g.call_function(torch.ops.aten.div.Tensor, (w, dp))
            avg.meta.update({"val": grad.meta.get("val"), M.PHASE.name: "backward",
                             M.MODULE.name: M.get(grad, M.MODULE, "")})
            M.set_meta(avg, M.GRAD_OF, M.get(grad, M.GRAD_OF))
            del grad.meta[M.GRAD_OF.name]          # the synchronised node is now the gradient
            for u in users:
                u.replace_input_with(grad, avg)
            n_sync += 1
        ctx.notes.append(f"data_parallel: {n_sync} gradients averaged over dp={dp} with all_reduce(sum)/dp")
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
