"""split_graphs: cut a stage's joint training-step graph into the graphs a schedule calls.

Every pass runs on the joint graph (forward, backward, gradient collectives, optimizer) first;
this pass then cuts it by the tags those passes left in ``node.meta``:

==============  ==========================================  ==========================================
graph           nodes                                       called
==============  ==========================================  ==========================================
``F``           ``fxpar_phase == "forward"``                once per microbatch (action ``F``)
``B``           ``fxpar_phase == "backward"``               once per microbatch (action ``B``)
``I`` / ``W``   backward, split: ``I`` makes the input      zero-bubble schedules (``I``, ``W``)
                gradients the previous stage needs, ``W``
                the rest (the weight gradients)
``REDUCE_GRAD`` ``fxpar_reduce_grad == "issue"``: the       once per step, after the stage's last
                bucket copies and the collectives' start    backward (action ``RG``)
``STEP``        ``fxpar_phase == "optimizer"`` and          once per step (action ``STEP``)
                ``fxpar_reduce_grad == "wait"``
==============  ==========================================  ==========================================

A node without a tag goes with the latest graph among its inputs. What crosses a cut becomes an
output of one graph and an input of the other, named by role (:class:`SplitGraph`):

* ``("saved", name)``: a value ``F`` (or ``I``) makes and a later per-microbatch graph reads,
  kept per microbatch. A backward graph reads parameters, the batch and received activations only
  through ``F``'s saved values, so a backward always differentiates through the weights its
  forward used (PipeDream's weight stashing needs exactly that).
* ``("grad", key)``: a parameter's gradient made per microbatch and read per step: the runtime
  sums it over the step's microbatches (and over the stages of a rank that share the parameter),
  then hands the sum to ``REDUCE_GRAD`` or ``STEP``. Anything else crossing from a per-microbatch
  graph into a per-step graph is refused, naming the node.
* ``("pending", name)``: a collective ``REDUCE_GRAD`` started and ``STEP`` waits on, so the
  reduction overlaps whatever the rank does in between.

Before (a one-Linear stage, dp=2, bucketed), after ``split_graphs(kinds=("F", "B", "REDUCE_GRAD", "STEP"))``::

    t = t(w); mm = mm(x, t); loss = ...                    # forward
    full_like = full_like(loss, 0.5); mm_1 = mm(...)       # backward: grad of w
    empty = empty([n]); copy_ = copy_(slot, mm_1); all_reduce_ = all_reduce_(empty, ...)   # issue
    wait = wait_tensor(all_reduce_); view = view(slice(wait)); _foreach_sub = ...          # step

    F(w, x, target) -> (loss, saved_x, saved_w)
    B(saved_x, saved_w) -> (grad w,)
    REDUCE_GRAD(grad w) -> (pending empty,)
    STEP(w, lr, step, pending empty) -> (new w, grad w)

``kinds=("FULL",)`` keeps the joint graph whole: a one-stage, one-microbatch program runs it as
one graph, its collectives overlapping its backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from fxpar import meta as M
from fxpar.errors import PassError
from fxpar.portable import pack_graph_module, unpack_graph_module
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.roles import GraphKind, Role

__all__ = ["SplitGraph", "split_graphs", "SplitGraphs"]

_ORDER = {GraphKind.UNSHARD: -1, GraphKind.F: 0, GraphKind.B: 1, GraphKind.I: 1, GraphKind.W: 2,
          GraphKind.REDUCE_GRAD: 3, GraphKind.STEP: 4}
_PER_MB = (GraphKind.F, GraphKind.B, GraphKind.I, GraphKind.W)
_DIRECT = {GraphKind.UNSHARD: (Role.PARAM,),
           GraphKind.F: (Role.PARAM, Role.BUFFER, Role.INPUT, Role.TARGET, Role.ACT, Role.STATE),
           GraphKind.B: (Role.TANGENT, Role.STATE), GraphKind.I: (Role.TANGENT, Role.STATE),
           GraphKind.W: (Role.TANGENT, Role.STATE),
           GraphKind.REDUCE_GRAD: (Role.STATE,),
           GraphKind.STEP: (Role.PARAM, Role.PARAM_SHARD, Role.BUFFER, Role.OPT_STATE, Role.LR, Role.STEP,
                            Role.STATE)}   # STATE: a feature's per-rank state, in any graph


@dataclass
class SplitGraph:
    """One graph a schedule action calls, with what each input and output is (``(role, key)``)."""
    kind: GraphKind                # or a kind a feature adds (its own string)
    gm: torch.fx.GraphModule
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)

    def __getstate__(self):   # graphs travel node by node (fxpar.portable)
        return {**self.__dict__, "gm": pack_graph_module(self.gm)}

    def __setstate__(self, state):
        self.__dict__.update({**state, "gm": unpack_graph_module(state["gm"])})


def _kind_of(n: torch.fx.Node, assigned: dict) -> GraphKind:
    if M.get(n, M.UNSHARD):
        return GraphKind.UNSHARD
    tag = M.get(n, M.REDUCE_GRAD)
    if tag == "issue":
        return GraphKind.REDUCE_GRAD
    if tag == "wait":
        return GraphKind.STEP
    phase = M.get(n, M.PHASE)
    if phase == "forward":
        return GraphKind.F
    if phase == "backward":
        return GraphKind.B
    if phase == "optimizer":
        return GraphKind.STEP
    ins = [assigned[a] for a in n.all_input_nodes if a in assigned]
    return max(ins, key=_ORDER.get) if ins else GraphKind.F


def _classify(gm, signature, split_backward: bool) -> dict:
    assigned = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            assigned[n] = _kind_of(n, assigned)
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    if split_backward:      # I: what the previous stage's gradients need; W: the rest of backward
        need, stack = set(), [o for o, (r, _) in zip(outs, signature.outputs)
                              if r == Role.ACT_GRAD and isinstance(o, torch.fx.Node)]
        while stack:
            x = stack.pop()
            if x in need or assigned.get(x) != GraphKind.B:
                continue
            need.add(x)
            stack.extend(x.all_input_nodes)
        for n, k in assigned.items():
            if k == GraphKind.B:
                assigned[n] = GraphKind.I if n in need else GraphKind.W
    for n, k in assigned.items():
        for a in n.all_input_nodes:
            ka = assigned.get(a)
            if ka is not None and _ORDER[ka] > _ORDER[k]:
                raise PassError(f"split_graphs: node {n.name} ({k}) reads {a.name}, which belongs to the later graph "
                                f"{ka}; a pass placed it out of order (made by pass {M.get(n, M.PASS, 'capture')!r})")
    return assigned


def split_graphs(gm: torch.fx.GraphModule, kinds: tuple) -> dict:
    """Cut ``gm`` (a joint stage graph with ``gm.meta['fxpar_signature']``) into ``{kind: SplitGraph}``."""
    sig = gm.meta[M.SIGNATURE.name]
    if tuple(kinds) == (GraphKind.FULL,):
        return {GraphKind.FULL: SplitGraph(GraphKind.FULL, gm, list(sig.inputs), list(sig.outputs))}
    split_bw = GraphKind.I in kinds
    assigned = _classify(gm, sig, split_bw)
    phs = gm.graph.find_nodes(op="placeholder")
    role_of = dict(zip(phs, sig.inputs))
    out_node = gm.graph.find_nodes(op="output")[0]
    graph_kinds = [k for k in (GraphKind.UNSHARD, GraphKind.F, GraphKind.I, GraphKind.W, GraphKind.REDUCE_GRAD,
                               GraphKind.STEP)
                   if k in kinds or (k in (GraphKind.I, GraphKind.W) and split_bw)]
    if not split_bw:
        graph_kinds.insert(graph_kinds.index(GraphKind.F) + 1, GraphKind.B)
    where = lambda n: assigned.get(n, "placeholder")  # noqa: E731

    # what each graph reads from outside itself, and the role it gets there
    reads = {k: {} for k in graph_kinds}          # kind -> {node: (role, key)}
    exports = {k: {} for k in graph_kinds}        # kind -> {node: (role, key)} outputs for later graphs
    consts = {k: [] for k in graph_kinds}         # kind -> get_attr nodes it reads (each graph makes its own)
    for n, k in assigned.items():
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                if a not in consts[k]:
                    consts[k].append(a)
                continue
            ka = where(a)
            if ka == k:
                continue
            reads[k].setdefault(a, _crossing(a, ka, k, role_of, exports))
    # joint outputs: each from the graph that makes it (or, for an input passed through, the graph it feeds)
    joint_out = {k: [] for k in graph_kinds}
    for node, (role, key) in zip(out_node.args[0], sig.outputs):
        if not isinstance(node, torch.fx.Node):
            continue
        k = where(node)
        if k == "placeholder":          # an input handed straight out (a pass-through activation or its gradient)
            k = ("STEP" if role in (Role.NEW_PARAM, Role.NEW_OPT_STATE) else
                 ("I" if split_bw else "B") if role == Role.ACT_GRAD else "F")
            reads[k].setdefault(node, role_of[node])
        elif role == Role.GRAD and k in _PER_MB:
            exports[k].setdefault(node, (Role.GRAD, key))   # unsynchronised: the runtime's sum is the gradient
            continue
        joint_out[k].append((node, (role, key)))
    out = {}
    for k in graph_kinds:
        body = [n for n in gm.graph.nodes if assigned.get(n) == k]
        ins = sorted(reads[k].items(), key=lambda kv: _input_rank(kv[1]))
        outs = list(exports[k].items()) + [(n, rk) for n, rk in joint_out[k]]
        out[k] = SplitGraph(k, _build(gm, k, ins, consts[k], body, outs), [rk for _, rk in ins], [rk for _, rk in outs])
    check_no_read_after_inplace_write(out)
    return out


def check_no_read_after_inplace_write(parts: dict) -> None:
    """Refuse a split in which a graph could read a tensor that an in-place op in a graph changed under it.

    The joint graph runs top to bottom, so each read sees exactly the in-place writes above it. Once cut,
    the graphs run in the order ``F < B | I < W < REDUCE_GRAD < STEP`` for one microbatch: ``F``, ``B``,
    ``I`` and ``W`` once per microbatch, interleaved with other microbatches' graphs (1F1B, zero bubble,
    Chimera run ``F`` of one microbatch between ``F`` and ``B`` of another), ``REDUCE_GRAD`` and ``STEP``
    once per step after the stage's last backward; and what crosses a cut (a placeholder, a ``saved`` /
    ``grad`` / ``pending`` export) is the tensor itself, not a copy. A *write* is an argument whose schema
    says ``Tensor(a!)`` (``sigmoid_``, ``add_``, ``copy_``, ``_foreach_add_``, ``all_reduce_``); it changes
    a *storage*: the written node's base and every node of that graph aliasing it (views, ``getitem``,
    an in-place op's own result, ``wait_tensor``). Refused with a ``PassError`` naming the node, the
    tensor and both graphs:

    1. In a per-microbatch graph (F, B, I, W), a write to a storage that leaves the graph: one of its
       placeholders (parameters, the batch, received activations, tangents, another graph's saved values:
       tensors the other graphs and the other microbatches also read) or one of its outputs (a saved value,
       gradient, activation or loss a later graph, the next stage or the runtime reads). The reader sees
       whatever the last-run write left, which depends on the schedule. A GRU shows it when in-place ops are
       cut apart: ``F`` saves ``x`` for ``B`` and then runs ``x.sigmoid_()``. A per-microbatch graph may write in place
       only into tensors it made itself and hands to no one.
    2. In a per-step graph, a write to one of its inputs that a graph running later in the step takes too,
       under the same ``(role, key)`` (``REDUCE_GRAD`` reducing its ``("grad", w)`` in place while ``STEP``
       also reads ``("grad", w)``): the later graph asks for the value from before the write, gets the one
       after.
    3. In a per-step graph, a write to a storage it exports to a later graph, made after the exported node:
       the export names the value before that write, the later graph reads the one after.
    4. A write to a constant (``get_attr``) in any graph: the constant is shared by every call of every
       graph, so each later call starts from what the last one left.

    Allowed: a write into a tensor the graph made and nobody else reads (the bucket pass's ``copy_`` of
    gradients into a fresh bucket in ``REDUCE_GRAD``); a per-step graph's export made by or after its last
    write to that storage (``REDUCE_GRAD``'s ``all_reduce_(bucket)`` result, which ``STEP`` waits on: the
    write happens before the read, and the read is there to see it); a per-step write to an input that only
    earlier graphs read (``STEP`` updating parameters and optimizer state in place, ``passes.reinplace``:
    every forward and backward of the step has read them already). A whole graph (``FULL``) keeps the
    joint order and needs no check.

    Example: a stage whose forward saves ``x = mm(input0, w)`` for its backward, then changes it::

        F:  x = mm(input0, w); sig = sigmoid_(x); loss = sum(sig)     -> (loss, saved x, saved input0)
        B:  (saved x, saved input0) -> t = t(input0); grad_w = mm(t, x)

        PassError: split_graphs: node sig (aten.sigmoid_.default) in the F graph writes in place into x, which
        F returns as ('saved', 'x') and the B graph reads: a tensor handed to another graph must not change
        once made, ...
    """
    import operator

    wait_tensor = torch.ops._c10d_functional.wait_tensor.default
    exported_roles = (Role.SAVED, Role.GRAD, Role.PENDING)
    takes: dict = {}                                  # (role, key) -> graph kinds that take it as an input
    for k, sg in parts.items():
        for rk in sg.inputs:
            takes.setdefault(tuple(rk), []).append(k)

    def arg_nodes(n, pred) -> list:
        """The nodes passed to ``n``'s schema arguments for which ``pred(arg)`` holds."""
        schema = getattr(n.target, "_schema", None)
        if schema is None:
            return []
        out, positional = [], [a for a in schema.arguments if not a.kwarg_only]
        for i, a in enumerate(schema.arguments):
            if not pred(a):
                continue
            v = n.args[i] if (not a.kwarg_only and i < len(n.args) and i < len(positional)) else n.kwargs.get(a.name)
            out += [x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, torch.fx.Node)]
        return out

    def alias_base(n):
        """The input ``n`` is a view of (shares storage with), or None for a fresh tensor."""
        if n.op != "call_function":
            return None
        if n.target is operator.getitem or n.target is wait_tensor:
            return n.args[0] if isinstance(n.args[0], torch.fx.Node) else None
        schema = getattr(n.target, "_schema", None)
        if schema is None or not any(r.alias_info is not None for r in schema.returns):
            return None
        aliased = arg_nodes(n, lambda a: a.alias_info is not None)
        return aliased[0] if aliased else None

    def readers(rk, k, later_only) -> list:
        return [j for j in takes.get(rk, []) if j != k and (not later_only or _ORDER[j] > _ORDER[k])]

    for k, sg in parts.items():
        nodes = list(sg.gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        root = {}
        for n in nodes:
            base = alias_base(n)
            root[n] = root.get(base, n) if base is not None else n
        role_in = {ph: tuple(rk) for ph, rk in zip(sg.gm.graph.find_nodes(op="placeholder"), sg.inputs)}
        out_args = sg.gm.graph.find_nodes(op="output")[0].args[0]
        outs = [(o, tuple(rk)) for o, rk in zip(out_args, sg.outputs) if isinstance(o, torch.fx.Node)]
        for w in nodes:
            if w.op != "call_function":
                continue
            for a in arg_nodes(w, lambda arg: arg.alias_info is not None and arg.alias_info.is_write):
                r = root[a]
                tensor = a.name if a is r else f"{a.name} (a view of {r.name})"
                head = (f"split_graphs: node {w.name} ({w.target}) in the {k} graph writes in place into {tensor}, "
                        f"which ")
                tail = (f" (node made by pass {M.get(w, M.PASS, 'capture')!r}). Make the op out of place, or write "
                        "into a fresh tensor (clone first) that no other graph reads.")
                why = None
                if r.op == "get_attr":
                    why = (f"is the constant {r.target!r}, shared by every call of every graph: each later call "
                           "would start from what this one left")
                elif k in _PER_MB:
                    if r in role_in:
                        others = readers(role_in[r], k, later_only=False)
                        why = (f"is its input {role_in[r]}, also read by "
                               + (f"the {', '.join(others)} graph(s) and " if others else "")
                               + f"the {k} graph of every other microbatch: a per-microbatch graph may write in "
                               "place only into tensors it made and hands to no one")
                    leaving = [(o, rk) for o, rk in outs if root[o] is r]
                    if why is None and leaving:
                        to = sorted({j for _, rk in leaving if rk[0] in exported_roles
                                     for j in readers(rk, k, later_only=True)}, key=_ORDER.get)
                        why = (f"{k} returns as {', '.join(str(rk) for _, rk in leaving)}"
                               + (f" and the {', '.join(to)} graph reads" if to else " to the runtime (or the next "
                                                                                    "stage)")
                               + ": a tensor handed to another graph must not change once made, or what the "
                               "reader sees depends on the schedule (an in-place op cut across the graphs, as a "
                               "recurrent cell's sigmoid_, gives wrong gradients)")
                else:
                    later = readers(role_in[r], k, later_only=True) if r in role_in else []
                    if later:
                        why = (f"is its input {role_in[r]}; the {', '.join(later)} graph, run later in the step, "
                               "reads that input too and would see the value after this write, not the one it "
                               "asked for")
                    for o, rk in outs:
                        to = readers(rk, k, later_only=True) if rk[0] in exported_roles else []
                        if why is None and to and root[o] is r and pos[o] < pos[w]:
                            why = (f"{k} exports as {rk} ({o.name}, made before this write) and the "
                                   f"{', '.join(to)} graph reads: it would see the value after the write")
                if why is not None:
                    raise PassError(head + why + tail)


_ROLE_RANK = {Role.PARAM: 0, Role.PARAM_SHARD: 0.5, Role.BUFFER: 1, Role.OPT_STATE: 2, Role.LR: 3, Role.STEP: 4,
              Role.INPUT: 5, Role.TARGET: 6, Role.ACT: 7, Role.TANGENT: 8, Role.UNSHARDED: 8.5, Role.SAVED: 9,
              Role.GRAD: 10, Role.PENDING: 11, Role.STATE: 12}


def _input_rank(rk):
    return _ROLE_RANK.get(rk[0], 99)


def _crossing(a, ka, k, role_of, exports) -> tuple:
    """The role under which graph ``k`` reads node ``a`` (made in ``ka`` or a placeholder)."""
    if ka == "placeholder":
        role = role_of[a]
        if role[0] in _DIRECT[k]:
            return role
        if k in _PER_MB and role[0] in _DIRECT[GraphKind.F]:   # the backward reads the batch or weights: F saves them
            exports[GraphKind.F][a] = (Role.SAVED, a.name)
            return (Role.SAVED, a.name)
        raise PassError(f"split_graphs: the {k} graph reads input {a.name} ({role[0]} {role[1]!r}), which that "
                        f"graph is not given; a pass made {k} depend on it")
    if ka == GraphKind.UNSHARD:                                     # ZeRO-3: a parameter gathered once per step
        exports[ka][a] = (Role.UNSHARDED, a.name)
        return (Role.UNSHARDED, a.name)
    if ka in _PER_MB and k in _PER_MB:
        exports[ka][a] = (Role.SAVED, a.name)
        return (Role.SAVED, a.name)
    if ka in (GraphKind.B, GraphKind.I, GraphKind.W) and k in (GraphKind.REDUCE_GRAD, GraphKind.STEP):
        key = M.get(a, M.GRAD_OF)
        if key is None:
            raise PassError(f"split_graphs: the per-step {k} graph reads {a.name}, made per microbatch in {ka}, and it "
                            "is not a parameter gradient (no fxpar_grad_of): only gradients can be summed over "
                            "microbatches. Move that node into the backward or the optimizer phase.")
        exports[ka][a] = (Role.GRAD, key)
        return (Role.GRAD, key)
    if ka == GraphKind.REDUCE_GRAD and k == GraphKind.STEP:
        exports[ka][a] = (Role.PENDING, a.name)
        return (Role.PENDING, a.name)
    raise PassError(f"split_graphs: the {k} graph reads {a.name} from the {ka} graph; values cross only from "
                    "forward to backward, from backward to REDUCE_GRAD/STEP (gradients) and from REDUCE_GRAD to STEP")


def _build(gm, kind, ins, consts, body, outs) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    env = {}
    for c in consts:
        env[c] = g.get_attr(c.target)
        env[c].meta = dict(c.meta)
    for node, (role, key) in ins:
        ph = g.placeholder(node.name if role != Role.GRAD else f"grad_{node.name}")
        ph.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", M.PARAM.name)}
        ph.meta[M.ROLE.name] = role
        env[node] = ph
    for n in body:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[n] for n, _ in outs))
    new = _LazyGraphModule(gm, g, f"{kind}Graph")     # its Python code generated when first read or run
    new.meta[M.KIND.name] = kind
    return new


class SplitGraphs(Pass):
    """The pass form, last in the pipeline: ``ctx.split`` gets ``{kind: SplitGraph}``; the joint
    graph itself is returned unchanged (history shows each cut graph as its own entry)."""
    name = "split_graphs"

    def __init__(self, kinds: tuple):
        self.kinds = tuple(kinds)

    def run(self, gm, ctx: PassContext) -> PassResult:
        parts = split_graphs(gm, self.kinds)
        ctx.split = parts
        if tuple(self.kinds) != (GraphKind.FULL,):
            ctx.notes.append("split_graphs: " + ", ".join(f"{k} {len(p.gm.graph.nodes)} nodes"
                                                          for k, p in parts.items()))
        return PassResult(gm, False, {"graphs": {k: p.gm.code for k, p in parts.items()}})
