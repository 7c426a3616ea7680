"""Herring's hierarchical gradient sum (Thangakrishnan et al., SC'20) over the dp buckets.

Herring sums gradients through parameter servers with *balanced fusion buffers*: each bucket is cut into
equal shards, one per server, so no server carries more than its share; and it reduces within a node before
crossing the (slower) network between nodes. Here every rank is also the server of one shard of each bucket,
and the three steps are collectives over the plan's ``node`` and ``cross`` groups (``Plan.section("herring")``):

1. ``reduce_scatter`` within the node: each of the node's L ranks receives the node's sum of its shard
   (the bucket padded with zeros to a multiple of L: every shard has exactly ceil(V/L) elements);
2. ``all_reduce`` of that shard across nodes, among the ranks with the same local index (the servers'
   sum; V/L elements cross the network per rank instead of a ring all-reduce's 2(N-1)/N·V);
3. ``all_gather`` within the node: every rank has the whole summed bucket again.

The pass replaces each bucket's ``all_reduce_`` (passes/bucket.py); the reduce-scatter starts where the
all-reduce did, right after the bucket's last gradient (its *ready point* R_b). Where steps 2-3 run is
``Plan.section("herring").overlap``, a choice kept in the Plan so that one run can time both: the planner sets True
(benchmarks/bench_param_server.py, "herring at wait" = False: with 6 buckets, ``--bucket-mb 4``, 0.78-0.91x the
step at 2 Gbit/s-500 Mbit/s in two quiet runs; uncapped, and with 25 MB buckets (2 buckets: nothing to overlap),
equal within noise). Edit a Plan to False for the old placement:

- ``overlap=False``: steps 2-3 run where the bucket's wait was (before the optimizer); no cross-node byte
  moves while backward computes.
- ``overlap=True``: each bucket's chain moves along backward. The in-node collectives are one at a time
  (gloo; ``passes.graph_utils.one_collective_in_flight``), so the node group is a channel with two slots per bucket of backward:
  R_b .. M_b .. R_{b+1}, where M_b is the middle node of the backward between bucket b's reduce-scatter and
  bucket b+1's copies. At M_b: wait the reduce-scatter of b, issue its cross-node all-reduce (it runs over the
  rest of backward), wait the cross-node all-reduce of b-1 (issued a segment earlier) and issue its all-gather;
  just before R_{b+1}'s reduce-scatter: wait that all-gather. Nothing waits on a collective issued less than
  half a segment before. (Waiting the reduce-scatter of b only *after* R_{b+1}'s would put two in-node
  collectives in flight.) The last bucket's chain (and the all-gather of the one before) stays at the end, as
  ``overlap=False`` has it: it is ready only when backward is done; there its cross-node all-reduce is issued
  first. Under microbatches the moved nodes run in ``REDUCE_GRAD`` (tagged ``issue``), the end in ``STEP``.

Before / after, one bucket of V elements, 2 nodes x 2 ranks (``overlap=False``)::

    all_reduce_ = all_reduce_(empty, 'sum', 'fxpar:dp'); ...; wait = wait_tensor(all_reduce_)

    rs = reduce_scatter_tensor(pad(empty, [0, p]), 'sum', 2, 'fxpar:node'); ...
    w1 = wait_tensor(rs); ar = all_reduce(w1, 'sum', 'fxpar:cross'); w2 = wait_tensor(ar)
    ag = all_gather_into_tensor(w2, 2, 'fxpar:node'); w3 = wait_tensor(ag); wait = slice(w3, 0, 0, V)

``overlap=True``, buckets 0..2 (mm_*: backward compute)::

    rs_0 = reduce_scatter_tensor(pad_0, ...)                    # R_0
    mm_2 = mm(...)
    w1_0 = wait_tensor(rs_0); ar_0 = all_reduce(w1_0, 'sum', 'fxpar:cross')          # M_0
    mm_3 = mm(...); copy_(slot_1, mm_3)
    rs_1 = reduce_scatter_tensor(pad_1, ...)                    # R_1
    mm_4 = mm(...)
    w1_1 = wait_tensor(rs_1); ar_1 = all_reduce(w1_1, ...)                            # M_1
    w2_0 = wait_tensor(ar_0); ag_0 = all_gather_into_tensor(w2_0, 2, 'fxpar:node')
    mm_5 = mm(...); copy_(slot_2, mm_5)
    w3_0 = wait_tensor(ag_0); grads_0 = slice(w3_0, 0, 0, V_0)                         # before R_2
    rs_2 = reduce_scatter_tensor(pad_2, ...)                    # R_2 (last): the rest at the end
    ...                                                         # end of backward; optimizer begins
    w1_2 = wait_tensor(rs_2); ar_2 = all_reduce(w1_2, ...)      # the last cross-node sum first
    w2_1 = wait_tensor(ar_1); ag_1 = all_gather_into_tensor(w2_1, ...); w3_1 = wait_tensor(ag_1)
    w2_2 = wait_tensor(ar_2); ag_2 = all_gather_into_tensor(w2_2, ...); w3_2 = wait_tensor(ag_2)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fxpar import meta as M
from fxpar.collectives import C10D, group_tag
from fxpar.pass_manager import Pass, PassContext, PassResult

from .graph_utils import one_collective_in_flight

__all__ = ["HierarchicalReduce"]

aten = torch.ops.aten


@dataclass
class _Chain:
    """One bucket's nodes: its flat buffer (first of its copies), the reduce-scatter, the waits and collectives
    of steps 2-3 and the slice that stands for the summed bucket."""
    buf: torch.fx.Node
    rs: torch.fx.Node
    w1: torch.fx.Node
    x: torch.fx.Node
    w2: torch.fx.Node
    ag: torch.fx.Node
    w3: torch.fx.Node
    out: torch.fx.Node


def _stamp(node, like, val, **extra):
    node.meta["val"] = val
    for k in (M.PHASE.name, M.MODULE.name, M.REDUCE_GRAD.name):
        if k in like.meta:
            node.meta[k] = like.meta[k]
    node.meta.update(extra)


def _three_steps(g, ar, node_ranks, cross_ranks) -> _Chain:
    """Replace bucket all-reduce ``ar`` by the three steps: the reduce-scatter where ``ar`` was, the rest where
    its wait was."""
    L = len(node_ranks)
    buf = ar.args[0]
    wait = next(iter(ar.users))
    val = buf.meta["val"]
    v = val.numel()
    shard = -(-v // L)
    pad = shard * L - v
    b = val.element_size()
    src = buf
    if pad:
        with g.inserting_before(ar):
            src = g.call_function(aten.constant_pad_nd.default, (buf, [0, pad], 0.0))
        _stamp(src, ar, val.new_empty([shard * L]))
    with g.inserting_before(ar):
        rs = g.call_function(C10D.reduce_scatter_tensor.default, (src, "sum", L, group_tag("node")))
    _stamp(rs, ar, val.new_empty([shard]), **{M.BUCKET.name: M.get(ar, M.BUCKET)})
    M.set_meta(rs, M.COMM, M.CommInfo("reduce_scatter", "node", tuple(node_ranks), shard * L * b))
    with g.inserting_before(wait):
        w1 = g.call_function(C10D.wait_tensor.default, (rs,))
        x = g.call_function(C10D.all_reduce.default, (w1, "sum", group_tag("cross")))
        w2 = g.call_function(C10D.wait_tensor.default, (x,))
        ag = g.call_function(C10D.all_gather_into_tensor.default, (w2, L, group_tag("node")))
        w3 = g.call_function(C10D.wait_tensor.default, (ag,))
        out = g.call_function(aten.slice.Tensor, (w3, 0, 0, v))
    shard_val = val.new_empty([shard])
    for n, vv in ((w1, shard_val), (x, shard_val), (w2, shard_val), (ag, val.new_empty([shard * L])),
                  (w3, val.new_empty([shard * L])), (out, val)):
        _stamp(n, wait, vv)
    M.set_meta(x, M.COMM, M.CommInfo("all_reduce", "cross", tuple(cross_ranks), shard * b))
    M.set_meta(ag, M.COMM, M.CommInfo("all_gather", "node", tuple(node_ranks), shard * b))
    wait.replace_all_uses_with(out)
    g.erase_node(wait)
    g.erase_node(ar)
    return _Chain(buf, rs, w1, x, w2, ag, w3, out)


def _middle(g, after, before):
    """The middle node strictly between ``after`` and ``before`` in graph order (``before`` if none)."""
    seg, on = [], False
    for n in g.nodes:
        if n is before:
            break
        if on:
            seg.append(n)
        on = on or n is after
    return seg[len(seg) // 2] if seg else before


def _place(anchor, nodes, like) -> None:
    """Move ``nodes``, in order, to just before ``anchor``, with ``like``'s phase and ``REDUCE_GRAD`` tag (the
    graph, ``REDUCE_GRAD`` or ``STEP``, they run in under microbatches)."""
    for n in nodes:
        anchor.prepend(n)
        for k in (M.PHASE.name, M.REDUCE_GRAD.name):
            if k in like.meta:
                n.meta[k] = like.meta[k]


def _chain_early(g, chains) -> None:
    """``overlap=True``: bucket b's cross-node all-reduce from M_b, its all-gather from M_{b+1}, waited before
    R_{b+2} (module docstring). The chains of the last bucket (and the last all-gather before it) stay put."""
    for b in range(len(chains) - 1):
        c, nxt = chains[b], chains[b + 1]
        mid = _middle(g, c.rs, nxt.buf)
        _place(mid, [c.w1, c.x], c.rs)
        if b:
            prev = chains[b - 1]
            _place(mid, [prev.w2, prev.ag], c.rs)
            _place(nxt.rs, [prev.w3, prev.out], c.rs)
    if len(chains) > 1:          # at the end: the last bucket's cross-node all-reduce before the gather it overtakes
        last, before = chains[-1], chains[-2]
        order = {n: i for i, n in enumerate(g.nodes)}
        if order[before.w2] < order[last.w1]:
            _place(before.w2, [last.w1, last.x], last.w1)


class HierarchicalReduce(Pass):
    name = "herring"
    requires = ("bucket",)

    def run(self, gm, ctx: PassContext) -> PassResult:
        section = ctx.plan.section("herring")
        if section is None:
            return PassResult(gm, False)
        g = gm.graph
        node_ranks = ctx.plan.group_of("node", ctx.rank)
        cross_ranks = ctx.plan.group_of("cross", ctx.rank)
        buckets = [x for x in g.nodes if x.op == "call_function" and x.target is C10D.all_reduce_.default
                   and M.get(x, M.BUCKET) is not None and M.get(x, M.COMM).axis == "dp"]
        chains = [_three_steps(g, ar, node_ranks, cross_ranks) for ar in buckets]
        overlap = section.overlap
        if not isinstance(overlap, bool):
            raise ValueError(f"Plan.section('herring').overlap = {overlap!r}: set True (each bucket's cross-node sum and "
                             "gather start during backward) or False (both after backward)")
        if overlap:
            _chain_early(g, chains)
        one_collective_in_flight(g)       # gloo: one gather / reduce-scatter in flight (see passes/graph_utils.py)
        g.lint()
        where = ("the cross-node all-reduce from the middle of the next bucket's backward, the all-gather one "
                 "bucket later" if overlap else "the cross-node all-reduce and the all-gather at the optimizer")
        ctx.notes.append(f"herring: {len(buckets)} bucket(s) summed in 3 steps: reduce_scatter in node "
                         f"{list(node_ranks)}, all_reduce across nodes {list(cross_ranks)}, all_gather in the node; "
                         f"{where}")
        return PassResult(gm, bool(buckets), {"buckets": len(buckets), "overlap": overlap})
