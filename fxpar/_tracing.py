"""Tracing helpers shared by the two capture front-ends: the whole training step
(:mod:`fxpar.capture`) and the forward + loss a pipeline cuts into stages
(:mod:`fxpar.pipeline.trace`). Internal to fxpar."""
from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback

from . import meta as M
from .errors import CaptureError

__all__ = ["ModuleTracker", "batch_parts", "explain_trace_error", "clean_name"]


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


def batch_parts(batch, loss_fn):
    batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    for i, b in enumerate(batch):
        if not isinstance(b, torch.Tensor):
            raise CaptureError(f"example_inputs[{i}] is a {type(b).__name__}; fxpar needs a tuple of tensors "
                               "(inputs..., target), each with the batch on dim 0.")
    if loss_fn is not None:
        if len(batch) < 2:
            raise CaptureError("with loss_fn given, example_inputs must be (inputs..., target); got one tensor. "
                               "Pass loss_fn=None if the model itself returns the loss.")
        return batch[:-1], batch[-1:]
    return batch, ()


def explain_trace_error(e: Exception, mod_name: str, tracker: ModuleTracker) -> CaptureError:
    where = tracker.stack[-1] if tracker.stack else "(top level)"
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    name = type(e).__name__
    if "DataDependent" in name or "data-dependent" in str(e) or "GuardOnDataDependent" in name:
        return CaptureError(
            f"cannot capture {mod_name}: module '{where}' has control flow that depends on tensor values "
            f"({name}: {text}). fxpar compiles one graph for every step, so a Python `if` on a tensor's value "
            "cannot be kept. Rewrite it with torch.where / torch.cond, or compute the condition from shapes only.")
    return CaptureError(f"cannot capture {mod_name}: tracing failed in module '{where}' with {name}: {text}")


def clean_name(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)
