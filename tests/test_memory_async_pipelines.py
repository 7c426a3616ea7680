"""Measured peak memory per rank against ``estimate()`` under the asynchronous pipeline schedules (PipeDream, 2BW,
Pipelined Backpropagation, PipeMare), as ``tests/test_memory_measured.py`` holds the synchronous ones to 1%.

The memory model does not yet count what these schedules hold: it predicts the same peak for PipeDream (stage s
stashes p - s weight versions), Pipelined Backpropagation (one) and PipeMare (one, plus a weight-sized velocity), and
on the untied 2-layer GPT at pp=2 it overstates stage 1 about 3x (measured / predicted: PipeMare 1.04 and 0.38,
PipeDream 1.04 and 0.33, Pipelined BP 0.98 and 0.33, 2BW 1.17 and 0.92, 1F1B 1.0001 on both). Each case is a strict
expected failure: when the cost model counts them, it passes, pytest reports the XPASS as a failure, and the mark
goes. The runtime's own count of the versions is right (``tests/test_pipeline_pbp.py::test_pipemare_math_and_memory``).
"""
import pytest
import torch

import fxpar
from fxpar.testing import GPT, gpt_loss, token_batches

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
GAP = "estimate() does not model the asynchronous schedules' weight versions (docs/strategies/pipelines.md, Limits)"


@pytest.mark.cost
@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=GAP)
@pytest.mark.parametrize("schedule,options", [
    ("pipemare", {"lr_warmup": 5, "discrepancy_correction": True}),
    ("pipedream", {}),
    ("pipelined_bp", {"correction": "sc+lwp"}),
    ("2bw", {}),
], ids=["pipemare", "pipedream", "pipelined_bp", "2bw"])
def test_measured_peak_is_the_predicted_one(clusters, schedule, options):
    batches = token_batches(3, seq=16, vocab=64)
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, tie_weights=False).double()
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], gpt_loss, SGD_M,
                             strategy=fxpar.Strategy(pp=2, schedule=schedule, microbatches=4, **options))
    res = prog.run_local(batches, cluster=clusters.get(2), measure_memory=True)
    est = prog.estimate()
    for r in range(2):
        pred, got = est.ranks[r].peak_memory_bytes, res.peak_memory_bytes[r]
        assert 0.99 * pred <= got <= 1.01 * pred, (schedule, r, got, pred)
