"""Sending a GraphModule to another process node by node.

``pickle`` of a ``torch.fx.GraphModule`` keeps only its Python code and re-traces that code with
a symbolic tracer on arrival. Every call whose arguments are not graph values then runs once,
during that re-trace, and its result is frozen into the graph as a constant. For a captured
training step this is wrong, not just slow: dropout is ``bernoulli(expand(empty([]), shape), p)``,
whose inputs are all constants, so a spawned rank would reuse one mask, drawn at unpickling,
in every step (and ``empty`` would carry uninitialised memory).

:func:`pack_graph_module` turns a GraphModule into plain data (node list with operator names,
arguments with node references by name, the picklable ``fxpar_*`` metadata, attributes), and
:func:`unpack_graph_module` rebuilds the same graph, node for node, on the other side. Payloads
sent to ranks (``RankPayload``, the pipeline's ``StageProgram``) pickle their graphs this way.
"""
from __future__ import annotations

import contextlib
import pickle
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

__all__ = ["PackedGraphModule", "pack_graph_module", "packing_once", "unpack_graph_module"]


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Op:
    namespace: str
    name: str
    overload: str | None       # None: an OpOverloadPacket

    def resolve(self):
        packet = getattr(getattr(torch.ops, self.namespace), self.name)
        return packet if self.overload is None else getattr(packet, self.overload)


@dataclass
class PackedGraphModule:
    nodes: list                 # (op, name, target, args, kwargs, meta)
    attrs: dict                 # get_attr / call_module target -> value
    meta: dict                  # the GraphModule's meta (picklable entries)
    codegen: object = None


def _pack_target(t):
    if isinstance(t, torch._ops.OpOverload):
        ns, name = t._schema.name.split("::")
        return _Op(ns, name, t._overloadname)
    if isinstance(t, torch._ops.OpOverloadPacket):
        ns, name = t._qualified_op_name.split("::")
        return _Op(ns, name, None)
    return t


def _pack_value(v):
    if isinstance(v, torch.fx.Node):
        return _Ref(v.name)
    if isinstance(v, (list, tuple)):
        return type(v)(_pack_value(x) for x in v)
    if isinstance(v, dict):
        return {k: _pack_value(x) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(_pack_value(v.start), _pack_value(v.stop), _pack_value(v.step))
    return _pack_target(v)


def _unpack_value(v, env: dict):
    if isinstance(v, _Ref):
        return env[v.name]
    if isinstance(v, _Op):
        return v.resolve()
    if isinstance(v, (list, tuple)):
        return type(v)(_unpack_value(x, env) for x in v)
    if isinstance(v, dict):
        return {k: _unpack_value(x, env) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(_unpack_value(v.start, env), _unpack_value(v.stop, env), _unpack_value(v.step, env))
    return v


def _picklable(d: dict, keep) -> dict:
    out = {}
    for k, v in d.items():
        if not keep(k):
            continue
        try:
            pickle.dumps(v)
        except Exception:  # noqa: BLE001 - fake tensors, stack traces of objects: not needed by a rank
            continue
        out[k] = v
    return out


_PACKED: dict | None = None      # id(GraphModule) -> (it, its packed form), while packing_once() is open


@contextlib.contextmanager
def packing_once():
    """Within it, a GraphModule pickled several times (the same graphs in every rank's payload) is packed once; the
    graphs must not change inside it."""
    global _PACKED
    outer, _PACKED = _PACKED, {}
    try:
        yield
    finally:
        _PACKED = outer


def pack_graph_module(gm: torch.fx.GraphModule) -> PackedGraphModule:
    """``gm`` as plain, picklable data (node ``meta`` keeps the ``fxpar_*`` keys only)."""
    if _PACKED is not None:
        got = _PACKED.get(id(gm))
        if got is not None and got[0] is gm:
            return got[1]
        packed = _PACKED[id(gm)] = (gm, _pack(gm))
        return packed[1]
    return _pack(gm)


def _pack(gm: torch.fx.GraphModule) -> PackedGraphModule:
    nodes, attrs = [], {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            attrs[n.target] = obj
        elif n.op == "call_module":
            attrs[n.target] = gm.get_submodule(n.target)
        nodes.append((n.op, n.name, _pack_target(n.target), _pack_value(n.args), _pack_value(n.kwargs),
                      _picklable(n.meta, lambda k: k.startswith("fxpar_"))))
    codegen = gm.graph._codegen
    return PackedGraphModule(nodes, attrs, _picklable(gm.meta, lambda k: True),
                             codegen if type(codegen) is not torch.fx.graph.CodeGen else None)


def unpack_graph_module(p: PackedGraphModule) -> torch.fx.GraphModule:
    """The GraphModule :func:`pack_graph_module` packed: the same nodes, names and order."""
    g = torch.fx.Graph()
    if p.codegen is not None:
        g._codegen = p.codegen
    env: dict = {}
    for op, name, target, args, kwargs, meta in p.nodes:
        target = target.resolve() if isinstance(target, _Op) else target
        node = g.create_node(op, target, _unpack_value(args, env), _unpack_value(kwargs, env), name=name)
        node.meta.update(meta)
        env[name] = node
    # lazy: its Python code is generated at its first call (or ``.code``), not here: a rank binds its graphs'
    # collectives and compression calls (each a recompile) before it runs them, and some graphs it never runs
    gm = _LazyGraphModule(dict(p.attrs), g)
    gm.meta.update(p.meta)
    return gm
