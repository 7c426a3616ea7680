"""cost_models.estimate / simulate: hand-built rank programs with known timelines."""
import json

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

import cost_models
from cost_models import DeadlockError, estimate
from fxpar.cluster import ClusterSpec, DeviceSpec, LinkSpec
from fxpar.meta import CommInfo

pytestmark = pytest.mark.cost

N = 64
MM = 1e-3                    # one 64x64 matmul: 2*64**3 FLOPs at 2*64**3*1e3 FLOP/s
ADD = 2 * N * N / (2 * N**3 * 1e3) / 2    # one FLOP per element (4096) at the same peak
AR = 1.5e-3                  # one all_reduce of 16 KiB on 2 ranks: S/B with latency 0
_fake = FakeTensorMode()
aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def _cluster(world=2, per_node=None):
    dev = DeviceSpec("cuda", "toy", 2**30, 2 * N**3 * 1e3, 1e18)
    return ClusterSpec(device=dev, nodes=world // (per_node or world), devices_per_node=per_node or world,
                       intra_node=LinkSpec(16384 / AR, 0.0), inter_node=LinkSpec(16384 / AR / 4, 0.0), backend="nccl")


def _program(steps, ranks=(0, 1)):
    """steps: 'mm', 'ar' (issue all_reduce of the last value), 'wait', 'send:p', 'recv:p'."""
    g = torch.fx.Graph()
    with _fake:
        x = g.placeholder("x")
        x.meta["val"] = torch.empty(N, N)
        last, pending, acc = x, [], None
        for s in steps:
            if s == "mm":
                last = g.call_function(aten.mm.default, (last, x))
                last.meta["val"] = torch.empty(N, N)
            elif s in ("ar",) or s.startswith(("send", "recv")):
                kind = "all_reduce" if s == "ar" else s.split(":")[0]
                grp = ranks if s == "ar" else tuple(int(v) for v in s.split(":")[1:])
                c = g.call_function(c10d.all_reduce.default, (last, "sum", "g"))
                c.meta["val"] = torch.empty(N, N)
                c.meta["fxpar_comm"] = CommInfo(kind, "dp" if s == "ar" else "pp", grp, 16384)
                pending.append(c)
            elif s == "wait":
                w = g.call_function(c10d.wait_tensor.default, (pending.pop(0),))
                w.meta["val"] = torch.empty(N, N)
                acc = w if acc is None else acc
                last = g.call_function(aten.add.Tensor, (last, w))
                last.meta["val"] = torch.empty(N, N)
        g.output(last)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_comm_overlaps_independent_compute():
    gm = _program(["mm", "ar", "mm", "wait"])
    est = estimate({0: gm, 1: gm}, _cluster())
    assert est.symmetric and est.program_classes == 1
    assert est.step_time_s == pytest.approx(MM + max(MM, AR) + ADD)
    r = est.ranks[0]
    assert r.comm_time_s == pytest.approx(AR) and r.compute_time_s == pytest.approx(2 * MM + ADD)
    assert r.overlap_s == pytest.approx(MM)                     # the second mm hides 1 ms of the 1.5
    assert r.comm_bytes == 16384                                 # ring: 2(N-1)/N * S with N=2
    assert r.idle_s == pytest.approx(AR - MM)
    assert "overlapped" in str(est) and "rank 0 (+1 alike)" in str(est)


def test_issuing_a_collective_costs_the_timeline_before_its_transfer():
    """``DeviceSpec.collective_issue_s`` is on the rank's timeline, once per collective, before the transfer
    starts (the call runs on the rank's CPU): the step grows by it, and the compute time counts it."""
    from dataclasses import replace
    issue = 0.4e-3
    cl = _cluster()
    cl = replace(cl, device=replace(cl.device, collective_issue_s=issue))
    gm = _program(["mm", "ar", "wait", "ar", "mm", "wait"])
    est = estimate({0: gm, 1: gm}, cl)
    # mm, issue, AR, add, issue, [AR alongside mm + ...], add
    assert est.step_time_s == pytest.approx(MM + issue + AR + ADD + issue + max(AR, MM) + ADD)
    assert est.ranks[0].compute_time_s == pytest.approx(2 * MM + 2 * ADD + 2 * issue)
    assert est.step_time_s >= est.ranks[0].compute_time_s


def test_gloo_overlaps_two_collectives_latency_not_bytes():
    """gloo runs a group's work on two threads (``cost_models.comm.GLOO_THREADS``): a collective issued while
    another is in flight starts at once, their latencies overlap, their bytes still share the wire; NCCL's one
    stream keeps them one at a time."""
    from dataclasses import replace
    gm = _program(["ar", "ar", "wait", "wait"])

    def step(backend, bandwidth, latency):
        cl = replace(_cluster(), backend=backend, intra_node=LinkSpec(bandwidth, latency))
        return estimate({0: gm, 1: gm}, cl).step_time_s

    lat = 1e-3                                        # latency-bound: 2(N-1)α = 2 ms each, bytes ~0
    assert step("nccl", 1e18, lat) == pytest.approx(2 * 2 * lat + ADD)      # one after the other
    assert step("gloo", 1e18, lat) == pytest.approx(2 * lat + 2 * ADD)      # together
    bw = 16384 / AR                                   # bytes-bound: 1.5 ms each, no latency
    assert step("gloo", bw, 0.0) == pytest.approx(step("nccl", bw, 0.0)) == pytest.approx(2 * AR + ADD)
    # a third one waits for a free thread: it starts when the first ends
    gm3 = _program(["ar", "ar", "ar", "wait", "wait", "wait"])
    cl = replace(_cluster(), backend="gloo", intra_node=LinkSpec(1e18, lat))
    assert estimate({0: gm3, 1: gm3}, cl).step_time_s == pytest.approx(2 * 2 * lat + ADD)
    # where calibrate() found the ranks progress one small collective at a time (DeviceSpec.collective_slots=1:
    # their time is CPU work on full cores), gloo keeps them one after the other too
    one = replace(cl, device=replace(cl.device, collective_slots=1))
    assert estimate({0: gm, 1: gm}, one).step_time_s == pytest.approx(2 * 2 * lat + ADD)


def test_wait_blocks_until_the_slowest_rank_issues():
    fast, slow = _program(["mm", "ar", "wait", "mm"]), _program(["mm", "mm", "mm", "ar", "wait", "mm"])
    est = estimate({0: fast, 1: slow}, _cluster())
    assert not est.symmetric
    start = 3 * MM                                               # rank 1 issues after three matmuls
    assert est.ranks[0].end_time_s == pytest.approx(start + AR + ADD + MM)
    assert est.ranks[1].end_time_s == pytest.approx(start + AR + ADD + MM)
    assert est.ranks[0].idle_s == pytest.approx(est.ranks[0].end_time_s - 2 * MM - ADD)
    assert est.ranks[0].overlap_s == 0


def test_send_recv_pair_and_deadlock_is_named():
    a, b = _program(["mm", "send:0:1", "wait"]), _program(["recv:0:1", "wait", "mm"])
    est = estimate({0: a, 1: b}, _cluster())
    assert est.ranks[1].end_time_s == pytest.approx(MM + AR + ADD + MM)     # p2p: S/B, same as a 2-rank ring
    assert est.ranks[0].comm_bytes == 16384 and est.ranks[1].comm_bytes == 0
    lonely = _program(["mm", "ar", "wait"])
    with pytest.raises(DeadlockError, match=r"rank 0 waits on all_reduce #0 .*ranks not yet issued: \[1\]"):
        estimate({0: lonely, 1: _program(["mm"])}, _cluster())


def test_symmetric_fast_path_equals_full_simulation_across_nodes():
    progs = {r: _program(["mm", "ar", "mm", "ar", "wait", "wait"], ranks=(0, 1, 2, 3)) for r in range(4)}
    cl = _cluster(world=4, per_node=2)
    fast = estimate(progs, cl)                                   # distinct objects, same code: one class
    assert fast.symmetric and fast.program_classes == 1
    full = cost_models.simulate.simulate(
        {r: cost_models.simulate.compile_program(g, cl, {}) for r, g in progs.items()},
        {r: [c.time_s for c in (cost_models.comm_info_cost(i, cl) for i in fast._programs[r].infos)] for r in progs})
    assert all(full[r].end == pytest.approx(fast.step_time_s) for r in progs)
    hier = cost_models.collective_cost("all_reduce", 16384, range(4), cl)
    assert hier.algorithm == "hierarchical"
    assert fast.ranks[3].comm_time_s == pytest.approx(2 * hier.time_s)


def test_timeline_is_valid_chrome_trace(tmp_path):
    gm = _program(["mm", "ar", "mm", "wait"])
    est = estimate({0: gm, 1: gm}, _cluster())
    path = est.timeline(str(tmp_path / "t.json"))
    events = json.load(open(path))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in spans} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    comm = [e for e in spans if e["tid"] == 1]
    assert comm[0]["name"].startswith("all_reduce[dp]") and comm[0]["dur"] == pytest.approx(AR * 1e6)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)


def test_estimate_on_fxpar_data_parallel_graphs():
    import fxpar
    from fxpar.testing import GPT, gpt_loss
    x = torch.randint(0, 64, (4, 16))
    p = fxpar.parallelize(GPT(), fxpar.ClusterSpec.local(2), (x, x), loss_fn=gpt_loss,
                          optimizer=(torch.optim.AdamW, {"lr": 1e-3}), strategy=fxpar.Strategy(dp=2, bucket_cap_mb=0.02))
    graphs = {r: p.graphs(r)["step"] for r in range(2)}
    cl = fxpar.ClusterSpec.local(2)
    est = estimate(graphs, cl)
    infos = [n.meta["fxpar_comm"] for n in graphs[0].graph.nodes if "fxpar_comm" in n.meta]
    assert len(infos) > 1
    assert est.ranks[0].comm_bytes == sum(i.nbytes for i in infos)           # ring, N=2: 2(N-1)/N * S = S
    assert est.ranks[0].comm_time_s == pytest.approx(sum(
        cost_models.ring_all_reduce_time(i.nbytes, 2, cl.intra_node.bandwidth, cl.intra_node.latency) for i in infos))
    assert not est.defaulted                                                 # every op of the step has a rule
    # (1e-12 relative: the simulator and the per-lane totals add the same times in different orders)
    assert est.step_time_s >= max(est.ranks[0].compute_time_s, est.ranks[0].comm_time_s) * (1 - 1e-12)


def test_comm_cpu_is_taken_from_compute_and_the_runtime_costs_each_graph():
    """Where calibrate() found the ranks' threads fill the cores, a collective's own threads run beside its
    transfer on the rank's cores: ``DeviceSpec.comm_cpu_s`` + ``comm_cpu_per_byte`` x its buffer are compute-lane
    time once it is issued, so compute overlapped with it is delayed by that much; a blocking collective costs the
    longer of its transfer and that CPU. ``action_overhead_s``: the runtime's Python around each graph it calls."""
    from dataclasses import replace
    cl, gm = _cluster(), _program(["mm", "ar", "mm", "wait"])
    base = estimate({0: gm, 1: gm}, cl)
    assert base.step_time_s == pytest.approx(MM + max(MM, AR) + ADD)
    cpu = 0.4e-3 + 1e-8 * 16384                      # per collective + per byte of its 16 KiB buffer
    busy = replace(cl, device=replace(cl.device, comm_cpu_s=0.4e-3, comm_cpu_per_byte=1e-8))
    est = estimate({0: gm, 1: gm}, busy)
    assert est.step_time_s == pytest.approx(MM + max(cpu + MM, AR) + ADD)   # the second matmul waits for the CPU
    assert est.ranks[0].compute_time_s == pytest.approx(2 * MM + ADD + cpu)
    blocking = _program(["mm", "ar", "wait"])
    slow = replace(cl, device=replace(cl.device, comm_cpu_s=2e-3))          # CPU longer than the transfer
    assert estimate({0: blocking, 1: blocking}, slow).step_time_s == pytest.approx(MM + 2e-3 + ADD)
    act = replace(cl, device=replace(cl.device, action_overhead_s=0.25e-3))
    assert estimate({0: gm, 1: gm}, act).step_time_s == pytest.approx(base.step_time_s + 0.25e-3)


def test_ops_run_cold_after_communication():
    """``DeviceSpec.cold_op_s``: the first op of each kind after the rank issued or waited on a communication pays it
    (the graph runs every step: a kind repeated with no communication between, around the end too, is warm), and the
    runtime's work around the graph runs cold in the op units of ``action_overhead_s``."""
    from dataclasses import replace

    from cost_models.simulate import cold_ops

    def cold(steps, device=None):
        return {n.name: k for n, k in cold_ops(_program(steps), device).items()}
    mm, mm_1, add = "mm_default", "mm_default_1", "add_tensor"
    # mm | all_reduce | mm_1 | wait | add: every op follows a communication since its kind last ran
    assert cold(["mm", "ar", "mm", "wait"]) == {mm: 1, mm_1: 1, add: 1}
    assert cold(["mm", "mm", "ar", "wait"]) == {mm: 1, add: 1}             # mm_1 follows mm with nothing between
    assert cold(["mm", "ar", "wait", "mm"]) == {add: 1, mm_1: 1}           # mm follows the last call's mm_1
    assert cold(["mm", "mm"]) == {}                                         # no communication: nothing runs cold
    dev = replace(_cluster().device, op_overhead_s=0.05e-3, action_overhead_s=0.25e-3)
    assert cold(["mm", "ar", "mm", "wait"], dev)["output"] == pytest.approx(5.0)   # the runtime's 5 ops' worth

    c = 0.1e-3
    cl, gm = _cluster(), _program(["mm", "ar", "mm", "wait"])
    est = estimate({0: gm, 1: gm}, replace(cl, device=replace(cl.device, cold_op_s=c)))
    assert est.step_time_s == pytest.approx((MM + c) + max(MM + c, AR) + ADD + c)
    assert est.ranks[0].compute_time_s == pytest.approx(2 * MM + ADD + 3 * c)
    both = replace(cl, device=replace(dev, cold_op_s=c))
    plain = replace(cl, device=dev)
    assert (estimate({0: gm, 1: gm}, both).ranks[0].compute_time_s
            == pytest.approx(estimate({0: gm, 1: gm}, plain).ranks[0].compute_time_s + 3 * c + 5 * c))
    flat = _program(["mm", "mm"])                                            # one rank, no communication
    assert estimate({0: flat}, replace(cl, device=replace(cl.device, cold_op_s=c))).step_time_s == \
        pytest.approx(estimate({0: flat}, cl).step_time_s)


def test_bytescheduler_tuner_charges_comm_cpu_per_piece_and_byte():
    from cost_models.comm_tuning import BucketTiming, simulate
    bts = [BucketTiming(1e-3, 0.0, [1000, 1000], 0)]
    plain = simulate(bts, 1e-3, 2e-3, lambda n: 1e-6, 10_000, False)
    charged = simulate(bts, 1e-3, 2e-3, lambda n: 1e-6, 10_000, False, 0.0, 1e-4, 1e-7)
    assert charged.step_s == pytest.approx(plain.step_s + 2 * 1e-4 + 2000 * 1e-7)
