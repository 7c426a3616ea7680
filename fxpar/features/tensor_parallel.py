"""Tensor parallelism: each operator's tensors split over the tp mesh axes, as one Feature.

The modes (``Strategy(tp=n, sharding=...)``, docs/tensor-parallel.md):

* ``"auto"``: Tofu's search (Wang et al., EuroSys'19; ``passes.tofu``), recursive halving over the mesh axes
  ``tp0``, ``tp1``, ... of size 2, each operator's split chosen by the cost model;
* ``"megatron"``: the graph's column-/row-parallel Linear pairs, attention split by heads (Shoeybi et al. 2019);
* ``"annotations"``: the model's ``fxpar.shard`` annotations only, then propagation (GShard, Lepikhin et al. 2020);
* a dict of Mesh-TensorFlow layouts (Shazeer et al. 2018), ``{param glob: ('tp', None, ...)}``.

What lives here: the ``sharding`` option and its checks; the mesh axes it adds after pp and dp; its Plan section
(the mode, the axes, the layouts and, per stage, every node's sharding and each parameter's and optimizer state's
layout); the decision (:meth:`TensorParallelFeature.plan_stage`, once each stage is captured: Tofu's search, or the
layouts and annotations propagated; Tofu's choice is reused when the Plan is handed back); its pass
(``passes.tensor_parallel``, first in the pass list), which lowers the decided shardings and decides nothing; the
rank's pieces of split parameters and optimizer state (:class:`Pieces`: cut at setup and after a checkpoint load,
gathered over tp for ``state_dict()`` and checkpoints); its lines in ``explain()``.
"""
from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxpar import meta as M
from fxpar.runtime.groups import group
from fxpar.errors import PassError, StrategyError
from fxpar.annotate import is_shard_node
from fxpar.explain import fmt_bytes
from fxpar.feature import Feature, Option, PlanSection, RankState, Slot, register_feature
from fxpar.mesh import Mesh
from fxpar.roles import Role
from fxpar.sharding import Sharding, ShardingError
from passes import tofu
from passes.propagate_sharding import ShardingResult, propagate_shardings
from passes.sharding import strip_annotations
from passes.sharding.megatron import megatron_layouts, megatron_whole
from passes.tensor_parallel import TensorParallel, random_ops, split_draws

__all__ = ["TensorParallelFeature", "TensorParallelSection", "Pieces", "MODES"]

MODES = ("auto", "megatron", "annotations")
_HOW = {"auto": "Tofu's search (recursive halving, exact DP per level)",
        "megatron": "Megatron preset (column/row-parallel Linear pairs), then the model's fxpar.shard annotations and "
                    "propagation (GShard) for the rest",
        "layouts": "Mesh-TensorFlow layouts, then the model's fxpar.shard annotations and propagation (GShard) for "
                   "the rest",
        "annotations": "the model's fxpar.shard annotations and propagation (GShard)"}


@dataclass
class TensorParallelSection(PlanSection):
    """The decisions. ``stages``: per stage ``{"params": {key: spec}, "opt_state": {...}}`` (a mesh axis or None per
    dim) and every node's sharding (``ShardingResult.to_json``: ``{"out": ..., "need": ...}``): under ``"auto"``,
    Tofu's choice in ``"auto"`` with ``"predicted_s"`` and ``"notes"`` (what the search found); in the other modes,
    the propagated layouts and annotations in ``"propagated"``, and ``"megatron"`` (the preset's layouts) under
    ``"megatron"``. :meth:`TensorParallelFeature.plan_stage` fills each stage in once it is captured;
    ``passes.tensor_parallel`` lowers it. A handed-back Plan's ``"auto"`` choice is lowered as it is (edit it to
    change the split); ``"propagated"`` is derived again from ``layouts`` and the model's annotations."""
    mode: str = "auto"                                   # "auto" | "megatron" | "layouts" | "annotations"
    axes: list = field(default_factory=list)            # [[mesh axis, size], ...]
    layouts: dict = field(default_factory=dict)         # {param glob: [mesh axis or None per dim]} ("layouts")
    stages: list = field(default_factory=list)

    def lines(self) -> list:
        out = [f"tensor parallelism over {' x '.join(f'{a}={n}' for a, n in self.axes)}: {_HOW[self.mode]}"]
        for s, st in enumerate(self.stages):
            split = {k: v for k, v in st.get("params", {}).items() if any(d is not None for d in v)}
            out.append(f"  stage {s}: {len(split)} of {len(st.get('params', {}))} parameter(s) split"
                       + (": " + ", ".join(f"{k} {tuple(v)}" for k, v in list(split.items())[:6])
                          + (" ..." if len(split) > 6 else "") if split else ""))
            whole = [(m, why) for m, why in st.get("megatron_whole", ())
                     if not any(any(d is not None for d in v) for k, v in split.items() if k.startswith(m + "."))]
            if whole:
                out.append(f"  stage {s}: the Megatron preset left {len(whole)} Linear(s) whole: "
                           + "; ".join(f"{m} ({why})" for m, why in whole[:6]) + ("; ..." if len(whole) > 6 else "")
                           + ". Split them with layouts {param glob: ('tp', None)}, or sharding='auto'")
        return out


class Pieces(RankState):
    """This rank's pieces of the split parameters and optimizer state. ``info``: ``{"axes": [[axis, size], ...],
    "stages": {stage: {"params": {key: spec}, "opt_state": {...}, "shapes": {key: whole shape}}}}``. The rank
    keeps the piece at its tp coordinate (``torch.chunk`` along each split dim, as ``passes.lower_sharding``
    cuts); :meth:`whole` gathers whole tensors over the tp groups (a collective where anything is split)."""

    def setup(self, ex) -> None:
        self.mesh = Mesh(tuple((a, int(n)) for a, n in self.info["axes"]))
        self.layouts = {s: st for s, st in self.info["stages"].items() if s in ex.params}
        self.collective = any(any(d is not None for d in dims) for st in self.layouts.values()
                              for part in (st["params"], st["opt_state"]) for dims in part.values())
        self._slice(ex)

    def after_load(self, ex) -> None:
        self._slice(ex)

    def _piece(self, ex, t: torch.Tensor, dims: list, whole_shape) -> torch.Tensor:
        if tuple(t.shape) != tuple(whole_shape):          # already this rank's piece
            return t
        c = self.mesh.coords(ex.tp_index)
        for d, axis in enumerate(dims):
            if axis is not None:
                t = t.chunk(self.mesh.axis_size(axis), dim=d)[c[axis]]
        return t.clone(memory_format=torch.contiguous_format)

    def _slice(self, ex) -> None:
        """Cut whole parameters and optimizer state into this rank's pieces (after building and loading)."""
        for s, st in self.layouts.items():
            for k, dims in st["params"].items():
                if any(dims) and k in ex.params[s]:
                    ex.params[s][k] = self._piece(ex, ex.params[s][k], dims, st["shapes"][k])
            for k, dims in st["opt_state"].items():
                if any(dims) and k in ex.state[s]:
                    ex.state[s][k] = self._piece(ex, ex.state[s][k], dims, st["shapes"][k.split(":", 1)[1]])

    def laid_out(self, ex, stage: int, key: str, t: torch.Tensor) -> torch.Tensor:
        st = self.layouts.get(stage)
        dims = st["params"].get(key) if st else None
        return self._piece(ex, t, dims, st["shapes"][key]) if dims and any(dims) else t

    def _gather(self, ex, t: torch.Tensor, dims: list) -> torch.Tensor:
        for d, axis in enumerate(dims):
            if axis is None:
                continue
            ranks = ex.p.bindings[axis]
            parts = [torch.empty_like(t) for _ in ranks]
            dist.all_gather(parts, t.contiguous(), group=group(ranks, axis))
            t = torch.cat(parts, dim=d)
        return t

    def whole(self, ex, params: dict, state: dict) -> tuple:
        for s, st in sorted(self.layouts.items()):
            for k, dims in st["params"].items():
                if any(dims) and k in params.get(s, {}):
                    params[s][k] = self._gather(ex, params[s][k], dims)
            for k, dims in st["opt_state"].items():
                if any(dims) and k in state.get(s, {}):
                    state[s][k] = self._gather(ex, state[s][k], dims)
        return params, state


def _nbytes(shape, dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def _mode(strategy) -> str:
    return "layouts" if isinstance(strategy.sharding, dict) else strategy.sharding


def _tied_layouts(section, plan, stage: int, sig) -> dict:
    """``{(role, key): dims}`` of stage ``stage``'s parameters (and their optimizer state) that an earlier stage
    holds too (a tied embedding and LM head): laid out as that stage decided, so the pieces the tied group sums
    match."""
    out = {}
    for role, key in sig.inputs:
        if role not in (Role.PARAM, Role.OPT_STATE) or key.split(":", 1)[-1] not in (plan.tied or {}):
            continue
        for t in range(min(stage, len(section.stages))):
            part = section.stages[t].get("params" if role == Role.PARAM else "opt_state", {})
            if key in part:
                out[(role, key)] = part[key]
                break
    return out


def _tofu_cost(cluster, ranks) -> tofu.TofuCost:
    """Tofu's prices from the cluster's intra-node link and the slowest device of ``ranks`` (the stage's: one
    sharding for all of them, and their collectives wait for the slowest; ``ClusterSpec.slowest_device``); its
    defaults where the cluster is not known."""
    if cluster is None:
        return tofu.TofuCost()
    return tofu.TofuCost(link_bytes_per_s=cluster.intra_node.bandwidth,
                         flops_per_s=cluster.slowest_device(ranks).peak_flops, latency_s=cluster.intra_node.latency)


def _versus_megatron(gm, captured, mesh, sig, found, cost) -> str:
    """Tofu's choice against Megatron's split of the same graph, by the same cost model (Tofu, §6: the search
    finds Megatron's split or a cheaper one)."""
    try:
        layouts = megatron_layouts(gm, mesh.size, "tp")
        if not layouts:
            return "tofu: the graph has no Linear pair, so there is no Megatron split to compare with"
        meg = _propagated(captured, gm, Mesh((("tp", mesh.size),)), layouts, sig)
    except ShardingError as e:
        return f"tofu: Megatron's split does not apply to this graph ({str(e).splitlines()[0]})"
    m = sum(tofu.plan_cost(gm, meg, cost, sig).values())
    p = found.predicted
    verdict = "cheaper than" if p < m * (1 - 1e-9) else "as cheap as" if p <= m * (1 + 1e-9) else "dearer than"
    return (f"tofu: its plan ({found.predicted:.4g} s predicted) is {verdict} Megatron's split ({m:.4g} s) by the "
            "same cost model")


def _propagated(captured, gm, mesh: Mesh, layouts: dict, sig, prefer=None):
    """``layouts`` propagated over ``gm``, ``captured``'s graph or a copy of it without annotations. Without
    annotations and preferences the result depends only on the mesh and the layouts: kept on the capture, so Tofu's
    comparison with Megatron's split and the Megatron build over the same capture propagate it once."""
    aliases = getattr(captured, "aliases", None) or {}
    derived = getattr(captured, "derived", None)
    if prefer or derived is None or any(is_shard_node(n) for n in gm.graph.nodes):
        return propagate_shardings(gm, mesh, layouts, aliases=aliases, signature=sig, whole_io=True, prefer=prefer)
    key = ("propagated", tuple(mesh.axes), tuple(sorted((k, tuple(v)) for k, v in layouts.items())))
    if key not in derived:
        derived[key] = propagate_shardings(gm, mesh, layouts, aliases=aliases, signature=sig, whole_io=True)
    return derived[key]


def _choose(section, plan, stage: int, captured, cluster, mesh: Mesh, entry: dict) -> tuple:
    """Stage ``stage``'s per-node shardings (a ``ShardingResult``) and what its entry records beside the
    per-parameter layouts: Tofu's choice (searched, or the handed-back Plan's) under ``auto``; the layouts
    (Megatron's preset, the user's, a tied parameter's earlier stage's) and the graph's annotations, propagated
    (GShard), under the other modes."""
    sig = captured.signature
    tied = _tied_layouts(section, plan, stage, sig)
    if section.mode == "auto":
        if entry.get("auto"):                     # a handed-back Plan: Tofu's stored choice
            return (ShardingResult.from_json(entry["auto"], mesh),
                    {"notes": [f"tofu: stage {stage}'s split is the handed-back Plan's (no search)"]})
        gm = copy.deepcopy(captured.gm)
        strip_annotations(gm)                     # Tofu decides every node itself
        phs = {(r, k): p.name for p, (r, k) in zip(gm.graph.find_nodes(op="placeholder"), sig.inputs)}
        fixed = {phs[rk]: Sharding(tuple(dims)) for rk, dims in tied.items() if rk in phs}
        cost = _tofu_cost(cluster, plan.stage_ranks(stage))
        found = tofu.tofu_search(gm, mesh.size, cost, signature=sig, whole_io=True, fixed=fixed)
        notes = [found.explain(limit=0).splitlines()[0], _versus_megatron(gm, captured, mesh, sig, found, cost)]
        return found.sharding, {"auto": found.sharding.to_json(), "predicted_s": found.predicted, "notes": notes}
    gm = captured.gm
    layouts = dict(section.layouts or {})
    extra = {}
    if section.mode == "megatron":
        preset = megatron_layouts(gm, mesh.size, mesh.names[0])
        extra["megatron"] = {k: list(v) for k, v in preset.items()}
        extra["megatron_whole"] = [list(w) for w in megatron_whole(gm, preset)]
        layouts = {**preset, **layouts}
    layouts.update({k: tuple(dims) for (r, k), dims in tied.items() if r == Role.PARAM})
    res = _propagated(captured, gm, mesh, layouts, sig)
    draws = split_draws(gm, res)
    if draws:                                     # dropout masks used split: drawn split, each rank its piece
        res = _propagated(captured, gm, mesh, layouts, sig, prefer=draws)
    extra["propagated"] = res.to_json()
    return res, extra


def _check_optimizer_on_pieces(plan, stage: int, params: dict, mode: str) -> None:
    """An untraced optimizer steps each rank's piece of a split parameter as torch would step a parameter of that
    shape: the whole parameter's update only where the update is elementwise (``fxpar.optim.ELEMENTWISE``). Any
    other (Adafactor's factored moments, Muon's orthogonalised matrix, a user's optimizer) is refused here."""
    opt = plan.optimizer or {}
    if not opt or opt.get("traced") or opt.get("elementwise"):
        return
    split = [(k, dims) for k, dims in params.items() if any(d is not None for d in dims)]
    if not split:
        return
    key, dims = split[0]
    more = f" (and {len(split) - 1} more)" if len(split) > 1 else ""
    raise StrategyError(
        f"optimizer {opt.get('name')} under tensor parallelism (sharding={mode!r}), stage {stage}: parameter "
        f"{key!r} is split {tuple(dims)}{more}, so each rank would step its piece on its own, and "
        f"{opt.get('name')}'s update is not elementwise (it reads the whole parameter: factored row/column moments, "
        "an orthogonalised matrix, or a step fxpar cannot see), so the pieces' updates would not be the whole "
        "parameter's. Use an elementwise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, ...: fxpar.optim.ELEMENTWISE), "
        "keep that parameter whole (layouts that do not split it), or train with dp/pp instead of tp.")


def _random_note(stage: int, drawn: list) -> str | None:
    """The plan note for a stage with random ops (dropout) under tensor parallelism: which stream each draws from."""
    if not drawn:
        return None
    split = [f"{d['node']} ({d['module']}, split {tuple(d['dims'])})" for d in drawn if d["stream"] == "rank"]
    whole = [f"{d['node']} ({d['module']})" for d in drawn if d["stream"] == "shared"]
    return (f"tensor parallelism, stage {stage}: {len(drawn)} random op(s) (dropout). On whole tensors "
            f"({len(whole)}: {', '.join(whole[:4]) + (' ...' if len(whole) > 4 else '') or 'none'}) every tp rank of "
            "a replica draws the same mask from the stream the tp group shares; on split tensors "
            f"({len(split)}: {', '.join(split[:4]) + (' ...' if len(split) > 4 else '') or 'none'}) each tp rank draws "
            "its piece from its own stream, so the masks differ from one process's with the same seed, and equal "
            "those of fxpar.testing.tp_streams_reference (docs/semantics.md, 'Random numbers under tensor "
            "parallelism')")


@register_feature
class TensorParallelFeature(Feature):
    name = "tensor_parallel"
    doc = ("operators split over tp ranks: Tofu's search (Wang et al. 2019), Megatron's Linear pairs (Shoeybi et al. "
           "2019), GShard annotations (Lepikhin et al. 2020) or Mesh-TensorFlow layouts (Shazeer et al. 2018)")
    options = {"sharding": Option("auto", (
        "with ``tp > 1``, how each operator's tensors are split over the tp ranks (docs/strategies/"
        "tensor-parallel.md): ``'auto'`` (Tofu's search, Wang et al. EuroSys'19, picks every operator's split by "
        "the cost model; tp a power of two), ``'megatron'`` (column-parallel then row-parallel Linear pairs found in "
        "the graph, attention split by heads; Shoeybi et al. 2019), ``'annotations'`` (only the model's "
        "``fxpar.shard`` annotations, GShard-style, and propagation), or a dict of Mesh-TensorFlow layouts "
        "``{'blocks.*.mlp.fc1.weight': ('tp', None), ...}`` (glob over parameter keys -> a mesh axis or None per "
        "dim). Annotations in the model count in every mode but ``'auto'``."))}
    enabled_by = ("tp",)
    conflicts_with = ("zero", "bytescheduler")      # not yet composed with them (nor with a grad_sync method)
    section = TensorParallelSection
    passes = ((Slot.PARTITION, TensorParallel),)   # first: every later pass works on the rank's local pieces
    state = Pieces

    def enabled(self, strategy) -> bool:
        return strategy.tp > 1

    def check_off(self, strategy) -> None:
        if strategy.sharding != self.options["sharding"].default:
            raise StrategyError(f"Strategy(sharding={strategy.sharding!r}) with tp=1: sharding says how operators "
                                "are split over the tp ranks, and tp=1 has one; set tp > 1 (e.g. Strategy(tp=2, "
                                f"sharding={strategy.sharding!r})) or drop sharding")

    def validate(self, strategy) -> None:
        if isinstance(strategy.sharding, dict):
            for pat, spec in strategy.sharding.items():
                if not isinstance(pat, str) or not isinstance(spec, (tuple, list)) or \
                        not all(a is None or isinstance(a, str) for a in spec):
                    raise StrategyError(f"Strategy(sharding={{{pat!r}: {spec!r}}}): a layout maps a parameter glob "
                                        "to a tuple with a mesh axis name or None per dim, e.g. "
                                        "{'blocks.*.fc1.weight': ('tp', None)}")
                bad = [a for a in spec if a is not None and a != "tp"]
                if bad:
                    raise StrategyError(f"Strategy(sharding={{{pat!r}: {tuple(spec)}}}): mesh axis {bad[0]!r} is not "
                                        "a tensor-parallel axis; layouts split over 'tp' (dp is data parallelism)")
        elif strategy.sharding not in MODES:
            raise StrategyError(f"Strategy(sharding={strategy.sharding!r}): choose one of {MODES} or pass "
                                "Mesh-TensorFlow layouts {param glob: ('tp', None, ...)}")
        if strategy.sharding == "auto" and strategy.tp & (strategy.tp - 1):
            raise StrategyError(f"Strategy(tp={strategy.tp}, sharding='auto'): Tofu's search halves the device set, so "
                                "tp must be a power of two (2, 4, 8, ...); use sharding='megatron' or layouts for "
                                f"tp={strategy.tp}")

    def mesh_axes(self, strategy, given) -> list:
        """Tofu halves the device set: ``tp0``, ``tp1``, ... of size 2 (``tp`` at tp=2); the other modes use one
        ``tp`` axis."""
        if given is not None:
            return [list(a) for a in given.axes]
        if _mode(strategy) != "auto":
            return [["tp", strategy.tp]]
        k = strategy.tp.bit_length() - 1
        return [["tp", 2]] if k == 1 else [[f"tp{i}", 2] for i in range(k)]

    def plan(self, strategy, plan, cluster):
        mode = _mode(strategy)
        return TensorParallelSection(
            mode=mode, axes=self.mesh_axes(strategy, None),
            layouts={p: list(v) for p, v in strategy.sharding.items()} if mode == "layouts" else {})

    def plan_stage(self, section, plan, stage, captured, cluster, schedule) -> None:
        """Stage ``stage``'s split, into ``section.stages[stage]``: every node's sharding (``"auto"``: Tofu's
        search, whose choice a handed-back Plan keeps; ``"propagated"``: the layouts and annotations propagated,
        derived again from the section's ``layouts`` each time) and each parameter's and optimizer state's layout.
        ``passes.tensor_parallel`` lowers it. Stages are decided in order: a parameter tied to an earlier stage
        takes that stage's layout."""
        mesh = Mesh(tuple((a, int(n)) for a, n in section.axes))
        while len(section.stages) <= stage:
            section.stages.append({})
        entry = section.stages[stage]
        if section.mode == "annotations":
            entry["annotations"] = sum(is_shard_node(n) for n in captured.gm.graph.nodes)
            if stage == plan.n_stages - 1 and not any(e.get("annotations") for e in section.stages):
                raise StrategyError(f"Strategy(sharding='annotations'): {captured.model_class} has no fxpar.shard "
                                    "annotation, so nothing would be split over the tp ranks. Annotate the tensors "
                                    "to split (fxpar.shard(x, ('tp', None)) in forward), or choose "
                                    "sharding='megatron', 'auto' or layouts {param glob: ('tp', None, ...)}")
        try:
            res, extra = _choose(section, plan, stage, captured, cluster, mesh, entry)
        except ShardingError as e:
            raise PassError(f"tensor parallelism over {dict(mesh.axes)} (sharding={section.mode!r}), stage {stage}: "
                            f"{e}") from None
        roles = dict(zip([p.name for p in captured.gm.graph.find_nodes(op="placeholder")], captured.signature.inputs))
        entry["params"] = {k: list(res.out[n][0].dims) for n, (r, k) in roles.items() if r == Role.PARAM}
        entry["opt_state"] = {k: list(res.out[n][0].dims) for n, (r, k) in roles.items() if r == Role.OPT_STATE}
        entry.update(extra)
        _check_optimizer_on_pieces(plan, stage, entry["params"], section.mode)
        entry["random"] = random_ops(captured.gm, res)
        note = _random_note(stage, entry["random"])
        if note and note not in plan.notes:
            plan.notes.append(note)

    def rank_info(self, section, program, rank):
        return {"axes": section.axes, "stages": {
            s: {"params": section.stages[s]["params"], "opt_state": section.stages[s]["opt_state"],
                "shapes": {k: list(v) for k, v in program.stages[s].captured.param_shapes.items()}}
            for s in program.plan.rank_stages(rank)}}

    def held_shape(self, section, program, rank, stage, key, shape):
        dims = section.stages[stage]["params"].get(key) if stage < len(section.stages) else None
        if not dims or not any(dims):
            return shape
        mesh = Mesh(tuple((a, int(n)) for a, n in section.axes))
        c = mesh.coords(rank % program.plan.tp)
        piece = torch.empty(shape, device="meta")
        for d, axis in enumerate(dims):       # as Pieces cuts: torch.chunk along each split dim
            if axis is not None:
                piece = piece.chunk(mesh.axis_size(axis), dim=d)[c[axis]]
        return tuple(piece.shape)

    def explain(self, section, program) -> list:
        """Per module on rank 0: parameters split (and how), the collectives the lowering inserted (by phase and
        kind, bytes handed to them per step), and the parameter bytes each rank holds."""
        plan = program.plan
        lines = ["tensor parallelism on rank 0, per module (every tp rank runs the same graphs):"]
        for s in plan.rank_stages(0):
            st, entry = program.stages[s], section.stages[s]
            cap, mesh = st.captured, plan.mesh
            mods: dict = defaultdict(lambda: {"split": [], "whole": 0, "comm": defaultdict(lambda: [0, 0])})
            held = whole = 0
            for k, dims in entry["params"].items():
                mod, _, leaf = k.rpartition(".")
                nb = _nbytes(cap.param_shapes[k], cap.param_dtypes[k])
                div = 1
                for a in dims:
                    div *= mesh.axis_size(a) if a else 1
                held, whole = held + nb / div, whole + nb
                if div > 1:
                    mods[mod or "<root>"]["split"].append(f"{leaf} {tuple(dims)}")
                else:
                    mods[mod or "<root>"]["whole"] += 1
            for n in st.joint.graph.nodes:
                c = n.meta.get(M.COMM.name)
                if c is not None and c.axis in plan.tp_axes:
                    cell = mods[M.get(n, M.MODULE) or "<root>"]["comm"][(M.get(n, M.PHASE) or "step", c.kind)]
                    cell[0], cell[1] = cell[0] + 1, cell[1] + c.nbytes
            lines.append(f"  stage {s}: parameters {fmt_bytes(held)} per rank of {fmt_bytes(whole)}")
            for mod, d in mods.items():
                comm = "; ".join(f"{ph} {k} x{c} ({fmt_bytes(b)})" for (ph, k), (c, b) in d["comm"].items())
                split = ", ".join(d["split"])
                lines.append(f"    {mod}: " + ", ".join(x for x in (f"split {split}" if split else "",
                                                                    f"{d['whole']} whole" if d["whole"] else "",
                                                                    comm) if x))
        return lines
