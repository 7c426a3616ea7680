"""Two waves of one rank, half a cycle apart: the peak of max over t of M(t) + M(t + T/2).

Wavelet (Wang et al., MLSys'21) runs a second wave of training (tock) on the same devices half a forward-backward
cycle after the first (tick). Its memory condition is that the two waves' memory timelines, one shifted by half
the cycle T, never add up to more than the device holds::

    max over t of  M(t) + M(t + T/2)  <=  device memory

``M`` here is one wave's timeline action by action (:func:`cost_models.step_memory.sequence_timeline` over the
wave's graphs): its bytes while each action runs and after it. The waves share what does not belong to either:
the rank's parameters, optimizer state and batch, and the one gradient accumulator per parameter both waves add
into (as large as the larger of the two waves' at the moment); those count once. The waves run in slots, one action of each per slot, the tick's first: while the tick
wave runs its action t the tock wave holds what it held after its action t - shift - 1, and while the tock wave
runs its action t - shift the tick wave holds what it held after its action t. The gradient reduction and the
update run once, after both waves.
"""
from __future__ import annotations

from dataclasses import dataclass

from .step_memory import sequence_timeline

__all__ = ["WavePeak", "waves_peak"]


@dataclass
class WavePeak:
    """``combined``: the two waves' peak together (bytes); ``one_wave``: one wave's peak alone; ``shared``: the bytes
    both hold once throughout (state, batch); ``slot``: the slot of the combined peak; ``timeline``: one wave's
    :func:`~cost_models.step_memory.sequence_timeline` rows."""
    combined: float
    one_wave: float
    shared: float
    slot: int
    timeline: list


def waves_peak(runs, shift: int, tail: int = 0) -> WavePeak:
    """The peak of two copies of the step sequence ``runs`` (one wave: ``(Liveness or None, label, keep)`` per item,
    as :func:`cost_models.step_memory.sequence_peak` takes), the second ``shift`` actions after the first. The last
    ``tail`` graphs of ``runs`` (the gradient reduction and the update) run once, after both waves."""
    base, line = sequence_timeline(runs)
    during = [d - base - g for _, d, _, g, _ in line]          # one wave's own bytes: no state, no accumulator
    after = [a - base - g for _, _, a, _, g in line]
    g_during = [g for *_, g, _ in line]
    g_after = [g for *_, g in line]
    n = len(line) - tail

    def held(j: int) -> tuple:                      # (own bytes, accumulators) of the wave after its action j
        return (0.0, 0.0) if j < 0 else (after[min(j, n - 1)], g_after[min(j, n - 1)])

    def both(j: int, other: tuple) -> float:        # the wave running its action j, the other wave holding ``other``
        return base + max(g_during[j], other[1]) + during[j] + other[0]

    best, slot = max((both(j, (0.0, g_after[n - 1] if n else 0.0)), n + shift) for j in range(n, len(line))) \
        if tail else (0.0, 0)                       # the tail runs once, after both waves (their sums in one)
    for t in range(n + shift):
        u = t - shift
        here = max(both(t, held(u - 1)) if t < n else 0.0, both(u, held(t)) if 0 <= u < n else 0.0)
        if here > best:
            best, slot = here, t
    one = max(d + g for d, g in zip(during, g_during)) + base
    return WavePeak(best, one, base, slot, line)
