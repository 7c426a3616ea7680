"""The straggler harness: ``ClusterSpec(slowdown={rank: factor})`` slows a rank's compute on the ranks and in
``estimate()``."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import sync as S
from fxpar.testing import MLP
from fxpar.testing.compress import mlp_batches
from cost_models.estimate import straggler_factor

SGD = (torch.optim.SGD, {"lr": 0.1})


def _program(slowdown, strategy, batches):
    torch.manual_seed(0)
    return fxpar.parallelize(MLP(layers=2).double(), fxpar.ClusterSpec.local(2, slowdown=slowdown), batches[0],
                             loss_fn=F.mse_loss, optimizer=SGD, strategy=strategy)


@pytest.mark.structure
def test_slowdown_json_round_trip_and_checks():
    spec = fxpar.ClusterSpec.local(4, slowdown={3: 2.0, 1: 1.5})
    assert spec.slowdown == ((1, 1.5), (3, 2.0)) and spec.slowdown_of(3) == 2.0 and spec.slowdown_of(0) == 1.0
    assert fxpar.ClusterSpec.from_json(spec.to_json()) == spec and "rank 3 2x slower" in str(spec)
    assert spec.with_world_size(2).slowdown == ((1, 1.5),)
    with pytest.raises(fxpar.errors.ClusterSpecError, match=r"rank 1's factor 0.5 must be a number >= 1"):
        fxpar.ClusterSpec.local(2, slowdown={1: 0.5})
    with pytest.raises(fxpar.errors.ClusterSpecError, match=r"rank 4 is not a worker rank \(0..3\)"):
        fxpar.ClusterSpec.local(4, slowdown={4: 2.0})


@pytest.mark.cost
def test_estimate_waits_for_the_straggler():
    """Synchronous dp, rank 1 twice as slow: its compute doubles, the step grows by one compute (the straggler's
    compute plus the all-reduce), and rank 0 idles waiting for it."""
    batches = mlp_batches(1)
    fast = _program({}, fxpar.Strategy(dp=2), batches).estimate()
    slow = _program({1: 2.0}, fxpar.Strategy(dp=2), batches).estimate()
    c0, c1 = slow.ranks[0].compute_time_s, slow.ranks[1].compute_time_s
    assert c0 == pytest.approx(fast.ranks[0].compute_time_s) and c1 == pytest.approx(2 * c0)
    assert slow.step_time_s == pytest.approx(fast.step_time_s + c0, rel=1e-6)
    assert slow.ranks[1].idle_s == pytest.approx(fast.ranks[1].idle_s, rel=1e-6)      # the straggler waits for no one
    assert slow.ranks[0].idle_s > fast.ranks[0].idle_s + 0.5 * c0                      # the other waits for it


@pytest.mark.serial
@pytest.mark.numerics
def test_a_slowed_rank_computes_longer(clusters):
    """Local SGD (no gradient collective between averagings), rank 1 four times as slow: its compute actions take
    far longer than rank 0's; the math is unchanged."""
    batches = mlp_batches(6)
    method = S.LocalSGD(period=100)
    base = _program({}, fxpar.Strategy(dp=2, sync=method), batches).run_local(batches, cluster=clusters.get(2))
    res = _program({1: 4.0}, fxpar.Strategy(dp=2, sync=method), batches).run_local(batches, cluster=clusters.get(2))
    assert res.losses == base.losses

    def compute_s(rank):        # the FULL actions of the steps after the first (which averages)
        return sum(v[0] for w in res.action_times[rank][1:] for (kind, _), v in w.items() if kind == "FULL")
    assert compute_s(1) > 2.0 * compute_s(0), (compute_s(0), compute_s(1))


def _shared(cluster, share: float):
    """``cluster`` whose ranks share the cores: each computes on ``share`` of one (``DeviceSpec.core_share``)."""
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, core_share=share))


@pytest.mark.cost
def test_a_straggler_on_shared_cores_sleeps_its_cpu_seconds():
    """The harness sleeps ``factor - 1`` times an action's CPU seconds; where each rank computes on half a core, its
    compute's wall seconds are twice its CPU seconds, so a 2x straggler's compute takes 1.5x, not 2x, and the step
    grows by half a compute. ``core_share`` round-trips through JSON and is checked."""
    batches = mlp_batches(1)
    fast = _program({}, fxpar.Strategy(dp=2), batches).estimate()
    torch.manual_seed(0)
    cluster = _shared(fxpar.ClusterSpec.local(2, slowdown={1: 2.0}), 0.5)
    slow = fxpar.parallelize(MLP(layers=2).double(), cluster, batches[0], loss_fn=F.mse_loss, optimizer=SGD,
                             strategy=fxpar.Strategy(dp=2)).estimate()
    c0, c1 = slow.ranks[0].compute_time_s, slow.ranks[1].compute_time_s
    assert c0 == pytest.approx(fast.ranks[0].compute_time_s) and c1 == pytest.approx(1.5 * c0)
    assert slow.step_time_s == pytest.approx(fast.step_time_s + 0.5 * c0, rel=1e-6)
    assert straggler_factor(2.0, cluster.device) == 1.5 and straggler_factor(3.0, _shared(cluster, 1.0).device) == 3.0
    assert straggler_factor(1.0, cluster.device) == 1.0
    assert fxpar.ClusterSpec.from_json(cluster.to_json()).device.core_share == 0.5
    for bad in (0.0, 1.5):
        with pytest.raises(fxpar.errors.ClusterSpecError, match="core_share"):
            _shared(cluster, bad)


def _dabmd(method, slowdown=None, world=4):
    torch.manual_seed(0)
    cluster = fxpar.ClusterSpec.local(world, slowdown=slowdown or {})
    return fxpar.parallelize(MLP(layers=2).double(), cluster, mlp_batches(1, batch=32)[0], loss_fn=F.mse_loss,
                             optimizer=SGD, strategy=fxpar.Strategy(dp=world, microbatches=4, sync=method))


@pytest.mark.cost
def test_dabmd_estimate_prices_the_microbatches_each_ranks_speed_admits():
    """DABMD's budget in estimate(): rank 3 of 4 twice as slow, a budget of 4.5 fast microbatches: the fast ranks
    take all 4 microbatches, the straggler floor(4.5 / 2) = 2 -- the same step, to the last digit, as
    fixed_microbatches=(4, 4, 4, 2); the round is shorter than pricing every microbatch; the estimate and explain()
    say how many microbatches and samples each rank takes per round."""
    every = _dabmd(S.DABMD(round_time_s=None, fixed_microbatches=(4, 4, 4, 4)), {3: 2.0}).estimate()
    mb = every.work_time_s(0, lambda label: label[:1] in ("F", "B")) / 4         # one fast microbatch's F + B
    assert every.work_time_s(3, lambda label: label[:1] in ("F", "B")) / 4 == pytest.approx(2 * mb)
    budget = _dabmd(S.DABMD(round_time_s=4.5 * mb), {3: 2.0})
    est = budget.estimate()
    fixed = _dabmd(S.DABMD(round_time_s=None, fixed_microbatches=(4, 4, 4, 2)), {3: 2.0}).estimate()
    assert est.step_time_s == fixed.step_time_s < every.step_time_s
    assert [r.compute_time_s for r in est.ranks] == [r.compute_time_s for r in fixed.ranks]
    assert est.ranks[3].compute_time_s == pytest.approx(every.ranks[3].compute_time_s - 2 * 2 * mb)
    labels = [label for label, _, _ in est.actions(3)]
    assert labels == ["F0.0", "B0.0", "F0.1", "B0.1", "RG0", "STEP0"], labels
    # 32 rows over dp=4 and 4 microbatches: 2 samples each
    assert "ranks 0-2: 4 of 4 microbatch(es), 8 samples per round" in est.notes[0]
    assert "rank 3: 2 of 4 microbatch(es), 4 samples per round" in est.notes[0]
    assert est.notes[0] in budget.explain()
    # no straggler, the same budget: every rank takes its whole shard, the step is the one of every microbatch
    whole = _dabmd(S.DABMD(round_time_s=4.5 * mb)).estimate()
    assert whole.step_time_s == _dabmd(S.DABMD(round_time_s=None, fixed_microbatches=(4, 4, 4, 4))).estimate().step_time_s


@pytest.mark.structure
def test_dabmd_microbatches_taken_follow_the_runtime_rule():
    """Microbatch j >= 1 is taken while (j + 1) x its seconds fit the budget: floor(budget / seconds), at least one,
    at most all; fixed counts are taken as given."""
    m = S.DABMD(round_time_s=1.0)
    assert [m.taken(0, t, 4) for t in (0.2, 0.25, 0.3, 0.34, 0.5, 0.51, 2.0)] == [4, 4, 3, 2, 2, 1, 1]
    assert S.DABMD(round_time_s=None, fixed_microbatches=(3, 1)).taken(1, 0.5, 4) == 1
