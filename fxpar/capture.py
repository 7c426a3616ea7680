"""Capture: a stage's training step as one joint aten graph -- forward, loss (or the incoming
output gradients), backward and optimizer step. One module, two entry points:

* :func:`trace_forward` -- forward + loss of the whole model on one microbatch, for cutting it into
  pipeline stages (``passes.split_stages``). Only a pipeline needs it.
* :func:`capture_training_step` -- the joint step graph of one stage. A program without a pipeline
  is one stage whose forward is the model itself (run through ``torch.func.functional_call``); a
  pipeline stage's forward is the stage graph ``split_stages`` cut out of the forward trace.

Both are ``make_fx`` (fake tensors: nothing is computed, no memory is used) over
``functionalize(fn, remove="mutations")``: the graphs hold no in-place op, so cutting them into
forward and backward graphs later cannot separate a write from a read. The joint step is
``torch.func.vjp`` of the stage forward, seeded with ``full_like(loss, 1/m)`` on the last stage
(m microbatches per step) or with the output gradients received from the next stage, followed by
the optimizer update of :mod:`fxpar.optim` (SGD/Adam/AdamW; others run eagerly). Placeholders and
outputs are described by a :class:`StepSignature`::

    def forward(self, wte_weight, ..., buf_bn_running_mean, ..., exp_avg_wte_weight, ..., lr, step,
                input0, target0):                                   # + act_*, tangent_* on pipeline stages
        embedding = aten.embedding(wte_weight, input0)             # fxpar_phase=forward, fxpar_module=wte
        ...
        full_like = aten.full_like(nll_loss, 0.25)                  # fxpar_phase=backward (the seed, 1/m)
        embedding_dense_backward = ...                              # fxpar_phase=backward
        _foreach_sub = ...                                          # fxpar_phase=optimizer
        return (loss | acts..., new params..., new buffers..., new opt state..., grads..., act grads...)

Tied parameters (an LM head sharing the embedding) are one placeholder: parameters are
de-duplicated by identity and ``functional_call`` re-ties them. Module paths come from forward
hooks (the model) or from the stage graph's own ``fxpar_module`` (a stage); backward nodes take
the module whose activations or parameters they read.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import random
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from . import meta as M
from ._tracing import (ModuleTracker, call_model, capture_context, clean_name, explain_trace_error, gc_paused,
                       split_batch)
from .capture_optim import UpdateStamp
from .errors import CaptureError
from .optim import OptimizerSpec
from .roles import Role

try:
    import numpy as np
except ImportError:                     # numpy is optional: only its random state is compared
    np = None

__all__ = ["StepSignature", "CapturedStep", "ForwardTrace", "capture_training_step", "trace_forward",
           "shared_captures", "unshared_captures", "model_fingerprint"]


@dataclass
class StepSignature:
    """What each placeholder and each output of a graph is: ``(role, key)`` pairs, ``role`` a :class:`~fxpar.roles.Role`.

    Joint-graph input roles: param, buffer, opt_state, lr, step, input, target, act (an activation
    received from the previous stage), tangent (the gradient of an output, from the next stage).
    Output roles: loss, act, new_param, new_buffer, new_opt_state, grad, act_grad. ``key`` is the
    model's state-dict key (opt_state: ``"exp_avg:blocks.0.fc.weight"``), the batch position, or the
    name of the activation in the whole-model forward trace. The graphs a split cuts out add roles of
    their own (see ``passes.split_graphs``).
    """
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)

    def index(self, role: Role, key: str | None = None, outputs: bool = False) -> list:
        seq = self.outputs if outputs else self.inputs
        return [i for i, (r, k) in enumerate(seq) if r == role and (key is None or k == key)]

    def keys(self, role: Role, outputs: bool = False) -> list:
        seq = self.outputs if outputs else self.inputs
        return [k for r, k in seq if r == role]

    def copy(self) -> "StepSignature":
        return StepSignature(list(self.inputs), list(self.outputs))


@dataclass
class CapturedStep:
    gm: torch.fx.GraphModule
    signature: StepSignature
    param_names: list            # unique trainable parameters of the stage, placeholder order
    buffer_names: list
    aliases: dict                # tied alias key -> canonical key (e.g. head.weight -> wte.weight)
    optimizer: OptimizerSpec
    model_class: str
    trace_seconds: float
    param_shapes: dict = field(default_factory=dict)
    param_dtypes: dict = field(default_factory=dict)
    stage: int = 0
    # what several builds over this capture derive alike, computed once (the auto planner's finalists share one
    # capture): fxpar.features.tensor_parallel keeps Megatron's propagated split here, keyed by what it depends on
    derived: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class ForwardTrace:
    """Forward + loss of the whole model on one microbatch (for stage cutting)."""
    gm: torch.fx.GraphModule
    roles: dict                      # placeholder name -> (role, key): param/buffer/input/target
    param_names: list                # trainable, de-duplicated
    buffer_names: list
    aliases: dict                    # tied alias key -> canonical key
    module_types: dict = field(default_factory=dict)   # module path -> class name


def _model_state(model: torch.nn.Module):
    """(trainable, buffers incl. frozen params, aliases): parameters de-duplicated by identity."""
    params = dict(model.named_parameters())
    trainable = {k: v for k, v in params.items() if v.requires_grad}
    buffers = {**{k: v for k, v in params.items() if not v.requires_grad}, **dict(model.named_buffers())}
    ids = {id(v): k for k, v in params.items()}
    aliases = {k: ids[id(v)] for k, v in model.named_parameters(remove_duplicate=False) if k not in params}
    if not trainable:
        raise CaptureError(f"{type(model).__name__} has no parameter with requires_grad=True: nothing to train. Set "
                           "requires_grad=True on the parameters to train (e.g. p.requires_grad_() for a frozen "
                           "backbone's head), or check that the model registers them as nn.Parameter.")
    return trainable, buffers, aliases


def _distinct(flat: list) -> list:
    """make_fx maps one tensor object to one placeholder: keep them distinct."""
    seen = set()
    for i, t in enumerate(flat):
        if id(t) in seen:
            flat[i] = t.detach().clone()
        seen.add(id(flat[i]))
    return flat


def _model_loss(out, mod_name: str):
    """With ``loss_fn=None`` the model returns its loss: a tensor, or an output with a ``loss`` field (Hugging
    Face's ``ModelOutput`` when ``labels=`` is given)."""
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        keys = f" with keys {list(out.keys())}" if isinstance(out, Mapping) else ""
        raise CaptureError(f"with loss_fn=None, {mod_name} must return its loss, but it returned a {type(out).__name__}"
                           f"{keys} and no 'loss'. Pass the labels the model computes its loss from (Hugging Face: "
                           "labels= in example_inputs), or pass loss_fn=.")
    return loss


def _scalar_loss(loss, mod_name: str, loss_fn) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise CaptureError(
            f"the loss of {mod_name} is not a scalar: got {shape}. "
            + ("Make loss_fn reduce to one number (e.g. reduction='mean')." if loss_fn is not None
               else "With loss_fn=None the model must return a scalar loss; pass loss_fn= instead."))


def _refuse_parameter_writes(model: torch.nn.Module, mod_name: str) -> None:
    """Modules whose forward writes their own parameter in place, which one captured graph cannot replay: an
    ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``max_norm`` renormalises the rows it looks up in its weight
    (``torch.embedding_renorm_``) before the optimizer ever sees them."""
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and mod.max_norm is not None:
            kind = type(mod).__name__
            raise CaptureError(
                f"cannot capture {mod_name}: module '{name or '(top level)'}' (nn.{kind}) has max_norm="
                f"{mod.max_norm}, so its forward renormalises the rows it looks up in its weight in place "
                "(torch.embedding_renorm_): a write to a parameter during forward, which fxpar's captured training "
                f"step cannot replay. Build the {kind} without max_norm, or bound the rows' norms out of place in "
                f"forward (rows = F.embedding(idx, w); rows * (max_norm / rows.norm(dim=-1, keepdim=True))"
                ".clamp(max=1)), which trains a traceable variant of the model.")


def trace_forward(model: torch.nn.Module, batch, loss_fn) -> ForwardTrace:
    """``loss_fn(model(*inputs), target)`` on one microbatch, as an aten graph of fake tensors. Every
    ``call_function`` node carries ``fxpar_module``; the one output is the scalar loss."""
    inputs, target, kw_names = split_batch(batch, loss_fn)
    trainable, buffers, aliases = _model_state(model)
    pnames, bnames = list(trainable), list(buffers)
    n_p, n_b = len(pnames), len(bnames)
    tracker = ModuleTracker(model)
    mod_name = type(model).__name__
    _refuse_parameter_writes(model, mod_name)

    def fwd(*flat):
        p, b = dict(zip(pnames, flat[:n_p])), dict(zip(bnames, flat[n_p:n_p + n_b]))
        x, y = flat[n_p + n_b:n_p + n_b + len(inputs)], flat[n_p + n_b + len(inputs):]
        tracker.set("forward", "")
        out = call_model(model, (p, b), tuple(x), kw_names)
        loss = loss_fn(out, *y) if loss_fn is not None else _model_loss(out, mod_name)
        _scalar_loss(loss, mod_name, loss_fn)
        return loss

    flat = _distinct([*trainable.values(), *buffers.values(), *inputs, *target])
    gm = _trace(fwd, flat, mod_name, tracker, model)
    roles = {}
    sig = [(Role.PARAM, k) for k in pnames] + [(Role.BUFFER, k) for k in bnames] + \
          [(Role.INPUT, str(i)) for i in range(len(inputs))] + [(Role.TARGET, str(i)) for i in range(len(target))]
    for node, (role, key) in zip(gm.graph.find_nodes(op="placeholder"), sig):
        node._rename(_placeholder_name(role, key))
        node.target = node.name
        roles[node.name] = (role, key)
    for n in gm.graph.nodes:
        custom = n.meta.pop("custom", None)
        if n.op == "call_function":
            M.set_meta(n, M.MODULE, (custom or {}).get(M.MODULE.name, ""))
            M.set_meta(n, M.PHASE, "forward")
    gm.recompile()
    types = {name: type(mod).__name__ for name, mod in model.named_modules()}
    return ForwardTrace(gm, roles, pnames, bnames, aliases, types)


def _python_random_state() -> tuple:
    """Python's and numpy's global random states (numpy's None where it is not installed)."""
    return random.getstate(), (None if np is None else np.random.get_state())


def _python_random_used(before: tuple, after: tuple) -> list:
    """Which of Python's ``random`` and ``numpy.random`` drew numbers between two states."""
    used = ["random"] if before[0] != after[0] else []
    if before[1] is not None and not all(np.array_equal(a, b) for a, b in zip(before[1], after[1])):
        used.append("numpy.random")
    return used


_PLAIN = (bool, int, float, str, type(None))


def _plain(v) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, tuple) and len(v) <= 16 and all(isinstance(x, _PLAIN) for x in v))


def _module_attributes(model: torch.nn.Module | None) -> dict:
    """``{(module path, attribute): value}`` for every plain Python attribute (bool, int, float, str, None, a
    short tuple of them) in the ``__dict__`` of ``model``'s modules: the Python state a forward can change."""
    if model is None:
        return {}
    return {(path, k): v for path, mod in model.named_modules(remove_duplicate=True)
            for k, v in mod.__dict__.items() if _plain(v)}


_UNSET = "(unset)"


def _attributes_changed(before: dict, after: dict) -> list:
    """``[(module path, attribute, before, after)]`` for the attributes a traced forward set or changed
    (``before`` is ``"(unset)"`` for one it set)."""
    return [(path, k, before.get((path, k), _UNSET), v) for (path, k), v in after.items()
            if (path, k) not in before or not (before[(path, k)] is v or before[(path, k)] == v)]


def _warn_attributes_changed(changed: list, mod_name: str) -> None:
    shown = "; ".join(f"module '{path or '(top level)'}' attribute {k!r}: {old if old is _UNSET else repr(old)} -> "
                      f"{new!r}" for path, k, old, new in changed[:4]) + ("; ..." if len(changed) > 4 else "")
    warnings.warn(
        f"{mod_name}'s forward changed Python attributes of its modules while fxpar captured it ({shown}). Python "
        "code in forward runs once, at capture: a decision that reads such state (a call counter, a flag toggled in "
        "forward, a time stamp) is fixed into the graph and replayed at every step, and the attribute does not change "
        "again while training. Make the decision a tensor op (torch.where on a tensor the step updates, such as a "
        "buffer), or keep the state outside forward and pass what it decides in as an input; docs/semantics.md "
        "'Python-level randomness and state'.", UserWarning, stacklevel=5)


def _trace(fn, flat, mod_name, tracker, model=None):
    state = _python_random_state()
    attributes = _module_attributes(model)
    try:
        # a lazy GraphModule: its Python code is generated when first read or called, not at every recompile()
        # (the trace's, the annotation's, a copy's, each pass's): the joint step is lowered, not run
        with fx_traceback.preserve_node_meta(), tracker, capture_context(), _use_lazy_graph_module(True), gc_paused():
            gm = make_fx(torch.func.functionalize(fn, remove="mutations"), tracing_mode="fake")(*flat)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the user's module named
        raise explain_trace_error(e, mod_name, tracker) from e
    changed = _attributes_changed(attributes, _module_attributes(model))
    if changed:
        _warn_attributes_changed(changed, mod_name)
    used = _python_random_used(state, _python_random_state())
    if (changed or used) and _SHARED is not None:
        _SHARED.impure = True
    if used:
        warnings.warn(
            f"{mod_name}'s training step drew from {' and '.join(used)} while fxpar captured it: Python-level "
            "randomness runs once, at capture, so whatever it decided (a branch taken, a layer skipped, a scale "
            "drawn) is fixed into the graph and replayed at every step. Use torch's random ops instead "
            "(torch.rand / torch.bernoulli / torch.where on a torch.rand draw), which are drawn afresh every step; "
            "docs/semantics.md 'Python-level randomness'.", UserWarning, stacklevel=4)
    return gm


class _StageRunner(torch.fx.Interpreter):
    """Runs a stage graph while tracing, handing each node's module path to the nodes it becomes.

    A stage receives its activations contiguous (that is how they travel), whatever strides they had
    in the whole-model trace, so a ``view`` traced on another layout may not apply: it runs as
    ``reshape``, which is a view wherever one exists."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten.view.default:
            target = torch.ops.aten.reshape.default
        return super().call_function(target, args, kwargs)

    def run_node(self, n):
        n.meta["custom"] = {M.PHASE.name: "forward", M.MODULE.name: M.get(n, M.MODULE, "")}
        try:
            return super().run_node(n)
        finally:
            n.meta.pop("custom", None)


class _SharedCaptures:
    """The captures made inside :func:`shared_captures`: ``(key, pristine copy, loss n_classes)`` each."""

    def __init__(self, across_models: bool = False):
        self.entries: list = []
        self.impure = False
        self.hits = 0
        self.across_models = across_models


_SHARED: _SharedCaptures | None = None


@contextlib.contextmanager
def shared_captures(across_models: bool = False):
    """Within it, :func:`capture_training_step` on the same model, microbatch (structure, shapes, dtypes, devices,
    strides and, off ``meta``, values), loss, optimizer, grad scale and frozen keys as an earlier call returns a
    deep copy of that capture instead of tracing again (the copy is what a second trace gives: the trace is
    deterministic in these). A pipeline stage's capture is not shared (its stage graph is made per call), nor one
    whose forward drew Python randomness or changed a module attribute (a second trace could differ).

    ``across_models=True``: "the same model" is any model alike in everything the trace reads
    (:func:`model_fingerprint`), not only the same object; a capture that warned is not shared then (a copy would
    not warn again). For many builds of models made alike, such as a test module's."""
    global _SHARED
    outer, _SHARED = _SHARED, _SharedCaptures(across_models)
    try:
        yield _SHARED
    finally:
        _SHARED = outer


@contextlib.contextmanager
def unshared_captures():
    """Within it, every capture traces (an enclosing :func:`shared_captures` is set aside): what
    ``parallelize(check_capture=True)`` compares must be two traces."""
    global _SHARED
    outer, _SHARED = _SHARED, None
    try:
        yield
    finally:
        _SHARED = outer


def _fingerprint_value(v, depth: int = 0):
    """What :func:`model_fingerprint` keeps of an attribute: plain values and small containers of them as they are,
    a tensor by its metadata and bytes, anything else by identity (alike only if it is the same object)."""
    if isinstance(v, _PLAIN) or isinstance(v, (torch.dtype, torch.device)):
        return v
    if isinstance(v, torch.Tensor):
        if v.device.type == "meta" or isinstance(v, torch._subclasses.FakeTensor):
            return ("tensor", tuple(v.shape), v.dtype, v.device.type, id(v))
        data = v.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b""
        return ("tensor", tuple(v.shape), v.dtype, v.device.type, v.stride(), v.requires_grad,
                hashlib.sha256(data).hexdigest())
    if depth < 3 and isinstance(v, (tuple, list)) and len(v) <= 64:
        return (type(v).__name__, tuple(_fingerprint_value(x, depth + 1) for x in v))
    if depth < 3 and isinstance(v, (set, frozenset)) and len(v) <= 256 and all(isinstance(x, _PLAIN) for x in v):
        return (type(v).__name__, tuple(sorted(v, key=repr)))
    if depth < 3 and isinstance(v, Mapping) and len(v) <= 64:
        return (type(v).__name__, tuple((_fingerprint_value(k, depth + 1), _fingerprint_value(x, depth + 1))
                                        for k, x in v.items()))
    return ("object", id(v))


def model_fingerprint(model: torch.nn.Module):
    """A key equal for two models whose training step traces alike: the same module tree (each module's class, by
    identity, and mode), the same attributes (:func:`_fingerprint_value`: plain values, tensors by their bytes,
    any other object, hooks included, by identity), parameters and buffers of the same names, shapes, dtypes,
    devices, strides, ``requires_grad`` and ties, under the same default dtype and grad mode. Their values do not
    enter: the trace runs on fake tensors. None where the model cannot be keyed so."""
    try:
        parts = [torch.get_default_dtype(), torch.is_grad_enabled()]
        for path, mod in model.named_modules(remove_duplicate=False):
            parts.append((path, id(type(mod)), tuple(
                (k, _fingerprint_value(v)) for k, v in mod.__dict__.items()
                if k not in ("_parameters", "_buffers", "_modules"))))
        first: dict = {}
        for kind, named in (("p", model.named_parameters(remove_duplicate=False)),
                            ("b", model.named_buffers(remove_duplicate=False))):
            for k, t in named:
                tie = first.setdefault(id(t), k)
                parts.append((kind, k, tuple(t.shape), t.dtype, t.device.type, t.stride(), t.requires_grad, tie,
                              type(t).__name__))
        return tuple(parts)
    except (TypeError, RuntimeError, ValueError):     # an attribute that does not hash or compare: not keyed
        return None


def _loss_key(loss_fn):
    """A loss callable fxpar made (``fxpar.losses``: one per call, from the user's loss) is the same as another
    made from the same user loss and microbatch count; any other is itself."""
    if hasattr(loss_fn, "visible") and hasattr(loss_fn, "loss_fn") and hasattr(loss_fn, "n_classes"):
        return (type(loss_fn), id(loss_fn.loss_fn), getattr(loss_fn, "k", None))
    return (id(loss_fn),)


def _leaf_same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if (type(a), a.shape, a.dtype, a.device, a.stride(), a.requires_grad) != \
                (type(b), b.shape, b.dtype, b.device, b.stride(), b.requires_grad):
            return False
        return a.device.type == "meta" or torch.equal(a, b)
    return type(a) is type(b) and a == b


def _same_call(a: tuple, b: tuple) -> bool:
    """Two calls' ``(model id, batch leaves, batch structure, loss key, optimizer, grad scale, frozen)`` equal."""
    try:
        return bool(a[0] == b[0] and a[2] == b[2] and len(a[1]) == len(b[1])
                    and all(_leaf_same(x, y) for x, y in zip(a[1], b[1])) and a[3:] == b[3:])
    except (RuntimeError, TypeError, ValueError):       # an option that does not compare (a tensor): not the same
        return False


def capture_training_step(model: torch.nn.Module, batch, loss_fn, optimizer: OptimizerSpec, *,
                          stage=None, grad_scale: float = 1.0, frozen=None) -> CapturedStep:
    """Trace one training step of a stage as one joint graph (inside :func:`shared_captures`, a copy of an
    earlier identical call's; see :func:`_capture_training_step`). The garbage collector is held off throughout (the
    trace, the update written from its template, the annotation: ``fxpar._tracing.gc_paused``)."""
    with gc_paused():
        return _shared_or_captured(model, batch, loss_fn, optimizer, stage, grad_scale, frozen)


def _shared_or_captured(model, batch, loss_fn, optimizer, stage, grad_scale, frozen) -> CapturedStep:
    shared = _SHARED
    if shared is None or stage is not None:
        return _capture_training_step(model, batch, loss_fn, optimizer, stage=stage, grad_scale=grad_scale,
                                      frozen=frozen)
    model_key = model_fingerprint(model) if shared.across_models else id(model)
    if model_key is None:
        return _capture_training_step(model, batch, loss_fn, optimizer, grad_scale=grad_scale, frozen=frozen)
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    key = (model_key, leaves, spec, _loss_key(loss_fn), optimizer, float(grad_scale),
           None if frozen is None else tuple(frozen))
    for k, pristine, n_classes in shared.entries:
        if _same_call(k, key):
            shared.hits += 1
            if n_classes is not _UNSET:            # what the capture's call of fxpar's loss recorded
                loss_fn.n_classes = n_classes
            return copy.deepcopy(pristine)
    shared.impure = False
    if shared.across_models:
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                cap = _capture_training_step(model, batch, loss_fn, optimizer, grad_scale=grad_scale,
                                             frozen=frozen)
        finally:
            for w in said:                         # said again as they were, outside the recording (an error too)
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        shared.impure |= bool(said)
    else:
        cap = _capture_training_step(model, batch, loss_fn, optimizer, stage=None, grad_scale=grad_scale,
                                     frozen=frozen)
    if not shared.impure:
        shared.entries.append((key, copy.deepcopy(cap), getattr(loss_fn, "n_classes", _UNSET)
                               if len(key[3]) > 1 else _UNSET))
    return cap


def _capture_training_step(model: torch.nn.Module, batch, loss_fn, optimizer: OptimizerSpec, *,
                           stage=None, grad_scale: float = 1.0, frozen=None) -> CapturedStep:
    """Trace one training step of a stage as one joint graph.

    ``stage=None``: the whole model is the stage; ``batch`` is the microbatch one rank sees.
    ``stage``: a ``passes.split_stages.StageGraph`` of ``model`` (its forward, inputs and outputs);
    ``batch`` is then the microbatch too (for the input/target shapes).
    ``grad_scale``: the loss gradient's seed on the last stage (1/m for m microbatches a step).
    ``frozen``: trainable parameter keys held fixed, like buffers (no gradient, no update, no optimizer
    state). ``None``: capture once, find the parameters the loss does not reach (a module the forward never
    calls, a weight used only through ``.detach()``), and capture again with them frozen -- torch.optim
    skips a parameter whose ``.grad`` is None, and so does fxpar.
    """
    t0 = time.perf_counter()
    inputs, target, kw_names = split_batch(batch, loss_fn)
    trainable, buffers, aliases = _model_state(model)
    frozen_keys = [k for k in trainable if k in set(frozen or ())]
    if frozen_keys:                      # held like buffers: read by the forward, never updated
        buffers = {**{k: trainable.pop(k).detach() for k in frozen_keys}, **buffers}
    mod_name = type(model).__name__
    _refuse_parameter_writes(model, mod_name)
    tracker = ModuleTracker(model)
    if stage is None:
        in_sig = [(Role.PARAM, k) for k in trainable] + [(Role.BUFFER, k) for k in buffers] + \
                 [(Role.INPUT, str(i)) for i in range(len(inputs))] + [(Role.TARGET, str(i)) for i in range(len(target))]
        out_sig, last = [(Role.LOSS, "loss")], True
        examples = {**{(Role.PARAM, k): v for k, v in trainable.items()},
                    **{(Role.BUFFER, k): v for k, v in buffers.items()},
                    **{(Role.INPUT, str(i)): t for i, t in enumerate(inputs)},
                    **{(Role.TARGET, str(i)): t for i, t in enumerate(target)}}

        def forward(vals: dict):
            p = {k: vals[(Role.PARAM, k)] for k in trainable}
            tracker.set("forward", "")                                 # the clones are forward work
            b = {k: vals[(Role.BUFFER, k)].clone() for k in buffers}     # new buffer values are outputs
            out = call_model(model, (p, b), tuple(vals[(Role.INPUT, str(i))] for i in range(len(inputs))), kw_names)
            loss = loss_fn(out, *(vals[(Role.TARGET, str(i))] for i in range(len(target)))) if loss_fn is not None \
                else _model_loss(out, mod_name)
            _scalar_loss(loss, mod_name, loss_fn)
            return [loss], [b[k] for k in buffers]
    else:
        stage_sig, out_sig = list(stage.inputs), list(stage.outputs)
        as_buffer = {(Role.PARAM, k): (Role.BUFFER, k) for k in frozen_keys}
        in_sig = [rk for rk in stage_sig if rk[0] == Role.PARAM and rk not in as_buffer] + \
            [as_buffer[rk] for rk in stage_sig if rk in as_buffer] + [rk for rk in stage_sig if rk[0] == Role.BUFFER] + \
            [rk for rk in stage_sig if rk[0] not in (Role.PARAM, Role.BUFFER)]
        last = out_sig == [(Role.LOSS, "loss")]
        used_buffers = [k for r, k in in_sig if r == Role.BUFFER]
        phs = stage.gm.graph.find_nodes(op="placeholder")
        examples = {}
        for rk, ph in zip(stage_sig, phs):
            role, key = as_buffer.get(rk, rk)
            v = ph.meta.get("val")
            if role == Role.PARAM:
                examples[(role, key)] = trainable[key]
            elif role == Role.BUFFER:
                examples[(role, key)] = buffers[key]
            elif role in (Role.INPUT, Role.TARGET):
                src = inputs[int(key)] if role == Role.INPUT else target[int(key)]
                examples[(role, key)] = torch.empty(src.shape, dtype=src.dtype, device=src.device)
            else:       # a boundary activation: where the stage's split traced it (the model's device)
                examples[(role, key)] = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        runner = _StageRunner(stage.gm)
        written = list(getattr(stage, "written", []))      # buffers the stage's forward writes (BatchNorm)

        def forward(vals: dict):
            vals = dict(vals)
            new = []
            tracker.set("forward", "")                                 # the copies are forward work
            for k in written:                # written in place on a copy, which leaves as the buffer's new value
                vals[(Role.BUFFER, k)] = vals[(Role.BUFFER, k)].clone()
                new.append(vals[(Role.BUFFER, k)])
            outs = runner.run(*[vals[as_buffer.get(rk, rk)] for rk in stage_sig])
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            return outs, new
        buffers = {k: buffers[k] for k in used_buffers}
    pkeys = [k for r, k in in_sig if r == Role.PARAM]
    bkeys = [k for r, k in in_sig if r == Role.BUFFER]
    diff_in = [i for i, (r, k) in enumerate(in_sig)
               if r == Role.PARAM or (r == Role.ACT and examples[(r, k)].is_floating_point())]
    snames = [f"{s}:{p}" for p in pkeys for s in optimizer.state_names]
    full_in = in_sig[:len(pkeys) + len(bkeys)] + [(Role.OPT_STATE, k) for k in snames] \
        + [(Role.LR, "lr"), (Role.STEP, "step")] + in_sig[len(pkeys) + len(bkeys):]
    if [r for r, _ in in_sig[:len(pkeys) + len(bkeys)]] != [Role.PARAM] * len(pkeys) + [Role.BUFFER] * len(bkeys):
        raise CaptureError(f"stage inputs must list parameters, then buffers: {in_sig}")
    # the output gradients a non-last stage receives: one per floating-point output
    out_vals = None if stage is None else [n.meta["val"] for n in stage.gm.graph.find_nodes(op="output")[0].args[0]]
    diff_out = [0] if last else [j for j, v in enumerate(out_vals) if v.is_floating_point()]
    tangent_sig = [] if last else [(Role.TANGENT, out_sig[j][1]) for j in diff_out]
    full_in += tangent_sig
    state_examples = [torch.empty_like(trainable[n.split(":", 1)[1]]) for n in snames]
    flat = _distinct([examples[rk] for rk in full_in[:len(pkeys) + len(bkeys)]] + state_examples +
                     [torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)] +
                     [examples[rk] for rk in in_sig[len(pkeys) + len(bkeys):]] +
                     ([] if last else [torch.empty(out_vals[j].shape, dtype=out_vals[j].dtype, device=out_vals[j].device)
                                       for j in diff_out]))
    n_p, n_b, n_s, n_d = len(pkeys), len(bkeys), len(snames), len(in_sig) - len(pkeys) - len(bkeys)
    k_state = len(optimizer.state_names)
    # the update is written from a trace over one parameter per layout (fxpar.capture_optim), not traced here
    stamp = UpdateStamp(optimizer) if optimizer.traced and n_p else None
    stamp = stamp if stamp is not None and stamp.usable else None

    def step(*flat_args):
        vals = dict(zip(in_sig[:n_p + n_b], flat_args[:n_p + n_b]))
        state = flat_args[n_p + n_b:n_p + n_b + n_s]
        lr, count = flat_args[n_p + n_b + n_s], flat_args[n_p + n_b + n_s + 1]
        rest = flat_args[n_p + n_b + n_s + 2:]
        vals.update(zip(in_sig[n_p + n_b:], rest[:n_d]))
        tangents = rest[n_d:]

        def f(*diff):
            v = dict(vals)
            for i, d in zip(diff_in, diff):
                v[in_sig[i]] = d
            outs, nb = forward(v)
            # new buffer values leave through vjp's aux, which unwraps them (a tensor made inside f and
            # carried out another way stays wrapped and would be baked into the graph as a constant)
            return tuple(outs[j] for j in diff_out), (tuple(o for j, o in enumerate(outs) if j not in diff_out),
                                                      tuple(nb))

        douts, vjp_fn, (aux, new_buffers) = torch.func.vjp(f, *[vals[in_sig[i]] for i in diff_in], has_aux=True)
        tracker.set("backward", "")
        seeds = (torch.full_like(douts[0], grad_scale),) if last else tuple(tangents)
        grads = vjp_fn(seeds)
        it_d, it_a = iter(douts), iter(aux)
        outs = [next(it_d) if j in diff_out else next(it_a) for j in range(len(out_sig))]
        pgrads = [g for i, g in zip(diff_in, grads) if in_sig[i][0] == Role.PARAM]
        # one tensor for two parameters' gradients (an LSTM's bias_ih and bias_hh): each parameter gets its own
        # node, which data parallelism syncs and the update reads as that parameter's gradient
        seen = set()
        for i, g in enumerate(pgrads):
            if id(g) in seen:
                pgrads[i] = g.clone()
            seen.add(id(g))
        agrads = [g for i, g in zip(diff_in, grads) if in_sig[i][0] == Role.ACT]
        tracker.set("optimizer", "")
        new_p, new_s = [], []
        if optimizer.traced and n_p:
            by_state = [[state[i * k_state + j] for i in range(n_p)] for j in range(k_state)]
            params = [vals[(Role.PARAM, k)] for k in pkeys]
            if stamp is not None:
                stamp.record(params, pgrads, by_state)
            else:
                new_p, new_by_state = optimizer.step_all(params, pgrads, by_state, lr, count)
                new_s = [new_by_state[j][i] for i in range(n_p) for j in range(k_state)]
        return (*outs, *new_p, *new_buffers, *new_s, *pgrads, *agrads)

    gm = _trace(step, flat, mod_name, tracker, model if stage is None else None)
    if stamp is not None and not _stamp_update(gm, stamp, n_p, n_b, k_state, len(out_sig),
                                               len(bkeys) if stage is None else len(written)):
        stamp = None            # a template this capture does not recognise: the update traced with the rest
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)        # the first trace gave them
            gm = _trace(step, flat, mod_name, tracker, model if stage is None else None)
    sig = StepSignature(list(full_in), list(out_sig))
    if optimizer.traced:
        sig.outputs += [(Role.NEW_PARAM, k) for k in pkeys]
    sig.outputs += [(Role.NEW_BUFFER, k) for k in (bkeys if stage is None else written)]
    if optimizer.traced:
        sig.outputs += [(Role.NEW_OPT_STATE, k) for k in snames]
    sig.outputs += [(Role.GRAD, k) for k in pkeys]
    sig.outputs += [(Role.ACT_GRAD, in_sig[i][1]) for i in diff_in if in_sig[i][0] == Role.ACT]
    if frozen is None:
        unused = _params_without_gradient(gm, sig, pkeys, last)
        if unused and len(unused) == len(pkeys) and stage is None:
            raise CaptureError(f"the loss of {mod_name} does not depend on any of its trainable parameters "
                               f"({', '.join(pkeys[:4])}{', ...' if len(pkeys) > 4 else ''}): nothing would train. Check "
                               "that forward uses its parameters and that the loss is computed from the model's output.")
        if unused:              # the same forward traced again: the first trace gave its warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return _capture_training_step(model, batch, loss_fn, optimizer, stage=stage, grad_scale=grad_scale,
                                              frozen=unused)
    _annotate(gm, sig)
    gm.meta[M.SIGNATURE.name] = sig
    return CapturedStep(gm, sig, pkeys, bkeys, aliases, optimizer, mod_name, time.perf_counter() - t0,
                        {k: tuple(trainable[k].shape) for k in pkeys}, {k: trainable[k].dtype for k in pkeys},
                        stage=0 if stage is None else stage.index)


def _stamp_update(gm: torch.fx.GraphModule, stamp: UpdateStamp, n_p: int, n_b: int, k_state: int, n_out: int,
                  n_new_buffers: int) -> bool:
    """Write the optimizer update into a step traced without it (``fxpar.capture_optim``) and put the new parameters
    and states among the outputs where the traced update puts them; False where no template fits."""
    phs = gm.graph.find_nodes(op="placeholder")
    out = gm.graph.find_nodes(op="output")[0]
    outs = list(out.args[0])
    grads = outs[n_out + n_new_buffers:n_out + n_new_buffers + n_p]
    if not all(isinstance(g, torch.fx.Node) for g in grads):
        return False
    s0 = n_p + n_b
    states = [[phs[s0 + i * k_state + j] for i in range(n_p)] for j in range(k_state)]
    made = stamp.apply(gm, phs[:n_p], grads, states, phs[s0 + n_p * k_state], phs[s0 + n_p * k_state + 1])
    if made is None:
        return False
    new_p, new_by_state = made[0], made[1:]
    new_s = [new_by_state[j][i] for i in range(n_p) for j in range(k_state)]
    ordered = outs[:n_out] + new_p + outs[n_out:n_out + n_new_buffers] + new_s + outs[n_out + n_new_buffers:]
    out.args = (type(out.args[0])(ordered),)
    gm.recompile()
    return True


def _params_without_gradient(gm: torch.fx.GraphModule, sig: StepSignature, pkeys: list, last: bool) -> list:
    """Parameters whose gradient does not depend on the loss (last stage) or on the received output
    gradients: the vjp returned zeros for them, where torch's autograd leaves ``.grad`` None."""
    phs = gm.graph.find_nodes(op="placeholder")
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    if last:
        seeds = [outs[i] for i in sig.index(Role.LOSS, outputs=True)]
    else:
        seeds = [ph for ph, (r, _) in zip(phs, sig.inputs) if r == Role.TANGENT]
    reached, stack = set(), [n for n in seeds if isinstance(n, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n not in reached:
            reached.add(n)
            stack.extend(n.users)
    grads = {k: outs[i] for i, (r, k) in enumerate(sig.outputs) if r == Role.GRAD}
    return [k for k in pkeys if not isinstance(grads.get(k), torch.fx.Node) or grads[k] not in reached]


def _placeholder_name(role: Role, key: str) -> str:
    if role == Role.OPT_STATE:
        s, p = key.split(":", 1)
        return f"{s}_{clean_name(p)}"
    prefix = {Role.PARAM: "", Role.BUFFER: "buf_", Role.INPUT: "input", Role.TARGET: "target", Role.LR: "",
              Role.STEP: "", Role.ACT: "act_", Role.TANGENT: "tangent_"}[role]
    return prefix + (key if role in (Role.INPUT, Role.TARGET) else clean_name(key))


def _backward_module(n: torch.fx.Node, param_module: dict) -> str:
    """A backward node belongs to the module whose activations or parameters it reads (the deepest),
    else to the module of the backward node that feeds it. Data flow, not autograd bookkeeping."""
    best = ""
    for a in n.all_input_nodes:
        m = param_module.get(a)
        if m is None and a.op == "call_function" and M.get(a, M.PHASE) == "forward":
            m = M.get(a, M.MODULE, "")
        if m and m.count(".") >= best.count(".") and len(m) > len(best):
            best = m
    if best:
        return best
    for a in n.all_input_nodes:
        if a.op == "call_function" and M.get(a, M.PHASE) == "backward" and M.get(a, M.MODULE):
            return M.get(a, M.MODULE)
    return ""


def _annotate(gm: torch.fx.GraphModule, sig: StepSignature) -> None:
    """Name placeholders after the model's keys and write fxpar's meta keys."""
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    for node, (role, key) in zip(placeholders, sig.inputs):
        node._rename(_placeholder_name(role, key))
        node.target = node.name
        M.set_meta(node, M.ROLE, role)
        if role in (Role.PARAM, Role.BUFFER, Role.OPT_STATE):
            M.set_meta(node, M.PARAM, key)
    param_module = {n: M.get(n, M.PARAM).rsplit(".", 1)[0] if "." in M.get(n, M.PARAM) else ""
                    for n in placeholders if M.get(n, M.ROLE) == Role.PARAM}
    for n in g.nodes:
        custom = n.meta.pop("custom", None)
        if n.op != "call_function":
            continue
        phase = (custom or {}).get(M.PHASE.name, "optimizer")
        M.set_meta(n, M.PHASE, phase)
        module = (custom or {}).get(M.MODULE.name, "")
        if phase == "backward":
            module = _backward_module(n, param_module)
        M.set_meta(n, M.MODULE, module)
    out = g.find_nodes(op="output")[0]
    for node, (role, key) in zip(out.args[0], sig.outputs):
        if role == Role.GRAD and isinstance(node, torch.fx.Node):
            M.set_meta(node, M.GRAD_OF, key)
    g.lint()
    gm.recompile()


def captures_differ(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> str | None:
    """Where two captures of one training step differ (the first node whose op, shape or dtype differs, with its
    module), or None where they are the same graph."""
    def key(n):
        v = n.meta.get("val")
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
        return n.op, str(n.target), shape, getattr(v, "dtype", None)

    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    for i, (x, y) in enumerate(zip(na, nb)):
        if key(x) != key(y):
            where = M.get(x, M.MODULE, "") or M.get(y, M.MODULE, "")
            return (f"node {i} is {x.op} {x.target} in the first and {y.op} {y.target} in the second"
                    + (f" (module {where!r}, {M.get(x, M.PHASE, '')})" if where else ""))
    if len(na) != len(nb):
        return f"the first has {len(na)} nodes, the second {len(nb)}"
    return None
