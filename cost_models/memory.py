"""Memory per rank: liveness over a graph, and the closed forms it is checked against.

Liveness (:func:`liveness`) walks a graph in order. Every tensor a node makes is a *storage*
that lives from its producer to the last user of any alias of it; views (ops whose schema says
the output aliases an input, plus ``_unsafe_view``; a ``reshape`` of a non-contiguous value, whose fake
value has a storage of its own, copies), in-place ops, ``getitem`` of a multi-output
op and ``wait_tensor`` alias a storage rather than make one. Placeholders belong to the caller
and live the whole step; graph outputs live to the end. Each storage gets a category::

    param, buffer, opt_state, input      placeholders, by node.meta["fxpar_role"] (a ZeRO ``param_shard``
                                         is a view of its whole parameter: no bytes of its own)
    activation                           made in the forward phase, read by a backward node
    grad                                 made in backward, read by the optimizer or returned
    new_state                            made by the optimizer and returned (updated params/state)
    temporary                            everything else

Before/after of what the walk sees (``x`` a placeholder, ``w`` a param)::

    %t   = aten.t(%w)              -> alias of w, no new bytes
    %mm  = aten.mm(%x, %t)         -> new storage, live until its last user
    %r   = aten.relu(%mm)          -> new storage; %mm dies here if %r was its last user

Closed forms: ZeRO model-state bytes for mixed-precision Adam (Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §5: 2Ψ fp16 params,
2Ψ fp16 grads, KΨ = 12Ψ fp32 optimizer state) and activation bytes per transformer layer
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
eq. 1 and Table 2: ``sbh(34 + 5as/h)`` with 16-bit activations and 1-byte dropout masks).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from fxpar import meta as M
from fxpar.roles import Role

from .compute import concrete, tensor_bytes
from .step_memory import sequence_peak

__all__ = ["Storage", "Liveness", "liveness", "infer_phases", "peak_over_executions", "sequence_peak",
           "zero_model_state_bytes", "korthikanti_activation_bytes", "CATEGORIES"]

CATEGORIES = ("param", "buffer", "opt_state", "input", "activation", "grad", "new_state", "temporary")
_OPT_ROLES = (Role.OPT_STATE, Role.LR, Role.STEP)
_ROLE_CATEGORY = {Role.PARAM: "param", Role.BUFFER: "buffer", Role.OPT_STATE: "opt_state"}
_MAY_COPY = {torch.ops.aten.reshape.default, torch.ops.aten.flatten.using_ints}
_ALIAS_TARGETS = {torch.ops.aten._unsafe_view.default, torch.ops.aten._reshape_alias.default,
                  torch.ops._c10d_functional.wait_tensor.default}


@dataclass
class Storage:
    """One allocation: bytes, the node that made it, first and last step index, category."""
    nbytes: float
    producer: torch.fx.Node
    start: int
    end: int
    category: str = "temporary"
    size: object = None          # nbytes as the graph has it: an int, or a SymInt on a symbolic graph
    key: object = None           # the fake value's storage: the same key in two graphs of a stage is one tensor
    keys: set = field(default_factory=set)   # ``key`` and the fake storages of the aliases that resolve here
    role: str | None = None      # a placeholder's ``fxpar_role`` (what the runtime hands it)

    def __post_init__(self):
        if self.key is not None:
            self.keys.add(self.key)


@dataclass
class Liveness:
    """Result of :func:`liveness`. ``live[i]`` is the bytes live while node ``i`` runs."""
    storages: list = field(default_factory=list)
    live: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    peak_bytes: float = 0.0
    peak_index: int = 0
    peak_breakdown: dict = field(default_factory=dict)     # category -> bytes live at the peak
    outputs: list = field(default_factory=list)            # per flat graph output: its Storage, or None
    out_grad_of: list = field(default_factory=list)        # per flat graph output: its fxpar_grad_of, or None
    out_parts: list = field(default_factory=list)          # per flat graph output: all its Storages (a tuple: several)

    @property
    def peak_node(self):
        return self.nodes[self.peak_index] if self.nodes else None

    def rebound(self, base: torch.fx.GraphModule, gm: torch.fx.GraphModule) -> "Liveness":
        """This liveness, made for ``base``, as that of ``gm``: a graph with the same code on the same shapes (two
        stages' identical gradient sums). The bytes are the same; each storage's producer node and fake-storage
        keys become ``gm``'s, since the step walk (``cost_models.step_memory``) links graphs by those keys."""
        pairs = list(zip(base.graph.nodes, gm.graph.nodes))
        if len(pairs) != len(gm.graph.nodes) or len(pairs) != len(base.graph.nodes):
            raise ValueError(f"Liveness.rebound: the graphs have {len(base.graph.nodes)} and {len(gm.graph.nodes)} "
                             "nodes; rebind only to a graph with the same code")
        node_of = dict(pairs)
        key_of = {}
        for b, n in pairs:
            bv, nv = b.meta.get("val"), n.meta.get("val")
            bvs = bv if isinstance(bv, (list, tuple)) else [bv]
            nvs = nv if isinstance(nv, (list, tuple)) else [nv]
            for x, y in zip(bvs, nvs):
                kx, ky = _storage_key(x), _storage_key(y)
                if kx is not None and ky is not None:
                    key_of[kx] = ky
        new = {id(s): dataclasses.replace(s, producer=node_of[s.producer], key=key_of.get(s.key, s.key),
                                          keys={key_of.get(k, k) for k in s.keys}) for s in self.storages}

        def swap(s):
            return None if s is None else new[id(s)]
        return dataclasses.replace(
            self, storages=list(new.values()), nodes=[node_of[n] for n in self.nodes],
            outputs=[swap(s) for s in self.outputs],
            out_parts=[[swap(s) for s in parts] for parts in self.out_parts])

    def totals(self) -> dict:
        """category -> total bytes of every storage of that category (not only at the peak)."""
        out = dict.fromkeys(CATEGORIES, 0.0)
        for s in self.storages:
            out[s.category] += s.nbytes
        return out

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.peak_breakdown.items() if v)
        where = self.peak_node.name if self.peak_node is not None else "-"
        return f"peak {self.peak_bytes / 2**20:.1f} MiB at {where} ({parts})"


def _is_alias_op(target) -> bool:
    if target in _ALIAS_TARGETS or target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _copies(node) -> bool:
    """A ``reshape`` whose input is not contiguous copies (its schema says alias): its value and its input's
    value sit on different storages."""
    if node.target not in _MAY_COPY:
        return False
    val, base = node.meta.get("val"), _first_tensor_arg(node)
    bval = base.meta.get("val") if base is not None else None
    if not (isinstance(val, torch.Tensor) and isinstance(bval, torch.Tensor)):
        return False
    try:
        return val.untyped_storage()._cdata != bval.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):    # a tensor without a storage (a functional wrapper)
        return False


def _storage_key(val):
    """Identity of a (fake) value's storage: split graphs share their joint graph's fake values, so a B input
    and the F output it is have one key."""
    try:
        return val.untyped_storage()._cdata
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def _first_tensor_arg(node):
    for a in node.args:
        if isinstance(a, torch.fx.Node):
            return a
    return None


def infer_phases(gm: torch.fx.GraphModule) -> dict:
    """node -> phase: ``node.meta["fxpar_phase"]`` where present, else inferred.

    Inference (for graphs not made by ``fxpar.capture``): the first output is the loss and its
    ancestors are ``forward``; from the first non-forward node that reads an ``opt_state``,
    ``lr`` or ``step`` placeholder on, nodes are ``optimizer`` (a traced step runs the optimizer
    last); the rest are ``backward``.
    """
    nodes = list(gm.graph.nodes)
    if all(M.PHASE.name in n.meta for n in nodes if n.op == "call_function"):
        return {n: n.meta.get(M.PHASE.name, "input") for n in nodes}
    out = next(n for n in reversed(nodes) if n.op == "output")
    flat = torch.fx.node.map_aggregate(out.args[0], lambda x: x)
    first = flat
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    forward: set = set()
    stack = [first] if isinstance(first, torch.fx.Node) else []
    while stack:
        n = stack.pop()
        if n in forward:
            continue
        forward.add(n)
        stack.extend(n.all_input_nodes)
    phases, in_optimizer = {}, False
    for n in nodes:
        if M.PHASE.name in n.meta:
            phases[n] = n.meta[M.PHASE.name]
        elif n.op == "placeholder":
            phases[n] = "input"
        elif n in forward:
            phases[n] = "forward"
        else:
            in_optimizer = in_optimizer or any(
                a.op == "placeholder" and a.meta.get(M.ROLE.name) in _OPT_ROLES for a in n.all_input_nodes)
            phases[n] = "optimizer" if in_optimizer else "backward"
    return phases


def _category(s_node, users_phase: set, phases: dict, is_output: bool) -> str:
    if s_node.op == "placeholder":
        return _ROLE_CATEGORY.get(s_node.meta.get(M.ROLE.name, Role.INPUT), "input")
    ph = phases.get(s_node)
    if ph == "forward" and "backward" in users_phase:
        return "activation"
    if ph == "backward" and (M.GRAD_OF.name in s_node.meta or "optimizer" in users_phase or is_output):
        return "grad"
    if ph == "optimizer" and is_output:
        return "new_state"
    return "temporary"


def liveness(gm: torch.fx.GraphModule, phases: dict | None = None) -> Liveness:
    """Live bytes at every node of ``gm``, the peak, and what is live at the peak."""
    phases = phases if phases is not None else infer_phases(gm)
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    last = len(nodes) - 1
    storage_of: dict = {}            # node -> Storage or list[Storage | None]
    storages: list = []
    for i, n in enumerate(nodes):
        if n.op == "output":
            continue
        val = n.meta.get("val")
        if n.op == "call_function" and _is_alias_op(n.target) and not _copies(n):
            base = n.args[0] if n.target is operator.getitem else _first_tensor_arg(n)
            src = storage_of.get(base)
            if n.target is operator.getitem and isinstance(src, list):
                src = src[n.args[1]] if n.args[1] < len(src) else None
            elif isinstance(src, list):
                src = next((s for s in src if s is not None), None)
            if isinstance(val, (list, tuple)):
                storage_of[n] = [src] * len(val)
            else:
                storage_of[n] = src
                if src is not None and _storage_key(val) is not None:
                    src.keys.add(_storage_key(val))     # a wait_tensor's fake value may have a storage of its own
            continue
        if isinstance(val, torch.Tensor):
            # a ZeRO stage 1/2 ``param_shard`` input is the runtime's view of a whole parameter already counted
            # host memory (ZeRO-Offload on a device: M.ON_HOST) is not the device's
            raw = 0 if (n.op == "placeholder" and n.meta.get(M.ROLE.name) == Role.PARAM_SHARD) or \
                n.meta.get(M.ON_HOST.name) else tensor_bytes(val)
            s = Storage(concrete(raw), n, 0 if n.op == "placeholder" else i, i, size=raw, key=_storage_key(val),
                        role=n.meta.get(M.ROLE.name) if n.op == "placeholder" else None)
            storages.append(s)
            storage_of[n] = s
        elif isinstance(val, (list, tuple)):
            outs = []
            for v in val:
                if isinstance(v, torch.Tensor):
                    raw = 0 if n.meta.get(M.ON_HOST.name) else tensor_bytes(v)
                    s = Storage(concrete(raw), n, i, i, size=raw, key=_storage_key(v),
                                role=n.meta.get(M.ROLE.name) if n.op == "placeholder" else None)
                    storages.append(s)
                    outs.append(s)
                else:
                    outs.append(None)
            storage_of[n] = outs
    # extend each storage to the last user of any alias; collect the phases that read it
    readers: dict = {}
    outputs: set = set()
    def touch(s, u):
        if s is None:
            return
        if u.op == "output":
            s.end = last
            outputs.add(id(s))
        else:
            s.end = max(s.end, index[u])
            if not (u.op == "call_function" and _is_alias_op(u.target)):
                readers.setdefault(id(s), set()).add(phases.get(u))

    for n in nodes:
        st = storage_of.get(n)
        if not isinstance(st, list):
            for u in n.users:
                touch(st, u)
            continue
        for u in n.users:
            # a getitem of a multi-output node reads only the element it selects (linear, not
            # outputs x users: a _foreach_ op over every parameter has one getitem per parameter)
            if u.target is operator.getitem and isinstance(u.args[1], int) and u.args[1] < len(st):
                touch(st[u.args[1]], u)
            else:
                for s in st:
                    touch(s, u)
    for s in storages:
        if s.producer.op == "placeholder":
            s.start, s.end = 0, last
        s.category = _category(s.producer, readers.get(id(s), set()), phases, id(s) in outputs)
    # sweep: +bytes at start, -bytes after end
    delta = [0.0] * (len(nodes) + 1)
    for s in storages:
        delta[s.start] += s.nbytes
        delta[s.end + 1] -= s.nbytes
    live, cur = [], 0.0
    for i in range(len(nodes)):
        cur += delta[i]
        live.append(cur)
    pi = max(range(len(live)), key=live.__getitem__) if live else 0
    breakdown = dict.fromkeys(CATEGORIES, 0.0)
    for s in storages:
        if s.start <= pi <= s.end:
            breakdown[s.category] += s.nbytes
    outs: list = []
    if nodes and nodes[-1].op == "output":
        torch.fx.node.map_aggregate(nodes[-1].args[0], outs.append)     # flat, in output order
    out_storages, parts = [], []
    for o in outs:
        st = storage_of.get(o) if isinstance(o, torch.fx.Node) else None
        out_storages.append(next((x for x in st if x is not None), None) if isinstance(st, list) else st)
        parts.append([x for x in st if x is not None] if isinstance(st, list) else [st] if st is not None else [])
    grad_of = [o.meta.get(M.GRAD_OF.name) if isinstance(o, torch.fx.Node) else None for o in outs]
    return Liveness(storages, live, nodes, live[pi] if live else 0.0, pi, breakdown, out_storages, grad_of, parts)


def peak_over_executions(executions, cache: dict | None = None) -> float:
    """Peak bytes over a sequence of ``(graph, microbatch)`` executions on one rank.

    The schedule-aware form: persistent state (param/buffer/opt_state placeholders) is counted
    once per distinct graph; within an execution the graph's own liveness applies; the outputs
    of an execution (e.g. a forward stage's saved activations) stay live until the last
    execution of the same microbatch has run. ``cache`` maps graph -> :class:`Liveness`.
    """
    cache = {} if cache is None else cache
    executions = list(executions)
    last_of_mb = {mb: i for i, (_, mb) in enumerate(executions)}
    persistent: dict = {}
    held: dict = {}               # microbatch -> bytes of outputs kept alive
    peak = 0.0
    for i, (gm, mb) in enumerate(executions):
        lv = cache.get(gm) or cache.setdefault(gm, liveness(gm))
        state = sum(s.nbytes for s in lv.storages if s.category in ("param", "buffer", "opt_state"))
        persistent[id(gm)] = state
        transient = [b - state for b in lv.live] or [0.0]
        carried = sum(held.values())
        peak = max(peak, sum(persistent.values()) + carried + max(transient))
        outs = sum(s.nbytes for s in lv.storages
                   if s.end == len(lv.nodes) - 1 and s.producer.op != "placeholder")
        held[mb] = held.get(mb, 0.0) + outs
        if last_of_mb[mb] == i:
            held.pop(mb, None)
    return peak


def zero_model_state_bytes(num_params: float, stage: int, dp: int, optimizer_bytes_per_param: int = 12) -> float:
    """Model-state bytes per rank for mixed-precision Adam under ZeRO stage 0–3.

    Rajbhandari et al. 2020, Fig. 1 / §5.1 with K = 12: stage 0 ``16Ψ``; stage 1 (optimizer
    states sharded) ``4Ψ + 12Ψ/N``; stage 2 (+ gradients) ``2Ψ + 14Ψ/N``; stage 3 (+ parameters)
    ``16Ψ/N``.
    """
    psi, k, n = float(num_params), optimizer_bytes_per_param, dp
    forms = {0: 4 * psi + k * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
             3: (4 + k) * psi / n}
    if stage not in forms:
        raise ValueError(f"ZeRO stage={stage!r}: use 0, 1, 2 or 3")
    return forms[stage]


def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, tp: int = 1,
                                 sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Activation bytes of one transformer layer (Korthikanti et al. 2022, Table 2).

    ``none``: ``sbh(34 + 5as/h)`` at tp=1; with tensor parallelism ``sbh(10 + 24/t + 5as/(ht))``,
    and with sequence parallelism ``sbh/t · (34 + 5as/h)``. ``selective`` recompute drops the
    ``5as/h`` term; ``full`` keeps only the layer input, ``2sbh`` (``2sbh/t`` with sequence parallel).
    """
    t = tp
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    attn = 0 if recompute == "selective" else 5 * a * s / (h * t)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute={recompute!r}: use 'none', 'selective' or 'full'")
    if sequence_parallel:
        return s * b * h * (34 / t + attn)
    return s * b * h * (10 + 24 / t + attn)
