"""BAGUA's asynchronous model averaging (``S.AsyncAveraging``): the replicas step alone and are averaged every
``interval_s`` seconds by a loop beside the steps, each adding ``mean - snapshot`` between two updates.

Deterministic mode (``every_steps=k``, on the step loop): with k=1 and plain SGD it is synchronous data
parallelism, with k it is Local SGD(period=k) -- every rank's parameters to 1e-10, in float64. Timed mode: each rank
records its averagings (the same number on every rank), and each averaging's correction sums to zero over the
ranks (the mean of the replicas is kept), measured on the ranks by a fingerprint of the correction.
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

SGD = (torch.optim.SGD, {"lr": 0.1})
SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


def _model():
    torch.manual_seed(0)
    return MLP(layers=2).double()


def _program(model, batches, method, optimizer=SGD_M, dp=2, **strategy):
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(dp), batches[0], loss_fn=F.mse_loss, optimizer=optimizer,
                             strategy=fxpar.Strategy(dp=dp, sync=method, **strategy))


def _close(got: dict, want: dict, msg=""):
    assert got and sorted(k for k in want if k in got) == sorted(got)
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-10, atol=1e-10, msg=f"{msg} {k}")


@pytest.mark.numerics
def test_every_step_with_plain_sgd_is_synchronous_dp(clusters):
    """every_steps=1, plain SGD, dp=4: each step's average of x - lr g_i is x - lr mean(g): the global-batch SGD step,
    on every replica, to 1e-10; one averaging per step recorded on every rank."""
    model, batches = _model(), mlp_batches(5)
    res = _program(model, batches, S.AsyncAveraging(every_steps=1), SGD, 4).run_local(batches, cluster=clusters.get(4))
    losses, want = reference_training(model, batches, F.mse_loss, SGD)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r in range(4):
        _close(res.features[r]["sync"]["replica"], want, f"replica {r}")
        assert res.features[r]["sync"]["averagings"] == 5


@pytest.mark.numerics
@pytest.mark.parametrize("every,warmup,microbatches", [(3, 0, 1), (2, 1, 1), (2, 0, 2)])
def test_every_k_steps_is_local_sgd(clusters, every, warmup, microbatches):
    """every_steps=k, SGD-momentum, dp=2 (and with 2 microbatches): every replica and the losses equal
    LocalSGD(period=k) with the same warm-up to 1e-10 (x + (mean - x) is the mean to rounding); the averagings fall
    after the same steps."""
    model, batches = _model(), mlp_batches(7)
    got = _program(model, batches, S.AsyncAveraging(every_steps=every, warmup_steps=warmup),
                   microbatches=microbatches).run_local(batches, cluster=clusters.get(2))
    want = _program(model, batches, S.LocalSGD(period=every, warmup_steps=warmup),
                    microbatches=microbatches).run_local(batches, cluster=clusters.get(2))
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-10, atol=1e-10)
    for r in range(2):
        _close(got.features[r]["sync"]["replica"], want.features[r]["sync"]["replica"], f"replica {r}")
        assert got.features[r]["sync"]["applied_steps"] == want.features[r]["sync"]["averaged_steps"]


@pytest.mark.numerics
def test_timed_averaging_keeps_the_mean_of_the_replicas(clusters):
    """interval_s=2 ms over 60 steps at dp=2: each rank records averagings (> 0, the same number on both: the loops
    agree when to stop), after the warm-up's steps only; per averaging the corrections' fingerprints (their dot
    product with one fixed random vector) sum to zero over the ranks while each is not zero: the replicas' mean is
    kept. The replicas were averaged: they are closer than two replicas that never are."""
    model, batches = _model(), mlp_batches(60)
    res = _program(model, batches, S.AsyncAveraging(interval_s=0.002, warmup_steps=2)).run_local(
        batches, cluster=clusters.get(2))
    a, b = (res.features[r]["sync"] for r in range(2))
    assert a["averagings"] > 0 and a["averagings"] == b["averagings"] == len(a["fingerprints"])
    assert min(a["applied_steps"] + b["applied_steps"]) >= 2
    for (fa, na), (fb, nb) in zip(a["fingerprints"], b["fingerprints"]):
        assert na > 0 and nb > 0
        assert abs(fa + fb) <= 1e-9 * (na + nb), (fa, fb)
    apart = _program(model, batches, S.LocalSGD(period=1000, warmup_steps=2)).run_local(batches,
                                                                                         cluster=clusters.get(2))
    gap = lambda f: sum((f[0]["sync"]["replica"][k] - f[1]["sync"]["replica"][k]).abs().sum().item()  # noqa: E731
                        for k in f[0]["sync"]["replica"])
    assert gap(res.features) < gap(apart.features)


@pytest.mark.structure
def test_plan_round_trip_notes_explain_and_schedule():
    """The method travels in the Plan (both modes); the timed mode's loops get process groups of their own; the note,
    explain() and program.schedule(rank) say when the replicas are averaged."""
    model, batches = _model(), mlp_batches(1)
    timed = _program(model, batches, S.AsyncAveraging(interval_s=0.25, warmup_steps=3))
    assert method_of(fxpar.Plan.from_json(timed.plan.to_json()).section("sync")) == S.AsyncAveraging(
        interval_s=0.25, warmup_steps=3)
    assert timed.plan.groups["sync_async"] == [[0, 1]]
    assert "every 0.25 s a background loop snapshots the replica" in timed.explain()
    text = str(timed.schedule(1))
    assert text.startswith("rank 1: FULL0.0\nsync AsyncAveraging(interval_s=0.25, warmup_steps=3): from step 3")
    assert "every 0.25 s AVERAGE0" in text and "steps 0..2 (warm-up)" in text
    exact = _program(model, batches, S.AsyncAveraging(every_steps=2))
    assert method_of(fxpar.Plan.from_json(exact.plan.to_json()).section("sync")) == S.AsyncAveraging(every_steps=2)
    assert "sync_async" not in exact.plan.groups
    nbytes = sum(p.numel() * 8 for p in model.parameters())
    lines = str(exact.schedule(0)).splitlines()
    assert lines[2:] == [f"  step 0: AVERAGE0 ({nbytes} bytes)", "  step 1: -"]
    assert exact.estimate().ranks[0].comm_bytes == nbytes // 2
