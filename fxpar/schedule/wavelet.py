"""Wavelet's tick-tock waves on one rank: two waves of the same data-parallel ranks, the second half a cycle late.

Wang, Wang, Jiang, Li & Stoica, "Wavelet: Efficient DNN Training with Tick-Tock Scheduling", MLSys'21. A rank's
memory climbs through a forward (activations saved for the backward) and falls through the backward; Wavelet
launches a second wave of training tasks (tock) on the same devices half a forward-backward cycle after the first
(tick), so that one wave's forward, whose memory grows, runs while the other's backward frees it: one wave's peak
falls in the other's valley.

Here a rank holds the model cut into ``v`` chunks (stages ``0 .. v-1``, all on pipeline rank 0: no message
between them, the executor hands a chunk's output to the next in place). One wave's forward-backward cycle of a
microbatch is ``2v`` slots, ``F0 .. F(v-1) B(v-1) .. B0``; the tock wave runs the same cycle ``v`` slots (half a
cycle) later. Of the step's ``m`` microbatches the first ``m/2`` are the tick wave's, the others the tock
wave's, one cycle after another in each wave. In a slot where both waves have work the tick action runs first.
Both waves add their gradients into the one accumulator per parameter; each chunk reduces them over ``dp``
(``RG``) after its last backward and updates once (``STEP``): an update sums the two waves' gradients, so the step
is synchronous training on the global batch.

Example, ``wavelet(1, 2)`` (one microbatch per wave, two chunks)::

    rank 0: F0.0 F1.0 B1.0 F0.1 B0.0 F1.1 B1.1 RG1 B0.1 RG0 STEP0 STEP1

After ``F1.0`` the tick wave holds both chunks' saved activations (its peak); its ``B1.0`` frees one before the
tock wave's ``F0.1`` saves one: the two waves together never hold more than one wave's peak.
"""
from __future__ import annotations

from fxpar.schedule._build import compute, finish
from fxpar.schedule.exceptions import ScheduleError
from fxpar.schedule.ir import Schedule

__all__ = ["wavelet", "wave_slots", "WAVES"]

WAVES = 2          # tick and tock


def wave_slots(v: int, k: int, wave: int) -> list:
    """One wave's compute in slot order: ``[(slot, kind, chunk, microbatch)]`` for its ``k`` microbatches over ``v``
    chunks; wave 0 (tick) takes microbatches ``0 .. k-1`` from slot 0, wave 1 (tock) ``k .. 2k-1`` from slot ``v``."""
    out = []
    for j in range(k):
        mb, t0 = wave * k + j, j * 2 * v + wave * v
        out += [(t0 + c, "F", c, mb) for c in range(v)]
        out += [(t0 + v + c, "B", v - 1 - c, mb) for c in range(v)]
    return out


def wavelet(p: int, m: int, v: int = 2) -> Schedule:
    """Tick-tock waves on one pipeline rank: ``m`` microbatches (``m/2`` per wave), the model in ``v`` chunks."""
    if p != 1:
        raise ScheduleError(f"wavelet(p={p}, m={m}): Wavelet runs its two waves on each data-parallel rank, with "
                            "the model whole on every rank (p=1); waves over pipeline stages are not built. Use pp=1.")
    if m < WAVES or m % WAVES:
        raise ScheduleError(f"wavelet(p=1, m={m}) needs an even m >= 2: half the microbatches are the tick wave's, "
                            f"half the tock wave's. Use m={max(2, m - m % 2)} or m={m + m % 2 or m + 2}.")
    if v < 2:
        raise ScheduleError(f"wavelet(v={v}) needs the model in v >= 2 chunks: with one chunk the tock wave's forward "
                            "cannot start while the tick wave's backward runs.")
    k = m // WAVES
    slots = sorted(wave_slots(v, k, 0) + wave_slots(v, k, 1), key=lambda x: (x[0], x[3]))
    lists = {0: [compute(0, kind, c, mb) for _, kind, c, mb in slots]}
    return finish(lists, v, m, {c: (0,) for c in range(v)}, "wavelet", v=v)
