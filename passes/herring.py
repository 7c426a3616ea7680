"""Herring's hierarchical gradient sum (Thangakrishnan et al., SC'20) over the dp buckets.

Herring sums gradients through parameter servers with *balanced fusion buffers*: each bucket is cut into
equal shards, one per server, so no server carries more than its share; and it reduces within a node before
crossing the (slower) network between nodes. Here every rank is also the server of one shard of each bucket,
and the three steps are collectives over the plan's ``node`` and ``cross`` groups (``Plan.grad_sync``):

1. ``reduce_scatter`` within the node: each of the node's L ranks receives the node's sum of its shard
   (the bucket padded with zeros to a multiple of L: every shard has exactly ceil(V/L) elements);
2. ``all_reduce`` of that shard across nodes, among the ranks with the same local index (the servers'
   sum; V/L elements cross the network per rank instead of a ring all-reduce's 2(N-1)/N·V);
3. ``all_gather`` within the node: every rank has the whole summed bucket again.

The pass replaces each bucket's ``all_reduce_`` (passes/bucket.py) in place; the reduce-scatter starts where
the all-reduce did (right after the bucket's last gradient), and the rest runs where its wait was. Before /
after, one bucket of V elements, 2 nodes x 2 ranks::

    all_reduce_ = all_reduce_(empty, 'sum', 'fxpar:dp'); ...; wait = wait_tensor(all_reduce_)

    rs = reduce_scatter_tensor(pad(empty, [0, p]), 'sum', 2, 'fxpar:node'); ...
    w1 = wait_tensor(rs); ar = all_reduce(w1, 'sum', 'fxpar:cross'); w2 = wait_tensor(ar)
    ag = all_gather_into_tensor(w2, 2, 'fxpar:node'); w3 = wait_tensor(ag); wait = slice(w3, 0, 0, V)
"""
from __future__ import annotations

import torch

from fxpar import meta as M
from fxpar.collectives import C10D, group_tag
from fxpar.pass_manager import Pass, PassContext, PassResult

__all__ = ["HierarchicalReduce"]

aten = torch.ops.aten


def _stamp(node, like, val, **extra):
    node.meta["val"] = val
    for k in (M.PHASE.name, M.MODULE.name, M.REDUCE_GRAD.name):
        if k in like.meta:
            node.meta[k] = like.meta[k]
    node.meta.update(extra)


class HierarchicalReduce(Pass):
    name = "herring"
    requires = ("bucket",)

    def run(self, gm, ctx: PassContext) -> PassResult:
        gs = ctx.plan.grad_sync or {}
        if gs.get("method") != "herring":
            return PassResult(gm, False)
        g = gm.graph
        node_ranks = ctx.plan.group_of("node", ctx.rank)
        cross_ranks = ctx.plan.group_of("cross", ctx.rank)
        L = len(node_ranks)
        buckets = [x for x in g.nodes if x.op == "call_function" and x.target is C10D.all_reduce_.default
                   and M.get(x, M.BUCKET) is not None and M.get(x, M.COMM).axis == "dp"]
        for ar in buckets:
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
        from .zero import _one_in_flight       # gloo: one gather / reduce-scatter in flight (see passes/zero.py)
        _one_in_flight(g)
        g.lint()
        ctx.notes.append(f"herring: {len(buckets)} bucket(s) summed in 3 steps: reduce_scatter in node "
                         f"{list(node_ranks)}, all_reduce across nodes {list(cross_ranks)}, all_gather in the node")
        return PassResult(gm, bool(buckets), {"buckets": len(buckets)})
