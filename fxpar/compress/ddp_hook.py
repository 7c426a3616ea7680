"""Any DDP communication hook, run on fxpar's gradient buckets the way ``DistributedDataParallel`` runs it.

A hook is the function a user hands to ``DistributedDataParallel.register_comm_hook(state, hook)``:
``hook(state, bucket) -> torch.futures.Future[Tensor]``. :class:`DDPHook` calls it once per bucket, in DDP's
bucket index order, with a :class:`HookBucket` that answers what torch's ``GradBucket`` answers: ``buffer()``
(this rank's local, un-divided gradients, flat, in the bucket's order: DDP divides nothing before a hook, the hook
averages), ``gradients()`` (each gradient as a view of the buffer), ``index()``, ``is_last()`` and ``set_buffer()``.
The future is waited for before anything of fxpar's runs again (torch's ``powerSGD_hook`` issues collectives from
its future's callbacks), with a time limit; its value must be the averaged bucket, the buffer's shape and dtype.

Process groups: a hook state of ``None`` reaches the hook as the rank's data-parallel process group (torch's
default hooks read ``None`` as the world, which is that group when dp is the whole world); a state object with a
``process_group`` attribute (``PowerSGDState``) travels to the ranks without it and has it set to the rank's
data-parallel group there. The hook itself must be picklable: a module-level function (or a ``functools.partial``
of one).

Checkpoints: the hook's state object is saved with each rank's checkpoint and restored into the rank's state on
resume (:meth:`DDPHook.host_state`): through its ``state_dict()`` / ``load_state_dict()`` where its class has both,
else every attribute but ``process_group`` (``PowerSGDState``: ``error_dict``, ``p_memory_dict``,
``q_memory_dict``, ``iter``, its numpy ``rng``, the statistics), copied at the save. An attribute that does not
pickle is refused by name when the checkpoint is taken.

Bytes: collectives a hook issues from its future's callbacks (``powerSGD_hook``'s all-reduces of P and Q) run on
the backend's threads; the callbacks the hook chains are run under the rank's ``CommCounter`` there too, so a run
with ``measure_comm=True`` counts every collective the hook issues (:func:`_counted_callbacks`).

Pricing: the plan and ``estimate()`` count what torch's own hooks send, as those hooks form it
(:meth:`DDPHook.collectives`: ``powerSGD_hook``'s P and Q per matrix from its ``PowerSGDState``), and their compute
counted from torch's own code, the hook run on meta tensors against a group that moves nothing
(:meth:`DDPHook.dry_run`). A hook of the user's own is priced as one plain all-reduce of the bucket, which the plan's
notes and ``explain()`` say.
"""
from __future__ import annotations

import base64
import contextlib
import copy
import functools
import math
import pickle
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch.distributed import distributed_c10d as c10d
from torch.distributed.distributed_c10d import ProcessGroup, Work
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from fxpar.compress.feature import register_method
from fxpar.compress.method import BucketInfo, Comm, Method
from fxpar.errors import StrategyError
from fxpar.runtime.measure import CommCounter

__all__ = ["DDPHook", "HookBucket", "hook_name", "powersgd_hook_sizes", "batched_powersgd_hook_sizes"]


def hook_name(hook) -> str:
    fn = getattr(hook, "func", hook)          # functools.partial
    mod = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{mod}.{qual}" if mod else qual


class HookBucket:
    """What a DDP comm hook sees of one bucket (the methods of torch's ``dist.GradBucket``)."""

    def __init__(self, buffer: torch.Tensor, info: BucketInfo):
        self._buffer = buffer
        self._info = info

    def index(self) -> int:
        return self._info.index

    def is_last(self) -> bool:
        return self._info.is_last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list:
        return self._info.views(self._buffer)

    def parameters(self) -> list:
        raise StrategyError(
            f"DDPHook: the hook called bucket.parameters() on bucket {self._info.index} "
            f"({', '.join(map(str, self._info.keys))}); fxpar's ranks run traced graphs and hold no nn.Parameter, "
            "so hooks that read or step parameters (the optimizer-overlap, mixed-precision and sharded-optimizer "
            "hooks) cannot run here; give fxpar the optimizer (parallelize(optimizer=...)) and its Strategy options "
            "instead")


def _state_without_group(state):
    """A state object with a ``process_group`` slot or attribute, rebuilt on the rank with ``process_group=None``
    (a process group cannot be pickled; :meth:`DDPHook.bind` sets the rank's dp group)."""
    cls = type(state)
    names = [s for c in cls.__mro__ for s in getattr(c, "__slots__", ())]
    fields = {s: getattr(state, s) for s in names if s != "process_group" and hasattr(state, s)}
    fields.update({k: v for k, v in getattr(state, "__dict__", {}).items() if k != "process_group"})
    return _rebuild_state, (cls, fields)


def _rebuild_state(cls, fields):
    obj = object.__new__(cls)
    for k, v in fields.items():
        object.__setattr__(obj, k, v)
    object.__setattr__(obj, "process_group", None)
    return obj


@register_method
@dataclass(frozen=True, eq=False)
class DDPHook(Method):
    """Run ``hook(state, bucket)`` on each gradient bucket, as ``DistributedDataParallel`` with
    ``register_comm_hook(state, hook)`` runs it. ``timeout_s``: how long one bucket's future may take before the
    rank stops with an error naming the hook."""
    hook: Callable = None
    state: Any = None
    timeout_s: float = 300.0

    name: ClassVar[str] = "ddp_hook"
    unshown: ClassVar[tuple] = ("pickle",)      # the hook and its state, for from_dict, not for reading
    paper: ClassVar[str] = "torch.nn.parallel.DistributedDataParallel.register_comm_hook (DDP communication hooks)"
    eager: ClassVar[bool] = True

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)

    def __reduce__(self):
        st = self.state
        if st is not None and _has_group(st):
            st = _StateCarrier(st)
        return _rebuild_hook, (self.hook, st, self.timeout_s)

    # ---- options ----
    def check(self, dp: int) -> None:
        if not callable(self.hook):
            raise StrategyError(f"DDPHook(hook={self.hook!r}): the hook must be a function hook(state, bucket) -> "
                                "torch.futures.Future, as for DistributedDataParallel.register_comm_hook")
        if getattr(self.hook, "__name__", "") == "<lambda>" or "<locals>" in getattr(self.hook, "__qualname__", ""):
            raise StrategyError(f"DDPHook(hook={hook_name(self.hook)}): the hook travels to the ranks by pickle; "
                                "define it at the top level of a module (a lambda or a nested function cannot be "
                                "pickled)")
        if not (self.timeout_s > 0):
            raise StrategyError(f"DDPHook(timeout_s={self.timeout_s!r}): must be > 0 seconds")
        if getattr(self.hook, "func", self.hook) is torch_powersgd.batched_powerSGD_hook and not _batched_can_run():
            raise StrategyError(
                f"DDPHook({hook_name(self.hook)}): this torch's batched_powerSGD_hook cannot run, in DDP or here: at "
                "its first compressed step it hands torch's _orthogonalize a 2-D matrix, which that function refuses "
                "(AssertionError); use torch's powerSGD_hook with the same PowerSGDState "
                "(C.DDPHook(powerSGD_hook, state)), or fxpar's own C.PowerSGD(rank=..., start_iter=...)")

    def to_dict(self) -> dict:
        """The hook's and state's names for reading, and the method itself pickled (``"pickle"``, base64), so a Plan
        in JSON carries the hook and its state (without its process group) to :meth:`from_dict`."""
        return {"method": self.name, "hook": hook_name(self.hook), "state": type(self.state).__name__,
                "timeout_s": self.timeout_s, "pickle": base64.b64encode(pickle.dumps(self)).decode("ascii")}

    @classmethod
    def from_dict(cls, data: dict) -> "DDPHook":
        if "pickle" not in data:
            raise StrategyError("DDPHook: a Plan section of a DDP comm hook needs its \"pickle\" entry (the hook and "
                                "its state, as DDPHook.to_dict() writes them); plan again with "
                                "Strategy(grad_sync=DDPHook(hook, state))")
        return pickle.loads(base64.b64decode(data["pickle"]))

    def summary(self) -> str:
        return f"DDPHook({hook_name(self.hook)}, state={type(self.state).__name__}, timeout_s={self.timeout_s})"

    # ---- on the rank ----
    def bind(self, comm: Comm):
        """The state the hook receives on this rank: ``None`` becomes the dp process group; a state whose
        ``process_group`` is ``None`` gets the dp group."""
        group = getattr(comm, "pg", None)
        if group is None:
            group = c10d._resolve_process_group(comm.group) if comm.size > 1 else c10d._get_default_group()
        if self.state is None:
            return group
        if _has_group(self.state) and getattr(self.state, "process_group", None) is None:
            self.state.process_group = group
        return self.state

    def sum(self, flat: torch.Tensor, state: dict, inputs: list, bucket: BucketInfo, comm: Comm, variant) -> tuple:
        # DDP hands a hook the local gradients, un-divided: the hook averages
        buf = flat * comm.size
        hb = HookBucket(buf, bucket)
        who = hook_name(self.hook)
        try:
            with _counted_callbacks(_active_counters()):
                fut = self.hook(self.bind(comm), hb)
        except StrategyError:
            raise
        except Exception as e:
            raise StrategyError(f"DDPHook {who}: the hook raised {type(e).__name__} on bucket {bucket.index} "
                                f"({', '.join(map(str, bucket.keys))}): {e}") from e
        if not isinstance(fut, (torch.futures.Future, torch._C.Future)):
            raise StrategyError(f"DDPHook {who}: on bucket {bucket.index} the hook returned "
                                f"{type(fut).__name__}, not a torch.futures.Future of the averaged bucket")
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        while not fut.done():
            if time.monotonic() > deadline:
                raise StrategyError(f"DDPHook {who}: the future it returned for bucket {bucket.index} did not "
                                    f"complete in {self.timeout_s:g} s (DDPHook(timeout_s=...)); a hook must "
                                    "return a future its collectives (or its own code) complete")
            time.sleep(pause)
            pause = min(1e-3, pause * 2 or 1e-5)
        try:
            out = fut.value()
        except Exception as e:
            raise StrategyError(f"DDPHook {who}: the future for bucket {bucket.index} failed: {e}") from e
        if isinstance(out, (list, tuple)) and len(out) == 1:
            out = out[0]
        want = (bucket.numel,)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != bucket.torch_dtype:
            got = (f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__)
            raise StrategyError(f"DDPHook {who}: the future for bucket {bucket.index} "
                                f"({', '.join(map(str, bucket.keys))}) holds {got}; DDP needs the averaged bucket, "
                                f"shape {want} and dtype {bucket.torch_dtype}")
        return out, dict(state)

    # ---- checkpoints ----
    def host_state(self):
        """The hook's state object as this rank's checkpoint keeps it: ``{"state_dict": ...}`` from its
        ``state_dict()`` where its class has ``state_dict`` and ``load_state_dict``, else ``{"attributes": {name:
        value}}``, every attribute but ``process_group``, copied; None where the state is ``None`` or holds no
        attribute (the hook keeps nothing between calls). An attribute that does not pickle is refused, by name."""
        st = self.state
        if st is None:
            return None
        who = f"DDPHook({hook_name(self.hook)}, state={type(st).__name__})"
        if callable(getattr(st, "state_dict", None)) and callable(getattr(st, "load_state_dict", None)):
            return {"state_dict": _copied(who, "state_dict()", st.state_dict())}
        fields = _fields(st)
        if not fields:
            return None
        return {"attributes": {k: _copied(who, f"attribute {k!r}", v) for k, v in fields.items()}}

    def load_host_state(self, saved) -> None:
        """Put a checkpoint's :meth:`host_state` back into this rank's hook state (its process group stays)."""
        if saved is None:
            return
        if "state_dict" in saved:
            self.state.load_state_dict(copy.deepcopy(saved["state_dict"]))
            return
        for k, v in saved["attributes"].items():
            object.__setattr__(self.state, k, copy.deepcopy(v))

    # ---- what it costs and says ----
    def torch_hook(self) -> str | None:
        """Which of torch's hooks this is (``"allreduce"``, ``"fp16"``, ``"bf16"``, ``"powerSGD"``,
        ``"batched_powerSGD"``; a ``functools.partial`` of one counts), or None: a hook of the user's own, whose
        bytes the plan cannot know."""
        kind = _TORCH_HOOKS.get(getattr(self.hook, "func", self.hook))
        if kind in ("powerSGD", "batched_powerSGD") and not all(
                hasattr(self.state, a) for a in ("matrix_approximation_rank", "start_powerSGD_iter",
                                                 "min_compression_rate", "use_error_feedback", "warm_start")):
            return None                 # not a PowerSGDState: what it sends is not torch's formula
        return kind

    def variant(self, bucket: BucketInfo, step: int, state: dict):
        """torch's PowerSGD hooks: ``"allreduce"`` while the hook's iteration count (``PowerSGDState.iter``, one per
        step, from 0) is below ``start_powerSGD_iter``, then ``"powersgd"``; other hooks: None. For the plan and the
        cost models only: the hook itself decides from its state."""
        if self.torch_hook() in ("powerSGD", "batched_powerSGD"):
            return "allreduce" if step < self.state.start_powerSGD_iter else "powersgd"
        return None

    def collectives(self, bucket: BucketInfo, variant) -> list:
        """``[(kind, bytes), ...]`` the hook issues on ``bucket``, in order, as torch's hooks form them
        (``torch/distributed/algorithms/ddp_comm_hooks``): ``allreduce_hook`` all-reduces the bucket;
        ``fp16_compress_hook`` / ``bf16_compress_hook`` a copy in 2-byte floats; ``powerSGD_hook`` before
        ``start_powerSGD_iter`` the bucket, after it three all-reduces (:func:`powersgd_hook_sizes`: the tensors it
        does not compress, whole, then P, then Q, each possibly empty); ``batched_powerSGD_hook`` after its start P
        and Q of the bucket padded to a square (:func:`batched_powersgd_hook_sizes`). A hook of the user's own: one
        all-reduce of the bucket, a guess the plan notes (:meth:`plan_note`)."""
        es, kind = bucket.element_size, self.torch_hook()
        if kind in ("fp16", "bf16"):
            return [("all_reduce", bucket.numel * 2)]
        if variant == "powersgd" and kind == "powerSGD":
            st = self.state
            return [("all_reduce", n * es) for n in powersgd_hook_sizes(
                bucket.shapes, st.matrix_approximation_rank, st.min_compression_rate)]
        if variant == "powersgd" and kind == "batched_powerSGD":
            return [("all_reduce", n * es) for n in batched_powersgd_hook_sizes(
                bucket.numel, self.state.matrix_approximation_rank)]
        return [("all_reduce", bucket.numel * es)]

    def wire_bytes(self, bucket: BucketInfo, variant) -> int:
        """The bytes of :meth:`collectives`; a run with ``measure_comm=True`` reports what the hook handed over."""
        return sum(n for _, n in self.collectives(bucket, variant))

    def eager_sum_compute(self, bucket: BucketInfo, variant):
        """``(ops, flops, bytes, classes)`` of one steady call of torch's ``allreduce_hook``, ``fp16_compress_hook``,
        ``bf16_compress_hook`` or ``powerSGD_hook`` on ``bucket`` at ``variant``: :meth:`dry_run`'s count. None for
        ``batched_powerSGD_hook`` and a hook of the user's own (then :meth:`priced_like` answers)."""
        run = self.dry_run(bucket, variant)
        return None if run is None else run[0]

    def dry_run(self, bucket: BucketInfo, variant):
        """``((ops, flops, bytes, classes), [(kind, bytes), ...])``: what :meth:`sum` computes, counted op by op
        (``cost_models.compute.eager_compute``), and the collectives it issues, for one steady call of torch's
        ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook`` or ``powerSGD_hook`` on ``bucket`` (at
        ``variant``) -- the bucket scaled to DDP's units, then torch's hook itself, run on meta tensors of the
        bucket's layout against a dp group that moves nothing (:class:`_StandInGroup`: each collective's future
        holds its own tensors), so nothing is computed or sent. ``powerSGD_hook`` runs on a copy of the state whose
        memories are empty and whose ``iter`` is ``start_powerSGD_iter`` (``"powersgd"``) or 0 (``"allreduce"``):
        once uncounted (its first call on a bucket makes the error, P and Q memories and draws Q), then counted --
        its error feedback (the add, the clone, the residual), the concatenation and copy back of the tensors it
        sends whole, the orthogonalisations of Q and P, the three matmuls and the divisions, as its code runs them.
        None for ``batched_powerSGD_hook`` and a hook of the user's own."""
        kind = self.torch_hook()
        if kind not in ("allreduce", "fp16", "bf16", "powerSGD"):
            return None
        from cost_models.compute import eager_compute
        group = _StandInGroup(max(bucket.dp_rank, 0), bucket.dp)
        state = group if kind != "powerSGD" else _pricing_state(self.state, group)
        at = int(self.state.start_powerSGD_iter) if kind == "powerSGD" and variant == "powersgd" else 0

        def call(flat):
            if kind == "powerSGD":
                state.iter = at                     # the hook counts its calls: each one at the variant's step
            buf = flat * bucket.dp                  # sum(): DDP's units
            return self.hook(state, HookBucket(buf, bucket)).wait()
        flat = torch.empty(bucket.numel, dtype=bucket.torch_dtype, device="meta")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call(flat)                              # the first call on a bucket: its memories made
            group.sent.clear()
            _, cost = eager_compute(call, flat)
        return cost, list(group.sent)

    def priced_like(self, bucket: BucketInfo, variant):
        """A traced method doing the same math as torch's hooks (the plan prices :meth:`dry_run`'s count, which
        answers for these hooks; this is what they are compared with): ``fp16_compress_hook`` / ``bf16_compress_hook``
        as :class:`~fxpar.compress.fp16.FP16` / ``BF16`` (the same casts), ``powerSGD_hook`` after its start as
        :class:`~fxpar.compress.powersgd.PowerSGD` with the state's options (the same math, equal to the hook to
        1e-10: ``tests/test_compress_powersgd.py``). ``allreduce_hook`` computes nothing; ``batched_powerSGD_hook``
        and a user's hook: not priced."""
        from fxpar.compress.fp16 import BF16, FP16
        from fxpar.compress.powersgd import PowerSGD
        kind = self.torch_hook()
        if kind == "fp16":
            return FP16(), None
        if kind == "bf16":
            return BF16(), None
        if kind == "powerSGD" and variant == "powersgd":
            st = self.state
            like = PowerSGD(rank=int(st.matrix_approximation_rank), start_iter=int(st.start_powerSGD_iter),
                            min_compression_rate=float(st.min_compression_rate),
                            error_feedback=bool(st.use_error_feedback), warm_start=bool(st.warm_start),
                            orthogonalization_epsilon=float(getattr(st, "orthogonalization_epsilon", 0.0)))
            with warnings.catch_warnings():      # the hook's own layout is told in describe()
                warnings.simplefilter("ignore")
                like.layout(bucket)
            return like, "compressed"
        return None

    def plan_note(self) -> str:
        if self.torch_hook() is None:
            return (f"the hook {hook_name(self.hook)} is the user's own: in the plan and estimate() each bucket is "
                    "priced as one plain all-reduce of the bucket, with none of the hook's compute (what it sends is not "
                    "known before it runs; run_local(measure_comm=True) measures it); " + super().plan_note())
        return super().plan_note()

    def describe(self, bucket: BucketInfo, variant) -> list:
        head = f"DDP comm hook {hook_name(self.hook)} (state {type(self.state).__name__}) sums the bucket"
        kind = self.torch_hook()
        sent = ", ".join(f"{k} of {n} B" for k, n in self.collectives(bucket, variant))
        if kind is None:
            return [f"{head}; a hook of the user's own: what it sends is not known before it runs, so the plan and "
                    f"estimate() price it as one plain all-reduce of the bucket ({sent}) and none of its compute; "
                    "run_local(measure_comm=True) reports the bytes measured"]
        how = {"allreduce": "torch's allreduce_hook: the bucket all-reduced",
               "fp16": "torch's fp16_compress_hook: the bucket all-reduced in float16",
               "bf16": "torch's bf16_compress_hook: the bucket all-reduced in bfloat16"}.get(kind)
        if how is None and variant != "powersgd":
            how = (f"torch's {kind}_hook before start_powerSGD_iter={self.state.start_powerSGD_iter}: the bucket "
                   "all-reduced")
        elif how is None and kind == "powerSGD":
            st = self.state
            how = (f"torch's powerSGD_hook (rank {st.matrix_approximation_rank}, min_compression_rate "
                   f"{st.min_compression_rate}): the tensors it does not compress all-reduced whole, then P and Q")
        elif how is None:
            how = (f"torch's batched_powerSGD_hook (rank {self.state.matrix_approximation_rank}): P and Q of the "
                   "bucket padded to a square; its compute is not priced")
        return [f"{head}; {how} ({sent}, as torch's hook forms them; run_local(measure_comm=True) measures them)"]


def powersgd_hook_sizes(shapes, rank: int, min_compression_rate: float) -> tuple:
    """``(whole, P, Q)``: the elements ``powerSGD_hook`` all-reduces for a bucket of gradients of ``shapes`` after
    its start (torch's ``powerSGD_hook`` steps I-III): each gradient viewed as a matrix ``n x m`` (``n`` its first
    dim, ``m`` the product of the rest) at rank ``r = min(n, m, rank)`` is compressed when
    ``(n + m) r min_compression_rate < n m`` (torch's ``_should_compress``), adding ``n r`` to P and ``m r`` to Q;
    the others are sent whole."""
    whole = p = q = 0
    for shape in shapes:
        numel = 1
        for s in shape:
            numel *= int(s)
        n = int(shape[0]) if len(shape) else 1
        m = numel // n if n else 0
        r = min(n, m, int(rank))
        if (n + m) * r * min_compression_rate < n * m:
            p, q = p + n * r, q + m * r
        else:
            whole += numel
    return whole, p, q


def batched_powersgd_hook_sizes(numel: int, rank: int) -> tuple:
    """``(P, Q)``: the elements ``batched_powerSGD_hook`` all-reduces after its start: the bucket padded to a
    square of side ``ceil(sqrt(numel))``, P and Q each ``side x rank``."""
    side = math.ceil(math.sqrt(numel))
    return side * int(rank), side * int(rank)


_TORCH_HOOKS = {default_hooks.allreduce_hook: "allreduce", default_hooks.fp16_compress_hook: "fp16",
                default_hooks.bf16_compress_hook: "bf16", torch_powersgd.powerSGD_hook: "powerSGD",
                torch_powersgd.batched_powerSGD_hook: "batched_powerSGD"}


def _fields(state) -> dict:
    """A state object's attributes (its slots and its ``__dict__``), less ``process_group``."""
    names = [n for c in type(state).__mro__ for n in getattr(c, "__slots__", ()) if n != "__weakref__"]
    out = {n: getattr(state, n) for n in names if n not in ("process_group", "__dict__") and hasattr(state, n)}
    out.update({k: v for k, v in getattr(state, "__dict__", {}).items() if k != "process_group"})
    return out


def _copied(who: str, what: str, value):
    """``value`` copied through pickle (what a checkpoint stores), or a StrategyError naming ``what``."""
    try:
        return pickle.loads(pickle.dumps(value))
    except Exception as e:
        raise StrategyError(
            f"{who}: the checkpoint cannot save the hook state's {what} ({type(value).__name__}: {e}); a checkpoint "
            "keeps the hook's state with each rank's: keep only values that pickle in the state (tensors, numbers, "
            "dicts, numpy generators), or give its class state_dict() and load_state_dict() that return and take "
            "such values") from e


@functools.lru_cache(maxsize=None)
def _batched_can_run() -> bool:
    """Whether this torch's ``batched_powerSGD_hook`` can run its compressed steps: it orthogonalizes one 2-D
    matrix per bucket with ``_orthogonalize``, which some torch versions accept only as a batch of matrices."""
    orthogonalize = getattr(torch_powersgd, "_orthogonalize", None)
    if orthogonalize is None:           # a torch that orthogonalizes otherwise: nothing known to refuse
        return True
    try:
        orthogonalize(torch.ones(2, 1))
    except Exception:
        return False
    return True


def _active_counters() -> list:
    """The rank's ``CommCounter`` modes active on this thread (a run with ``measure_comm=True``)."""
    return [m for m in _get_current_dispatch_mode_stack() if isinstance(m, CommCounter)]


class _Relay(TorchDispatchMode):
    """Hands every op dispatched on another thread (a future's callback on the backend's thread) to ``mode``, which
    counts it there as on the rank's own thread. One per callback run: a mode's entry keeps flags of its own."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.mode.__torch_dispatch__(func, types, args, kwargs)


_PATCH_LOCK = threading.Lock()
_patch_depth = 0
_THEN = torch._C.Future.then
_ADD_DONE = torch._C.Future.add_done_callback


def _counting(callback, counters):
    """``callback`` run under ``counters``: on a thread where they are not active, each through a :class:`_Relay`;
    callbacks it chains in turn are counted alike."""
    def run(fut):
        on = _get_current_dispatch_mode_stack()
        with contextlib.ExitStack() as stack:
            for c in counters:
                if not any(m is c for m in on):
                    stack.enter_context(_Relay(c))
            stack.enter_context(_counted_callbacks(counters))
            return callback(fut)
    return run


@contextlib.contextmanager
def _counted_callbacks(counters):
    """While a hook runs: every callback chained on a ``torch.futures.Future`` (``then``, ``add_done_callback``) runs
    under ``counters``. A DDP hook issues collectives from its future's callbacks, which the backend runs on its own
    threads, where the rank's counter (a thread's dispatch mode) does not see them otherwise. Nothing to count:
    nothing changes."""
    global _patch_depth
    if not counters:
        yield
        return

    def then(self, callback):
        return _THEN(self, _counting(callback, counters))

    def add_done_callback(self, callback):
        return _ADD_DONE(self, _counting(callback, counters))
    with _PATCH_LOCK:
        if _patch_depth == 0:
            torch._C.Future.then, torch._C.Future.add_done_callback = then, add_done_callback
        _patch_depth += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _patch_depth -= 1
            if _patch_depth == 0:
                torch._C.Future.then, torch._C.Future.add_done_callback = _THEN, _ADD_DONE


class _Done(Work):
    """A collective that is done: its future holds the tensors it was handed."""

    def __init__(self, tensors):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(tensors)

    def get_future(self):
        return self._future

    def wait(self, timeout=None):
        return True


class _StandInGroup(ProcessGroup):
    """A dp group of ``size`` ranks that moves nothing (a hook run to count its compute,
    :meth:`DDPHook.eager_sum_compute`): every all-reduce is done at once, its future holding the tensors it was
    handed; ``sent`` lists each as ``("all_reduce", bytes)``."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._size = size
        self.sent: list = []

    def size(self) -> int:
        return self._size

    def allreduce(self, tensors, opts=None):
        self.sent.append(("all_reduce", sum(t.numel() * t.element_size() for t in tensors)))
        return _Done(tensors)

    def getBackendName(self) -> str:
        return "fxpar-stand-in"


def _pricing_state(state, group):
    """A copy of the ``PowerSGDState`` ``state`` on ``group``, with empty memories (error, P, Q) and its own
    generator, for a hook run that counts its compute."""
    fields = _fields(state)
    fields.update(error_dict={}, p_memory_dict={}, q_memory_dict={}, rng=copy.deepcopy(fields.get("rng")))
    out = _rebuild_state(type(state), fields)
    out.process_group = group
    return out


def _has_group(state) -> bool:
    slots = [s for c in type(state).__mro__ for s in getattr(c, "__slots__", ())]
    return "process_group" in slots or "process_group" in getattr(state, "__dict__", {})


class _StateCarrier:
    """Pickles a hook state without its process group."""

    def __init__(self, state):
        self.state = state

    def __reduce__(self):
        return _state_without_group(self.state)


def _rebuild_hook(hook, state, timeout_s):
    return DDPHook(hook, state, timeout_s)

