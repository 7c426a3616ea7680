"""fxpar.tools.calibrate: two gloo ranks on 127.0.0.1 give a valid ClusterSpec."""
import pytest

from fxpar.tools.calibrate import fit_alpha_beta, index_row_overhead
from fxpar.cluster import ClusterSpec

pytestmark = [pytest.mark.cost, pytest.mark.serial]      # it measures the machine


def test_fit_recovers_ring_alpha_beta():
    n, alpha, bw = 4, 20e-6, 2e9
    sizes = [1e3, 1e5, 1e6, 1e7]
    times = [2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw for s in sizes]
    a, b = fit_alpha_beta(sizes, times, n)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)


@pytest.mark.slow
def test_calibrate_two_local_ranks():
    spec, raw = ClusterSpec.calibrate(world_size=2, sizes=(4 << 10, 1 << 20, 4 << 20), reps=3, threads=1,
                                      return_measurements=True)
    assert raw["threads"] == 1                     # measured with the threads the planned ranks will use
    assert spec.world_size == 2 and spec.backend == "gloo"
    assert 1e8 < spec.intra_node.bandwidth < 1e12 and 0 <= spec.intra_node.latency < 5e-3
    assert 1e8 < spec.device.peak_flops < 1e13 and spec.device.mem_bandwidth > 1e8
    assert 0 < spec.device.efficiency["softmax"] <= 1 and spec.device.efficiency["matmul"] == 1.0
    eff, c = spec.device.efficiency, raw["compute"]
    assert eff["transcendental_backward"] == pytest.approx(min(1.0, c["softmax_numel"] / (spec.device.peak_flops *
                                                                                     c["gelu_backward_s"])))
    assert ClusterSpec.from_json(spec.to_json()) == spec
    assert 0 <= spec.device.late_recv_s < 0.1
    assert 0 < spec.device.collective_issue_s < 0.05       # measured: a functional collective's call, before its wait
    assert set(raw["in_step"]) == {"all_reduce", "all_gather", "pair"} and raw["in_step"]["all_reduce"] > 0
    assert spec.device.collective_slots == raw["collective_slots"] in (1, 2)   # the pair measured: one or two at once
    import os
    cpu = raw["comm_cpu"]                           # gloo's threads' CPU per all_reduce, from /proc (Linux)
    full = 2 * 1 >= (os.cpu_count() or 1)           # 2 ranks x 1 thread fill the cores: it is compute's time
    if cpu is None:                                 # no schedstat here: nothing measured, nothing charged
        assert spec.device.comm_cpu_s == spec.device.comm_cpu_per_byte == 0.0
    else:
        assert cpu["per_collective_s"] >= 0 and cpu["per_byte_s"] >= 0 and len(cpu["samples"]) == 2
        assert spec.device.comm_cpu_s == (cpu["per_collective_s"] if full else 0.0)
    # what a transfer took from the compute it overlapped: 1 and 4 MiB in flight beside a block of compute that hid them
    over = raw["overlap_cpu"]
    assert [s for s, _ in over["samples"]] == [1 << 20, 4 << 20] and over["per_byte_s"] >= 0
    assert over["hidden"] < 1e-3                    # the block outlasted the transfer: the wait after it is free
    assert spec.device.comm_cpu_per_byte == (over["per_byte_s"] if full else 0.0)
    # fxpar's runtime per graph call, in per-op units scaled by the per-op cost measured with every rank running
    assert raw["action_overhead_ops"] > 0
    # the share of a core a rank's compute ran on: 2 ranks x 1 thread on at least 2 cores have one each
    assert spec.device.core_share == pytest.approx(c["core_share"]) and 0 < c["core_share"] <= 1
    if (os.cpu_count() or 1) >= 2:
        assert c["core_share"] == 1.0
    assert spec.device.action_overhead_s == pytest.approx(raw["action_overhead_ops"] * spec.device.op_overhead_s)
    assert spec.intra_node.latency == raw["alpha"] and raw["alpha_fit"] >= 0   # α as a step sees it, the fit kept
    # ops after a collective against back to back, per kind of op; the in-step loops' adds ran cold, not the collective
    cold = raw["cold_ops"]
    assert cold["kinds"] == 20 and cold["back_to_back"] > 0
    assert spec.device.cold_op_s == raw["cold_op_s"] == pytest.approx(
        max(0.0, cold["after_collective"] - cold["back_to_back"]) / 20)
    assert raw["in_step"]["pair"] == pytest.approx(max(0.0, raw["in_step_measured"]["pair"] - 2 * raw["cold_op_s"]))
    # index_add_ of random rows into a table larger than the caches: its time beyond the bytes, per row
    from fxpar.tools.probes import INDEX_ROWS as _INDEX_ROWS, INDEX_TABLE as _INDEX_TABLE
    beyond = c["index_add_s"] - (3 * _INDEX_ROWS * _INDEX_TABLE[1] * 4 + _INDEX_ROWS * 8) / c["add_bytes_per_s"]
    assert c["index_add_s"] > 0 and spec.device.index_row_s == index_row_overhead(c) == \
        pytest.approx(max(0.0, beyond) / _INDEX_ROWS)


def test_alpha_is_what_a_small_collective_costs_in_a_step():
    """``link_spec``: the bandwidth from the fit's slope, α from the small collectives measured back to back
    (``in_step_alpha``), so that the cost model's 1 KiB all_reduce in a graph -- issue on the rank's timeline,
    then 2(N-1)α + bytes/B on the link -- takes what was measured."""
    import torch

    from cost_models import estimate
    from fxpar.tools.calibrate import in_step_alpha, link_spec
    from dataclasses import replace
    from fxpar.meta import CommInfo
    n, issue, a, bw, fit_alpha = 2, 80e-6, 400e-6, 1e9, 30e-6
    in_step = {"all_reduce": issue + 2 * (n - 1) * a, "all_gather": issue + (n - 1) * a}
    assert in_step_alpha(in_step, issue, n) == pytest.approx(a)
    assert in_step_alpha({"all_reduce": 50e-6}, issue, n) == 0.0          # never below zero
    sizes = [4096, 1 << 20, 4 << 20]
    raw = {"all_reduce": [(s, 2 * (n - 1) * fit_alpha + 2 * (n - 1) / n * s / bw) for s in sizes],
           "collective_issue_s": issue, "in_step": in_step}
    link = link_spec(raw, n)
    assert link.bandwidth == pytest.approx(bw) and link.latency == pytest.approx(a)
    assert raw["alpha_fit"] == pytest.approx(fit_alpha) and raw["alpha"] == link.latency
    assert link_spec({"all_reduce": raw["all_reduce"]}, n).latency == pytest.approx(fit_alpha)   # no in-step figure

    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(256)
    y = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    y.meta["val"], y.meta["fxpar_comm"] = torch.empty(256), CommInfo("all_reduce", "dp", (0, 1), 1024)
    z = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (y,))
    z.meta["val"] = torch.empty(256)
    g.output(z)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    spec = ClusterSpec.local(2)
    spec = replace(spec, intra_node=link, device=replace(spec.device, collective_issue_s=issue))
    step = estimate({0: gm, 1: gm}, spec).step_time_s
    assert step == pytest.approx(in_step["all_reduce"] + 1024 / bw, rel=1e-6)


def test_late_recv_overhead_is_the_mean_wait_less_the_transfer():
    from fxpar.tools.calibrate import late_recv_overhead
    from fxpar.cluster import LinkSpec
    link = LinkSpec(1e9, 50e-6)
    waits = [0.2e-3, 0.4e-3, 6.0e-3]                   # heavy-tailed: the mean, not the median
    assert late_recv_overhead(waits, 100_000, link) == pytest.approx(2.2e-3 - 50e-6 - 1e-4)
    assert late_recv_overhead([1e-5], 100_000, link) == 0.0
    assert late_recv_overhead([], 100_000, link) == 0.0


def test_late_recv_s_round_trips_and_is_checked():
    from dataclasses import replace
    from fxpar.errors import ClusterSpecError
    spec = ClusterSpec.local(2)
    spec = replace(spec, device=replace(spec.device, late_recv_s=3e-3))
    assert ClusterSpec.from_json(spec.to_json()).device.late_recv_s == 3e-3
    with pytest.raises(ClusterSpecError, match="late_recv_s"):
        replace(spec, device=replace(spec.device, late_recv_s=-1.0))


def test_collective_issue_cost_is_on_the_compute_lane_once_per_collective():
    """``DeviceSpec.collective_issue_s``: the node that issues a collective costs it on the compute lane, its wait
    nothing there (the wait is the link's time, cost_models.comm); it round-trips and is checked."""
    from dataclasses import replace

    import torch

    from cost_models.compute import graph_compute
    from fxpar.errors import ClusterSpecError
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    z = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (y,))
    g.output(z)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    spec = ClusterSpec.local(2)
    spec = replace(spec, device=replace(spec.device, collective_issue_s=1e-4))
    times = graph_compute(gm, spec.device).times
    assert times[y] == 1e-4 and times[z] == 0.0
    assert ClusterSpec.from_json(spec.to_json()).device.collective_issue_s == 1e-4
    with pytest.raises(ClusterSpecError, match="collective_issue_s"):
        replace(spec, device=replace(spec.device, collective_issue_s=-1.0))


def test_rank_cores_split_the_machine_evenly():
    """``calibrate(pin=True)`` and the netns harness's ``pin``: rank r gets the r-th equal run of cores, or core
    r % cores when there are more ranks than cores."""
    from fxpar.tools.calibrate import rank_cores
    assert [rank_cores(r, 2, cores=16) for r in range(2)] == [set(range(8)), set(range(8, 16))]
    assert [rank_cores(r, 2, cores=2) for r in range(2)] == [{0}, {1}]
    assert [rank_cores(r, 4, cores=2) for r in range(4)] == [{0}, {1}, {0}, {1}]
    assert rank_cores(2, 3, cores=8) == {4, 5}          # 8 // 3 = 2 cores each; core 6, 7 left over


def test_shared_cores_time_a_loop_not_single_calls():
    """Where the ranks share the cores, ``_time_shared`` reports a loop's wall time over its calls (each rank's share
    of the cores: a single call often fits in one time slice and runs on a core of its own), not a median of calls:
    calls of 1 ms and 5 ms in turn give 3 ms."""
    import itertools
    import time

    from fxpar.tools.probes import time_shared as _time_shared
    turns = itertools.cycle([0.001, 0.005])
    got = _time_shared(lambda: time.sleep(next(turns)), seconds=0.3)
    assert 0.0028 < got < 0.0045        # the mean (3 ms, plus sleep's overshoot); a median would be 1 or 5 ms
