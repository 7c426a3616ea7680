"""What running a program gives back: ``RunResult`` (``program.run_local``) and ``RankRunner``
(``program.runner()``, one rank of a torchrun job; on a rank a feature runs beside the workers, that feature's
runner)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .runtime.launch import shutdown_env_group

if TYPE_CHECKING:
    from .program import Program
    from .runtime.executor import Executor

__all__ = ["RunResult", "RankRunner", "GroupExit"]


@dataclass
class RunResult:
    """What ``run_local`` trained and measured. The same fields for every strategy.

    ``losses``: one float per step, the global-batch loss. ``step_times``: seconds per step (slowest
    rank). ``state_dict()``: trained parameters and buffers under the model's own keys.
    Measured per rank: ``comm`` (point-to-point sends/receives and bytes; ``held_sends`` / ``held_send_bytes``: the
    most messages, and their bytes, sent and not yet let go at once), ``comm_calls`` (with
    ``measure_comm=True``: per step the collectives run, ``(kind, bytes)``; ``comm_groups`` beside it: per step, per
    call, the global ranks of the group it ran over), ``peak_activations`` /
    ``peak_activation_bytes`` (stage -> most microbatches whose saved tensors were alive at once, and their
    bytes), ``action_times`` (rank -> per step ``{(kind, stage): (seconds, count)}``), ``timelines`` (rank ->
    per step ``(kind, stage, microbatch, start, end)``), ``bubble`` (per step, the idle share of the ranks'
    time), ``peak_versions`` / ``peak_version_bytes`` (weight versions held, asynchronous schedules) and with
    ``record_weights`` the ``weight_log``. ``state_bytes``: rank -> the most model-state bytes it held when a step
    updated: ``{"params", "grads", "optimizer"}`` (grads: the accumulated gradients handed to the update; a fused
    one-microbatch step keeps its gradients inside the graph and reports 0), the model state a sharding feature's
    formulas count.
    ``peak_memory_bytes`` (with ``measure_memory=True``): rank -> the most tensor bytes it held at once over its
    steps, its state included (:class:`fxpar.runtime.measure.MemoryTracker`; on CUDA this figure would be
    ``torch.cuda.max_memory_allocated``), to set against ``program.estimate().ranks[r].peak_memory_bytes``;
    ``held_memory_bytes``: rank -> the bytes it held when its first step began (state and its microbatches).
    ``servers``: each rank a feature runs beside the workers (``program.extra_ranks()``) -> what it reported
    (:meth:`fxpar.feature.ExtraRank.serve`; a CPU summation server: its steps and, per step, the bytes it received and sent).
    ``features``: rank -> ``{feature: report}``, what a feature's per-rank state reported at the end of the run
    (:meth:`fxpar.feature.RankState.report`; Accordion: its switch log per bucket).

    Each ``run_local`` call starts from the weights the program was built with (the model's, at
    ``parallelize`` time): it does not continue an earlier call. To continue one, save and resume:
    ``run_local(b1, save_to=d)``, then ``run_local(b2, resume_from=d)`` (docs/semantics.md).

    ``losses`` follow the program's loss semantics (``Strategy(loss_average=...)``): by default, for a
    cross-entropy fxpar sees, the global batch's loss exactly as one process computes it.
    """
    losses: list
    step_times: list
    per_rank_losses: dict = field(default_factory=dict)
    comm_calls: dict = field(default_factory=dict)
    comm_groups: dict = field(default_factory=dict)
    _state: dict = field(default_factory=dict, repr=False)
    optimizer_state: dict = field(default_factory=dict, repr=False)
    comm: dict = field(default_factory=dict)
    peak_versions: dict = field(default_factory=dict)
    peak_version_bytes: int = 0
    peak_activations: dict = field(default_factory=dict)
    peak_activation_bytes: dict = field(default_factory=dict)
    action_times: dict = field(default_factory=dict, repr=False)
    timelines: dict = field(default_factory=dict, repr=False)
    weight_log: dict = field(default_factory=dict, repr=False)
    bubble: list = field(default_factory=list)
    state_bytes: dict = field(default_factory=dict)
    peak_memory_bytes: dict = field(default_factory=dict)
    held_memory_bytes: dict = field(default_factory=dict)
    servers: dict = field(default_factory=dict)     # a rank beside the workers -> what it reported (ExtraRank.serve)
    features: dict = field(default_factory=dict)    # rank -> {feature: what its RankState reported} (RankState.report)

    def state_dict(self) -> dict:
        """Trained parameters and buffers, unsharded, under the model's own keys (tied keys included)."""
        return dict(self._state)


class GroupExit:
    """``close()`` and ``with``: meet the other ranks, then leave the process group (torchrun runners)."""

    def close(self) -> None:
        """Wait for every rank, then leave the process group. Also runs at interpreter exit."""
        shutdown_env_group()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()


class RankRunner(GroupExit):
    """One rank's side of a program under torchrun: ``step(global_batch)`` trains one step."""

    def __init__(self, executor: Executor, program: Program):
        self.executor, self.program = executor, program

    @property
    def rank(self) -> int:
        return self.executor.rank

    def step(self, batch) -> float:
        """Train one step on this rank's part of ``batch``; returns the global-batch loss (every rank)."""
        import torch.distributed as dist
        if self.program.layout is not None:        # checked against example_inputs; the loss's extra columns added
            batch = self.program._prepare(batch, f"runner.step(batch) (step {len(self.executor.loss_sums)})")
        loss = self.executor.step(batch)
        on = "cpu" if "gloo" in str(dist.get_backend()) else self.executor.device    # NCCL sums device tensors
        t = torch.tensor([loss if self.executor.tp_index == 0 else 0.0], dtype=torch.float64, device=on)  # last stages, tp 0
        dist.all_reduce(t)
        return float(t) / (self.program.plan.microbatches * self.program.dp)

    def save(self, path) -> None:
        """Collective (every rank calls it): write the training state to the checkpoint directory ``path``."""
        self.executor.save(path)

    def load(self, path) -> None:
        """Collective: continue from the checkpoint ``path`` (saved under this or any other strategy)."""
        self.executor.load(path)

    def state_dict(self) -> dict:
        """The whole model's trained state under its own keys. Collective: every rank must call it."""
        import torch.distributed as dist
        self.executor.drain()                 # what the features hold in flight (a carried update) first
        parts = [None] * dist.get_world_size()
        mine = self.executor.state_dict() if self.executor.dp_index == 0 or self.executor.collective() else {}
        dist.all_gather_object(parts, mine if self.executor.dp_index == 0 else {})
        return self.program._full_state(parts)
