"""Functional optimizers that trace into the training-step graph.

Each reproduces the update rule of its ``torch.optim`` namesake (single-tensor path, the CPU
default) with the learning rate and the step count as graph *inputs*, so that torch LR
schedulers drive the traced program: the runtime keeps a real ``torch.optim`` object only to
hold ``param_groups[0]["lr"]`` for the scheduler.

The step is traced with ``torch._foreach_*`` ops: one node per operation for all parameters.

    SGD   (torch.optim.SGD): d = g + wd·p;  b = d (first step) else μ·b + (1−τ)·d;
          d = d + μ·b (nesterov) else b;  p ← p − lr·d
    Adam  (Kingma & Ba 2015, torch.optim.Adam): g = g + wd·p;  m ← lerp(m, g, 1−β1);
          v ← β2·v + (1−β2)·g²;  p ← p − lr/(1−β1^t) · m / (√v/√(1−β2^t) + ε)
    AdamW (Loshchilov & Hutter 2019): as Adam without the wd term in g, and p ← p·(1 − lr·wd) first.

Other optimizers (and these with options fxpar does not trace: amsgrad, maximize, several
param groups) run eagerly on each rank after the graph returns the synchronised gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["OptimizerSpec", "resolve_optimizer", "TRACEABLE"]


@dataclass
class OptimizerSpec:
    """The user's optimizer choice, and whether fxpar traces its step into the graph."""
    cls: type
    kwargs: dict = field(default_factory=dict)
    traced: bool = False
    why_not_traced: str = ""

    @property
    def name(self) -> str:
        return self.cls.__name__

    @property
    def state_names(self) -> tuple:
        """Per-parameter state tensors the traced step reads and writes."""
        if not self.traced:
            return ()
        if self.cls is torch.optim.SGD:
            return ("momentum_buffer",) if self.kwargs.get("momentum", 0) else ()
        return ("exp_avg", "exp_avg_sq")

    def hyper(self, key, default):
        return self.kwargs.get(key, default)

    def make_torch_optimizer(self, params):
        return self.cls(params, **self.kwargs)

    def init_state(self, p: torch.Tensor) -> list:
        return [torch.zeros_like(p) for _ in self.state_names]

    def step_all(self, params: list, grads: list, states: list, lr, step):
        """One update of every parameter with ``torch._foreach_*`` ops (a few graph nodes, not a few
        per parameter). ``states[j]`` is the list of state ``state_names[j]`` over the parameters;
        ``step`` is the count after increment. Returns (new_params, new_states)."""
        if self.cls is torch.optim.SGD:
            return _sgd(self.kwargs, params, grads, states, lr, step)
        return _adam(self.kwargs, params, grads, states, lr, step, decoupled=self.cls is torch.optim.AdamW)


TRACEABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_UNTRACED_OPTIONS = ("amsgrad", "maximize", "differentiable", "capturable", "fused")


def resolve_optimizer(optimizer) -> OptimizerSpec:
    """Accept ``(cls, kwargs)``, ``cls`` or ``None`` (plain SGD, lr=0.01)."""
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if optimizer is None:
        optimizer = (torch.optim.SGD, {"lr": 0.01})
    if isinstance(optimizer, type):
        optimizer = (optimizer, {})
    if not (isinstance(optimizer, tuple) and len(optimizer) == 2 and isinstance(optimizer[0], type)
            and issubclass(optimizer[0], torch.optim.Optimizer) and isinstance(optimizer[1], dict)):
        raise TypeError(f"optimizer={optimizer!r}: pass (torch.optim.X, {{'lr': ...}}), e.g. "
                        "(torch.optim.AdamW, {'lr': 1e-3}); an optimizer instance cannot be captured because "
                        "its parameters are the model's, not the ranks' shards.")
    cls, kwargs = optimizer
    spec = OptimizerSpec(cls, dict(kwargs))
    if cls not in TRACEABLE:
        spec.why_not_traced = f"{cls.__name__} has no traced step in fxpar (traced: SGD, Adam, AdamW)"
    else:
        bad = [k for k in _UNTRACED_OPTIONS if kwargs.get(k)]
        if bad:
            spec.why_not_traced = f"{cls.__name__} option(s) {bad} are not traced"
        elif kwargs.get("foreach") is not None:
            spec.why_not_traced = ""  # foreach only changes the kernel, not the math
    spec.traced = not spec.why_not_traced
    return spec


def _sgd(kw, params, grads, states, lr, step):
    momentum, dampening = kw.get("momentum", 0.0), kw.get("dampening", 0.0)
    wd, nesterov = kw.get("weight_decay", 0.0), kw.get("nesterov", False)
    F = torch
    d = F._foreach_add(grads, params, alpha=wd) if wd else list(grads)
    new_states = []
    if momentum:
        (bufs,) = states
        first = (step == 1).to(step.dtype)     # torch starts the buffer as a copy of d (float64 coefficients)
        keep = momentum * (1 - first)
        take = first + (1 - dampening) * (1 - first)
        bufs = F._foreach_add(F._foreach_mul(bufs, keep), F._foreach_mul(d, take))
        new_states = [bufs]
        d = F._foreach_add(d, bufs, alpha=momentum) if nesterov else bufs
    return F._foreach_sub(params, F._foreach_mul(d, lr)), new_states


def _adam(kw, params, grads, states, lr, step, decoupled):
    beta1, beta2 = kw.get("betas", (0.9, 0.999))
    eps = kw.get("eps", 1e-8)
    wd = kw.get("weight_decay", 1e-2 if decoupled else 0.0)
    F = torch
    exp_avg, exp_avg_sq = states
    if wd:
        if decoupled:
            params = F._foreach_mul(params, 1 - lr * wd)
        else:
            grads = F._foreach_add(grads, params, alpha=wd)
    exp_avg = F._foreach_lerp(exp_avg, grads, 1 - beta1)
    exp_avg_sq = F._foreach_addcmul(F._foreach_mul(exp_avg_sq, beta2), grads, grads, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    step_size = lr / bias_correction1
    denom = F._foreach_add(F._foreach_div(F._foreach_sqrt(exp_avg_sq), bias_correction2_sqrt), eps)
    update = F._foreach_mul(F._foreach_div(exp_avg, denom), step_size)
    return F._foreach_sub(params, update), [exp_avg, exp_avg_sq]
