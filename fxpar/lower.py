"""Lowering: each stage's joint step graph → the graphs its schedule calls, by one list of passes.

The pipeline is one list, read top to bottom (:func:`default_passes`); it runs on every stage's
joint graph (forward, backward, optimizer) *before* the graph is cut, so a pass written for a
program without a pipeline works unchanged on every stage of a pipeline. The last pass,
``split_graphs``, cuts the joint graph by the tags the passes wrote into ``F``, ``B`` (or ``I`` and
``W``), ``REDUCE_GRAD`` and ``STEP`` -- or keeps it whole (``FULL``) for a one-stage,
one-microbatch program. Ranks holding the same stage share its graphs: collectives name their
group (``"fxpar:dp"``), and the runtime binds the name to each rank's process group.
"""
from __future__ import annotations

import copy

from . import meta as M
from ._tracing import gc_paused
from .feature import get_feature
from .pass_manager import HistoryEntry, PassContext, PassManager
from .roles import GraphKind
from passes import SplitGraphs

__all__ = ["default_passes", "lower", "graph_kinds"]


def graph_kinds(schedule, stage: int) -> tuple:
    """The graphs the schedule's actions on ``stage`` call (:class:`~fxpar.roles.GraphKind`), in order."""
    G = GraphKind
    kinds = {a.kind.value for acts in schedule.actions.values() for a in acts if a.stage == stage}
    if G.FULL in kinds:
        return (G.FULL,)
    out = ([G.UNSHARD] if G.UNSHARD in kinds else []) + [G.F] + ([G.I, G.W] if G.I in kinds else [G.B]) \
        + [G.REDUCE_GRAD, G.STEP]
    return tuple(out)


def default_passes(plan, custom: list, kinds: tuple) -> list:
    """The one pass list, read top to bottom: the enabled features' passes, each in its
    :class:`~fxpar.feature.Slot` (in registration order within a slot; the slots say why each sits where it
    does), the user's passes, and the split last."""
    pipeline = []
    for name, section in plan.features.items():      # the enabled features' passes, each in its slot
        pipeline += get_feature(name).make_passes(section)
    taken = {n for name, section in plan.features.items() for n in get_feature(name).replaces(section)}
    pipeline = [(slot, p) for slot, p in pipeline if p.name not in taken]   # passes another feature's passes replace
    pipeline = [p for _, p in sorted(pipeline, key=lambda sp: sp[0])]     # stable: registration order within a slot
    # The user's passes see the finished distributed graph, unless one declares ``before=(...)``
    # naming one of ours: then it goes just ahead of the earliest pass it names.
    for p in custom:
        names = [q.name for q in pipeline]
        at = [names.index(b) for b in getattr(p, "before", ()) if b in names]
        pipeline.insert(min(at), p) if at else pipeline.append(p)
    pipeline.append(SplitGraphs(kinds))   # last: cut the joint graph into the graphs the schedule calls
    return pipeline


def lower(stages: list, plan, schedule, cluster, custom_passes: list, keep_history: bool = True):
    """``stages``: the captured joint step of each stage (``fxpar.capture.CapturedStep``). Returns, per stage,
    ``(split graphs {kind: SplitGraph}, joint graph after the passes, history, explain() notes)``. The garbage
    collector is held off throughout (the copy of each captured graph, the passes, the cut graphs:
    ``fxpar._tracing.gc_paused``)."""
    with gc_paused():
        return _lower(stages, plan, schedule, cluster, custom_passes, keep_history)


def _lower(stages: list, plan, schedule, cluster, custom_passes: list, keep_history: bool) -> list:
    out = []
    for s, captured in enumerate(stages):
        kinds = graph_kinds(schedule, s)
        gm = copy.deepcopy(captured.gm)
        gm.meta[M.SIGNATURE.name] = captured.signature.copy()
        gm.meta[M.OPTIMIZER.name] = dict(plan.optimizer or {})   # graphs cut later update as the plan says
        pm = PassManager(default_passes(plan, custom_passes, kinds), keep_history=keep_history)
        rank = plan.stage_to_rank[s][0] * plan.width        # the stage's first holder stands for all its holders
        ctx = PassContext(plan=plan, cluster=cluster, mesh=plan.mesh, rank=rank, stage=s,
                          signature=gm.meta[M.SIGNATURE.name], captured=captured,
                          kinds=kinds)                      # the graphs the split will cut (passes read it)
        gm, hist = pm.run(gm, ctx)
        parts = ctx.split
        for name, section in plan.features.items():      # graphs a feature derives from the cut ones
            parts = get_feature(name).after_split(section, parts, gm, ctx)
        for h in hist:
            h.info = {**h.info, "stage": s}
        if keep_history and kinds != (GraphKind.FULL,):
            hist += [HistoryEntry(f"split_graphs:{k}", True, 0.0, len(p.gm.graph.nodes), p.gm.code,
                                  {"stage": s, "inputs": p.inputs, "outputs": p.outputs}) for k, p in parts.items()]
        out.append((parts, gm, hist, ctx.notes))
    return out
