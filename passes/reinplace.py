"""Run the traced optimizer in place: ``_foreach_op(xs, ...)`` → ``_foreach_op_(xs, ...)`` where
nothing reads the old ``xs`` afterwards.

Capture traces the optimizer functionally (new parameter and moment tensors every step), which
costs a write of fresh memory per op where torch.optim updates in place. This pass rewrites an
out-of-place foreach op to its in-place form when every tensor of its first list is either a
parameter / optimizer-state input (owned by the runtime, which takes the outputs back as the new
state) or a fresh result of an earlier optimizer foreach op, and no node after it reads that
tensor or any view of it. The values are identical; only where they are written changes.
Before / after (AdamW, one parameter shown)::

    _foreach_lerp = aten._foreach_lerp.Scalar([exp_avg_w], [grad_w], 0.1)
    getitem_7 = _foreach_lerp[0]
    ... return (..., getitem_7, ...)

    _foreach_lerp_ = aten._foreach_lerp_.Scalar([exp_avg_w], [grad_w], 0.1)   # mutates exp_avg_w
    ... return (..., exp_avg_w, ...)
"""
from __future__ import annotations

import copy
import operator

import torch

from fxpar import meta as M
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.roles import Role

from .fuse_optimizer import fuse_adam
from .graph_utils import OWNED_ROLES, last_read

__all__ = ["ReinplaceOptimizer", "reinplace_step_graph"]



def _inplace_variant(target):
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    name = target._schema.name.split("::")[-1]
    if not name.startswith("_foreach_") or name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name + "_", None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


class ReinplaceOptimizer(Pass):
    """``optimizer``: ``Plan.optimizer`` where no plan is at hand (``ctx.plan``'s otherwise); where its ``kernel``
    is ``"fused"``, Adam/AdamW's chains become one fused in-place call first (``passes.fuse_optimizer``)."""
    name = "reinplace_optimizer"

    def __init__(self, optimizer: dict | None = None):
        self.optimizer = optimizer

    def run(self, gm, ctx: PassContext) -> PassResult:
        g = gm.graph
        cfg = self.optimizer if self.optimizer is not None else getattr(ctx.plan, "optimizer", None) or {}
        fused = 0
        if cfg.get("kernel") == "fused":
            fused, notes = fuse_adam(gm, cfg)
            if fused:
                ctx.notes.append(f"reinplace_optimizer: {fused} {cfg.get('name')} update(s) run as one fused in-place "
                                 "kernel each (passes.fuse_optimizer)")
            ctx.notes += [f"reinplace_optimizer: {cfg.get('name')} update {w}" for w in notes]
        nodes = list(g.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        out = g.find_nodes(op="output")[0]
        fresh = set()          # getitems of optimizer foreach results (no other alias exists)
        rewritten = 0
        for n in nodes:
            new_target = _inplace_variant(n.target) if n.op == "call_function" else None
            if new_target is None or M.get(n, M.PHASE) != "optimizer" or not isinstance(n.args[0], (list, tuple)):
                if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) \
                        and _inplace_variant(n.args[0].target) is not None:
                    fresh.add(n)
                continue
            xs = list(n.args[0])
            others = [a for a in list(n.args[1:]) + list(n.kwargs.values())]
            flat_others = {y for a in others for y in (a if isinstance(a, (list, tuple)) else [a])}
            ok = all(
                isinstance(x, torch.fx.Node) and x not in flat_others
                and ((x.op == "placeholder" and M.get(x, M.ROLE) in OWNED_ROLES) or x in fresh)
                and last_read(x, pos) <= pos[n] and x not in out.args[0]
                for x in xs)
            if not ok or len(set(xs)) != len(xs):
                if n.op == "call_function":
                    fresh.update(u for u in n.users if u.target is operator.getitem)
                continue
            # every getitem(n, i) becomes xs[i], which the in-place op has updated
            for u in list(n.users):
                if u.target is not operator.getitem:
                    break
            else:
                with g.inserting_before(n):
                    m = g.call_function(new_target, n.args, n.kwargs)
                m.meta.update({k: v for k, v in n.meta.items() if k in (M.PHASE.name, M.MODULE.name)})
                m.meta["val"] = None            # the in-place foreach ops return nothing
                for u in list(n.users):
                    u.replace_all_uses_with(xs[u.args[1]])
                    g.erase_node(u)
                g.erase_node(n)
                nodes = list(g.nodes)
                pos = {x: i for i, x in enumerate(nodes)}
                rewritten += 1
        if rewritten:
            ctx.notes.append(f"reinplace_optimizer: {rewritten} optimizer foreach op(s) run in place on parameter/state buffers")
        return PassResult(gm, rewritten + fused > 0, {"rewritten": rewritten, "fused": fused})


def reinplace_step_graph(gm: torch.fx.GraphModule, n_params: int, n_state: int,
                         optimizer: dict | None = None) -> torch.fx.GraphModule:
    """A pipeline stage's optimizer graph ``(params, grads, states, lr, step) -> (new params, new states)``
    (``fxpar.pipeline.autodiff.trace_step``), rewritten in place: its outputs are then its parameter and
    state inputs, updated. ``n_state``: state tensors per parameter. Returns a new GraphModule."""
    gm = copy.deepcopy(gm)
    roles = ([Role.PARAM] * n_params + [Role.GRAD] * n_params + [Role.OPT_STATE] * (n_params * n_state)
             + [Role.LR, Role.STEP])
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(roles):
        raise ValueError(f"step graph has {len(phs)} inputs; expected {len(roles)} for {n_params} parameters "
                         f"with {n_state} state tensors each")
    for n, role in zip(phs, roles):
        M.set_meta(n, M.ROLE, role)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            M.set_meta(n, M.PHASE, "optimizer")
    ReinplaceOptimizer(optimizer or {}).run(gm, PassContext(rank=0, plan=None, mesh=None, cluster=None))
    gm.graph.lint()
    gm.recompile()
    return gm
