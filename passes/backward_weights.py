"""Weights a backward reads at its own time: the forward stops saving its weights, the backward takes them as inputs.

A stage's forward graph ``F`` saves, for its backward ``B``, the weights (or views of them) that the input gradients
need (``dX = dY W``). An asynchronous schedule that stashes no weights (Pipelined Backpropagation, PipeMare) runs
the backward on whatever weights the stage holds when the backward runs, so :func:`read_weights_at_backward`
rewrites the pair: every saved output of ``F`` that is a parameter or a chain of views of one leaves ``F``'s
outputs, and ``B`` gets the parameter as an input of role :attr:`~fxpar.roles.Role.BACKWARD_PARAM` (one per
parameter) and repeats the views itself. Before and after, for ``y = x @ W.T``::

    F(W, x):  t = aten.t(W); y = aten.mm(x, t)        -> outputs (saved x, saved t, act y)
    B(dy, x, t):  dx = aten.mm(dy, aten.t(t)) ...

    F(W, x):  t = aten.t(W); y = aten.mm(x, t)        -> outputs (saved x, act y)
    B(dy, x, W'):  t = aten.t(W'); dx = aten.mm(dy, aten.t(t)) ...     W': ("backward_param", key)

``forward_role``: the role ``F``'s parameter inputs get instead of ``param`` (a feature that supplies the weights a
forward computes with: linear weight prediction); None leaves them. The runtime then holds no weights for a
microbatch between its forward and its backward: the saved tensors are activations only.
"""
from __future__ import annotations

import dataclasses

import torch

from fxpar import meta as M
from fxpar.roles import GraphKind, Role

from .graph_utils import is_alias

__all__ = ["read_weights_at_backward", "weight_views_saved"]


def weight_views_saved(sg) -> dict:
    """``{saved key: (parameter key, [view nodes from the parameter out])}`` for the saved outputs of the forward
    graph ``sg`` that are a parameter or views of one."""
    phs = [n for n in sg.gm.graph.nodes if n.op == "placeholder"]
    role_of = dict(zip(phs, sg.inputs))
    out = next(n for n in sg.gm.graph.nodes if n.op == "output")
    found = {}
    for node, (role, key) in zip(out.args[0], sg.outputs):
        if role != Role.SAVED:
            continue
        chain, x = [], node
        while isinstance(x, torch.fx.Node) and is_alias(x) and x.args and isinstance(x.args[0], torch.fx.Node):
            chain.append(x)
            x = x.args[0]
        if x in role_of and role_of[x][0] in (Role.PARAM, Role.FORWARD_PARAM):
            found[key] = (role_of[x][1], chain[::-1])
    return found


def read_weights_at_backward(parts: dict, forward_role: Role | None = None) -> dict:
    """``parts`` (``{kind: SplitGraph}``, a stage's cut graphs) with ``F`` saving no weights and ``B`` reading them as
    ``BACKWARD_PARAM`` inputs; the other graphs unchanged. A stage whose forward saves no weights keeps its pair."""
    fwd, bwd = parts[GraphKind.F], parts[GraphKind.B]
    moved = weight_views_saved(fwd)
    out = dict(parts)
    out[GraphKind.F] = _forward_without(fwd, set(moved), forward_role)
    out[GraphKind.B] = _backward_reading(bwd, moved) if moved else bwd
    return out


def _forward_without(sg, keys: set, forward_role):
    gm = sg.gm
    out = next(n for n in gm.graph.nodes if n.op == "output")
    keep = [j for j, (role, key) in enumerate(sg.outputs) if not (role == Role.SAVED and key in keys)]
    dropped = [out.args[0][j] for j in range(len(sg.outputs)) if j not in keep]
    out.args = (tuple(out.args[0][j] for j in keep),)
    for x in dropped:                  # views only the saved output read: gone with it
        while isinstance(x, torch.fx.Node) and is_alias(x) and not x.users:
            nxt = x.args[0]
            gm.graph.erase_node(x)
            x = nxt
    inputs = list(sg.inputs)
    if forward_role is not None:
        inputs = [(forward_role if role == Role.PARAM else role, key) for role, key in inputs]
        for ph, (role, _) in zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs):
            ph.meta[M.ROLE.name] = role
    gm.recompile()
    return dataclasses.replace(sg, gm=gm, inputs=inputs, outputs=[sg.outputs[j] for j in keep])


def _backward_reading(sg, moved: dict):
    gm = sg.gm
    g = gm.graph
    phs = [n for n in g.nodes if n.op == "placeholder"]
    first_body = phs[-1].next                    # the views go after every placeholder (and any constant)
    inputs, made = [], {}
    for ph, (role, key) in zip(phs, sg.inputs):
        if role != Role.SAVED or key not in moved:
            inputs.append((role, key))
            continue
        pkey, chain = moved[key]
        if pkey not in made:
            with g.inserting_before(ph):
                new = g.placeholder(f"bwd_{pkey.replace('.', '_')}")
            new.meta = {M.ROLE.name: Role.BACKWARD_PARAM}
            made[pkey] = new
            inputs.append((Role.BACKWARD_PARAM, pkey))
        x = made[pkey]
        with g.inserting_before(first_body):
            for v in chain:                              # the forward's views, on the weights the backward reads
                x = g.call_function(v.target, (x, *v.args[1:]), dict(v.kwargs))
                x.meta = {k: val for k, val in v.meta.items() if k in ("val", "tensor_meta")}
        ph.replace_all_uses_with(x)
        g.erase_node(ph)
    gm.recompile()
    return dataclasses.replace(sg, gm=gm, inputs=inputs)
