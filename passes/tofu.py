"""Tofu's search (``sharding="auto"``): choose every operator's split by recursive halving + exact DP.

Wang et al., "Supporting Very Large Models using Automatic Dataflow Graph Partitioning", EuroSys'19:
to partition a graph over G = 2^k devices, split the device set in two, choose for every operator
how to split it in two (or replicate it) at the least cost, then do the same inside each half on
the halved tensors -- k levels (§4). Each level is a dynamic program over the coarsened graph (§5),
here exact variable elimination (``passes.sharding.search``: chains fuse as min-plus products).

Level l is a mesh axis of size 2: ``"tp"`` for G = 2, ``"tp0" .. "tp{k-1}"`` for G > 2 (a dim split
at one level is not split again at a later one: one mesh axis per tensor dim). Per level:

* a variable per operator (per group of a ``_foreach`` op), its labels the candidates of its rule
  (``passes.sharding``) that fit the tensors left by earlier levels; a variable per placeholder,
  labels R or a split (never a partial sum);
* pairwise cost: bytes to redistribute a producer's output into what the consumer needs
  (``fxpar.sharding.redistribute_bytes``, ring closed forms), and each updated parameter and
  optimizer state back into its input's layout; divided by ``TofuCost.link_bytes_per_s``;
* unary cost: the op's FLOPs (``cost_models.compute.node_cost``) over ``flops_per_s``, halved when
  the op's outputs are split or partial; and ``mem_s_per_byte`` per byte of parameter and optimizer
  state a device holds (Tofu partitions to fit memory; without a price on it, replicating
  everything would cost nothing).

Coarsening: rule candidates, FLOPs and edge tables are computed once per operator signature, so the
repeated blocks of a transformer (``blocks.0``, ``blocks.1`` ...) share them; elimination in
min-degree order fuses chains and keeps the live set small. Repeated blocks are searched once
(``blocks="reuse"``, the default): ``passes.tofu_blocks`` assigns every variable to its layer by data
flow, and ``search.solve_blocks`` eliminates each distinct block's interior once as min-plus tables over
its boundary, reused for every identical copy -- exact, the flat DP's optimum (32 layers, 64 devices:
3 eliminations per level instead of 32; DP 2.7 s -> 0.6 s). The result is a
:class:`~passes.propagate_sharding.ShardingResult` (``lower_shardings`` lowers it; ``to_plan()`` is
the JSON for the Plan's ``tensor_parallel`` section) plus the predicted cost. On the test GPT at G = 2 (``explain()``)::

    tofu over 2 devices (levels ['tp']): predicted 1.2e-06 s = comm ... + compute ... + memory ...
      wte_weight     P(None, 'tp')
      addmm          P(None, 'tp')       ...
"""
from __future__ import annotations

import functools
import gc
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from cost_models.compute import concrete, node_cost
from fxpar import meta as M
from fxpar.roles import Role
from fxpar.sharding import R, Sharding, ShardingError, collective_bytes, redistribute_bytes, redistribute_steps

from .propagate_sharding import ShardingResult, placement_fits
from .sharding import OpInfo, groups_of, tensor_leaves
from .sharding.search import Problem
from .tofu_blocks import assign_blocks, block_lists

__all__ = ["TofuCost", "TofuResult", "tofu_search", "plan_cost", "level_axes"]

_ORDER = {"all_reduce": 0, "reduce_scatter": 1, "all_gather": 2, "all_to_all": 3, "slice": 4, "zero": 5}


@dataclass(frozen=True)
class TofuCost:
    """Seconds per byte sent, per FLOP, per byte of parameter/optimizer state held, per collective issued (the
    link's latency: many small collectives cost more than their bytes say); 0 turns a term off."""
    link_bytes_per_s: float = 100e9
    flops_per_s: float = 100e12
    mem_s_per_byte: float = 1e-11
    latency_s: float = 0.0


def _calls(a, b) -> int:
    """Collectives a change of placement along one axis issues (local slices and zeros send nothing)."""
    return sum(1 for kind, _, _ in redistribute_steps(a, b) if kind not in ("slice", "zero"))


@dataclass
class TofuResult:
    sharding: ShardingResult
    levels: list                   # mesh axis per level, each of size 2
    predicted: float               # the objective (seconds): comm of every level + compute + memory
    parts: dict = field(default_factory=dict)   # comm / compute / memory seconds
    seconds: float = 0.0           # search time
    max_table: int = 0             # the largest DP table built (entries)
    blocks: list = field(default_factory=list)  # per level: {"blocks", "solved", "wide"} (search.solve_blocks)
    optima: list = field(default_factory=list)  # per level: the DP's optimum (seconds, that level's terms)
    phases: dict = field(default_factory=dict)  # wall seconds: graph (scan), build, blocks (assignment), dp, result

    @property
    def mesh(self) -> dict:
        return dict(self.sharding.mesh)

    def to_plan(self) -> dict:
        return {"mesh": self.mesh, "predicted_s": self.predicted, "shardings": self.sharding.to_plan()}

    def explain(self, limit: int = 40) -> str:
        g = 2 ** len(self.levels)
        head = (f"tofu over {g} devices (levels {self.levels}): predicted {self.predicted:.3g} s = "
                + " + ".join(f"{k} {v:.3g}" for k, v in self.parts.items())
                + f"; searched in {self.seconds:.2f} s, largest DP table {self.max_table}"
                + "".join(f"; {ax}: one flat elimination (block boundaries too wide)" if b.get("flat") else
                          f"; {ax}: {b['solved']} of {b['blocks']} blocks eliminated"
                          for ax, b in zip(self.levels, self.blocks) if b))
        return head + "\n" + self.sharding.explain(limit)


def level_axes(g: int, axis: str = "tp") -> list:
    if g < 2 or g & (g - 1):
        raise ShardingError(f"tofu_search: the device count {g} is not a power of two >= 2; Tofu halves the device "
                            "set at each level -- use 2, 4, 8, ... devices (or another sharding mode)")
    k = g.bit_length() - 1
    return [axis] if k == 1 else [f"{axis}{i}" for i in range(k)]


def _val(n):
    return n.meta.get("val")


def _is_tensor(n):
    return isinstance(_val(n), torch.Tensor)


def _nbytes(n) -> float:
    v = _val(n)
    return float(v.numel() * v.element_size())


class _Graph:
    """What every level reads: per node its rule info, groups, FLOPs share per group (cached by signature)."""

    def __init__(self, gm, signature, whole_io: bool = False, fixed: dict | None = None):
        self.gm, self.signature, self.whole_io = gm, signature, whole_io and signature is not None
        by_name = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
        self.fixed = {by_name[k]: sh for k, sh in (fixed or {}).items() if k in by_name}   # placeholder -> Sharding
        self.fed_whole = set()          # whole_io: placeholders the runtime feeds whole (all but params and state)
        if self.whole_io:
            self.fed_whole = {n for n, (role, _) in zip(gm.graph.find_nodes(op="placeholder"), signature.inputs)
                              if role not in (Role.PARAM, Role.OPT_STATE)}
        self.nodes = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function")]
        self.info, self.groups, self.work, self.leaves, self.key, self.floats = {}, {}, {}, {}, {}, {}
        cache: dict = {}
        self._where: dict = {}
        for n in self.nodes:
            if n.op != "call_function" or n.target is operator.getitem:
                continue
            info = OpInfo.of(n)
            if not info.paths and not info.out_shapes:
                continue
            leaves = [x for _, x in tensor_leaves(n)]
            self.floats[n] = tuple(_val(x).dtype.is_floating_point for x in leaves)
            key = (n.target, tuple(info.in_shapes), tuple(info.out_shapes), _consts(n),
                   self.floats[n])
            if key not in cache:
                groups = groups_of(info)
                flops = float(concrete(node_cost(n).flops))
                sizes = [max(1, int(torch.Size(s).numel())) for s in info.out_shapes]
                total = sum(sizes) or 1
                cache[key] = (groups, [flops * sum(sizes[o] for o in g.outs) / total for g in groups])
            self.info[n], self.leaves[n], self.key[n] = info, leaves, key
            self.groups[n], self.work[n] = cache[key]

    def where(self, n) -> dict:
        """``{getitem index: (group index, position in the group's outputs)}`` for the outputs of ``n``."""
        w = self._where.get(n)
        if w is None:
            by_out = {o: (gi, k) for gi, grp in enumerate(self.groups[n]) for k, o in enumerate(grp.outs)}
            w = self._where[n] = {p: by_out[o] for o, p in enumerate(self.info[n].out_pos) if o in by_out}
        return w

    def outputs(self):
        """``[(output leaf, placeholder it must match, WHOLE (whole_io: the runtime reads it whole) or None)]``."""
        out = self.gm.graph.output_node()
        leaves = [a for a in torch.utils._pytree.tree_flatten(out.args[0])[0] if isinstance(a, torch.fx.Node)]
        if self.signature is None:
            return [(x, None) for x in leaves]
        phs = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        by_key = dict(zip(self.signature.inputs, phs))
        out = []
        for (role, key), x in zip(self.signature.outputs, leaves):
            ph = by_key.get((role[4:], key)) if role.startswith("new_") else by_key.get((Role.PARAM, key)) \
                if role == Role.GRAD else None
            out.append((x, WHOLE if ph is None and self.whole_io else ph))
        return out


WHOLE = "whole"     # an output the runtime reads whole (Tofu with whole_io)


def _consts(n):
    return tuple(a if not isinstance(a, torch.fx.Node) else "·" for a in torch.utils._pytree.tree_flatten(
        (n.args, n.kwargs))[0])


class _Level:
    """One halving: a DP problem over placements along ``axis`` (size 2), given the earlier levels."""

    def __init__(self, g: _Graph, axis: str, prior: list, cost: TofuCost, labels_cache: dict):
        self.g, self.axis, self.cost, self.n = g, axis, cost, 2
        self.prior = prior                      # earlier levels: [(place, need)]
        self.labels_cache = labels_cache        # (op signature, group, taken) -> legal candidates
        self.p = Problem()
        self.vars = {}                          # (node, group index) -> (var, labels)
        self.prod = {}                          # tensor node -> (node, group index, position in group outs)
        self._tables: dict = {}
        self.optimum = None                     # the DP's optimum, once solved

    def _taken(self, node, which, slots):
        """Per output (which=0) / input (which=1) of ``node`` in ``slots``: the dims earlier levels split (a later
        level may not split them again: one mesh axis per tensor dim); None at the first level."""
        if not self.prior:
            return None
        pls = [lvl[which].get(node, ()) for lvl in self.prior]
        return tuple(frozenset(p[i] for p in pls if i < len(p) and isinstance(p[i], int)) for i in slots)

    def _split_before(self, node) -> int:
        return sum(1 for place, _ in self.prior if isinstance(place.get(node, (R,))[0], int))

    def build(self):
        c = self.cost
        for n in self.g.nodes:
            if n.op == "placeholder":
                if not _is_tensor(n):
                    continue
                shape, taken = tuple(_val(n).shape), (self._taken(n, 0, (0,)) or [()])[0]
                labels = [((), (R,))] + [((), (d,)) for d in range(len(shape))
                                         if shape[d] % 2 == 0 and shape[d] >= 2 and d not in taken
                                         and n not in self.g.fed_whole]
                if n in self.g.fixed:                    # laid out already (a tied parameter another stage decided)
                    labels = [((), (self.g.fixed[n].placement(self.axis),))]
                v = self.p.var(len(labels))
                self.vars[(n, 0)] = (v, labels)
                self.prod[n] = (n, 0, 0)
                if c.mem_s_per_byte and M.get(n, M.ROLE) in (Role.PARAM, Role.OPT_STATE):
                    held = _nbytes(n) / 2 ** self._split_before(n)
                    self.p.unary(v, [held * c.mem_s_per_byte / (2 if isinstance(lb[1][0], int) else 1) for lb in labels])
            elif n.target is operator.getitem:
                src, idx = n.args
                if _is_tensor(n) and src in self.g.info:
                    w = self.g.where(src).get(idx)
                    if w is not None:
                        self.prod[n] = (src,) + w
            elif n in self.g.info:
                self._op(n)
        for (n, gi), (v, labels) in list(self.vars.items()):
            if n.op == "call_function":
                self._edges(n, gi, v, labels)
        for x, ph in self.g.outputs():
            if ph is WHOLE and x in self.prod:               # read whole by the runtime: charge making it whole
                u, ulabels, k = self._producer(x)
                before = (R,) * len(self.prior)
                tab = self._table(x, [lb[1][k] for lb in ulabels], [R], before)
                self.p.unary(u, [row[0] for row in tab])
            elif ph is not None and ph is not WHOLE and x in self.prod and (ph, 0) in self.vars:
                pv, plabels = self.vars[(ph, 0)]
                u, ulabels, k = self._producer(x)
                before = tuple(place[ph][0] for place, _ in self.prior)
                self.p.pair(u, pv, self._table(x, [lb[1][k] for lb in ulabels], [lb[1][0] for lb in plabels], before))

    def _op(self, n):
        info, c = self.g.info[n], self.cost
        for gi, grp in enumerate(self.g.groups[n]):
            div = 2 ** sum(1 for place, _ in self.prior if any(place[n][o] != R for o in grp.outs))
            g_in, g_out = self._taken(n, 1, grp.ins), self._taken(n, 0, grp.outs)
            key = (self.g.key[n], gi, g_in, g_out)
            labels = self.labels_cache.get(key)
            if labels is None:
                floats = self.g.floats[n]
                labels = [cd for cd in grp.cands if _fits_group(info, grp, cd, g_in, g_out, floats)] or [grp.cands[0]]
                self.labels_cache[key] = labels
            v = self.p.var(len(labels))
            self.vars[(n, gi)] = (v, labels)
            if len(info.out_pos) == 1 and grp.outs:
                self.prod[n] = (n, gi, 0)
            if c.flops_per_s:
                w = self.g.work[n][gi] / div / c.flops_per_s
                self.p.unary(v, [w / (2 if any(pl != R for pl in lb[1]) else 1) for lb in labels])

    def _producer(self, x):
        pn, pg, k = self.prod[x]
        u, ulabels = self.vars[(pn, pg)]
        return u, ulabels, k

    def _edges(self, n, gi, v, labels):
        grp = self.g.groups[n][gi]
        leaves = self.g.leaves[n]
        for pos, j in enumerate(grp.ins):
            x = leaves[j]
            if x not in self.prod:
                continue
            u, ulabels, k = self._producer(x)
            before = tuple(need[n][j] for _, need in self.prior)
            self.p.pair(u, v, self._table(x, [lb[1][k] for lb in ulabels], [lb[0][pos] for lb in labels], before))

    def _table(self, x, src: list, dst: list, dst_before: tuple):
        """Bytes (as seconds) of ``x`` from each producer label to each consumer label. With earlier levels, a
        pair whose whole redistribution the lowering cannot order (two axes trading one dim) is excluded."""
        nb = _nbytes(x) / 2 ** self._split_before(x)
        src_before = tuple(place[x][0] for place, _ in self.prior)
        key = (tuple(src), tuple(dst), nb, src_before, dst_before, _val(x).dim())
        if key not in self._tables:
            bw, lat = self.cost.link_bytes_per_s, self.cost.latency_s
            self._tables[key] = [[redistribute_bytes(a, b, nb / 2 if isinstance(a, int) else nb, 2) / bw
                                  + lat * _calls(a, b) if _orderable(_val(x).dim(), src_before + (a,), dst_before + (b,)) else _NO
                                  for b in dst] for a in src]
        return self._tables[key]

    def solve(self, blocks=None, reuse: bool = True):
        """``(place, need)``: per node its output placements and the placements it needs its inputs in.
        ``blocks``: lists of variables eliminated block by block (``solve_blocks``), once per distinct one with
        ``reuse``."""
        self.optimum, labels = self.p.solve(blocks, reuse)
        place, need = {}, {}
        for (n, gi), (v, lbs) in self.vars.items():
            ins, outs = lbs[labels[v]]
            if n.op == "placeholder":
                place[n] = outs
                continue
            info, grp = self.g.info[n], self.g.groups[n][gi]
            if n not in place:
                place[n], need[n] = [R] * len(info.out_shapes), [R] * len(info.paths)
            pl, nd = place[n], need[n]
            for o, p in zip(grp.outs, outs):
                pl[o] = p
            for j, p in zip(grp.ins, ins):
                nd[j] = p
        for n in need:
            place[n], need[n] = tuple(place[n]), tuple(need[n])
        for n in self.g.nodes:
            if n.op == "call_function" and n.target is operator.getitem and n in self.prod:
                src, gi, k = self.prod[n]
                place[n], need[n] = (place[src][self.g.groups[src][gi].outs[k]],), ()
        return place, need


def tofu_search(gm: torch.fx.GraphModule, devices: int, cost: TofuCost | None = None, signature=None,
                axis: str = "tp", whole_io: bool = False, fixed: dict | None = None,
                blocks: str = "reuse") -> TofuResult:
    """Choose every node's sharding of ``gm`` (a captured joint or forward graph) over ``devices`` (a power of
    two) by Tofu's recursive halving; ``signature`` (``CapturedStep.signature``): updated parameters and
    optimizer state leave laid out as they came in; ``whole_io`` (with ``signature``): inputs other than parameters
    and optimizer state come in whole, gradients leave as their parameters, other outputs whole (what the
    runtime feeds and reads); ``fixed``: placeholder name -> Sharding it must keep (a parameter shared with a stage
    searched before); ``blocks``: "reuse" (each distinct repeated block's interior eliminated once and reused,
    ``passes.tofu_blocks``), "each" (block by block, no reuse) or "flat" (one elimination over everything) -- all
    exact. Returns the shardings, lowerable, and the predicted cost."""
    import time
    if blocks not in _BLOCK_MODES:
        raise ValueError(f"tofu_search: blocks={blocks!r}; use one of {_BLOCK_MODES}")
    t0 = time.perf_counter()
    was = gc.isenabled()
    gc.disable()            # the search makes ~10^5 small objects per level; collections of the big graph dominate
    try:
        return _search(gm, devices, cost, signature, axis, t0, whole_io, fixed, blocks)
    finally:
        if was:
            gc.enable()


_BLOCK_MODES = ("reuse", "each", "flat")


def _search(gm, devices, cost, signature, axis, t0, whole_io=False, fixed=None, blocks="reuse"):
    import time
    cost = cost or TofuCost()
    axes = level_axes(devices, axis)
    g = _Graph(gm, signature, whole_io, fixed)
    levels, max_table, labels_cache, owner, stats, optima = [], 0, {}, None, [], []
    clock = dict.fromkeys(("graph", "build", "blocks", "dp", "result"), 0.0)
    clock["graph"], t = time.perf_counter() - t0, time.perf_counter()

    def tick(phase):
        nonlocal t
        now = time.perf_counter()
        clock[phase] += now - t
        t = now
    for ax in axes:
        lvl = _Level(g, ax, levels, cost, labels_cache)
        lvl.build()
        tick("build")
        if blocks != "flat":                            # which block each (node, group) is in, from level 1's graph
            owner = owner if owner is not None else assign_blocks(lvl.vars, lvl.p.sizes, lvl.p.pairs)
        lists = None if blocks == "flat" else block_lists(lvl.vars, owner)
        tick("blocks")
        levels.append(lvl.solve(lists, blocks == "reuse"))
        tick("dp")
        stats.append(dict(lvl.p.stats) if lists else {})
        optima.append(lvl.optimum)
        max_table = max(max_table, lvl.p.max_table)
    res = _result(g, axes, levels)
    parts = plan_cost(gm, res, cost, signature, graph=g)
    tick("result")
    return TofuResult(res, axes, sum(parts.values()), parts, time.perf_counter() - t0, max_table, blocks=stats,
                      optima=optima, phases=clock)


_NO = 1e30     # the cost of a choice the lowering cannot carry out


@functools.lru_cache(maxsize=None)
def _orderable(ndim: int, src: tuple, dst: tuple) -> bool:
    """Whether the lowering's step order (reductions, gathers, all_to_alls, slices; axes in order) turns the
    placements ``src`` (one per level) into ``dst`` through valid shardings only."""
    if len(src) < 2 or src == dst:
        return True
    axes = [str(i) for i in range(len(src))]
    try:
        cur = Sharding.from_placements(ndim, dict(zip(axes, src)))
        Sharding.from_placements(ndim, dict(zip(axes, dst)))
        steps = [(a, kind, d) for a, p, q in zip(axes, src, dst) for kind, _, d in redistribute_steps(p, q)]
        for a, _, d in sorted(steps, key=lambda s: _ORDER[s[1]]):
            cur = cur.with_placement(a, d)
    except ShardingError:
        return False
    return True


def _fits_group(info, grp, cand, g_in, g_out, floats) -> bool:
    """``propagate_sharding._fits`` for one group on a size-2 axis, given the dims earlier levels split of the
    group's own inputs/outputs only (a ``_foreach`` op has hundreds of groups: per-node tuples are quadratic)."""
    for i, (j, pl) in enumerate(zip(grp.ins, cand[0])):
        if not placement_fits(info.in_shapes[j], pl, 2, g_in[i] if g_in else (), floats[j]):
            return False
    for i, (o, pl) in enumerate(zip(grp.outs, cand[1])):
        if not placement_fits(info.out_shapes[o], pl, 2, g_out[i] if g_out else (), True):
            return False
    return True


def _result(g: _Graph, axes: list, levels: list) -> ShardingResult:
    res = ShardingResult({a: 2 for a in axes}, sources={})
    for n in g.nodes:
        if n.op == "placeholder":
            if _is_tensor(n):
                res.out[n.name] = (_sh(_val(n).dim(), axes, levels, n, 0, 0),)
            continue
        info = g.info.get(n)
        if n.target is operator.getitem:
            if _is_tensor(n) and n in levels[0][0]:
                res.out[n.name] = (_sh(_val(n).dim(), axes, levels, n, 0, 0),)
            res.need[n.name] = ()
            continue
        if info is None:
            res.out[n.name], res.need[n.name] = (), ()
            continue
        res.out[n.name] = tuple(_sh(len(s), axes, levels, n, o, 0) for o, s in enumerate(info.out_shapes))
        res.need[n.name] = tuple(_sh(len(s), axes, levels, n, j, 1) for j, s in enumerate(info.in_shapes))
    out = []
    for x, ph in g.outputs():
        out.append(Sharding((None,) * _val(x).dim()) if ph is WHOLE else
                   res.out[ph.name][0] if ph is not None and ph.name in res.out else res.out[x.name][0])
    res.need["output"] = tuple(out)
    res.redistributions = _redistributions(g, res)
    return res


def _sh(ndim, axes, levels, n, i, which) -> Sharding:
    return Sharding.from_placements(ndim, {a: lvl[which][n][i] for a, lvl in zip(axes, levels)})


def _local_bytes(x, sh: Sharding, sizes) -> float:
    v = _val(x)
    return float(torch.Size(sh.local_shape(tuple(v.shape), sizes, x.name)).numel() * v.element_size())


def _redistributions(g: _Graph, res: ShardingResult) -> list:
    """What ``lower_shardings`` will insert (it reuses a version made for one consumer for the next), per step:
    ``(node, input, src, dst, axis, kind, bytes sent per rank)``."""
    sizes = {a: s for a, s in res.mesh.items() if s > 1}
    versions, out = {}, []
    for n in g.gm.graph.nodes:
        if n.name in res.out and len(res.out[n.name]) == 1:
            versions[n] = {res.out[n.name][0]}
        if n.op == "output":
            pairs = list(zip([x for x, _ in g.outputs()], res.need["output"]))
        elif n.op == "call_function" and n.target is not operator.getitem and n in g.info:
            pairs = list(zip([x for _, x in tensor_leaves(n)], res.need[n.name]))
        else:
            continue
        for x, want in pairs:
            vers = versions[x]
            if want in vers:
                continue
            gb = _nbytes(x)

            def cost(s):
                return sum(redistribute_bytes(s.placement(a), want.placement(a), gb / (k if isinstance(
                    s.placement(a), int) else 1), k) for a, k in sizes.items())
            cur = min(vers, key=lambda s: (cost(s), str(s)))
            steps = [(a, kind, dst) for a in sizes for kind, _, dst in redistribute_steps(cur.placement(a),
                                                                                           want.placement(a))]
            for a, kind, dst in sorted(steps, key=lambda s: _ORDER[s[1]]):
                nxt = cur.with_placement(a, dst)
                out.append((n.name, x.name, cur.placement(a), dst, a, kind,
                            collective_bytes(kind, _local_bytes(x, cur, sizes), sizes[a])))
                cur = nxt
                vers.add(cur)
    return out


def plan_cost(gm, res: ShardingResult, cost: TofuCost | None = None, signature=None, graph: _Graph | None = None):
    """Tofu's objective for any sharding result (the search's, or propagation's from Megatron layouts):
    ``{"comm", "compute", "memory"}`` seconds. Comm: per consumer input (and per updated state output), per mesh
    axis in order, the bytes to redistribute from the producer's sharding (its size split by the axes before),
    each counted on its own; compute: each op's FLOPs over the devices its outputs are split across."""
    cost = cost or TofuCost()
    g = graph or _Graph(gm, signature)
    sizes = [(a, s) for a, s in res.mesh.items() if s > 1]
    comm = compute = memory = 0.0

    def edge(x, want: Sharding) -> float:          # bytes, with each collective's latency as bytes
        have, total, nb = res.out[x.name][0], 0.0, _nbytes(x)
        for a, k in sizes:
            pa = have.placement(a)
            total += redistribute_bytes(pa, want.placement(a), nb / k if isinstance(pa, int) else nb, k)
            total += cost.latency_s * cost.link_bytes_per_s * _calls(pa, want.placement(a))
            nb = nb / k if isinstance(pa, int) else nb
        return total
    for n in g.nodes:
        if n.op == "placeholder" and _is_tensor(n) and M.get(n, M.ROLE) in (Role.PARAM, Role.OPT_STATE):
            memory += _local_bytes(n, res.out[n.name][0], dict(sizes)) * cost.mem_s_per_byte
        if n not in g.info:
            continue
        for x, want in zip([x for _, x in tensor_leaves(n)], res.need[n.name]):
            comm += edge(x, want)
        if cost.flops_per_s:
            for grp, w in zip(g.groups[n], g.work[n]):
                split = 1
                for a, k in sizes:
                    if any(res.out[n.name][o].placement(a) != R for o in grp.outs):
                        split *= k
                compute += w / split / cost.flops_per_s
    for (x, ph), want in zip(g.outputs(), res.need.get("output", ())):
        if ph is not None:
            comm += edge(x, want)
    return {"comm": comm / cost.link_bytes_per_s, "compute": compute, "memory": memory}

