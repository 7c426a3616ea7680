"""BytePS's gradient sum over CPU summation servers (Jiang et al., OSDI'20), on the dp buckets.

``ClusterSpec(cpu_servers=k)`` adds ``k`` CPU-only ranks after the ``n`` workers; each sums one partition of
every bucket. The planner records each server's share, ``2(n-1)/(n²+kn-2k)`` (``Plan.section("byteps")``; the
derivation is in :mod:`cost_models.byteps_traffic`): it balances the bytes a worker sends (its pushes plus the workers'
all-reduce of the rest) against the bytes a server sends (the sums pulled by every worker). A bucket of ``V``
elements keeps its first ``W = V - k·P`` elements on the workers' all-reduce and cuts the rest into ``k``
partitions of ``P = round(V·share)`` elements, one per server. For server ``j`` the workers

* **push** partition ``j`` to it: ``all_to_all_single`` over group ``server{j}`` (every worker and server
  ``j``) in which a worker sends ``P`` elements to the server and nothing to the other workers;
* **pull** the sum back: ``all_to_all_single`` in which the server sends ``P`` elements to every worker.

The server (:mod:`fxpar.runtime.server`) receives the ``n`` pushes of a partition, sums them and sends the
sum back, partition after partition, in the order the workers issue them -- this pass records that order in
``gm.meta["fxpar_byteps"]``. Each step opens with a one-element **go** message to every server (a run ends
with a stop message instead). The optimizer stays on the workers. Pushes and pulls are issued where the
bucket's all-reduce was (right after its last gradient) and waited where its wait was, so they overlap the rest
of backward like the all-reduce did. With ``k = 0`` (or a bucket too small for a whole element per server)
the bucket stays one all-reduce. Before / after, one bucket of V elements, n=2 workers, k=1 server::

    all_reduce_ = all_reduce_(empty, 'sum', 'fxpar:dp'); ...; wait = wait_tensor(all_reduce_)

    go = all_to_all_single(new_ones(empty, [1]), [0, 0, 0], [0, 0, 1], 'fxpar:server0')   # first bucket only
    ar = all_reduce(slice(empty, 0, 0, W), 'sum', 'fxpar:dp')
    push = all_to_all_single(slice(empty, 0, W, V), [0, 0, 0], [0, 0, P], 'fxpar:server0')
    pull = all_to_all_single(new_empty(empty, [0]), [0, 0, P], [0, 0, 0], 'fxpar:server0'); ...
    wait = cat([wait_tensor(ar), wait_tensor(pull), wait_tensor(push), wait_tensor(go)])   # acks are empty

The graph's ``fxpar_comm`` entries describe each push/pull as an ``all_to_all`` over the *workers* (the ranks
that run the graph in lock-step; the server's side runs outside the graphs) with the bytes that rank moves:
``P`` elements sent by a push, ``P`` received by a pull, one element sent by go.
"""
from __future__ import annotations

import torch

from fxpar import meta as M
from fxpar.collectives import C10D, group_tag
from fxpar.pass_manager import Pass, PassContext, PassResult
from cost_models.byteps_traffic import split_bucket

__all__ = ["ServerSum", "server_group"]

aten = torch.ops.aten
_A2A = C10D.all_to_all_single.default


def server_group(j: int) -> str:
    """The name of server ``j``'s group (every worker and that server)."""
    return f"server{j}"


def _stamp(node, like, val, **extra):
    node.meta["val"] = val
    for key in (M.PHASE.name, M.MODULE.name, M.REDUCE_GRAD.name):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    node.meta.update(extra)


class _Bucket:
    """Inserts one bucket's collectives: issue before ``ar``, waits before ``wait``."""

    def __init__(self, g, ar, n: int, workers: tuple):
        self.g, self.ar, self.wait = g, ar, next(iter(ar.users))
        self.buf = ar.args[0]
        self.val = self.buf.meta["val"]
        self.n, self.workers = n, workers
        self.issued: list = []                    # (node, value of its wait, order in the result)

    def collective(self, name, target, args, val, kind, axis, nbytes, out_val):
        with self.g.inserting_before(self.ar):
            x = self.g.create_node("call_function", target, args, name=name)
        _stamp(x, self.ar, val, **{M.BUCKET.name: M.get(self.ar, M.BUCKET)})
        M.set_meta(x, M.COMM, M.CommInfo(kind, axis, self.workers, nbytes))
        self.issued.append((x, out_val))
        return x

    def node(self, target, args, val):
        with self.g.inserting_before(self.ar):
            x = self.g.call_function(target, args)
        _stamp(x, self.ar, val)
        return x

    def a2a(self, name, j, x, send: int, recv: int, nbytes: int):
        """``all_to_all_single`` over server ``j``'s group: ``send`` elements to the server (the group's last
        rank), ``recv`` from it, nothing to or from the other workers."""
        n = self.n
        out = self.val.new_empty([recv])
        return self.collective(name, _A2A, (x, [0] * n + [recv], [0] * n + [send], group_tag(server_group(j))),
                               out, "all_to_all", server_group(j), nbytes, out)

    def finish(self) -> None:
        """Wait for every collective where the bucket's wait was; the bucket is their results, in order."""
        g, wait = self.g, self.wait
        with g.inserting_before(wait):
            waits = []
            for x, v in self.issued:
                w = g.call_function(C10D.wait_tensor.default, (x,))
                _stamp(w, wait, v)
                waits.append(w)
            out = g.call_function(aten.cat.default, (waits,))
        _stamp(out, wait, self.val)
        wait.replace_all_uses_with(out)
        g.erase_node(wait)
        g.erase_node(self.ar)


class ServerSum(Pass):
    """Carry out ``Plan.section("byteps")``: each bucket split between the workers' all-reduce and
    the CPU servers' push/pull, by the share the planner recorded."""
    name = "byteps"
    requires = ("bucket",)

    def run(self, gm, ctx: PassContext) -> PassResult:
        section = ctx.plan.section("byteps")
        if section is None or not section.servers:
            return PassResult(gm, False)
        g = gm.graph
        n, servers = int(section.workers), list(section.servers)
        k = len(servers)
        workers = tuple(ctx.plan.group_of("dp", ctx.rank))
        buckets = [x for x in g.nodes if x.op == "call_function" and x.target is C10D.all_reduce_.default
                   and M.get(x, M.BUCKET) is not None and M.get(x, M.COMM).axis == "dp"]
        ops = {j: [] for j in range(k)}          # per server, in issue order: (what, elements, dtype)
        split = []
        for ar in buckets:
            b = _Bucket(g, ar, n, workers)
            v = b.val.numel()
            w, p = split_bucket(v, n, k)
            split.append([w, p])
            if p == 0:
                continue
            size = b.val.element_size()
            dtype = str(b.val.dtype).replace("torch.", "")
            if w:
                part = b.node(aten.slice.Tensor, (b.buf, 0, 0, w), b.val.new_empty([w]))
                b.collective("byteps_ar", C10D.all_reduce.default, (part, "sum", group_tag("dp")), b.val.new_empty([w]),
                             "all_reduce", "dp", w * size, b.val.new_empty([w]))
            for j in range(k):
                if not ops[j]:                   # the step's first message to server j: go
                    one = b.node(aten.new_ones.default, (b.buf, [1]), b.val.new_empty([1]))
                    b.a2a(f"byteps_go_s{j}", j, one, 1, 0, size)
                    ops[j].append(("go", 1, dtype))
                lo = w + j * p
                part = b.node(aten.slice.Tensor, (b.buf, 0, lo, lo + p), b.val.new_empty([p]))
                b.a2a(f"byteps_push_s{j}", j, part, p, 0, p * size)
                none = b.node(aten.new_empty.default, (b.buf, [0]), b.val.new_empty([0]))
                b.a2a(f"byteps_pull_s{j}", j, none, 0, p, p * size)
                ops[j] += [("push", p, dtype), ("pull", p, dtype)]
            # the bucket in order: the workers' part, then each server's sum; then the pushes' and go's empty acks
            b.issued.sort(key=lambda e: (e[1].numel() == 0,))
            b.finish()
        g.lint()
        gm.meta[M.BYTEPS.name] = {"workers": n, "servers": servers, "ops": {servers[j]: ops[j] for j in range(k)},
                                   "split": split}
        used = [s for s in split if s[1]]
        ctx.notes.append(f"byteps: {len(used)} of {len(buckets)} bucket(s) split: per bucket the workers all-reduce "
                         f"the first W elements and push one partition of P to each of the {k} CPU server(s) "
                         f"{servers}, pulling its sum back; (W, P) = {[tuple(s) for s in split]}")
        return PassResult(gm, bool(used), {"buckets": len(used)})
