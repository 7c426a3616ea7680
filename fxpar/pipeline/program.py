"""``build_pipeline_program``: model + Strategy(pp > 1) → a PipelineProgram (per-stage graphs + schedule).

The flow, top to bottom:

1. trace forward + loss of one microbatch (:mod:`.trace`);
2. cut it into the schedule's number of stages (:mod:`passes.split_stages`);
3. per stage, trace forward and backward with the saved tensors explicit, and the optimizer step
   (:mod:`.autodiff`);
4. per rank, the schedule's action list (:mod:`fxpar.schedule`), run by :mod:`.executor`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import StrategyError
from ..mesh import Mesh
from ..program import GroupExit, RunResult, _fmt
from ..runtime.launch import LocalCluster, init_from_env
from ..schedule import Schedule, ScheduleError, simulate
from ..schedule.ir import Action
from .autodiff import differentiate_stage, trace_step
from .executor import PipelineExecutor, PipelinePayload, train
from .inspection import rank_collectives, stage_history
from .schedules import ASYNC, check_custom_schedule, schedule_for
from .trace import trace_forward

__all__ = ["build_pipeline_program", "PipelineProgram", "PipelinePlan", "ActionList", "PipelineRankRunner"]

class ActionList(list):
    """One rank's actions; ``str()`` prints them in the schedule IR's text form."""

    def __init__(self, rank: int, actions):
        super().__init__(actions)
        self.rank = rank

    def __str__(self) -> str:
        return f"rank {self.rank}: " + " ".join(a.short() for a in self)


@dataclass
class PipelinePlan:
    mesh: Mesh
    schedule: str
    microbatches: int
    microbatch_size: int
    cuts: list
    candidates: list
    stage_to_rank: dict            # stage -> pipeline ranks
    shared_params: dict

    def __str__(self) -> str:
        return "\n".join([
            f"mesh {self.mesh} (global rank = pp_index * dp + dp_index)",
            f"schedule {self.schedule}, {self.microbatches} microbatches of {self.microbatch_size} per pipeline",
            f"stages start before {['(start)'] + self.cuts}; placement {self.stage_to_rank}",
            f"cut candidates: {self.candidates}",
            f"shared parameters (gradients summed across stages): {self.shared_params or 'none'}"])


def _check_batch(batch, dp: int, m: int) -> int:
    sizes = {t.shape[0] for t in batch}
    if len(sizes) != 1:
        raise StrategyError(f"example_inputs have different batch sizes {sorted(sizes)} on dim 0")
    b = sizes.pop()
    if b % (dp * m):
        k = dp * m
        raise StrategyError(
            f"global batch {b} does not split into dp={dp} x microbatches={m} = {k} equal microbatches; use a batch "
            f"that is a multiple of {k} (e.g. {max(k, b - b % k)} or {b - b % k + k}) or change microbatches.")
    return b


def build_pipeline_program(model, cluster, example_inputs, loss_fn, optimizer_spec, strategy,
                           lr_scheduler=None) -> "PipelineProgram":
    """Compile ``model``'s training step for ``strategy.pp`` pipeline ranks × ``strategy.dp`` replicas."""
    t0 = time.perf_counter()
    pp, dp, m = strategy.pp, strategy.dp, strategy.microbatches
    if strategy.tp != 1:
        raise StrategyError(f"{strategy}: pipeline parallelism with tp > 1 is not available; use tp=1")
    if pp * dp != cluster.world_size:
        raise StrategyError(f"{strategy} needs dp*pp = {pp * dp} ranks but the cluster has {cluster.world_size}")
    custom = isinstance(strategy.schedule, Schedule)
    name = "custom" if custom else strategy.schedule or "1f1b"
    if name in ASYNC and lr_scheduler is not None:
        raise StrategyError(f"schedule {name!r} updates weights inside a window of microbatches; an lr_scheduler "
                            "stepped once per batch is not defined for it. Drop lr_scheduler or use a synchronous "
                            "schedule ('gpipe', '1f1b', 'interleaved', 'chimera').")
    batch = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    b = _check_batch(batch, dp, m)
    if custom:
        sched = check_custom_schedule(strategy.schedule, strategy)
    else:
        try:
            sched = schedule_for(name, pp, m, 2)
        except ScheduleError as e:
            raise StrategyError(f"{strategy}: {e}") from e
    mb = b // (dp * m)
    micro = tuple(t.narrow(0, 0, mb) for t in batch)
    ft = trace_forward(model, micro, loss_fn)
    t1 = time.perf_counter()
    from passes.split_stages import split_stages   # fxpar reaches passes only through the pipeline
    fpb = cluster.device.peak_flops / cluster.intra_node.bandwidth
    split = split_stages(ft.gm, ft.roles, sched.n_stages, strategy.split_points, ft.module_types, fpb)
    if name in ASYNC and split.shared_params:
        raise StrategyError(f"schedule {name!r} steps each stage at its own time, so a parameter shared by stages "
                            f"({sorted(split.shared_params)}: {split.shared_params}) would get different versions "
                            "in different stages. Untie it, or use a synchronous schedule.")
    params = {k: v for k, v in model.named_parameters()}
    stages, histories = [], []
    t_split = time.perf_counter() - t1
    for st in split.stages:
        ta = time.perf_counter()
        sp = differentiate_stage(st.index, st.gm, st.inputs, st.outputs)
        tb = time.perf_counter()
        sp.step = trace_step(st.index, optimizer_spec, [(tuple(params[k].shape), params[k].dtype) for k in sp.param_keys])
        if sp.step is not None and name not in ASYNC:     # synchronous: nothing stashes old weights
            from passes.reinplace import reinplace_step_graph
            sp.step_inplace = reinplace_step_graph(sp.step, len(sp.param_keys), len(optimizer_spec.state_names))
        stages.append(sp)
        histories.append(stage_history(ft.gm, st, sp, {"trace_forward": t1 - t0, "split_stages": t_split,
                                                       "differentiate_stage:forward": tb - ta,
                                                       "trace_step": time.perf_counter() - tb}))
    t2 = time.perf_counter()
    return PipelineProgram(model=model, cluster=cluster, strategy=strategy, schedule=sched, split=split,
                           stages=stages, trace=ft, optimizer=optimizer_spec, lr_scheduler=lr_scheduler,
                           n_inputs=len(batch) - (1 if loss_fn is not None else 0), microbatch_size=mb,
                           timings={"capture": t1 - t0, "lower": t2 - t1}, histories=histories)


class PipelineProgram:
    def __init__(self, *, model, cluster, strategy, schedule, split, stages, trace, optimizer, lr_scheduler,
                 n_inputs, microbatch_size, timings, histories=None):
        self.model_name = type(model).__name__
        self.cluster, self.strategy, self.split, self.stages = cluster, strategy, split, stages
        self.pipe_schedule = schedule
        self.trace, self.optimizer, self._lr_scheduler = trace, optimizer, lr_scheduler
        self.n_inputs, self.timings = n_inputs, timings
        self._histories = histories or []
        self.dp, self.pp = strategy.dp, strategy.pp
        self.mesh = Mesh((("pp", self.pp), ("dp", self.dp)))
        self._params = {k: v.detach() for k, v in model.named_parameters()}
        self._buffers = {**{k: v.detach() for k, v in model.named_parameters() if not v.requires_grad},
                         **{k: v.detach() for k, v in model.named_buffers()}}
        self._model_keys = list(model.state_dict().keys())
        self.plan = PipelinePlan(self.mesh, schedule.name, strategy.microbatches, microbatch_size, split.cuts,
                                 split.candidates, dict(schedule.stage_to_rank), split.shared_params)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def _pipe(self, rank: int) -> tuple:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is outside this program's {self.world_size} ranks")
        return divmod(rank, self.dp)

    # ---- inspection -----------------------------------------------------------------------
    def graphs(self, rank: int = 0) -> dict:
        """name -> GraphModule for every stage this rank holds: ``stage{s}.forward/.backward/.step``."""
        pr, _ = self._pipe(rank)
        out = {}
        for s in self.pipe_schedule.rank_stages(pr):
            sp = self.stages[s]
            out[f"stage{s}.forward"], out[f"stage{s}.backward"] = sp.forward, sp.backward
            if sp.step is not None:
                out[f"stage{s}.step"] = sp.step
        return out

    def history(self, rank: int = 0) -> list:
        """Per stage this rank holds, the graph after each lowering step (``HistoryEntry``; ``str()`` is its code):
        ``trace_forward`` (whole model), ``split_stages``, ``differentiate_stage:forward``/``:backward``,
        ``trace_step``; ``entry.info['stage']`` says which stage."""
        pr, _ = self._pipe(rank)
        return [e for s in self.pipe_schedule.rank_stages(pr) for e in self._histories[s]]

    def collectives(self, rank: int = 0) -> list:
        """This rank's sends, receives and all-reduces of one step in issue order, as ``fxpar.meta.CommInfo``
        (send/recv: ``ranks=(src, dst)``; all-reduce axis ``dp`` for replicas, ``pp`` for SYNC and tied weights)."""
        self._pipe(rank)
        return rank_collectives(self, rank)

    def schedule(self, rank: int = 0) -> ActionList:
        """This rank's actions, peers as global ranks (``str()`` prints ``rank R: F0.0 SF0.0>1 ...``)."""
        pr, d = self._pipe(rank)
        g = lambda r: None if r is None else r * self.dp + d   # noqa: E731
        return ActionList(rank, [Action(rank, a.kind, a.stage, a.microbatch, g(a.peer), a.version)
                                 for a in self.pipe_schedule.actions[pr]])

    def explain(self) -> str:
        sim = simulate(self.pipe_schedule)
        lines = [f"fxpar pipeline program for {self.model_name}: {self.strategy} on {self.world_size} rank(s)",
                 "", "plan:"] + ["  " + ln for ln in str(self.plan).splitlines()]
        lines += ["", "stages:"]
        for st, sp in zip(self.split.stages, self.stages):
            pbytes = sum(self._params[k].numel() * self._params[k].element_size() for k in sp.param_keys)
            sends = sum(int(torch.Size(sh).numel()) * torch.empty((), dtype=dt).element_size()
                        for (sh, dt), (r, _) in zip(sp.output_meta, sp.outputs) if r == "act")
            lines.append(f"  stage {st.index} on pipeline rank(s) {self.pipe_schedule.stage_to_rank[st.index]}: "
                         f"{len(st.nodes)} nodes ({st.flops / 1e6:.2f} MFLOP fwd per microbatch), "
                         f"modules {st.modules[:3]}{'...' if len(st.modules) > 3 else ''}")
            lines.append(f"    params {_fmt(pbytes)} in {len(sp.param_keys)} tensors; saves {sp.n_saved} tensors "
                         f"({_fmt(sp.saved_bytes)}) per microbatch in flight; sends {_fmt(sends)} forward per microbatch")
        peak = sim.peak_activations_per_rank
        lines += ["", f"schedule {self.pipe_schedule.name} (F=1, B=2 units): bubble {sim.bubble_fraction:.3f}; "
                      f"microbatches in flight per rank {peak}",
                  "  activation memory per rank ~ in-flight microbatches x saved bytes of its stages "
                  "(run_local measures both: RunResult.peak_activations, .peak_activation_bytes)"]
        lines += ["  " + ln for ln in self.pipe_schedule.format_lists().splitlines()]
        if self.asynchronous:
            lines += ["", f"asynchronous: the schedule above covers 2 batches; a run covers all its batches in one "
                          f"window with no flush. Weight versions held at once per stage (simulator): "
                          f"{sim.peak_versions}; each forward's saved tensors keep the version its backward needs."]
        if self.split.shared_params:
            lines += ["", "tied parameters: each stage holds a copy; before the step their gradients are summed "
                          "(all-reduce over the ranks holding them), so every copy takes the same update"]
        if self.dp > 1:
            lines += [f"data parallel: each stage's gradients are all-reduced over its {self.dp} replicas before STEP"]
        lines += ["", f"time: capture {self.timings['capture']:.2f}s, split+differentiate {self.timings['lower']:.2f}s"]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<fxpar.PipelineProgram {self.model_name} {self.strategy} on {self.world_size} ranks>"

    # ---- running ------------------------------------------------------------------------------
    def _groups(self) -> list:
        dp, out = self.dp, []
        for r in range(self.pp):
            out.append(tuple(r * dp + d for d in range(dp)))
        for d in range(dp):
            for s, rs in sorted(self.pipe_schedule.stage_to_rank.items()):
                out.append(tuple(sorted(r * dp + d for r in rs)))
            for key, ss in sorted(self.split.shared_params.items()):
                holders = sorted({r for s in ss for r in self.pipe_schedule.stage_to_rank[s]})
                out.append(tuple(r * dp + d for r in holders))
        seen, uniq = set(), []
        for g in out:
            if len(g) > 1 and g not in seen:
                seen.add(g)
                uniq.append(g)
        return uniq

    @property
    def asynchronous(self) -> bool:
        return not isinstance(self.strategy.schedule, Schedule) and self.pipe_schedule.name in ASYNC

    def payload(self, rank: int, n_batches: int = 1, record_weights: bool = False,
                seed: int | None = 0) -> PipelinePayload:
        """Rank ``rank``'s part. Asynchronous schedules cover all ``n_batches`` batches in one window.
        ``record_weights``: log a hash of the weights every F and B computes with (``RunResult.weight_log``)."""
        pr, _ = self._pipe(rank)
        sched = self.pipe_schedule
        extra = {"n_inputs": self.n_inputs, "record_weights": record_weights, "rng_seed": seed}
        if self.asynchronous:
            sched = schedule_for(sched.name, self.pp, self.plan.microbatches, n_batches)
            m = self.plan.microbatches
            extra.update(asynchronous=True, seed=1.0 / self.dp if sched.name == "pipedream" else 1.0 / (m * self.dp))
        held = sched.rank_stages(pr)
        keys = {k for s in held for k in self.stages[s].param_keys}
        return PipelinePayload(rank=rank, dp=self.dp, pp=self.pp, actions=list(sched.actions[pr]),
                               stage_to_rank=dict(sched.stage_to_rank),
                               n_stages=sched.n_stages, microbatches=self.plan.microbatches,
                               stages={s: self.stages[s] for s in held}, params={k: self._params[k] for k in keys},
                               buffers=dict(self._buffers), optimizer=self.optimizer,
                               shared=dict(self.split.shared_params), groups=self._groups(),
                               lr_scheduler=self._lr_scheduler, extra=extra)

    def run_local(self, batches, cluster: LocalCluster | None = None, timeout_s: float = 600.0,
                  record_weights: bool = False, seed: int | None = 0) -> RunResult:
        """Spawn (or reuse) ``world_size`` gloo ranks, train one step per global batch, gather the result.
        ``seed``: each rank seeds torch's generator with ``seed + rank`` (dropout reproducible; None: leave it).

        Besides losses and state, the result carries what the ranks measured: ``peak_activations`` /
        ``peak_activation_bytes`` (stage -> most microbatches whose saved tensors were alive at once, and
        their bytes; max over replicas), ``action_times`` (rank -> per step, ``{(kind, stage): (total seconds,
        count)}``; ``("allreduce", -1)`` is the dp and tied-weight gradient all-reduce before the first STEP),
        ``timelines`` (rank -> per step, ``(kind, stage, microbatch, start, end)`` per action, seconds of
        ``time.perf_counter``, one clock for every process on a Linux host),
        ``peak_versions``, ``bubble``, ``comm``; with ``record_weights`` also ``weight_log`` (rank -> one
        entry per F and B: version, hash of the weights its backward reads, hash of the newest weights)."""
        batches = [tuple(b) if isinstance(b, (tuple, list)) else (b,) for b in batches]
        for b in batches:
            _check_batch(b, self.dp, self.plan.microbatches)
        own = cluster is None
        lc = cluster or LocalCluster(self.world_size, backend=self.cluster.backend)
        if lc.world_size != self.world_size:
            raise ValueError(f"LocalCluster has {lc.world_size} ranks but this program needs {self.world_size}")
        try:
            results = lc.run(train, [(self.payload(r, len(batches), record_weights, seed), batches)
                                     for r in range(self.world_size)], timeout_s=timeout_s)
        finally:
            if own:
                lc.close()
        return self._gather(results)

    def runner(self, backend: str | None = None, seed: int | None = 0) -> "PipelineRankRunner":
        """Under torchrun (or on an initialised group): this rank's part, one ``step(global_batch)`` at a time."""
        init_from_env(backend or self.cluster.backend)
        import torch.distributed as dist
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"{dist.get_world_size()} processes but the program needs {self.world_size}: use "
                             f"--nproc-per-node {self.world_size} (or change the Strategy)")
        if self.asynchronous:
            raise StrategyError(f"schedule {self.pipe_schedule.name!r} runs all batches in one window; use "
                                "run_local(batches), or a synchronous schedule with runner()")
        return PipelineRankRunner(PipelineExecutor(self.payload(dist.get_rank(), seed=seed)), self)

    def _gather(self, results: list) -> RunResult:
        n = len(results[0]["loss_sums"])
        total_mb = self.plan.microbatches * self.dp
        losses = [sum(r["loss_sums"][i] for r in results) / total_mb for i in range(n)]
        times = [max(r["step_times"][i] for r in results) for i in range(n)]
        state = {}
        for r in results:
            state.update(r.get("state", {}))
        state.update(self._buffers)
        for alias, canon in self.trace.aliases.items():
            state[alias] = state[canon]
        state = {k: state[k] for k in self._model_keys if k in state}
        res = RunResult(losses=losses, step_times=times, _state=state,
                        per_rank_losses={i: r["loss_sums"] for i, r in enumerate(results)})
        res.comm = {i: r["comm"] for i, r in enumerate(results)}
        # weight versions held at once, per stage (max over ranks), and the most bytes any rank held in them
        res.peak_versions = {}
        for r in results:
            for s, held in r["peak_versions"].items():
                res.peak_versions[s] = max(res.peak_versions.get(s, 0), held)
        res.peak_version_bytes = max(r["peak_version_bytes"] for r in results)
        res.peak_activations, res.peak_activation_bytes = {}, {}
        for r in results:
            for s, held in r["act_peak"].items():
                res.peak_activations[s] = max(res.peak_activations.get(s, 0), held)
                res.peak_activation_bytes[s] = max(res.peak_activation_bytes.get(s, 0), r["act_peak_bytes"][s])
        res.action_times = {i: [{k: tuple(v) for k, v in w.items()} for w in r["action_times"]]
                            for i, r in enumerate(results)}
        res.weight_log = {i: r["weight_log"] for i, r in enumerate(results)}
        res.timelines = {i: r["timelines"] for i, r in enumerate(results)}
        # measured bubble per step: the idle share of the ranks' time, 1 - sum(F/B time) / (ranks * step time)
        if not self.asynchronous:
            res.bubble = [1 - sum(r["busy"][i] for r in results) / (len(results) * times[i]) for i in range(n)]
        return res


class PipelineRankRunner(GroupExit):
    """One rank's side of a pipeline program: ``step(batch)`` trains one step, returns the global-batch loss."""

    def __init__(self, executor: PipelineExecutor, program: PipelineProgram):
        self.executor, self.program = executor, program

    @property
    def rank(self) -> int:
        return self.executor.rank

    def step(self, batch) -> float:
        import torch.distributed as dist
        batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        t = torch.tensor([self.executor.step(batch)], dtype=torch.float64)   # loss sums live on last stages
        dist.all_reduce(t)
        return float(t) / (self.program.plan.microbatches * self.program.dp)

    def state_dict(self) -> dict:
        """The whole model's trained state under its own keys. Collective: every rank must call it."""
        import torch.distributed as dist
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, self.executor.state_dict() if self.executor.dp_index == 0 else {})
        state = {}
        for part in parts:
            state.update(part)
        state.update(self.program._buffers)
        for alias, canon in self.program.trace.aliases.items():
            state[alias] = state[canon]
        return {k: state[k] for k in self.program._model_keys if k in state}
