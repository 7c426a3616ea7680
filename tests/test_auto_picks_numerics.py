"""The plans ``strategy="auto"`` picks for two of the models ``benchmarks/bench_planner.py measure`` runs, an HF
Llama from a ``LlamaConfig`` and an MLP, at 2 and 4 ranks, on the fixed calibrations of this machine that
``tests/test_auto_planner.py`` prices them on: each pick trains like one process (float64, losses and parameters to
1e-10). The third model, the tied GPT: ``tests/test_auto_planner.py::test_the_plan_auto_picks_trains_like_one_process``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.testing import max_abs_diff, reference_training

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_planner import _models  # noqa: E402  (the models its measure subcommand runs)
from test_auto_planner import _calibrated_local  # noqa: E402  (the calibrations its measurements ran on)

ADAMW = (torch.optim.AdamW, {"lr": 1e-2})
TOL = 1e-10


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("which", ["HF Llama", "MLP"])
def test_the_pick_trains_like_one_process(clusters, which, world):
    ((_, model, batches, loss),) = [m for m in _models(2) if m[0].startswith(which)]
    prog = fxpar.parallelize(model, _calibrated_local(world), batches[0], loss, ADAMW, strategy="auto")
    assert prog.auto_search.chosen is not None and prog.world_size == world
    ref_losses, ref_state = reference_training(model, batches, loss, ADAMW)
    res = prog.run_local(batches, cluster=clusters.get(world))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL, (str(prog.strategy), res.losses, ref_losses)
    assert max_abs_diff(res.state_dict(), ref_state) < TOL, str(prog.strategy)
