"""Measured peak memory per rank against ``estimate()`` under the asynchronous pipeline schedules (PipeDream, 2BW,
Pipelined Backpropagation, PipeMare), as ``tests/test_memory_measured.py`` holds the synchronous ones to 1%.

What each holds (``cost_models.step_memory``, ``fxpar/features/pipeline_delayed.py``): PipeDream stashes the
versions a later F or B of stage s names (p - s at most), 2BW two; Pipelined Backpropagation and PipeMare one, with
PipeMare's velocity beside it, the weights weight prediction and discrepancy correction compute for F and B, and what
spike compensation builds after an update. A sent message is held until the receive after which the rank waits on
it (``fxpar.schedule.sends``), in the run and in the walk alike; the run covers the two batches of the window
``estimate()`` prices (the program's schedule).
"""
import pytest
import torch

import fxpar
from fxpar.testing import GPT, gpt_loss, token_batches

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


def _program(schedule, options, batches):
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, tie_weights=False).double()
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], gpt_loss, SGD_M,
                             strategy=fxpar.Strategy(pp=2, schedule=schedule, microbatches=4, **options))


@pytest.mark.cost
@pytest.mark.slow
@pytest.mark.parametrize("schedule,options", [
    ("pipemare", {"lr_warmup": 5, "discrepancy_correction": True}),
    ("pipedream", {}),
    ("pipelined_bp", {"correction": "sc+lwp"}),
    ("2bw", {}),
], ids=["pipemare", "pipedream", "pipelined_bp", "2bw"])
def test_measured_peak_is_the_predicted_one(clusters, schedule, options):
    batches = token_batches(2, seq=16, vocab=64)
    prog = _program(schedule, options, batches)
    res = prog.run_local(batches, cluster=clusters.get(2), measure_memory=True)
    est = prog.estimate()
    for r in range(2):
        pred, got = est.ranks[r].peak_memory_bytes, res.peak_memory_bytes[r]
        assert 0.99 * pred <= got <= 1.01 * pred, (schedule, r, got, pred)


@pytest.mark.cost
@pytest.mark.slow
def test_the_schedules_hold_different_weight_versions():
    """Stage 0 of two (p - s = 2): PipeDream stashes a second version, 2BW holds two, PipeMare one plus its velocity,
    Pipelined Backpropagation one; the last stage holds one under PipeDream, two under 2BW."""
    batches = token_batches(2, seq=16, vocab=64)
    params = {r: sum(v.numel() * v.element_size() for k, v in _program("1f1b", {}, batches).initial_params().items()
                     if (k.startswith(("wte", "wpe", "blocks.0")) == (r == 0))) for r in range(2)}
    got = {}
    for schedule, options in [("pipedream", {}), ("2bw", {}), ("pipemare", {"discrepancy_correction": True}),
                              ("pipelined_bp", {})]:
        est = _program(schedule, options, batches).estimate()
        got[schedule] = [est.ranks[r].memory_breakdown.get("param", 0.0) +
                         est.ranks[r].memory_breakdown.get("feature delayed_pipeline", 0.0) for r in range(2)]
    assert got["pipedream"] == [2 * params[0], params[1]], got
    assert got["2bw"] == [2 * params[0], 2 * params[1]], got
    assert got["pipemare"] == [2 * params[0], 2 * params[1]], got          # one copy and its velocity
    assert got["pipelined_bp"] == [params[0], params[1]], got
