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

Topology: inside a node links are ``cluster.intra_node``, across nodes ``cluster.inter_node``.
A group inside one node uses the flat algorithm on intra links. A group that spans nodes with
``k`` ranks on each of ``m`` nodes uses the hierarchical algorithm (as NCCL/Horovod do):
all_reduce = intra reduce_scatter(S) + inter all_reduce(S/k) over ``m`` + intra all_gather(S/k);
reduce_scatter and all_gather run their intra and inter halves in sequence. Uneven groups
fall back to a flat ring bottlenecked by the inter-node link.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CommCost", "collective_cost", "comm_info_cost", "ring_all_reduce_time", "ALGORITHMS"]

ALGORITHMS = ("auto", "ring", "tree", "hierarchical")


@dataclass(frozen=True)
class CommCost:
    """Seconds the collective takes and bytes each rank puts on the wire (intra + inter)."""
    time_s: float
    wire_bytes: float
    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    algorithm: str = ""


def ring_all_reduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """The closed form ``2(N-1)/N · S/B + 2(N-1)α`` (Patarasuk & Yuan 2009)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


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


def collective_cost(kind: str, nbytes: float, ranks, cluster, algorithm: str = "auto") -> CommCost:
    """Cost of one collective of ``kind`` over the global ``ranks`` of ``cluster``.

    ``algorithm``: ``"auto"`` (ring inside a node, hierarchical across nodes), ``"ring"`` (flat
    ring, bottlenecked by the slowest link it crosses), ``"tree"`` (all_reduce only),
    ``"hierarchical"``.
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
        return CommCost(t, b, 0.0 if inter else b, b if inter else 0.0, alg)
    per_node: dict = {}
    for r in ranks:
        per_node[cluster.node_of(r)] = per_node.get(cluster.node_of(r), 0) + 1
    m = len(per_node)
    intra, inter = cluster.intra_node, cluster.inter_node
    if m == 1:
        t, b, alg = _flat(kind, S, n, intra.bandwidth, intra.latency, algorithm)
        return CommCost(t, b, b, 0.0, alg)
    k = n // m
    even = all(c == k for c in per_node.values())
    if algorithm in ("ring", "tree") or not even or k == 1 or kind in ("all_to_all", "broadcast"):
        if kind == "all_to_all":
            # pairwise exchange: (n - peers_on_node) messages leave the node
            k0 = max(per_node.values())
            ti = (k0 - 1) * (intra.latency + S / n / intra.bandwidth)
            te = (n - k0) * (inter.latency + S / n / inter.bandwidth)
            bi, be = (k0 - 1) * S / n, (n - k0) * S / n
            return CommCost(ti + te, bi + be, bi, be, "pairwise")
        # a flat algorithm runs at the speed of its slowest (inter-node) hop
        bw, lat = min(intra.bandwidth, inter.bandwidth), max(intra.latency, inter.latency)
        t, b, alg = _flat(kind, S, n, bw, lat, "tree" if algorithm == "tree" else "ring")
        return CommCost(t, b, 0.0, b, alg)
    # hierarchical: k ranks on each of m nodes
    if kind == "all_reduce":
        t1, b1, _ = _flat("reduce_scatter", S, k, intra.bandwidth, intra.latency, "ring")
        t2, b2, _ = _flat("all_reduce", S / k, m, inter.bandwidth, inter.latency, "ring")
        t3, b3, _ = _flat("all_gather", S / k, k, intra.bandwidth, intra.latency, "ring")
        return CommCost(t1 + t2 + t3, b1 + b2 + b3, b1 + b3, b2, "hierarchical")
    if kind == "reduce_scatter":
        t1, b1, _ = _flat("reduce_scatter", S, k, intra.bandwidth, intra.latency, "ring")
        t2, b2, _ = _flat("reduce_scatter", S / k, m, inter.bandwidth, inter.latency, "ring")
        return CommCost(t1 + t2, b1 + b2, b1, b2, "hierarchical")
    if kind == "all_gather":
        t1, b1, _ = _flat("all_gather", S, m, inter.bandwidth, inter.latency, "ring")
        t2, b2, _ = _flat("all_gather", S * m, k, intra.bandwidth, intra.latency, "ring")
        return CommCost(t1 + t2, b1 + b2, b2, b1, "hierarchical")
    raise ValueError(f"unknown collective kind {kind!r}")


def comm_info_cost(info, cluster, algorithm: str = "auto") -> CommCost:
    """Cost of the collective a node's :class:`fxpar.meta.CommInfo` describes."""
    return collective_cost(info.kind, info.nbytes, info.ranks, cluster, algorithm)
