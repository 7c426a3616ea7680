"""Lowering: the captured step graph → one graph per rank, by the passes the Plan calls for.

The pipeline is one list, read top to bottom. Ranks whose graphs can only differ in which
process group a collective uses (Plan.structural_key) share one lowered graph.
"""
from __future__ import annotations

import copy

from .pass_manager import PassContext, PassManager

__all__ = ["default_passes", "lower"]


def default_passes(plan, custom: list) -> list:
    from passes import BucketGradients, DataParallelGradSync, ReinplaceOptimizer, SyncBuffers  # fxpar reaches passes only here
    pipeline = []
    if plan.dp > 1:
        pipeline += [
            DataParallelGradSync(),  # gradients of a batch shard are partial: average them over dp
            BucketGradients(),       # fuse those all_reduces into DDP-style buckets, issued as backward produces them
            SyncBuffers(),           # buffers (BatchNorm stats) follow dp-rank 0, as DDP's broadcast_buffers
        ]
    if plan.optimizer.get("traced"):
        pipeline.append(ReinplaceOptimizer())   # write the update into the parameter/state buffers, as torch.optim does
    # The user's passes see the finished distributed graph, unless one declares ``before=(...)``
    # naming one of ours: then it goes just ahead of the earliest pass it names.
    for p in custom:
        names = [q.name for q in pipeline]
        at = [names.index(b) for b in getattr(p, "before", ()) if b in names]
        pipeline.insert(min(at), p) if at else pipeline.append(p)
    return pipeline


def lower(captured, plan, cluster, custom_passes: list, ranks=None, keep_history: bool = True):
    """Returns ``(graphs, histories, notes)``: per rank, the lowered GraphModule, the pass history, and
    explain() lines."""
    mesh = plan.mesh
    ranks = range(mesh.size) if ranks is None else ranks
    pm = PassManager(default_passes(plan, custom_passes), keep_history=keep_history)
    by_key, graphs, histories, notes = {}, {}, {}, {}
    for r in ranks:
        key = plan.structural_key(r)
        if key not in by_key:
            gm = copy.deepcopy(captured.gm) if pm.passes else captured.gm
            gm.meta["fxpar_signature"] = captured.signature.copy()
            ctx = PassContext(plan=plan, cluster=cluster, mesh=mesh, rank=r, signature=gm.meta["fxpar_signature"],
                              captured=captured)
            gm, hist = pm.run(gm, ctx)
            by_key[key] = (gm, hist, ctx.notes)
        graphs[r], histories[r], notes[r] = by_key[key]
    return graphs, histories, notes
