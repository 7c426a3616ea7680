"""Backward's node order by data flow alone: the graph analysis behind ``passes.grad_order``.

The planner (``fxpar.features.bytescheduler.plan_comm_schedule``) simulates candidate orders with these functions and the
``grad_order`` pass carries the chosen one out; both read the same definitions here.
"""
from __future__ import annotations

from . import meta as M

__all__ = ["backward_region", "reordered_backward", "why_not_reorder"]


def backward_region(gm) -> list:
    """The nodes from backward's first node up to the optimizer's first (or the output), in graph order."""
    out, inside = [], False
    for n in gm.graph.nodes:
        phase = M.get(n, M.PHASE)
        if n.op == "output" or phase == "optimizer":
            break
        inside = inside or phase == "backward"
        if inside:
            out.append(n)
    return out


def why_not_reorder(gm) -> str | None:
    """Why backward of ``gm`` cannot be reordered by data flow alone (None: it can)."""
    region = backward_region(gm)
    if not region:
        return "the graph has no backward"
    for n in region:
        if n.op != "call_function":
            return f"node {n.name} ({n.op}) inside backward"
        if M.get(n, M.PHASE) == "forward":
            return f"forward node {n.name} inside backward (recompute or offload placed it there)"
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return f"node {n.name} ({n.target}) writes in place: its order is not data flow alone"
    return None


def reordered_backward(gm, keys: list) -> list:
    """Backward's nodes with the gradients of ``keys`` made in that order: for each, the nodes it still needs
    (in their original order), then it; then every node left, in its original order. A topological order."""
    region = backward_region(gm)
    idx = {n: i for i, n in enumerate(region)}
    grad = {}
    for n in region:
        k = M.get(n, M.GRAD_OF)
        if k is not None:
            grad[k] = n                      # the last node tagged with the key is its gradient
    out, done = [], set()
    for k in keys:
        if k not in grad:
            continue
        need, stack = set(), [grad[k]]
        while stack:
            x = stack.pop()
            if x in need or x in done or x not in idx:
                continue
            need.add(x)
            stack.extend(x.all_input_nodes)
        for x in sorted(need, key=idx.__getitem__):
            out.append(x)
            done.add(x)
    out += [n for n in region if n not in done]
    return out
