"""Zero-bubble pipeline schedules: ZB-H1 with the backward split into I (input grads) and W (weight grads).

Qi, Wan, Huang & Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024 (arXiv:2401.10241), Sec. 2.1,
Fig. 3 (top) and Table 2. The stage-to-stage chain of a backward only needs the input gradient
(``I``, the paper's "B"); the weight gradient (``W``) of a microbatch can run any time after its I on
the same rank, so W's are moved into the places where 1F1B idles. Stage s lives on rank s, microbatches
go in 1F1B order, and the list ends with ``RG s`` (after the last W) and ``STEP s``.

Two orders, chosen by ``in_flight`` (how many microbatches' activations stage s may hold, counted
as the simulator counts them: from the start of F to the end of W):

* ``"1f1b"``: at most ``p-s`` on stage s, exactly 1F1B's count stage by stage. That pins
  the steady state to ``F I W`` (W_k must finish before F_(k+p-s) starts), so W's are delayed only
  in the drain, where each ``I`` runs as soon as its gradient arrives and the W's fill the waits (the
  W of microbatch j follows the I of microbatch j+s). Idle time per rank: (p-1)(F+I) against 1F1B's
  (p-1)(F+I+W); with F = I = W that is two thirds of 1F1B's bubble, and no order under this memory
  bound does better (derived here, not from the paper: the last stage cannot start F_0 before (p-1)F,
  runs m F-I-W triples back to back, and its last I must then travel p-1 I's up to stage 0).
* ``"p"`` (default): the paper's ZB-H1 order. Stage s warms up with p-1-s forwards, then s (F, I) pairs, then
  runs (F_x, I_(x-p+1+s), W_(x-p+1)) triples, and drains with (I, W) pairs and the last s W's. Every
  stage holds p microbatches at its peak -- 1F1B's peak, which 1F1B reaches only on stage 0; the
  paper counts the s extra ones at the smaller weight-gradient stash M_W (Table 2: peak memory p*M_B).
  Idle time per rank: (p-1)(F+I-W) (Table 2, T_B there is our I), a third of 1F1B's with F = I = W.

Figures from the dry run (``simulate(s, F=1, I=1, W=1)``; 1F1B with F=1, B=2), makespan / bubble:

    ======  =============  ==================  =============
    p, m    1f1b           zb1p (in_flight=    zb1p (default,
                           "1f1b")             in_flight="p")
    ======  =============  ==================  =============
    2, 4    15 / 0.200     14 / 0.143          13 / 0.077
    2, 8    27 / 0.111     26 / 0.077          25 / 0.040
    4, 4    21 / 0.429     18 / 0.333          15 / 0.200
    4, 8    33 / 0.273     30 / 0.200          27 / 0.111
    ======  =============  ==================  =============

Example, ``zb1p(2, 3)`` (``print(schedule.format_lists())``)::

    rank 0: F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 I0.0 W0.0 F0.2 SF0.2>1 RB0.1<1 I0.1 W0.1 RB0.2<1 I0.2 W0.2 RG0 STEP0
    rank 1: RF1.0<0 F1.0 I1.0 SB1.0>0 RF1.1<0 F1.1 I1.1 SB1.1>0 W1.0 RF1.2<0 F1.2 I1.2 SB1.2>0 W1.1 W1.2 RG1 STEP1
"""
from __future__ import annotations

from fxpar.schedule._build import compute, finish
from fxpar.schedule.exceptions import ScheduleError
from fxpar.schedule.ir import Schedule
from fxpar.schedule.synchronous import check_pm, too_few_microbatches

__all__ = ["zb1p"]


def _stage_order(p: int, m: int, s: int, lag: int) -> list[tuple[str, int]]:
    """(kind, microbatch) order of stage s; in the steady state W_j follows I_(j+lag), in the drain I_(j+s)."""
    w = p - 1 - s
    seq: list[tuple[str, int]] = []
    for x in range(m):
        seq.append(("F", x))
        if x - w >= 0:
            seq.append(("I", x - w))
            if x - w - lag >= 0:
                seq.append(("W", x - w - lag))
    pending = [j for j in range(m) if ("W", j) not in seq]
    for j in range(max(m - w, 0), m):                   # drain: I's as gradients arrive, W's fill the waits
        seq.append(("I", j))
        if pending and pending[0] <= j - s:
            seq.append(("W", pending.pop(0)))
    return seq + [("W", j) for j in pending]


def zb1p(p: int, m: int, in_flight: str = "p") -> Schedule:
    """ZB-H1 over p stages (stage s on rank s) and m >= p microbatches; see the module docstring.

    ``in_flight="p"`` (default) is the paper's order: p microbatches in flight on every stage (1F1B's peak,
    reached on every stage instead of stage 0 only), the bubble (p-1)(F+I-W);
    ``in_flight="1f1b"`` keeps every stage at 1F1B's activation count (p-s on stage s), bubble (p-1)(F+I).
    """
    check_pm("zb1p", p, m)
    if in_flight not in ("1f1b", "p"):
        raise ScheduleError(f"zb1p: in_flight must be '1f1b' (at most p-s microbatches in flight on stage s, as "
                            f"1F1B) or 'p' (the paper's ZB-H1 order, p on every stage); got {in_flight!r}")
    if m < p:
        raise too_few_microbatches("zb1p", p, m)
    lists = {}
    for s in range(p):
        lag = 0 if in_flight == "1f1b" else s
        lists[s] = [compute(s, k, s, i) for k, i in _stage_order(p, m, s, lag)]
    return finish(lists, p, m, {s: (s,) for s in range(p)}, "zb1p", **({} if in_flight == "p" else
                                                                         {"in_flight": in_flight}))
