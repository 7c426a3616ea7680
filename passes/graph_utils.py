"""Graph helpers that several passes share: views and reads of a node, the gradient all-reduce chains
data parallelism makes, and the order of a graph's gathers and reduce-scatters.

Every name here is public; a pass imports what it needs from this module, never a private helper of another pass.
"""
from __future__ import annotations

import operator

import torch

from fxpar import meta as M
from fxpar.collectives import C10D
from fxpar.roles import Role

__all__ = ["OWNED_ROLES", "grad_sync_chains", "is_alias", "last_read", "one_collective_in_flight"]

aten = torch.ops.aten

# roles of placeholders whose tensors the runtime owns and takes back as the new state (updated in place)
OWNED_ROLES = (Role.PARAM, Role.OPT_STATE)


def is_alias(n) -> bool:
    """Whether ``n`` is a view of one of its inputs (an op whose schema says a result aliases an input without
    writing it); ``getitem`` of a tuple is not."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return False
    schema = getattr(n.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def last_read(node, pos, skip=frozenset()) -> int:
    """Position of the last node that reads ``node`` or a view of it, other than the nodes of ``skip``. Making a
    view reads nothing: a view nobody reads (a dead ``detach`` left where a pass moved the nodes around it) does
    not count."""
    last, stack, seen = -1, [node], set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        for u in x.users:
            if u in skip:
                continue
            if is_alias(u):
                stack.append(u)
            else:
                last = max(last, pos[u])
    return last


def grad_sync_chains(gm) -> dict:
    """param key -> (raw grad, all_reduce, wait, averaged grad) as made by data_parallel.
    The averaged grad is a ``div`` of the wait, or the wait itself when backward was pre-scaled."""
    out = {}
    for avg in gm.graph.nodes:
        key = M.get(avg, M.GRAD_OF)
        if key is None or avg.op != "call_function":
            continue
        if avg.target is aten.div.Tensor:
            w = avg.args[0]
        elif avg.target is C10D.wait_tensor.default:
            w = avg
        else:
            continue
        if w.op != "call_function" or w.target is not C10D.wait_tensor.default:
            continue
        ar = w.args[0]
        out[key] = (ar.args[0], ar, w, avg)
    return out


def one_collective_in_flight(g) -> None:
    """At most one gather or reduce-scatter of a graph in flight at a time: each waits for the one before it.
    With a gather started before the previous one was waited on, our runs (torch 2.13, gloo, CPU) hung once in a
    40-run loop and aborted with heap corruption in 3 of about 12 test-file runs; one at a time, 270 runs and
    the test file passed every time. A minimal two-collective script did not reproduce it, so the cause (gloo's
    all-gather/reduce-scatter on two worker threads) is a guess. Compute still overlaps every collective."""
    kinds = (C10D.all_gather_into_tensor.default, C10D.reduce_scatter_tensor.default)
    colls = [x for x in g.nodes if x.op == "call_function" and x.target in kinds]
    order = {x: i for i, x in enumerate(g.nodes)}
    for prev, cur in zip(colls, colls[1:]):
        w = next(iter(prev.users))
        if order[w] > order[cur]:
            cur.prepend(w)
            if M.get(cur, M.REDUCE_GRAD) == "issue":     # stage 1: the earlier wait joins REDUCE_GRAD's graph
                M.set_meta(w, M.REDUCE_GRAD, "issue")
            order = {x: i for i, x in enumerate(g.nodes)}
