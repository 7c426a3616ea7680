"""precision: mixed-precision training -- forward and backward in bfloat16 or float16, master parameters, gradients
for the update and optimizer state in the model's own dtype (``Strategy(precision="bf16" | "fp16" | "fp32")``), as
torch FSDP's ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)`` and Megatron-LM's ``--bf16`` do.

The decision is this module's: the compute dtype, the dtype gradients are reduced in
(``reduce_precision="master" | "compute"``) and, under fp16, the dynamic loss scale (torch.amp.GradScaler's rule
and defaults). The mechanism is ``passes.precision``: ``CastToCompute`` in ``Slot.PRECISION`` (right after tensor
parallelism's lowering, before every pass that reads gradients or sizes values), ``CastGradsForUpdate`` in
``Slot.BUFFERS`` where gradients are reduced in the compute dtype, and ``LossScaleStep`` in ``Slot.BUFFERS`` under
fp16. The per-rank state (fp16 only) is the loss scale, its growth count and the steps skipped, checkpointed per
rank.

Where the gradients the update reads are split across ranks (pipeline stages, tensor-parallel pieces, the chunks
of an update sharded over dp), each rank checks its own and the 0/1 found-inf flags are max-reduced over the ranks
that hold the parts of one update (the process groups ``loss_scale``: a replica's stages and tp pieces; every rank
where the update is sharded over dp), so every rank skips or steps together and moves its scale the same way, as
torch's ``ShardedGradScaler`` and Megatron-LM's ``found_inf`` all-reduce do.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from passes.precision import PRECISION_DTYPES, CastGradsForUpdate, CastToCompute, LossScaleStep

import torch

from fxpar.errors import StrategyError
from fxpar.feature import Feature, Option, PlanSection, RankState, Slot, enabled_features, register_feature

__all__ = ["Precision", "PrecisionSection", "LossScaleState", "GRAD_SCALER_DEFAULTS", "FOUND_GROUP", "found_over"]

REDUCE = ("master", "compute")
# the process group over which fp16's found-inf flags are max-reduced (Plan.groups)
FOUND_GROUP = "loss_scale"
# torch.amp.GradScaler's defaults (torch/amp/grad_scaler.py)
GRAD_SCALER_DEFAULTS = {"init_scale": 2.0 ** 16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


@dataclass
class PrecisionSection(PlanSection):
    """The compute dtype (``"bf16"``/``"fp16"``), where gradients are reduced (``"master"``: cast back to the master
    dtype where backward makes them; ``"compute"``: reduced in the compute dtype, cast back for the update), and the
    dynamic loss scale's settings (fp16; empty: no scaling). ``found_over``: the groups of ranks whose found-inf
    flags are max-reduced each step (:func:`found_over`; empty: every rank's update reads the same whole
    gradients)."""
    compute: str = "bf16"
    reduce: str = "master"
    loss_scale: dict = field(default_factory=dict)
    found_over: list = field(default_factory=list)

    def lines(self) -> list:
        out = [f"forward and backward in {self.compute}; master parameters, the gradients the update reads and the "
               f"optimizer state in the model's dtype; gradients reduced in "
               f"{'the master dtype' if self.reduce == 'master' else self.compute}"]
        if self.loss_scale:
            ls = self.loss_scale
            out.append(f"dynamic loss scale from {ls['init_scale']:g}: x{ls['growth_factor']:g} after "
                       f"{ls['growth_interval']} finite steps, x{ls['backoff_factor']:g} and the step skipped on a "
                       "non-finite gradient (torch.amp.GradScaler's rule)")
        if self.found_over:
            out.append(f"each rank checks the gradients its update reads; the found-inf flags are max-reduced over "
                       f"ranks {' and '.join(map(str, self.found_over))}, so every rank skips or steps together")
        return out


class LossScaleState(RankState):
    """fp16's loss scale, the finite steps since it last changed, and the steps skipped (the optimizer's step count
    runs behind the executor's by that many, as torch's does when GradScaler skips ``optimizer.step()``)."""

    def __init__(self, info, rank: int):
        super().__init__(info, rank)
        self.tensors = {"scale": torch.tensor(float(info["init_scale"]), dtype=torch.float32),
                        "growth_tracker": torch.zeros((), dtype=torch.float32),
                        "skipped": torch.zeros((), dtype=torch.float64)}

    def setup(self, ex) -> None:
        dev = getattr(ex, "device", None)
        if dev is not None:
            self.tensors = {k: v.to(dev) for k, v in self.tensors.items()}

    def report(self):
        return {"scale": float(self.tensors["scale"]), "skipped_steps": int(self.tensors["skipped"])}


@register_feature
class Precision(Feature):
    name = "precision"
    doc = ("mixed precision: bf16/fp16 compute from fp32 master weights (Micikevicius et al. ICLR'18; torch FSDP's "
           "MixedPrecisionPolicy), fp16 with dynamic loss scaling")
    options = {
        "precision": Option("fp32", (
            "the dtype forward and backward compute in: ``'fp32'`` (the model's own dtype throughout), ``'bf16'`` or "
            "``'fp16'``: parameters stay the model's (the masters), are cast to the compute dtype at the start of each "
            "step, and gradients come back to the master dtype for the update (passes/precision.py). ``'fp16'`` "
            "scales the loss dynamically (``loss_scale``).")),
        "reduce_precision": Option("master", (
            "(precision bf16/fp16) where gradients are reduced across ranks: ``'master'`` (cast back where backward "
            "makes them: reduced and accumulated over microbatches in the master dtype, torch FSDP's "
            "``reduce_dtype=float32``) or ``'compute'`` (reduced in the compute dtype, half the bytes; cast back for "
            "the update). fp16 reduces in the master dtype.")),
        "loss_scale": Option(None, (
            "(precision='fp16') the dynamic loss scale's settings, a dict of torch.amp.GradScaler's ``init_scale``, "
            "``growth_factor``, ``backoff_factor``, ``growth_interval`` (defaults: GradScaler's); None: "
            "GradScaler's defaults under fp16, none under bf16 (its range is float32's).")),
    }
    section = PrecisionSection
    state = LossScaleState

    def enabled(self, strategy) -> bool:
        return strategy.precision != "fp32"

    def validate(self, strategy) -> None:
        p, r, ls = strategy.precision, strategy.reduce_precision, strategy.loss_scale
        if p not in PRECISION_DTYPES:
            raise StrategyError(f"Strategy(precision={p!r}): choose one of {tuple(PRECISION_DTYPES)}")
        if r not in REDUCE:
            raise StrategyError(f"Strategy(reduce_precision={r!r}): choose 'master' (gradients reduced in the master "
                                "parameters' dtype) or 'compute' (in the compute dtype)")
        if ls is not None:
            if p != "fp16":
                raise StrategyError(f"Strategy(precision={p!r}, loss_scale=...): a loss scale serves fp16 only "
                                    "(bf16 has float32's range); drop loss_scale or set precision='fp16'")
            unknown = sorted(set(ls) - set(GRAD_SCALER_DEFAULTS)) if isinstance(ls, dict) else None
            if unknown is None or unknown:
                raise StrategyError(f"Strategy(loss_scale={ls!r}): pass a dict of {sorted(GRAD_SCALER_DEFAULTS)}")
        if p == "fp16":
            if r != "master":
                raise StrategyError("Strategy(precision='fp16', reduce_precision='compute'): fp16 gradients are "
                                    "unscaled as they come back to the master dtype, before the reduction; drop "
                                    "reduce_precision or use precision='bf16'")
            moved = [f.name for f in enabled_features(strategy) if f.state_moves_in_sum]
            if moved:
                raise StrategyError(f"{strategy}: precision='fp16' skips a step whose gradients overflow, after they "
                                    f"are summed; feature(s) {moved} change their per-rank state during that sum "
                                    "(error feedback, averaging), which a skipped step would leave moved. Use "
                                    "precision='bf16' (no loss scale, no skipped steps) with them")

    def plan(self, strategy, plan, cluster):
        ls = {}
        if strategy.precision == "fp16":
            if not (plan.optimizer or {}).get("traced"):
                raise StrategyError(f"Strategy(precision='fp16') with the eager optimizer {plan.optimizer.get('name')}: "
                                    "the loss scale skips a step inside the traced update; use a traced optimizer "
                                    "(SGD, Adam, AdamW) or precision='bf16'")
            ls = {**GRAD_SCALER_DEFAULTS, **(strategy.loss_scale or {})}
            _check_one_step(strategy, plan)
        plan.notes.append(f"precision: forward and backward in {strategy.precision} from master parameters")
        section = PrecisionSection(compute=strategy.precision, reduce=strategy.reduce_precision, loss_scale=ls,
                                   found_over=found_over(strategy, plan, bool(ls)))
        return self.adopt(section, strategy, plan, cluster)

    def adopt(self, section, strategy, plan, cluster):
        derived = found_over(strategy, plan, bool(section.loss_scale))
        if list(section.found_over) != derived:
            raise StrategyError(f"parallelize(plan=...): the Plan's precision.found_over is {section.found_over}, but "
                                f"this run's mesh ({plan.mesh}) and sharding need {derived} (every rank whose "
                                "gradients make the step must share the skip decision); hand back found_over as "
                                "planned, or change dp/tp/pp/zero")
        if section.found_over:
            plan.groups[FOUND_GROUP] = [list(g) for g in section.found_over]
        return section

    def make_passes(self, section) -> list:
        scale = bool(section.loss_scale)
        out = [(Slot.PRECISION, CastToCompute(PRECISION_DTYPES[section.compute], section.reduce, scale))]
        if section.reduce == "compute" and not scale:
            out.append((Slot.BUFFERS, CastGradsForUpdate()))
        if scale:
            ls = section.loss_scale
            out.append((Slot.BUFFERS, LossScaleStep(ls["growth_factor"], ls["backoff_factor"], ls["growth_interval"],
                                                    FOUND_GROUP if section.found_over else None)))
        return out

    def rank_info(self, section, program, rank: int):
        return dict(section.loss_scale) if section.loss_scale else None

    def state_bytes(self, section, program, rank: int) -> int:
        return 4 + 4 + 8 if section.loss_scale else 0


def found_over(strategy, plan, scaled: bool) -> list:
    """The groups of ranks whose found-inf flags fp16's update max-reduces: the ranks that hold different parts of
    one update -- a replica's pipeline stages and tensor-parallel pieces (Megatron-LM's model-parallel group), and
    where the update is sharded over dp every dp rank as well (each updates its own chunk), so every rank of the
    mesh. None where each rank's update reads whole gradients (data parallelism alone: they are summed, the same on
    every rank) or nothing is scaled. Replicas under pp or tp with a whole update each read the same summed
    gradients, so they decide alike."""
    mesh, sharded = plan.mesh, bool(strategy.option("zero"))
    if not scaled or (plan.pp == 1 and plan.tp == 1 and not sharded):
        return []
    if sharded:
        return [list(range(mesh.size))]
    return [[r for r in range(mesh.size) if mesh.coords(r)["dp"] == d] for d in range(plan.dp)]


def _check_one_step(strategy, plan) -> None:
    """fp16 needs one update per rank and step that every rank takes or skips together: refuse a schedule that
    updates inside its window (several weight versions) or places several stages on one pipeline rank (each stage's
    update would decide apart from the others on that rank)."""
    if plan.asynchronous:
        raise StrategyError(f"Strategy(precision='fp16', schedule={plan.schedule!r}): an asynchronous schedule updates "
                            "each stage inside its window, so no step is skipped on every rank together; use a "
                            "synchronous schedule with one stage per pipeline rank, or precision='bf16' (no loss "
                            "scale needed)")
    per_rank = {}
    for ranks in plan.stage_to_rank:
        for r in ranks:
            per_rank[r] = per_rank.get(r, 0) + 1
    several = sorted(r for r, n in per_rank.items() if n > 1)
    if several:
        raise StrategyError(f"Strategy(precision='fp16', schedule={plan.schedule!r}): pipeline rank(s) {several} hold "
                            "several stages, each updated by its own graph, so their skip decisions cannot be one; "
                            "use a schedule with one stage per pipeline rank, or precision='bf16' (no loss scale "
                            "needed)")
