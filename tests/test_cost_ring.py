"""cost_models.comm across nodes: gloo's flat ring hop by hop, Herring's collectives on their links,
BytePS's store-and-forward through its CPU servers -- against hand computations, and in estimate()."""
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxpar
from cost_models.comm import collective_cost, comm_info_cost, ring_step, server_exchange_cost
from fxpar.cluster import ClusterSpec, LinkSpec
from fxpar.meta import CommInfo
from fxpar.testing import MLP

pytestmark = pytest.mark.cost

BI, AI = 2e9, 40e-6          # intra-node link (the calibrated loopback, say)
BE, AE = 62.5e6, 100e-6      # inter-node link: 500 Mbit/s
SGD = (torch.optim.SGD, {"lr": 0.1})


def _gloo(nodes=2, per_node=2, **kw):
    return ClusterSpec.local(nodes * per_node, nodes=nodes, devices_per_node=per_node,
                             intra_node=LinkSpec(BI, AI), inter_node=LinkSpec(BE, AE), **kw)


def _nccl(nodes=2, per_node=2):
    return ClusterSpec(device=ClusterSpec.preset("a100-80gb").device, nodes=nodes, devices_per_node=per_node,
                       intra_node=LinkSpec(BI, AI), inter_node=LinkSpec(BE, AE), backend="nccl")


def _ring_hop(m, links=((BI, AI), (BE, AE)), load=1):
    """One ring step by hand: the slower of an intra hop and an inter hop carrying ``load`` flows of m bytes."""
    (bi, ai), (be, ae) = links
    return max(ai + m / bi, ae + load * m / be)


def test_flat_ring_crosses_the_cut_with_one_and_a_half_buffers_each_way():
    """gloo on 2 nodes x 2: the ring 0-1-2-3 crosses on 1->2 and 3->0, one hop each way, each carrying
    2(N-1)/N·S; its 6 steps each as slow as the inter-node hop (S/4 at B_e)."""
    S, cl = 14.8e6, _gloo()
    st = ring_step(range(4), cl, S / 4)
    assert (st.crossing, st.load) == (2, 1)
    c = collective_cost("all_reduce", S, range(4), cl)
    assert c.algorithm == "ring"
    assert c.cut_bytes == pytest.approx(1.5 * S, rel=1e-12)
    assert c.time_s == pytest.approx(6 * (AE + S / 4 / BE), rel=1e-12)
    assert c.wire_bytes == pytest.approx(1.5 * S) and c.inter_bytes == pytest.approx(1.5 * S / 2)
    rs, ag = collective_cost("reduce_scatter", S, range(4), cl), collective_cost("all_gather", S / 4, range(4), cl)
    assert rs.time_s + ag.time_s == pytest.approx(c.time_s, rel=1e-12)
    assert rs.cut_bytes + ag.cut_bytes == pytest.approx(c.cut_bytes, rel=1e-12)


def test_ring_step_is_its_slowest_hop_and_shared_nics_divide():
    """A step is max over hops; under gloo the hops that leave one node at once share its NIC: an interleaved
    group order (0, 2, 1, 3) crosses on every hop, two each way per node."""
    m, cl = 1e6, _gloo()
    assert ring_step((0, 1), cl, m).seconds == pytest.approx(AI + m / BI)
    assert ring_step((0, 1, 2, 3), cl, m).seconds == pytest.approx(_ring_hop(m))
    st = ring_step((0, 2, 1, 3), cl, m)
    assert (st.crossing, st.load) == (4, 2) and st.seconds == pytest.approx(AE + 2 * m / BE)
    fast_inter = ClusterSpec.local(4, nodes=2, devices_per_node=2, intra_node=LinkSpec(1e6, 1e-3),
                                   inter_node=LinkSpec(1e9, 1e-6))
    assert ring_step(range(4), fast_inter, m).seconds == pytest.approx(1e-3 + m / 1e6)     # the intra hop is slower


def test_herring_collectives_on_their_links():
    """Herring's three steps, 2 nodes x 2, bucket of S bytes: reduce_scatter over (0, 1) and all_gather of S/2
    inside the node; the cross all_reduce of S/2 over (0, 2), whose sibling (1, 3) shares each node's NIC under
    gloo: 2 steps of 2·S/4 at B_e. Its cut carries S each way, 2/3 of the flat ring's 1.5 S."""
    S, cl = 14.8e6, _gloo()
    rs = collective_cost("reduce_scatter", S, (0, 1), cl)
    x = collective_cost("all_reduce", S / 2, (0, 2), cl)
    ag = collective_cost("all_gather", S / 2, (0, 1), cl)
    assert rs.time_s == pytest.approx(AI + S / 2 / BI) and rs.cut_bytes == 0
    assert ag.time_s == pytest.approx(AI + S / 2 / BI) and ag.cut_bytes == 0
    assert x.time_s == pytest.approx(2 * (AE + 2 * (S / 4) / BE), rel=1e-12)
    assert x.cut_bytes == pytest.approx(S, rel=1e-12)
    flat = collective_cost("all_reduce", S, range(4), cl)
    assert x.cut_bytes / flat.cut_bytes == pytest.approx(2 / 3)
    herring = rs.time_s + x.time_s + ag.time_s
    assert herring < flat.time_s
    assert flat.time_s - herring == pytest.approx(0.5 * S / BE + 4 * AE - S / BI - 2 * AI, rel=1e-9)
    # NCCL: a NIC per GPU, so the two cross groups do not share; "auto" across nodes stays hierarchical
    xn = collective_cost("all_reduce", S / 2, (0, 2), _nccl())
    assert xn.time_s == pytest.approx(2 * (AE + S / 4 / BE)) and xn.cut_bytes == pytest.approx(S / 2)
    assert collective_cost("all_reduce", S, range(4), _nccl()).algorithm == "hierarchical"
    hier = collective_cost("all_reduce", S, range(4), cl, "hierarchical")    # gloo forced: the 2 inter rings share
    assert hier.time_s == pytest.approx(herring, rel=1e-12) and hier.cut_bytes == pytest.approx(S)


def _mlp_program(grad_sync, cluster, dp):
    torch.manual_seed(0)
    model = MLP(d_in=64, hidden=256, d_out=16)
    batch = (torch.randn(8, 64), torch.randn(8, 16))
    return fxpar.parallelize(model, cluster, batch, F.mse_loss, SGD,
                             strategy=fxpar.Strategy(dp=dp, grad_sync=grad_sync, bucket_cap_mb=0.1))


def _hand(info):
    """Each collective of the programs below costed by hand on _gloo()'s links."""
    S, n = info.nbytes, len(info.ranks)
    if info.axis == "dp" and n == 4:
        return 6 * _ring_hop(S / 4)
    if info.axis == "cross":
        return 2 * (AE + 2 * (S / 2) / BE)
    if (info.kind, info.axis) == ("reduce_scatter", "node"):
        return AI + S / 2 / BI
    if (info.kind, info.axis) == ("all_gather", "node"):
        return AI + S / BI
    raise AssertionError(f"unexpected collective {info}")


def test_estimate_tells_flat_all_reduce_from_herring():
    """estimate() of the same MLP on 2 nodes x 2 over gloo: each collective costed as above (its comm time the sum),
    and the flat all-reduce predicted slower than Herring, as the bytes on the cut say."""
    cl = _gloo()
    steps = {}
    for method in ("allreduce", "herring"):
        prog = _mlp_program(method, cl, 4)
        infos = prog.collectives(0)
        kinds = {(i.kind, i.axis) for i in infos}
        assert kinds == ({("all_reduce", "dp")} if method == "allreduce" else
                         {("reduce_scatter", "node"), ("all_reduce", "cross"), ("all_gather", "node")})
        est = prog.estimate()
        assert est.ranks[0].comm_time_s == pytest.approx(sum(_hand(i) for i in infos), rel=1e-9)
        steps[method] = est.step_time_s
    assert steps["allreduce"] > steps["herring"]


def test_byteps_store_and_forward_by_hand():
    """A push (or pull) of P bytes from n workers through a CPU server: the server's NIC takes the remote
    workers' pieces one after another (a machine of its own: all n), then half the server's sum, (n+1)·P
    at memory bandwidth. Placed on a worker node, that node's workers use the intra link."""
    P = 4e6
    two = _gloo(nodes=2, per_node=1, cpu_servers=1)
    mem = two.device.mem_bandwidth
    own = server_exchange_cost(P, (0, 1), two)
    assert own.time_s == pytest.approx(AE + 2 * P / BE + 3 * P / (2 * mem), rel=1e-12)
    assert own.cut_bytes == pytest.approx(2 * P) and own.wire_bytes == P and own.algorithm == "server"
    in_b = server_exchange_cost(P, (0, 1), two, server_node=1)
    assert in_b.time_s == pytest.approx(max(AE + P / BE, AI + P / BI) + 3 * P / (2 * mem), rel=1e-12)
    assert in_b.cut_bytes == pytest.approx(P)
    four = _gloo(nodes=2, per_node=2, cpu_servers=1)        # 4 workers: 0, 1 in node 0; 2, 3 + the server in node 1
    assert server_exchange_cost(P, range(4), four, 1).time_s == \
        pytest.approx(max(AE + 2 * P / BE, AI + P / BI) + 5 * P / (2 * mem), rel=1e-12)
    assert server_exchange_cost(P, range(4), four).time_s == pytest.approx(AE + 4 * P / BE + 5 * P / (2 * mem))
    # only messages on a CPU server's group go through it; a workers' all_to_all stays pairwise
    push = CommInfo("all_to_all", "server0", (0, 1), int(P))
    assert comm_info_cost(push, two) == own
    assert comm_info_cost(push, two, server_nodes=(1,)) == in_b
    assert comm_info_cost(CommInfo("all_to_all", "ep", (0, 1), int(P)), two).algorithm == "pairwise"
    with pytest.raises(ValueError, match=r"server_nodes\[0\]=5: CPU server 0 must sit on a worker node 0..1"):
        comm_info_cost(push, two, server_nodes=(5,))
    with pytest.raises(ValueError, match=r"places 0 CPU server.*cpu_servers=1"):
        comm_info_cost(push, two, server_nodes=())


def test_estimate_costs_byteps_pushes_and_pulls_through_the_server():
    """estimate() of BytePS (2 workers on 2 nodes + 1 CPU server): the workers' all-reduce of their part is the
    2-rank ring across the nodes; every push and pull (and the step's one-element go) is the server's
    store-and-forward; the comm time is their sum."""
    cl = _gloo(nodes=2, per_node=1, cpu_servers=1)
    prog = _mlp_program("byteps", cl, 2)
    infos = prog.collectives(0)
    mem = cl.device.mem_bandwidth
    server = [i for i in infos if i.axis == "server0"]
    assert len(server) == 1 + 2 * sum(1 for i in infos if i.axis == "dp")      # go, then a push and a pull per bucket
    hand = sum(2 * (AE + i.nbytes / 2 / BE) for i in infos if i.axis == "dp")
    hand += sum(AE + 2 * i.nbytes / BE + 3 * i.nbytes / (2 * mem) for i in server)
    assert prog.estimate().ranks[0].comm_time_s == pytest.approx(hand, rel=1e-9)


def test_cluster_server_nodes_place_the_server_for_program_estimate():
    """ClusterSpec(server_nodes=(1,)): the CPU server shares node 1's machine, so Program.estimate() costs each
    push and pull as comm_info_cost does with that placement (worker 1 reaches it without the network), which is
    less than a server on a machine of its own; the setting round-trips through JSON and bad ones are refused."""
    own = _gloo(nodes=2, per_node=1, cpu_servers=1)
    placed = ClusterSpec.from_dict(_gloo(nodes=2, per_node=1, cpu_servers=1, server_nodes=(1,)).to_dict())
    assert placed.server_nodes == (1,) and own.server_nodes is None
    infos = _mlp_program("byteps", own, 2).collectives(0)
    by_hand = {name: sum(comm_info_cost(i, own, server_nodes=where).time_s for i in infos)
               for name, where in (("own", None), ("placed", (1,)))}
    got_own = _mlp_program("byteps", own, 2).estimate().ranks[0].comm_time_s
    got_placed = _mlp_program("byteps", placed, 2).estimate().ranks[0].comm_time_s
    assert got_own == pytest.approx(by_hand["own"], rel=1e-9)
    assert got_placed == pytest.approx(by_hand["placed"], rel=1e-9)
    assert got_placed < got_own
    for bad in ((2,), (0, 1), ("1",)):
        with pytest.raises(fxpar.errors.ClusterSpecError, match=r"give one worker node index in 0..1 per CPU server"):
            _gloo(nodes=2, per_node=1, cpu_servers=1, server_nodes=bad)


# ---- measured: the bytes that cross the one veth between two network namespaces (benchmarks/netns_link.py) ----
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import netns_link as nl  # noqa: E402


def _veth_bytes(dev):
    for line in open("/proc/net/dev").read().splitlines()[2:]:
        name, rest = line.split(":", 1)
        if name.strip() == dev:
            f = rest.split()
            return int(f[8]) + int(f[0])          # sent + received: both directions
    raise AssertionError(f"no device {dev} in this namespace")


def _flat_then_herring(numel, dev, reps=8):
    """On 4 ranks, 0-1 in namespace A and 2-3 in B: ``reps`` flat all_reduces over all four, then ``reps`` times
    Herring's three steps; rank 0 reads the veth's counters (both directions) before, between and after: the bytes
    of each run of ``reps``."""
    import torch.distributed as dist
    rank = dist.get_rank()
    groups = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]
    node, cross = groups[rank // 2], groups[2 + rank % 2]

    def settled():
        """Every rank done; rank 0 then reads until two reads 50 ms apart agree (the veth counts a 64 KiB segment
        when its sender's transmit returns, which can come after the receiver has it)."""
        dist.barrier()
        if rank != 0:
            dist.barrier()
            return 0
        last, now = -1, _veth_bytes(dev)
        for _ in range(40):
            if now == last:
                break
            time.sleep(0.05)
            last, now = now, _veth_bytes(dev)
        dist.barrier()
        return now

    x = torch.ones(numel)
    c0 = settled()
    for _ in range(reps):
        dist.all_reduce(x)
    c1 = settled()
    shard, out = torch.empty(numel // 2), torch.empty(numel)
    for _ in range(reps):
        dist.reduce_scatter_tensor(shard, x, group=node)
        dist.all_reduce(shard, group=cross)
        dist.all_gather_into_tensor(out, shard, group=node)
    c2 = settled()
    return (c1 - c0) / reps, (c2 - c1) / reps


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or nl.preflight() is not None,
                    reason="needs root and a working `ip netns` (benchmarks/netns_link.py builds the link)")
def test_cut_bytes_match_the_veth():
    """The cost model's bytes on the cut, both directions (2 · cut_bytes), against the veth's counters: gloo's
    flat ring over 2 nodes x 2 puts 3 S on the link, Herring's steps 2 S (TCP/IP headers: up to 4% more)."""
    numel = 2**20
    S, cl = numel * 4, _gloo()
    ring = collective_cost("all_reduce", S, range(4), cl).cut_bytes
    herring = sum(collective_cost(k, b, g, cl).cut_bytes for k, b, g in (
        ("reduce_scatter", S, (0, 1)), ("all_reduce", S / 2, (0, 2)), ("all_gather", S / 2, (0, 1))))
    assert (2 * ring, 2 * herring) == (3 * S, 2 * S)
    link = nl.CappedLink(verbose=False)
    with link, nl.NetnsCluster(4, link, timeout_s=120) as lc:
        flat_m, herring_m = lc.run(_flat_then_herring, [(numel, link.names.dev_a)] * 4)[0]
    assert 2 * ring <= flat_m <= 1.04 * 2 * ring
    assert 2 * herring <= herring_m <= 1.04 * 2 * herring
