"""Optimizers fxpar does not trace (torch's own, stepped eagerly on each rank) where parameters are split.

An eager optimizer steps what the rank holds. Under tensor parallelism that is a piece of each split parameter:
the whole parameter's update only for an elementwise optimizer (``fxpar.optim.ELEMENTWISE``). Adafactor (factored
moments) and Muon (an orthogonalised matrix) are refused there, naming the optimizer, the parameter and why; ZeRO
refuses every untraced optimizer. An elementwise one (Adagrad) under tp=2 equals one process and resumes bitwise
(its state of split parameters is saved whole). Where the update sees whole parameters -- Muon under dp=2 and pp=2,
Adafactor over parameters offloaded whole to files (``offload=("params",), offload_to="disk"`` without ZeRO) -- it
equals torch.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.errors import InputError, StrategyError
from fxpar.testing import max_abs_diff, reference_training, regression_batches, tiny_gpt, token_batches, gpt_loss
from fxpar.testing.resume import assert_resume_is_exact

MUON = (torch.optim.Muon, {"lr": 0.02})
ADAFACTOR = (torch.optim.Adafactor, {"lr": 1e-2})
ADAGRAD = (torch.optim.Adagrad, {"lr": 0.05})


class Matrices(nn.Module):
    """Weights that are all 2-D (what Muon takes)."""

    def __init__(self, d=16, hidden=32, out=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden, bias=False), nn.Linear(hidden, out, bias=False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _matrices():
    torch.manual_seed(0)
    return Matrices().double(), regression_batches(4)


@pytest.mark.structure
@pytest.mark.parametrize("opt", [ADAFACTOR, MUON], ids=["Adafactor", "Muon"])
def test_a_non_elementwise_optimizer_on_split_parameters_is_refused(opt):
    model, batches = _matrices()
    with pytest.raises(StrategyError) as e:
        fxpar.parallelize(model, 2, batches[0], F.mse_loss, opt, strategy=fxpar.Strategy(tp=2, sharding="megatron"))
    msg = str(e.value)
    assert opt[0].__name__ in msg and "'fc1.weight' is split" in msg and "not elementwise" in msg
    assert "elementwise optimizer" in msg and "dp/pp" in msg


@pytest.mark.structure
def test_zero_refuses_an_untraced_optimizer():
    model, batches = _matrices()
    with pytest.raises(StrategyError, match=r"zero=3.*Adafactor is not traced.*SGD, Adam or AdamW"):
        fxpar.parallelize(model, 2, batches[0], F.mse_loss, ADAFACTOR, strategy=fxpar.Strategy(dp=2, zero=3))


@pytest.mark.structure
def test_muon_names_a_parameter_it_cannot_take():
    with pytest.raises(InputError, match=r"Muon.*'blocks\.0\.ln1\.weight' of shape \(16,\).*2-D"):
        fxpar.parallelize(tiny_gpt(), 2, token_batches(1)[0], gpt_loss, MUON, strategy=fxpar.Strategy(dp=2))


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [dict(dp=2), dict(pp=2, microbatches=2)], ids=["dp2", "pp2"])
def test_muon_on_whole_parameters_equals_torch(clusters, strategy):
    model, batches = _matrices()
    ref_losses, ref_state = reference_training(model, batches, F.mse_loss, MUON)
    prog = fxpar.parallelize(model, 2, batches[0], F.mse_loss, MUON, strategy=fxpar.Strategy(**strategy))
    res = prog.run_local(batches, cluster=clusters.get(2))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10


@pytest.mark.numerics
@pytest.mark.slow
def test_an_elementwise_optimizer_on_pieces_equals_one_process_and_resumes(clusters, tmp_path):
    model, batches = _matrices()
    ref_losses, ref_state = reference_training(model, batches, F.mse_loss, ADAGRAD)
    prog = fxpar.parallelize(model, 2, batches[0], F.mse_loss, ADAGRAD,
                             strategy=fxpar.Strategy(tp=2, sharding="megatron"))
    assert prog.plan.section("tensor_parallel").stages[0]["params"]["fc1.weight"] == ["tp", None]
    lc = clusters.get(2)
    whole, _, _ = assert_resume_is_exact(prog, batches, 2, lc, tmp_path / "ck")
    assert max(abs(a - b) for a, b in zip(whole.losses, ref_losses)) < 1e-10
    assert max_abs_diff(whole.state_dict(), ref_state) < 1e-10


@pytest.mark.numerics
def test_an_untraced_optimizer_over_offloaded_whole_parameters_equals_torch(clusters, tmp_path):
    model, batches = _matrices()
    ref_losses, ref_state = reference_training(model, batches, F.mse_loss, ADAFACTOR)
    prog = fxpar.parallelize(model, 2, batches[0], F.mse_loss, ADAFACTOR,
                             strategy=fxpar.Strategy(dp=2, offload=("params",), offload_to="disk", offload_dir=tmp_path))
    res = prog.run_local(batches, cluster=clusters.get(2))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10


@pytest.mark.cost
def test_the_eager_step_is_priced_on_the_pieces_a_rank_holds():
    """Under Megatron tp=2 each rank steps half of every weight (fc1's rows, fc2's columns): the eager Adagrad step
    is priced on those pieces, (16, 16) and (8, 16), not on the whole (32, 16) and (8, 32)."""
    from cost_models.compute import eager_step_compute
    model, batches = _matrices()
    prog = fxpar.parallelize(model, 2, batches[0], F.mse_loss, ADAGRAD,
                             strategy=fxpar.Strategy(tp=2, sharding="megatron"))
    assert not prog.optimizer.traced
    dt = torch.float64
    pieces = eager_step_compute(prog.optimizer, {(0, "fc1.weight"): ((16, 16), dt), (0, "fc2.weight"): ((8, 16), dt)})
    whole = eager_step_compute(prog.optimizer, {(0, "fc1.weight"): ((32, 16), dt), (0, "fc2.weight"): ((8, 32), dt)})
    assert pieces[2] < whole[2]
    for rank in range(2):
        assert prog.eager_step_compute(rank) == pieces
