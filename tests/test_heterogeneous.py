"""A heterogeneous ClusterSpec priced per rank: each rank's compute on its own device, each rank's peak against its
own memory, and the choices made once for all ranks (ByteScheduler's pieces, Herring's bucket size, Tofu's sharding,
the pipeline cut's price of a byte) on the slowest device.

Per rank: on a fast and a half-speed device, ``estimate()`` costs each rank as the cluster of its device alone does,
and the step is the slow rank's; a rank whose peak exceeds its own (smaller) memory is the one ``explain()`` and
Wavelet's check name; a late receive costs its sender's ``late_recv_s``. Once for all: ByteScheduler, Herring and
Tofu decide on a mixed cluster exactly as on a cluster of its slowest device. A cluster of equal devices given one
per rank estimates and plans as the homogeneous cluster of that device.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import fxpar
from cost_models import estimate
from fxpar.cluster import ClusterSpec, DeviceSpec
from fxpar.features.pipeline import flops_per_byte
from fxpar.testing import MLP
from test_cost_simulate import _cluster, _program

FAST = DeviceSpec("cpu", "fast", 8 * 2**30, 100e9, 20e9)
HALF = DeviceSpec("cpu", "half", 8 * 2**30, 50e9, 10e9)          # half the FLOP/s and the memory bandwidth
SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2})


def _mlp():
    torch.manual_seed(0)
    return MLP(d_in=64, hidden=64, d_out=64, layers=6).double()


def _batch(n=16):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 64, dtype=torch.float64, generator=g), torch.randn(n, 64, dtype=torch.float64, generator=g))


def _prog(cluster, opt=SGD_M, **strategy):
    return fxpar.parallelize(_mlp(), cluster, _batch(), F.mse_loss, opt, strategy=fxpar.Strategy(**strategy))


def _alike(device, world=2, **kw):
    """The homogeneous cluster of ``device`` with the links ``ClusterSpec.heterogeneous`` gives."""
    return ClusterSpec.local(world, device=device, **kw)


@pytest.mark.structure
def test_slowest_and_distinct_devices_fold_stragglers_in():
    c = ClusterSpec.heterogeneous([FAST, HALF, FAST, FAST])
    assert c.devices_of() == [FAST, HALF] and c.devices_of([0, 2]) == [FAST]
    assert c.slowest_device() is HALF and c.slowest_device([2, 3]) is FAST
    slowed = ClusterSpec.local(2, device=FAST, slowdown={1: 4.0})
    assert slowed.slowest_device().peak_flops == FAST.peak_flops / 4 == slowed.speed_of(1)
    assert [d.peak_flops for d in slowed.devices_of()] == [FAST.peak_flops, FAST.peak_flops / 4]
    plain = ClusterSpec.local(2)
    assert plain.devices_of() == [plain.device] and plain.slowest_device() is plain.device
    # the cut's price of a received byte: the slowest device's FLOP/s; with per-stage speeds, the fastest stage's
    bw = c.intra_node.bandwidth
    assert flops_per_byte(c) == HALF.peak_flops / bw
    assert flops_per_byte(c, [100e9, 50e9]) == 100e9 / bw and flops_per_byte(None) == 0.0


@pytest.mark.cost
def test_estimate_costs_each_rank_on_its_own_device_and_the_step_is_the_slow_ranks():
    mixed = _prog(ClusterSpec.heterogeneous([FAST, HALF]), dp=2).estimate()
    fast, half = (_prog(_alike(d), dp=2).estimate() for d in (FAST, HALF))
    assert mixed.ranks[0].compute_time_s == pytest.approx(fast.ranks[0].compute_time_s, rel=1e-12)
    assert mixed.ranks[1].compute_time_s == pytest.approx(half.ranks[1].compute_time_s, rel=1e-12)
    assert mixed.ranks[1].compute_time_s == pytest.approx(2 * mixed.ranks[0].compute_time_s, rel=1e-12)
    assert max(mixed.ranks, key=lambda r: r.end_time_s).rank == 1
    assert mixed.step_time_s == pytest.approx(half.step_time_s, rel=1e-12)       # synchronous: the slow rank's
    assert mixed.ranks[0].idle_s > mixed.ranks[1].idle_s


@pytest.mark.structure
def test_the_rank_over_its_own_memory_is_named():
    peak = _prog(_alike(FAST), dp=2).estimate().ranks[1].peak_memory_bytes
    small = DeviceSpec("cpu", "small", int(peak) - 1, 100e9, 20e9)
    prog = _prog(ClusterSpec.heterogeneous([FAST, small]), dp=2)
    text = prog.explain()
    assert "of rank 1 exceeds" in text and "of its small (1 rank(s) over their device's memory)" in text
    waves = _prog(ClusterSpec.heterogeneous([FAST, small]), dp=2, schedule="wavelet")
    assert waves.estimate().ranks[1].peak_memory_bytes > small.memory_bytes
    with pytest.raises(fxpar.StrategyError, match=r"the two waves do not fit: rank 1's combined peak .*"
                                                  r"\(ClusterSpec\.devices\[1\], small\.memory_bytes="):
        waves.run_local([_batch()])


@pytest.mark.cost
def test_a_late_receive_costs_its_senders_late_recv_s():
    """Rank 0 sends, then computes two matmuls; rank 1 posts the receive after one: the receive is late while the
    sender computes, and the message takes the sender's device's ``late_recv_s`` longer, not the receiver's."""
    late = 2e-3
    a, b = _program(["send:0:1", "mm", "mm", "wait"]), _program(["mm", "recv:0:1", "wait"])
    base = _cluster()

    def comm(l0, l1):
        devices = (replace(base.device, late_recv_s=l0), replace(base.device, late_recv_s=l1))
        return estimate({0: a, 1: b}, replace(base, devices=devices)).ranks[1].comm_time_s
    plain = estimate({0: a, 1: b}, base).ranks[1].comm_time_s
    assert comm(0.0, 0.0) == pytest.approx(plain)
    assert comm(late, 0.0) == pytest.approx(plain + late)            # the sender's figure
    assert comm(0.0, late) == pytest.approx(plain)                   # not the receiver's


@pytest.mark.cost
def test_bytescheduler_tunes_on_the_slowest_device():
    mixed, half, fast = (_prog(c, ADAMW, dp=2, comm_schedule="bytescheduler").plan.section("bytescheduler").stages[0]
                         for c in (ClusterSpec.heterogeneous([FAST, HALF]), _alike(HALF), _alike(FAST)))
    for key in ("predicted_step_s", "fifo_predicted_step_s", "partition_bytes", "credit_bytes", "pieces", "events"):
        assert mixed[key] == half[key], key
    assert mixed["predicted_step_s"] > fast["predicted_step_s"]       # compute twice as long, the same link


@pytest.mark.cost
def test_herring_sizes_buckets_on_the_slowest_device():
    mixed, half, fast = (_prog(c, dp=4, grad_sync="herring").plan.section("herring").bucket_choice
                         for c in (ClusterSpec.heterogeneous([FAST, FAST, FAST, HALF], nodes=2),
                                   _alike(HALF, 4, nodes=2, devices_per_node=2),
                                   _alike(FAST, 4, nodes=2, devices_per_node=2)))
    assert mixed == half
    assert all(mixed["tried"][mb] > fast["tried"][mb] for mb in mixed["tried"])


@pytest.mark.cost
def test_tofu_prices_compute_on_the_slowest_device():
    mixed, half, fast = (_prog(c, tp=2, sharding="auto").plan.section("tensor_parallel").stages[0]
                         for c in (ClusterSpec.heterogeneous([HALF, FAST]), _alike(HALF), _alike(FAST)))
    assert mixed["predicted_s"] == half["predicted_s"] > fast["predicted_s"]
    assert mixed["auto"] == half["auto"]


@pytest.mark.cost
@pytest.mark.parametrize("strategy", [dict(dp=2, comm_schedule="bytescheduler"), dict(pp=2, microbatches=4),
                                      dict(tp=2, sharding="auto")], ids=["bytescheduler", "1f1b", "tofu"])
def test_equal_devices_one_per_rank_are_the_homogeneous_cluster(strategy):
    given, homogeneous = (_prog(c, ADAMW, **strategy) for c in (ClusterSpec.heterogeneous([HALF, HALF]), _alike(HALF)))
    assert given.plan.cuts == homogeneous.plan.cuts
    a, b = given.estimate(), homogeneous.estimate()
    assert a.step_time_s == b.step_time_s
    assert [(r.compute_time_s, r.comm_time_s, r.peak_memory_bytes) for r in a.ranks] == \
        [(r.compute_time_s, r.comm_time_s, r.peak_memory_bytes) for r in b.ranks]
