"""recompute: activation checkpointing on a stage's joint graph -- backward recomputes forward values
instead of reading them from the forward.

A *policy* decides, per forward node, ``"save"`` or ``"recompute"`` (decisions apart from mechanism, as
JAX's ``checkpoint_policies``); the feature ``fxpar.features.recompute`` records the decision per stage in
the Plan's ``recompute`` section; this pass carries it out. For each forward value marked ``recompute``
that a backward node reads, the forward chain that makes it is copied into the backward phase just before
its first backward use, up to values that are kept: ``save``-marked nodes, placeholders, random ops
(``bernoulli``, ``rand*``, ``native_dropout``, ``empty``: never recomputed, so a dropout mask is the
forward's own and the math is unchanged bit for bit) and ops that write an input (:func:`writes_input`:
BatchNorm in training mode updates its running statistics; run twice, it would update them twice). A
training BatchNorm's output is still recomputed, from the batch statistics its forward saved
(``x * (invstd * weight) + (bias - mean * invstd * weight)``, as torch's CPU kernel computes it): the
recomputed values are the forward's, and the running statistics are written once. The copies are tagged ``fxpar_phase="backward"``,
keep ``fxpar_module`` and record ``fxpar_recompute_of`` (the forward node they copy); backward's uses point
at them. ``split_graphs`` then saves, per microbatch, only what backward still reads from the forward.

Before (``a`` and ``g`` marked recompute, ``h`` saved)::

    h   = addmm(b, x, t)          # forward        F -> (loss, saved h, saved a, saved g)
    a   = gelu(h)                 # forward
    g   = mul(a, a)               # forward
    ... = gelu_backward(d, a)     # backward reads a
    ... = mul(d2, g)              # backward reads g

After::

    h   = addmm(b, x, t)          # forward        F -> (loss, saved h)
    a   = gelu(h); g = mul(a, a)  # forward (their forward users only)
    a_r = gelu(h)                 # backward, fxpar_recompute_of="a"
    ... = gelu_backward(d, a_r)
    g_r = mul(a_r, a_r)           # backward, fxpar_recompute_of="g"
    ... = mul(d2, g_r)

Policies (:data:`POLICIES`): ``none``; ``full`` (each repeated block recomputed from its input: save only
values a forward user in another block reads); ``selective`` (Korthikanti et al., MLSys'23: save matmul
outputs, recompute elementwise work and the attention core); ``auto`` (:func:`auto_decide`: the least
recompute FLOPs whose saved bytes fit a budget, by min-cut); or a user's ``policy(node) -> "save" |
"recompute"``. :func:`revolve_forward_steps` gives Revolve's optimal count for a chain of equal steps.
"""
from __future__ import annotations

import operator
from math import comb

import torch
import torch.fx
from torch._guards import detect_fake_mode

from fxpar import meta as M
from fxpar.errors import PassError
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.roles import Role

__all__ = ["Recompute", "SAVE", "RECOMPUTE", "POLICIES", "is_random", "writes_input", "decide", "demands", "saved_bytes",
           "auto_decide", "revolve_forward_steps", "policy_full", "policy_selective", "policy_none"]

SAVE, RECOMPUTE = "save", "recompute"
aten = torch.ops.aten
_MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.linear, aten.matmul}
_UNINITIALISED = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
_STORAGE_ALIASES = {aten._unsafe_view.default, aten._reshape_alias.default}
# BatchNorm ops that update running statistics in place when ``training`` (argument 5) is true, though their
# schema does not mark the write
_BATCH_NORM_UNMARKED = {aten.native_batch_norm, aten.cudnn_batch_norm, aten.miopen_batch_norm, aten.batch_norm}
# BatchNorm ops returning (output, batch mean, batch invstd, ...) in training mode: output recomputable from the
# saved statistics; op -> index of its ``training`` argument (None: always training)
_BATCH_NORM_STATS = {aten.native_batch_norm.default: 5, aten._native_batch_norm_legit.default: 5,
                     aten._batch_norm_with_update.default: None}


# ---- what a node is ------------------------------------------------------------------------------------------
def _packet(node):
    return getattr(node.target, "overloadpacket", node.target)


def is_random(node: torch.fx.Node) -> bool:
    """A node whose value recomputing would change: a seeded random op (dropout's ``bernoulli``, ``rand*``,
    ``native_dropout``; torch tags them ``nondeterministic_seeded``) or uninitialised memory (``empty``)."""
    if node.op != "call_function":
        return False
    if _packet(node) in _UNINITIALISED:
        return True
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()) and _dropout_p(node) != 0.0


def writes_input(node: torch.fx.Node) -> bool:
    """A node that writes one of its inputs in place -- BatchNorm in training mode updating its running
    statistics (``native_batch_norm``, ``_native_batch_norm_legit``, ``_batch_norm_with_update``). Recomputing
    it would write them again, so it is never recomputed."""
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    if _packet(node) in _BATCH_NORM_UNMARKED:
        running_mean = node.args[3] if len(node.args) > 3 else node.kwargs.get("running_mean")
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
        return bool(training) and running_mean is not None
    return False


def _kept(node) -> bool:
    """A forward node never recomputed: a random op or one that writes an input."""
    return is_random(node) or writes_input(node)


def _batch_norm_parts(node):
    """For ``getitem(bn, 0)`` of a training BatchNorm whose batch mean and invstd the forward reads out
    (``getitem(bn, 1)``, ``getitem(bn, 2)``): ``(bn, input, weight, bias, mean, invstd)``, from which the output
    is recomputed without running the BatchNorm again. None for any other node."""
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 0:
        return None
    bn = node.args[0]
    if not isinstance(bn, torch.fx.Node) or bn.op != "call_function" or bn.target not in _BATCH_NORM_STATS:
        return None
    at = _BATCH_NORM_STATS[bn.target]
    if at is not None and not (bn.args[at] if len(bn.args) > at else bn.kwargs.get("training", False)):
        return None
    items = {u.args[1]: u for u in bn.users if u.target is operator.getitem and _is_forward(u)}
    if 1 not in items or 2 not in items:
        return None
    x, w, b = (bn.args + (None, None))[:3]
    return bn, x, w, b, items[1], items[2]


def _reads(node) -> list:
    """The nodes a recomputed copy of ``node`` reads: a training BatchNorm's output reads the BatchNorm's
    input, weight, bias and saved statistics, any other node its own inputs."""
    parts = _batch_norm_parts(node)
    if parts is None:
        return list(node.all_input_nodes)
    return [a for a in parts[1:] if isinstance(a, torch.fx.Node)]


def _dropout_p(node):
    """An attention op's ``dropout_p`` (0.0: deterministic though tagged random); None for other ops."""
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == "dropout_p":
            return node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
    return None


def _is_forward(node) -> bool:
    return node.op == "call_function" and M.get(node, M.PHASE) == "forward"


def _aliases(node) -> bool:
    """Whether ``node``'s tensor shares an input's storage (a view, ``_unsafe_view``, a chunk of ``split``)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _aliases(node.args[0])
    if node.target in _STORAGE_ALIASES:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return int(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    return 0


def _root(node):
    """The node whose storage ``node``'s tensor lives in."""
    while _aliases(node):
        src = node.args[0]
        node = src.args[0] if node.target is operator.getitem else src
    return node


def _tuple_valued(node) -> bool:
    return isinstance(node.meta.get("val"), (list, tuple))


# ---- policies: node -> "save" | "recompute" ------------------------------------------------------------------
def policy_none(node) -> str:
    return SAVE


def _block(module: str) -> str:
    """The repeated block a module path belongs to (``blocks.3.attn`` -> ``blocks.3``), else its top module."""
    parts = (module or "").split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]


def policy_full(node) -> str:
    """Recompute each block from its input: save a value only where a forward user in another block (or the
    stage's output) reads it -- the values crossing block boundaries."""
    b = _block(M.get(node, M.MODULE, ""))
    for u in node.users:
        if u.op == "output" or (_is_forward(u) and _block(M.get(u, M.MODULE, "")) != b):
            return SAVE
    return RECOMPUTE


def policy_selective(node) -> str:
    """Korthikanti et al. (MLSys'23), selective: keep matmul outputs; recompute the elementwise work, the
    norms and the attention core (softmax; dropout masks are always kept)."""
    return SAVE if _packet(node) in _MATMULS else RECOMPUTE


POLICIES = {"none": policy_none, "full": policy_full, "selective": policy_selective}


def decide(gm: torch.fx.GraphModule, policy) -> list:
    """Names of the forward nodes ``policy`` marks ``recompute`` (random ops and ops that write an input
    never; a ``getitem`` only with its multi-output source, so a tuple is never handed from forward to
    backward -- except a training BatchNorm's output, recomputed from the statistics its forward saved)."""
    out, chosen = [], set()
    for n in gm.graph.nodes:
        if not _is_forward(n) or _kept(n):
            continue
        d = policy(n)
        if d not in (SAVE, RECOMPUTE):
            raise PassError(f"recompute policy {getattr(policy, '__name__', policy)!r} returned {d!r} for node "
                            f"{n.name} ({n.target}, module {M.get(n, M.MODULE, '')!r}); return 'save' or "
                            "'recompute' (activation offload is not built yet)")
        if d == RECOMPUTE and (_batch_norm_parts(n) is not None
                               or not (n.target is operator.getitem and n.args[0] not in chosen
                                       and _tuple_valued(n.args[0]))):
            chosen.add(n)
            out.append(n.name)
    return out


# ---- what a decision costs ----------------------------------------------------------------------------------
def demands(gm: torch.fx.GraphModule, recompute) -> tuple:
    """``(copied, saved)``: the forward nodes backward will recompute and the values (forward nodes or
    placeholders) it will still read from the forward, for the set of node names ``recompute``."""
    names = set(recompute)
    copied, saved, seen = [], [], set()
    stack = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and M.get(n, M.PHASE) == "backward":
            stack += [a for a in n.all_input_nodes if a.op == "placeholder" or _is_forward(a)]
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        if a.name in names and _is_forward(a):
            copied.append(a)
            stack += [x for x in _reads(a) if x.op != "get_attr"]
        else:
            saved.append(a)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(copied, key=order.get), sorted(saved, key=order.get)


def saved_bytes(saved, roles: dict) -> int:
    """Bytes ``saved`` keep alive per microbatch, as the runtime measures them: each storage once (a view
    keeps its base), weights left out (``roles``: placeholder name -> role), an input counts its own bytes."""
    roots = {}
    for n in saved:
        r = _root(n)
        if r.op == "placeholder":
            roots[r] = 0 if roles.get(r.name) in (Role.PARAM, Role.BUFFER) else _nbytes(r.meta.get("val"))
        else:
            roots[r] = _nbytes(r.meta.get("val"))
    return sum(roots.values())


def auto_decide(gm: torch.fx.GraphModule, roles: dict, budget_bytes: int, flops_of, in_flight: int = 1) -> dict:
    """The least recompute FLOPs whose saved bytes (× ``in_flight`` microbatches) fit ``budget_bytes``.

    Min-cut (networkx), as AOTAutograd's partitioner but with a price on recompute: each forward node ``v``
    is an edge ``v_in -> v_out`` costing its storage's bytes (cut: ``v`` saved); ``source -> v_in`` costs
    ``λ·flops(v)`` (cut: ``v`` recomputed); data edges, ``source -> placeholder/random`` and ``value read by
    backward -> sink`` are uncuttable. A cut is then a consistent plan (what backward needs is saved or
    recomputed from saved values) costing ``bytes + λ·FLOPs``. λ = 0 gives the smallest feasible plan; a
    bisection on λ finds the cheapest-recompute plan meeting the budget. A min-cut over hundreds of values is
    exact for each λ, where an exact integer program's search would not stay small; the price is that a cut
    reaches only plans on the bytes/FLOPs lower convex hull (Lagrangian relaxation), so a greedy pass then
    saves, costliest first, each recomputed value the budget still holds. Not proven optimal between hull
    points; exact bytes (each storage once) are checked for every plan considered, so the budget always holds.
    Raises ``ValueError`` naming the smallest feasible bytes when the budget is below it."""
    def cut_for(lam):
        return _min_cut(gm, roles, flops_of, lam)

    def cost(names):                  # exact: bytes as the runtime measures them (each storage once), × in flight
        copied, saved = demands(gm, names)
        return saved_bytes(saved, roles) * in_flight, sum(flops_of(n) for n in copied)

    smallest = cut_for(0.0)
    s_bytes, s_flops = cost(smallest)
    if s_bytes > budget_bytes:
        raise ValueError(f"memory_budget_gb={budget_bytes / 1e9:.6g} GB ({budget_bytes} bytes) is below the smallest "
                         f"feasible plan: {s_bytes} bytes ({s_bytes / 1e9:.6g} GB) of saved activations "
                         f"({in_flight} microbatch(es) in flight). Raise the budget to at least that, or use fewer "
                         "microbatches in flight")
    best = (s_flops, smallest, s_bytes)
    none_bytes, _ = cost([])
    if none_bytes <= budget_bytes:
        return {"recompute": [], "saved_bytes": none_bytes // in_flight, "recompute_flops": 0,
                "smallest_bytes": s_bytes // in_flight}
    lo, hi = -30.0, 30.0                              # log2 of λ (bytes per FLOP)
    for _ in range(16):
        mid = (lo + hi) / 2
        names = cut_for(2.0 ** mid)
        b, f = cost(names)
        if b <= budget_bytes:
            lo = mid
            if f < best[0]:
                best = (f, names, b)
        else:
            hi = mid
    f, names, b = best
    # then greedily keep the costliest recomputed values the budget still holds (reaches plans off the hull)
    copied, _ = demands(gm, names)
    for x in sorted((n for n in copied if not _tuple_valued(n) and flops_of(n) > 0), key=flops_of, reverse=True):
        trial = [m for m in names if m != x.name]
        tb, tf = cost(trial)
        if tb <= budget_bytes and tf < f:
            names, b, f = trial, tb, tf
    return {"recompute": names, "saved_bytes": b // in_flight, "recompute_flops": f,
            "smallest_bytes": s_bytes // in_flight}


def _min_cut(gm, roles, flops_of, lam: float) -> list:
    import networkx as nx
    g = nx.DiGraph()
    S, T = "__source", "__sink"
    needed = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and M.get(n, M.PHASE) == "backward":
            needed.update(a for a in n.all_input_nodes if a.op == "placeholder" or _is_forward(a))
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            g.add_edge(S, (n, 0))
            weight = roles.get(n.name) in (Role.PARAM, Role.BUFFER)
            g.add_edge((n, 0), (n, 1), capacity=0 if weight else _nbytes(n.meta.get("val")))
        elif _is_forward(n):
            root = _root(n)
            if _tuple_valued(n):
                g.add_edge((n, 0), (n, 1))                            # a tuple is never saved, only its items
            elif root.op == "placeholder":
                g.add_edge((n, 0), (n, 1), capacity=0 if roles.get(root.name) in (Role.PARAM, Role.BUFFER)
                           else _nbytes(root.meta.get("val")))
            else:
                g.add_edge((n, 0), (n, 1), capacity=_nbytes(root.meta.get("val")))
            if _kept(n):
                g.add_edge(S, (n, 0))                                 # never recomputed
            else:
                g.add_edge(S, (n, 0), capacity=int(round(lam * flops_of(n))))
            for a in _reads(n):
                if a.op == "placeholder" or _is_forward(a):
                    g.add_edge((a, 1), (n, 0))
        else:
            continue
        if n in needed:
            g.add_edge((n, 1), T)
    _, (src_side, _) = nx.minimum_cut(g, S, T)
    return [n.name for n in gm.graph.nodes if _is_forward(n) and (n, 0) not in src_side and not _kept(n)]


# ---- the pass ------------------------------------------------------------------------------------------------
def apply_recompute(gm: torch.fx.GraphModule, recompute) -> int:
    """Copy the chains of the forward nodes named in ``recompute`` into backward before their first backward
    use and point backward at the copies. Returns the number of nodes copied."""
    graph = gm.graph
    names = set(recompute)
    marked = {n for n in graph.nodes if n.name in names}
    bad = [n for n in marked if not _is_forward(n) or _kept(n)]
    if bad:
        n = bad[0]
        why = ("a random op (its value would change)" if is_random(n)
               else "an op that writes its input (run again, it would write it twice: BatchNorm's running "
                    "statistics)" if writes_input(n)
               else f"not a forward node ({n.op}, phase {M.get(n, M.PHASE)!r})")
        raise PassError(f"recompute: node {n.name} ({n.target}, module {M.get(n, M.MODULE, '')!r}) is {why}; "
                        "it cannot be recomputed. Mark it 'save' in the policy (or drop it from the Plan's recompute "
                        "section)")
    copies = {}

    def copy_of(v, before):
        todo = [v]
        while todo:                                  # post-order without recursion: inputs first
            x = todo[-1]
            pending = [a for a in _reads(x) if a in marked and a not in copies]
            if pending:
                todo += pending
                continue
            todo.pop()
            if x in copies:
                continue
            remap = lambda a: copies.get(a, a) if a in marked else a      # noqa: E731
            with graph.inserting_before(before):
                parts = _batch_norm_parts(x)
                if parts is None:
                    c = graph.node_copy(x, remap)
                    made = [c]
                else:
                    c, made = _normalise_from_stats(graph, x, *(remap(a) if isinstance(a, torch.fx.Node) else a
                                                                for a in parts[1:]))
            for m in made:
                m.meta.update({k: x.meta[k] for k in (M.MODULE.name,) if k in x.meta})
                m.meta[M.PHASE.name] = "backward"
                M.set_meta(m, M.RECOMPUTE_OF, x.name)
            c.meta.update({k: x.meta[k] for k in ("val", "tensor_meta") if k in x.meta})
            copies[x] = c
        return copies[v]

    for n in list(graph.nodes):
        if n.op != "call_function" or M.get(n, M.PHASE) != "backward":
            continue
        for a in list(n.all_input_nodes):
            if a in marked:
                n.replace_input_with(a, copy_of(a, n))
    return len(copies)


def _normalise_from_stats(graph, out, x, w, b, mean, invstd):
    """``out`` (a training BatchNorm's output) recomputed from its input and the batch statistics its forward
    saved, as torch's CPU kernel computes it: ``alpha = invstd * weight``, ``beta = bias - mean * alpha``,
    ``x * alpha + beta`` (per channel, dim 1). Returns (the output node, every node made)."""
    val = out.meta.get("val")
    shape = [1, -1] + [1] * (val.dim() - 2) if isinstance(val, torch.Tensor) else [1, -1]
    fake_mode = detect_fake_mode([a.meta.get("val") for a in (x, mean, invstd) if isinstance(a, torch.fx.Node)])
    made = []

    def op(target, *args, **kwargs):
        made.append(graph.call_function(target, args, kwargs))
        if fake_mode is not None:                                     # the value's fake tensor, for later passes
            with fake_mode:
                made[-1].meta["val"] = target(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args),
                                              **kwargs)
        return made[-1]

    alpha = invstd if w is None else op(aten.mul.Tensor, invstd, w)
    shift = op(aten.mul.Tensor, mean, alpha)
    beta = op(aten.neg.default, shift) if b is None else op(aten.sub.Tensor, b, shift)
    y = op(aten.add.Tensor, op(aten.mul.Tensor, x, op(aten.view.default, alpha, shape)),
           op(aten.view.default, beta, shape))
    stat_val = mean.meta.get("val")
    if isinstance(val, torch.Tensor) and isinstance(stat_val, torch.Tensor) and stat_val.dtype != val.dtype:
        y = op(aten._to_copy.default, y, dtype=val.dtype)
    return y, made


def _drop_unread_forward(gm) -> None:
    """Erase forward nodes nothing reads any more (values only backward used to read); random ops and ops
    that write an input stay, so the random stream is the one the forward drew and buffers are written once."""
    for n in reversed(list(gm.graph.nodes)):
        if _is_forward(n) and not n.users and not _kept(n):
            gm.graph.erase_node(n)


class Recompute(Pass):
    """Carry out the Plan section ``recompute``'s ``stages[stage]['recompute']`` (what the feature decided) on the
    joint graph."""
    name = "recompute"
    before = ("data_parallel", "bucket")

    def run(self, gm, ctx: PassContext) -> PassResult:
        section = ctx.plan.section("recompute")
        stages = section.stages if section is not None else []
        names = stages[ctx.stage]["recompute"] if ctx.stage < len(stages) else []
        n = apply_recompute(gm, names) if names else 0
        if n:
            _drop_unread_forward(gm)
            ctx.notes.append(f"recompute: stage {ctx.stage}: backward recomputes {n} forward node(s) "
                             f"({section.policy} policy)")
        return PassResult(gm, bool(n), {"copied": n})


# ---- Revolve -------------------------------------------------------------------------------------------------
def revolve_forward_steps(n: int, c: int) -> int:
    """Griewank & Walther, "Algorithm 799: Revolve" (ACM TOMS 26(1), 2000), Prop. 1: the least number of
    forward steps to reverse a chain of ``n`` equal steps with ``c`` checkpoints (the initial state held in one
    of them). With β(s, t) = C(s+t, s) and r the least integer with β(c, r) >= n: ``r·n − β(c+1, r−1)``."""
    if n < 1 or c < 1:
        raise ValueError(f"revolve_forward_steps(n={n}, c={c}): need n >= 1 steps and c >= 1 checkpoints")
    r = 0
    while comb(c + r, c) < n:
        r += 1
    return r * n - comb(c + 1 + r - 1, c + 1) if r else 0
