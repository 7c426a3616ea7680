"""Program: what ``parallelize`` returns. The plan, the per-rank graphs, their history, and ways to run."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import meta as M
from .collectives import collective_nodes
from .runtime.executor import RankPayload, StepExecutor
from .runtime.launch import LocalCluster, init_from_env

__all__ = ["Program", "RunResult", "RankRunner"]


@dataclass
class RunResult:
    losses: list                    # one float per step: the global-batch loss
    step_times: list                # seconds per step (slowest rank)
    per_rank_losses: dict = field(default_factory=dict)
    comm_calls: dict = field(default_factory=dict)   # rank -> per step [(kind, bytes)], with measure_comm=True
    _state: dict = field(default_factory=dict, repr=False)
    optimizer_state: dict = field(default_factory=dict, repr=False)

    def state_dict(self) -> dict:
        """Trained parameters and buffers, unsharded, under the model's own keys (tied keys included)."""
        return dict(self._state)


def _train(payload: RankPayload, batches: list) -> dict:
    ex = StepExecutor(payload)
    for b in batches:
        ex.step(b)
    out = {"losses": ex.losses, "step_times": ex.step_times, "dp_index": ex.dp_index, "comm_calls": ex.comm_calls}
    if payload.rank == 0:
        out["state"] = ex.state_dict()
        out["optimizer_state"] = ex.optimizer_state()
    return out


class Program:
    def __init__(self, *, model, captured, plan, strategy, cluster, graphs, histories, notes, lr_scheduler, timings):
        self.model_name = type(model).__name__
        self.captured = captured
        self.plan = plan
        self.strategy = strategy
        self.cluster = cluster
        self._graphs = graphs
        self._histories = histories
        self._notes = notes
        self._lr_scheduler = lr_scheduler
        self.timings = timings
        self._params = {k: v.detach() for k, v in model.named_parameters()}
        self._buffers = {**{k: v.detach() for k, v in model.named_parameters() if not v.requires_grad},
                         **{k: v.detach() for k, v in model.named_buffers()}}
        self._model_keys = list(model.state_dict().keys())

    @property
    def world_size(self) -> int:
        return self.plan.mesh.size

    # ---- inspection -----------------------------------------------------------------------
    def graphs(self, rank: int = 0) -> dict:
        """name -> GraphModule this rank runs (printable with ``.code`` / ``.graph``, runnable)."""
        self._check_rank(rank)
        return {"step": self._graphs[rank]}

    def history(self, rank: int = 0) -> list:
        """One entry per pass (capture first): ``str(entry)`` is the graph's code after that pass."""
        self._check_rank(rank)
        return list(self._histories[rank])

    def collectives(self, rank: int = 0) -> list:
        """The collectives of this rank's step in issue order, as ``fxpar.meta.CommInfo``."""
        return [M.get(n, M.COMM) for n in collective_nodes(self._graphs[rank])]

    def estimate(self):
        """Predicted step time, per-rank compute/comm time, bytes on the wire and peak memory, from the
        cost models (``cost_models.estimate``) over this program's per-rank graphs. Starts no process."""
        if getattr(self, "_estimate", None) is None:
            import cost_models     # the cost models read graphs; fxpar reaches them only here and in the planner
            self._estimate = cost_models.estimate(dict(self._graphs), self.cluster)
        return self._estimate

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is outside this program's {self.world_size} ranks")

    def explain(self) -> str:
        cap, plan = self.captured, self.plan
        nbytes = {k: _numel(cap.param_shapes[k]) * torch.empty((), dtype=cap.param_dtypes[k]).element_size()
                  for k in cap.param_names}
        p_bytes = sum(nbytes.values())
        s_bytes = p_bytes * len(cap.optimizer.state_names)
        b_bytes = sum(v.numel() * v.element_size() for v in self._buffers.values())
        lines = [f"fxpar program for {self.model_name}: {self.strategy} on {self.world_size} rank(s)",
                 f"cluster: {self.cluster}", "", "plan:"]
        lines += ["  " + ln for ln in str(plan).splitlines()]
        lines += ["", "per rank (every rank holds a full replica under data parallelism):",
                  f"  parameters      {_fmt(p_bytes)} ({sum(_numel(s) for s in cap.param_shapes.values()):,} values in {len(cap.param_names)} tensors)",
                  f"  gradients       {_fmt(p_bytes)}",
                  f"  optimizer state {_fmt(s_bytes)} ({', '.join(cap.optimizer.state_names) or 'none'})",
                  f"  buffers         {_fmt(b_bytes)}"]
        if cap.aliases:
            lines.append(f"  tied parameters (one tensor, one gradient): {cap.aliases}")
        comms = self.collectives(0)
        lines += ["", f"collectives per step on rank 0: {len(comms)}, {_fmt(sum(c.nbytes for c in comms))} handed to them"]
        for i, c in enumerate(comms):
            lines.append(f"  {i:3d}. {c.kind:<10} over {c.axis} {list(c.ranks)}: {_fmt(c.nbytes)}")
        lines += ["", "passes run (rank 0): " + " -> ".join(f"{h.pass_name}({h.nodes})" for h in self._histories[0])]
        lines += ["  " + n for n in self._notes[0]]
        if not cap.optimizer.traced:
            lines += ["", f"optimizer {cap.optimizer.name} runs eagerly on each rank ({cap.optimizer.why_not_traced}):",
                      "  its update is not in the graph, so passes that rewrite the optimizer step do not apply."]
        lines += ["", "estimate (cost models; " + ("calibrated cluster" if self.cluster.device.efficiency
                                                  else "vendor/default figures: ClusterSpec.calibrate() for this machine's") + "):"]
        est = self.estimate()
        lines += ["  " + ln for ln in str(est).splitlines()]
        mem = self.cluster.device.memory_bytes
        over = [r.rank for r in est.ranks if r.peak_memory_bytes > mem]
        if over:
            lines.append(f"  WARNING: predicted peak memory {_fmt(max(r.peak_memory_bytes for r in est.ranks))} exceeds the "
                         f"{_fmt(mem)} of a {self.cluster.device.name} on {len(over)} rank(s): shard state (ZeRO), "
                         "or split the model (tp/pp), or use a smaller batch.")
        if est.defaulted:
            lines.append("  ops costed by the default rule (no entry in cost_models.compute.FLOP_RULES): "
                         + ", ".join(f"{k} x{v}" for k, v in est.defaulted.most_common()))
        lines += ["", f"time: capture {self.timings['capture']:.2f}s, plan+lower {self.timings['lower']:.2f}s"]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<fxpar.Program {self.model_name} {self.strategy} on {self.world_size} ranks>"

    # ---- running ------------------------------------------------------------------------------
    def payload(self, rank: int, measure_comm: bool = False, seed: int | None = 0) -> RankPayload:
        """Rank ``rank``'s part, picklable. ``seed``: see :meth:`run_local`."""
        cap = self.captured
        return RankPayload(rank=rank, gm=self._graphs[rank], signature=self._graphs[rank].meta["fxpar_signature"],
                           mesh_axes=self.plan.mesh_axes, batch_dim=self.plan.batch_dim,
                           params={k: self._params[k] for k in cap.param_names},
                           buffers={k: self._buffers[k] for k in cap.buffer_names},
                           optimizer=cap.optimizer, lr_scheduler=self._lr_scheduler,
                           extra={"measure_comm": measure_comm, "rng_seed": seed})

    def run_local(self, batches, cluster: LocalCluster | None = None, timeout_s: float = 600.0,
                  measure_comm: bool = False, seed: int | None = 0) -> RunResult:
        """Spawn the ranks here (gloo on 127.0.0.1), train one step per global batch, gather the result.
        ``measure_comm=True`` records every collective each rank runs (``RunResult.comm_calls``).

        ``seed``: each rank seeds torch's generator with ``seed + rank`` before training, so random
        ops (dropout) are reproducible and dp ranks draw different masks for their shards -- what
        torch DDP does when each process calls ``torch.manual_seed(seed + rank)``. ``None`` leaves
        each process's generator as it is."""
        batches = [tuple(b) if isinstance(b, (tuple, list)) else (b,) for b in batches]
        if self.world_size == 1:
            with torch.random.fork_rng(devices=[]):      # the caller's generator is left as it was
                results = [_train(self.payload(0, measure_comm, seed), batches)]
        else:
            self._check_picklable()
            own = cluster is None
            lc = cluster or LocalCluster(self.world_size, backend=self.cluster.backend)
            if lc.world_size != self.world_size:
                raise ValueError(f"LocalCluster has {lc.world_size} ranks but this program needs {self.world_size}")
            try:
                results = lc.run(_train, [(self.payload(r, measure_comm, seed), batches) for r in range(self.world_size)],
                                 timeout_s=timeout_s)
            finally:
                if own:
                    lc.close()
        return self._gather(results)

    def _check_picklable(self) -> None:
        import pickle
        try:
            pickle.dumps(self._lr_scheduler)
        except Exception as e:  # noqa: BLE001
            raise TypeError(
                f"lr_scheduler={self._lr_scheduler!r} cannot be sent to the spawned ranks ({e}). Pass "
                "(torch.optim.lr_scheduler.StepLR, {'step_size': 1}) or a module-level function instead of a "
                "lambda or a local function.") from None

    def _gather(self, results: list) -> RunResult:
        dp_ranks = [r for r in range(self.world_size)]
        n = len(results[0]["losses"])
        losses = [sum(results[r]["losses"][i] for r in dp_ranks) / len(dp_ranks) for i in range(n)]
        times = [max(res["step_times"][i] for res in results) for i in range(n)]
        state = dict(results[0]["state"])
        for alias, canon in self.captured.aliases.items():
            state[alias] = state[canon]
        state = {k: state[k] for k in self._model_keys if k in state}
        return RunResult(losses, times, {r: res["losses"] for r, res in enumerate(results)},
                         {r: res["comm_calls"] for r, res in enumerate(results)}, state,
                         results[0].get("optimizer_state", {}))

    def runner(self, backend: str | None = None, seed: int | None = 0) -> "RankRunner":
        """Under torchrun: join the env:// group and run this rank's part (``seed`` as in :meth:`run_local`)."""
        init_from_env(backend or self.cluster.backend)
        import torch.distributed as dist
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"torchrun started {dist.get_world_size()} processes but the program needs {self.world_size}: "
                             f"use --nproc-per-node {self.world_size} (or change the Strategy)")
        return RankRunner(StepExecutor(self.payload(dist.get_rank(), seed=seed)), self)


class GroupExit:
    """``close()`` and ``with``: meet the other ranks, then leave the process group (torchrun runners)."""

    def close(self) -> None:
        """Wait for every rank, then leave the process group. Also runs at interpreter exit."""
        from .runtime.launch import shutdown_env_group
        shutdown_env_group()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()


class RankRunner(GroupExit):
    """One rank's side of a program under torchrun: ``step(global_batch)`` trains one step."""

    def __init__(self, executor: StepExecutor, program: Program):
        self.executor, self.program = executor, program

    @property
    def rank(self) -> int:
        return self.executor.rank

    def step(self, batch) -> float:
        """Train one step on this rank's shard of ``batch``; returns the global-batch loss (mean over dp)."""
        import torch.distributed as dist
        local = self.executor.step(batch)
        t = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / dist.get_world_size()

    def state_dict(self) -> dict:
        state = self.executor.state_dict()
        for alias, canon in self.program.captured.aliases.items():
            state[alias] = state[canon]
        return state


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)
