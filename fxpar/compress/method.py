"""What every gradient-compression method is: its options, its per-bucket math, its bytes.

A method is a frozen dataclass of its options (the value of ``Strategy(grad_sync=...)``) whose
:meth:`Method.sum` says how one gradient bucket is summed over the data-parallel ranks: compress, the
collectives, decompress. ``sum`` is written as a plain function of tensors and is traced (``make_fx``) once
per bucket and :meth:`Method.variant` into a graph the rank runs each step; the collectives it calls through
:class:`Comm` are functional collectives over the dp group, so the traced graph holds them like any other.

Where a method decides something on the host each step (PowerSGD's ``start_iter``, Accordion's switch, a
user's DDP comm hook), :meth:`Method.variant` names the graph to run; where it needs random numbers or other
values made on the host, :meth:`Method.host_inputs` makes them (from the rank's generator, which checkpoints
save). Its per-rank, per-bucket state (error-feedback residuals, warm-start factors, adaptive levels) is a dict
of tensors, made by :meth:`Method.init_state`, handed to ``sum`` and replaced by what ``sum`` returns.

The bucket ``sum`` receives holds this rank's gradients already scaled by ``1 / dp``: plain data parallelism's
sum of the ranks' buckets is the mean gradient. A method returns its estimate of that sum.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Hashable

import torch

from fxpar.collectives import C10D, group_tag
from fxpar.errors import StrategyError

__all__ = ["Method", "BucketInfo", "Comm"]


@dataclass(frozen=True)
class BucketInfo:
    """One gradient bucket as a method sees it (picklable: it travels to the ranks).

    ``stage``, ``index``: the pipeline stage and the bucket's index in that stage (DDP's bucket index: 0 is the
    first bucket backward fills); ``count``: the stage's number of buckets; ``keys``: the parameters whose
    gradients the bucket holds, in buffer order; ``shapes`` and ``offsets``: each gradient's shape and its first
    element in the flat buffer; ``numel``, ``dtype``: the flat buffer's; ``dp``: ranks summing it; ``dp_rank``: this
    rank's index among them (-1 where a method is planned before the ranks exist)."""
    stage: int
    index: int
    count: int
    keys: tuple
    shapes: tuple
    offsets: tuple
    numel: int
    dtype: str
    dp: int
    dp_rank: int = -1

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def views(self, flat: torch.Tensor) -> list:
        """Each gradient as a view of ``flat`` (in bucket order)."""
        out = []
        for shape, off in zip(self.shapes, self.offsets):
            n = 1
            for s in shape:
                n *= int(s)
            out.append(flat[off:off + n].view(shape))
        return out


class Comm:
    """The dp group a bucket is summed over, as :meth:`Method.sum` sees it.

    Each call is a functional collective followed by its wait (a pass may move waits later); traced, they are
    ``_c10d_functional`` nodes on the group tag ``"fxpar:dp"``, which the runtime binds to the rank's group. A
    method counts on nothing else from the group: ``size`` and ``rank`` are known when it is traced."""

    def __init__(self, size: int, rank: int, group: str | None = None):
        self.size, self.rank = size, rank
        self.group = group if group is not None else group_tag("dp")

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return C10D.wait_tensor(C10D.all_reduce(t, op, self.group))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` stacked along dim 0 (rank order): ``[size * t.shape[0], ...]``."""
        return C10D.wait_tensor(C10D.all_gather_into_tensor(t.contiguous(), self.size, self.group))

    def reduce_scatter(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The sum over ranks of ``t``, cut along dim 0 into ``size`` equal pieces: this rank's piece."""
        return C10D.wait_tensor(C10D.reduce_scatter_tensor(t.contiguous(), op, self.size, self.group))

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` cut along dim 0 into ``size`` equal pieces, piece r sent to rank r; what each rank sent here, in
        rank order."""
        n = t.shape[0] // self.size
        return C10D.wait_tensor(C10D.all_to_all_single(t.contiguous(), [n] * self.size, [n] * self.size, self.group))


@dataclass(frozen=True)
class Method:
    """Base of a gradient-compression method's options: subclass as a frozen dataclass whose fields are the
    method's options (JSON values), set ``name`` (the string shorthand and the feature's name, ``"powersgd"``)
    and ``paper``, and override what the method needs."""
    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""          # the reference, for help() and explain()
    # True: ``sum`` runs as Python every step (it calls code that cannot be traced, such as a user's DDP comm hook);
    # ``comm`` is then an eager :class:`Comm` on the rank's real group
    eager: ClassVar[bool] = False
    # the RankState class of the method's feature where its sum needs more of the rank than the bucket (a subclass of
    # fxpar.compress.runtime.CompressState: Decentralized reads the bucket's weights and moves them after the update);
    # None: CompressState
    rank_state: ClassVar[type | None] = None
    # keys of :meth:`to_dict` that carry the method for a machine (a pickle), left out of the Plan's printed lines
    unshown: ClassVar[tuple] = ()

    # ---- options -----------------------------------------------------------------------------------
    def check(self, dp: int) -> None:
        """Refuse option values this method cannot carry out (raise :class:`fxpar.StrategyError` naming the option
        and the fix)."""

    def check_plan(self, plan) -> None:
        """Refuse what the rest of the plan asks that this method cannot run with (``plan.optimizer``, the stages'
        ``grad_groups``), raising :class:`fxpar.StrategyError` naming it and the fix: a method that carries part of
        the optimizer's math (QAdam) names the optimizer it pairs with."""

    def check_optimizer(self, spec) -> None:
        """Refuse optimizer settings this method cannot run with (``spec``: the program's
        :class:`fxpar.optim.OptimizerSpec`, its ``cls`` and ``kwargs``), raising :class:`fxpar.StrategyError` naming the
        setting and the fix. Checked when the program's ranks are made."""

    def to_dict(self) -> dict:
        return {"method": self.name, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "Method":
        data = {k: v for k, v in data.items() if k != "method"}
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise StrategyError(f"{cls.__name__}: unknown option(s) {unknown}; its options: {sorted(fields)}")
        return cls(**data)

    # ---- per bucket, on the host --------------------------------------------------------------------------
    def init_state(self, bucket: BucketInfo, gen: torch.Generator) -> dict:
        """This rank's state for ``bucket`` before the first step: ``{name: tensor}`` (``gen``: the rank's
        generator, seeded from the method's seed or 0, the same on every rank)."""
        return {}

    def variant(self, bucket: BucketInfo, step: int, state: dict) -> Hashable:
        """Which graph sums ``bucket`` at ``step`` (0 for the first step this bucket is summed); each distinct value
        is traced once. Default: one graph."""
        return None

    def host_inputs(self, bucket: BucketInfo, step: int, state: dict, variant, gen: torch.Generator) -> list:
        """Tensors made on the host for this step's ``sum`` (random draws from ``gen``, which checkpoints save)."""
        return []

    # ---- per bucket, traced ---------------------------------------------------------------------------------
    def sum(self, flat: torch.Tensor, state: dict, inputs: list, bucket: BucketInfo, comm: Comm, variant) -> tuple:
        """``(summed, new_state)``: this method's estimate of the sum over ranks of ``flat`` (each rank's bucket,
        already scaled by 1/dp), and the state for the next step (the same keys, shapes and dtypes)."""
        raise NotImplementedError(f"{type(self).__name__}.sum")

    # ---- what it costs and says -------------------------------------------------------------------------------
    def wire_bytes(self, bucket: BucketInfo, variant) -> int:
        """Bytes this rank hands to collectives to sum ``bucket`` (the formula the measured bytes must equal)."""
        raise NotImplementedError(f"{type(self).__name__}.wire_bytes")

    def collectives(self, bucket: BucketInfo, variant) -> list:
        """``[(kind, bytes), ...]``: the collectives this rank issues to sum ``bucket``, in order, for the cost
        models (each pays its own latency and algorithm). A traced method's are read from its graph; an eager
        method's from here. Default: one all-reduce of :meth:`wire_bytes`."""
        return [("all_reduce", int(self.wire_bytes(bucket, variant)))]

    def priced_like(self, bucket: BucketInfo, variant):
        """For an ``eager`` method (whose sum is not traced, so the cost models see none of its compute): ``(method,
        variant)``, a traced method whose sum of ``bucket`` does the same compute, which the plan traces and prices in
        its place; None: the compute is not priced. Default: None."""
        return None

    def eager_sum_compute(self, bucket: BucketInfo, variant):
        """For an ``eager`` method: ``(ops, flops, bytes, classes)`` of what its sum of ``bucket`` computes at
        ``variant`` (``cost_models.compute.eager_compute``'s count of the sum's own aten ops, run where it costs
        nothing: on meta tensors), which the plan prices in place of :meth:`priced_like`'s; None: not counted (then
        :meth:`priced_like` answers). Default: None."""
        return None

    def host_state(self):
        """What of this method's own objects (not its per-bucket state tensors) a rank's checkpoint keeps
        (picklable; None: nothing), such as a DDP comm hook's state object."""
        return None

    def load_host_state(self, saved) -> None:
        """Restore what :meth:`host_state` returned, on resume."""

    def report(self, bucket: BucketInfo, state: dict, records=()):
        """What this rank's state of ``bucket`` tells the run's result at its end (picklable; None: nothing):
        ``RunResult.features[rank][<method name>][(stage, index)]``. ``records``: what :meth:`step_record` returned
        at each step of the run, oldest first."""
        return None

    def step_record(self, bucket: BucketInfo, state: dict):
        """What the rank keeps of ``bucket``'s step, from the state the step's sum returned (picklable; None:
        nothing): handed to :meth:`report` as ``records`` at the run's end, and saved in checkpoints."""
        return None

    def describe(self, bucket: BucketInfo, variant) -> list:
        """Lines for ``explain()``: per tensor of ``bucket``, what is compressed and how."""
        return []

    def plan_note(self) -> str:
        """What the plan's notes say of this method's training, after its summary."""
        return ("each update uses this method's estimate of the dp sum of the gradients, not the sum itself: training "
                "differs from one process on purpose (docs/semantics.md, 'Gradient compression')")

    def summary(self) -> str:
        """One line: the method and its options."""
        opts = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({opts})"
