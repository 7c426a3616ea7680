"""zero_offload: ZeRO-Offload's host-side update (Ren et al., ATC'21, §4) and ZeRO-Infinity's read-ahead from disk
(Rajbhandari et al., SC'21, §6.2), on a stage's joint graph after ``passes.zero``.

``Strategy(dp=N, zero=1|2|3, offload=("optimizer",))`` (``offload_to="cpu"`` or ``"disk"``): the optimizer
state, and the rank's master copy of its parameter chunks, live in host memory; the update runs there. The
graph says where each value is by ``_to_copy(..., device=...)`` nodes:

1. **gradients stream to the host**: each bucket's reduce-scattered chunk is copied to the host as soon as its
   ``wait_tensor`` returns (in backward for every bucket but the last, whose wait is where backward ends; one
   copy per bucket, ``passes.zero`` having made one reduce-scatter per bucket); everything that read the
   chunk (the slices the update reads, the ``grad`` outputs) reads the host copy;
2. **the update on the host**: the traced optimizer reads only host values (the copied gradient chunks, the
   ``param_shard`` master chunks and ``opt_state`` chunks the runtime keeps on the host);
3. **updated chunks back**: stages 1-2 copy each bucket's updated chunks (the ``cat`` ``passes.zero`` makes for
   the all-gather) to the compute device just before that bucket's ``all_gather``: one copy per bucket. Stage 3
   has no such gather: the updated chunk *is* the parameter, kept on the host (the master), and each gather of
   it in forward and backward first copies it to the device.

The device is the graph's tensors' device. fxpar runs CPU ranks, so here every copy is host to host: the
graph shows the mechanism and the numerics prove it changes nothing; the memory and PCIe benefit needs a GPU
(as ``passes.offload`` says for activations). One precision throughout: the master chunk equals the rank's
chunk of the parameter, so under stages 1-2 the runtime cuts it from the parameter it holds (a view on CPU).

``offload_to="disk"`` (ZeRO-Infinity) adds explicit read-ahead, ``fxpar::prefetch`` (``fxpar.prefetch``), of
disk-resident inputs, one read ahead, as ``passes.zero``'s gather prefetch: within forward and within
backward, the file of the next parameter read is requested just after the current one is read (under stage 3:
just after the current parameter's gather starts, before the layer computes); what the update reads (its
optimizer state, and its parameter chunk when parameters are offloaded) is requested just after the bucket's
reduce-scatter starts, so the reads overlap the rest of backward.

Before / after (stage 2, dp=2, one bucket; the dp average and the update abridged)::

    rs = reduce_scatter_tensor(buf, 'sum', 2, 'fxpar:dp'); w = wait_tensor(rs); g = slice(w, 0, 0, 4)
    _foreach_lerp_([exp_avg], [g], 0.1); ...; p1 = _foreach_sub(...)
    ag = all_gather_into_tensor(cat([p1]), 2, 'fxpar:dp')

    rs = reduce_scatter_tensor(buf, 'sum', 2, 'fxpar:dp'); w = wait_tensor(rs)
    w_host = _to_copy(w, device=cpu); g = slice(w_host, 0, 0, 4)          # streamed to the host
    _foreach_lerp_([exp_avg], [g], 0.1); ...; p1 = _foreach_sub(...)       # the update on host values
    ag = all_gather_into_tensor(_to_copy(cat([p1]), device=cuda:0), 2, 'fxpar:dp')   # back, then gathered

Stage 3 with parameters on disk (prefetch of layer 1 while layer 0's gather runs and layer 0 computes)::

    ag = all_gather_into_tensor(_to_copy(w0, device=cuda:0), 2, 'fxpar:dp'); prefetch = fxpar.prefetch(w1)
    w0_full = view(slice(wait_tensor(ag), ...)); ag_1 = all_gather_into_tensor(_to_copy(w1, ...)); mm(x, t(w0_full))
"""
from __future__ import annotations

import torch

from fxpar import meta as M
from fxpar.collectives import C10D
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.prefetch import prefetch as PREFETCH
from fxpar.roles import Role

__all__ = ["ZeroOffload", "HOST"]

aten = torch.ops.aten
HOST = torch.device("cpu")
_AG, _RS, _WAIT = (C10D.all_gather_into_tensor.default, C10D.reduce_scatter_tensor.default,
                   C10D.wait_tensor.default)


def _like(anchor, node, **extra) -> None:
    """``node`` takes ``anchor``'s place tags: phase, module, REDUCE_GRAD/UNSHARD (so the split puts it beside)."""
    for key in (M.PHASE, M.MODULE, M.REDUCE_GRAD, M.UNSHARD):
        if key.name in anchor.meta:
            node.meta[key.name] = anchor.meta[key.name]
    node.meta.update(extra)


def _copy(g, x, device, *, after=None, before=None, tags=None):
    """``_to_copy(x, device=device)`` after or before a node, with a fake value of its own (a copy is new memory)."""
    with (g.inserting_after(after) if after is not None else g.inserting_before(before)):
        c = g.call_function(aten._to_copy.default, (x,), {"device": device})
    v = x.meta["val"]
    c.meta["val"] = v.clone() if v.device == device else v.to(device)
    _like(tags if tags is not None else x, c)
    return c


def _is_copy(n, device=None) -> bool:
    return (n.op == "call_function" and n.target is aten._to_copy.default
            and (device is None or n.kwargs.get("device") == device))


def graph_device(gm) -> torch.device:
    """The compute device: where the graph's parameters are."""
    sig = gm.meta[M.SIGNATURE.name]
    for ph, (role, _) in zip(gm.graph.find_nodes(op="placeholder"), sig.inputs):
        if role == Role.PARAM and isinstance(ph.meta.get("val"), torch.Tensor):
            return ph.meta["val"].device
    return HOST


# ---- ZeRO-Offload ---------------------------------------------------------------------------------------
def grads_to_host(g) -> list:
    """One copy to the host per reduce-scatter, right after its wait; every reader of the chunk reads the copy."""
    out = []
    for rs in [n for n in g.nodes if n.op == "call_function" and n.target is _RS]:
        (w,) = [u for u in rs.users if u.target is _WAIT]
        h = _copy(g, w, HOST, after=w)
        w.replace_all_uses_with(h, delete_user_cb=lambda u, h=h: u is not h)
        out.append(h)
    return out


def updates_to_device(g, device) -> list:
    """Stages 1-2: each bucket's updated chunks (the all-gather's input) copied to the device before the gather."""
    out = []
    for ag in [n for n in g.nodes if n.op == "call_function" and n.target is _AG
               and M.get(n, M.PHASE) == "optimizer" and n.args[0].op != "placeholder"]:
        out.append(_copy(g, ag.args[0], device, before=ag, tags=ag))
        ag.replace_input_with(ag.args[0], out[-1])
    return out


def chunks_to_device(g, device) -> list:
    """Stage 3: each gather reads the host-resident chunk through a copy to the device."""
    out = []
    for ag in [n for n in g.nodes if n.op == "call_function" and n.target is _AG and n.args[0].op == "placeholder"]:
        out.append(_copy(g, ag.args[0], device, before=ag, tags=ag))
        ag.replace_input_with(ag.args[0], out[-1])
    return out


def mark_host_values(g, roles: dict, what: set, stage: int) -> int:
    """On a rank that computes on a device: mark (``fxpar_on_host``) every value that lives in host memory -- the
    offloaded inputs (optimizer state; the parameter chunks under stage 3 or with parameters offloaded), the copies
    to the host, and whatever is computed from host values alone (the update) -- so that the memory model counts
    device memory without them. Returns how many nodes it marked."""
    host_roles = ({Role.OPT_STATE} if "optimizer" in what else set()) | \
        ({Role.PARAM} if "params" in what or (stage == 3 and "optimizer" in what) else set())
    on_host: set = {ph for ph, (role, _) in roles.items() if role in host_roles}
    for n in g.nodes:
        if n.op != "call_function" or n in on_host:
            continue
        if _is_copy(n):
            if n.kwargs.get("device") == HOST:
                on_host.add(n)
            continue                                   # a copy to the device is device memory
        ins = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), (torch.Tensor, list, tuple))]
        if ins and all(a in on_host for a in ins):
            on_host.add(n)
    for n in on_host:
        M.set_meta(n, M.ON_HOST, True)
    return len(on_host)


# ---- ZeRO-Infinity: read ahead from disk -----------------------------------------------------------------
def _prefetch_after(g, anchor, ph, phase):
    with g.inserting_after(anchor):
        p = g.call_function(PREFETCH, (ph,))
    if phase is None:
        _like(anchor, p)                 # beside its anchor (the UNSHARD graph too)
    else:                                # moved ahead of the update: only the phase says where it runs
        M.set_meta(p, M.PHASE, phase)
        M.set_meta(p, M.MODULE, M.get(anchor, M.MODULE, ""))
    p.meta["val"] = None
    return p


def prefetch_reads(g, roles: dict, on_disk: set) -> list:
    """Forward's and then backward's reads of disk-resident inputs, each input at its first read in each phase; the
    next one's read-ahead goes just after the current one's read (or after the gather that read starts), forward's
    last read prefetching backward's first. ``roles``: placeholder -> (role, key)."""
    order = {n: i for i, n in enumerate(g.nodes)}
    seq = []
    for phase in ("forward", "backward"):
        first = {}
        for ph, (role, _) in roles.items():
            reads = [u for u in ph.users if M.get(u, M.PHASE) == phase and u.target is not PREFETCH]
            if role in on_disk and reads:
                first[ph] = min(reads, key=order.__getitem__)
        seq += sorted(((ph, r) for ph, r in first.items()), key=lambda pr: order[pr[1]])
    out = []
    for (prev, anchor), (nxt, _) in zip(seq, seq[1:]):
        if nxt is prev:                                       # read again at once (forward's last, backward's first)
            continue
        if _is_copy(anchor) and len(anchor.users) == 1 and next(iter(anchor.users)).target is _AG:
            anchor = next(iter(anchor.users))                 # after the gather starts, not between copy and gather
        out.append(_prefetch_after(g, anchor, nxt, None))
    return out


def prefetch_update_reads(g, roles: dict, on_disk: set) -> list:
    """What the update reads of each bucket's parameters (their optimizer state; their chunk when parameters are on
    disk), requested just after the bucket's reduce-scatter starts. Tagged ``optimizer``: a split program runs it
    at the top of ``STEP``, the only graph given the optimizer state."""
    by_key = {}
    for ph, (role, key) in roles.items():
        if role in on_disk and role in (Role.OPT_STATE, Role.PARAM, Role.PARAM_SHARD):
            by_key.setdefault(key.split(":", 1)[-1], []).append(ph)
    out = []
    for rs in [n for n in g.nodes if n.op == "call_function" and n.target is _RS]:
        keys, stack, seen = [], list(rs.users), set()
        while stack:                                          # the slices of the waited chunk name their parameter
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if M.get(x, M.GRAD_OF) is not None and x.target is aten.slice.Tensor:
                keys.append(M.get(x, M.GRAD_OF))
                continue
            stack.extend(x.users)
        anchor = rs
        for k in sorted(keys):
            for ph in by_key.get(k, []):
                if any(M.get(u, M.PHASE) == "optimizer" for u in ph.users):
                    anchor = _prefetch_after(g, anchor, ph, "optimizer")
                    out.append(anchor)
    return out


class ZeroOffload(Pass):
    """ZeRO-Offload (the Plan's ``zero_offload`` section: ``what`` has ``optimizer``) and ZeRO-Infinity's disk
    read-ahead (``to == 'disk'``) on the chunks ``passes.zero`` made."""
    name = "zero_offload"
    requires = ("zero",)

    def run(self, gm, ctx: PassContext) -> PassResult:
        off = ctx.plan.section("zero_offload")
        what = set(off.what) if off is not None else set()
        info = gm.meta.get(M.ZERO.name)
        if not what or not info:
            return PassResult(gm, False)
        g = gm.graph
        sig = gm.meta[M.SIGNATURE.name]
        roles = dict(zip(g.find_nodes(op="placeholder"), sig.inputs))
        device, stage = graph_device(gm), info["stage"]
        stats = {"to_host": 0, "to_device": 0, "prefetch": 0}
        if "optimizer" in what:
            stats["to_host"] = len(grads_to_host(g))
            if stage < 3:
                stats["to_device"] = len(updates_to_device(g, device))
        if stage == 3:
            stats["to_device"] += len(chunks_to_device(g, device))
        if off.to == "disk":
            on_disk = ({Role.PARAM, Role.PARAM_SHARD} if "params" in what else set()) | \
                      ({Role.OPT_STATE} if "optimizer" in what else set())
            stats["prefetch"] = len(prefetch_update_reads(g, roles, on_disk)) + len(prefetch_reads(g, roles, on_disk))
        if device != HOST:
            stats["on_host"] = mark_host_values(g, roles, what, stage)
        g.lint()
        gm.meta[M.ZERO_OFFLOAD.name] = {"host": str(HOST), "device": str(device), **stats}
        ctx.notes.append(
            f"zero_offload: {stats['to_host']} gradient chunk copy(ies) to {HOST} (one per bucket, after its "
            f"reduce-scatter), the update on the host, {stats['to_device']} copy(ies) to {device} "
            + ("(stage 3: before each gather of a chunk)" if stage == 3 else "(one per bucket, before its all-gather)")
            + (f"; {stats['prefetch']} read-ahead(s) from disk (fxpar::prefetch)" if stats["prefetch"] else "")
            + ("; here host and device are both the CPU: the copies show the mechanism, not a saving"
               if device == HOST else ""))
        return PassResult(gm, True, stats)
