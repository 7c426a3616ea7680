"""cost_models.comm: α–β collective costs against their closed forms."""
import math

import pytest

from cost_models.comm import collective_cost, ring_all_reduce_time
from fxpar.cluster import ClusterSpec, LinkSpec

pytestmark = pytest.mark.cost


def _cluster(nodes=1, per_node=8, intra=(100e9, 2e-6), inter=(10e9, 10e-6)):
    return ClusterSpec(device=ClusterSpec.preset("a100-80gb").device, nodes=nodes, devices_per_node=per_node,
        intra_node=LinkSpec(*intra), inter_node=LinkSpec(*inter), backend="nccl")


@pytest.mark.parametrize("n", [2, 3, 8])
def test_ring_all_reduce_closed_form(n):
    S, B, a = 64 * 2**20, 100e9, 2e-6
    c = collective_cost("all_reduce", S, range(n), _cluster(per_node=8))
    assert c.time_s == pytest.approx(2 * (n - 1) / n * S / B + 2 * (n - 1) * a, rel=1e-12)
    assert c.wire_bytes == pytest.approx(2 * (n - 1) / n * S)
    assert c.algorithm == "ring" and c.inter_bytes == 0
    assert ring_all_reduce_time(S, n, B, a) == pytest.approx(c.time_s)


def test_reduce_scatter_plus_all_gather_is_ring_all_reduce():
    S, cl = 8 * 2**20, _cluster()
    rs = collective_cost("reduce_scatter", S, range(8), cl)
    ag = collective_cost("all_gather", S / 8, range(8), cl)
    ar = collective_cost("all_reduce", S, range(8), cl)
    assert rs.time_s + ag.time_s == pytest.approx(ar.time_s)
    assert rs.wire_bytes + ag.wire_bytes == pytest.approx(ar.wire_bytes)


def test_tree_wins_on_latency_ring_on_bandwidth():
    cl = _cluster(per_node=8)
    small, big = 1024, 1 << 30
    assert collective_cost("all_reduce", small, range(8), cl, "tree").time_s < \
        collective_cost("all_reduce", small, range(8), cl, "ring").time_s
    assert collective_cost("all_reduce", big, range(8), cl, "ring").time_s < \
        collective_cost("all_reduce", big, range(8), cl, "tree").time_s
    t = collective_cost("all_reduce", small, range(8), cl, "tree")
    assert t.time_s == pytest.approx(2 * math.log2(8) * 2e-6 + 2 * small / 100e9)


def test_hierarchical_all_reduce_across_nodes():
    k, m, S = 4, 2, 256 * 2**20
    cl = _cluster(nodes=m, per_node=k)
    c = collective_cost("all_reduce", S, range(8), cl)
    Bi, ai, Be, ae = 100e9, 2e-6, 10e9, 10e-6
    expect = ((k - 1) / k * S / Bi + (k - 1) * ai) * 2 + ring_all_reduce_time(S / k, m, Be, ae)
    assert c.algorithm == "hierarchical" and c.time_s == pytest.approx(expect)
    assert c.inter_bytes == pytest.approx(2 * (m - 1) / m * S / k)
    flat = collective_cost("all_reduce", S, range(8), cl, "ring")
    assert flat.time_s == pytest.approx(ring_all_reduce_time(S, 8, Be, ae)) and flat.time_s > c.time_s


def test_all_to_all_broadcast_and_p2p():
    cl = _cluster(nodes=2, per_node=4)
    S = 8 * 2**20
    a2a = collective_cost("all_to_all", S, range(4), cl)
    assert a2a.time_s == pytest.approx(3 * 2e-6 + 3 / 4 * S / 100e9) and a2a.wire_bytes == pytest.approx(3 / 4 * S)
    a2a_x = collective_cost("all_to_all", S, range(8), cl)
    assert a2a_x.inter_bytes == pytest.approx(4 / 8 * S) and a2a_x.intra_bytes == pytest.approx(3 / 8 * S)
    bc = collective_cost("broadcast", 1024, range(4), cl)
    assert bc.time_s == pytest.approx(2 * (2e-6 + 1024 / 100e9))
    send = collective_cost("send", S, (0, 5), cl)
    assert send.time_s == pytest.approx(10e-6 + S / 10e9) and send.inter_bytes == S
    recv = collective_cost("recv", S, (0, 1), cl)
    assert recv.time_s == pytest.approx(2e-6 + S / 100e9) and recv.wire_bytes == 0
    assert collective_cost("all_reduce", S, (3,), cl).time_s == 0


def test_unknown_kind_names_the_choices():
    with pytest.raises(ValueError, match="all_reduce, all_gather"):
        collective_cost("allreduce", 10, range(2), _cluster())
