"""Measured memory per rank: the dispatch-level tracker, ZeRO's state bytes on real ranks, and the
measured peak against ``program.estimate()``'s prediction.

Tracker: on hand-made ops the peak is exact (views count once, a storage is freed when its last view dies,
held state counts from the start, a microbatch counts its own slice). Ranks (dp=2, float64 tied GPT, AdamW,
one microbatch): training with the tracker on still matches single-process training; the bytes a rank holds
when a step starts are the paper's formulas for ZeRO stages 0-3 (Rajbhandari et al. SC'20 §5.1, fp64 weights,
Adam's two states) plus the rank's microbatch; the measured peak falls from stage 0 to 1 and 3; and for every
ZeRO stage and recompute policy the measured peak is within 10% of the prediction (the goal), with one
microbatch, with two (F, B, REDUCE_GRAD, STEP) and under pp=2 x dp=2 with 4 microbatches (1F1B, and ZB-H1's I/W
split once); the model in fact holds to 1%, which the tests also check.
"""
from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.runtime.measure import MemoryTracker
from fxpar.testing import gpt_loss, max_abs_diff, reference_training, tiny_gpt, token_batches

pytestmark = pytest.mark.cost

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
_GPT = dict(vocab=64, d=32)        # every parameter has an even size: no padding
_RUNS: dict = {}


def _run(clusters, zero: int, recompute: str, steps: int = 2, **layout):
    """(program, result) of ``steps`` steps at dp=2 (``layout``: pp, microbatches, schedule) with the tracker on;
    each configuration runs once per session."""
    key = (zero, recompute, steps, tuple(sorted(layout.items())))
    if key not in _RUNS:
        batches = token_batches(steps, seq=16, vocab=64)
        world = 2 * layout.get("pp", 1)
        prog = fxpar.parallelize(tiny_gpt(**_GPT), fxpar.ClusterSpec.local(world), batches[0], gpt_loss, ADAMW,
                                 strategy=fxpar.Strategy(dp=2, zero=zero, recompute=recompute, **layout))
        _RUNS[key] = (prog, prog.run_local(batches, cluster=clusters.get(world), measure_memory=True))
    return _RUNS[key]


def _assert_predicted(prog, res, within: float, what) -> None:
    """Measured peak within ``within`` of the predicted one, per rank -- or above it by at most one collective's
    input more. Gloo's worker thread releases a collective's input (the reduce-scatter's bucket, the all-gather's
    chunk) a moment after ``wait_tensor`` has returned on the rank's thread: when the step allocates in that
    moment, the measured bytes hold that one buffer more (seen on one rank in about a third of the runs under
    ZeRO-1/2, always exactly one collective's input), which can lift the peak by up to that buffer."""
    est = prog.estimate()
    for r in range(prog.world_size):
        late = max([0] + [c.nbytes for c in prog.collectives(r) if c.kind not in ("send", "recv")])
        pred, got = est.ranks[r].peak_memory_bytes, res.peak_memory_bytes[r]
        assert (1 - within) * pred <= got <= (1 + within) * pred + late, (what, r, got, pred, late)


@pytest.mark.slow
def test_measuring_memory_leaves_the_math_alone(clusters):
    ref_losses, ref_state = reference_training(tiny_gpt(**_GPT), token_batches(2, seq=16, vocab=64), gpt_loss, ADAMW)
    for zero in (0, 3):
        _, res = _run(clusters, zero, "none")
        assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
        assert max_abs_diff(res.state_dict(), ref_state) < 1e-10


@pytest.mark.slow
def test_held_state_is_the_papers_formula_and_the_peak_falls_with_zero(clusters):
    """At a step's start a rank holds parameters and Adam's two states (no gradients yet): (b + 2b)Ψ at stage 0,
    bΨ + 2bΨ/N at 1 and 2, 3bΨ/N at 3 -- plus its microbatch (4 x 16 tokens and targets, int64)."""
    psi = sum(p.numel() for p in tiny_gpt(**_GPT).parameters())
    n, b = 2, F64
    micro = 2 * 4 * 16 * 8
    expect = {0: 3 * b * psi, 1: b * psi + 2 * b * psi // n, 2: b * psi + 2 * b * psi // n, 3: 3 * b * psi // n}
    peak = {}
    for zero, state in expect.items():
        prog, res = _run(clusters, zero, "none")
        assert res.held_memory_bytes == {0: state + micro, 1: state + micro}, zero
        peak[zero] = res.peak_memory_bytes[0]
        assert res.peak_memory_bytes[1] == pytest.approx(peak[zero], rel=0.1)
        if zero == 1:
            # ZeRO-1 all-gathers the updated copy of the rank's chunk; gloo's worker thread holds that copy until it
            # drops the collective, which may be after wait_tensor has returned (_check_peak): in some runs the
            # next step's reduce-scatter then meets it alive, and the peak is there, up to one chunk higher
            late = max(c.nbytes for c in prog.collectives(0) if c.kind == "all_gather")
    # one microbatch: gradients live inside the fused step, so stage 2 holds what stage 1 holds at its peak
    assert peak[0] > peak[1] > peak[3] and peak[2] < peak[0], peak
    # the optimizer state ZeRO-1 shards (bΨ of fp64 Adam state at N=2) is what the peak loses: bΨ exactly where the
    # chunk was freed in time, less at most that chunk where it was not
    assert b * psi - late <= peak[0] - peak[1] <= b * psi, (peak, late)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_measured_peak_within_10pct_of_the_estimate(clusters, zero, recompute):
    """One microbatch (the fused step): the prediction is the graph's liveness (measured: exact to the byte)."""
    prog, res = _run(clusters, zero, recompute)
    _assert_predicted(prog, res, 0.1, (zero, recompute))
    _assert_predicted(prog, res, 0.01, (zero, recompute))


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_two_microbatches_measured_peak_is_the_predicted_one(clusters, zero, recompute):
    """Two microbatches (F, B, REDUCE_GRAD, STEP): the schedule-level model (cost_models/step_memory.py) holds
    what the executor holds between graphs -- saved activations until their backward, the gradient accumulator
    from the first backward to the end of the step, REDUCE_GRAD's buffer until STEP and its views after,
    ZeRO-3's gathered parameters from UNSHARD to RESHARD -- each storage once however many views a graph takes
    of it. The goal is 10%; the model holds to 1% (measured: exact to the byte)."""
    prog, res = _run(clusters, zero, recompute, steps=1, microbatches=2)
    assert {"F", "B", "STEP"} <= set(prog.stages[0].graphs) and "FULL" not in prog.stages[0].graphs
    _assert_predicted(prog, res, 0.1, (zero, recompute, "mb=2"))
    _assert_predicted(prog, res, 0.01, (zero, recompute, "mb=2"))


@pytest.mark.slow
@pytest.mark.parametrize("zero,recompute,schedule", [
    (0, "full", "1f1b"), (1, "selective", "1f1b"), (2, "none", "1f1b"), (3, "selective", "1f1b"), (0, "none", "zb1p")])
def test_pipeline_measured_peak_is_the_predicted_one(clusters, zero, recompute, schedule):
    """pp=2 x dp=2 x 4 microbatches: besides the above, received activations a forward saves, every sent tensor
    (the executor keeps it until the receive after which it waits on the send) and, under zb1p, what I hands W and the gradients W
    returns from it. Off by 512 bytes in about 0.9 MB: each rank holds its whole slice of the batch (tokens and
    targets) while a stage's graphs read only one of the two, which is all the model sees."""
    prog, res = _run(clusters, zero, recompute, steps=1, pp=2, microbatches=4, schedule=schedule)
    assert {"F", "STEP"} <= set(prog.stages[1].graphs) and ("W" in prog.stages[1].graphs) == (schedule == "zb1p")
    _assert_predicted(prog, res, 0.1, (zero, recompute, schedule))
    _assert_predicted(prog, res, 0.01, (zero, recompute, schedule))
