"""ByteScheduler as a graph pass (Peng et al., SOSP'19): priority, partitions, credit, cross-iteration overlap.

The planner decides (``fxpar.features.bytescheduler.plan_comm_schedule``, simulated by ``cost_models.comm_tuning``): the
buckets (at most ``partition`` bytes; a bigger single gradient is cut into row pieces), their priority (the
order the next forward first uses their parameters), the credit, and the issue plan -- at each event of
the step (a bucket made in backward: ``ready``; a bucket needed: ``need``) which pieces are issued and
which are waited. This pass carries the plan out on a stage's joint graph, after ``bucket``:

1. **Partition**: a bucket planned in row pieces gets one fresh buffer, copy and in-place all_reduce per
   piece; the reduced gradient is the ``cat`` of the pieces (each piece its own storage: a later cut
   never sees one piece's write land in another's export).
2. **Priority and credit**: every piece's all_reduce and wait move to the event the plan names, in the
   plan's order, so at most ``credit`` bytes are issued and not waited at any point of the step.
3. **Cross-iteration overlap** (one stage, one microbatch, traced optimizer): the joint graph becomes the
   steady-state step. Each bucket's wait and its parameters' update move into the *next* step, just before
   the first forward use of those parameters: the pieces cross the step boundary as ``("carry", piece)``
   inputs and outputs, the optimizer's ``_foreach`` ops are cut per bucket (element-wise: the same math),
   and forward and backward read the updated parameters. A bucket whose pieces the plan expects to have landed
   earlier is updated earlier (an ``("update", bucket)`` op: at the next step's ``start``, before its first
   forward op, or while another bucket's wait would stall), so the optimizer runs in time the rank would
   otherwise spend waiting. After ``split_graphs`` the feature derives ``FIRST`` (nothing
   carried in: no update) and ``DRAIN`` (the carried waits and updates only; before results, state_dict
   and checkpoints) from it by data flow (:func:`carry_variants`); the graphs the ranks run then make the
   update in place (``passes.reinplace``), as the other programs do.
   Under a pipeline or with several microbatches (graphs ``F``, ``B``, ``REDUCE_GRAD``, ``STEP``) the stage's
   ``STEP`` moves instead: its ``_foreach`` ops are cut per bucket here, and after the split the feature adds ``F_UPDATE``,
   the stage's first forward of the next step with each bucket's carried waits and update just before that
   bucket's first forward op (``passes.carry_step``).

4. **The delayed update under ZeRO** (``Strategy(zero=1|2|3, delayed_update=True)``, ZeRO-Offload's DPU on
   ``passes.zero``'s chunks): there is no ByteScheduler piece plan; each bucket's reduce-scattered gradient
   chunk, waited in its own step (one collective in flight, as ``passes.zero`` keeps it), leaves the step as a
   ``("carry", "chunk<b>")`` output and comes back as an input that the next step's update reads after its
   backward (``passes.delayed_update``). Forward and backward read the parameters before the update.

Before / after (cross-iteration, two buckets, ``fc2`` made first in backward, ``fc1`` needed first)::

    mm = mm(x, t(fc1_w)); ...; mm_9 = mm(..)                     # forward, backward (grad fc1_w last)
    all_reduce_ = all_reduce_(bucket0); all_reduce__1 = all_reduce_(bucket1)
    wait = wait_tensor(all_reduce_); wait_1 = wait_tensor(all_reduce__1)
    _foreach_sub = _foreach_sub([fc1_w, fc2_w], [g1, g2])       # optimizer: every parameter at once

    wait_2 = wait_tensor(carry_piece1)                         # previous step's fc1 bucket
    _foreach_sub_1 = _foreach_sub([fc1_w], [view(wait_2)])     # ... its update
    mm = mm(x, t(getitem))                                     # forward reads the updated fc1_w
    wait_3 = wait_tensor(carry_piece0); _foreach_sub_0 = ...   # fc2 just before its first use
    ...; all_reduce_ = all_reduce_(bucket0); ...               # this step's buckets leave as carry
    return (loss, getitem, ..., all_reduce_, all_reduce__1)
"""
from __future__ import annotations

import copy
import operator

import torch
import torch.fx

from fxpar import meta as M
from fxpar.collectives import C10D, insert_all_reduce
from fxpar.errors import PassError
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.roles import GraphKind, Role

from .delayed_update import carry_zero_chunks
from .reinplace import ReinplaceOptimizer

__all__ = ["CommSchedule", "carry_variants", "carry_step", "buckets_of_params", "split_foreach", "reinplaced",
           "FIRST", "DRAIN", "F_UPDATE"]

# The graph kinds the carry cuts besides the core ones (fxpar.roles.GraphKind): a feature's kinds are its own
# strings, declared once by the passes that cut them, and never a core kind's name.
FIRST = "FIRST"          # one stage, one microbatch: the first step (nothing carried in)
DRAIN = "DRAIN"          # ... and the carried waits and update alone, after the last step
F_UPDATE = "F_UPDATE"    # split graphs: the first F with the previous step's STEP folded in (passes.carry_step)

aten = torch.ops.aten


def _buckets(gm) -> dict:
    """bucket index -> (all_reduce_, buffer, wait, last copy before the issue) as ``bucket`` made them."""
    out = {}
    for n in gm.graph.nodes:
        b = M.get(n, M.BUCKET)
        if b is None or n.target is not C10D.all_reduce_.default:
            continue
        waits = [u for u in n.users if u.target is C10D.wait_tensor.default]
        out[b] = (n, n.args[0], waits[0], n.prev)
    return out


def _tag(node, src, val, tag=None):
    node.meta["val"] = val
    for k in (M.PHASE.name, M.MODULE.name):
        if k in src.meta:
            node.meta[k] = src.meta[k]
    if tag:
        M.set_meta(node, M.REDUCE_GRAD, tag)


def _partition(gm, ctx, b, ar, buf, w, cuts) -> list:
    """Replace bucket ``b`` (one gradient) by one buffer + all_reduce_ per row range; returns its pieces
    ``[(all_reduce_, wait, buffer, last copy)]``; the gradient becomes the ``cat`` of the pieces."""
    g = gm.graph
    grads = [u for s in w.users for u in s.users if M.get(u, M.GRAD_OF) is not None]
    if len(grads) != 1 or len(w.users) != 1:
        raise PassError(f"comm_schedule: bucket {b} of stage {ctx.stage} is not one gradient's slot (its wait feeds "
                        f"{[u.name for u in w.users]}); only a single-gradient bucket is cut in row pieces: plan the "
                        "stage again (drop the Plan's bytescheduler stages)")
    grad, (sl,) = grads[0], list(w.users)
    copies = [u for u in buf.users if u.op == "call_function" and u.target is aten.slice.Tensor]
    (view,) = [u for s in copies for u in s.users]
    (cp,) = list(view.users)
    raw = cp.args[1]
    rest = list(raw.meta["val"].shape[1:])
    axis = M.get(ar, M.COMM).axis
    ranks = M.get(ar, M.COMM).ranks
    pieces, cursor = [], ar
    for r0, r1 in cuts:
        val = raw.meta["val"][r0:r1]
        n = val.numel()
        with g.inserting_after(cursor):
            nb = g.call_function(aten.empty.memory_format, ([n],), dict(buf.kwargs))
        with g.inserting_after(nb):
            slot = g.call_function(aten.view.default, (nb, [r1 - r0] + rest))
        with g.inserting_after(slot):
            src = g.call_function(aten.slice.Tensor, (raw, 0, r0, r1))
        with g.inserting_after(src):
            c = g.call_function(aten.copy_.default, (slot, src))
        flat = buf.meta["val"].new_empty([n])
        for node, v in ((nb, flat), (slot, flat.view(val.shape)), (src, val), (c, flat.view(val.shape))):
            _tag(node, cp, v, "issue")
        a, wt = insert_all_reduce(g, nb, axis, ranks, after=c, in_place=True)
        M.set_meta(a, M.BUCKET, b)
        M.set_meta(a, M.REDUCE_GRAD, "issue")
        M.set_meta(wt, M.REDUCE_GRAD, "wait")
        pieces.append((a, wt, nb, c))
        cursor = wt
    # the reduced gradient: the pieces' rows, back in one tensor, where the old wait was read
    with g.inserting_before(grad):
        parts = []
        for (a, wt, nb, c), (r0, r1) in zip(pieces, cuts):
            v = g.call_function(aten.view.default, (wt, [r1 - r0] + rest))
            _tag(v, grad, raw.meta["val"][r0:r1], "wait")
            parts.append(v)
        cat = g.call_function(aten.cat.default, (parts, 0))
    _tag(cat, grad, raw.meta["val"], "wait")
    M.copy_meta(grad, cat)
    M.set_meta(cat, M.GRAD_OF, M.get(grad, M.GRAD_OF))
    M.set_meta(cat, M.REDUCE_GRAD, "wait")
    grad.replace_all_uses_with(cat)
    for dead in [grad, sl, w, ar, cp, view] + copies + [buf]:
        if dead in g.nodes and not dead.users:
            g.erase_node(dead)
    return pieces


def _pieces(gm, ctx, entry) -> list:
    """Piece id -> (all_reduce_, wait, buffer, last copy), partitioning the buckets the plan cut in rows."""
    found = _buckets(gm)
    by_bucket: dict = {}
    for b, r0, r1 in entry["pieces"]:
        by_bucket.setdefault(b, []).append(None if r0 is None else (r0, r1))
    out = []
    for b, cuts in by_bucket.items():
        if b not in found:
            raise PassError(f"comm_schedule: the Plan's bytescheduler section names bucket {b} of stage {ctx.stage}, "
                            "which the bucket "
                            f"pass did not make (buckets {sorted(found)}); plan again (drop the Plan's bytescheduler stages)")
        ar, buf, w, last = found[b]
        if cuts == [None]:
            out.append((ar, w, buf, last))
        else:
            out += _partition(gm, ctx, b, ar, buf, w, cuts)
    return out


def _place(gm, pieces, events, cross: bool) -> dict:
    """Move each piece's issue and wait to the plan's event: ``ready`` right after the bucket's last copy, every
    ``need`` where the step first reads a reduced gradient (the optimizer; with cross-iteration,
    :func:`_move_updates` then moves them into the forward). Returns {(piece, op): event kind}."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    last_copy = {}                                    # bucket -> the last copy of all its pieces
    for ar, _, _, c in pieces:
        b = M.get(ar, M.BUCKET)
        if b not in last_copy or order[c] > order[last_copy[b]]:
            last_copy[b] = c
    need_at = min((u for _, w, _, _ in pieces for u in w.users), key=order.__getitem__)
    where = {}
    for kind, b, ops in events:
        cursor = last_copy.get(b)
        for op, p in ops:
            if op == "update":                       # an update's place (cross-iteration): _move_updates
                continue
            ar, w = pieces[p][0], pieces[p][1]
            node = ar if op == "issue" else w
            where[(p, op)] = kind
            M.set_meta(node, M.REDUCE_GRAD, "issue" if kind == "ready" else "wait")
            if kind == "ready":
                cursor.append(node)
                cursor = node
            else:
                need_at.prepend(node)
                if op == "issue" and not cross:    # the buffer crosses to STEP once its copies are made: an alias
                    _alias_after_copies(g, ar, pieces[p][3])
    return where


def _alias_after_copies(g, ar, last_copy) -> None:
    buf = ar.args[0]
    with g.inserting_after(last_copy):
        al = g.call_function(aten.alias.default, (buf,))
    _tag(al, last_copy, buf.meta["val"], "issue")
    ar.args = (al,) + tuple(ar.args[1:])


def split_foreach(gm, group_of: list) -> None:
    """Cut every optimizer ``_foreach`` op over all P parameters into one op per group (element-wise ops:
    the same values, bit for bit); ``getitem`` users follow their element."""
    g = gm.graph
    P = len(group_of)
    groups = sorted(set(group_of))
    idx = {gr: [i for i in range(P) if group_of[i] == gr] for gr in groups}
    for n in list(g.nodes):
        if n.op != "call_function" or not str(getattr(n.target, "__name__", "")).startswith("_foreach_"):
            continue
        lists = [i for i, a in enumerate(n.args) if isinstance(a, (list, tuple))]
        if not lists:
            continue
        if any(len(n.args[i]) != P for i in lists):
            raise PassError(f"comm_schedule: optimizer node {n.name} ({n.target}) has lists of "
                            f"{[len(n.args[i]) for i in lists]} elements, not one per parameter ({P}); cannot cut it "
                            "per bucket for cross-iteration overlap")
        made = {}
        for gr in groups:
            args = tuple([a[i] for i in idx[gr]] if j in lists else a for j, a in enumerate(n.args))
            with g.inserting_before(n):
                m = g.call_function(n.target, args, dict(n.kwargs))
            m.meta.update({k: v for k, v in n.meta.items() if k != "val"})
            if isinstance(n.meta.get("val"), (list, tuple)):
                m.meta["val"] = [n.meta["val"][i] for i in idx[gr]]
            made[gr] = m
        for u in list(n.users):
            if u.target is not operator.getitem:
                raise PassError(f"comm_schedule: {u.name} reads the whole list {n.name}; cannot cut it per bucket")
            i = u.args[1]
            gr = group_of[i]
            u.args = (made[gr], idx[gr].index(i))
        g.erase_node(n)


def _cross_iteration(gm, pieces, where, events) -> list:
    """Make the joint graph the steady-state step (module docstring, 3). Returns the carry keys."""
    g = gm.graph
    sig = gm.meta[M.SIGNATURE.name]
    outs = list(g.find_nodes(op="output")[0].args[0])
    phs = g.find_nodes(op="placeholder")
    role = dict(zip(phs, sig.inputs))
    keys = [k for r, k in sig.inputs if r == Role.PARAM]
    ph_of = {k: ph for ph, (r, k) in role.items() if r == Role.PARAM}
    new_of = {k: outs[i] for i, (r, k) in enumerate(sig.outputs) if r == Role.NEW_PARAM}
    bucket_of_key = buckets_of_params(pieces, keys)
    split_foreach(gm, [bucket_of_key[k] for k in keys])
    # carry: each piece leaves this step as it stands after backward, and comes back as an input
    last_ph = phs[-1]
    carry_keys, carry_out, carried_ops = [], [], {}
    for p, (ar, w, buf, _) in enumerate(pieces):
        name = f"piece{p}"
        with g.inserting_after(last_ph):
            c = g.placeholder(f"carry_{name}")
        c.meta["val"] = buf.meta["val"]
        M.set_meta(c, M.ROLE, Role.CARRY)
        last_ph = c
        issued_here, waited_here = where.get((p, "issue")) == "ready", where.get((p, "wait")) == "ready"
        cur = c
        if not issued_here:
            with g.inserting_before(ar):
                cur = g.call_function(ar.target, (c,) + tuple(ar.args[1:]))
            cur.meta.update(ar.meta)
            carried_ops[(p, "issue")] = cur
        if not waited_here:
            with g.inserting_before(w):
                cur = g.call_function(C10D.wait_tensor.default, (cur,))
            cur.meta.update(w.meta)
            carried_ops[(p, "wait")] = cur
        for u in list(w.users):
            u.replace_input_with(w, cur)
        carry_out.append(w if waited_here else ar if issued_here else buf)
        if not waited_here:
            g.erase_node(w)
        if not issued_here:
            g.erase_node(ar)
        carry_keys.append(name)
    sig.inputs += [(Role.CARRY, k) for k in carry_keys]
    delayed = bool(gm.meta.get(M.DELAYED_UPDATE.name))
    # forward and backward read the updated parameters (under the delayed update: the ones before it)
    for k in (keys if not delayed else ()):
        for u in list(ph_of[k].users):
            if M.get(u, M.PHASE) in ("forward", "backward"):
                u.replace_input_with(ph_of[k], new_of[k])
    keep = [i for i, (r, _) in enumerate(sig.outputs) if r != Role.GRAD]
    sig.outputs = [sig.outputs[i] for i in keep] + [(Role.CARRY, k) for k in carry_keys]
    g.find_nodes(op="output")[0].args = (tuple([outs[i] for i in keep] + carry_out),)
    if not delayed:                # the delayed update stays after backward, where the optimizer was
        _move_updates(gm, keys, new_of, bucket_of_key, sig, events, carried_ops)
    gm.meta[M.CARRY.name] = True
    return carry_keys



def carry_step(gm, pieces, events) -> list:
    """Cross-iteration overlap with split graphs (``passes.carry_step``): on the joint graph after ``_place``
    (without cross-iteration: need events at the optimizer): cut the
    optimizer per bucket and record, per need event in the plan's order, its bucket, how many collective ops it
    has (they sit in ``STEP`` in that order) and the bucket's parameter keys (``gm.meta['fxpar_carry_step']``).
    Returns the pieces waited in the next step."""
    sig = gm.meta[M.SIGNATURE.name]
    keys = [k for r, k in sig.inputs if r == Role.PARAM]
    bucket_of_key = buckets_of_params(pieces, keys)
    split_foreach(gm, [bucket_of_key[k] for k in keys])
    need = [[b, len(ops), [k for k in keys if bucket_of_key[k] == b]] for kind, b, ops in events if kind == "need"]
    gm.meta[M.CARRY_STEP.name] = need
    gm.graph.lint()
    return [p for kind, _, ops in events if kind == "need" for op, p in ops if op == "wait"]


def buckets_of_params(pieces, keys: list) -> dict:
    """param key -> the bucket its reduced gradient is in (every key must have one: cross-iteration overlap moves
    each update into the next step, bucket by bucket)."""
    bucket_of_key = {}
    for ar, w, _, _ in pieces:
        for n in _downstream_grads(w):
            bucket_of_key[M.get(n, M.GRAD_OF)] = M.get(ar, M.BUCKET)
    missing = [k for k in keys if k not in bucket_of_key]
    if missing:
        raise PassError(f"comm_schedule: parameters {missing[:4]} have no reduced gradient in a bucket; "
                        "cross-iteration overlap moves every update into the next step, bucket by bucket. Freeze them "
                        "(requires_grad=False) if nothing should train them, or use comm_schedule='fifo'")
    return bucket_of_key

def _downstream_grads(w) -> list:
    """The gradient nodes (fxpar_grad_of) a piece's wait feeds, through slices, views and cat."""
    out, stack, seen = [], list(w.users), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if M.get(n, M.GRAD_OF) is not None:
            out.append(n)
        elif n.target in (aten.slice.Tensor, aten.view.default, aten.cat.default, aten.div_.Tensor):
            stack.extend(n.users)
    return out


def _ancestors(nodes, stop) -> set:
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder" or n in stop:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _move_updates(gm, keys, new_of, bucket_of_key, sig, events, carried_ops) -> None:
    """Each bucket's ``need`` event (its carried waits, and the issues and waits of others the plan puts there)
    and its parameters' update go just before the first forward use of those parameters. The plan may run a
    bucket's update earlier, where its pieces have landed (``("update", bucket)`` ops): at the ``start`` event
    (before the first forward op) or inside an earlier bucket's ``need`` event, while that one's pieces are still
    on the wire (``cost_models.comm_tuning._next_forward``)."""
    g = gm.graph
    outs = g.find_nodes(op="output")[0].args[0]
    state_of = {}
    for (r, k), o in zip(sig.outputs, outs):
        if r == Role.NEW_OPT_STATE:
            state_of.setdefault(k.split(":", 1)[1], []).append(o)
    order = {n: i for i, n in enumerate(g.nodes)}
    fwd = next((n for n in g.nodes if M.get(n, M.PHASE) == "forward"), None)
    first_use = {}
    for k in keys:
        users = [u for u in new_of[k].users if M.get(u, M.PHASE) == "forward"]
        first_use[k] = min(users, key=order.__getitem__) if users else fwd
    by_bucket: dict = {}
    for k in keys:
        by_bucket.setdefault(bucket_of_key[k], []).append(k)
    placed: set = set()

    def update(b, anchor):                  # bucket b's update (and what it still needs) just before anchor
        ks = by_bucket.get(b, [])
        chain = _ancestors([new_of[k] for k in ks] + [o for k in ks for o in state_of.get(k, [])], placed)
        for n in sorted(chain, key=order.__getitem__):
            anchor.prepend(n)
        placed.update(chain)

    for kind, b, ops in events:
        if kind not in ("start", "need"):
            continue
        ks = by_bucket.get(b, []) if kind == "need" else []
        anchor = min((first_use[k] for k in ks), key=order.__getitem__) if ks else fwd
        for op, p in ops:                   # the plan's order: issues, waits and early updates of this event first
            if op == "update":
                update(p, anchor)
                continue
            n = carried_ops.get((p, op))
            if n is not None and n not in placed:
                anchor.prepend(n)
                placed.add(n)
        if kind == "need":
            update(b, anchor)
    g.lint()


class CommSchedule(Pass):
    """Carry out the Plan's ``bytescheduler`` section on a stage's joint graph: see the module docstring."""
    name = "comm_schedule"
    requires = ("bucket",)

    def __init__(self, cross_iteration: bool = False):
        self.cross_iteration = cross_iteration

    def run(self, gm, ctx: PassContext) -> PassResult:
        cs = ctx.plan.section("bytescheduler")
        if cs.delayed_update and ctx.plan.section("zero") is not None:
            return self._delay_zero(gm, ctx)
        stages = cs.stages
        entry = stages[ctx.stage] if ctx.stage < len(stages) else None
        if not entry or not entry.get("pieces"):
            return PassResult(gm, False)
        pieces = _pieces(gm, ctx, entry)
        if len(pieces) != len(entry["pieces"]):
            raise PassError(f"comm_schedule: stage {ctx.stage} has {len(pieces)} pieces, the plan {len(entry['pieces'])}")
        gm.meta[M.DELAYED_UPDATE.name] = bool(cs.delayed_update)
        split = tuple(ctx.kinds) != (GraphKind.FULL,)     # a pipeline, or several microbatches
        where = _place(gm, pieces, entry["events"], self.cross_iteration and not split)
        gm.graph.lint()
        if self.cross_iteration and split:
            carry = carry_step(gm, pieces, entry["events"])
        else:
            carry = _cross_iteration(gm, pieces, where, entry["events"]) if self.cross_iteration else []
        gm.recompile()
        ctx.notes.append(f"comm_schedule: {len(pieces)} piece(s) issued in priority order under a credit of "
                         f"{entry['credit_bytes']} bytes" + (f"; {len(carry)} carried into the next step, each bucket's "
                                                             "wait and update just before its first forward use"
                                                             + (" (STEP moves into the stage's first F: F_UPDATE)"
                                                                if split else "") if carry else ""))
        return PassResult(gm, True, {"pieces": len(pieces), "carry": len(carry)})


    @staticmethod
    def _delay_zero(gm, ctx) -> PassResult:
        z = ctx.plan.section("zero").stage
        if not gm.meta.get(M.ZERO.name):
            raise PassError(f"comm_schedule: Strategy(zero={z}, delayed_update=True), stage {ctx.stage}: "
                            "the zero pass sharded no parameter of this stage, so there is no reduce-scattered chunk to "
                            "carry; use delayed_update with zero=0 here")
        keys = carry_zero_chunks(gm)
        gm.recompile()
        ctx.notes.append(f"comm_schedule: delayed update on ZeRO-{z} chunks: {len(keys)} reduce-scattered "
                         "gradient chunk(s) carried into the next step, updated there after its backward")
        return PassResult(gm, True, {"pieces": len(keys), "carry": len(keys)})


def carry_variants(gm, sig) -> dict:
    """From the steady-state graph (``FULL``, with carry): ``FIRST`` (no carry in: the deferred waits and updates
    dropped, forward reads the parameters as given) and ``DRAIN`` (only the carried waits and updates).
    Returns {kind: (GraphModule, input roles, output roles)}."""
    g = gm.graph
    phs = g.find_nodes(op="placeholder")
    role = dict(zip(phs, sig.inputs))
    outs = list(g.find_nodes(op="output")[0].args[0])
    param_of = {o: next(ph for ph, (r, k) in role.items() if r == Role.PARAM and k == key)
                for o, (r, key) in zip(outs, sig.outputs) if r == Role.NEW_PARAM}
    deferred_roots = {ph for ph, (r, _) in role.items() if r in (Role.CARRY, Role.OPT_STATE, Role.LR, Role.STEP)}
    deferred = set()
    for n in g.nodes:      # what the carried update makes; forward reads an updated parameter as given instead
        if n in deferred_roots or any(a in deferred and a not in param_of for a in n.all_input_nodes):
            deferred.add(n)
    first_outs = [(o, rk) for o, rk in zip(outs, sig.outputs) if rk[0] in (Role.LOSS, Role.NEW_BUFFER, Role.CARRY)]
    first = _subgraph(gm, [n for n in g.nodes if n.op != "placeholder" and n not in deferred and n.op != "output"],
                      role, first_outs, param_of, FIRST)
    drain_outs = [(o, rk) for o, rk in zip(outs, sig.outputs) if rk[0] in (Role.NEW_PARAM, Role.NEW_OPT_STATE)]
    need = _ancestors([o for o, _ in drain_outs], set())
    drain = _subgraph(gm, [n for n in g.nodes if n in need], role, drain_outs, {}, DRAIN)
    cfg = gm.meta.get(M.OPTIMIZER.name)
    steady = reinplaced(copy.deepcopy(gm), list(sig.inputs), cfg)
    return {GraphKind.FULL: (steady, list(sig.inputs), list(sig.outputs)), FIRST: first,
            DRAIN: (reinplaced(drain[0], drain[1], cfg), drain[1], drain[2])}


def reinplaced(gm, roles, optimizer: dict | None = None):
    """The update in place on the parameter and state buffers (``passes.reinplace``), once the cut by data flow
    is made: the steady step's forward then reads the updated parameter buffer, after the update."""
    for ph, (r, _) in zip(gm.graph.find_nodes(op="placeholder"), roles):
        M.set_meta(ph, M.ROLE, r)
    ReinplaceOptimizer(optimizer or {}).run(gm, PassContext())   # Plan.optimizer: fused where it says so
    gm.graph.lint()
    gm.recompile()
    return gm


def _subgraph(gm, body, role, outs, subst, kind) -> tuple:
    """A graph of ``body`` (nodes of ``gm``, in order) returning ``outs``; a read of a key of ``subst`` reads its
    placeholder instead. Its inputs: the placeholders it reads, with their roles."""
    g = torch.fx.Graph()
    env, ins = {}, []
    read = {a for n in body for a in n.all_input_nodes} | {o for o, _ in outs}
    read |= {subst[a] for a in list(read) if a in subst}
    for ph, rk in role.items():
        if ph in read:
            env[ph] = g.placeholder(ph.name)
            env[ph].meta = {k: v for k, v in ph.meta.items() if k in ("val", M.PARAM.name, M.ROLE.name)}
            ins.append(rk)
    for o, ph in subst.items():
        if ph in env:
            env[o] = env[ph]
    for n in body:
        missing = [a for a in n.all_input_nodes if a not in env]
        if missing:
            raise PassError(f"comm_schedule: the {kind} graph needs {missing[0].name} for {n.name}, which it does not make")
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[o] for o, _ in outs))
    new = torch.fx.GraphModule(gm, g, f"{kind}Graph")
    new.meta[M.KIND.name] = kind
    return new, ins, [rk for _, rk in outs]
