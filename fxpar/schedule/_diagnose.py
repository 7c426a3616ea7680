"""Explain a deadlock: for each stuck rank, the step, the action, and why it can never run."""
from __future__ import annotations

from fxpar.schedule.exceptions import ScheduleDeadlockError
from fxpar.schedule.ir import Action, ActionKind, Schedule

__all__ = ["deadlock_error"]

_K = ActionKind


def _find(schedule: Schedule, rank: int, pred, after: int = 0) -> int | None:
    for j, a in enumerate(schedule.actions.get(rank, [])):
        if j >= after and pred(a):
            return j
    return None


def _where(schedule: Schedule, ptr: dict[int, int], rank: int) -> str:
    acts = schedule.actions.get(rank)
    if acts is None:
        return f"rank {rank} does not exist"
    if ptr[rank] >= len(acts):
        return f"rank {rank} has finished"
    return f"rank {rank} is stuck at step {ptr[rank]} on {acts[ptr[rank]].short()}"


def _reason(schedule: Schedule, ptr: dict[int, int], r: int, a: Action, blocking: bool) -> str:
    s, i = a.stage, a.microbatch
    here = ptr[r]
    if a.kind in (_K.RECV_F, _K.RECV_B):
        src = a.peer
        want = _K.SEND_F if a.kind == _K.RECV_F else _K.SEND_B
        ps = s - 1 if a.kind == _K.RECV_F else s + 1
        j = _find(schedule, src, lambda b: b.kind == want and b.stage == ps and b.microbatch == i and b.peer == r)
        send = Action(src, want, ps, i, r).short()
        if j is None:
            return f"but rank {src} never sends it ({send} is not in rank {src}'s list)"
        return f"but rank {src} sends it ({send}) only at step {j}, and {_where(schedule, ptr, src)}"
    if a.kind in (_K.SEND_F, _K.SEND_B) and blocking and a.peer in schedule.actions:
        d = a.peer
        want = _K.RECV_F if a.kind == _K.SEND_F else _K.RECV_B
        rs = s + 1 if a.kind == _K.SEND_F else s - 1
        j = _find(schedule, d, lambda b: b.kind == want and b.stage == rs and b.microbatch == i and b.peer == r)
        recv = Action(d, want, rs, i, r).short()
        if j is None:
            return f"(a blocking send) but rank {d} never receives it ({recv} is not in its list)"
        return f"(a blocking send) until rank {d} posts {recv} at its step {j}, but {_where(schedule, ptr, d)}"
    if a.kind == _K.REDUCE_GRAD:
        members = schedule.stage_to_rank.get(s, (r,))
        others = [q for q in members if q != r and not (ptr.get(q, 0) < len(schedule.actions.get(q, []))
                                                         and schedule.actions[q][ptr[q]] == Action(q, a.kind, s))]
        return "for the other holders of stage %d: %s" % (s, "; ".join(_where(schedule, ptr, q) for q in others))
    # compute or a send waiting on local data
    mine = schedule.actions[r]
    if a.kind == _K.F:
        need, what = Action(r, _K.F, s - 1, i), f"the activations of stage {s - 1} microbatch {i}"
        recv = Action(r, _K.RECV_F, s, i, 0).short()[:-1] + "<SRC"
    elif a.kind in (_K.B, _K.I, _K.W):
        pre = _K.I if a.kind == _K.W else _K.F
        if not any(b.kind == pre and b.stage == s and b.microbatch == i for b in mine[:here]):
            j = _find(schedule, r, lambda b: b.kind == pre and b.stage == s and b.microbatch == i)
            role = "input-gradient half" if pre == _K.I else "forward"
            return (f"but its {role} {pre.value}{s}.{i} is never run on rank {r}" if j is None else
                    f"but its {role} {pre.value}{s}.{i} comes later, at step {j} of rank {r}")
        if a.kind == _K.W:
            return f"after I{s}.{i}, which ran: this should not block (report it as a simulator bug)"
        need, what = Action(r, _K.B, s + 1, i), f"the gradients from stage {s + 1} microbatch {i}"
        recv = Action(r, _K.RECV_B, s, i, 0).short()[:-1] + "<SRC"
        j = _find(schedule, r, lambda b: b.kind in (_K.B, _K.I) and b.stage == s + 1 and b.microbatch == i)
        if j is not None:
            return f"for {what}, but rank {r} computes {mine[j].short()} only later, at step {j}"
        return f"for {what}, which rank {r} neither computes nor receives (no {recv} before it)"
    else:
        bases = (_K.F,) if a.kind == _K.SEND_F else (_K.B, _K.I)
        j = _find(schedule, r, lambda b: b.kind in bases and b.stage == s and b.microbatch == i)
        need = Action(r, bases[0], s, i)
        return (f"but rank {r} never computes {need.short()}" if j is None else
                f"but rank {r} computes {mine[j].short()} only later, at step {j}")
    j = _find(schedule, r, lambda b: b.kind == need.kind and b.stage == need.stage and b.microbatch == i)
    if j is not None:
        return f"for {what}, but rank {r} computes {need.short()} only later, at step {j}"
    return f"for {what}, which rank {r} neither computes nor receives (no {recv} before it)"


def deadlock_error(schedule: Schedule, ptr: dict[int, int], blocking: bool) -> ScheduleDeadlockError:
    stuck = {}
    lines = []
    for r in sorted(schedule.actions):
        if ptr[r] < len(schedule.actions[r]):
            a = schedule.actions[r][ptr[r]]
            why = _reason(schedule, ptr, r, a, blocking)
            stuck[r] = (ptr[r], a, why)
            lines.append(f"rank {r} waits at step {ptr[r]} on {a.short()} {why}")
    step = min(st for st, _, _ in stuck.values())
    msg = (f"schedule '{schedule.name}' deadlocks at step {step}: ranks {sorted(stuck)} can never go on.\n  "
           + "\n  ".join(lines)
           + ("\nWith blocking sends every SEND must meet its RECV at the same point on both ranks: reorder, "
              "or run with asynchronous sends (isend), the default semantics." if blocking else
              "\nFix the order so each RECV's SEND comes before anything that waits on this rank "
              "(check with fxpar.schedule.validate, then simulate)."))
    return ScheduleDeadlockError(msg, stuck)
