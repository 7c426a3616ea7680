"""Cross-iteration overlap with split graphs (a pipeline, or several microbatches): the stage's STEP moves into the
next step's first forward of that stage (ByteScheduler, Peng et al., SOSP'19, on ``passes.comm_schedule``'s plan).

A stage that runs ``F``, ``B`` (or ``I``/``W``), ``REDUCE_GRAD`` and ``STEP`` issues its gradient pieces in
``REDUCE_GRAD`` (ready events) as without overlap; its ``STEP`` (the need events' issues and waits, and the
update) does not run at the end of the step but at the start of the stage's first ``F`` of the next step, as
``F_UPDATE``: each need event's collectives and its bucket's update go just before the first forward op that
reads that bucket's parameters, and the forward reads the updated parameters. The all-reduce of a stage's
gradients then overlaps the pipeline's drain (the earlier stages' last backwards) and the next step's forwards
of the earlier stages; on the stage itself, the first layers' forward runs while the last layers' pieces are
still on the wire. The math is synchronous SGD: the update of step t happens before any forward of step t+1
reads those parameters, with step t's gradients, learning rate and count.

:func:`passes.comm_schedule.carry_step` prepares the joint graph (the optimizer's ``_foreach`` ops cut per bucket,
the plan's need events recorded); ``split_graphs`` cuts ``F``/``B``/``REDUCE_GRAD``/``STEP`` as always, and then
the feature (``fxpar.features.bytescheduler``, after the split) builds ``F_UPDATE`` from ``F`` and ``STEP``
(:func:`carry_forward`). The runtime (the feature's ``Carry`` state) keeps
STEP's inputs at the STEP action, runs ``F_UPDATE`` for the stage's first F of the next step, and ``STEP`` itself
to drain (after the last step, before results, state_dict and checkpoints).

Before / after (stage of two buckets, ``fc2`` made first in backward, ``fc1`` needed first)::

    F:        t = t(fc1_w); addmm = addmm(fc1_b, x, t); ...; t_1 = t(fc2_w); addmm_1 = ...
    STEP:     wait = wait_tensor(pending0); wait_1 = wait_tensor(pending1)
              _foreach_add = _foreach_add([fc1_w, fc1_b, fc2_w, fc2_b], [...])

    F_UPDATE: wait_1 = wait_tensor(pending1); _foreach_add_1 = _foreach_add([fc1_w, fc1_b], [view(wait_1)])
              t = t(getitem); addmm = addmm(getitem_1, x, t); ...    # forward reads the updated fc1
              wait = wait_tensor(pending0); _foreach_add_0 = _foreach_add([fc2_w, fc2_b], [view(wait)])
              t_1 = t(getitem_2); addmm_1 = ...
              return (loss, act, saved..., new fc1_w, new fc1_b, new fc2_w, new fc2_b, new state...)
"""
from __future__ import annotations

import torch
import torch.fx

from fxpar import meta as M
from fxpar.collectives import C10D
from fxpar.errors import PassError
from fxpar.roles import GraphKind, Role

from .comm_schedule import F_UPDATE, reinplaced
from .split_graphs import SplitGraph

__all__ = ["carry_forward"]

_COLL = (C10D.all_reduce_.default, C10D.wait_tensor.default)


def carry_forward(f, step, need, optimizer: dict | None = None) -> dict:
    """``{"F_UPDATE": ..., "STEP": ...}`` (``SplitGraph``s) from the split ``F`` and ``STEP``: see
    :func:`_interleave`; both then update parameters and optimizer state in place (``passes.reinplace``), as the
    programs without overlap do (the interleaving needs the update's results as values, so it comes first)."""
    gm, ins, outs = _interleave(f, step, need)
    return {F_UPDATE: SplitGraph(F_UPDATE, reinplaced(gm, ins, optimizer), ins, outs),
            GraphKind.STEP: SplitGraph(GraphKind.STEP, reinplaced(step.gm, list(step.inputs), optimizer),
                                       list(step.inputs), list(step.outputs))}


def _interleave(f, step, need) -> tuple:
    """``F_UPDATE`` from the split ``F`` and ``STEP`` (``SplitGraph``s) and ``need`` (:func:`carry_step`): STEP's
    nodes go, need event by need event, just before the first F node that reads one of the event's bucket's
    parameters (never later than a later event's: the plan's order of issues and waits, hence its credit, is
    kept); F's reads of a parameter (and a parameter F hands on as a saved value) become the updated one.
    Inputs: F's, then STEP's not already there, by ``(role, key)``; outputs: F's, then STEP's.
    Returns ``(GraphModule, input roles, output roles)``."""
    fg, sg = f.gm.graph, step.gm.graph
    s_nodes = [n for n in sg.nodes if n.op not in ("placeholder", "output")]
    f_nodes = [n for n in fg.nodes if n.op not in ("placeholder", "output")]
    s_pos = {n: i for i, n in enumerate(s_nodes)}
    s_out = list(sg.find_nodes(op="output")[0].args[0])
    bad = [rk for rk in step.outputs if rk[0] not in (Role.NEW_PARAM, Role.NEW_OPT_STATE, Role.GRAD)]
    if bad:
        raise PassError(f"comm_schedule: the STEP graph also makes {bad[:3]}; cross-iteration overlap under a pipeline "
                        "moves STEP into the next step's first forward and cannot carry those: use "
                        "comm_schedule='bytescheduler' without a pipeline, or comm_schedule='fifo'")
    new_of = {key: o for o, (r, key) in zip(s_out, step.outputs) if r == Role.NEW_PARAM}
    state_of: dict = {}
    for o, (r, key) in zip(s_out, step.outputs):
        if r == Role.NEW_OPT_STATE:
            state_of.setdefault(key.split(":", 1)[1], []).append(o)
    colls = [n for n in s_nodes if n.target in _COLL]
    if len(colls) != sum(n for _, n, _ in need):
        raise PassError(f"comm_schedule: the STEP graph has {len(colls)} gradient collectives, the plan's need events "
                        f"{sum(n for _, n, _ in need)}; plan again (drop the Plan's bytescheduler stages)")
    events, i = [], 0
    for _, n, keys in need:
        roots = colls[i:i + n] + [new_of[k] for k in keys if k in new_of] + [o for k in keys for o in state_of.get(k, [])]
        events.append((keys, roots))
        i += n
    key_of = {ph: key for ph, (r, key) in zip(fg.find_nodes(op="placeholder"), f.inputs) if r == Role.PARAM}
    first: dict = {}
    for j, n in enumerate(f_nodes):
        for a in n.all_input_nodes:
            if a in key_of:
                first.setdefault(key_of[a], j)
    at = [min((first.get(k, len(f_nodes)) for k in keys), default=len(f_nodes)) for keys, _ in events]
    for j in reversed(range(len(at) - 1)):          # never after a later event: the plan's order stays
        at[j] = min(at[j], at[j + 1])

    g = torch.fx.Graph()
    env, ins, by_role, root = {}, [], {}, {}
    for graph, roles, gm in ((fg, f.inputs, f.gm), (sg, step.inputs, step.gm)):
        for ph, rk in zip(graph.find_nodes(op="placeholder"), roles):
            rk = tuple(rk)
            if rk not in by_role:
                by_role[rk] = g.placeholder(ph.name)
                by_role[rk].meta = {k: v for k, v in ph.meta.items()
                                    if k in ("val", "tensor_meta", M.PARAM.name, M.ROLE.name)}
                ins.append(rk)
            env[ph] = by_role[rk]
        for n in graph.find_nodes(op="get_attr"):
            root[n.target] = getattr(gm, n.target)
    placed: set = set()

    def emit(roots) -> None:
        chain, stack = set(), list(roots)
        while stack:
            n = stack.pop()
            if n in chain or n in placed or n.op == "placeholder":
                continue
            chain.add(n)
            stack.extend(n.all_input_nodes)
        for n in sorted(chain, key=s_pos.__getitem__):
            env[n] = g.node_copy(n, lambda a: env[a])
        placed.update(chain)

    def updated(a):
        if a in key_of:
            new = new_of.get(key_of[a])
            if new is None or new not in env:
                raise PassError(f"comm_schedule: F_UPDATE reads parameter {key_of[a]!r} before its update")
            return env[new]
        return env[a]

    nxt = 0
    for j, n in enumerate(f_nodes + [None]):
        while nxt < len(events) and at[nxt] == j:
            emit(events[nxt][1])
            nxt += 1
        if n is not None:
            env[n] = g.node_copy(n, updated)
    emit(s_nodes)                                   # anything else STEP makes, in its order
    f_out = list(fg.find_nodes(op="output")[0].args[0])
    g.output(tuple([torch.fx.map_arg(o, updated) for o in f_out] + [torch.fx.map_arg(o, lambda a: env[a]) for o in s_out]))
    gm = torch.fx.GraphModule(root, g, f"{F_UPDATE}Graph")
    gm.meta[M.KIND.name] = F_UPDATE
    g.lint()
    return gm, ins, list(f.outputs) + list(step.outputs)
