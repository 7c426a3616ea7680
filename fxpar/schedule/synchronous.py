"""Synchronous schedules with a flush: the one-stage program, GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B.

All compute the gradient of the whole batch with one weight version (no ``@v`` on actions), reduce
each held stage's gradients with one ``RG s`` right after the rank's last backward of s, and end each
rank's list with one ``STEP`` per stage it holds. With uniform per-stage times
(every stage's F takes t_f, every B takes t_b, communication free) GPipe and 1F1B both idle
(p-1)(t_f+t_b) per rank, so the bubble fraction idle/(idle+busy) is (p-1)/(m+p-1) whatever the
ratio t_b/t_f (Huang et al. NeurIPS'19; Narayanan et al. SC'21 Sec. 2.2).

Example, ``one_f_one_b(2, 4)`` (``print(schedule.format_lists())``)::

    rank 0: F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 F0.2 SF0.2>1 RB0.1<1 B0.1 ... RB0.3<1 B0.3 RG0 STEP0
    rank 1: RF1.0<0 F1.0 B1.0 SB1.0>0 RF1.1<0 F1.1 B1.1 SB1.1>0 ... B1.3 SB1.3>0 RG1 STEP1

``single(1, 1)`` is ``rank 0: FULL0.0``; ``single(1, 3)`` is
``rank 0: F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 RG0 STEP0``.
"""
from __future__ import annotations

from fxpar.schedule._build import compute, finish
from fxpar.schedule.exceptions import ScheduleError
from fxpar.schedule.ir import Schedule

__all__ = ["single", "gpipe", "one_f_one_b", "interleaved", "check_pm", "too_few_microbatches", "one_f_one_b_lists"]


def check_pm(name: str, p: int, m: int) -> None:
    """Raise a ScheduleError unless there is at least one stage and one microbatch."""
    if p < 1 or m < 1:
        raise ScheduleError(f"{name}: need p >= 1 stages and m >= 1 microbatches, got p={p}, m={m}")


def too_few_microbatches(name: str, p: int, m: int, v: int = 1) -> ScheduleError:
    """The error for a schedule that needs ``m >= p`` microbatches, with the bubble it would have and the fix."""
    bubble = (p - 1) / (v * m + p - 1)
    return ScheduleError(
        f"{name}(p={p}, m={m}) needs m >= p: with fewer microbatches than stages it never reaches its "
        f"one-forward-one-backward steady state, and each rank idles {bubble:.0%} of the step "
        f"(bubble (p-1)/(v*m+p-1)), exactly as GPipe would. "
        f"Use m >= {p} microbatches (several times p keeps the bubble small: m={4 * p} gives "
        f"{(p - 1) / (v * 4 * p + p - 1):.0%}), or fewer pipeline stages, or schedule='gpipe' if m must stay {m}.")


def single(p: int = 1, m: int = 1) -> Schedule:
    """The one-stage schedule: a program without a pipeline (plain data parallelism, dp replicas
    being copies of this one rank).

    m == 1: ``FULL0.0``, forward + backward + REDUCE_GRAD + STEP as one graph (the fused step).
    m > 1: gradient accumulation, ``F0.0 B0.0 F0.1 B0.1 ... RG0 STEP0``.
    """
    if p != 1:
        raise ScheduleError(f"single(p={p}, m={m}) is the one-stage schedule and needs p=1; for {p} pipeline "
                            f"stages pick a pipeline schedule such as '1f1b' or 'gpipe'.")
    if m < 1:
        raise ScheduleError(f"single: need m >= 1 microbatches, got m={m}")
    if m == 1:
        return Schedule({0: [compute(0, "FULL", 0, 0)]}, 1, 1, {0: (0,)}, "single")
    lists = {0: [compute(0, k, 0, i) for i in range(m) for k in ("F", "B")]}
    return finish(lists, 1, m, {0: (0,)}, "single")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al., NeurIPS'19): every rank runs all m forwards, then all m backwards, then STEP.

    Stage s lives on rank s. Peak activations: m microbatches on every stage.
    """
    check_pm("gpipe", p, m)
    lists = {s: [compute(s, "F", s, i) for i in range(m)] + [compute(s, "B", s, i) for i in range(m)]
             for s in range(p)}
    return finish(lists, p, m, {s: (s,) for s in range(p)}, "gpipe")


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B with a flush, i.e. PipeDream-Flush (Narayanan et al., "Memory-Efficient Pipeline-Parallel
    DNN Training", ICML'21) and Megatron-LM's default schedule (Narayanan et al. SC'21, Fig. 4 top).

    Stage s (on rank s) runs ``p-s-1`` warmup forwards, then alternates one forward and one backward,
    then drains the remaining backwards, then STEP. At most ``p-s`` microbatches are in flight on
    stage s (p on stage 0), against m for GPipe; the bubble is the same, (p-1)/(m+p-1).
    """
    check_pm("1f1b", p, m)
    if m < p:
        raise too_few_microbatches("1f1b", p, m)
    return finish(one_f_one_b_lists(p, m), p, m, {s: (s,) for s in range(p)}, "1f1b")


def one_f_one_b_lists(p: int, m: int, version=None, step_after=None) -> dict:
    """The 1F1B compute order; ``version(s, i)`` labels F/B, ``step_after(s, i)`` returns the actions
    to put after ``B s.i`` (a list: ``[RG s, STEP s@v]``) or None."""
    lists = {}
    for s in range(p):
        w = min(p - s - 1, m)
        fwd = [compute(s, "F", s, i, version(s, i) if version else None) for i in range(m)]
        seq = fwd[:w]
        for k in range(m):
            if w + k < m:
                seq.append(fwd[w + k])
            seq.append(compute(s, "B", s, k, version(s, k) if version else None))
            if step_after and (st := step_after(s, k)) is not None:
                seq += st
        lists[s] = seq
    return lists


def interleaved(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", SC'21, Sec. 2.2.2): each rank holds v model chunks ("virtual stages").

    There are ``p*v`` stages; stage ``c*p + r`` (chunk c of rank r) lives on rank r. Microbatches go
    through in groups of p: rank r runs virtual microbatch k (k = 0 .. m*v-1) on chunk
    ``(k mod p*v) // p`` for forwards (``v-1-`` that for backwards), microbatch ``(k // (p*v))*p + k mod p``.
    Rank r warms up with ``(p-r-1)*2 + (v-1)*p`` forwards (Megatron's count), then alternates F and B.
    The bubble shrinks by v: t_bubble / t_ideal = (p-1)/(v*m) with uniform chunk times, i.e. a bubble
    fraction idle/(idle+busy) of (p-1)/(v*m+p-1). Megatron's condition: m a multiple of p.
    """
    check_pm("interleaved", p, m)
    if v < 1:
        raise ScheduleError(f"interleaved: v (model chunks per rank) must be >= 1, got v={v}")
    if m < p:
        raise too_few_microbatches("interleaved", p, m, v)
    if m % p:
        lo, hi = (m // p) * p, (m // p + 1) * p
        raise ScheduleError(f"interleaved(p={p}, m={m}, v={v}) needs m to be a multiple of p={p}: microbatches go "
                            f"through the v={v} chunks in groups of p (Megatron-LM's rule). Use m={lo} or m={hi}.")
    total = m * v
    group = p * v

    def chunk(k: int, forward: bool) -> int:
        c = (k % group) // p
        return c if forward else v - 1 - c

    def mb(k: int) -> int:
        return (k // group) * p + k % p

    lists = {}
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        F = [compute(r, "F", chunk(k, True) * p + r, mb(k)) for k in range(total)]
        B = [compute(r, "B", chunk(k, False) * p + r, mb(k)) for k in range(total)]
        seq = F[:warm]
        for k in range(total - warm):
            seq += [F[warm + k], B[k]]
        seq += B[total - warm:]
        lists[r] = seq
    return finish(lists, p * v, m, {c * p + r: (r,) for c in range(v) for r in range(p)}, "interleaved", v=v)
