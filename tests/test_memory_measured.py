"""Measured memory per rank (issue 10): the dispatch-level tracker, ZeRO's state bytes on real ranks, and the
measured peak against ``program.estimate()``'s prediction.

Tracker: on hand-made ops the peak is exact (views count once, a storage is freed when its last view dies,
held state counts from the start, a microbatch counts its own slice). Ranks (dp=2, float64 tied GPT, AdamW,
one microbatch): training with the tracker on still matches single-process training; the bytes a rank holds
when a step starts are the paper's formulas for ZeRO stages 0-3 (Rajbhandari et al. SC'20 §5.1, fp64 weights,
Adam's two states) plus the rank's microbatch; the measured peak falls from stage 0 to 1 and 3; and for every
ZeRO stage and recompute policy the measured peak is within 10% of the prediction (the issue's goal).
"""
from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.runtime.measure import MemoryTracker
from fxpar.testing import GPT, gpt_loss, max_abs_diff, reference_training

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
F64 = 8


# ---- the tracker on hand-made ops ----------------------------------------------------------------------
def test_tracker_exact_peak_on_hand_made_ops():
    x = torch.randn(1000, dtype=torch.float64)                       # held: 8000 bytes
    with MemoryTracker(held=[x]) as mem:
        a = x * 2                                                     # 16000
        v = a.view(10, 100)                                           # a view: no new bytes
        b = a + 1                                                     # 24000 (peak so far)
        del a                                                         # v keeps a's storage alive
        assert mem.current_bytes == 24000
        del v                                                         # 16000
        c = b.sum()                                                   # 16008
        b.add_(1)                                                     # in place: no new bytes
        del b                                                         # 8008
        d = torch.empty(3000, dtype=torch.float64)                    # 32008: the peak
        del d                                                         # 8008
        e = c.expand(4)                                               # a view of c: nothing new
        assert mem.current_bytes == 8008
    assert (mem.held_bytes, mem.peak_bytes, mem.current_bytes) == (8000, 32008, 8008)
    assert e.shape == (4,)


def test_tracker_counts_a_microbatch_by_its_slice_and_a_view_once():
    batch = torch.zeros(8, 100, dtype=torch.float64)                  # 6400 bytes, every rank holds it all
    mine = batch[4:]                                                   # this rank's half: 3200
    halves = list(mine.chunk(2))                                       # two microbatches: 1600 each
    w = torch.ones(100, 10, dtype=torch.float64)                       # 8000
    with MemoryTracker(held=[w, w.t()], inputs=halves) as mem:        # w and its view: one storage
        assert mem.held_bytes == 8000 + 3200
        y = halves[0] @ w                                              # 2 x 10: 160
        z = halves[0].view(-1)                                         # a view of the batch: counted already
    assert mem.peak_bytes == 8000 + 3200 + 160
    assert y.shape == (2, 10) and z.numel() == 200


def test_tracker_stops_counting_when_the_mode_exits():
    with MemoryTracker() as mem:
        a = torch.ones(100, dtype=torch.float64)
    del a                                                              # freed after the exit: figures stay
    assert (mem.peak_bytes, mem.current_bytes) == (800, 800)


# ---- ranks ------------------------------------------------------------------------------------------
def _gpt():
    torch.manual_seed(0)
    return GPT(vocab=64, d=32, layers=2, heads=2).double()      # every parameter has an even size: no padding


def _batches(n, batch=8, seq=16):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        idx = torch.randint(0, 64, (batch, seq + 1), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


_RUNS: dict = {}


def _run(clusters, zero: int, recompute: str):
    """(program, result) of 2 steps at dp=2 with the tracker on; each configuration runs once per session."""
    key = (zero, recompute)
    if key not in _RUNS:
        batches = _batches(2)
        prog = fxpar.parallelize(_gpt(), fxpar.ClusterSpec.local(2), batches[0], gpt_loss, ADAMW,
                                 strategy=fxpar.Strategy(dp=2, zero=zero, recompute=recompute))
        _RUNS[key] = (prog, prog.run_local(batches, cluster=clusters.get(2), measure_memory=True))
    return _RUNS[key]


def test_measuring_memory_leaves_the_math_alone(clusters):
    ref_losses, ref_state = reference_training(_gpt(), _batches(2), gpt_loss, ADAMW)
    for zero in (0, 3):
        _, res = _run(clusters, zero, "none")
        assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
        assert max_abs_diff(res.state_dict(), ref_state) < 1e-10


def test_held_state_is_the_papers_formula_and_the_peak_falls_with_zero(clusters):
    """At a step's start a rank holds parameters and Adam's two states (no gradients yet): (b + 2b)Ψ at stage 0,
    bΨ + 2bΨ/N at 1 and 2, 3bΨ/N at 3 -- plus its microbatch (4 x 16 tokens and targets, int64)."""
    psi = sum(p.numel() for p in _gpt().parameters())
    n, b = 2, F64
    micro = 2 * 4 * 16 * 8
    expect = {0: 3 * b * psi, 1: b * psi + 2 * b * psi // n, 2: b * psi + 2 * b * psi // n, 3: 3 * b * psi // n}
    peak = {}
    for zero, state in expect.items():
        _, res = _run(clusters, zero, "none")
        assert res.held_memory_bytes == {0: state + micro, 1: state + micro}, zero
        peak[zero] = res.peak_memory_bytes[0]
        assert res.peak_memory_bytes[1] == pytest.approx(peak[zero], rel=0.1)
    # one microbatch: gradients live inside the fused step, so stage 2 holds what stage 1 holds at its peak
    assert peak[0] > peak[1] > peak[3] and peak[2] < peak[0], peak
    # the optimizer state ZeRO-1 shards (bΨ of fp64 Adam state at N=2) is at least what the peak loses
    assert peak[0] - peak[1] >= b * psi, peak


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_measured_peak_within_10pct_of_the_estimate(clusters, zero, recompute):
    """A collective's input (the reduce-scatter's bucket, the all-gather's chunk) is released by gloo's worker
    thread, which can drop its reference a moment after ``wait_tensor`` has returned on the rank's thread: when
    the step allocates in that moment, the measured peak holds that one buffer more (seen on one rank in about
    a third of the runs under ZeRO-1/2, always exactly one collective's input). The check allows exactly one
    such buffer, nothing else."""
    prog, res = _run(clusters, zero, recompute)
    est = prog.estimate()
    late = [0] + sorted({c.nbytes for c in prog.collectives(0)})
    for r in (0, 1):
        pred, got = est.ranks[r].peak_memory_bytes, res.peak_memory_bytes[r]
        assert any(0.9 <= (got - b) / pred <= 1.1 for b in late), (zero, recompute, r, got, pred, late)
