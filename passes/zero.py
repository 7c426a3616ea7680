"""ZeRO-1/2/3 (Rajbhandari et al., SC'20) as one pass over a stage's joint graph.

Each parameter whose gradient is summed over dp (``fxpar.zero_layout.zero_keys``) is cut into dp chunks
(``fxpar.zero_layout``: flattened, zero-padded to a multiple of dp; rank i owns chunk i). The pass:

1. replaces ``data_parallel``'s per-gradient ``all_reduce`` by one ``reduce_scatter`` per bucket of
   ``plan.section("data_parallel").buckets``: every gradient of the bucket is copied into an interleaved buffer
   ``[dp, C]``
   (row j holds every gradient's chunk j), so the reduce-scatter hands each rank its own chunks of
   the summed gradients (``C`` elements). Stage 1 starts it after backward (``REDUCE_GRAD``: gradients
   accumulate whole over microbatches, one reduce-scatter per step); stages 2 and 3 start it in
   backward, as each bucket fills, so a rank only ever accumulates its chunks;
2. runs the traced optimizer on chunks: the optimizer is elementwise (``torch._foreach_*``), so it is
   the same graph with chunk-shaped parameter, gradient and state inputs; optimizer state is chunks;
3. stage 1 and 2: all-gathers the updated chunks (one ``all_gather`` per bucket) into whole
   parameters; stage 3: the parameters themselves are chunks (the ``param`` inputs are ``[c]``): each is
   all-gathered just before its first forward use and gathered *again* just before its first backward
   use, as SimpleFSDP writes it (a recompute of the gather: between the two, only the chunk is held).
   The backward re-derives what forward made from the gathered weight alone (``t``, views) from its own
   gather, so no whole weight lives from forward to backward.

Communication per rank and step (elements of Ψ parameters): reduce-scatter Ψ + all-gather Ψ = 2Ψ
(stages 1, 2, as plain dp's all-reduce); stage 3 gathers twice: 3Ψ. Before / after (stage 3, one
``Linear``; dp=2, w has 8 elements)::

    mm = mm(x, t(w)); ...; mm_1 = mm(t_1, x)          # grad of w
    ar = all_reduce(mm_1, 'sum', 'fxpar:dp'); wait = wait_tensor(ar)
    _foreach_sub([w], [mul(wait)])

    ag = all_gather_into_tensor(w, 2, 'fxpar:dp'); w_full = view(slice(wait_tensor(ag), 0, 0, 8), [2, 4])
    mm = mm(x, t(w_full)); ...
    ag_1 = all_gather_into_tensor(w, 2, 'fxpar:dp'); w_full_1 = ...   # backward's own gather
    mm_1 = mm(t_1, x)
    buf = empty([8]); copy_(slice(view(buf, [2, 4]), 1, 0, 4), view(mm_1, [2, 4]))
    rs = reduce_scatter_tensor(buf, 'sum', 2, 'fxpar:dp'); g = slice(wait_tensor(rs), 0, 0, 4)
    _foreach_sub([w], [mul(g)])                       # w: this rank's chunk [4]
"""
from __future__ import annotations

import torch

from fxpar import meta as M
from fxpar.collectives import C10D, group_tag
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.roles import GraphKind, Role
from fxpar.zero_layout import chunk_numel, zero_keys

from .fake_values import record, refresh
from .graph_utils import grad_sync_chains, one_collective_in_flight

__all__ = ["ZeroShard"]

aten = torch.ops.aten
_VIEWISH = {aten.t.default, aten.view.default, aten.permute.default, aten.transpose.int, aten.expand.default,
            aten.unsqueeze.default, aten._unsafe_view.default, aten.detach.default, aten.alias.default,
            aten.slice.Tensor, aten.select.int, aten.reshape.default, aten.squeeze.dim, aten.squeeze.default}


def _stamp(node, phase, module="", **extra):
    node.meta[M.PHASE.name] = phase
    node.meta[M.MODULE.name] = module
    for k, v in extra.items():
        node.meta[k] = v


class ZeroShard(Pass):
    """Shard optimizer state (the Plan's ``zero`` section: stage >= 1), gradients (``>= 2``) and parameters (``3``)
    over dp."""
    name = "zero"
    requires = ("data_parallel",)

    def run(self, gm, ctx: PassContext) -> PassResult:
        plan = ctx.plan
        section = plan.section("zero")
        z = section.stage if section is not None else 0
        chains = grad_sync_chains(gm)
        keys = [k for k in zero_keys(plan, ctx.stage) if k in chains]
        if not z or not keys:
            return PassResult(gm, False)
        n = plan.dp
        ranks = plan.group_of("dp", ctx.rank)
        g = gm.graph
        before = record(gm)
        sig = gm.meta[M.SIGNATURE.name]
        phs = g.find_nodes(op="placeholder")
        ph_of = {rk: ph for ph, rk in zip(phs, sig.inputs)}
        shapes = {k: tuple(chains[k][0].meta["val"].shape) for k in keys}
        numels = {k: chains[k][0].meta["val"].numel() for k in keys}
        sizes = {k: chunk_numel(numels[k], n) for k in keys}
        dps = plan.section("data_parallel")           # its buckets: the data_parallel feature's
        buckets = ([[k for k in b if k in sizes] for b in dps.buckets[ctx.stage]] if dps is not None and dps.buckets
                   else [keys])
        buckets = [b for b in buckets if b]
        covered = {k for b in buckets for k in b}
        buckets += [[k] for k in keys if k not in covered]
        grad_shard = {}
        stats = {"reduce_scatter": 0, "all_gather": 0}
        per_step = GraphKind.UNSHARD in ctx.kinds    # F/B graphs under a schedule: gather once per step
        for b in buckets:
            grad_shard.update(self._reduce_scatter(g, b, chains, sizes, numels, n, ranks, z))
            stats["reduce_scatter"] += 1
        opt_nodes = [x for x in g.nodes if x.op == "call_function" and M.get(x, M.PHASE) == "optimizer"]
        last_ph = phs[-1]
        states: dict = {}           # parameter key -> its optimizer states' inputs ("exp_avg:<key>")
        for rk in sig.inputs:
            if rk[0] == Role.OPT_STATE:
                states.setdefault(rk[1].split(":", 1)[1], []).append(rk)
        order = {x: i for i, x in enumerate(g.nodes)}       # stage 3: the nodes' order, kept as gathers go in
        for k in keys:
            p = ph_of[(Role.PARAM, k)]
            for sk in states.get(k, ()):
                ph_of[sk].meta["val"] = ph_of[sk].meta["val"].new_empty([sizes[k]])
            if z < 3:            # the optimizer reads this rank's chunk of the whole parameter (the runtime cuts it)
                with g.inserting_after(last_ph):
                    s = g.placeholder(f"{p.name}_chunk")
                s.meta["val"] = p.meta["val"].new_empty([sizes[k]])
                M.set_meta(s, M.ROLE, Role.PARAM_SHARD)
                M.set_meta(s, M.PARAM, k)
                sig.inputs.append((Role.PARAM_SHARD, k))
                last_ph = s
                for u in opt_nodes:
                    if p in u.all_input_nodes:
                        u.replace_input_with(p, s)
            elif per_step:
                self._gather_once(g, p, shapes[k], numels[k], n, ranks)
                stats["all_gather"] += 1
            else:
                self._gather_for_use(g, p, k, shapes[k], numels[k], n, ranks, order)
                stats["all_gather"] += 2
        if z == 3 and not per_step:
            _prefetch(g)
        one_collective_in_flight(g)
        if z < 3:
            stats["all_gather"] += self._gather_updates(g, sig, buckets, sizes, numels, shapes, n, ranks)
        refresh(gm, before)          # the chunks' shapes, through what reads them
        g.lint()
        gm.meta[M.ZERO.name] = {"stage": z, "n": n, "keys": {k: [list(shapes[k]), sizes[k]] for k in keys}}
        ctx.notes.append(f"zero: stage {z} over dp={n}: {len(keys)} parameters in chunks; "
                         f"{stats['reduce_scatter']} reduce_scatter(s), {stats['all_gather']} all_gather(s) per step")
        return PassResult(gm, True, {"keys": len(keys), **stats})

    # ---- gradients: one reduce-scatter per bucket into each rank's chunks --------------------------------
    @staticmethod
    def _reduce_scatter(g, bucket, chains, sizes, numels, n, ranks, z) -> dict:
        order = {x: i for i, x in enumerate(g.nodes)}
        parts = [chains[k] for k in bucket]
        raws = [p[0] for p in parts]
        last = max(raws, key=order.__getitem__)
        first_use = min((u for p in parts for u in p[3].users), key=order.__getitem__)
        val = raws[0].meta["val"]
        C = sum(sizes[k] for k in bucket)
        issue = {M.REDUCE_GRAD.name: "issue"} if z == 1 else {}     # stage 1: once per step, after backward
        wait = {M.REDUCE_GRAD.name: "wait"} if z == 1 else {}
        mod = M.get(last, M.MODULE, "")
        with g.inserting_after(last):
            buf = g.call_function(aten.empty.memory_format, ([n * C],), {"dtype": val.dtype, "device": val.device})
        _stamp(buf, "backward", mod, **issue)
        with g.inserting_after(buf):
            rows = g.call_function(aten.view.default, (buf, [n, C]))
        _stamp(rows, "backward", mod, **issue)
        cursor, off, offs = rows, 0, {}
        for k, raw in zip(bucket, raws):
            c, pad = sizes[k], n * sizes[k] - numels[k]
            if len(bucket) == 1 and not pad:        # the buffer is the gradient's own shape: one copy, any layout
                with g.inserting_after(cursor):
                    whole = g.call_function(aten.view.default, (buf, list(raw.meta["val"].shape)))
                with g.inserting_after(whole):
                    cursor = g.call_function(aten.copy_.default, (whole, raw))
                _stamp(whole, "backward", mod, **issue)
                _stamp(cursor, "backward", mod, **issue)
                offs[k] = 0
                break
            with g.inserting_after(cursor):
                flat = g.call_function(aten.reshape.default, (raw, [-1]))
            cursor = flat
            if pad:
                with g.inserting_after(cursor):
                    cursor = g.call_function(aten.constant_pad_nd.default, (flat, [0, pad], 0.0))
                _stamp(cursor, "backward", mod, **issue)
            with g.inserting_after(cursor):
                mat = g.call_function(aten.view.default, (cursor, [n, c]))
            with g.inserting_after(mat):
                slot = g.call_function(aten.slice.Tensor, (rows, 1, off, off + c))
            with g.inserting_after(slot):
                cursor = g.call_function(aten.copy_.default, (slot, mat))
            for x in (flat, mat, slot, cursor):
                _stamp(x, "backward", mod, **issue)
            offs[k] = off
            off += c
        with g.inserting_after(cursor):
            rs = g.call_function(C10D.reduce_scatter_tensor.default, (buf, "sum", n, group_tag("dp")))
        _stamp(rs, "backward", mod, **issue)
        M.set_meta(rs, M.COMM, M.CommInfo("reduce_scatter", "dp", tuple(ranks), n * C * val.element_size()))
        with g.inserting_before(first_use):
            w = g.call_function(C10D.wait_tensor.default, (rs,))
        _stamp(w, "backward", mod, **wait)
        divide = not all(p[3] is p[2] for p in parts)         # backward's seed was not scaled by 1/dp
        summed, out = w, {}
        if divide:
            with g.inserting_after(w):
                summed = g.call_function(aten.div.Tensor, (w, n))
            _stamp(summed, "backward", mod, **wait)
        anchor = summed
        for k, (raw, ar, wt, avg) in zip(bucket, parts):
            with g.inserting_after(anchor):
                sh = g.call_function(aten.slice.Tensor, (summed, 0, offs[k], offs[k] + sizes[k]))
            _stamp(sh, "backward", M.get(raw, M.MODULE, ""), **wait)
            M.set_meta(sh, M.GRAD_OF, k)
            avg.replace_all_uses_with(sh)
            for dead in dict.fromkeys((avg, wt, ar)):
                g.erase_node(dead)
            out[k] = sh
            anchor = sh
        return out

    # ---- stage 3: gather each parameter before its forward use, and again before its backward use ------
    @staticmethod
    def _gather_for_use(g, p, key, shape, numel, n, ranks, order: dict) -> None:
        """``order``: position of every node (taken before the gathers went in: they only ever go in before a node
        that was there, so the order of those nodes stands; what this reads is among them, else it is taken again)."""
        c = chunk_numel(numel, n)
        full_val = p.meta["val"]
        p.meta["val"] = full_val.new_empty([c])
        by_phase = {}
        for u in p.users:
            by_phase.setdefault(M.get(u, M.PHASE), []).append(u)

        def gather(before, phase, module):
            with g.inserting_before(before):
                ag = g.call_function(C10D.all_gather_into_tensor.default, (p, n, group_tag("dp")))
                w = g.call_function(C10D.wait_tensor.default, (ag,))
                sl = g.call_function(aten.slice.Tensor, (w, 0, 0, numel))
                full = g.call_function(aten.view.default, (sl, list(shape)))
            for x in (ag, w, sl, full):
                _stamp(x, phase, module)
            M.set_meta(ag, M.COMM, M.CommInfo("all_gather", "dp", tuple(ranks), c * full_val.element_size()))
            return full

        fwd_users = by_phase.get("forward", [])
        if fwd_users:
            first = min(_known(g, order, fwd_users), key=order.__getitem__)
            full = gather(first, "forward", M.get(first, M.MODULE, ""))
            for u in fwd_users:
                u.replace_input_with(p, full)
            # what forward makes from the whole weight alone (t, views): backward makes its own from its gather
            made, stack = {full}, [full]
            while stack:
                x = stack.pop()
                for u in x.users:
                    if (u not in made and M.get(u, M.PHASE) == "forward" and u.target in _VIEWISH
                            and all(a in made for a in u.all_input_nodes)):
                        made.add(u)
                        stack.append(u)
        else:
            full, made = None, set()
        bwd_users = [u for u in p.users if M.get(u, M.PHASE) == "backward"]
        reads = [(u, x) for x in made for u in x.users if M.get(u, M.PHASE) == "backward"]
        if not bwd_users and not reads:
            return
        first = min(_known(g, order, bwd_users + [u for u, _ in reads]), key=order.__getitem__)
        mod = M.get(first, M.MODULE, "")
        full_b = gather(first, "backward", mod)
        M.set_meta(full_b, M.RECOMPUTE_OF, full.name if full is not None else p.name)
        for u in bwd_users:
            u.replace_input_with(p, full_b)
        copies = {full: full_b} if full is not None else {}
        for x in sorted(_known(g, order, made - {full}), key=order.__getitem__):   # forward order: inputs first
            with g.inserting_before(first):
                y = g.node_copy(x, lambda a: copies.get(a, a))
            _stamp(y, "backward", mod)
            M.set_meta(y, M.RECOMPUTE_OF, x.name)
            copies[x] = y
        for u, x in reads:
            u.replace_input_with(x, copies[x])

    @staticmethod
    def _gather_once(g, p, shape, numel, n, ranks) -> None:
        """Stage 3 with F/B graphs (microbatches, pipelines): one gather per parameter and step, in the UNSHARD
        graph the schedule's ``UNSHARD s`` runs; every forward and backward of the step reads it, ``RESHARD s``
        drops it (the schedule IR's actions, not a gather per microbatch)."""
        c = chunk_numel(numel, n)
        full_val = p.meta["val"]
        p.meta["val"] = full_val.new_empty([c])
        users = [u for u in p.users if M.get(u, M.PHASE) in ("forward", "backward")]
        if not users:
            return
        first = users[0]
        with g.inserting_before(first):
            ag = g.call_function(C10D.all_gather_into_tensor.default, (p, n, group_tag("dp")))
            w = g.call_function(C10D.wait_tensor.default, (ag,))
            sl = g.call_function(aten.slice.Tensor, (w, 0, 0, numel))
            full = g.call_function(aten.view.default, (sl, list(shape)))
        for x in (ag, w, sl, full):
            _stamp(x, "forward", M.get(first, M.MODULE, ""))
            M.set_meta(x, M.UNSHARD, True)
        M.set_meta(ag, M.COMM, M.CommInfo("all_gather", "dp", tuple(ranks), c * full_val.element_size()))
        for u in users:
            u.replace_input_with(p, full)

    # ---- stages 1 and 2: gather the updated chunks into whole parameters ---------------------------------
    @staticmethod
    def _gather_updates(g, sig, buckets, sizes, numels, shapes, n, ranks) -> int:
        out = g.find_nodes(op="output")[0]
        outs = list(out.args[0])
        pos = {k: i for i, (r, k) in enumerate(sig.outputs) if r == Role.NEW_PARAM}
        count = 0
        for b in buckets:
            b = [k for k in b if k in pos]
            if not b:
                continue
            C = sum(sizes[k] for k in b)
            val = outs[pos[b[0]]].meta["val"]
            with g.inserting_before(out):
                cat = g.call_function(aten.cat.default, ([outs[pos[k]] for k in b],))
                ag = g.call_function(C10D.all_gather_into_tensor.default, (cat, n, group_tag("dp")))
                w = g.call_function(C10D.wait_tensor.default, (ag,))
                rows = g.call_function(aten.view.default, (w, [n, C]))
            for x in (cat, ag, w, rows):
                _stamp(x, "optimizer")
            M.set_meta(ag, M.COMM, M.CommInfo("all_gather", "dp", tuple(ranks), C * val.element_size()))
            off = 0
            for k in b:
                c = sizes[k]
                with g.inserting_before(out):
                    col = g.call_function(aten.slice.Tensor, (rows, 1, off, off + c))
                    flat = g.call_function(aten.reshape.default, (col, [n * c]))
                    sl = g.call_function(aten.slice.Tensor, (flat, 0, 0, numels[k]))
                    full = g.call_function(aten.view.default, (sl, list(shapes[k])))
                for x in (col, flat, sl, full):
                    _stamp(x, "optimizer")
                outs[pos[k]] = full
                off += c
            count += 1
        out.args = (tuple(outs),)
        return count


def _known(g, order: dict, nodes):
    """``nodes``, with ``order`` taken again over the graph if one of them is not in it."""
    nodes = list(nodes)
    if any(x not in order for x in nodes):
        order.clear()
        order.update((x, i) for i, x in enumerate(g.nodes))
    return nodes


def _prefetch(g) -> None:
    """Stage 3: start each parameter's gather as soon as the previous parameter's has arrived, so it overlaps the
    compute that uses the previous one (prefetch one ahead, as FSDP's forward/backward prefetch), within forward
    and within backward. A gather reads only its parameter's chunk, a graph input, so it may start anywhere earlier."""
    for phase in ("forward", "backward"):
        gathers = [x for x in g.nodes if x.op == "call_function" and x.target is C10D.all_gather_into_tensor.default
                   and M.get(x, M.PHASE) == phase and x.args[0].op == "placeholder"]
        for prev, cur in zip(gathers, gathers[1:]):
            next(iter(prev.users)).append(cur)
