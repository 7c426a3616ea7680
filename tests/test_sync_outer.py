"""DiLoCo (``S.DiLoCo``) and SlowMo (``S.SlowMo``): Local SGD's averaging, then an outer step from the parameters of
the last averaging.

Reductions: DiLoCo with an outer SGD of lr 1 and no momentum, and SlowMo with slow_momentum 0 and slow_lr 1, are
Local SGD (to 1e-10); SlowMo with period 1 and slow_lr 1 over plain SGD (no momentum, no weight decay, a constant
lr gamma, no warm-up) is heavy-ball SGD, torch's ``SGD(lr=gamma, momentum=slow_momentum)``, as Wang et al. say (§3).
Against one-process references of the papers' math (``fxpar.testing.sync``): DiLoCo's outer Nesterov step, SlowMo's
Algorithm 1. A checkpoint in the middle of a window resumes every replica and the outer state bitwise.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import sync as S
from fxpar.sync.feature import method_of
from fxpar.testing import MLP, reference_training
from fxpar.testing.compress import mlp_batches
from fxpar.testing.resume import assert_resume_is_exact
from fxpar.testing.sync import local_sgd_reference, nesterov_outer, slowmo_outer

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.01})
NESTEROV = (torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})


def _model():
    torch.manual_seed(0)
    return MLP(layers=2).double()


def _program(model, batches, method, optimizer=SGD_M, dp=2):
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(dp), batches[0], loss_fn=F.mse_loss, optimizer=optimizer,
                             strategy=fxpar.Strategy(dp=dp, sync=method))


def _replicas(res, dp) -> list:
    return [res.features[r]["sync"]["replica"] for r in range(dp)]


def _assert_replicas_equal(a, b, dp: int = 2) -> None:
    """Every replica's parameters bitwise equal in two runs (``assert_resume_is_exact`` checks rank 0's)."""
    for r, (x, y) in enumerate(zip(_replicas(a, dp), _replicas(b, dp))):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), r


def _close(got: dict, want: dict, msg=""):
    assert got and sorted(k for k in want if k in got) == sorted(got)
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-10, atol=1e-10, msg=f"{msg} {k}")


@pytest.mark.numerics
@pytest.mark.parametrize("method", [S.DiLoCo(period=2, outer=(torch.optim.SGD, {"lr": 1.0})),
                                    S.SlowMo(period=2, slow_lr=1.0, slow_momentum=0.0)], ids=["DiLoCo", "SlowMo"])
def test_plain_outer_step_is_local_sgd(clusters, method):
    """anchor - 1 * (anchor - average) is the average: every replica equals Local SGD's to 1e-10."""
    model, batches = _model(), mlp_batches(5)
    got = _program(model, batches, method).run_local(batches, cluster=clusters.get(2))
    want = _program(model, batches, S.LocalSGD(period=2)).run_local(batches, cluster=clusters.get(2))
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-10, atol=1e-10)
    for r, (a, b) in enumerate(zip(_replicas(got, 2), _replicas(want, 2))):
        _close(a, b, f"replica {r}")


@pytest.mark.numerics
@pytest.mark.parametrize("optimizer", [SGD_M, ADAMW], ids=["SGD-momentum", "AdamW"])
def test_diloco_nesterov_equals_the_papers_outer_step(clusters, optimizer):
    """dp=4, H=2, 6 steps, outer SGD(lr 0.7, momentum 0.9, Nesterov): every replica equals the one-process reference
    whose outer step is Nesterov's written out; the outer step moved the replicas off Local SGD."""
    model, batches = _model(), mlp_batches(6)
    res = _program(model, batches, S.DiLoCo(period=2, outer=NESTEROV), optimizer, 4).run_local(
        batches, cluster=clusters.get(4))
    losses, reps = local_sgd_reference(model, batches, F.mse_loss, optimizer, 4, 2, outer=nesterov_outer(0.7, 0.9))
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r, got in enumerate(_replicas(res, 4)):
        _close(got, reps[r], f"replica {r}")
    _, local = local_sgd_reference(model, batches, F.mse_loss, optimizer, 4, 2)
    assert max((reps[0][k] - local[0][k]).abs().max().item() for k in local[0]) > 1e-6


@pytest.mark.numerics
@pytest.mark.parametrize("period,warmup", [(3, 0), (2, 1)])
def test_slowmo_equals_algorithm_1(clusters, period, warmup):
    """dp=2, inner SGD-momentum (lr gamma 0.1), slow_lr 1.5, slow_momentum 0.5: every replica equals Algorithm 1 in
    one process (with a warm-up, the first window starts from the synchronous steps' parameters)."""
    model, batches = _model(), mlp_batches(7)
    method = S.SlowMo(period=period, warmup_steps=warmup, slow_lr=1.5, slow_momentum=0.5)
    res = _program(model, batches, method).run_local(batches, cluster=clusters.get(2))
    losses, reps = local_sgd_reference(model, batches, F.mse_loss, SGD_M, 2, period, warmup,
                                       outer=slowmo_outer(0.1, 1.5, 0.5))
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r, got in enumerate(_replicas(res, 2)):
        _close(got, reps[r], f"replica {r}")


@pytest.mark.numerics
def test_slowmo_period_one_is_heavy_ball_sgd(clusters):
    """Wang et al. §3: tau=1, alpha=1 over plain SGD (lr gamma, no momentum, no weight decay, no warm-up): the average
    is x - gamma g (g the mean gradient), so u = beta u + g and x = x - gamma u: torch's SGD(lr=gamma,
    momentum=beta) on the global batch, to 1e-10 (only rounding differs: u is formed from parameter differences)."""
    model, batches = _model(), mlp_batches(5)
    res = _program(model, batches, S.SlowMo(period=1, slow_lr=1.0, slow_momentum=0.7),
                   (torch.optim.SGD, {"lr": 0.1}), 4).run_local(batches, cluster=clusters.get(4))
    losses, want = reference_training(model, batches, F.mse_loss, (torch.optim.SGD, {"lr": 0.1, "momentum": 0.7}))
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r, got in enumerate(_replicas(res, 4)):
        _close(got, want, f"replica {r}")


@pytest.mark.numerics
@pytest.mark.parametrize("method", [S.DiLoCo(period=2, outer=NESTEROV),
                                    S.SlowMo(period=2, slow_lr=1.5, slow_momentum=0.5)], ids=["DiLoCo", "SlowMo"])
def test_checkpoint_in_the_middle_of_a_window_resumes_bitwise(clusters, tmp_path, method):
    """Averagings after steps 0, 2 and 4; saved after step 3 (apart, with outer momentum from two averagings), 3 more
    == 6 straight, bitwise, per replica: the outer optimizer's state or the slow momentum and the parameters of the
    last averaging are the rank's checkpoint state."""
    model, batches = _model(), mlp_batches(6)
    straight, _, resumed = assert_resume_is_exact(_program(model, batches, method), batches, 3,
                                                  clusters.get(2), tmp_path / "ck")
    _assert_replicas_equal(straight, resumed)


@pytest.mark.structure
def test_plan_round_trip_explain_and_state_bytes():
    """DiLoCo's outer optimizer travels in the Plan as its class path and arguments; explain says what the outer step
    does; the rank holds the parameters of the last averaging and one outer state tensor per parameter."""
    model, batches = _model(), mlp_batches(1)
    method = S.DiLoCo(period=5, outer=NESTEROV)
    prog = _program(model, batches, method)
    text = prog.plan.to_json()
    assert method_of(fxpar.Plan.from_json(text).section("sync")) == method
    assert "outer optimizer SGD(lr=0.7, momentum=0.9, nesterov=True) steps the parameters of the last averaging" \
        in prog.explain()
    nbytes = sum(p.numel() * 8 for p in model.parameters())
    assert prog.estimate().ranks[0].memory_breakdown["feature sync"] == 2 * nbytes
    local = _program(model, batches, S.LocalSGD(period=5))
    assert "feature sync" not in local.estimate().ranks[0].memory_breakdown
    slow = _program(model, batches, S.SlowMo(period=4, slow_momentum=0.25))
    assert "slow momentum u = 0.25 u + (x_prev - x_avg) / lr, then x = x_prev - 1.0 lr u" in slow.explain()
