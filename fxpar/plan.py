"""Plan: the decisions, as pure data. Printable, JSON round-trip, editable by hand.

A Plan is what the planner decided and what the passes carry out, for every strategy: a program
without a pipeline is a one-stage pipeline. Edit one and hand it back::

    plan = program.plan
    plan.cuts = ["blocks.3"]                       # move the pipeline cut
    plan.section("data_parallel").buckets[0] = [[...names...], [...]]   # stage 0's gradient buckets, in issue order
    program = fxpar.parallelize(..., plan=plan)

Fields a later decision depends on are re-derived when an edit invalidates them (new cuts give new
stage parameters, so buckets that no longer match a stage are planned again; ``explain()`` says so). An edit
that cannot hold is refused by name (:meth:`Plan.check_edits`): a mesh other than the Strategy's, stage lists of
different lengths, a parameter name the model does not have (in ``stage_params`` or a bucket), cuts without a
pipeline or against the Strategy's ``split_points``, a ``batch_dim`` other than 0, JSON that does not parse, an
unknown field or section. What the run reads from a handed-back Plan: ``microbatches``, ``cuts``, the feature
sections (the schedule, buckets, layouts ...). Every other field is derived from what the run is given, and an
edit of one (a value other than the one the run derives) is refused by name too (:meth:`Plan.check_derived`);
``notes`` are written afresh.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from .errors import StrategyError
from .feature import section_from_dict
from .mesh import Mesh

__all__ = ["Plan"]


def _groups_by_param(grad_groups: list) -> dict:
    """``grad_groups`` without the stages (which follow the cuts): param key -> the groups it is summed over."""
    out: dict = {}
    for per in grad_groups:
        for k, g in per.items():
            out.setdefault(k, set()).add(g)
    return {k: sorted(v, key=repr) for k, v in sorted(out.items())}


def _as_json(value):
    """``value`` as a JSON round trip gives it back (tuples as lists, int keys as strings): a Plan read from JSON
    compares equal to the one written."""
    return json.loads(json.dumps(value))


def _short(value, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class Plan:
    mesh_axes: list = field(default_factory=lambda: [["pp", 1], ["dp", 1]])   # [[name, size], ...], row-major
    batch_dim: int = 0                         # dim of every batch tensor that dp and microbatches split
    global_batch: int = 0
    microbatches: int = 1                      # per pipeline replica and step (every direction of a bidirectional one)
    cuts: list = field(default_factory=list)   # module path each stage after the first starts at
    candidates: list = field(default_factory=list)     # every module path a cut may go before
    stage_to_rank: list = field(default_factory=list)  # per stage: the pipeline ranks holding it
    stage_params: list = field(default_factory=list)   # per stage: its trainable parameters' keys
    tied: dict = field(default_factory=dict)           # param key -> stages that use it (when > 1)
    groups: dict = field(default_factory=dict)         # group name -> [[global ranks], ...] (disjoint)
    grad_groups: list = field(default_factory=list)    # per stage: {param key: group its gradient is summed over}
    loss_average: str = ""                     # "global" (by counted targets) or "per_shard" (docs/semantics.md)
    optimizer: dict = field(default_factory=dict)  # {"name": ..., "traced": bool, "why_not_traced": str}
    passes: list = field(default_factory=list)     # the passes each stage's joint graph goes through, in order
    custom_passes: list = field(default_factory=list)
    notes: list = field(default_factory=list)      # what the planner wants the user to know
    # every strategy's decisions (the gradient buckets, how state and operators are sharded, what is recomputed,
    # the order of communication ...): the enabled features' sections (fxpar.Feature), feature name -> its
    # PlanSection dataclass; a feature that is off has none
    features: dict = field(default_factory=dict)
    # the Strategy the Plan was made with: each setting off its default, as its repr (Strategy.given_settings); a
    # handed-back Plan is refused with a Strategy that sets one otherwise (the Plan's sections would win silently)
    made_with: dict = field(default_factory=dict)

    def section(self, name: str):
        """Feature ``name``'s Plan section, or None when the feature is off."""
        return self.features.get(name)

    @property
    def schedule_section(self):
        """The section of the pipeline schedule feature that picked the schedule, or None: one stage."""
        return next((sec for sec in self.features.values() if sec.picks_schedule), None)

    @property
    def schedule(self) -> str:
        """The schedule the program runs: a schedule name or a hand-written schedule's text (its pipeline schedule
        feature's section holds it), or ``"single"``: the one-stage program (gradient accumulation over the
        microbatches)."""
        sec = self.schedule_section
        return "single" if sec is None else sec.schedule

    @schedule.setter
    def schedule(self, value: str) -> None:
        sec = self.schedule_section
        if sec is None:
            raise ValueError(f"Plan.schedule = {value!r}: this Plan runs the one-stage program and has no "
                             "pipeline schedule section to edit; ask for the pipeline with "
                             f"Strategy(pp=..., schedule={value!r})")
        sec.schedule = value

    @property
    def asynchronous(self) -> bool:
        """Whether a feature's schedule keeps several weight versions per stage (each stage updates inside the
        window, never flushed)."""
        return any(sec.asynchronous for sec in self.features.values())

    @property
    def mesh(self) -> Mesh:
        return Mesh(tuple((n, int(s)) for n, s in self.mesh_axes))

    @property
    def dp(self) -> int:
        return self.mesh.axis_size("dp")

    @property
    def pp(self) -> int:
        return self.mesh.axis_size("pp") if "pp" in self.mesh.names else 1

    @property
    def tp_axes(self) -> list:
        """The tensor-parallel mesh axes (``tp``, or Tofu's halvings ``tp0``, ``tp1``, ...), fastest last."""
        return [n for n, _ in self.mesh.axes if n not in ("pp", "dp")]

    @property
    def tp(self) -> int:
        out = 1
        for a in self.tp_axes:
            out *= self.mesh.axis_size(a)
        return out

    @property
    def width(self) -> int:
        """Ranks holding one pipeline rank's stages: dp x tp."""
        return self.dp * self.tp

    @property
    def n_stages(self) -> int:
        return max(1, len(self.stage_to_rank))

    def coords(self, rank: int) -> tuple:
        """(pipeline rank, index within it) of a global rank: rank = pipeline rank * dp * tp + dp index * tp + tp
        index (tensor-parallel ranks are neighbours, as Megatron places them inside a node)."""
        return divmod(rank, self.width)

    def stage_ranks(self, stage: int) -> list:
        """The global ranks holding stage ``stage``: every dp and tp index of its pipeline ranks."""
        return [pr * self.width + i for pr in self.stage_to_rank[stage] for i in range(self.width)]

    def rank_stages(self, rank: int) -> list:
        """Stages whose weights global ``rank`` holds."""
        pr, _ = self.coords(rank)
        return [s for s, rs in enumerate(self.stage_to_rank) if pr in rs]

    def group_of(self, name: str, rank: int) -> tuple | None:
        """The ranks of group ``name`` that ``rank`` belongs to (None if it is in none)."""
        if name in self.mesh.names:
            return self.mesh.group(rank, name)
        for ranks in self.groups.get(name, []):
            if rank in ranks:
                return tuple(ranks)
        return None

    def all_groups(self) -> list:
        """Every process group the program uses, as ``(name, ranks)``, in one order (every rank creates them
        in it). Each name gets process groups of its own, even where two names cover the same ranks: the
        collectives of one name are issued in one order on every member, but two names' collectives need
        not be, so sharing a process group could pair one name's tensor with the other's."""
        out = [(axis, tuple(g)) for axis in ["dp"] + self.tp_axes for g in self.mesh.groups(axis)]
        for name in sorted(self.groups):
            out += [(name, tuple(g)) for g in self.groups[name]]
        return [(n, g) for n, g in dict.fromkeys(out) if len(g) > 1]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"Plan.from_json: the text is not valid JSON: {e.msg} at line {e.lineno}, column "
                             f"{e.colno}. Fix it there (Plan.to_json() writes the format).") from None
        if not isinstance(data, dict):
            raise ValueError(f"Plan.from_json: the JSON holds a {type(data).__name__}, not an object of Plan fields; "
                             "pass the text Plan.to_json() wrote")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Plan.from_json: unknown field(s) {unknown}; known: {sorted(known)} (a feature's "
                             "decisions go under \"features\": {section name: {...}})")
        data["features"] = {name: section_from_dict(name, sec) for name, sec in data.get("features", {}).items()}
        plan = cls(**data)
        plan.tied = {k: list(v) for k, v in plan.tied.items()}
        return plan

    def check_edits(self, strategy, param_keys, against_made_with: bool = True) -> None:
        """Refuse a handed-back Plan whose hand-edited fields cannot hold: ``microbatches`` not a positive int, a
        mesh other than the Strategy's, stage lists whose lengths disagree with each other, ``stage_params``
        naming a parameter the model does not have (``param_keys``), ``batch_dim`` other than 0, cuts without a
        pipeline (pp=1) or other than the Strategy's ``split_points``; with ``against_made_with`` (a Strategy the
        user passed), a Strategy that sets a setting otherwise than the one the Plan was made with. Fields derived from others
        are re-derived (module docstring); these would otherwise be dropped without a word."""
        m = self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise StrategyError(f"parallelize(plan=...): the Plan's microbatches={m!r} must be a positive int (the "
                                "microbatches per step); fix it in the Plan or its JSON")
        given = {"dp": self.dp, "tp": self.tp, "pp": self.pp}
        want = {"dp": strategy.dp, "tp": strategy.tp, "pp": strategy.pp}
        if given != want:
            raise StrategyError(f"parallelize(plan=...): the Plan's mesh_axes {self.mesh_axes} give "
                                + ", ".join(f"{k}={v}" for k, v in given.items()) + f", but {strategy} asks for "
                                + ", ".join(f"{k}={v}" for k, v in want.items()) + ". The mesh comes from the Strategy: "
                                "change dp/tp/pp in Strategy(...) and plan again, not mesh_axes")
        if self.stage_to_rank and self.stage_params and len(self.stage_to_rank) != len(self.stage_params):
            raise StrategyError(f"parallelize(plan=...): the Plan's stage_to_rank lists {len(self.stage_to_rank)} "
                                f"stage(s) but its stage_params {len(self.stage_params)}. Both follow cuts (one module "
                                "path per stage after the first): edit cuts (or Strategy(pp=...)) and leave these two "
                                "as planned")
        if self.batch_dim != 0:
            raise StrategyError(f"parallelize(plan=...): the Plan's batch_dim={self.batch_dim!r}, but fxpar splits every "
                                "batch tensor on dim 0 (over dp and microbatches). Set batch_dim to 0 and put the batch "
                                "on dim 0 of every tensor of example_inputs (docs/semantics.md, 'Inputs')")
        if self.cuts and self.pp == 1:
            raise StrategyError(f"parallelize(plan=...): the Plan's cuts {self.cuts} cut a pipeline, but its mesh and "
                                f"{strategy} have pp=1: a one-stage program has no cuts, so they would be ignored. "
                                "Set cuts to [] for one stage, or ask for a pipeline (Strategy(pp=2, ...)) and edit "
                                "the cuts of that program's Plan")
        if self.cuts and strategy.split_points and list(self.cuts) != list(strategy.split_points):
            raise StrategyError(f"parallelize(plan=...): the Plan's cuts {self.cuts} and Strategy(split_points="
                                f"{list(strategy.split_points)}) disagree, and the Plan's would win without a word. "
                                "Keep one: drop split_points from the Strategy, or set the Plan's cuts to [] (or to "
                                "the same list)")
        if self.made_with and against_made_with:
            # a setting the Strategy leaves at its default says nothing: the Plan's stands
            now = strategy.given_settings()
            differ = [k for k in sorted(now) if self.made_with.get(k) != now[k]
                      and k not in ("dp", "tp", "pp", "split_points")]
            if differ:
                raise StrategyError(
                    "parallelize(plan=...): the Plan was made with " + ", ".join(
                        f"{k}={self.made_with.get(k, '(its default)')}" for k in differ)
                    + " but the Strategy passed with it has " + ", ".join(f"{k}={now[k]}" for k in differ)
                    + ". A handed-back Plan's decisions win over the Strategy's options, so the program would not run "
                    "what the Strategy says. Pass the Plan's own strategy (program.strategy) and edit the Plan, or "
                    "drop plan= to plan again with the new Strategy")
        known = set(param_keys)
        for s, keys in enumerate(self.stage_params):
            bad = [k for k in keys if k not in known]
            if bad:
                raise StrategyError(f"parallelize(plan=...): the Plan's stage_params[{s}] names {bad}, which the model "
                                    f"does not have (its parameters look like {sorted(known)[:6]}); fix the name, or "
                                    "plan again from the Strategy")

    # fields the planner derives, each from what the run is given (not from the Plan), and what of each is compared
    # with the run's: a handed-back Plan that sets one (not left at its default) to another value than the run
    # derives would have that edit dropped. Which stage holds a parameter follows the cuts, and a Plan whose cuts
    # were edited still lists the stages of the old cuts: of the per-stage fields only what no cut changes is
    # compared (which parameters train, which are tied, each one's gradient group), and the placement and the
    # groups only where the number of stages is the run's (an edited schedule may change it).
    _DERIVED = {
        "global_batch": ("the rows of example_inputs", "give example_inputs that many rows", None, False),
        "candidates": ("the model's module boundaries", "choose cuts among them", None, False),
        "optimizer": ("parallelize(optimizer=...) and the cluster's device", "pass that optimizer", None, False),
        "loss_average": ("Strategy(loss_average=...) and loss_fn", "set Strategy(loss_average=...)", None, False),
        "custom_passes": ("Strategy(passes=[...])", "pass them in Strategy(passes=[...])", None, False),
        "passes": ("the Strategy and the Plan's feature sections", "add a pass of your own with "
                   "Strategy(passes=[...]); the order of the built-in passes is fixed (fxpar/lower.py)", None, False),
        "stage_to_rank": ("the pipeline schedule", "set Strategy(schedule=...) or write the placement in a "
                          "hand-written schedule", None, True),
        "stage_params": ("the model's trainable parameters", "freeze a parameter with requires_grad_(False) "
                         "before parallelize; move one to another stage by editing cuts",
                         lambda v: sorted({k for keys in v for k in keys}), False),
        "tied": ("the parameters several stages use", "tie or untie them in the model", lambda v: sorted(v), False),
        "groups": ("the mesh and the schedule's placement", "change dp/tp/pp or the schedule", None, True),
        "grad_groups": ("the mesh, the schedule's placement and the tied parameters", "change dp/tp/pp or the "
                        "schedule", _groups_by_param, True),
    }

    def check_derived(self, planned: "Plan") -> None:
        """After planning from this handed-back Plan: refuse a field the run does not read from it (it derives it,
        ``_DERIVED``) that this Plan sets to another value than ``planned`` holds -- a hand edit that would be
        dropped. A field left at its default is not given."""
        default = Plan()
        same_count = len(self.stage_to_rank) == len(planned.stage_to_rank)
        for name, (source, fix, norm, per_stage) in self._DERIVED.items():
            given, got = getattr(self, name), getattr(planned, name)
            if given == getattr(default, name) or (per_stage and not same_count):
                continue
            if norm is not None:
                given, got = norm(given), norm(got)
            if _as_json(given) == _as_json(got):
                continue
            if isinstance(given, dict) and isinstance(got, dict):      # name only the entries that differ
                keys = [k for k in {**got, **given} if _as_json(given.get(k)) != _as_json(got.get(k))]
                given, got = {k: given.get(k) for k in keys}, {k: got.get(k) for k in keys}
            raise StrategyError(f"parallelize(plan=...): the Plan's {name} gives {_short(given)}, but this run derives "
                                f"{_short(got)} from {source}; the Plan's {name} is not read, so that edit would be "
                                f"dropped: {fix}, or hand back {name} as planned (program.plan.{name})")

    def __str__(self) -> str:
        lines = [f"mesh: {self.mesh} (global rank = pp index * dp + dp index)" if self.tp == 1 else
                 f"mesh: {self.mesh} (global rank = (pp index * dp + dp index) * tp + tp index)",
                 f"batch: {self.global_batch} split on dim {self.batch_dim} over dp={self.dp}, "
                 f"{self.microbatches} microbatch(es) per step"]
        if self.n_stages > 1:
            lines.append(f"stages: {self.n_stages}, starting before {['(start)'] + list(self.cuts)}; "
                         f"placement (stage: pipeline ranks) {dict(enumerate(self.stage_to_rank))}")
        sched = self.schedule if "\n" not in self.schedule else "hand-written (" + self.schedule.splitlines()[0] + ")"
        lines.append(f"schedule: {sched}")
        if self.tied:
            lines.append(f"tied parameters (gradients summed over the stages using them): {self.tied}")
        if self.loss_average:
            lines.append(f"loss: {self.loss_average} average over shards and microbatches (docs/semantics.md)")
        opt = self.optimizer
        lines.append(f"optimizer: {opt.get('name')} " + ("traced into the graph" if opt.get("traced")
                                                          else f"eager on each rank ({opt.get('why_not_traced')})")
                     + (f"; {'one fused kernel per update' if opt['kernel'] == 'fused' else 'torch._foreach_* ops'} "
                        f"({opt.get('why_kernel')})" if opt.get("kernel") else ""))
        for name, sec in self.features.items():
            lines += [f"{name}: {ln}" for ln in sec.plan_lines(self)]
        if self.passes:
            lines.append(f"passes: {' -> '.join(self.passes)}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
