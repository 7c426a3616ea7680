"""Inserting functional collectives into a graph: the helpers passes (ours and users') call.

A collective is two nodes: the functional op, which starts it, and ``wait_tensor``, which
blocks until the result is there. Everything between them overlaps with the communication,
so moving a wait later is how a pass expresses overlap. Groups are named by mesh axis
(``"fxpar:dp"``) in the graph; the runtime binds that name to this rank's process group, so
ranks that differ only in their dp coordinate share one graph.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from . import meta as M

__all__ = ["group_tag", "axis_of_tag", "insert_all_reduce", "insert_broadcast", "is_collective", "is_wait",
           "collective_nodes", "C10D", "gloo_all_gather_into_tensor", "lower_for_backend", "gathers_beside_collectives",
           "in_flight_across_graphs", "stage_through_host", "gloo_group"]

C10D = torch.ops._c10d_functional
_TAG = "fxpar:"


def group_tag(axis: str) -> str:
    return _TAG + axis


def axis_of_tag(tag) -> str | None:
    return tag[len(_TAG):] if isinstance(tag, str) and tag.startswith(_TAG) else None


def is_collective(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and M.COMM.name in n.meta


def is_wait(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target is C10D.wait_tensor.default


def collective_nodes(gm: torch.fx.GraphModule) -> list:
    """Collectives in graph (issue) order."""
    return [n for n in gm.graph.nodes if is_collective(n)]


def _nbytes(node: torch.fx.Node) -> int:
    v = node.meta.get("val")
    return int(v.numel() * v.element_size()) if isinstance(v, torch.Tensor) else 0


def _stamp(node, src, val):
    node.meta["val"] = val
    if src is not None:
        for k in (M.PHASE.name, M.MODULE.name):
            if k in src.meta:
                node.meta[k] = src.meta[k]


def insert_all_reduce(graph: torch.fx.Graph, x: torch.fx.Node, axis: str, ranks: tuple,
                      after: torch.fx.Node | None = None, wait_before: torch.fx.Node | None = None,
                      reduce_op: str = "sum", in_place: bool = False) -> tuple:
    """Insert ``all_reduce(x)`` after ``after`` (default: x) and its wait before ``wait_before``
    (default: right after the collective). Returns ``(collective, wait)``.

    ``in_place=True`` reduces ``x``'s own storage (``all_reduce_``) instead of a copy: only for
    a buffer nothing else reads, such as a freshly made bucket."""
    op = C10D.all_reduce_.default if in_place else C10D.all_reduce.default
    with graph.inserting_after(after or x):
        ar = graph.call_function(op, (x, reduce_op, group_tag(axis)))
    _stamp(ar, x, x.meta.get("val"))
    M.set_meta(ar, M.COMM, M.CommInfo("all_reduce", axis, tuple(ranks), _nbytes(x), reduce_op))
    ctx = graph.inserting_before(wait_before) if wait_before is not None else graph.inserting_after(ar)
    with ctx:
        w = graph.call_function(C10D.wait_tensor.default, (ar,))
    _stamp(w, x, x.meta.get("val"))
    return ar, w


def insert_broadcast(graph: torch.fx.Graph, x: torch.fx.Node, axis: str, ranks: tuple, src: int,
                     before: torch.fx.Node | None = None) -> tuple:
    """Broadcast ``x`` from global rank ``src`` over the axis group, inserted before ``before``
    (default: right after x); returns ``(collective, wait)``."""
    with (graph.inserting_before(before) if before is not None else graph.inserting_after(x)):
        bc = graph.call_function(C10D.broadcast.default, (x, src, group_tag(axis)))
    _stamp(bc, x, x.meta.get("val"))
    M.set_meta(bc, M.COMM, M.CommInfo("broadcast", axis, tuple(ranks), _nbytes(x)))
    with graph.inserting_after(bc):
        w = graph.call_function(C10D.wait_tensor.default, (bc,))
    _stamp(w, x, x.meta.get("val"))
    return bc, w


# --- the runtime's lowering for gloo -------------------------------------------------------------------------
# torch 2.13's functional ``all_gather_into_tensor`` reaches gloo as ``allgather_into_tensor_coalesced``
# (``AsyncAllgatherCoalescedWork``). With another collective in flight -- Parallax's pairs beside the dense
# rest's all-reduce, a pipeline rank's gathers while another graph's collectives are out, Herring's gathers with
# several buckets -- that path corrupts the heap now and then: ``malloc(): unaligned tcache chunk
# detected`` or a segfault, about once in 10-20 thousand steps of two ranks over a veth pair here
# (``benchmarks/gloo_gather_stress.py`` reproduces it). The same gather through ``dist.all_gather_single(async_op=True)``
# (gloo's ``_allgather_base``) ran 100 thousand steps clean, as did the functional all-reduce,
# reduce-scatter and all-to-all, and the functional gather with nothing beside it. So on a gloo group the runtime
# runs each gather that is in flight at once with another collective through the latter, its work registered for
# the graph's own ``wait_tensor``: the same bytes, the same order, the same graph otherwise. A gather alone keeps the
# functional op (it frees its buffers as it always did: the memory tests measure those programs to the byte).

_LIB = torch.library.Library("fxpar", "FRAGMENT")
_LIB.define("all_gather_into_tensor(Tensor input, int group_size, str group_name) -> Tensor")


def _gather(input, group_size, group_name):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    # torch 2.13's all_gather_into_tensor is all_gather_single under a deprecation warning; older torch has only it
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    inp = input.contiguous()
    out = inp.new_empty([group_size * inp.shape[0], *inp.shape[1:]])     # as the functional op: dim 0 x n
    work = gather(out, inp, group=_resolve_process_group(group_name), async_op=True)
    torch._C._distributed_c10d._register_work(out, work)       # the graph's wait_tensor(out) waits for it
    return out


def _gather_fake(input, group_size, group_name):
    return input.new_empty([group_size * input.shape[0], *input.shape[1:]])


_LIB.impl("all_gather_into_tensor", _gather, "CompositeExplicitAutograd")
torch.library.register_fake("fxpar::all_gather_into_tensor", _gather_fake, lib=_LIB)

gloo_all_gather_into_tensor = torch.ops.fxpar.all_gather_into_tensor.default


def _in_flight(gm: torch.fx.GraphModule) -> tuple:
    """Each collective's span in graph order, ``{node: (issued, first wait)}`` (a collective not waited in the graph
    spans to its end; a wait on a placeholder, a collective an earlier graph issued, spans from its start), and
    whether anything is in flight across the graph's boundary (issued and not waited here, or waited here on a
    placeholder)."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    spans, across = {}, False
    for n in nodes:
        if n.op != "call_function" or getattr(n.target, "namespace", None) not in ("_c10d_functional", "fxpar"):
            continue
        if n.target is C10D.wait_tensor.default:
            src = n.args[0]
            while isinstance(src, torch.fx.Node) and src.target is operator.getitem:
                src = src.args[0]
            if isinstance(src, torch.fx.Node) and src.op == "placeholder":
                spans[src] = (-1, min(pos[n], spans.get(src, (-1, len(nodes)))[1]))
                across = True
            elif src in spans:
                spans[src] = (spans[src][0], min(pos[n], spans[src][1]))
        elif n.target is gloo_all_gather_into_tensor or (n.target.namespace == "_c10d_functional" and
                                                         n.target._schema.name.split("::")[-1] in _COLLECTIVE_OPS):
            spans[n] = (pos[n], len(nodes))
    if any(end == len(nodes) for node, (_, end) in spans.items() if node.op != "placeholder"):
        across = True
    return spans, across


_COLLECTIVE_OPS = {"all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
                   "all_to_all_single", "broadcast", "broadcast_", "all_reduce_coalesced", "all_reduce_coalesced_",
                   "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"}


def gathers_beside_collectives(gm: torch.fx.GraphModule, anywhere: bool = False) -> list:
    """The ``all_gather_into_tensor`` nodes of ``gm`` in flight at once with another collective of the graph (their
    spans overlap: see :func:`_in_flight`); every gather where ``anywhere`` (the rank has collectives in flight
    across its graphs' boundaries, which no one graph shows)."""
    spans, _ = _in_flight(gm)
    out = []
    for n, (a, b) in spans.items():
        if n.op == "placeholder" or n.target is not C10D.all_gather_into_tensor.default:
            continue
        if anywhere or any(m is not n and c < b and a < d for m, (c, d) in spans.items()):
            out.append(n)
    return out


def lower_for_backend(gm: torch.fx.GraphModule, anywhere: bool = False, backend: str | None = None) -> int:
    """On a rank whose groups are bound (``bind_groups``): every ``all_gather_into_tensor`` over a gloo group that
    is in flight at once with another collective (:func:`gathers_beside_collectives`; ``anywhere``: every one) runs as
    :data:`gloo_all_gather_into_tensor` instead (see the note above; on a group with gloo for CPU and NCCL for CUDA
    too: the op calls ``dist``, which picks the backend by device). A gather alone keeps the functional op, which ran
    clean alone. Returns how many nodes changed; graphs over NCCL alone are left as they are. ``backend`` given
    (``ClusterSpec.backend``): every group is taken to be of it, bound or not (a graph shown outside a run)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    changed = 0
    for n in gathers_beside_collectives(gm, anywhere):
        name = n.args[2]
        if backend is None and (not isinstance(name, str) or name.startswith(_TAG)):
            continue                  # not bound to a process group (bind_groups first)
        kind = backend if backend is not None else str(dist.get_backend(_resolve_process_group(name)))
        if "gloo" in kind:                                                    # "gloo", or "cpu:gloo,cuda:nccl"
            n.target = gloo_all_gather_into_tensor
            changed += 1
    if changed:
        gm.recompile()
    return changed


def in_flight_across_graphs(gms) -> bool:
    """Whether any of a rank's graphs leaves a collective in flight past its end or waits one an earlier graph
    issued: then a gather may run beside a collective no one graph shows."""
    return any(_in_flight(gm)[1] for gm in gms)


# ---- device tensors over a gloo group -------------------------------------------------------------------------
# Gloo moves host memory: of its collectives only all_reduce and broadcast take CUDA tensors, and its send/recv and
# gathers read a CUDA pointer as if it were a host one. Ranks that share one GPU over gloo (a one-GPU machine, a
# debugging run) therefore stage each collective through the host: the input is copied down, the collective runs on
# the copy and is waited at once, and the result is copied back to the device. Overlap is lost on such a group (the
# copy back needs the result); NCCL groups, and gloo groups of CPU ranks, are left as they are.


def gloo_group(group_name) -> bool:
    """Whether the process group named ``group_name`` (a bound group name, or a ProcessGroup) is gloo alone (not a
    ``"cpu:gloo,cuda:nccl"`` group, which sends device tensors to NCCL)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    pg = _resolve_process_group(group_name) if isinstance(group_name, str) else group_name
    return str(dist.get_backend(pg)) == "gloo"


def _host_staged(op):
    """``op`` (a functional collective) run on host copies of its device tensors, waited, and its result copied back
    to the device; an in-place op (``all_reduce_``) copies the result into its own device inputs."""
    in_place = op._schema.name.endswith("_")

    def down(a, devices):
        if isinstance(a, torch.Tensor):
            devices.append(a.device)
            return a.cpu() if a.device.type != "cpu" else a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return type(a)(down(x, devices) for x in a)
        return a

    def run(*args, **kwargs):
        devices: list = []
        host = [down(a, devices) for a in args]
        out = op(*host, **kwargs)
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        outs = [C10D.wait_tensor.default(t) for t in outs]
        if in_place:
            firsts = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            for dst, src in zip(firsts, outs):
                if dst.device.type != "cpu":
                    dst.copy_(src)
            return args[0]
        dev = devices[0] if devices else torch.device("cpu")
        outs = [t.to(dev) for t in outs]
        return outs if isinstance(out, (list, tuple)) else outs[0]

    run.__name__ = f"host_staged_{op._schema.name.split('::')[-1]}"
    run.__qualname__ = run.__name__
    return run


_STAGED: dict = {}


def _group_arg(n: torch.fx.Node):
    """The bound group name a collective node names (its last string argument)."""
    for a in reversed(n.args):
        if isinstance(a, str):
            return a
    return None


def stage_through_host(gm: torch.fx.GraphModule, backend: str | None = None) -> int:
    """On a rank whose tensors live on a device and whose groups are bound: every collective over a gloo-only group
    runs through :func:`_host_staged` (host copies, waited at once, copied back). The graph's ``wait_tensor`` nodes
    stay and find nothing in flight. Returns how many nodes changed. ``backend`` given (``ClusterSpec.backend``):
    every group is taken to be of it, bound or not (a graph shown outside a run)."""
    changed = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or not hasattr(n.target, "_schema"):
            continue
        name = n.target._schema.name
        short = name.split("::")[-1]
        if not (n.target is gloo_all_gather_into_tensor or
                (name.startswith("_c10d_functional::") and short in _COLLECTIVE_OPS)):
            continue
        group_name = _group_arg(n)
        if group_name is None:
            continue
        if backend is not None:
            if backend != "gloo":
                continue
        elif group_name.startswith(_TAG) or not gloo_group(group_name):
            continue
        if n.target not in _STAGED:
            _STAGED[n.target] = _host_staged(n.target)
        n.target = _STAGED[n.target]
        changed += 1
    if changed:
        gm.recompile()
    return changed
