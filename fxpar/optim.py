"""Functional optimizers that trace into the training-step graph.

Each reproduces the update rule of its ``torch.optim`` namesake (single-tensor path, the CPU
default) with the learning rate and the step count as graph *inputs*, so that torch LR
schedulers drive the traced program: the runtime keeps a real ``torch.optim`` object only to
hold ``param_groups[0]["lr"]`` for the scheduler.

The step is traced with ``torch._foreach_*`` ops: one node per operation for all parameters, which
every pass can cut, shard and move as element-wise ops. Where the update runs in place on CPU,
``passes.fuse_optimizer`` then runs Adam/AdamW's chain as ATen's fused kernel (``_fused_adamw_``, what
torch.optim's ``fused=True`` calls): :meth:`OptimizerSpec.kernel` decides, ``Plan.optimizer['kernel']``
records it.

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

from .errors import InputError

__all__ = ["OptimizerSpec", "resolve_optimizer", "check_optimizer_params", "TRACEABLE", "ELEMENTWISE"]


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
    def elementwise(self) -> bool:
        """Each element's update reads only that element's parameter, gradient and state (and scalars): stepping
        pieces of a split parameter is stepping the whole one (:data:`ELEMENTWISE`)."""
        return self.cls in ELEMENTWISE

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

    def kernel(self, device_kind: str = "cpu", in_place: bool = True) -> tuple:
        """``("fused" | "foreach", why)``: how the traced update runs. Adam and AdamW run as one fused kernel
        (``passes.fuse_optimizer``) unless ``fused=False`` or ``foreach=True`` asks for the list ops, the device
        is not a CPU (the CUDA fused kernel wants its step tensors on the device: not placed there yet), or the
        schedule keeps old weight versions (the fused kernel is the in-place update)."""
        fused, foreach = self.kwargs.get("fused"), self.kwargs.get("foreach")
        if self.cls not in (torch.optim.Adam, torch.optim.AdamW):
            return "foreach", f"fxpar fuses Adam and AdamW only; {self.name} runs as torch._foreach_* ops"
        if fused is False or foreach:
            return "foreach", f"{'fused=False' if fused is False else 'foreach=True'} asked for torch._foreach_* ops"
        if device_kind != "cpu":
            return "foreach", (f"the fused kernel is used on CPU only so far (device {device_kind!r}: its fused "
                               "kernel wants the step tensors on the device, which fxpar does not place there yet)")
        if not in_place:
            return "foreach", ("this schedule keeps old weight versions (asynchronous): the update is not in place, "
                               "and the fused kernel is the in-place update")
        return "fused", ("fused=True asked" if fused else
                         "fxpar's default for Adam/AdamW on CPU: one pass over memory instead of ten")

    def adam_hyper(self) -> dict:
        """Adam/AdamW's hyperparameters as the traced chain uses them (torch's defaults where not given)."""
        return _adam_hyper(self.kwargs, self.cls is torch.optim.AdamW)

    def step_all(self, params: list, grads: list, states: list, lr, step):
        """One update of every parameter with ``torch._foreach_*`` ops (a few graph nodes, not a few
        per parameter). ``states[j]`` is the list of state ``state_names[j]`` over the parameters;
        ``step`` is the count after increment. Returns (new_params, new_states)."""
        if self.cls is torch.optim.SGD:
            return _sgd(self.kwargs, params, grads, states, lr, step)
        return _adam(self.kwargs, params, grads, states, lr, step, decoupled=self.cls is torch.optim.AdamW)


TRACEABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
# torch.optim's optimizers whose update is elementwise: per element, from its gradient, its own state and scalars
# (the step count, the learning rate). Not here: Adafactor (row and column moments of a matrix), Muon (a matrix
# orthogonalised as a whole), LBFGS (dot products over every parameter), SparseAdam (sparse gradients), and any
# subclass (its step may differ).
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
               torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD, torch.optim.NAdam,
               torch.optim.RAdam)
_UNTRACED_OPTIONS = ("amsgrad", "maximize", "differentiable", "capturable")


def resolve_optimizer(optimizer) -> OptimizerSpec:
    """Accept ``(cls, kwargs)``, ``cls`` or ``None`` (plain SGD, lr=0.01). Checks the class and its settings
    here, by building it over one dummy parameter, so a mistake is named before any rank starts."""
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if optimizer is None:
        optimizer = (torch.optim.SGD, {"lr": 0.01})
    if isinstance(optimizer, type):
        optimizer = (optimizer, {})
    if isinstance(optimizer, list) and len(optimizer) == 2:
        optimizer = tuple(optimizer)
    _check_optimizer(optimizer)
    cls, kwargs = optimizer
    spec = OptimizerSpec(cls, dict(kwargs))
    if cls not in TRACEABLE:
        spec.why_not_traced = f"{cls.__name__} has no traced step in fxpar (traced: SGD, Adam, AdamW)"
    else:
        bad = [k for k in _UNTRACED_OPTIONS if kwargs.get(k)]
        if bad:
            spec.why_not_traced = f"{cls.__name__} option(s) {bad} are not traced"
        elif kwargs.get("foreach") is not None or kwargs.get("fused") is not None:
            spec.why_not_traced = ""  # foreach / fused only change the kernel, not the math (OptimizerSpec.kernel)
    spec.traced = not spec.why_not_traced
    return spec


def check_optimizer_params(spec: OptimizerSpec, shapes: dict) -> None:
    """An untraced optimizer takes every trainable parameter (``shapes``: key -> shape) as torch builds it, checked
    here on meta tensors, so a parameter it refuses (``torch.optim.Muon`` takes 2-D parameters only) is named before
    any rank starts."""
    if spec.traced:
        return
    for key, shape in shapes.items():
        try:
            spec.cls([torch.empty(tuple(shape), device="meta", requires_grad=True)], **spec.kwargs)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputError(f"optimizer=({spec.name}, ...) refuses parameter {key!r} of shape {tuple(shape)}: {e}. "
                             f"Freeze it (requires_grad=False), or choose an optimizer that takes it"
                             + (" (Muon updates 2-D weight matrices: train biases, norms and embeddings with "
                                "another optimizer, which fxpar's one-optimizer programs do not combine yet)"
                                if spec.cls is getattr(torch.optim, "Muon", None) else "") + ".") from None


def _check_optimizer(optimizer) -> None:
    example = "pass (torch.optim.X, {'lr': ...}), e.g. (torch.optim.AdamW, {'lr': 1e-3})"
    if isinstance(optimizer, torch.optim.Optimizer) or (isinstance(optimizer, tuple) and optimizer
                                                        and isinstance(optimizer[0], torch.optim.Optimizer)):
        inst = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer[0]
        name = type(inst).__name__
        settings = {k: v for k, v in inst.defaults.items() if k in ("lr", "momentum", "weight_decay", "betas", "eps")}
        raise InputError(f"optimizer={name}(model.parameters(), ...) is an optimizer instance: it holds the model's own "
                         "parameters, while each rank builds its optimizer over its own part of them. Give the class and "
                         f"its settings instead: {example}; here ({_qual(type(inst))}, {settings}).")
    if isinstance(optimizer, str):
        near = [n for n in dir(torch.optim) if n.lower() == optimizer.lower()]
        guess = near[0] if near else "AdamW"
        raise InputError(f"optimizer={optimizer!r} is a name; fxpar takes the class and its settings: "
                         f"(torch.optim.{guess}, {{'lr': 1e-3}}).")
    if not (isinstance(optimizer, tuple) and len(optimizer) == 2):
        raise InputError(f"optimizer={optimizer!r}: {example}; an optimizer instance cannot be captured because "
                         "its parameters are the model's, not the ranks' shards.")
    cls, kwargs = optimizer
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        what = _qual(cls) if isinstance(cls, type) or callable(cls) else repr(cls)
        raise InputError(f"optimizer=({what}, ...): {what} is not a torch.optim.Optimizer class. Use one from torch.optim "
                         "(SGD, Adam and AdamW are traced into the step; others run on each rank as torch runs them), "
                         "or your own subclass of torch.optim.Optimizer.")
    if not isinstance(kwargs, dict):
        hint = f" -- e.g. ({cls.__name__}, {{'lr': {kwargs!r}}})" if isinstance(kwargs, (int, float)) else ""
        raise InputError(f"optimizer=({cls.__name__}, {kwargs!r}): the settings must be a dict of {cls.__name__}'s "
                         f"keyword arguments{hint}.")
    lr = kwargs.get("lr", 0.0)
    if isinstance(lr, bool) or not isinstance(lr, (int, float, torch.Tensor)):
        raise InputError(f"optimizer=({cls.__name__}, {{'lr': {lr!r}, ...}}): lr must be a number (a float such as "
                         f"1e-3), not a {type(lr).__name__}.")
    try:
        cls([torch.zeros(1, 1, requires_grad=True)], **kwargs)   # 2-D: Muon takes matrices only
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        import inspect
        try:
            known = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params")]
        except (TypeError, ValueError):
            known = []
        unknown = [k for k in kwargs if known and k not in known]
        fix = (f"{cls.__name__} has no setting {unknown[0]!r}: use one of its settings ({', '.join(known)})"
               if unknown else "fix the setting it names")
        raise InputError(f"optimizer=({cls.__name__}, {kwargs!r}): {_qual(cls)} refuses these settings: {e}. "
                         f"{fix[0].upper() + fix[1:]}.") from None


def _qual(cls) -> str:
    mod = getattr(cls, "__module__", "") or ""
    name = getattr(cls, "__qualname__", None) or getattr(cls, "__name__", None) or repr(cls)
    if mod.startswith("torch.optim"):
        return f"torch.optim.{name}"
    return f"{mod}.{name}" if mod and mod != "builtins" else name


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


def _adam_hyper(kw, decoupled) -> dict:
    b1, b2 = kw.get("betas", (0.9, 0.999))
    return {"beta1": float(b1), "beta2": float(b2), "eps": float(kw.get("eps", 1e-8)),
            "weight_decay": float(kw.get("weight_decay", 1e-2 if decoupled else 0.0))}


def _adam(kw, params, grads, states, lr, step, decoupled):
    h = _adam_hyper(kw, decoupled)        # the same figures passes.fuse_optimizer checks the traced chain against
    beta1, beta2, eps, wd = h["beta1"], h["beta2"], h["eps"], h["weight_decay"]
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

