"""Capture: model + loss + optimizer → one functional training-step graph at aten level.

The step is ``make_fx`` (fake tensors: nothing is computed, no memory is used) over
``functionalize(step)``, where ``step`` runs the model through ``torch.func.functional_call``,
takes ``torch.func.grad_and_value`` of the loss and, for SGD/Adam/AdamW, the optimizer update
(:mod:`fxpar.optim`). Parameters, buffers, optimizer state, the learning rate, the step count
and the batch are all placeholders; the new values are outputs::

    def forward(self, wte_weight, ..., buf_bn_running_mean, ..., exp_avg_wte_weight, ..., lr, step, input0, target):
        embedding = aten.embedding(wte_weight, input0)               # fxpar_phase=forward, fxpar_module=wte
        ...
        embedding_dense_backward = ...                               # fxpar_phase=backward
        add_12 = ...                                                 # fxpar_phase=optimizer
        return (loss, new params..., new buffers..., new optimizer state..., grads...)

Tied parameters (an LM head sharing the embedding) are one placeholder: parameters are
de-duplicated by identity and ``functional_call`` re-ties them. Module paths come from
forward hooks active while tracing; backward nodes inherit the module of the forward node
they differentiate (autograd's sequence number).

Why not ``torch.export`` first: fake-mode ``make_fx`` raises the same data-dependent-control-flow
errors export does (we re-raise them naming the module), captures what export captures
(``nn.TransformerEncoderLayer``, masks built from ``x.shape``), and is 2–3× faster.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from . import meta as M
from .errors import CaptureError
from ._tracing import ModuleTracker, batch_parts, clean_name, explain_trace_error
from .optim import OptimizerSpec

__all__ = ["StepSignature", "CapturedStep", "capture_training_step"]


@dataclass
class StepSignature:
    """What each placeholder and each output of a step graph is: ``(role, key)`` pairs.

    Roles of inputs: param, buffer, opt_state, lr, step, input, target. Roles of outputs: loss,
    new_param, new_buffer, new_opt_state, grad. ``key`` is the model's state-dict key (for
    opt_state: ``"exp_avg:blocks.0.fc.weight"``) or the batch position.
    """
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)

    def index(self, role: str, key: str | None = None, outputs: bool = False) -> list:
        seq = self.outputs if outputs else self.inputs
        return [i for i, (r, k) in enumerate(seq) if r == role and (key is None or k == key)]

    def keys(self, role: str, outputs: bool = False) -> list:
        seq = self.outputs if outputs else self.inputs
        return [k for r, k in seq if r == role]

    def copy(self) -> "StepSignature":
        return StepSignature(list(self.inputs), list(self.outputs))


@dataclass
class CapturedStep:
    gm: torch.fx.GraphModule
    signature: StepSignature
    param_names: list            # unique parameters, placeholder order
    buffer_names: list
    aliases: dict                # tied alias key -> canonical key (e.g. head.weight -> wte.weight)
    optimizer: OptimizerSpec
    model_class: str
    trace_seconds: float
    param_shapes: dict = field(default_factory=dict)
    param_dtypes: dict = field(default_factory=dict)


def capture_training_step(model: torch.nn.Module, batch, loss_fn, optimizer: OptimizerSpec) -> CapturedStep:
    """Trace one training step of ``model`` on ``batch`` (the batch one rank sees)."""
    t0 = time.perf_counter()
    inputs, target = batch_parts(batch, loss_fn)
    params = dict(model.named_parameters())               # de-duplicated by identity: tied weights once
    trainable = {k: v for k, v in params.items() if v.requires_grad}
    frozen = {k: v for k, v in params.items() if not v.requires_grad}
    buffers = {**frozen, **dict(model.named_buffers())}
    ids = {id(v): k for k, v in params.items()}
    aliases = {k: ids[id(v)] for k, v in model.named_parameters(remove_duplicate=False) if k not in params}
    pnames, bnames = list(trainable), list(buffers)
    if not pnames:
        raise CaptureError(f"{type(model).__name__} has no parameter with requires_grad=True: nothing to train.")
    snames = [f"{s}:{p}" for p in pnames for s in optimizer.state_names]
    n_p, n_b, n_s = len(pnames), len(bnames), len(snames)
    tracker = ModuleTracker(model)
    mod_name = type(model).__name__

    def step(*flat):
        p = dict(zip(pnames, flat[:n_p]))
        b = {k: v.clone() for k, v in zip(bnames, flat[n_p:n_p + n_b])}   # new buffer values are outputs
        state = flat[n_p + n_b:n_p + n_b + n_s]
        lr, step_count = flat[n_p + n_b + n_s], flat[n_p + n_b + n_s + 1]
        data = flat[n_p + n_b + n_s + 2:]
        x, y = data[:len(inputs)], data[len(inputs):]

        def loss_of(p, b):
            tracker.set("forward", "")
            out = torch.func.functional_call(model, (p, b), tuple(x))
            loss = loss_fn(out, *y) if loss_fn is not None else out
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise CaptureError(
                    f"the loss of {mod_name} is not a scalar: got {shape}. "
                    + ("Make loss_fn reduce to one number (e.g. reduction='mean')." if loss_fn is not None
                       else "With loss_fn=None the model must return a scalar loss; pass loss_fn= instead."))
            tracker.set("backward", "")
            return loss

        grads, loss = torch.func.grad_and_value(loss_of)(p, b)
        tracker.set("optimizer", "")
        if not optimizer.traced:
            return (loss, *b.values(), *(grads[k] for k in pnames))
        k = len(optimizer.state_names)
        by_state = [[state[i * k + j] for i in range(n_p)] for j in range(k)]
        new_p, new_by_state = optimizer.step_all([p[n] for n in pnames], [grads[n] for n in pnames], by_state,
                                                 lr, step_count)
        new_s = [new_by_state[j][i] for i in range(n_p) for j in range(k)]
        return (loss, *new_p, *b.values(), *new_s, *(grads[k_] for k_ in pnames))

    state_vals = [torch.empty_like(trainable[n.split(":", 1)[1]]) for n in snames]
    flat = [*trainable.values(), *buffers.values(), *state_vals, torch.zeros((), dtype=torch.float64),
            torch.ones((), dtype=torch.float64), *inputs, *target]
    seen = set()
    for i, t in enumerate(flat):  # make_fx maps one tensor object to one placeholder: keep them distinct
        if id(t) in seen:
            flat[i] = t.detach().clone()
        seen.add(id(flat[i]))
    try:
        with fx_traceback.preserve_node_meta(), tracker:
            gm = make_fx(torch.func.functionalize(step, remove="mutations"), tracing_mode="fake")(*flat)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the user's module named
        raise explain_trace_error(e, mod_name, tracker) from e

    sig = StepSignature()
    sig.inputs = ([("param", k) for k in pnames] + [("buffer", k) for k in bnames] + [("opt_state", k) for k in snames]
                  + [("lr", "lr"), ("step", "step")] + [("input", str(i)) for i in range(len(inputs))]
                  + [("target", str(i)) for i in range(len(target))])
    sig.outputs = [("loss", "loss")]
    if optimizer.traced:
        sig.outputs += [("new_param", k) for k in pnames]
    sig.outputs += [("new_buffer", k) for k in bnames]
    if optimizer.traced:
        sig.outputs += [("new_opt_state", k) for k in snames]
    sig.outputs += [("grad", k) for k in pnames]
    _annotate(gm, sig)
    gm.meta["fxpar_signature"] = sig
    return CapturedStep(gm, sig, pnames, bnames, aliases, optimizer, mod_name, time.perf_counter() - t0,
                        {k: tuple(v.shape) for k, v in trainable.items()}, {k: v.dtype for k, v in trainable.items()})


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
    prefix = {"param": "", "buffer": "buf_", "input": "input", "target": "target", "lr": "", "step": ""}
    for node, (role, key) in zip(placeholders, sig.inputs):
        if role == "opt_state":
            s, p = key.split(":", 1)
            name = f"{s}_{clean_name(p)}"
        elif role in ("input", "target"):
            name = f"{prefix[role]}{key}"
        else:
            name = prefix[role] + clean_name(key)
        node._rename(name)
        node.target = node.name
        M.set_meta(node, M.ROLE, role)
        if role in ("param", "buffer", "opt_state"):
            M.set_meta(node, M.PARAM, key)
    param_module = {n: M.get(n, M.PARAM).rsplit(".", 1)[0] if "." in M.get(n, M.PARAM) else ""
                    for n in placeholders if M.get(n, M.ROLE) == "param"}
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
        if role == "grad" and isinstance(node, torch.fx.Node):
            M.set_meta(node, M.GRAD_OF, key)
    g.lint()
    gm.recompile()
