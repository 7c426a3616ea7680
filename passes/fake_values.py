"""Fake values kept valid through a pass: each node's ``meta["val"]`` (its fake tensor: shape, stride, dtype,
device) recomputed only where an edit can have changed it, not over the whole graph.

A pass that edits a graph calls :func:`record` before its first edit and :func:`refresh` after its last. A node's
value is recomputed (its op run on fake tensors) when the node is new, when its op, its constant arguments or its
value were changed since the record, or when an input's value differs from the recorded input's (a node replaced
by another of an alike value over the same storage counts as the same; for an op whose recorded value shared no
storage with its recorded inputs -- a new tensor, not a view, not an input handed back -- an alike value over
another storage counts as the same too: such a value depends on its inputs' metadata alone); a recomputed value equal
in every property to the recorded one, and not a view of an input, keeps the recorded object and stops there (a
view's recorded value aliases the recorded input's storage, which the memory model's storage keys must follow).
Every other node keeps its value. Each value depends only on its op, its constant arguments and its inputs' values,
so the result equals a propagation over the whole graph (``torch.fx.passes.fake_tensor_prop.FakeTensorProp``), at
the cost of the edited region. Within it, an op called again on inputs alike to an earlier call's (the same op in
the next of a model's repeated blocks) gets a value made from the earlier one's (:class:`_Memo`), and a
``_foreach_*`` op runs once per kind of element of its lists (:func:`_run_foreach`)::

    before = record(gm)
    ...                                   # insert casts, change a view's shape, replace a placeholder's value
    refresh(gm, before)                   # the new and edited nodes, and what their change reaches

The graph's fake tensors keep one fake mode (the capture's): the recomputation runs in the mode the values already
share. A graph whose values share no single mode (none are fake, or several modes) is propagated whole in a fresh
mode, as ``FakeTensorProp`` would.
"""
from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.fx.experimental.proxy_tensor import py_sym_types, snapshot_fake
from torch.fx.immutable_collections import immutable_list
from torch.fx.node import map_aggregate, map_arg
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

__all__ = ["record", "refresh", "single_fake_mode", "NodeFailed"]

_NO_VAL = object()


class NodeFailed(Exception):
    """A node's op failed on fake tensors: ``node`` is the node, ``__cause__`` the op's error."""

    def __init__(self, node: torch.fx.Node, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.node = node


def record(gm: torch.fx.GraphModule) -> dict:
    """``{node: (target, args, kwargs, value)}`` for every node of ``gm``, before a pass edits it. fx keeps a node's
    ``args`` and ``kwargs`` immutable (an edit assigns new ones), so this holds references, not copies."""
    return {n: (n.target, n.args, n.kwargs, n.meta.get("val", _NO_VAL)) for n in gm.graph.nodes}


def refresh(gm: torch.fx.GraphModule, before: dict) -> None:
    """Recompute ``meta["val"]`` where it may differ from what ``before`` (:func:`record`, or a node's counterpart in
    a graph this one was built from, its arguments mapped to this graph's nodes) recorded; see the module's text.
    Raises :class:`NodeFailed` naming the node whose op fails."""
    mode = single_fake_mode(gm)
    if mode is None or not _refresh_in(gm, before, mode):
        _propagate_whole(gm)


def _refresh_in(gm, before: dict, mode) -> bool:
    """:func:`refresh` in ``mode`` (entered once for the whole walk); False where an op that changes its input's
    metadata in place must be run: the caller propagates the whole graph instead."""
    changed: set = set()
    env: dict = {}
    memo = _Memo(mode)

    def same(a, b):
        return _same_args(a, b, env, changed, before)

    def value_of(x):
        v = env[x]
        return v if type(v) is FakeTensor and v.fake_mode is mode else _in_mode(v, mode)

    with mode:
        for n in gm.graph.nodes:
            old = before.get(n)
            if n.op == "output":       # what FakeTensorProp records for it: its values, as a tuple
                if old is None or old[3] is _NO_VAL or not same(n.args, old[1]):
                    out = map_aggregate(map_arg(n.args[0], env.__getitem__), lambda r: _extract(r, mode))
                    if out is not None:
                        n.meta["val"] = out
                continue
            val = n.meta.get("val", _NO_VAL)
            if n.op == "placeholder":
                env[n] = _placeholder(n, val, old, mode, changed)
                continue
            if old is not None and old[3] is not _NO_VAL and (val is old[3] or val is _NO_VAL) \
                    and n.target == old[0] and (same(n.args, old[1]) and same(n.kwargs, old[2])
                                                or _alike_inputs(n, old, env, changed, before)):
                n.meta["val"] = env[n] = old[3]
                continue
            if n.op != "call_function" or _mutates_metadata(n.target):
                return False
            args, kwargs = map_arg((n.args, n.kwargs), value_of)
            try:
                result = memo.run(n.target, args, kwargs)
            except Exception as e:  # noqa: BLE001 - re-raised naming the node
                raise NodeFailed(n, e) from e
            new = _own_value(result, args, kwargs, mode)
            if old is not None and old[3] is not _NO_VAL and _same_value(new, old[3]) \
                    and not _aliases(result, (args, kwargs)):
                n.meta["val"] = env[n] = old[3]
                continue
            if new is not None:
                n.meta["val"] = new
            else:
                n.meta.pop("val", None)
            env[n] = result
            changed.add(n)
    return True


def _own_value(result, args, kwargs, mode):
    """What :func:`_extract` keeps of ``result``, without the snapshot where the op's fresh fake tensor can be kept
    itself: one that is no input returned (an in-place op's) and does not require grad is its own snapshot (the
    same shape, strides, dtype, device, offset and storage), and nothing changes its metadata later (an op that
    would makes :func:`refresh` propagate the whole graph)."""
    if type(result) is FakeTensor and not result.requires_grad:
        if not _is_input(result, args, kwargs):
            return result
    elif type(result) in (list, tuple) and result and all(type(r) is FakeTensor and not r.requires_grad
                                                              for r in result):
        ids = _input_ids((args, kwargs))
        if not any(id(r) in ids for r in result):
            return immutable_list(result) if isinstance(result, list) else tuple(result)
    return map_aggregate(result, lambda r: _extract(r, mode))


class _Memo:
    """An op's value by what it is given: the first call of an op on inputs of given shapes, strides, dtypes,
    devices and offsets (and given constants) runs it on fake tensors; a later alike call (the same op at the same
    place in the next of a model's repeated blocks) makes its value from the first one's, as the fake mode's own
    cache does (``FakeTensorMode._output_from_cache_entry``): a new tensor of the recorded metadata, or for a view
    one over its input's storage. Only ops whose value is a function of that metadata are remembered: no in-place
    or out= op, nothing data-dependent, each result either a new tensor or (a view op) a view of its first input."""

    def __init__(self, mode):
        self.mode = mode
        self.seen: dict = {}

    def run(self, target, args, kwargs):
        key = self._key(target, args, kwargs)
        hit = self.seen.get(key) if key is not None else None
        if hit is not None:
            return self._make(hit, args)
        result = _run_foreach(target, args, kwargs, self.mode)
        if result is _NO_VAL:
            result = target(*args, **kwargs)
        if key is not None:
            entry = self._entry(target, result, args, kwargs)
            if entry is not None:
                self.seen[key] = entry
        return result

    @staticmethod
    def _key(target, args, kwargs):
        if not isinstance(target, torch._ops.OpOverload) or target.__name__.startswith("_foreach_"):
            return None
        schema = target._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments) \
                or torch.Tag.dynamic_output_shape in target.tags or torch.Tag.data_dependent_output in target.tags \
                or torch.Tag.inplace_view in target.tags:
            return None
        try:
            key = (target, _meta_key(args), _meta_key(kwargs))
            hash(key)
        except (_Unkeyed, TypeError):
            return None
        return key

    def _entry(self, target, result, args, kwargs):
        outs = result if isinstance(result, tuple) else (result,)
        if not outs or any(type(r) is not FakeTensor or r.fake_mode is not self.mode or r.requires_grad
                           or r.constant is not None or any(type(d) is not int for d in r.shape) for r in outs):
            return None
        metas = tuple((tuple(r.shape), r.stride(), r.dtype, r.layout, r.storage_offset(), r.device) for r in outs)
        if target.is_view:
            if len(outs) != 1 or not args or type(args[0]) is not FakeTensor \
                    or _storages(outs) != _storages(args[0]) or _aliases(outs, (args[1:], kwargs)):
                return None
            return (isinstance(result, tuple), metas, True)
        if _aliases(outs, (args, kwargs)) or any(m[4] != 0 for m in metas) or len(set(_storages(outs))) != len(outs):
            return None
        return (isinstance(result, tuple), metas, False)

    def _make(self, entry, args):
        as_tuple, metas, view = entry
        out = []
        storage = args[0].untyped_storage() if view else None
        with in_kernel_invocation_manager(self.mode):
            for shape, stride, dtype, layout, offset, device in metas:
                empty = torch.empty_strided(shape, stride, dtype=dtype, layout=layout, device="meta")
                if view:
                    empty.set_(storage, offset, shape, stride)
                out.append(FakeTensor(self.mode, empty, device))
        return tuple(out) if as_tuple else out[0]


class _Unkeyed(Exception):
    pass


def _meta_key(a):
    if type(a) is FakeTensor:
        if a.requires_grad or a.constant is not None:     # a value the mode knows: ops on it may read it
            raise _Unkeyed
        return ("T", a.shape, a.stride(), a.dtype, a.device, a.layout, a.storage_offset())
    if isinstance(a, torch.Tensor):
        raise _Unkeyed
    if isinstance(a, (list, tuple)):
        return (type(a) is list, tuple(_meta_key(x) for x in a))
    if isinstance(a, dict):
        return tuple((k, _meta_key(v)) for k, v in a.items())
    if isinstance(a, py_sym_types):
        raise _Unkeyed
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return (type(a), a)
    raise _Unkeyed


def _run_foreach(target, args, kwargs, mode):
    """A functional ``_foreach_*`` op (tensor lists in, a list of new tensors out) over lists whose elements repeat a
    few shapes (a model's repeated blocks): run on one element of each kind (the same shape, strides, dtype, device,
    offset and scalars at that position), and every other element's value made alike to its kind's (a new tensor,
    as the op makes). The op maps element i of its lists to result i by itself, so this is the op's value.
    ``_NO_VAL`` where this does not apply (the caller runs the op)."""
    if not isinstance(target, torch._ops.OpOverload) or not target.__name__.startswith("_foreach_") or kwargs:
        return _NO_VAL
    schema = target._schema
    if len(schema.returns) != 1 or str(schema.returns[0].type) != "List[Tensor]" \
            or schema.returns[0].alias_info is not None \
            or any(a.alias_info is not None for a in schema.arguments):
        return _NO_VAL
    lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    if not lists or not args[lists[0]]:
        return _NO_VAL
    length = len(args[lists[0]])
    if any(len(args[i]) != length for i in lists):
        return _NO_VAL
    kinds: dict = {}
    of = []
    for j in range(length):
        key = []
        for i in lists:
            x = args[i][j]
            if type(x) is FakeTensor and x.constant is None:
                key.append((x.shape, x.stride(), x.dtype, x.device, x.layout, x.storage_offset(), x.requires_grad))
            elif isinstance(x, (int, float, bool)):
                key.append((type(x), x))
            else:
                return _NO_VAL
        of.append(kinds.setdefault(tuple(key), len(kinds)))
    if len(kinds) * 2 > length:
        return _NO_VAL
    first = {}
    for j, k in enumerate(of):
        first.setdefault(k, j)
    reps = sorted(first.values())
    sub = list(args)
    for i in lists:
        sub[i] = [args[i][j] for j in reps]
    got = target(*sub)
    if not isinstance(got, (list, tuple)) or len(got) != len(reps) or _aliases(got, sub) or any(
            type(r) is not FakeTensor or r.requires_grad or r.storage_offset() != 0 or r.constant is not None
            for r in got):
        return _NO_VAL
    made = dict(zip(reps, got))
    metas = {j: (r.shape, r.stride(), r.dtype, r.layout, r.device) for j, r in made.items()}   # the fake device:
    out = []                                                                                   # read outside the kernel
    with in_kernel_invocation_manager(mode):
        for j, k in enumerate(of):
            if j in made:
                out.append(made[j])
                continue
            shape, stride, dtype, layout, device = metas[first[k]]
            out.append(FakeTensor(mode, torch.empty_strided(shape, stride, dtype=dtype, layout=layout, device="meta"),
                                  device))
    return out


def _is_input(t, args, kwargs) -> bool:
    return id(t) in _input_ids((args, kwargs))


def _input_ids(v) -> set:
    return {id(t) for t in _leaves(v, torch.Tensor)}


def _placeholder(n, val, old, mode, changed):
    if isinstance(val, FakeTensor) and val.fake_mode is mode:
        if old is None or (val is not old[3] and not _same_value(val, old[3])):
            changed.add(n)
        return val
    if isinstance(val, torch.Tensor):      # a real or meta tensor stands for the input's shape: a fake of it
        with mode:
            fake = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        n.meta["val"] = snapshot_fake(fake)
        if old is None or not _same_value(fake, old[3]):
            changed.add(n)
        return fake
    if old is None or val is not old[3]:
        changed.add(n)
    return None if val is _NO_VAL else val


def single_fake_mode(gm: torch.fx.GraphModule):
    """The one fake mode of every fake tensor among ``gm``'s values; None where there are none, or several."""
    modes = set()
    for n in gm.graph.nodes:
        for v in _leaves(n.meta.get("val"), FakeTensor):
            modes.add(v.fake_mode)
    return modes.pop() if len(modes) == 1 else None


def _propagate_whole(gm) -> None:
    """Every node's value from fresh fakes of the placeholders' values, in a new mode."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = []
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            with mode:
                fakes.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device))
        else:
            fakes.append(v)
    try:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    except Exception as e:  # noqa: BLE001 - re-raised naming the node
        node = next((x for x in gm.graph.nodes if x.op == "call_function" and "val" not in x.meta), None)
        if node is None:
            raise
        raise NodeFailed(node, e) from e


def _leaves(v, kind) -> list:
    """The ``kind`` instances in ``v`` and the lists, tuples and dicts it nests, in order."""
    out: list = []
    _collect(v, kind, out)
    return out


def _collect(v, kind, out: list) -> None:
    if isinstance(v, kind):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            if isinstance(x, kind):
                out.append(x)
            elif isinstance(x, (list, tuple, dict)):
                _collect(x, kind, out)
    elif isinstance(v, dict):
        for x in v.values():
            _collect(x, kind, out)


def _in_mode(v, mode):
    if isinstance(v, FakeTensor):
        return v if v.fake_mode is mode else mode.from_tensor(v)
    if isinstance(v, torch.Tensor):
        return mode.from_tensor(v)
    if isinstance(v, (list, tuple)):
        if all(type(x) is FakeTensor and x.fake_mode is mode for x in v):
            return v
        return type(v)(_in_mode(x, mode) for x in v)
    return v


def _extract(r, mode):
    """What ``FakeTensorProp`` keeps of an op's result: a snapshot of each fake tensor, symbolic numbers as they are."""
    if isinstance(r, FakeTensor):
        return snapshot_fake(r)
    if isinstance(r, torch.Tensor):
        return snapshot_fake(mode.from_tensor(r, static_shapes=True))
    if isinstance(r, py_sym_types):
        return r
    return None


def _mutates_metadata(target) -> bool:
    """An op that changes its input's shape or strides in place (``t_``, ``resize_``, ``set_``): a recorded value
    it reads would change under it."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.inplace_view in target.tags or target.__name__.split(".")[0] in ("resize_", "set_",
                                                                                     "resize_as_")


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
                and a.layout == b.layout and a.storage_offset() == b.storage_offset()
                and a.requires_grad == b.requires_grad)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):     # fx's immutable_list is a list
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))
                and isinstance(a, list) == isinstance(b, list) and len(a) == len(b)
                and all(_same_value(x, y) for x, y in zip(a, b)))
    if a is None or b is None:
        return a is b
    if isinstance(a, (int, float, bool)) and type(a) is type(b):
        return a == b
    return False


def _storages(v) -> list:
    return [t.untyped_storage()._cdata for t in _leaves(v, torch.Tensor)]


def _same_storages(a, b) -> bool:
    """The same storages: a node put in another's place may stand for it only if a view of it would alias what a
    view of the other aliased (the memory model counts a storage once however many views it has)."""
    return _storages(a) == _storages(b)


def _aliases(result, inputs) -> bool:
    """A result that shares a storage with an input (a view): its recorded value aliases the recorded input's
    storage, so it cannot stand for the new one."""
    return bool(set(_storages(result)) & set(_storages(inputs)))


def _alike_inputs(n, old, env: dict, changed: set, before: dict) -> bool:
    """Inputs alike to the recorded ones in value, over other storages, for an op whose recorded value shared no
    storage with its recorded inputs (a new tensor, not a view or an input returned): its value is a function of
    its inputs' shapes, strides, dtypes, devices and offsets alone, so the recorded value stands (a cast back to
    the master dtype before the update; a gathered ZeRO-3 weight's transpose read by a matmul)."""
    if not isinstance(n.target, torch._ops.OpOverload) or any(
            r.alias_info is not None for r in n.target._schema.returns) or any(
            a.alias_info is not None and a.alias_info.is_write for a in n.target._schema.arguments):
        return False
    ins = list(_leaves(old[1:3], torch.fx.Node))
    was = [before[x][3] if x in before else x.meta.get("val", _NO_VAL) for x in ins]
    if any(v is _NO_VAL for v in was) or _aliases(old[3], was):
        return False
    return _same_args(n.args, old[1], env, changed, before, loose=True) \
        and _same_args(n.kwargs, old[2], env, changed, before, loose=True)


def _same_args(a, b, env: dict, changed: set, before: dict, loose: bool = False) -> bool:
    """Arguments that give the op what the recorded ones gave it: the same constants, and in each node's place a
    node whose value is alike to the recorded node's (the same node unchanged, or another with an alike value: a
    cast back to the dtype the value had)."""
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
            return False
        if a is b and a not in changed:
            return True
        if a not in env or (a is b and not loose):
            return False
        was = before[b][3] if b in before else b.meta.get("val", _NO_VAL)
        return was is not _NO_VAL and _same_value(env[a], was) and (loose or _same_storages(env[a], was))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)):          # fx's immutable_list is a list
        return isinstance(b, (list, tuple)) and isinstance(a, list) == isinstance(b, list) and len(a) == len(b) \
            and all(_same_args(x, y, env, changed, before, loose) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() \
            and all(_same_args(a[k], b[k], env, changed, before, loose) for k in a)
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a constant that does not compare: count it as changed
        return False
