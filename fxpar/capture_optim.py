"""The optimizer update of a captured training step, written into the graph from a trace over one parameter per
distinct layout instead of a trace over every parameter.

The traced update (:meth:`fxpar.optim.OptimizerSpec.step_all`) is a chain of ``torch._foreach_*`` ops: one node
per op over all ``n`` parameters, ``n`` ``getitem`` nodes after each, scalar ops on ``lr`` and ``step`` between
them. Tracing it through ``make_fx`` dispatches every list element through functionalization, the proxy tracer and
fake-tensor propagation (GPT-2 small: 148 parameters, some 2,000 nodes, a third of the capture). Element ``i`` of
every foreach op's output depends only on element ``i`` of its inputs and on the scalars, so the chain is traced
once over one representative per distinct *layout* -- ``(shape, stride, dtype, device, requires_grad)`` of the
parameter, its gradient and each optimizer state -- and every element is then written as its representative's
element was traced::

    template (k = 2 layouts)                      the step's graph (n = 4 parameters, layouts a b a b)
    _foreach_mul = _foreach_mul([p_a, p_b], s)    _foreach_mul = _foreach_mul([p0, p1, p2, p3], s)
    getitem_8 = getitem(_foreach_mul, 0)          getitem_8 = getitem(_foreach_mul, 0)      # val as p_a's
    getitem_9 = getitem(_foreach_mul, 1)          getitem_9 = getitem(_foreach_mul, 1)      # val as p_b's
                                                  getitem_10 = getitem(_foreach_mul, 2)     # val as p_a's
                                                  getitem_11 = getitem(_foreach_mul, 3)     # val as p_b's

The nodes are created in the order, with the names, targets, arguments and meta (``val`` and ``tensor_meta`` per
element, ``seq_nr`` shifted to the step's autograd sequence) that ``make_fx`` gives when it traces the update
inside the step: the graph is the one a full trace makes (``tests/test_capture_optim.py`` compares them node by
node). A template whose shape this module does not recognise is not used: the step is then traced whole.
Templates are kept per optimizer setting and layouts, so a second capture of the same model traces no update.
"""
from __future__ import annotations

import operator
from collections import OrderedDict

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from . import meta as M

__all__ = ["UpdateStamp"]

_CACHE: OrderedDict = OrderedDict()     # (optimizer key, layouts) -> _Template
_CACHE_SIZE = 32
_REFUSED: set = set()                   # optimizer keys whose template was not recognised: traced whole
_PLAIN = (bool, int, float, str, type(None))
ENABLED = True                          # False: the update is traced with the step (what the templates reproduce)


def _layout(t: torch.Tensor) -> tuple:
    """What the update's trace of one element depends on: shape, stride, dtype, device, and whether autograd records
    it below the functionalization the step is traced under (a parameter, and a gradient computed from one, do:
    a foreach op over any such element saves its outputs, which make_fx writes as detach nodes)."""
    inner = torch._from_functional_tensor(t) if torch._is_functional_tensor(t) else t
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device, bool(inner.requires_grad)


def _hashable(v) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(_hashable(x) for x in v))


def _optimizer_key(optimizer):
    """The optimizer's class and settings, and the global modes a trace reads (grad mode, inference mode, the
    default dtype), as a cache key; None where a setting is not a plain value."""
    items = tuple(sorted(optimizer.kwargs.items()))
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype())
    return (optimizer.cls, items, modes) if all(_hashable(v) for _, v in items) else None


class UpdateStamp:
    """Used by the capture: :meth:`record` inside the step's trace, where the update would be traced (it reads
    the tensors' layouts and the autograd sequence number), then :meth:`apply` on the traced graph, which writes
    the update's nodes before the output and returns them (or None: trace the update instead)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.key = _optimizer_key(optimizer)
        self.usable = ENABLED and self.key is not None and self.key not in _REFUSED
        self.layouts = None
        self.seq_nr = 0

    def record(self, params: list, grads: list, states: list) -> None:
        self.layouts = [(_layout(p), _layout(g), *(_layout(s[i]) for s in states))
                        for i, (p, g) in enumerate(zip(params, grads))]
        self.seq_nr = torch.autograd._get_sequence_nr()

    def apply(self, gm: torch.fx.GraphModule, params: list, grads: list, states: list, lr, step):
        """Write the update of ``params`` (placeholder nodes) from ``grads`` and ``states`` (lists of nodes per
        state) with the scalar nodes ``lr`` and ``step`` before ``gm``'s output node. Returns ``(new params,
        new states per state)`` as node lists, or None where no template fits (nothing is written then)."""
        distinct = list(dict.fromkeys(self.layouts))
        rep = [distinct.index(lay) for lay in self.layouts] if len(distinct) > 1 else [0] * len(self.layouts)
        key = (self.key, tuple(distinct))
        template = _CACHE.get(key)
        if template is None:
            template = _Template.trace(self.optimizer, distinct)
            if template is None:
                _REFUSED.add(self.key)
                return None
            _CACHE[key] = template
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
        else:
            _CACHE.move_to_end(key)
        mode = next(n.meta["val"].fake_mode for n in gm.graph.find_nodes(op="placeholder")
                    if isinstance(n.meta.get("val"), FakeTensor))
        return template.stamp(gm.graph, mode, rep, params, grads, states, lr, step, self.seq_nr)


def _plain_fake(v) -> bool:
    return isinstance(v, FakeTensor) and v.storage_offset() == 0 and not v.requires_grad


def _fake_like(mode, v: FakeTensor, base: torch.Tensor) -> FakeTensor:
    """A fake tensor of ``v``'s layout in ``mode``, over ``base``'s (meta) storage: make_fx's snapshots of one
    output (the foreach node's list, its getitem, a detach of it) share one."""
    return FakeTensor(mode, base.detach(), v.device)


def _meta_like(v: FakeTensor) -> torch.Tensor:
    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")


_DETACH = torch.ops.aten.detach.default


class _Template:
    """The update traced over ``k`` representatives, read as steps to repeat over ``n`` elements.

    A per-element value is ``(stream, j)``: element ``j`` of a stream -- an input list (``"p"``, ``"g"``,
    ``("s", state)``), a foreach node's outputs (the node), or a run of per-element detaches (``("run", index)``).
    Steps: ``("scalar", node)`` an op on lr, step and constants; ``("foreach", node, streams)`` with the stream of
    each list argument; ``("getitem", foreach node)`` its ``k`` getitems; ``("detach", run, source stream,
    {j: node})`` detaches of some elements of a stream."""

    def __init__(self, k, steps, outputs, seq, scalar_inputs, getitems):
        self.k, self.steps, self.outputs = k, steps, outputs
        self.seq0, self.seq_count = seq[0], seq[1] - seq[0]     # autograd's sequence number: at the start, how many
        self.scalar_inputs, self.getitems = scalar_inputs, getitems     # (lr, step) placeholders; getitems by j

    @classmethod
    def trace(cls, optimizer, layouts: list):
        k, n_s = len(layouts), len(optimizer.state_names)
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        with torch._functorch.config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
            mode = FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv(), static_shapes=True)

        def make(lay):
            shape, stride, dtype, device, rg = lay
            with mode:
                t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            return t.requires_grad_(rg) if rg else t

        with mode:
            scalars = [torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)]
        flat = [make(lay[0]) for lay in layouts] + [make(lay[1]) for lay in layouts] + \
            [make(lay[2 + s]) for s in range(n_s) for lay in layouts] + scalars
        seq0 = []

        def update(*args):
            p, g = list(args[:k]), list(args[k:2 * k])
            st = [list(args[2 * k + s * k:2 * k + (s + 1) * k]) for s in range(n_s)]
            fx_traceback.current_meta["custom"] = {M.PHASE.name: "optimizer", M.MODULE.name: ""}
            seq0.append(torch.autograd._get_sequence_nr())
            new_p, new_s = optimizer.step_all(p, g, st, args[-2], args[-1])
            seq0.append(torch.autograd._get_sequence_nr())
            return (*new_p, *(t for s in new_s for t in s))

        try:
            with fx_traceback.preserve_node_meta():
                gm = make_fx(torch.func.functionalize(update, remove="mutations"), tracing_mode="fake")(*flat)
        except Exception:       # noqa: BLE001 - the step is then traced whole, which reports any error itself
            return None
        return cls._read(gm.graph, k, n_s, seq0)

    @classmethod
    def _read(cls, g: torch.fx.Graph, k: int, n_s: int, seq: list):
        """The steps of the template graph, or None where its shape is not one :meth:`stamp` repeats."""
        el: dict = {}           # per-element template node -> (stream, j)
        sc: set = set()         # scalar template nodes (lr, step and ops on them)
        phs = list(g.find_nodes(op="placeholder"))
        if len(phs) != (2 + n_s) * k + 2:
            return None
        streams = ["p", "g"] + [("s", s) for s in range(n_s)]
        for i, ph in enumerate(phs[:-2]):
            el[ph] = (streams[i // k], i % k)
        sc.update(phs[-2:])
        steps, outputs, getitems = [], None, {}
        for n in g.nodes:
            if n.op == "placeholder":
                continue
            last = steps[-1] if steps else None
            if n.op == "output":
                outs = list(n.args[0])
                if len(outs) != (1 + n_s) * k or any(o not in el for o in outs):
                    return None
                outputs = []
                for grp in range(1 + n_s):
                    refs = [el[o] for o in outs[grp * k:(grp + 1) * k]]
                    if len({s for s, _ in refs}) != 1 or [j for _, j in refs] != list(range(k)):
                        return None
                    outputs.append(refs[0][0])
                continue
            if n.op != "call_function" or any(isinstance(v, torch.fx.Node) for v in n.kwargs.values()):
                return None
            val = n.meta.get("val")
            if n.target is operator.getitem:
                src, j = n.args
                if not (isinstance(src, torch.fx.Node) and src in getitems and isinstance(j, int)):
                    return None
                if j == 0:
                    steps.append(["getitem", src, 0])
                elif not (last and last[0] == "getitem" and last[1] is src and last[2] == j - 1):
                    return None
                steps[-1][2] = j
                getitems[src].append(n)
                el[n] = (src, j)
                if not _plain_fake(val):
                    return None
                continue
            if last and last[0] == "getitem" and last[2] != k - 1:
                return None                 # getitems of a foreach node come together, all k of them
            lists = [a for a in n.args if isinstance(a, (list, tuple))]
            nodes = [a for a in n.args if isinstance(a, torch.fx.Node)]
            if lists:                       # a foreach op: each list one stream, element j at position j
                arg_streams = []
                for a in n.args:
                    if isinstance(a, (list, tuple)):
                        refs = [el.get(x) for x in a]
                        if len(a) != k or None in refs or len({s for s, _ in refs}) != 1 \
                                or [j for _, j in refs] != list(range(k)):
                            return None
                        arg_streams.append(refs[0][0])
                    else:
                        arg_streams.append(None)
                if any(x not in sc for x in nodes) or not isinstance(val, (list, tuple)) or len(val) != k \
                        or not all(_plain_fake(v) for v in val):
                    return None
                steps.append(("foreach", n, arg_streams))
                getitems[n] = []
                continue
            if all(x in sc for x in nodes):          # a scalar op on lr, step and constants
                if not (isinstance(val, FakeTensor) or val is None or isinstance(val, _PLAIN)):
                    return None
                sc.add(n)
                steps.append(("scalar", n))
                continue
            # make_fx's detach of a foreach output autograd saved: one element of one stream
            if n.target is not _DETACH or len(nodes) != 1 or nodes[0] not in el or not _plain_fake(val):
                return None
            src, j = el[nodes[0]]
            if not (last and last[0] == "detach" and last[2] == src and j > max(last[3])):
                steps.append(["detach", ("run", len(steps)), src, {}])
            steps[-1][3][j] = n
            el[n] = (steps[-1][1], j)
        if outputs is None or any(len(v) != k for v in getitems.values()):
            return None
        return cls(k, [tuple(s) for s in steps], outputs, seq, tuple(phs[-2:]), getitems)

    def stamp(self, g: torch.fx.Graph, mode, rep: list, params, grads, states, lr, step, seq_nr: int):
        """Write the update over the ``len(rep)`` elements (element ``i`` as representative ``rep[i]``) before
        ``g``'s output; returns the node lists of the template's outputs (new params, then each new state)."""
        n = len(rep)
        nodes = {"p": list(params), "g": list(grads), **{("s", s): list(v) for s, v in enumerate(states)}}
        bases = {key: [None] * n for key in nodes}      # stream -> meta storage per element (None: not needed)
        made: dict = {}                                 # template scalar / foreach node -> real node
        shift = seq_nr - self.seq0
        out = g.find_nodes(op="output")[0]

        def arg(a):
            return made[a] if isinstance(a, torch.fx.Node) else a

        def meta(t, val, tensor_meta=None):
            m = dict(t.meta)
            if "custom" in m:
                m["custom"] = dict(m["custom"])
            if "seq_nr" in m:
                m["seq_nr"] = m["seq_nr"] + shift
            m["val"] = val
            if tensor_meta is not None:
                m["tensor_meta"] = tensor_meta
            return m

        def name_of(t):
            return g._target_to_str(t.target.overloadpacket.__name__) \
                if isinstance(t.target, torch._ops.OpOverload) else None

        made[self.scalar_inputs[0]], made[self.scalar_inputs[1]] = lr, step
        with g.inserting_before(out):
            for s in self.steps:
                kind, t = s[0], s[1]
                if kind == "scalar":
                    node = g.create_node("call_function", t.target, tuple(arg(a) for a in t.args), dict(t.kwargs),
                                         name=name_of(t))
                    v = t.meta.get("val")
                    node.meta = meta(t, _fake_like(mode, v, _meta_like(v)) if isinstance(v, FakeTensor) else v)
                    made[t] = node
                elif kind == "foreach":
                    args = tuple(list(nodes[st]) if st is not None else arg(a) for a, st in zip(t.args, s[2]))
                    node = g.create_node("call_function", t.target, args, dict(t.kwargs), name=name_of(t))
                    tv = t.meta["val"]
                    base = [_meta_like(tv[j]) for j in rep]
                    node.meta = meta(t, type(tv)(_fake_like(mode, tv[j], b) for j, b in zip(rep, base)))
                    made[t], bases[t] = node, base
                elif kind == "getitem":
                    src, got = made[t], []
                    for i, j in enumerate(rep):
                        gt = self.getitems[t][j]
                        node = g.create_node("call_function", operator.getitem, (src, i), {})
                        node.meta = meta(gt, _fake_like(mode, gt.meta["val"], bases[t][i]))
                        got.append(node)
                    nodes[t] = got
                else:                                    # detach run
                    _, run, src, by_j = s
                    got = [None] * n
                    for i, j in enumerate(rep):
                        d = by_j.get(j)
                        if d is None:
                            continue
                        x = nodes[src][i]
                        node = g.create_node("call_function", d.target, (x,), dict(d.kwargs), name=name_of(d))
                        base = bases[src][i] if bases[src][i] is not None else _meta_like(d.meta["val"])
                        node.meta = meta(d, _fake_like(mode, d.meta["val"], base))
                        got[i] = node
                    nodes[run], bases[run] = got, bases[src]
        if "seq_nr" in out.meta:           # made after the update's autograd nodes
            out.meta["seq_nr"] += self.seq_count
        return [nodes[st] for st in self.outputs]
