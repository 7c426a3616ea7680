"""Two waves of one rank, half a cycle apart: the peak of max over t of M(t) + M(t + T/2).

Wavelet (Wang et al., MLSys'21) runs a second wave of training (tock) on the same devices half a forward-backward
cycle after the first (tick). Its memory condition is that the two waves' memory timelines, one shifted by half
the cycle T, never add up to more than the device holds::

    max over t of  M(t) + M(t + T/2)  <=  device memory

``M`` here is one wave's timeline action by action (:func:`cost_models.step_memory.sequence_timeline` over the
wave's graphs): its bytes while each action runs and after it. The waves run in slots, the tick's action first in
a slot both use: while the tick wave runs its action t the tock wave holds what it held after its action
t - shift - 1, and while the tock wave runs its action t - shift the tick wave holds what it held after its action
t. The gradient reduction and the update run once, after both waves.

* One timeline (data parallelism, every chunk on the rank): the tock wave is the tick wave's timeline again. The
  waves share what belongs to neither: the rank's parameters, optimizer state and batch, and the one gradient
  accumulator per parameter both waves add into (as large as the larger of the two waves' at the moment); those
  count once.
* Two timelines (``other``: model parallelism, the tock wave's stage on this rank is another rank's tick stage):
  the tock wave's memory on this rank is that other rank's tick timeline half a cycle later, M_r(t) +
  M_q(t + T/2); the two stages' state, batches and accumulators are their own, and add.
"""
from __future__ import annotations

from dataclasses import dataclass

from .step_memory import sequence_timeline

__all__ = ["WavePeak", "waves_peak"]


@dataclass
class WavePeak:
    """``combined``: the two waves' peak together (bytes); ``one_wave``: one wave's peak alone; ``shared``: the bytes
    held throughout (the rank's state and batch); ``slot``: the slot of the combined peak; ``timeline``: the tick
    wave's :func:`~cost_models.step_memory.sequence_timeline` rows."""
    combined: float
    one_wave: float
    shared: float
    slot: int
    timeline: list


class _Line:
    """One wave's timeline: its own bytes (no state, no accumulator) and its accumulators', while each action runs
    and after it; ``n`` the wave's actions before its tail (reduction, update)."""

    def __init__(self, runs, tail: int):
        self.base, self.rows = sequence_timeline(runs)
        self.during = [d - self.base - g for _, d, _, g, _ in self.rows]
        self.after = [a - self.base - g for _, _, a, _, g in self.rows]
        self.g_during = [g for *_, g, _ in self.rows]
        self.g_after = [g for *_, g in self.rows]
        self.n = len(self.rows) - tail

    def held(self, j: int, end: int | None = None) -> tuple:
        """(own bytes, accumulators) after its action j (none before its first; its last wave action's after it)."""
        last = self.n - 1 if end is None else end
        return (0.0, 0.0) if j < 0 or last < 0 else (self.after[min(j, last)], self.g_after[min(j, last)])


def waves_peak(runs, shift: int, tail: int = 0, other=None, other_tail: int = 0) -> WavePeak:
    """The peak of the tick wave ``runs`` (``(Liveness or None, label, keep)`` per item, as
    :func:`cost_models.step_memory.sequence_peak` takes) and a tock wave ``shift`` actions after it: the same
    ``runs`` again (``other`` None: shared state and accumulators), or ``other``'s (its own state and accumulators).
    The last ``tail`` (``other_tail``) graphs of each run once, after both waves."""
    a = _Line(runs, tail)
    b = a if other is None else _Line(other, other_tail)
    shared = other is None
    base = a.base if shared else a.base + b.base

    def at(x, j: int, held: tuple) -> float:     # wave x runs its action j; the other wave holds ``held``
        g = max(x.g_during[j], held[1]) if shared else x.g_during[j] + held[1]
        return base + g + x.during[j] + held[0]

    best, slot = 0.0, 0
    done_b = (0.0, b.g_after[b.n - 1] if b.n else 0.0) if shared else b.held(len(b.rows) - 1)
    for j in range(a.n, len(a.rows)):           # the tail runs once, after both waves (their sums in one)
        here = at(a, j, done_b)
        if here > best:
            best, slot = here, a.n + shift
    if not shared:
        done_a = a.held(len(a.rows) - 1, len(a.rows) - 1)
        for j in range(b.n, len(b.rows)):
            here = at(b, j, done_a)
            if here > best:
                best, slot = here, a.n + shift
    for t in range(max(a.n, b.n + shift)):
        u = t - shift
        here = max(at(a, t, b.held(u - 1)) if t < a.n else 0.0, at(b, u, a.held(t)) if 0 <= u < b.n else 0.0)
        if here > best:
            best, slot = here, t
    one = max(d + g for d, g in zip(a.during, a.g_during)) + a.base
    return WavePeak(best, one, base, slot, a.rows)
