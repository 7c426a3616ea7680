"""What a PipelineProgram shows besides its graphs: the lowering history and the communication of a rank.

``history``: per stage, the graph after each step of the pipeline lowering -- the traced forward + loss
(``trace_forward``), the stage cut out of it (``split_stages``), its forward and backward with the saved
tensors explicit (``differentiate_stage``) and its optimizer step (``trace_step``) -- as
:class:`fxpar.pass_manager.HistoryEntry`, like :meth:`fxpar.program.Program.history`.

``collectives``: everything rank R sends, receives and reduces in one step, in the order the runtime
(:mod:`.executor`) issues it, as :class:`fxpar.meta.CommInfo`: ``send``/``recv`` for each boundary message
(``ranks = (src, dst)``, bytes of the whole message), ``all_reduce`` for ``SYNC s`` (over stage s's replicas,
axis ``pp``), for data parallelism (over the dp replicas of the rank's stages, axis ``dp``) and for a tied
parameter (over the ranks holding the stages that use it, axis ``pp``).
"""
from __future__ import annotations

import torch

from ..meta import CommInfo
from ..pass_manager import HistoryEntry
from ..schedule.ir import ActionKind

__all__ = ["stage_history", "rank_collectives"]

_K = ActionKind


def stage_history(trace_gm, split_stage, sp, seconds: dict) -> list:
    """The lowering of one stage, graph by graph. ``seconds``: step name -> wall seconds it took."""
    s = split_stage.index
    steps = [("trace_forward", trace_gm, {}),
             ("split_stages", split_stage.gm, {"stage": s, "inputs": list(split_stage.inputs),
                                               "outputs": list(split_stage.outputs)}),
             ("differentiate_stage:forward", sp.forward, {"stage": s, "saved": sp.n_saved,
                                                          "saved_bytes": sp.saved_bytes}),
             ("differentiate_stage:backward", sp.backward, {"stage": s})]
    if sp.step is not None:
        steps.append(("trace_step", sp.step, {"stage": s}))
    return [HistoryEntry(name, True, seconds.get(name, 0.0), len(gm.graph.nodes), gm.code, info)
            for name, gm, info in steps]


def _nbytes(metas) -> int:
    return sum(int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size() for shape, dt in metas)


def _message_bytes(sp, kind) -> int:
    """Bytes of one boundary message, as the executor sends and receives it."""
    if kind == _K.SEND_F:
        return _nbytes(sp.output_meta)
    if kind == _K.RECV_F:
        return _nbytes([sp.input_meta[j] for j, (r, _) in enumerate(sp.inputs) if r == "act"])
    if kind == _K.SEND_B:
        return _nbytes([sp.input_meta[j] for j in sp.diff_inputs if sp.inputs[j][0] != "param"])
    return _nbytes([sp.output_meta[j] for j in sp.diff_outputs])


def rank_collectives(program, rank: int) -> list:
    """Rank ``rank``'s communication in one step, in issue order (see the module docstring)."""
    pr, d = program._pipe(rank)
    dp = program.dp
    g = lambda r: r * dp + d                # noqa: E731 - pipeline rank -> global rank
    sched = program.pipe_schedule
    stage_bytes = {s: sum(program._params[k].numel() * program._params[k].element_size() for k in sp.param_keys)
                   for s, sp in enumerate(program.stages)}
    held = sched.rank_stages(pr)
    out, synced = [], False
    for a in sched.actions[pr]:
        sp = program.stages[a.stage]
        if a.kind in (_K.SEND_F, _K.SEND_B):
            out.append(CommInfo("send", "pp", (rank, g(a.peer)), _message_bytes(sp, a.kind)))
        elif a.kind in (_K.RECV_F, _K.RECV_B):
            out.append(CommInfo("recv", "pp", (g(a.peer), rank), _message_bytes(sp, a.kind)))
        elif a.kind == _K.SYNC:
            ranks = tuple(sorted(g(r) for r in sched.stage_to_rank[a.stage]))
            if len(ranks) > 1:
                out.append(CommInfo("all_reduce", "pp", ranks, stage_bytes[a.stage]))
        elif a.kind == _K.STEP and a.version is not None:      # asynchronous: this stage over dp, each STEP
            if dp > 1:
                out.append(CommInfo("all_reduce", "dp", tuple(pr * dp + i for i in range(dp)), stage_bytes[a.stage]))
        elif a.kind == _K.STEP and not synced:                 # synchronous: once, before the first STEP
            synced = True
            if dp > 1:
                out += [CommInfo("all_reduce", "dp", tuple(pr * dp + i for i in range(dp)), stage_bytes[s])
                        for s in sorted(held)]
            for key in sorted(program.split.shared_params):
                stages = program.split.shared_params[key]
                holders = sorted({r for s in stages for r in sched.stage_to_rank[s]})
                if any(s in held for s in stages) and len(holders) > 1:
                    p = program._params[key]
                    out.append(CommInfo("all_reduce", "pp", tuple(g(r) for r in holders), p.numel() * p.element_size()))
    return out
