"""split_stages: cut a forward+loss graph into pipeline stages, each its own GraphModule.

Nodes fall in two kinds. An *activation* node depends on a trainable parameter and on the
batch: it runs in exactly one stage, the one whose range of graph positions holds it (a cut
"before module ``blocks.2``" is the position of the first node ``blocks.2`` runs). Every other
node (``t(weight)``, a causal mask built from the input, ``arange``) is *replicated*: each stage
that needs it recomputes it from its own placeholders, so a stage never receives a parameter and
a tied weight (GPT's embedding reused by the LM head) is simply a placeholder of both stages.

A value made in stage a and used in stage c > a+1 (a skip connection) goes through every stage
in between: it is an input and an output of each, so a schedule only ever sends between
neighbour stages. Before, cut before ``fc2``::

    x = placeholder; w1 = placeholder; w2 = placeholder
    t = t(w1); h = mm(x, t)          # fc1
    r = relu(h)
    t_1 = t(w2); o = mm(r, t_1)      # fc2
    s = add(o, h)                    # skip: h crosses the cut
    loss = mean(s)

After: stage 0 ``(x, w1) -> (h, r)``; stage 1 ``(w2, h, r) -> loss`` with ``t_1`` recomputed there.

Where no split points are given, cuts go where a PipeDream-style partition (Narayanan et al.
SOSP'19) puts them: candidate cuts (:func:`cut_candidates`) are the starts of every element of
every repeated block list at any depth (``blocks.3``, Hugging Face's ``transformer.h.3`` and
``model.layers.3``) and of the modules around those lists (``wte``, ``ln_f``, ``lm_head``); a
dynamic program over them minimises the largest stage cost, FLOPs (``cost_models.compute``)
plus the bytes the stage receives times ``flops_per_byte``. :func:`stage_imbalance` says how
uneven the result is.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from cost_models.compute import concrete, node_cost
from fxpar import meta as M
from fxpar.errors import StrategyError
from fxpar.pass_manager import Pass, PassResult
from fxpar.roles import Role

__all__ = ["StageGraph", "StageSplit", "StageDevices", "split_stages", "cut_candidates", "balanced_cuts", "smallest_stage_bytes", "stage_imbalance",
           "imbalance_warning", "IMBALANCE_WARN", "SplitStages"]

_CONTAINERS = ("ModuleList", "Sequential", "ModuleDict")


@dataclass
class StageGraph:
    """One stage's forward: ``gm(*inputs) -> outputs``; inputs/outputs are ``(role, key)`` pairs.

    Input roles: ``param``, ``buffer``, ``input``, ``target`` (key: model key or batch position) and
    ``act`` (key: the name of the node in the whole-model graph that made it). Output roles:
    ``act``, or ``loss`` on the last stage.
    """
    index: int
    gm: torch.fx.GraphModule
    inputs: list
    outputs: list
    nodes: list                    # names of the activation nodes this stage computes
    replicated: list               # names of the replicated nodes it recomputes
    modules: list                  # module paths it runs, in order
    flops: int = 0
    written: list = field(default_factory=list)   # buffer keys its forward writes (BatchNorm running statistics)

    @property
    def params(self) -> list:
        return [k for r, k in self.inputs if r == Role.PARAM]


@dataclass
class StageSplit:
    stages: list
    cuts: list                      # module path each stage after the first starts at
    candidates: list                # every module path a cut may go before
    shared_params: dict = field(default_factory=dict)   # param key -> stages using it (when > 1)

    def __str__(self) -> str:
        lines = []
        for st in self.stages:
            start = "start" if st.index == 0 else f"before {self.cuts[st.index - 1]!r}"
            acts_in = [k for r, k in st.inputs if r == Role.ACT]
            lines.append(f"stage {st.index} ({start}): {len(st.nodes)} nodes, {st.flops / 1e6:.2f} MFLOP fwd, "
                         f"params {st.params}, receives {acts_in or '-'}, sends "
                         f"{[k for _, k in st.outputs]}")
        for k, ss in self.shared_params.items():
            lines.append(f"shared parameter {k!r} in stages {ss}: gradients summed across them before the step")
        return "\n".join(lines)


def _node_flops(n: torch.fx.Node) -> int:
    try:
        return int(concrete(node_cost(n).flops))
    except Exception:  # noqa: BLE001 - a node the cost model cannot read counts as free
        return 0


def _bytes(n: torch.fx.Node) -> int:
    v = n.meta.get("val")
    return int(v.numel() * v.element_size()) if isinstance(v, torch.Tensor) else 0


def _classify(gm: torch.fx.GraphModule, roles: dict) -> set:
    """Names of activation nodes: those depending on a trainable parameter and on the batch."""
    dep = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            role = roles[n.name][0]
            dep[n] = (role == Role.PARAM, role in (Role.INPUT, Role.TARGET))
        elif n.op == "get_attr":          # a constant the trace made (torch.tensor(...) in a forward)
            dep[n] = (False, False)
        elif n.op == "call_function":
            ins = [dep[a] for a in n.all_input_nodes]
            dep[n] = (any(p for p, _ in ins), any(b for _, b in ins))
    return {n.name for n, (p, b) in dep.items() if n.op == "call_function" and p and b}


def _first_positions(gm: torch.fx.GraphModule) -> dict:
    """Module path (and every prefix of it) -> position of the first node it runs."""
    first = {}
    for i, n in enumerate(gm.graph.nodes):
        mod = M.get(n, M.MODULE) if n.op == "call_function" else None
        if not mod:
            continue
        parts = mod.split(".")
        for j in range(1, len(parts) + 1):
            first.setdefault(".".join(parts[:j]), i)
    return first


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _within(path: str, members: set, proper: bool = False) -> bool:
    """Whether ``path`` (or, with ``proper``, one of its ancestors only) is in ``members``."""
    parts = path.split(".")
    return any(".".join(parts[:j]) in members for j in range(1, len(parts) + (not proper)))


def _list_elements(paths: list, module_types: dict) -> set:
    """Paths that are one element of a repeated block list, at any depth:

    * a child of a ``ModuleList``/``Sequential``/``ModuleDict`` that is not itself inside an element
      (``blocks.3``, ``model.transformer.h.3``; an unknown type whose children are named 0, 1, …
      counts as a container);
    * a child of a container inside an element when all its children are of one class, two or more
      (T5's ``encoder.block.3`` inside ``encoder``; not ``block.3.layer.0``, where self-attention and
      feed-forward differ, nor a ``Sequential(Linear, Tanh)`` inside a block);
    * one of two or more siblings of one class that have submodules of their own, not inside an
      element (``encoder`` and ``decoder`` of one stack class, ``block1``, ``block2`` held as plain
      attributes; not a decoder layer's ``self_attn`` and ``multihead_attn``).
    """
    children: dict = {}
    for p in paths:
        if p:
            children.setdefault(_parent(p), []).append(p)
    composite = {_parent(p) for p in paths if p}
    elements: set = set()
    for parent in sorted(children, key=lambda q: q.count(".") if q else -1):     # outer lists first
        kids = children[parent]
        kind = module_types.get(parent, "")
        inside = bool(parent) and _within(parent, elements)
        if kind in _CONTAINERS or (not kind and parent and all(k.rsplit(".", 1)[-1].isdigit() for k in kids)):
            classes = {module_types.get(k, "") for k in kids}
            if not inside or (len(kids) > 1 and len(classes) == 1 and "" not in classes):
                elements.update(kids)
            continue
        if inside:
            continue
        by_class: dict = {}
        for k in kids:
            if k in composite and module_types.get(k):
                by_class.setdefault(module_types[k], []).append(k)
        elements.update(k for ks in by_class.values() if len(ks) > 1 for k in ks)
    return elements


def _structural(paths: list, elements: set) -> set:
    """The root and every module on the way from it to an outermost block list (not inside a block):
    their children are the coarse places to cut (``transformer.wte``, ``transformer.ln_f``, ``lm_head``)."""
    spine = {""}
    for e in elements:
        if not _within(e, elements, proper=True):         # an outermost element: its ancestors lead to it
            parts = e.split(".")
            spine.update(".".join(parts[:j]) for j in range(1, len(parts)))
    return spine


def cut_candidates(gm: torch.fx.GraphModule, roles: dict, module_types: dict) -> list:
    """Module paths a stage may start at, in execution order.

    A path is a candidate if it is an element of a repeated block list at any depth (see
    :func:`_list_elements`: ``blocks.3``, ``model.transformer.h.3``, ``model.layers.3``,
    T5's ``encoder.block.1``) or a child of the root or of a module on the way from the root to an
    outermost block list (``wte``, ``model.transformer.ln_f``, ``lm_head``). A path is kept only if
    the first node it runs comes after the first activation (a cut before it leaves stage 0 work);
    of two starting at the same node, the deeper (``blocks.0``, not ``blocks``). For models whose
    block lists sit at the top (``blocks.N``) this is the children of the root and of top-level
    containers, as before.
    """
    acts = _classify(gm, roles)
    pos = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    first_act = min((pos[a] for a in acts), default=0)
    first = _first_positions(gm)
    paths = sorted(set(module_types) | set(first))
    elements = _list_elements(paths, module_types)
    spine = _structural(paths, elements)

    by_pos: dict = {}
    for path, i in first.items():
        if not (path in elements or _parent(path) in spine) or i <= first_act:
            continue
        if path.count(".") >= by_pos.get(i, "").count("."):
            by_pos[i] = path          # two paths starting at one node: keep the deeper (blocks.0, not blocks)
    return [by_pos[i] for i in sorted(by_pos)]


@dataclass(frozen=True)
class StageDevices:
    """The devices the stages run on, for a cut that balances time rather than FLOPs (heterogeneous clusters):
    per stage its device's speed (FLOP/s; a stage's cost is its FLOPs over it) and memory (bytes; a stage whose
    parameters' state, ``state_copies`` times their bytes -- weights, gradient and optimizer moments -- exceeds it
    is not a cut the search takes), and a name for messages."""
    speed: tuple
    memory: tuple
    names: tuple
    state_copies: int = 4


def _param_bytes_per_segment(gm, roles: dict, acts: set, nodes: list, bounds: list) -> list:
    """Per segment ``[bounds[i], bounds[i + 1])``: ``{parameter name: bytes}`` of the parameters its activation nodes
    read (directly or through replicated nodes such as ``t(weight)``)."""
    memo: dict = {}

    def params_of(n) -> frozenset:
        if n in memo:
            return memo[n]
        if n.op == "placeholder":
            out = frozenset([n]) if roles[n.name][0] == Role.PARAM else frozenset()
        else:
            out = frozenset().union(*[params_of(a) for a in n.all_input_nodes if a.name not in acts]) \
                if n.all_input_nodes else frozenset()
        memo[n] = out
        return out

    segs = []
    for a, b in zip(bounds, bounds[1:]):
        got: dict = {}
        for n in nodes[a:b]:
            if n.name in acts:
                for q in n.all_input_nodes:
                    for ph in (params_of(q) if q.name not in acts else ()):
                        got[ph.name] = _bytes(ph)
        segs.append(got)
    return segs


def smallest_stage_bytes(gm: torch.fx.GraphModule, roles: dict, candidates: list, state_copies: int = 4,
                         stage: int = 1, n_stages: int = 3) -> tuple:
    """``(bytes, where)``: the parameter state (``state_copies`` x parameter bytes) of the smallest stage any cut can
    make at position ``stage`` of ``n_stages`` -- one segment between two neighbouring candidates; the first stage's
    holds the model's start, the last's the loss -- and where it starts and ends, in words."""
    first = _first_positions(gm)
    nodes = list(gm.graph.nodes)
    acts = _classify(gm, roles)
    bounds = [0] + [first[c] for c in candidates] + [len(nodes)]
    segs = _param_bytes_per_segment(gm, roles, acts, nodes, bounds)
    sizes = [state_copies * sum(sg.values()) for sg in segs]
    if stage == 0:
        i = 0
    elif stage == n_stages - 1:
        i = len(sizes) - 1
    else:
        i = min(range(len(sizes)), key=lambda j: (sizes[j], j))
    ends = ["the model's start"] + [repr(c) for c in candidates] + ["the loss"]
    return sizes[i], f"from {ends[i]} to {ends[i + 1]}"


def balanced_cuts(gm: torch.fx.GraphModule, roles: dict, candidates: list, n_stages: int,
                  flops_per_byte: float = 0.0, devices: StageDevices | None = None) -> list:
    """Choose ``n_stages - 1`` of ``candidates`` minimising the largest stage cost (FLOPs + received bytes); with
    ``devices``, the largest stage *time* (that cost over the stage's device speed) among the cuts whose every stage
    fits its device's memory."""
    first = _first_positions(gm)
    nodes = list(gm.graph.nodes)
    acts = _classify(gm, roles)
    bounds = [0] + [first[c] for c in candidates] + [len(nodes)]
    seg_cost = [sum(_node_flops(n) for n in nodes[a:b] if n.name in acts) for a, b in zip(bounds, bounds[1:])]
    pos = {n: i for i, n in enumerate(nodes)}
    # a stage's compute takes (its FLOPs) / (its device's speed relative to the fastest); the bytes it receives
    # take as long on any device
    speed = tuple(v / max(devices.speed) for v in devices.speed) if devices is not None else (1.0,) * n_stages
    fits = _fits(gm, roles, acts, nodes, bounds, devices, n_stages)

    def crossing(i: int) -> int:   # bytes live across position i
        return sum(_bytes(n) for n in nodes[:i] if n.name in acts and any(pos[u] >= i for u in n.users))

    cross = [0] + [crossing(first[c]) * flops_per_byte for c in candidates]
    k_seg = len(seg_cost)
    prefix = [0]
    for c in seg_cost:
        prefix.append(prefix[-1] + c)
    INF = float("inf")
    best = [[(INF, INF, None)] * (k_seg + 1) for _ in range(n_stages + 1)]   # (max cost, sum bytes, prev)
    best[0][0] = (0, 0, None)
    for k in range(1, n_stages + 1):
        for j in range(k, k_seg + 1):
            for i in range(k - 1, j):
                mx, tot, _ = best[k - 1][i]
                if mx == INF:
                    continue
                if not fits(k - 1, i, j):
                    continue
                cost = (prefix[j] - prefix[i]) / speed[k - 1] + cross[i]
                cand = (max(mx, cost), tot + cross[i], i)
                if cand[:2] < best[k][j][:2]:
                    best[k][j] = cand
    if best[n_stages][k_seg][0] == INF:
        raise StrategyError(_no_fit(gm, roles, candidates, n_stages, devices))
    cuts, j = [], k_seg
    for k in range(n_stages, 0, -1):
        i = best[k][j][2]
        if i:
            cuts.append(candidates[i - 1])
        j = i
    return list(reversed(cuts))


def _fits(gm, roles, acts, nodes, bounds, devices, n_stages):
    """``fits(k, i, j)``: whether segments ``i .. j - 1`` as stage ``k`` fit its device's memory."""
    if devices is None:
        return lambda k, i, j: True
    segs = _param_bytes_per_segment(gm, roles, acts, nodes, bounds)
    memo: dict = {}

    def need(i: int, j: int) -> int:
        if (i, j) not in memo:
            union: dict = {}
            for sg in segs[i:j]:
                union.update(sg)
            memo[(i, j)] = devices.state_copies * sum(union.values())
        return memo[(i, j)]
    return lambda k, i, j: need(i, j) <= devices.memory[k]


def _no_fit(gm, roles, candidates, n_stages, devices) -> str:
    """Why no cut fits: a device smaller than the smallest stage any cut makes, or the stages' memory in all."""
    smallest = [smallest_stage_bytes(gm, roles, candidates, devices.state_copies, k, n_stages)
                for k in range(n_stages)]
    tiny = [k for k in range(n_stages) if devices.memory[k] < smallest[k][0]]
    fix = ("give that stage a device with more memory (ClusterSpec.heterogeneous), use more stages (pp), or cut "
           "deeper module paths (Strategy(split_points=[...]))")
    if tiny:
        k = tiny[0]
        small, where = smallest[k]
        return (f"stage {k}'s device {devices.names[k]} has {devices.memory[k]} bytes of memory, less than the smallest "
                f"stage any cut makes (the one {where}), whose parameters, gradients and optimizer state "
                f"take {small} bytes ({devices.state_copies} x its parameter bytes); {fix}")
    return (f"no cut of the model into {n_stages} stages fits the devices' memory "
            f"({', '.join(f'{n}: {m} bytes' for n, m in zip(devices.names, devices.memory))}; a stage holds "
            f"{devices.state_copies} x its parameter bytes); {fix}")


IMBALANCE_WARN = 0.2    # explain() warns above this stage_imbalance


def stage_imbalance(split: StageSplit) -> float:
    """How uneven the stages are: ``max(stage FLOPs) / min(stage FLOPs) - 1``, from each stage's forward
    FLOPs (``StageGraph.flops``; backward is about twice forward per op, so the ratio holds for the
    step). 0.0 is perfectly even, 0.25 means the slowest stage does 25% more work than the fastest
    (the pipeline runs at the slowest stage's pace); ``inf`` if a stage does no counted work.
    One stage: 0.0."""
    flops = [st.flops for st in split.stages]
    if len(flops) < 2:
        return 0.0
    lo, hi = min(flops), max(flops)
    return float("inf") if lo <= 0 else hi / lo - 1.0


def imbalance_warning(split: StageSplit, threshold: float = IMBALANCE_WARN) -> str:
    """A line for ``explain()`` when :func:`stage_imbalance` exceeds ``threshold``, else ``""``."""
    r = stage_imbalance(split)
    if r <= threshold:
        return ""
    flops = [st.flops for st in split.stages]
    hi, lo = flops.index(max(flops)), flops.index(min(flops))
    return (f"warning: pipeline stages are unbalanced: stage {hi} does {max(flops) / 1e6:.2f} MFLOP forward, stage "
            f"{lo} {min(flops) / 1e6:.2f} ({'inf' if r == float('inf') else f'{r:.0%}'} more; the pipeline runs at "
            f"the slowest stage's pace). Cuts {split.cuts}; places to cut: {split.candidates}. Choose other "
            "Strategy(split_points=[...]) or a number of stages that divides the repeated blocks evenly.")


def split_stages(gm: torch.fx.GraphModule, roles: dict, n_stages: int, split_points=None,
                 module_types: dict | None = None, flops_per_byte: float = 0.0,
                 devices: StageDevices | None = None) -> StageSplit:
    """Cut ``gm`` (forward + loss, placeholders described by ``roles``) into ``n_stages`` stage graphs; ``devices``:
    balance stage times on unequal devices and respect their memory (:func:`balanced_cuts`)."""
    module_types = module_types or {}
    candidates = cut_candidates(gm, roles, module_types)
    first = _first_positions(gm)
    if split_points is not None:
        cuts = list(split_points)
        if len(cuts) != n_stages - 1:
            raise StrategyError(f"split_points={cuts} gives {len(cuts) + 1} stages but the schedule needs {n_stages}; "
                                f"give {n_stages - 1} module paths, e.g. {candidates[:n_stages - 1]}")
        for c in cuts:
            if c not in first:
                raise StrategyError(f"split point {c!r} is not a module the forward runs; candidates: {candidates}")
        ps = [first[c] for c in cuts]
        if any(a >= b for a, b in zip(ps, ps[1:])):
            raise StrategyError(f"split_points={cuts} are not in execution order (or two start at the same node); "
                                f"order them as the model runs them: candidates in order are {candidates}")
    else:
        if n_stages - 1 > len(candidates):
            raise StrategyError(
                f"cannot cut the model into {n_stages} pipeline stages: it has only {len(candidates)} place(s) to "
                f"cut, before {candidates} (the elements of its repeated block lists and the modules around them). "
                f"Use at most {len(candidates) + 1} stages, or pass Strategy(split_points=[...]) with deeper module "
                "paths.")
        cuts = balanced_cuts(gm, roles, candidates, n_stages, flops_per_byte, devices) if n_stages > 1 else []
    return _build(gm, roles, [first[c] for c in cuts], cuts, candidates, n_stages)


def _build(gm, roles, cut_pos, cuts, candidates, n_stages) -> StageSplit:
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    acts = _classify(gm, roles)
    out_node = nodes[-1]
    loss = out_node.args[0]
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    if loss.name not in acts:
        raise StrategyError(f"the loss ({loss.name}) does not depend on both the parameters and the batch; "
                            "nothing to pipeline")

    def stage_of(n) -> int:
        return sum(1 for c in cut_pos if pos[n] >= c)

    act_stage = {n: stage_of(n) for n in nodes if n.name in acts}
    act_stage[loss] = n_stages - 1
    writers, written = _buffer_writes(gm, roles, act_stage)
    # the last stage to use each activation (the loss counts as a use on the last stage)
    last_use = {n: max([act_stage[u] for u in n.users if u in act_stage] + [act_stage[n]]) for n in act_stage}
    boundary = {s: [n for n in nodes if n in act_stage and act_stage[n] < s <= last_use[n]] for s in range(n_stages + 1)}
    stages, shared = [], {}
    for s in range(n_stages):
        own = [n for n in nodes if act_stage.get(n) == s or writers.get(n) == s]
        outs = [loss] if s == n_stages - 1 else boundary[s + 1]
        st = _stage_graph(gm, roles, s, own, boundary[s], outs, acts, is_last=s == n_stages - 1)
        st.written = [k for k, ws in written.items() if ws == s]
        for k in st.params:
            shared.setdefault(k, []).append(s)
        stages.append(st)
        if not own:
            raise StrategyError(f"stage {s} would compute nothing (cuts {cuts}); choose split points that each start a "
                                f"different part of the model, from {candidates}")
    return StageSplit(stages, list(cuts), candidates, {k: v for k, v in shared.items() if len(v) > 1})


def _writes(n: torch.fx.Node) -> list:
    """The argument nodes an in-place op writes (``copy_``'s destination; ``native_batch_norm``'s running statistics)."""
    schema = getattr(n.target, "_schema", None)
    if n.op != "call_function" or schema is None:
        return []
    if n.target is torch.ops.aten.native_batch_norm.default:    # writes its running statistics, undeclared
        training = n.args[5] if len(n.args) > 5 else n.kwargs.get("training", False)
        return [a for a in n.args[3:5] if isinstance(a, torch.fx.Node)] if training else []
    out = []
    for arg, a in zip(schema.arguments, n.args):
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, torch.fx.Node):
            out.append(a)
    return out


def _buffer_writes(gm, roles: dict, act_stage: dict) -> tuple:
    """Buffers the forward writes (BatchNorm's running statistics and step count): each belongs to the one stage whose
    activations read it, and the nodes that write it run there. Returns ``(writer node -> stage, buffer key ->
    stage)``; a written buffer read by two stages is refused (its update would happen on one of them only)."""
    writers, written = {}, {}
    for n in gm.graph.nodes:
        for dst in _writes(n):
            if dst.op != "placeholder" or roles.get(dst.name, (None,))[0] != Role.BUFFER:
                continue
            key = roles[dst.name][1]
            readers = sorted({act_stage[u] for u in dst.users if u in act_stage})
            if len(readers) > 1:
                raise StrategyError(
                    f"buffer {key!r} is written in forward (module '{key.rsplit('.', 1)[0] if '.' in key else '(top)'}', "
                    f"e.g. BatchNorm running statistics) and read by pipeline stages {readers}: each stage would "
                    "keep its own copy of it. Cut the model so that the module's reads fall in one stage "
                    "(Strategy(split_points=[...])), or put that module in eval mode.")
            if not readers:            # a step count (add(num_batches_tracked, 1)): the stage that runs its module
                mod = key.rsplit(".", 1)[0] if "." in key else ""
                readers = sorted({st for m, st in act_stage.items() if _within(M.get(m, M.MODULE, ""), {mod})})
            stage = readers[0] if readers else 0
            writers[n] = stage
            written[key] = stage
    return writers, written


def _stage_graph(gm, roles, s, own, acts_in, outs, acts, is_last) -> StageGraph:
    needed_rep, needed_ph = [], []
    seen = set()

    def visit(n):
        if n in seen or n.name in acts and n not in own:
            return
        seen.add(n)
        for a in n.all_input_nodes:
            if a.name in acts and a not in own:
                continue
            visit(a)
        if n.op == "placeholder":
            needed_ph.append(n)
        elif n not in own:
            needed_rep.append(n)

    for n in own:
        visit(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    rank = {Role.PARAM: 0, Role.BUFFER: 1, Role.INPUT: 2, Role.TARGET: 3}
    needed_ph.sort(key=lambda n: (rank[roles[n.name][0]], order[n]))
    g = torch.fx.Graph()
    env = {}
    inputs = []
    for n in needed_ph:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)
        inputs.append(roles[n.name])
    for n in acts_in:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)
        inputs.append((Role.ACT, n.name))
    for n in sorted(needed_rep + list(own), key=order.get):   # the whole-model order: a weight's transpose
        # stays next to its use, so backward produces that weight's gradient there too (bucket overlap)
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[n] for n in outs))
    sgm = torch.fx.GraphModule(gm, g)
    modules = []
    for n in own:
        mod = M.get(n, M.MODULE)
        if mod and mod not in modules:
            modules.append(mod)
    outputs = [(Role.LOSS, "loss")] if is_last else [(Role.ACT, n.name) for n in outs]
    return StageGraph(s, sgm, inputs, outputs, [n.name for n in own], [n.name for n in needed_rep], modules,
                      sum(_node_flops(n) for n in own))


class SplitStages(Pass):
    """The pass form of :func:`split_stages`, configured when made; the :class:`StageSplit` goes to the result's
    ``info['split']`` and to ``ctx.scratch['split_stages']``. The graph is unchanged."""
    name = "split_stages"

    def __init__(self, n_stages: int, roles: dict, split_points=None, module_types: dict | None = None,
                 flops_per_byte: float = 0.0):
        self.n_stages, self.roles, self.split_points = n_stages, roles, split_points
        self.module_types, self.flops_per_byte = module_types, flops_per_byte

    def run(self, gm, ctx) -> PassResult:
        split = split_stages(gm, self.roles, self.n_stages, self.split_points, self.module_types, self.flops_per_byte)
        ctx.scratch[self.name] = split
        ctx.notes.append(f"split_stages: {len(split.stages)} stages, cuts before {split.cuts}")
        return PassResult(gm, modified=False, info={"split": split})
