"""HetPipe (``Strategy(dp=k, pp=p, schedule="hetpipe", staleness=D)``) and heterogeneous clusters.

Heterogeneous ClusterSpec: JSON round trip; a straggler's slowdown is the same cluster as its ``as_heterogeneous()``
(the same estimate, the same cut); ``estimate()`` costs a rank on its own device. Cut: on unequal devices the
speed-aware cut balances the stages' times (dry run and ``program.estimate()``) where the FLOP-balanced cut does not;
a device too small for any stage is refused by name. Reduction: D = 0 on equal devices is synchronous dp x pp,
float64 to 1e-10 against one process. WSP: with a straggler and D = 1, the run equals the one-process replay of the
servers' recorded waves (``fxpar.testing.hetpipe.wsp_reference``), every read within the bound. D = 0 resumes
bitwise, and runs under torchrun with its servers as the last ranks, equal to run_local bitwise.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.cluster import DeviceSpec
from fxpar.schedule import simulate
from fxpar.schedule.hetpipe import hetpipe, may_start, stage_times
from fxpar.testing import MLP, max_abs_diff, reference_training
from fxpar.testing.compress import mlp_batches
from fxpar.testing.hetpipe import wsp_reference, wsp_violations
from fxpar.testing.resume import assert_resume_is_exact
from test_sync_ssp import torchrun_ssp

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
FAST = DeviceSpec("cpu", "fast", 8 * 2**30, 100e9, 20e9)
SLOW = DeviceSpec("cpu", "slow", 4 * 2**30, 50e9, 10e9)


def _wide():
    torch.manual_seed(0)
    return MLP(d_in=128, hidden=128, d_out=128, layers=12).double()


def _wide_batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(32, 128, dtype=torch.float64, generator=g), torch.randn(32, 128, dtype=torch.float64, generator=g))


def _hetpipe(model, batch, cluster, microbatches=4, optimizer=SGD_M, **options):
    return fxpar.parallelize(model, cluster, batch, loss_fn=F.mse_loss, optimizer=optimizer,
                             strategy=fxpar.Strategy(dp=2, pp=2, microbatches=microbatches, schedule="hetpipe",
                                                     **options))


@pytest.mark.structure
def test_heterogeneous_cluster_round_trips_and_reads_per_rank():
    c = fxpar.ClusterSpec.heterogeneous([FAST, SLOW, FAST, SLOW], cpu_servers=2)
    assert fxpar.ClusterSpec.from_json(c.to_json()) == c
    assert [c.device_of(r).name for r in range(4)] == ["fast", "slow", "fast", "slow"]
    assert c.speed_of(1) == 50e9 and c.run_slowdown(1) == 2.0 and c.run_slowdown(0) == 1.0
    assert "2 fast (8 GiB, 0.1 TFLOP/s) + 2 slow (4 GiB, 0.05 TFLOP/s)" in str(c)
    slowed = fxpar.ClusterSpec.local(4, slowdown={3: 2.0})
    h = slowed.as_heterogeneous()
    assert h.slowdown == () and h.speed_of(3) == slowed.speed_of(3) == slowed.device.peak_flops / 2
    assert h.run_slowdown(3) == slowed.run_slowdown(3) == 2.0


@pytest.mark.cost
def test_straggler_and_its_heterogeneous_cluster_estimate_and_cut_alike():
    """``local(4, slowdown={2: 2, 3: 2})`` and its ``as_heterogeneous()``: the same cuts, the same estimate; the
    slow ranks' compute costed on their own (slower) device."""
    model, batch = _wide(), _wide_batch()
    slowed = fxpar.ClusterSpec.local(4, slowdown={2: 2.0, 3: 2.0}, cpu_servers=2)
    a, b = (_hetpipe(model, batch, cl) for cl in (slowed, slowed.as_heterogeneous()))
    assert a.plan.cuts == b.plan.cuts
    ea, eb = a.estimate(), b.estimate()
    assert ea.step_time_s == pytest.approx(eb.step_time_s, rel=1e-12)
    for ra, rb in zip(ea.ranks, eb.ranks):
        assert ra.compute_time_s == pytest.approx(rb.compute_time_s, rel=1e-12)
    equal = _hetpipe(model, batch, fxpar.ClusterSpec.local(4, cpu_servers=2), split_points=a.plan.cuts).estimate()
    assert eb.ranks[2].compute_time_s > 1.9 * equal.ranks[2].compute_time_s     # stage 1 on the half-speed device


@pytest.mark.cost
def test_speed_aware_cut_balances_stage_times_flop_cut_does_not():
    """Stage 1's devices are 2x slower. The speed-aware cut's stage times (FLOPs / device FLOP/s) are within 15% of
    each other (a block is 1/13 of the work, and the cut also pays for the activations it sends); the FLOP-balanced
    cut's differ by more than 50%. The dry run of the wave and program.estimate()
    agree: the speed-aware program's step is shorter."""
    model, batch = _wide(), _wide_batch()
    cluster = fxpar.ClusterSpec.heterogeneous([FAST, FAST, SLOW, SLOW], cpu_servers=2)
    prog = _hetpipe(model, batch, cluster, microbatches=8)
    sec = prog.plan.section("hetpipe")
    assert sec.stage_speed == [100e9, 50e9] and sec.imbalance() <= 0.15
    assert fxpar.Plan.from_json(prog.plan.to_json()).section("hetpipe") == sec
    naive = _hetpipe(model, batch, cluster, microbatches=8, split_points=sec.flop_cuts)
    assert naive.plan.cuts != prog.plan.cuts
    nsec = naive.plan.section("hetpipe")
    assert nsec.imbalance() > 0.5
    bal = simulate(hetpipe(2, 8), **dict(zip("FB", stage_times(sec.stage_flops, sec.stage_speed))))
    flop = simulate(hetpipe(2, 8), **dict(zip("FB", stage_times(nsec.stage_flops, nsec.stage_speed))))
    assert flop.makespan > 1.3 * bal.makespan
    assert naive.estimate().step_time_s > 1.15 * prog.estimate().step_time_s
    assert "longer than the fastest; the FLOP-balanced cut would be ['layers" in prog.explain()


@pytest.mark.structure
def test_device_too_small_for_any_stage_is_named():
    model, batch = _wide(), _wide_batch()
    tiny = DeviceSpec("cpu", "tiny", 2**16, 50e9, 10e9)
    cluster = fxpar.ClusterSpec.heterogeneous([FAST, FAST, tiny, tiny], cpu_servers=2)
    with pytest.raises(fxpar.StrategyError, match=r"stage 1's device tiny \(rank 2\) has 65536 bytes of memory, "
                                                  r"less than the smallest stage any cut makes \(the one from "
                                                  r"'out' to the loss\).*take \d+ bytes.*use more "
                                                  r"stages \(pp\)"):
        _hetpipe(model, batch, cluster)


@pytest.mark.structure
def test_wsp_rule_and_its_replay_checks():
    assert may_start([3, 1], 2, 1) and not may_start([3, 1], 3, 1) and may_start([2, 2], 2, 0)
    log = [("push", 0, 0), ("push", 1, 0), ("read", 0, 1, 1, 0), ("push", 0, 1), ("read", 0, 2, 1, 0)]
    assert wsp_violations(log, 2, 1) == [] and wsp_violations(log, 2, 0) == [(0, 2, 1)]


@pytest.mark.numerics
def test_staleness_zero_on_equal_devices_is_synchronous_dp_x_pp(clusters):
    """D = 0, equal devices, dp=2 x pp=2, SGD-momentum: the losses and parameters of one process, to 1e-10; every
    read waited for every virtual worker's previous wave."""
    torch.manual_seed(0)
    model, batches = MLP(layers=4).double(), mlp_batches(3)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(4, cpu_servers=2), batches[0], loss_fn=F.mse_loss,
                             optimizer=SGD_M, strategy=fxpar.Strategy(dp=2, pp=2, microbatches=2, schedule="hetpipe"))
    res = prog.run_local(batches, cluster=clusters.get(6))
    losses, state = reference_training(model, batches, F.mse_loss, SGD_M)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    got = res.state_dict()
    assert sorted(got) == sorted(state)
    for k, v in state.items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-10, msg=k)
    for r in range(4):
        assert all(c == fresh for c, fresh, _, _ in res.features[r]["sync"]["reads"])


@pytest.mark.slow
@pytest.mark.numerics
def test_resume_at_staleness_zero_is_bitwise(clusters, tmp_path):
    """D = 0, dp=2 x pp=2, two servers (one per stage), SGD-momentum: 2 waves, save, resume, 2 waves equals 4 waves
    bitwise, every virtual worker's own stage included; each stage's servers went on from clock 2."""
    torch.manual_seed(0)
    model, batches = MLP(layers=4).double(), mlp_batches(4)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(4, cpu_servers=2), batches[0], loss_fn=F.mse_loss,
                             optimizer=SGD_M, strategy=fxpar.Strategy(dp=2, pp=2, microbatches=2, schedule="hetpipe"))
    lc = clusters.get(6)
    whole, _, second = assert_resume_is_exact(prog, batches, 2, lc, tmp_path / "ck")
    for r in range(4):
        assert max_abs_diff(second.features[r]["sync"]["replica"], whole.features[r]["sync"]["replica"]) == 0
    servers = [second.servers[r] for r in sorted(second.servers)]
    assert [s["start_clock"] for s in servers] == [2, 2] and [s["steps"] for s in servers] == [4, 4]


@pytest.mark.slow
@pytest.mark.numerics
def test_stale_waves_equal_the_wsp_replay(clusters):
    """D = 1, virtual worker 1's devices 3x slower: the run's losses and final parameters equal the one-process WSP
    replay of the servers' logs, every read within the bound, and some read was stale."""
    torch.manual_seed(0)
    model, batches = MLP(layers=4).double(), mlp_batches(6)
    cluster = fxpar.ClusterSpec.local(4, cpu_servers=2, slowdown={1: 3.0, 3: 3.0})
    prog = fxpar.parallelize(model, cluster, batches[0], loss_fn=F.mse_loss, optimizer=SGD_M,
                             strategy=fxpar.Strategy(dp=2, pp=2, microbatches=2, schedule="hetpipe", staleness=1))
    res = prog.run_local(batches, cluster=clusters.get(6))
    servers = [res.servers[r] for r in sorted(res.servers)]
    ref = wsp_reference(model, batches, F.mse_loss, SGD_M, 2, [s["log"] for s in servers],
                        [s["keys"] for s in servers], staleness=1)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref["losses"]), rtol=1e-10, atol=1e-10)
    got = res.state_dict()
    for k, v in ref["final"].items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-10, msg=k)
    reads = [r for w in range(4) for r in res.features[w]["sync"]["reads"]]
    assert all(c - fresh <= 1 for c, fresh, _, _ in reads)
    assert any(c - fresh > 0 for c, fresh, _, _ in reads), "no read was stale: the straggler did not slow worker 1"


@pytest.mark.slow
@pytest.mark.numerics
def test_torchrun_with_server_ranks_equals_run_local(clusters, tmp_path):
    """HetPipe D = 0 under torchrun: 2 virtual workers of 2 stages (ranks 0-3) and a parameter server per stage
    (ranks 4, 5): 4 waves equal run_local's bitwise; after loading the checkpoint of wave 2, waves 3 and 4 again give
    the same losses."""
    got, example = torchrun_ssp(tmp_path, 6, "--method", "hetpipe", "--staleness", "0")
    batches = mlp_batches(4)
    _, prog = example.program_for("hetpipe", 0, 6, batches[0])
    res = prog.run_local(batches, cluster=clusters.get(6))
    assert got["losses"] == res.losses and got["again"] == res.losses[2:]
    assert max_abs_diff(got["state"], res.state_dict()) == 0
