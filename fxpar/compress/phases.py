"""A method's traced bucket sum cut at its collectives: compute phases that the rank runs, collectives it issues.

:func:`split_phases` takes the graph ``make_fx`` traced from :meth:`fxpar.compress.Method.sum` and cuts it into
compute-only graphs, one per *phase*, with the collectives taken out: phase ``k`` makes the tensors that the
collectives issued after it send, and reads the results of collectives issued after earlier phases. A node's phase
is the number of collective round trips on its longest path from the inputs (each node runs as soon as what it
reads is there, a collective is issued as soon as what it sends is made), except that the nodes touching a storage
some node writes in place keep their order. The last phase makes the graph's outputs and issues nothing.

PowerSGD's sum (whole tensors, then P, then Q, ``powersgd.power_step``)::

    cat = cat(whole); all_reduce = all_reduce(cat); wait = wait_tensor(all_reduce); div = div(wait, 2)
    bmm = bmm(m, orth(q)); cat_1 = cat([bmm]); all_reduce_1 = all_reduce(cat_1); wait_1 = wait_tensor(all_reduce_1)
    bmm_1 = bmm(m^T, orth(wait_1)); cat_2 = ...; all_reduce_2 = all_reduce(cat_2); wait_2 = wait_tensor(all_reduce_2)
    out = cat([bmm(orth(wait_1), wait_2^T), div]); return (out, x - out, ...)

becomes three phases and three collectives::

    phase 0: cat, bmm, cat_1                 -> issue all_reduce(cat) as "wait", all_reduce(cat_1) as "wait_1"
    phase 1: reads wait_1: orth, bmm_1, cat_2 -> issue all_reduce(cat_2) as "wait_2"
    phase 2: reads wait, wait_1, wait_2: div, the estimates, out, the new state

The phases are the same nodes in the same order as the traced graph: running them with the collectives between gives
the same bits. Who runs what when is :mod:`fxpar.compress.inflight`'s.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from fxpar.collectives import C10D, gloo_all_gather_into_tensor
from fxpar.errors import PassError

__all__ = ["Phase", "Collective", "PhasedSum", "split_phases", "piece_bytes", "DIVISIBLE"]

# the collectives a piece of which is the same collective on a piece of the tensor: an all-reduce is element-wise,
# an all-gather moves rows (its pieces' rows are put back in rank order). An all-to-all's and a reduce-scatter's
# pieces would each split among the ranks again, so each is sent whole.
DIVISIBLE = ("all_reduce", "all_gather")

_KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "all_to_all_single": "all_to_all"}


@dataclass
class Phase:
    """One compute-only graph: reads ``inputs`` (value names) and returns ``outputs`` (value names)."""
    gm: torch.fx.GraphModule
    inputs: tuple
    outputs: tuple


@dataclass
class Collective:
    """A collective taken out of the sum: it sends value ``send`` and its waited result is value ``name``.
    ``target`` and ``args`` are the functional collective and its arguments after the tensor (the group's name
    among them); ``kind`` its cost-model name; ``nbytes`` what this rank hands it; ``row_bytes`` one row's bytes
    (dim 0: the unit a piece is cut in)."""
    name: str
    send: str
    target: object
    args: tuple
    kind: str
    nbytes: int
    row_bytes: int

    @property
    def divisible(self) -> bool:
        return self.kind in DIVISIBLE


@dataclass
class PhasedSum:
    """The sum as ``phases`` (``len(issues) == len(phases)``: ``issues[k]``, the collectives issued after phase
    ``k``, in the traced order; the last is empty), the traced graph's ``inputs`` (value names, in its placeholder
    order) and ``outputs`` (value names the last phase returns, in the traced output order). ``needs[k]``: the
    collective results phase ``k`` or the collectives after it read."""
    inputs: tuple
    phases: list
    issues: list
    outputs: tuple
    needs: list

    @property
    def collectives(self) -> list:
        return [c for cs in self.issues for c in cs]


def _issues(n: torch.fx.Node) -> bool:
    return (n.op == "call_function" and n.target is not C10D.wait_tensor.default
            and (getattr(n.target, "namespace", None) == "_c10d_functional" or n.target is gloo_all_gather_into_tensor))


def _kind(n: torch.fx.Node) -> str:
    if n.target is gloo_all_gather_into_tensor:
        return "all_gather"
    name = n.target._schema.name.split("::")[-1].rstrip("_")
    return _KINDS.get(name, name)


def split_phases(gm: torch.fx.GraphModule, what: str = "the bucket sum") -> PhasedSum:
    """``gm`` (a traced sum: placeholders, aten ops, functional collectives each read by one ``wait_tensor``, one
    output) cut into phases (module docstring). ``what`` names the sum in errors."""
    g = gm.graph
    nodes = list(g.nodes)
    out_node = next(n for n in nodes if n.op == "output")
    waits = {}                                       # collective -> its wait
    for n in nodes:
        if _issues(n):
            users = list(n.users)
            if len(users) != 1 or users[0].target is not C10D.wait_tensor.default:
                raise PassError(f"{what}: collective {n.name} is read by {[u.name for u in users]}, not by one "
                                "wait_tensor: write the method's collectives through its Comm")
            if any(isinstance(a, torch.fx.Node) for a in list(n.args[1:]) + list(n.kwargs.values())):
                raise PassError(f"{what}: collective {n.name} takes more than one tensor; a method's collectives take one")
            waits[n] = users[0]
    of_wait = {w: c for c, w in waits.items()}
    written = _written_roots(nodes)
    sched, last_on = {}, {}                          # node -> phase; written storage -> phase of its last toucher
    for n in nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        k = max([sched.get(a, 0) for a in n.all_input_nodes], default=0)
        if n in of_wait:
            k = sched[of_wait[n]] + 1
        for r in written.get(n, ()):                 # a storage written in place: its touchers keep their order
            k = max(k, last_on.get(r, 0))
        sched[n] = k
        for r in written.get(n, ()):
            last_on[r] = k
    last = max([sched.get(a, 0) for a in out_node.all_input_nodes] + [sched[c] + 1 for c in waits] + [0])
    for n in nodes:
        if n.op == "call_function" and n not in waits and n not in of_wait:
            last = max(last, sched[n])
    phases, issues, needs = [], [], []
    for k in range(last + 1):
        body = [n for n in nodes if sched.get(n) == k and n.op == "call_function" and n not in waits
                and n not in of_wait]
        after = [c for c in nodes if c in waits and sched.get(c) == k]
        outs = []
        for n in body:
            if any(sched.get(u, last) > k or u is out_node for u in n.users) and n not in outs:
                outs.append(n)
        for c in after:
            if c.args[0] in body and c.args[0] not in outs:
                outs.append(c.args[0])
        if k == last:
            outs = list(out_node.args[0])
        phases.append(_graph(gm, body, outs, f"phase{k}"))
        issues.append([Collective(waits[c].name, c.args[0].name, c.target, tuple(c.args[1:]), _kind(c),
                                  _nbytes(c.args[0]), _row_bytes(c.args[0])) for c in after])
        read = set(phases[-1].inputs) | {c.send for c in issues[-1]}
        needs.append(tuple(w.name for w in of_wait if w.name in read))
    inputs = tuple(n.name for n in nodes if n.op == "placeholder")
    return PhasedSum(inputs, phases, issues, tuple(phases[-1].outputs), needs)


def _written_roots(nodes: list) -> dict:
    """node -> the storages (their first node) it touches that some node of the graph writes in place: a view or
    an in-place op shares its argument's storage; every node reading, viewing or writing such a storage keeps its
    place among the others touching it (PowerSGD's Gram-Schmidt divides and subtracts in place on column views)."""
    root, touches, writes = {}, {}, set()
    for n in nodes:
        base = None
        if n.op == "call_function":
            schema = getattr(n.target, "_schema", None)
            if n.target is operator.getitem:
                base = n.args[0]
            elif schema is not None:
                views = any(r.alias_info is not None for r in schema.returns)
                for a, v in zip(schema.arguments, n.args):
                    if a.alias_info is not None and isinstance(v, torch.fx.Node):
                        if views and base is None:
                            base = v
                        if a.alias_info.is_write:
                            writes.add(root[v])
        root[n] = root[base] if base is not None else n
        touches[n] = {root[a] for a in n.all_input_nodes} | {root[n]}
    return {n: sorted((r for r in rs if r in writes), key=nodes.index) for n, rs in touches.items()
            if any(r in writes for r in rs)}


def _graph(gm, body: list, outs: list, name: str) -> Phase:
    """The nodes ``body`` (in order) as a graph returning ``outs``; what they read from outside is its input."""
    g = torch.fx.Graph()
    env, inputs = {}, []
    inside = set(body)

    def arg(a):
        if a not in env and a.op == "get_attr":      # a constant the trace kept on the module: each phase reads it
            env[a] = g.node_copy(a)
        elif a not in env:
            env[a] = g.placeholder(a.name)
            env[a].meta = {k: v for k, v in a.meta.items() if k == "val"}
            inputs.append(a.name)
        return env[a]

    reads = [a for n in body for a in n.all_input_nodes if a not in inside] + [o for o in outs if o not in inside]
    for a in reads:
        arg(a)
    for n in body:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[o] for o in outs))
    return Phase(torch.fx.GraphModule(gm, g, name), tuple(inputs), tuple(o.name for o in outs))


def _nbytes(n: torch.fx.Node) -> int:
    v = n.meta.get("val")
    return int(v.numel() * v.element_size()) if isinstance(v, torch.Tensor) else 0


def _row_bytes(n: torch.fx.Node) -> int:
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return 0
    return int(v[0].numel() * v.element_size()) if v.dim() > 0 and v.shape[0] > 0 else int(v.element_size())


def piece_bytes(c: Collective, partition: int | None) -> list:
    """The bytes of each piece collective ``c`` is sent in under ``partition`` (bytes; None: whole): whole rows of at
    most ``partition`` bytes (one row at least) for an all-reduce or an all-gather, the whole tensor otherwise."""
    if not partition or not c.divisible or c.nbytes <= partition or c.row_bytes <= 0:
        return [c.nbytes]
    rows = c.nbytes // c.row_bytes
    per = max(1, partition // c.row_bytes)
    return [min(per, rows - r) * c.row_bytes for r in range(0, rows, per)]
