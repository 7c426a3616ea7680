"""Trace a model's forward + loss (no backward, no optimizer) at aten level, for stage cutting.

One microbatch, fake tensors (nothing is computed). Placeholders, in order: trainable
parameters (tied ones once), buffers (and frozen parameters), the inputs, the target; the one
output is the scalar loss. Every ``call_function`` node carries ``fxpar_module`` (the module that
ran it), written by the same forward hooks :mod:`fxpar.capture` uses::

    def forward(self, wte_weight, ..., input0, target0):
        embedding = aten.embedding(wte_weight, input0)     # fxpar_module=wte
        ...
        return nll_loss                                     # fxpar_module=''
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from .. import meta as M
from .._tracing import ModuleTracker, batch_parts, clean_name, explain_trace_error
from ..errors import CaptureError, StrategyError

__all__ = ["ForwardTrace", "trace_forward"]


@dataclass
class ForwardTrace:
    gm: torch.fx.GraphModule
    roles: dict                      # placeholder name -> (role, key): param/buffer/input/target
    param_names: list                # trainable, de-duplicated
    buffer_names: list
    aliases: dict                    # tied alias key -> canonical key
    module_types: dict = field(default_factory=dict)   # module path -> class name


def trace_forward(model: torch.nn.Module, batch, loss_fn) -> ForwardTrace:
    """``loss_fn(model(*inputs), target)`` on one microbatch, as an aten graph of fake tensors."""
    inputs, target = batch_parts(batch, loss_fn)
    params = dict(model.named_parameters())
    trainable = {k: v for k, v in params.items() if v.requires_grad}
    buffers = {**{k: v for k, v in params.items() if not v.requires_grad}, **dict(model.named_buffers())}
    ids = {id(v): k for k, v in params.items()}
    aliases = {k: ids[id(v)] for k, v in model.named_parameters(remove_duplicate=False) if k not in params}
    pnames, bnames = list(trainable), list(buffers)
    if not pnames:
        raise CaptureError(f"{type(model).__name__} has no parameter with requires_grad=True: nothing to train.")
    n_p, n_b = len(pnames), len(bnames)
    tracker = ModuleTracker(model)

    def fwd(*flat):
        p = dict(zip(pnames, flat[:n_p]))
        b = dict(zip(bnames, flat[n_p:n_p + n_b]))
        data = flat[n_p + n_b:]
        x, y = data[:len(inputs)], data[len(inputs):]
        tracker.set("forward", "")
        out = torch.func.functional_call(model, (p, b), tuple(x))
        loss = loss_fn(out, *y) if loss_fn is not None else out
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise CaptureError(f"the loss of {type(model).__name__} is not a scalar; make loss_fn reduce to one "
                               "number (reduction='mean')")
        return loss

    flat = [*trainable.values(), *buffers.values(), *inputs, *target]
    seen = set()
    for i, t in enumerate(flat):
        if id(t) in seen:
            flat[i] = t.detach().clone()
        seen.add(id(flat[i]))
    try:
        with fx_traceback.preserve_node_meta(), tracker:
            gm = make_fx(torch.func.functionalize(fwd, remove="mutations"), tracing_mode="fake")(*flat)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised naming the user's module
        raise explain_trace_error(e, type(model).__name__, tracker) from e

    roles = [("param", k) for k in pnames] + [("buffer", k) for k in bnames] + \
            [("input", str(i)) for i in range(len(inputs))] + [("target", str(i)) for i in range(len(target))]
    by_name = {}
    for node, (role, key) in zip(gm.graph.find_nodes(op="placeholder"), roles):
        node._rename({"param": "", "buffer": "buf_"}.get(role, role) + clean_name(key))
        node.target = node.name
        by_name[node.name] = (role, key)
    for n in gm.graph.nodes:
        custom = n.meta.pop("custom", None)
        if n.op == "call_function":
            M.set_meta(n, M.MODULE, (custom or {}).get(M.MODULE.name, ""))
            if n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder":
                raise StrategyError(
                    f"{type(model).__name__} writes to buffer {by_name[n.args[0].name][1]!r} during forward (e.g. "
                    "BatchNorm running statistics); pipeline stages do not carry buffer updates yet. Use a norm "
                    "without running statistics (LayerNorm) or put the model in eval mode for those modules.")
    gm.recompile()
    types = {name: type(mod).__name__ for name, mod in model.named_modules()}
    return ForwardTrace(gm, by_name, pnames, bnames, aliases, types)
