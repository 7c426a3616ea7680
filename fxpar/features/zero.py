"""ZeRO stages 1-3 (Rajbhandari et al., SC'20) as one Feature: ``Strategy(dp=N, zero=1 | 2 | 3)``.

* option ``zero`` (0 off; 1 optimizer state, 2 + gradients, 3 + parameters sharded over dp), validated here;
* its Plan section :class:`ZeroSection` (the stage and the dp size it shards over);
* its planning (:meth:`Zero.plan`: what it refuses, the Plan's note) and the schedule's ``UNSHARD`` /
  ``RESHARD`` actions for stage 3 under F/B graphs (:meth:`Zero.schedule`);
* its pass ``passes.zero.ZeroShard`` in the ``SHARD_STATE`` slot (the layout: ``fxpar.zero_layout``);
* its per-rank state :class:`ZeroState`: the rank's chunks of optimizer state (and of parameters under stage
  3), the chunk each update reads (role ``param_shard``), the parameters an ``UNSHARD`` gathered for the step
  (role ``unsharded``), whole tensors for ``state_dict()`` and checkpoints (a collective over dp);
* its lines in ``explain()``: what each rank holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxpar import meta as M
from fxpar.roles import GraphKind, Role
from fxpar.errors import StrategyError
from fxpar.explain import fmt_bytes
from fxpar.feature import Feature, Option, PlanSection, RankState, Slot, register_feature, schedule_names
from fxpar.runtime.groups import group
from fxpar.schedule import ActionKind, add_unshard
from fxpar.zero_layout import chunk, describe, unchunk, zero_keys
from passes.zero import ZeroShard

__all__ = ["Zero", "ZeroSection", "ZeroState"]


@dataclass
class ZeroSection(PlanSection):
    """The decision: the ZeRO stage and the dp size its chunks are cut for."""
    stage: int = 1
    dp: int = 1

    def lines(self) -> list:
        return [f"ZeRO stage {self.stage} over dp={self.dp}: gradient buckets reduce-scattered into "
                f"ZeRO-{self.stage} chunks; {describe(self.stage)}"]


class ZeroState(RankState):
    """What a rank holds under ZeRO. ``info``: per held stage that the pass sharded, ``{"stage": 1|2|3, "n": dp,
    "keys": {key: [shape, chunk numel]}}`` (the joint graph's ``fxpar_zero``)."""
    input_roles = (Role.PARAM_SHARD, Role.UNSHARDED)

    def __init__(self, info, rank):
        super().__init__(info, rank)
        self.stages = {int(s): i for s, i in info.items()}
        self.collective = bool(self.stages)        # whole tensors are gathered over dp: every rank calls whole()
        self.unsharded: dict = {}                  # stage -> its parameters gathered by UNSHARD, until RESHARD

    # ---- layout -----------------------------------------------------------------------------------
    def _rechunk(self, ex) -> None:
        """Cut whole tensors into this rank's chunks: optimizer state (stages 1-3) and parameters (stage 3).
        Chunks stay chunks."""
        for s, info in self.stages.items():
            n = info["n"]
            for k, (shape, c) in info["keys"].items():
                if info["stage"] == 3 and ex.params[s][k].numel() != c:
                    ex.params[s][k] = chunk(ex.params[s][k], n, ex.dp_index).clone()
                for name in ex.spec.state_names:
                    t = ex.state[s][f"{name}:{k}"]
                    if t.numel() != c or t.dim() != 1:
                        ex.state[s][f"{name}:{k}"] = chunk(t, n, ex.dp_index).clone()

    def setup(self, ex) -> None:
        self._rechunk(ex)

    def after_load(self, ex) -> None:
        self._rechunk(ex)

    # ---- graph inputs -----------------------------------------------------------------------------
    def provide_role(self, ex, role, key, stage, weights):
        if role == Role.PARAM_SHARD:           # stages 1-2: the update reads this rank's chunk of a whole parameter
            return chunk(weights[key], self.stages[stage]["n"], ex.dp_index)
        return self.unsharded[stage][key]   # "unsharded": the stage's parameters UNSHARD gathered for this step

    def handlers(self, ex) -> dict:
        def unshard(a, w, idx):
            """ZeRO-3 under a pipeline: gather the stage's parameters once for the step's forwards and backwards."""
            s = a.stage
            sg = ex.p.graphs[s].get(GraphKind.UNSHARD)
            if sg is None:
                return
            res = sg.gm(*[ex.params[s][key] for _, key in sg.inputs])
            self.unsharded[s] = {key: v for (_, key), v in zip(sg.outputs, res)}

        def reshard(a, w, idx):
            self.unsharded.pop(a.stage, None)      # the gathered parameters go; the chunks stay
        return {ActionKind.UNSHARD: unshard, ActionKind.RESHARD: reshard}

    # ---- whole tensors ----------------------------------------------------------------------------
    def _whole(self, ex, s: int, key: str, t: torch.Tensor) -> torch.Tensor:
        """Collective over dp: the whole tensor from every rank's chunk ``t`` of parameter ``key``."""
        info = self.stages[s]
        parts = [torch.empty_like(t) for _ in range(info["n"])]
        dist.all_gather(parts, t.contiguous(), group=group(ex.p.bindings["dp"], "dp"))
        return unchunk(parts, info["keys"][key][0])

    def whole(self, ex, params, state):
        for s in sorted(self.stages):
            info = self.stages[s]
            for k in info["keys"]:
                if info["stage"] == 3:
                    params[s][k] = self._whole(ex, s, k, params[s][k])
                for name in ex.spec.state_names:
                    state[s][f"{name}:{k}"] = self._whole(ex, s, k, state[s][f"{name}:{k}"])
        return params, state

    def save(self) -> dict:
        return {}            # the checkpoint holds whole tensors (whole()); the chunks are cut again on load


@register_feature
class Zero(Feature):
    name = "zero"
    doc = "ZeRO: optimizer state, gradients and parameters sharded over dp (Rajbhandari et al., SC'20)"
    options = {"zero": Option(0, (
        "ZeRO (Rajbhandari et al., SC'20; passes/zero.py), over the dp axis: ``0`` off; ``1`` optimizer state "
        "sharded (gradients reduce-scattered once per step, updated chunks all-gathered); ``2`` gradients too "
        "(reduce-scattered in backward, as each bucket fills); ``3`` parameters too (all-gathered before their "
        "forward use and again before their backward use). Needs dp > 1 and a traced optimizer (SGD, Adam, AdamW)."))}
    section = ZeroSection
    passes = ((Slot.SHARD_STATE, ZeroShard),)
    state = ZeroState

    def enabled(self, strategy) -> bool:
        z = strategy.zero
        return isinstance(z, bool) or z != 0        # zero=False is refused by validate(), as any non-stage

    def validate(self, strategy) -> None:
        z = strategy.zero
        if z not in (0, 1, 2, 3) or isinstance(z, bool):
            raise StrategyError(f"Strategy(zero={z!r}): choose 0 (off), 1 (optimizer state sharded over dp), "
                                "2 (+ gradients) or 3 (+ parameters)")
        if strategy.dp == 1:
            raise StrategyError(f"Strategy(zero={z}, dp=1): ZeRO shards over the dp axis, and dp=1 leaves "
                                "nothing to shard; set dp > 1 (e.g. Strategy(dp=4, zero=" + str(z) + ")) or zero=0")

    def plan(self, strategy, plan, cluster):
        """Refuse what ZeRO cannot shard; the section and the Plan's note."""
        z = strategy.zero
        if plan.dp == 1:
            raise StrategyError(f"zero={z} with dp=1: ZeRO shards over the dp axis; set dp > 1 or zero=0")
        opt = plan.optimizer or {}
        if opt and not opt.get("traced"):
            name = opt.get("name")
            raise StrategyError(f"{strategy}: ZeRO runs the optimizer on each rank's chunks inside the step graph, and "
                                f"{name} is not traced ({opt.get('why_not_traced')}). Use torch.optim.SGD, Adam or "
                                f"AdamW without those options, or zero=0: then {name} runs eagerly on every rank "
                                "with whole parameters and state (plain data parallelism).")
        if plan.asynchronous:
            raise StrategyError(f"{strategy}: schedule {plan.schedule!r} keeps several weight versions per stage; ZeRO "
                                f"is built for synchronous schedules ({', '.join(schedule_names(asynchronous=False))}). "
                                "Use one of those, or zero=0.")
        section = ZeroSection(stage=z, dp=plan.dp)
        plan.features[self.name] = section            # zero_keys reads the section
        n_keys = sum(len(zero_keys(plan, s)) for s in range(len(plan.stage_params)))
        whole = sum(len(k) for k in plan.stage_params) - n_keys
        plan.notes.append(f"zero={z}: {describe(z)}; {n_keys} parameter(s) in dp={plan.dp} chunks"
                          + (f", {whole} kept whole (shared by stages or held by one rank)" if whole else ""))
        return section

    def plan_schedule(self, section, plan, schedule):
        """Stage 3 with F/B graphs: gather each stage's parameters once a step (``UNSHARD`` .. ``RESHARD``)."""
        if section.stage != 3 or any(a.kind is ActionKind.FULL for acts in schedule.actions.values() for a in acts):
            return schedule
        return add_unshard(schedule, [s for s in range(plan.n_stages) if zero_keys(plan, s)])

    def rank_info(self, section, program, rank):
        info = {s: program.stages[s].joint.meta.get(M.ZERO.name) for s in program.plan.rank_stages(rank)}
        return {s: z for s, z in info.items() if z} or None

    def explain(self, section, program) -> list:
        """The section's line, then what each rank holds."""
        plan, lines = program.plan, section.lines()
        nbytes = lambda cap, k: (int(torch.Size(cap.param_shapes[k]).numel())        # noqa: E731
                                 * torch.empty((), dtype=cap.param_dtypes[k]).element_size())
        for st in program.stages:
            cap = st.captured
            keys = (st.joint.meta.get(M.ZERO.name) or {}).get("keys", {})
            whole = sum(nbytes(cap, k) for k in cap.param_names)
            sharded = sum(nbytes(cap, k) for k in keys)
            part = lambda stage: whole - sharded + sharded / plan.dp if section.stage >= stage else whole   # noqa: E731
            lines.append(f"stage {st.index}: {len(keys)} parameter(s) in chunks of {fmt_bytes(sharded)} (padding "
                         f"aside); per rank: parameters {fmt_bytes(part(3))}, gradients {fmt_bytes(part(2))}, "
                         f"optimizer state {fmt_bytes(part(1) * len(cap.optimizer.state_names))}")
        return lines
