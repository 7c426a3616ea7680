"""Asynchronous pipelines without weight stashing: ``Strategy(pp=p, schedule="pipelined_bp" | "pipemare")``.

Both run 1F1B without a flush, an update after every microbatch's backward, and one weight version per stage: a
forward computes with the stage's newest weights and so does its backward, ``D_s = p - s - 1`` updates later
(``fxpar/schedule/delayed.py``). The forward saves no weights (``passes.backward_weights`` moves the weights a
backward reads into its inputs, role ``backward_param``), so nothing is stashed. What differs is how the delay is
corrected, by this feature's per-rank state (:class:`DelayedState`):

* Pipelined Backpropagation (Kosson et al., MLSys'21), ``correction=``, for SGD with momentum m and learning rate
  lr (v: the momentum buffer, g: the update's gradient with weight decay, D = D_s):

  - ``"sc"``, spike compensation: ``w <- w - lr * (a * v_new + b * g)``, ``a = m**D``, ``b = (1 - m**D) / (1 - m)``
    (the gradient's first D momentum steps taken at once, the rest scaled by m**D);
  - ``"lwp"``, linear weight prediction: the forward computes with ``w - lr * D * v`` (the weights D updates ahead
    at the present velocity), the backward with the stage's weights when it runs;
  - ``"sc+lwp"``: both; None: the delayed update alone.

* PipeMare (Yang et al., MLSys'21), any optimizer:

  - ``lr_warmup=K``: stage s's learning rate at its update k is ``lr * max(D_s, 1) ** -(1 - min(k / K, 1))``: 1/D_s
    of it at the start, all of it after K updates;
  - ``discrepancy_correction=True``: a velocity ``delta <- gamma * delta + (1 - gamma) * (w_new - w)`` per stage,
    ``gamma = 0.1 ** (1 / D_s)``, and the backward runs on ``w - D_s * delta``: the weights extrapolated back to
    those its forward used.

``fxpar.testing.async_reference.delayed_pipeline_reference`` holds the same math in one process. The papers' method
sections could not be read (docs/strategies/pipelines.md, "Checked against the papers"): the constants above rest on
the properties the papers choose them for, which ``tests/test_pipeline_pbp.py`` checks (SC's total impulse is plain
momentum's; LWP's horizon is the delay; the warm-up runs from 1/D to 1; gamma^D = 0.1), not on the papers' text. The
warm-up has the form and delay of one independent implementation (Ajanthan et al., ICML 2025, which counts updates
from 1 where ``lr_factor`` counts from 0); the rest has none to compare with. A checkpoint carries what the next
window's first ``D_s`` forwards read (the stage's versions before the newest, through the runtime; with weight
prediction their momentum, through :class:`DelayedState`), so a resumed run is the run that never stopped, bit for
bit.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from cost_models.compute import tensor_bytes
from fxpar.errors import StrategyError
from fxpar.feature import Option, RankState, register_feature
from fxpar.roles import GraphKind, Role
from fxpar.schedule import ActionKind
from fxpar.schedule.delayed import pipelined_bp, pipemare, stage_delay
from passes.backward_weights import read_weights_at_backward

from .pipeline import PipelineSchedule, PipelineSection, asked_schedule
from .pipeline_async import refuse_tied_weights

__all__ = ["DelayedPipelines", "DelayedSection", "DelayedState", "CORRECTIONS", "lr_factor", "velocity_decay",
           "spike_coefficients"]

CORRECTIONS = (None, "sc", "lwp", "sc+lwp")
_BP, _MARE = "pipelined_bp", "pipemare"
# the options each schedule of this feature reads
_OWN = {"correction": _BP, "lr_warmup": _MARE, "discrepancy_correction": _MARE}


def spike_coefficients(momentum: float, delay: int) -> tuple:
    """Spike compensation's ``(a, b)`` for momentum m and delay D: ``(m**D, (1 - m**D) / (1 - m))``."""
    a = momentum ** delay
    return a, (1.0 - a) / (1.0 - momentum)


def lr_factor(delay: int, k: int, warmup: int) -> float:
    """PipeMare's learning-rate factor of a stage with delay ``delay`` at its update ``k`` (0 first) over a warm-up of
    ``warmup`` updates: ``max(delay, 1) ** -(1 - min(k / warmup, 1))`` (1 without a warm-up)."""
    if not warmup:
        return 1.0
    return float(max(delay, 1)) ** -(1.0 - min(k / warmup, 1.0))


def velocity_decay(delay: int) -> float:
    """The decay of PipeMare's velocity estimate for a stage with delay ``delay``: ``0.1 ** (1 / delay)``."""
    return 0.1 ** (1.0 / delay) if delay else 0.0


class DelayedState(RankState):
    """Per rank: the learning rate each update uses, the corrections after it, the weights F and B read.

    ``tensors``: PipeMare's velocity estimate (``"delta:<key>"``) with ``discrepancy_correction``, saved in
    checkpoints. With weight prediction, a checkpoint also carries each stage's momentum buffers of the ``D_s``
    versions before the newest (:meth:`save`): a resumed window's first forwards predict from the versions the
    checkpoint carries (``fxpar.runtime.state``), each with its own velocity, as in the run that never stopped."""
    input_roles = (Role.FORWARD_PARAM, Role.BACKWARD_PARAM)

    def setup(self, ex) -> None:
        self.before: dict = {}
        if self.info["discrepancy_correction"]:
            self.tensors = {f"delta:{k}": torch.zeros_like(v) for ps in ex.params.values() for k, v in ps.items()}
        self.lwp = "lwp" in self.info["correction"]
        self.reading: dict = {}        # stage -> the weight version the running forward reads
        self.carried: dict = {}        # stage -> momentum of the versions a resumed window starts with, oldest first
        self.history: dict = {}        # stage -> the last D_s momentum buffers before the newest, for a checkpoint
        self.unloaded = False          # a resumed window whose checkpoint did not carry them
        if self.lwp and ex.p.settings.save_to:     # before any update every earlier version is the first
            self.history = {s: [self._momentum(ex, s)] * n for s in ex.params
                            if (n := ex.p.settings.carried.get(s, 0))}

    @staticmethod
    def _momentum(ex, stage: int, state: dict | None = None) -> dict:
        state = ex.state[stage] if state is None else state
        return {k: state[f"momentum_buffer:{k}"] for k in ex.params[stage]}

    def provide_role(self, ex, role, key, stage, weights):
        delay = self.info["delays"][stage]
        if role == Role.FORWARD_PARAM:            # linear weight prediction: D updates ahead at today's velocity
            lr = float(ex.torch_opt.param_groups[0]["lr"])
            carried, version = self.carried.get(stage, ()), self.reading.get(stage)
            v = (carried[version][key] if version is not None and version < len(carried)
                 else ex.state[stage][f"momentum_buffer:{key}"])
            return weights[key] - (lr * delay) * v
        w = ex.params[stage][key]                 # the backward: the stage's weights when it runs
        if self.info["discrepancy_correction"] and delay:
            return w - delay * self.tensors[f"delta:{key}"]
        return w

    def after_load(self, ex) -> None:
        carries = any(ex.p.settings.carried.get(s, 0) for s in ex.params)
        self.unloaded = self.lwp and ex.p.settings.resumed and carries

    def save(self) -> dict:
        out = super().save()
        if self.history:
            out["momentum_history"] = {s: [{k: v.clone() for k, v in m.items()} for m in ms]
                                       for s, ms in self.history.items()}
        return out

    def load(self, saved: dict) -> None:
        saved = dict(saved)
        history = saved.pop("momentum_history", None)
        super().load(saved)
        if self.lwp and history is not None:
            self.carried = {s: [{k: v.clone() for k, v in m.items()} for m in ms] for s, ms in history.items()}
            self.history = {s: list(ms) for s, ms in self.carried.items()} if self.history else {}
            self.unloaded = False

    def handlers(self, ex) -> dict:
        step = ex.handlers[ActionKind.STEP]
        self.base_lr = [float(g["lr"]) for g in ex.torch_opt.param_groups]     # the warm-up scales these

        forward = ex.handlers[ActionKind.F]

        def read(a, w, idx):
            if self.unloaded:
                raise RuntimeError(
                    f"rank {self.rank}: Strategy(schedule='pipelined_bp', correction={self.info['correction']!r}) "
                    "resumes from a checkpoint that does not carry the momentum of each stage's versions before the "
                    "newest, which the first forwards of the window predict from: resume from a checkpoint a run "
                    "with weight prediction saved.")
            self.reading[a.stage] = a.version
            forward(a, w, idx)

        def run(a, w, idx):
            s = a.stage
            if self.info["lr_warmup"]:
                factor = lr_factor(self.info["delays"][s], ex.step_count[s], self.info["lr_warmup"])
                for group, base in zip(ex.torch_opt.param_groups, self.base_lr):
                    group["lr"] = base * factor
            self.before[s] = (ex.params[s], dict(ex.state[s]), float(ex.torch_opt.param_groups[0]["lr"]))
            step(a, w, idx)

        return {ActionKind.STEP: run, **({ActionKind.F: read} if self.lwp else {})}

    def after_update(self, ex, stage: int) -> None:
        before = self.before.pop(stage, None)
        if before is None:
            return
        w0, state0, lr = before
        delay, keys = self.info["delays"][stage], list(ex.params[stage])
        if self.lwp:
            self.carried.pop(stage, None)     # the forwards on carried versions all ran before the first update
            if stage in self.history:
                self.history[stage] = (self.history[stage] + [self._momentum(ex, stage, state0)])[1:]
        if "sc" in self.info["correction"] and delay:     # w1 = w0 - lr (a v1 + b g), g = v1 - m v0
            m = self.info["momentum"]
            a, b = spike_coefficients(m, delay)
            new = dict(ex.params[stage])
            for k in keys:
                v1, v0 = ex.state[stage][f"momentum_buffer:{k}"], state0[f"momentum_buffer:{k}"]
                new[k] = w0[k] - lr * ((a + b) * v1 - (b * m) * v0)
            ex.params[stage] = new
        if self.info["discrepancy_correction"] and delay:
            gamma = velocity_decay(delay)
            for k in keys:
                d = self.tensors[f"delta:{k}"]
                self.tensors[f"delta:{k}"] = gamma * d + (1.0 - gamma) * (ex.params[stage][k] - w0[k])

    def report(self):
        """The bytes this rank holds beside its one weight version: PipeMare's velocity estimate."""
        return {"velocity_bytes": self.nbytes()}



@dataclass
class DelayedSection(PipelineSection):
    """``schedule``: ``"pipelined_bp"`` or ``"pipemare"``; ``delays``: D_s per stage; the corrections it runs."""
    correction: str | None = None
    lr_warmup: int = 0
    discrepancy_correction: bool = False
    delays: list = field(default_factory=list)
    momentum: float = 0.0          # SGD's momentum, which spike compensation and weight prediction read
    asynchronous = True

    def lines(self) -> list:
        fixes = ([f"correction={self.correction!r}"] if self.correction else []) + (
            [f"lr_warmup={self.lr_warmup}"] if self.lr_warmup else []) + (
            ["discrepancy_correction"] if self.discrepancy_correction else [])
        return [f"{self.schedule}, asynchronous without weight stashing: one weight version per stage, the gradient "
                f"{self.delays} updates late per stage; " + (", ".join(fixes) if fixes else "uncorrected")]


@register_feature
class DelayedPipelines(PipelineSchedule):
    name = "delayed_pipeline"
    doc = ("asynchronous pipelines without weight stashing: Pipelined Backpropagation (Kosson et al., MLSys'21), "
           "PipeMare (Yang et al., MLSys'21)")
    section = DelayedSection
    state = DelayedState
    schedules = {_BP: pipelined_bp, _MARE: pipemare}
    papers = {
        _BP: "Pipelined Backpropagation (Kosson et al., MLSys'21): 1F1B without a flush, an update after every "
             "microbatch, no stash; spike compensation and linear weight prediction correct the delay",
        _MARE: "PipeMare (Yang et al., MLSys'21): 1F1B without a flush, an update after every microbatch, one weight "
               "copy per stage; a learning-rate warm-up per stage and a backward on extrapolated weights",
    }
    options = {
        "correction": Option(None, "schedule='pipelined_bp': the delay correction, None, 'sc' (spike compensation), "
                                   "'lwp' (linear weight prediction) or 'sc+lwp'; needs torch.optim.SGD with momentum"),
        "lr_warmup": Option(None, "schedule='pipemare': updates of the per-stage learning-rate warm-up (stage s starts "
                                  "at lr / D_s, D_s = pp - s - 1, and reaches lr after lr_warmup updates)"),
        "discrepancy_correction": Option(False, "schedule='pipemare': the backward runs on the weights extrapolated "
                                                "back by the stage's delay with a velocity estimate"),
    }

    # ---- the decision ------------------------------------------------------------------------------
    def validate(self, strategy) -> None:
        name = asked_schedule(strategy)
        correction = strategy.option("correction")
        if correction not in CORRECTIONS:
            raise StrategyError(f"Strategy(schedule={name!r}, correction={correction!r}): unknown correction; "
                                f"Pipelined Backpropagation corrects with one of {list(CORRECTIONS)} (spike "
                                "compensation, linear weight prediction, both). Pick one of them.")
        for opt, owner in _OWN.items():
            value = strategy.option(opt)
            if owner != name and value != self.options[opt].default:
                fix = ("PipeMare corrects with lr_warmup= and discrepancy_correction=" if name == _MARE else
                       "Pipelined Backpropagation corrects with correction=")
                raise StrategyError(f"Strategy(schedule={name!r}, {opt}={value!r}): {opt}= belongs to "
                                    f"schedule={owner!r}, which this Strategy does not run; {fix}. Drop {opt}= or "
                                    f"set schedule={owner!r}.")
        warmup = strategy.option("lr_warmup")
        if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0):
            raise StrategyError(f"Strategy(schedule='pipemare', lr_warmup={warmup!r}): the warm-up is a number of "
                                "updates, an int >= 0; pass lr_warmup=N (or None for no warm-up).")
        if strategy.pp == 1:
            warnings.warn(f"Strategy(pp=1, schedule={name!r}): with one stage no gradient is late (the delay is 0), "
                          f"so {name!r} is plain SGD with an update per microbatch; use pp > 1 for a pipeline.",
                          UserWarning, stacklevel=2)

    def check_off(self, strategy) -> None:
        for opt, owner in _OWN.items():
            value = strategy.option(opt)
            if value != self.options[opt].default:
                raise StrategyError(f"Strategy(schedule={asked_schedule(strategy)!r}, {opt}={value!r}): {opt}= "
                                    f"belongs to schedule={owner!r}, which this Strategy does not run, so nothing "
                                    f"would use it. Drop {opt}= or set schedule={owner!r}.")

    def plan(self, strategy, plan, cluster):
        return self.section(schedule=asked_schedule(strategy), correction=strategy.option("correction"),
                            lr_warmup=strategy.option("lr_warmup") or 0,
                            discrepancy_correction=bool(strategy.option("discrepancy_correction")),
                            delays=[stage_delay(strategy.pp, s) for s in range(strategy.pp)])

    def plan_stage(self, section, plan, stage, captured, cluster, schedule) -> None:
        if not section.correction:
            return
        opt = captured.optimizer
        kw = opt.kwargs
        why = ("it is " + opt.name if opt.cls is not torch.optim.SGD else
               "its momentum is 0" if not kw.get("momentum", 0) else
               "it is Nesterov's" if kw.get("nesterov") else
               f"its dampening is {kw['dampening']}" if kw.get("dampening", 0) else
               "fxpar does not trace its step" if not opt.traced else "")
        if why:
            raise StrategyError(f"Strategy(schedule='pipelined_bp', correction={section.correction!r}) corrects "
                                "SGD with momentum (it reads the momentum buffer), but the optimizer is not that: "
                                f"{why}. Pass optimizer=(torch.optim.SGD, {{'lr': ..., 'momentum': 0.9}}), or "
                                "correction=None.")
        section.momentum = float(kw["momentum"])

    def make_schedule(self, section, plan, n_batches: int = 2, resumed: bool = False):
        """One window over every microbatch of the run: an update per microbatch, never flushed; ``resumed``: it starts
        holding the ``D_s`` versions before the newest that the checkpoint carries (the run that never stopped ran
        its first forwards on them)."""
        return self.schedules[section.schedule](plan.pp, plan.microbatches * n_batches, resumed=resumed)

    def grad_scale(self, section, plan) -> float:
        """An update per microbatch: its gradient is not averaged over the batch's microbatches."""
        return 1.0

    def cut_stages(self, section, strategy, plan, base, model, micro, loss_fn, cluster) -> tuple:
        trace, split = super().cut_stages(section, strategy, plan, base, model, micro, loss_fn, cluster)
        refuse_tied_weights(section.schedule, plan)
        return trace, split

    # ---- the mechanism -----------------------------------------------------------------------------
    def after_split(self, section, parts: dict, joint, ctx) -> dict:
        """The forward saves no weights; the backward reads the stage's weights when it runs (``backward_param``),
        and with weight prediction the forward reads predicted ones (``forward_param``)."""
        if GraphKind.F not in parts or GraphKind.B not in parts:
            return parts
        predict = "lwp" in (section.correction or "") and section.delays[ctx.stage] > 0
        return read_weights_at_backward(parts, Role.FORWARD_PARAM if predict else None)

    def rank_info(self, section, program, rank: int):
        return {"schedule": section.schedule, "correction": section.correction or "", "delays": list(section.delays),
                "momentum": section.momentum, "lr_warmup": section.lr_warmup,
                "discrepancy_correction": section.discrepancy_correction}

    # ---- what it costs ------------------------------------------------------------------------------
    def state_bytes(self, section, program, rank: int) -> int:
        """PipeMare's velocity estimate with ``discrepancy_correction``: one tensor per parameter of every stage the
        rank holds (:meth:`DelayedState.setup`)."""
        if not section.discrepancy_correction:
            return 0
        return int(sum(sum(_param_bytes(program, s).values()) for s in program.plan.rank_stages(rank)))

    def action_bytes(self, section, program, action, graph) -> tuple:
        """What :class:`DelayedState` makes outside the graphs, on a stage with a delay:

        * F with weight prediction: the predicted weights it reads (``forward_param``), one tensor per weight;
        * B with discrepancy correction: the extrapolated weights it reads (``backward_param``);
        * after STEP, while the update's outputs and the weights before it live: spike compensation builds the new
          weights key by key, ``w0 - lr * ((a + b) * v1 - (b * m) * v0)`` (the keys before, and three tensors of
          the key's size at once); the velocity update ``gamma * d + (1 - gamma) * (w1 - w0)`` three tensors of
          one key's size."""
        if not section.delays[action.stage]:
            return (0.0, 0.0)
        kind, held = action.kind, _param_bytes(program, action.stage)
        if kind == ActionKind.F and "lwp" in (section.correction or ""):
            return (float(sum(held[k] for r, k in graph.inputs if r == Role.FORWARD_PARAM)), 0.0)
        if kind == ActionKind.B and section.discrepancy_correction:
            return (float(sum(held[k] for r, k in graph.inputs if r == Role.BACKWARD_PARAM)), 0.0)
        if kind != ActionKind.STEP:
            return (0.0, 0.0)
        sizes = list(held.values())
        after, before = 0.0, 0.0
        if "sc" in (section.correction or ""):
            for n in sizes:
                after = max(after, before + 3 * n)
                before += n
        if section.discrepancy_correction:
            after = max([after] + [3 * n for n in sizes])
        return (0.0, after)

    def explain(self, section, program) -> list:
        return [self.papers[section.schedule]] + section.lines()


def _param_bytes(program, stage: int) -> dict:
    """``{parameter key: bytes}`` of a stage on its rank, in the order the runtime holds them (its update's inputs)."""
    step = program.stages[stage].graphs[GraphKind.STEP]
    nodes = [n for n in step.gm.graph.nodes if n.op == "placeholder"]
    got = {k: tensor_bytes(n.meta["val"]) for (r, k), n in zip(step.inputs, nodes) if r == Role.PARAM}
    return {k: got[k] for k in program.stages[stage].param_keys if k in got}
