"""Tracing helpers shared by fxpar's traces (the training step and the forward + loss a pipeline
cuts into stages): module paths for node meta, the batch split, errors that name the user's
module and say what to change, and the context every trace runs in. Internal to fxpar."""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import sysconfig
import traceback
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx.traceback as fx_traceback

from . import meta as M
from .errors import CaptureError, InputError

__all__ = ["ModuleTracker", "batch_parts", "split_batch", "call_model", "BatchLayout", "explain_trace_error",
           "clean_name", "capture_context", "gc_paused", "TRACING_PREDICATES"]

# Library predicates that ask "is a graph being traced right now?" and answer wrongly under
# fxpar's capture: (module that defines it, function name). Every module of the same top-level
# package that bound the function by name (``from .utils import is_tracing``) is patched too.
TRACING_PREDICATES = (
    ("transformers.utils.import_utils", "is_tracing"),
)


def _traced_true(orig):
    @functools.wraps(orig)
    def predicate(*args, **kwargs):
        return True
    return predicate


_SCANNED: dict = {}       # (package, id(fn)) -> (the loaded module names scanned, their bindings)


def _bindings(package: str, fn, only=None) -> list:
    """``(module, name)`` for every loaded module of ``package`` (or of the names ``only``) whose global ``name``
    is ``fn``. Reads ``vars(module)`` so lazy modules (transformers' ``_LazyModule``) import nothing. A scan of
    the whole package is kept while no module is loaded or unloaded (a capture scans once, not twice per trace);
    each kept binding is checked again before use."""
    key = (package, id(fn))
    loaded = frozenset(sys.modules) if only is None else None
    if only is None and key in _SCANNED and _SCANNED[key][0] == loaded:
        return [(mod, name) for mod, name in _SCANNED[key][1] if vars(mod).get(name) is fn]
    out = []
    for mod_name in (list(sys.modules) if only is None else only):
        mod = sys.modules.get(mod_name)
        if mod is None or not (mod_name == package or mod_name.startswith(package + ".")):
            continue
        for name, value in list(getattr(mod, "__dict__", {}).items()):
            if value is fn:
                out.append((mod, name))
    if only is None:
        _SCANNED[key] = (loaded, out)
    return out


@contextlib.contextmanager
def capture_context():
    """Enter around every ``make_fx`` trace of a capture, so that libraries see a trace in progress.

    Why: fxpar traces ``make_fx(functionalize(step), tracing_mode="fake")``. The model then sees
    functional wrappers (``FunctionalTensorWrapper``) around fake tensors, not ``FakeTensor``s,
    and no dynamo, jit or fx-proxy state is set. Hugging Face ``transformers`` (5.x) asks
    ``is_tracing(tensor)`` (``transformers.utils.import_utils``: dynamo, jit, fx ``Proxy`` or
    ``FakeTensor``) before value-dependent shortcuts, e.g. in ``masking_utils``::

        if not is_tracing(packed_sequence_mask) and (packed_sequence_mask[:, -1] == 0).all():
            return None

    It answers False, the shortcut reads a fake tensor's value and the capture fails with a
    data-dependent guard error in the model's mask code. Inside this context such predicates
    return True, so the library takes the path it takes under ``torch.compile``/``torch.export``:
    the general computation, correct for every batch, kept in the graph.

    Only predicates listed in :data:`TRACING_PREDICATES` are patched, only if their package is
    already imported (a model built from it has imported it), in every loaded module of that
    package that bound them by name; all are restored on exit, including bindings made by
    modules imported during the trace. Outside the context nothing is changed. Nests.
    """
    patched = []          # (module, name, original)
    replaced = []         # (package, replacement, original)
    before = None         # module name -> how many globals it had
    for home_name, fn_name in TRACING_PREDICATES:
        home = sys.modules.get(home_name)
        orig = vars(home).get(fn_name) if home is not None else None
        if orig is None:
            continue
        if before is None:
            before = {m: len(getattr(mod, "__dict__", ())) for m, mod in list(sys.modules.items())}
        package, repl = home_name.split(".", 1)[0], _traced_true(orig)
        replaced.append((package, repl, orig))
        for mod, name in _bindings(package, orig):
            setattr(mod, name, repl)
            patched.append((mod, name, orig))
    try:
        yield
    finally:
        for mod, name, orig in reversed(patched):
            setattr(mod, name, orig)
        # modules first imported while tracing, or whose globals grew (a lazy module caches what it resolved),
        # may have bound repl
        new = [m for m, mod in list(sys.modules.items())
               if before.get(m) != len(getattr(mod, "__dict__", ()))] if replaced else []
        for package, repl, orig in replaced:
            for mod, name in _bindings(package, repl, only=new):
                setattr(mod, name, orig)


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector held off inside: around a trace and the passes over its graph.

    A trace of GPT-2 small's step makes some 10^5 objects that live as long as the graph (nodes, their meta, fake
    tensors); each of them counts towards the collector's next collection, which then walks every object in the
    process (torch's own included) while almost nothing is garbage: about a tenth of a build's time. Objects
    freed by their reference count are freed inside as ever; cycles wait until the block ends, when collection
    resumes on its usual thresholds. Restores what it found (nests; a collector the caller disabled stays so)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class ModuleTracker:
    """Forward hooks that write the current module path into the node meta make_fx copies."""

    def __init__(self, model: torch.nn.Module):
        self.names = {mod: name for name, mod in model.named_modules()}
        self.stack: list = []
        self.handles: list = []

    def set(self, phase: str, module: str | None = None):
        mod = module if module is not None else (self.stack[-1] if self.stack else "")
        fx_traceback.current_meta["custom"] = {M.PHASE.name: phase, M.MODULE.name: mod}

    def __enter__(self):
        def pre(mod, args):
            if mod in self.names:
                self.stack.append(self.names[mod])
                self.set("forward")

        def post(mod, args, out):
            if mod in self.names and self.stack:
                self.stack.pop()
                self.set("forward")

        self.handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                        torch.nn.modules.module.register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        fx_traceback.current_meta.pop("custom", None)


def _structure(batch):
    """(positional elements, keyword dict, form) of a batch as the user wrote it. Forms: ``"tensor"``,
    ``"tuple"`` ``(x, y)``, ``"dict"`` ``{"input_ids": ...}``, ``"nested"`` ``((x, y), {...})`` and
    ``"trailing"`` ``(x, y, {...})``."""
    if isinstance(batch, Mapping):
        return (), dict(batch), "dict"
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2 and isinstance(batch[0], (tuple, list)) and isinstance(batch[1], Mapping):
            return tuple(batch[0]), dict(batch[1]), "nested"
        if batch and isinstance(batch[-1], Mapping):
            return tuple(batch[:-1]), dict(batch[-1]), "trailing"
        return tuple(batch), {}, "tuple"
    return (batch,), {}, "tensor"


def _n_targets(loss_fn) -> int:
    return 0 if loss_fn is None else int(getattr(loss_fn, "fxpar_n_targets", 1))


def split_batch(batch, loss_fn):
    """``(inputs, targets, keyword names)``: inputs are the positional model inputs then the keyword ones
    (the last ``len(keyword names)`` of them), targets the last positional elements ``loss_fn`` takes."""
    pos, kw, _ = _structure(batch)
    n_t = _n_targets(loss_fn)
    for i, b in enumerate(pos):
        if not isinstance(b, torch.Tensor):
            raise CaptureError(f"example_inputs[{i}] is a {type(b).__name__}; fxpar needs a tuple of tensors "
                               "(inputs..., target), each with the batch on dim 0.")
    for k, b in kw.items():
        if not isinstance(b, torch.Tensor):
            raise CaptureError(f"example_inputs[{k!r}] is a {type(b).__name__}; fxpar needs tensors with the batch "
                               "on dim 0 (pass other settings to the model's constructor).")
    if len(pos) < n_t:
        raise CaptureError("with loss_fn given, example_inputs must be (inputs..., target); got "
                           + ("one tensor" if len(pos) == 1 else f"{len(pos)} positional tensor(s)")
                           + ". Pass loss_fn=None if the model itself returns the loss.")
    inputs = pos[:len(pos) - n_t] + tuple(kw.values())
    return inputs, pos[len(pos) - n_t:], tuple(kw)


def batch_parts(batch, loss_fn):
    """``(inputs, targets)`` of a batch (keyword inputs last among the inputs); see :func:`split_batch`."""
    inputs, targets, _ = split_batch(batch, loss_fn)
    return inputs, targets


def call_model(model, state: tuple, inputs: tuple, kw_names: tuple):
    """``model(*positional, **keywords)`` through ``torch.func.functional_call`` with ``state`` (params, buffers)."""
    n_pos = len(inputs) - len(kw_names)
    return torch.func.functional_call(model, state, tuple(inputs[:n_pos]), dict(zip(kw_names, inputs[n_pos:])))


@dataclass(frozen=True)
class BatchLayout:
    """Where each tensor of a user's batch goes in the flat tuple fxpar's graphs and runtime use.

    A batch is ``(inputs..., target)`` (or the inputs alone when the model returns its loss), a dict
    of keyword inputs (Hugging Face style ``{"input_ids": ..., "attention_mask": ..., "labels": ...}``),
    or both: ``((inputs..., target), {...})`` or ``(inputs..., target, {...})``. Flat order: the
    positional model inputs, the keyword inputs in the dict's order, then the targets. ``paths`` names
    each flat tensor as the user would index it (``[1]``, ``['attention_mask']``, ``[0][1]``).
    """
    form: str
    n_args: int
    kwargs: tuple
    n_targets: int
    paths: tuple

    @classmethod
    def of(cls, batch, loss_fn, what: str = "example_inputs") -> "BatchLayout":
        pos, kw, form = _structure(batch)
        n_t = _n_targets(loss_fn)
        for k in kw:
            if not isinstance(k, str):
                raise InputError(f"{what} has the dict key {k!r}; keyword inputs are named by strings (the model's "
                                 "forward argument names, e.g. 'input_ids').")
        if len(pos) < n_t or (n_t and len(pos) == n_t and not kw):      # no model input besides the target
            have = f"only the keyword inputs {sorted(kw)}" if kw and not pos else f"{len(pos)} tensor(s)"
            raise InputError(f"{what} has {have}, but loss_fn={_fn_name(loss_fn)} needs the target as the last "
                             "positional element: pass (inputs..., target), (target, {keywords}) or "
                             "((inputs..., target), {keywords}); or loss_fn=None if the model computes its own loss "
                             "(Hugging Face models do, from labels=).")
        if not pos and not kw:
            raise InputError(f"{what} is empty; pass one global batch: (inputs..., target) or a dict of keyword inputs.")
        pre = {"tensor": "", "tuple": "", "dict": "", "nested": "[0]", "trailing": ""}[form]
        kw_pre = {"nested": "[1]", "trailing": f"[{len(pos)}]"}.get(form, "")
        n_args = len(pos) - n_t
        paths = [f"{pre}[{i}]" for i in range(n_args)] + [f"{kw_pre}[{k!r}]" for k in kw] + \
                [f"{pre}[{i}]" for i in range(n_args, len(pos))]
        if form == "tensor":
            paths = [""]
        layout = cls(form, n_args, tuple(kw), n_t, tuple(paths))
        layout.flatten(batch, what)        # every element a tensor
        return layout

    @property
    def n_inputs(self) -> int:
        return self.n_args + len(self.kwargs)

    def describe(self, i: int, what: str) -> str:
        """``batches[3]['attention_mask']``, ``example_inputs[1] (the target)``."""
        if i >= len(self.paths):
            return f"{what} (column {i}, added by fxpar)"
        role = " (the target)" if self.n_targets and i >= self.n_inputs else ""
        return f"{what}{self.paths[i]}{role}"

    def shape_text(self) -> str:
        if self.form == "dict":
            return f"a dict with keys {list(self.kwargs)}"
        n = self.n_args + self.n_targets
        pos = f"{n} tensor(s)" + (" (inputs..., target)" if self.n_targets else "")
        if self.form == "tensor":
            return "one tensor"
        if self.form == "tuple":
            return f"a tuple of {pos}"
        if self.form == "nested":
            return f"(a tuple of {pos}, a dict with keys {list(self.kwargs)})"
        return f"a tuple of {pos} followed by a dict with keys {list(self.kwargs)}"

    def flatten(self, batch, what: str = "batch") -> tuple:
        """The batch's tensors in flat order; raises :class:`InputError` naming the element that does not fit."""
        pos, kw, form = _structure(batch)
        same_form = form == self.form or {form, self.form} <= {"tensor", "tuple"}
        if not same_form or len(pos) != self.n_args + self.n_targets or sorted(kw) != sorted(self.kwargs):
            detail = ""
            if form in ("dict", "nested", "trailing") and self.kwargs:
                missing, extra = sorted(set(self.kwargs) - set(kw)), sorted(set(kw) - set(self.kwargs))
                detail = (f" (missing keys {missing})" if missing else "") + (f" (unexpected keys {extra})" if extra else "")
            raise InputError(f"{what} is {_structure_text(pos, kw, form)}{detail}, but example_inputs was "
                             f"{self.shape_text()}: give every batch the structure of example_inputs (or build the "
                             "program from an example of the new structure).")
        kw = {k: kw[k] for k in self.kwargs}          # the same keys, in example_inputs' order
        n_t = self.n_targets
        flat = pos[:len(pos) - n_t] + tuple(kw.values()) + pos[len(pos) - n_t:]
        for i, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{self.describe(i, what)} is a {type(t).__name__}, not a tensor: fxpar trains on "
                                 "tensors with the batch on dim 0; convert it with torch.as_tensor(...).")
        return flat

    def unflatten(self, flat):
        """The structured batch of a flat tuple (targets, and anything fxpar appended after them, positional)."""
        n_in = self.n_inputs
        pos = tuple(flat[:self.n_args]) + tuple(flat[n_in:])
        if not self.kwargs:
            return pos
        return pos, dict(zip(self.kwargs, flat[self.n_args:n_in]))


def _structure_text(pos, kw, form) -> str:
    if form == "dict":
        return f"a dict with keys {list(kw)}"
    if form == "tensor":
        return "one tensor" if isinstance(pos[0], torch.Tensor) else f"a {type(pos[0]).__name__}"
    text = f"a tuple of {len(pos)} element(s)"
    return text + (f" and a dict with keys {list(kw)}" if kw else "")


def _fn_name(fn) -> str:
    if fn is None:
        return "None"
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    mod = getattr(fn, "__module__", "") or ""
    return f"{mod}.{name}" if mod.startswith("torch") else name


# Torch's own tracing machinery, relative to torch's directory: the frames between the line that
# asked for a tensor's value and the guard that refused. Skipped to find that line.
_TORCH_MACHINERY = ("fx/", "_subclasses/", "_ops.py", "utils/", "_functorch/", "_prims", "_refs/", "_decomp/",
                    "_meta_registrations.py", "_higher_order_ops/", "_library/", "overrides.py", "_tensor.py",
                    "_dynamo/", "_guards.py", "_logging/", "func/", "__init__.py")

# What a user can do when the value-dependent decision is in library code they cannot edit,
# keyed by (file suffix, function) of the line that decided.
_LIBRARY_ADVICE = {
    ("torch/nn/modules/transformer.py", "_detect_is_causal_mask"):
        "torch compares the attention mask you passed with a causal mask, value by value, to decide whether it is "
        "causal. Tell it instead and the comparison is skipped: pass tgt_is_causal=True with tgt_mask "
        "(nn.Transformer, nn.TransformerDecoder), src_is_causal=True with src_mask (nn.Transformer) or "
        "is_causal=True with mask (nn.TransformerEncoder); pass False where the mask is not causal.",
}
_GENERIC_LIBRARY_ADVICE = (
    "You cannot rewrite library code, but you can often keep it off that path: pass the argument that answers "
    "the question for it (a flag such as is_causal=...), or leave out an optional argument the library checks "
    "(for example an all-ones attention mask). If the check only asks whether a trace is running, report it "
    "to fxpar's issue tracker with this message: fxpar answers such checks while capturing "
    "(fxpar._tracing.TRACING_PREDICATES).")


def _torch_dir() -> str:
    return os.path.dirname(torch.__file__) + os.sep


def _is_library(path: str) -> bool:
    """Installed code the user did not write: torch, site-packages, the standard library, fxpar itself."""
    path = os.path.abspath(path)
    roots = [_torch_dir(), os.path.dirname(os.path.abspath(__file__)) + os.sep,
             sysconfig.get_paths()["stdlib"] + os.sep]
    return (any(path.startswith(r) for r in roots) or f"{os.sep}site-packages{os.sep}" in path
            or f"{os.sep}dist-packages{os.sep}" in path)


def _short(path: str) -> str:
    for marker in (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    return path


def _deciding_frames(e: BaseException):
    """(the frame whose line read a tensor's value, the user's frame that led there or None)."""
    frames = traceback.extract_tb(e.__traceback__)
    torch_dir = _torch_dir()
    i = len(frames) - 1
    while i >= 0 and frames[i].filename.startswith(torch_dir) and \
            frames[i].filename[len(torch_dir):].startswith(_TORCH_MACHINERY):
        i -= 1
    if i < 0:
        return None, None
    site = next((f for f in reversed(frames[:i]) if not _is_library(f.filename)), None)
    return frames[i], site


def explain_trace_error(e: Exception, mod_name: str, tracker: ModuleTracker) -> CaptureError:
    """A CaptureError naming the module being traced and, for a decision on a tensor's value, the line
    that made it and what the user can change: their own code, or the arguments they give library code."""
    where = tracker.stack[-1] if tracker.stack else "(top level)"
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    name = type(e).__name__
    if not ("DataDependent" in name or "data-dependent" in str(e) or "GuardOnDataDependent" in name):
        return CaptureError(f"cannot capture {mod_name}: tracing failed in module '{where}' with {name}: {text}")
    head = (f"cannot capture {mod_name}: module '{where}' has control flow that depends on tensor values "
            f"({name}: {text}). fxpar compiles one graph for every step, so a Python `if` on a tensor's value "
            "cannot be kept.")
    frame, site = _deciding_frames(e)
    if frame is None or not _is_library(frame.filename):
        at = f" The decision is at {frame.filename}:{frame.lineno}: `{frame.line}`." if frame else ""
        return CaptureError(f"{head}{at} Rewrite it with torch.where / torch.cond, or compute the condition "
                            "from shapes only.")
    path = _short(frame.filename)
    advice = next((a for (suffix, fn), a in _LIBRARY_ADVICE.items()
                   if frame.filename.replace(os.sep, "/").endswith(suffix) and frame.name == fn),
                  _GENERIC_LIBRARY_ADVICE)
    called = f", reached from your code at {site.filename}:{site.lineno}: `{site.line}`" if site else ""
    return CaptureError(f"{head} The decision is in library code, {path}:{frame.lineno} in {frame.name}(): "
                        f"`{frame.line}`{called}. {advice}")


def clean_name(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)
