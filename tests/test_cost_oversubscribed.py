"""Ranks that outnumber their node's cores: a rank computes faster while fewer of its node's ranks compute
(processor sharing, ``cost_models.simulate.CoreSharing``, ``DeviceSpec.host_cores``); elsewhere nothing changes."""
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fxpar
from cost_models.simulate import CoreSharing, simulate
from fxpar.cluster import ClusterSpec, DeviceSpec, LinkSpec
from fxpar.errors import ClusterSpecError
from fxpar.meta import CommInfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_planner import ADAMW, _models  # noqa: E402  (the models its measure subcommand runs)

pytestmark = pytest.mark.cost


def _local(n, cores, share):
    dev = dataclasses.replace(ClusterSpec.local(n).device, core_share=share, host_cores=cores)
    return ClusterSpec.local(n, device=dev)


def test_the_share_of_the_cores_follows_the_ranks_computing():
    """4 ranks on 2 cores. At the fair share (0.5, an idle machine) two ranks computing run twice as fast as four,
    one no faster than two (a rank uses one core); at 0.25 the other load is 4 ranks' worth (2 / 0.25 - 4), so two
    computing run 8/6 as fast: 2/(2 + 4) of a core against 2/(4 + 4). Every rank computing: as calibrated."""
    s = CoreSharing.of(_local(4, 2, 0.5), range(4))
    assert s.nodes == {0: (2, 4, 0.0)} and s.node_of == {0: 0, 1: 0, 2: 0, 3: 0}
    assert [s.speed(0, k) for k in (4, 3, 2, 1)] == [1.0, pytest.approx(4 / 3), 2.0, 2.0]
    s = CoreSharing.of(_local(4, 2, 0.25), range(4))
    assert s.nodes == {0: (2, 4, 4.0)}
    assert [s.speed(0, k) for k in (4, 2, 1)] == [1.0, pytest.approx(4 / 3), pytest.approx(1.6)]


def test_no_sharing_where_ranks_do_not_outnumber_cores():
    """GPUs, unknown cores (host_cores 0: every spec written before the field), a core per rank: None, and estimate()
    runs the simulation it runs without the field; a CPU server rank is a machine of its own."""
    assert CoreSharing.of(ClusterSpec.local(4), range(4)) is None
    assert CoreSharing.of(_local(4, 4, 1.0), range(4)) is None
    assert CoreSharing.of(_local(2, 2, 1.0), range(2)) is None
    gpu = ClusterSpec.preset("a100")
    assert CoreSharing.of(dataclasses.replace(gpu, device=dataclasses.replace(gpu.device, host_cores=2)),
                          range(8)) is None
    assert CoreSharing.of(_local(4, 2, 0.5), [0, 4]).node_of == {0: 0}


def test_host_cores_round_trips_and_is_checked():
    cl = _local(4, 2, 0.5)
    assert ClusterSpec.from_json(cl.to_json()) == cl and ClusterSpec.from_json(cl.to_json()).device.host_cores == 2
    with pytest.raises(ClusterSpecError, match="host_cores"):
        ClusterSpec.local(4, device=dataclasses.replace(cl.device, host_cores=-1))


def _prog(*steps, infos=()):
    return SimpleNamespace(steps=list(steps), infos=list(infos), comm_names=[f"c{k}" for k in range(len(infos))])


def test_processor_sharing_on_a_hand_made_timeline():
    """Two ranks on one core at the fair share (0.5). Both computing: each at the calibrated rate; alone: twice it.
    Rank 0 computes 1 s, rank 1 2 s: both do 1 s of work by t = 1, then rank 1's last second takes 0.5 s (1.5, not
    2). With a message: rank 0 computes 1 s alone (rank 1 waits on the receive): 0.5 s; the 0.1 s message; then
    both compute 1 s at once: 1.6 s, not 2.1."""
    sharing = CoreSharing.of(_local(2, 1, 0.5), range(2))
    progs = {0: _prog(("compute", 1.0, 0)), 1: _prog(("compute", 2.0, 0))}
    res = simulate(progs, {0: [], 1: []}, sharing=sharing)
    assert (res[0].end, res[1].end) == (1.0, 1.5)
    assert res[1].compute == [(0.0, 1.5, 0)]
    plain = simulate(progs, {0: [], 1: []})
    assert (plain[0].end, plain[1].end) == (1.0, 2.0)

    send, recv = CommInfo("send", "pp", (0, 1), 1024), CommInfo("recv", "pp", (0, 1), 1024)
    progs = {0: _prog(("compute", 1.0, 0), ("issue", 0), ("wait", 0), ("compute", 1.0, 1), infos=[send]),
             1: _prog(("issue", 0), ("wait", 0), ("compute", 1.0, 0), infos=[recv])}
    res = simulate(progs, {0: [0.1], 1: [0.1]}, sharing=sharing)
    assert res[0].compute == [(0.0, 0.5, 0), (pytest.approx(0.6), pytest.approx(1.0), 1)]
    assert res[1].comm == [(0.5, 0.1, 0)] and res[1].end == pytest.approx(1.6) and res[0].end == pytest.approx(1.6)
    assert simulate(progs, {0: [0.1], 1: [0.1]})[1].end == pytest.approx(2.1)


# ClusterSpec.calibrate(4)'s figures on the 2-core machine of docs/benchmarks.md's "Automatic planner" table, rounded,
# at the fair share of an idle machine (0.5 of a core per rank while all four compute)
IDLE_4_ON_2 = DeviceSpec(
    "cpu", "cpu", 16 * 2**30, 1.22e10, 2.31e9, op_overhead_s=2.08e-5, action_overhead_s=3.17e-4, cold_op_s=1.44e-5,
    collective_issue_s=1.81e-4, collective_slots=2, comm_cpu_s=1.32e-3, comm_cpu_per_byte=2.16e-10,
    late_recv_s=7.47e-4, index_row_s=4.85e-7, core_share=0.5,
    efficiency={"attention": 0.62, "conv": 1.0, "elementwise": 1.0, "matmul": 1.0, "matmul_narrow": 0.02,
                "memory": 1.0, "norm": 0.062, "softmax": 0.049, "transcendental": 0.028,
                "transcendental_backward": 0.017})


@pytest.mark.slow
def test_four_ranks_on_two_cores_price_the_pipeline_by_its_turns():
    """The tied GPT of ``bench_planner.py measure`` at 4 ranks (where dp=2 x pp=2 ZB-H1 ran faster than dp=4). dp=4's
    ranks compute at once, as calibrated: its estimate is the same with host_cores and without. The pipeline's
    ranks take turns: with host_cores 2 they compute faster while the others wait, and its step comes out under
    dp=4's; priced as if every rank always computed beside three others (host_cores 0), it comes out over."""
    name, model, batches, loss = next(iter(_models(1)))
    batch = tuple(t.double() if t.is_floating_point() else t for t in batches[0])
    base = ClusterSpec.local(4, device=IDLE_4_ON_2, intra_node=LinkSpec(6.76e8, 1.27e-3))
    shared = dataclasses.replace(base, device=dataclasses.replace(IDLE_4_ON_2, host_cores=2))
    steps = {}
    for st in (fxpar.Strategy(dp=4), fxpar.Strategy(dp=2, pp=2, schedule="zb1p", microbatches=2)):
        for cl in (base, shared):
            torch.manual_seed(0)
            steps[(st.dp, cl.device.host_cores)] = fxpar.parallelize(model, cl, batch, loss, ADAMW,
                                                                      strategy=st).estimate()
    dp4, pipe = (steps[(4, 0)], steps[(4, 2)]), (steps[(2, 0)], steps[(2, 2)])
    assert dp4[0].step_time_s == dp4[1].step_time_s
    assert [r.compute_time_s for r in dp4[0].ranks] == [r.compute_time_s for r in dp4[1].ranks]
    assert pipe[0].step_time_s > dp4[0].step_time_s > pipe[1].step_time_s
    # its compute is the same work: the pipeline's ranks compute at most twice as fast (two cores, four ranks)
    for a, b in zip(pipe[0].ranks, pipe[1].ranks):
        assert a.compute_time_s / 2 <= b.compute_time_s < a.compute_time_s
    assert 0 < pipe[1].bubble < 1     # the compute actions' wall time at their shared rates, within the step


def test_a_deadlock_under_sharing_is_named():
    """Both ranks wait on a receive the other never sends: the shared-core simulation stops and names them."""
    from cost_models.simulate import DeadlockError
    sharing = CoreSharing.of(_local(2, 1, 0.5), range(2))
    progs = {r: _prog(("compute", 1.0, 0), ("issue", 0), ("wait", 0),
                      infos=[CommInfo("recv", "pp", (1 - r, r), 1024)]) for r in range(2)}
    with pytest.raises(DeadlockError, match="rank 0 waits on recv"):
        simulate(progs, {0: [0.1], 1: [0.1]}, sharing=sharing)
