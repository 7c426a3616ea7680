"""α–β cost of collectives and point-to-point transfers over a :class:`~fxpar.cluster.ClusterSpec`.

A message of ``n`` bytes over a link costs ``α + n/β`` (Hockney 1994). Per-collective step counts
and bytes follow Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication
Operations in MPICH" (IJHPCA 19(1)), for a group of ``N`` ranks and a buffer of ``S`` bytes:

=================  ===========================  =====================================
collective         time                          bytes each rank sends
=================  ===========================  =====================================
all_reduce ring    2(N-1)α + 2(N-1)/N · S/B      2(N-1)/N · S
all_reduce tree    2⌈log2 N⌉α + 2 S/B            2 S   (pipelined double binary tree,
                                                          Sanders et al. 2009; NCCL)
reduce_scatter     (N-1)α + (N-1)/N · S/B        (N-1)/N · S          (S = input)
all_gather         (N-1)α + (N-1) · s/B          (N-1) · s            (s = shard sent)
all_to_all         (N-1)α + (N-1)/N · S/B        (N-1)/N · S          (pairwise exchange)
broadcast          min(⌈log2 N⌉(α + S/B),        S (root), ≤ S others
                       (⌈log2 N⌉+N-1)α + 2(N-1)/N·S/B)   (binomial / van de Geijn)
send / recv        α + S/B                       S
=================  ===========================  =====================================

``S`` is :attr:`fxpar.meta.CommInfo.nbytes`, the tensor handed to the collective on this rank.

**Links.** Ranks of one node talk over ``cluster.intra_node``; nodes reach each other through their NICs
(a non-blocking switch between them), ``cluster.inter_node`` per NIC and direction. Who owns a NIC follows the
backend (:func:`nic_per_node`): under NCCL every GPU has its own (the presets' per-GPU figures); under gloo the
processes of a machine share its one interface, so flows leaving (entering) a node at the same time divide its
bandwidth: the group's own hops, and those of its *sibling groups* -- under SPMD the node's other devices run
the same collective over their own groups at the same moment (Herring's cross groups 0-2 and 1-3 on 2 nodes
x 2 share each node's link: ``devices_per_node / (the group's ranks on the node)`` copies).

**Flat ring** (gloo, whatever the placement: its all_reduce is a ring -- the netns harness measures 1.5 S each
way on the cut below -- and its reduce_scatter and all_gather are costed alike, the same bytes per rank; NCCL
inside a node and across nodes for uneven groups): the group's ranks in group order, wrapping. An all_reduce is ``2(N-1)``
steps in which every rank sends ``S/N`` to the next (``N-1`` for reduce_scatter; all_gather sends the shard);
a step lasts as long as its slowest hop, ``α + load · S/N / B`` on that hop's link (:func:`ring_step`). Over
ranks 0-1-2-3 on 2 nodes x 2 the hops 1→2 and 3→0 cross, one each way, and each carries ``2(N-1)/N · S =
1.5 S`` per all_reduce: the cut sees 1.5 S each way (:attr:`CommCost.cut_bytes`).

**Hierarchical** (NCCL's choice across nodes for a group of ``k`` ranks on each of ``m`` nodes; Horovod):
all_reduce = intra reduce_scatter(S) + inter all_reduce(S/k) over ``m`` + intra all_gather(S/k);
reduce_scatter and all_gather run their intra and inter halves in sequence. The ``k`` inter rings of a node run
at once: under a shared NIC each gets ``B/k``.

**BytePS's servers** (:func:`server_exchange_cost`; Jiang et al., OSDI'20): a message on the group of CPU
summation server ``j`` (axis ``server{j}``, ``passes.byteps``) is one half of the server's store-and-forward
of a partition of ``P`` bytes: every worker pushes ``P`` (or pulls the sum back), so the server's NIC carries
``n·P`` in (out) while each worker NIC carries its node's pieces; the server sums the ``n`` pushes (``n``
reads and one write of ``P`` at the device's memory bandwidth) before any pull can leave, charged half to the
push and half to the pull. The server is a machine of its own (``ClusterSpec.cpu_servers``) unless
``server_nodes`` places it on a worker node (as the netns harness does); then that node's workers reach it
over ``intra_node``.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

__all__ = ["CommCost", "RingStep", "collective_cost", "comm_info_cost", "ring_all_reduce_time", "ring_step",
           "nic_per_node", "server_exchange_cost", "ALGORITHMS", "GLOO_THREADS", "latency_part"]

ALGORITHMS = ("auto", "ring", "tree", "hierarchical")
_SERVER_AXIS = re.compile(r"server(\d+)$")     # passes.byteps.server_group(j)


@dataclass(frozen=True)
class CommCost:
    """Seconds the collective takes and bytes each rank puts on the wire (intra + inter; per rank, averaged
    over the group). ``cut_bytes``: bytes one direction of the busiest inter-node NIC carries, the sibling
    groups' included (0 inside a node)."""
    time_s: float
    wire_bytes: float
    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    algorithm: str = ""
    cut_bytes: float = 0.0


@dataclass(frozen=True)
class RingStep:
    """One step of a ring in which every rank sends ``m`` bytes to the next: its seconds, how many hops cross
    nodes, and the most flows one NIC direction carries at once (0: no hop crosses)."""
    seconds: float
    crossing: int
    load: int


def ring_all_reduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """The closed form ``2(N-1)/N · S/B + 2(N-1)α`` (Patarasuk & Yuan 2009)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def nic_per_node(cluster) -> bool:
    """Whether a node's devices share one NIC (``inter_node`` is per node): gloo's processes send through their
    machine's one TCP interface; NCCL's GPUs each have their own (``inter_node`` per device)."""
    return getattr(cluster, "backend", "gloo") == "gloo"


def _copies(cluster, on_node: int) -> int:
    """Copies of a collective that share a node's NIC: the node's devices over the group's ranks there."""
    if not nic_per_node(cluster) or on_node <= 0:
        return 1
    return max(1, cluster.devices_per_node // on_node)


def ring_step(ranks, cluster, m: float) -> RingStep:
    """One ring step over ``ranks`` (group order, wrapping), each rank sending ``m`` bytes to the next: as slow
    as its slowest hop, ``α + load · m / B`` of the hop's link."""
    nodes = [cluster.node_of(r) for r in ranks]
    count = Counter(nodes)
    out, into = Counter(), Counter()
    same = False
    for a, b in zip(nodes, nodes[1:] + nodes[:1]):
        if a == b:
            same = True
        else:
            out[a] += 1
            into[b] += 1
    intra, inter = cluster.intra_node, cluster.inter_node
    t = intra.latency + m / intra.bandwidth if same else 0.0
    load = 0
    if out:
        if nic_per_node(cluster):
            load = max(max(c * _copies(cluster, count[a]) for a, c in out.items()),
                       max(c * _copies(cluster, count[b]) for b, c in into.items()))
        else:
            load = 1          # a NIC per device: a rank sends to one neighbour
        t = max(t, inter.latency + load * m / inter.bandwidth)
    return RingStep(t, sum(out.values()), load)


def _ring(kind: str, S: float, ranks: tuple, cluster) -> CommCost:
    """A flat ring over ``ranks`` hop by hop (see the module docstring)."""
    n = len(ranks)
    steps, m = {"all_reduce": (2 * (n - 1), S / n), "reduce_scatter": (n - 1, S / n),
                "all_gather": (n - 1, S)}[kind]
    st = ring_step(ranks, cluster, m)
    wire = steps * m
    inter = wire * st.crossing / n
    return CommCost(steps * st.seconds, wire, wire - inter, inter, "ring", steps * m * st.load)


def _log2(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0


def _flat(kind: str, S: float, n: int, bw: float, lat: float, algorithm: str) -> tuple[float, float, str]:
    """(time, bytes sent per rank, algorithm) of a flat collective on one link class."""
    if n <= 1:
        return 0.0, 0.0, "local"
    if kind == "all_reduce":
        if algorithm == "tree":
            return 2 * _log2(n) * lat + 2 * S / bw, 2 * S, "tree"
        return ring_all_reduce_time(S, n, bw, lat), 2 * (n - 1) / n * S, "ring"
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) * lat + (n - 1) / n * S / bw, (n - 1) / n * S, "ring" if kind == "reduce_scatter" else "pairwise"
    if kind == "all_gather":
        return (n - 1) * lat + (n - 1) * S / bw, (n - 1) * S, "ring"
    if kind == "broadcast":
        tree = _log2(n) * (lat + S / bw)
        sag = (_log2(n) + n - 1) * lat + 2 * (n - 1) / n * S / bw
        return (tree, S, "binomial") if tree <= sag else (sag, 2 * (n - 1) / n * S, "scatter+allgather")
    if kind in ("send", "recv"):
        return lat + S / bw, S if kind == "send" else 0.0, "p2p"
    raise ValueError(f"unknown collective kind {kind!r}; CommInfo.kind must be one of all_reduce, "
                     "all_gather, reduce_scatter, all_to_all, broadcast, send, recv")


_RINGS = ("all_reduce", "reduce_scatter", "all_gather")
_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")


def collective_cost(kind: str, nbytes: float, ranks, cluster, algorithm: str = "auto") -> CommCost:
    """Cost of one collective of ``kind`` over the global ``ranks`` of ``cluster``.

    ``algorithm``: ``"auto"`` follows the backend -- gloo: a flat ring in group order (its all_reduce,
    reduce_scatter and all_gather); NCCL: a ring inside a node, hierarchical across nodes; ``"ring"`` (flat,
    hop by hop), ``"tree"`` (all_reduce only), ``"hierarchical"``.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}; choose one of {ALGORITHMS}")
    ranks = tuple(ranks)
    n = len(ranks)
    S = float(nbytes)
    if kind in ("send", "recv"):
        link = cluster.link(ranks[0], ranks[-1])
        t, b, alg = _flat(kind, S, 2, link.bandwidth, link.latency, "p2p")
        inter = cluster.node_of(ranks[0]) != cluster.node_of(ranks[-1])
        return CommCost(t, b, 0.0 if inter else b, b if inter else 0.0, alg, S if inter else 0.0)
    if kind not in _KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; CommInfo.kind must be one of {', '.join(_KINDS)}")
    if n <= 1:
        return CommCost(0.0, 0.0, algorithm="local")
    per_node = Counter(cluster.node_of(r) for r in ranks)
    m = len(per_node)
    intra = cluster.intra_node
    if m == 1 and (kind not in _RINGS or algorithm == "tree"):
        t, b, alg = _flat(kind, S, n, intra.bandwidth, intra.latency, algorithm)
        return CommCost(t, b, b, 0.0, alg)
    k = n // m
    even = all(c == k for c in per_node.values())
    flat_ring = algorithm == "ring" or (algorithm == "auto" and nic_per_node(cluster))
    if kind in _RINGS and algorithm != "tree" and (m == 1 or flat_ring or not even or k == 1):
        return _ring(kind, S, ranks, cluster)
    if algorithm == "tree" or not even or k == 1 or kind in ("all_to_all", "broadcast"):
        return _flat_across(kind, S, ranks, per_node, cluster, algorithm)
    return _hierarchical(kind, S, k, m, cluster)


def _flat_across(kind: str, S: float, ranks: tuple, per_node: Counter, cluster, algorithm: str) -> CommCost:
    """all_to_all (pairwise exchange), broadcast and tree all_reduce across nodes."""
    n = len(ranks)
    intra, inter = cluster.intra_node, cluster.inter_node
    if kind == "all_to_all":
        # pairwise exchange: (n - peers_on_node) messages leave the node
        k0 = max(per_node.values())
        ti = (k0 - 1) * (intra.latency + S / n / intra.bandwidth)
        te = (n - k0) * (inter.latency + S / n / inter.bandwidth)
        bi, be = (k0 - 1) * S / n, (n - k0) * S / n
        return CommCost(ti + te, bi + be, bi, be, "pairwise", be * (k0 if nic_per_node(cluster) else 1))
    # a flat algorithm runs at the speed of its slowest (inter-node) hop
    bw, lat = min(intra.bandwidth, inter.bandwidth), max(intra.latency, inter.latency)
    t, b, alg = _flat(kind, S, n, bw, lat, "tree" if algorithm == "tree" else "ring")
    return CommCost(t, b, 0.0, b, alg, b)


def _hierarchical(kind: str, S: float, k: int, m: int, cluster) -> CommCost:
    """k ranks on each of m nodes: in-node, across (the node's k inter rings at once), in-node."""
    intra, inter = cluster.intra_node, cluster.inter_node
    share = k if nic_per_node(cluster) else 1
    bw_x = inter.bandwidth / share
    if kind == "all_reduce":
        t1, b1, _ = _flat("reduce_scatter", S, k, intra.bandwidth, intra.latency, "ring")
        t2, b2, _ = _flat("all_reduce", S / k, m, bw_x, inter.latency, "ring")
        t3, b3, _ = _flat("all_gather", S / k, k, intra.bandwidth, intra.latency, "ring")
        return CommCost(t1 + t2 + t3, b1 + b2 + b3, b1 + b3, b2, "hierarchical", b2 * share)
    if kind == "reduce_scatter":
        t1, b1, _ = _flat("reduce_scatter", S, k, intra.bandwidth, intra.latency, "ring")
        t2, b2, _ = _flat("reduce_scatter", S / k, m, bw_x, inter.latency, "ring")
        return CommCost(t1 + t2, b1 + b2, b1, b2, "hierarchical", b2 * share)
    if kind == "all_gather":
        t1, b1, _ = _flat("all_gather", S, m, bw_x, inter.latency, "ring")
        t2, b2, _ = _flat("all_gather", S * m, k, intra.bandwidth, intra.latency, "ring")
        return CommCost(t1 + t2, b1 + b2, b2, b1, "hierarchical", b1 * share)
    raise ValueError(f"unknown collective kind {kind!r}")


def server_exchange_cost(nbytes: float, workers, cluster, server_node: int | None = None) -> CommCost:
    """One push (or pull) of BytePS's store-and-forward: each of ``workers`` sends ``nbytes`` to a CPU
    summation server (or receives the sum). The server's NIC carries the remote workers' pieces one after the
    other, each worker node's NIC its own workers' pieces; workers on ``server_node`` (None: the server is a
    machine of its own) use ``intra_node``. Plus half the server's sum, ``(n+1)·nbytes`` at memory bandwidth.
    ``wire_bytes``: the bytes a worker moves (sends by a push, receives by a pull)."""
    workers = tuple(workers)
    n = len(workers)
    if n == 0:
        return CommCost(0.0, 0.0, algorithm="server")
    node = cluster.nodes if server_node is None else server_node
    count = Counter(cluster.node_of(w) for w in workers)
    local = count.pop(node, 0)
    remote = sum(count.values())
    intra, inter = cluster.intra_node, cluster.inter_node
    t = intra.latency + nbytes / intra.bandwidth if local else 0.0
    load = 0
    if remote:
        own = max(count.values()) if nic_per_node(cluster) else 1
        load = max(own, remote)               # a worker node's NIC, or the server's, which takes every piece
        t = max(t, inter.latency + load * nbytes / inter.bandwidth)
    t += (n + 1) * nbytes / (2 * cluster.device.mem_bandwidth)
    S = float(nbytes)
    return CommCost(t, S, S * local / n, S * remote / n, "server", S * load)


def _server_of(info, cluster, server_nodes) -> tuple | None:
    """``(j, node or None)`` when ``info`` is a message on CPU server ``j``'s group, else None."""
    hit = _SERVER_AXIS.match(info.axis or "") if info.kind == "all_to_all" else None
    if hit is None or int(hit.group(1)) >= getattr(cluster, "cpu_servers", 0):
        return None
    j = int(hit.group(1))
    if server_nodes is not None and len(server_nodes) <= j:
        raise ValueError(f"server_nodes={list(server_nodes)!r} places {len(server_nodes)} CPU server(s), but the "
                         f"ClusterSpec has cpu_servers={cluster.cpu_servers}: give one worker node (or None) per server.")
    node = None if server_nodes is None else server_nodes[j]
    if node is not None and not (isinstance(node, int) and 0 <= node < cluster.nodes):
        raise ValueError(f"server_nodes[{j}]={node!r}: CPU server {j} must sit on a worker node 0..{cluster.nodes - 1} "
                         "of the ClusterSpec, or None (a machine of its own, as ClusterSpec.cpu_servers describes).")
    return j, node


def comm_info_cost(info, cluster, algorithm: str = "auto", server_nodes=None) -> CommCost:
    """Cost of the collective a node's :class:`fxpar.meta.CommInfo` describes. ``server_nodes[j]``: the worker
    node BytePS's CPU server ``j`` sits on (None or absent: machines of their own). A node that issues several
    collectives (``info.parts``) costs their sum, each with its own latency terms and algorithm."""
    parts = getattr(info, "parts", ())
    if parts:
        costs = [collective_cost(kind, nbytes, info.ranks, cluster, algorithm) for kind, nbytes in parts]
        return CommCost(sum(c.time_s for c in costs), sum(c.wire_bytes for c in costs),
                        sum(c.intra_bytes for c in costs), sum(c.inter_bytes for c in costs),
                        "+".join(c.algorithm for c in costs), sum(c.cut_bytes for c in costs))
    server = _server_of(info, cluster, server_nodes)
    if server is not None:
        return server_exchange_cost(info.nbytes, info.ranks, cluster, server[1])
    return collective_cost(info.kind, info.nbytes, info.ranks, cluster, algorithm)


GLOO_THREADS = 2     # ProcessGroupGloo's worker threads per group (its Options' default): two collectives at once


def latency_part(info, cluster, seconds: float) -> float:
    """The part of a collective's ``seconds`` that is latency, not bytes: its algorithm's steps times the
    slowest link's α (ring: 2(N-1) for all_reduce, N-1 for reduce_scatter, all_gather and all_to_all,
    ⌈log2 N⌉ for broadcast, 1 for a message; summed over ``info.parts``), at most ``seconds``. Two collectives
    in flight at once overlap these parts while their bytes share the wire (:func:`cost_models.simulate.simulate`,
    ``slots``)."""
    ranks = tuple(info.ranks)
    n = len(ranks)
    if n <= 1:
        return 0.0
    nodes = {cluster.node_of(r) for r in ranks}
    alpha = max(cluster.intra_node.latency, cluster.inter_node.latency) if len(nodes) > 1 else cluster.intra_node.latency
    kinds = [kind for kind, _ in getattr(info, "parts", ())] or [info.kind]
    steps = sum({"all_reduce": 2 * (n - 1), "broadcast": math.ceil(math.log2(n)),
                 "send": 1, "recv": 1}.get(kind, n - 1) for kind in kinds)
    return min(seconds, steps * alpha)
