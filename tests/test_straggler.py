"""The straggler harness: ``ClusterSpec(slowdown={rank: factor})`` slows a rank's compute on the ranks and in
``estimate()``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import sync as S
from fxpar.testing import MLP
from fxpar.testing.compress import mlp_batches

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
