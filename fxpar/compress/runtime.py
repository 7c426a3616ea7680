"""A compression method on a rank: its per-bucket state, step counters and generator, and the bucket sums it runs.

The compression pass (:mod:`fxpar.compress.feature`) puts, for a traced method, one call of :func:`bucket_sum`
(``overlapped=True``) where each data-parallel bucket's all-reduce was issued and one call of
:func:`bucket_sum_wait` where its wait was; for an ``eager`` method one call of :func:`bucket_sum` that sums at
once. When the rank starts, its :class:`CompressState` binds those calls to itself (:meth:`CompressState.setup`).

``bucket_sum`` (:meth:`CompressState.issue`), on the host:

1. asks the method which graph sums the bucket at this step (:meth:`Method.variant`, from the bucket's own step
   counter and state) and for the tensors made on the host (:meth:`Method.host_inputs`, from the rank's generator);
2. takes that variant's graph -- :meth:`Method.sum` traced once per (bucket, variant) with ``make_fx`` on fake
   tensors, its collectives bound to the rank's dp group (``bind_groups``) and cut into compute phases with the
   collectives between them (:func:`fxpar.compress.phases.split_phases`);
3. hands the sum to the rank's :class:`fxpar.compress.inflight.InFlight`, which runs its first phase and issues its
   first collectives (in backward, in the fused one-stage step) and moves the sums before it on.

``bucket_sum_wait`` (:meth:`CompressState.wait`) finishes every sum in flight (their last collectives, waited, and
their last phases), keeps each bucket's new state and counts its step. An ``eager`` method's ``bucket_sum``
(:meth:`CompressState.sum`) runs ``sum`` itself with an :class:`EagerComm` on the rank's group, at once.

Everything it keeps -- each bucket's state tensors, each bucket's step counter, the generator's state and the
method's own objects (:meth:`Method.host_state`: a DDP hook's state object) -- is saved in checkpoints
(:meth:`CompressState.save`) and restored bitwise (:meth:`CompressState.load`). The collectives run inside the
executor's ``CommCounter`` like any graph's (functional collectives, and an eager method's ``dist.*`` calls:
``c10d`` ops).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import _disable_current_modes

from fxpar.collectives import C10D, gloo_all_gather_into_tensor, lower_for_backend
from fxpar.feature import RankState
from fxpar.runtime.groups import bind_groups, group

from .inflight import InFlight, Running
from .method import BucketInfo, Comm, Method
from .phases import split_phases

__all__ = ["bucket_sum", "bucket_sum_wait", "CompressInfo", "CompressState", "EagerComm", "bucket_key",
           "generator_for", "trace_sum", "kept_sum"]


def bucket_key(stage: int, index: int) -> str:
    """The name of a bucket's entries in checkpoints: ``"s<stage>b<index>"``."""
    return f"s{stage}b{index}"


def generator_for(method: Method) -> torch.Generator:
    """The rank's generator for ``method``: seeded from its ``seed`` option, 0 if it has none (the same on every
    rank; a method that wants draws of its own per rank draws for every rank and keeps its own)."""
    return torch.Generator().manual_seed(int(getattr(method, "seed", 0) or 0))


def bucket_sum(flat: torch.Tensor, feature: str, stage: int, index: int, overlapped: bool = False) -> torch.Tensor:
    """What the compression pass puts in a graph in place of a bucket's all-reduce: the bucket ``flat`` (this rank's
    gradients, scaled by 1/dp) summed over dp by feature ``feature``'s method -- at once, or (``overlapped``) begun,
    returning ``flat`` as the handle that :func:`bucket_sum_wait` reads. On a rank, :class:`CompressState` replaces
    each call by its own :meth:`CompressState.sum` / :meth:`CompressState.issue`; called here, the graph runs
    outside a rank."""
    raise RuntimeError(f"graph calls fxpar.compress.runtime.bucket_sum for feature {feature!r} (stage {stage}, bucket "
                       f"{index}) outside a rank: run the program (run_local, runner()) -- its ranks bind the call to "
                       "their compression state")


def bucket_sum_wait(handle: torch.Tensor, feature: str, stage: int, index: int) -> torch.Tensor:
    """Where the update reads a bucket whose sum :func:`bucket_sum` began (``handle``): its sum. On a rank,
    :class:`CompressState` replaces each call by its own :meth:`CompressState.wait`."""
    raise RuntimeError(f"graph calls fxpar.compress.runtime.bucket_sum_wait for feature {feature!r} (stage {stage}, "
                       f"bucket {index}) outside a rank: run the program (run_local, runner())")


@dataclass(frozen=True)
class CompressInfo:
    """What a rank's :class:`CompressState` starts from (picklable): the feature, the method, the buckets of the
    stages the rank holds (``dp_rank`` set), the ranks of its dp group, and how the sums in flight are ordered
    (``schedule``: None, FIFO; else ``{"priority": {(stage, bucket): rank}, "partition_bytes", "credit_bytes"}``,
    ByteScheduler on the compressed pieces)."""
    feature: str
    method: Method
    buckets: tuple
    dp_ranks: tuple
    schedule: dict | None = None


class EagerComm(Comm):
    """:class:`Comm` for an ``eager`` method: the collectives run at once through ``torch.distributed`` on the rank's
    dp group ``pg`` (the executor's ``CommCounter`` counts them: ``c10d`` ops)."""

    def __init__(self, size: int, rank: int, pg):
        super().__init__(size, rank, group=None)
        self.pg = pg

    def all_reduce(self, t, op: str = "sum"):
        out = t.detach().clone()
        dist.all_reduce(out, op=_OPS[op], group=self.pg)
        return out

    def all_gather(self, t):
        t = t.contiguous()
        out = t.new_empty([self.size * t.shape[0], *t.shape[1:]])
        dist.all_gather_into_tensor(out, t, group=self.pg)
        return out

    def reduce_scatter(self, t, op: str = "sum"):
        t = t.contiguous()
        out = t.new_empty([t.shape[0] // self.size, *t.shape[1:]])
        dist.reduce_scatter_tensor(out, t, op=_OPS[op], group=self.pg)
        return out

    def all_to_all(self, t):
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=self.pg)
        return out


_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class CompressState(RankState):
    """One rank's compression state: per (stage, bucket) the method's state tensors and step counter, the rank's
    generator, and the traced graphs (per bucket and variant)."""

    def __init__(self, info: CompressInfo, rank: int):
        super().__init__(info, rank)
        self.method = info.method
        self.buckets = {(b.stage, b.index): b for b in info.buckets}
        self.gen = generator_for(self.method)
        self.state = {k: dict(self.method.init_state(b, self.gen)) for k, b in sorted(self.buckets.items())}
        self.steps = {k: 0 for k in self.buckets}
        self.records = {k: [] for k in self.buckets}      # per bucket, Method.step_record of each step
        self.graphs: dict = {}         # (stage, index, variant) -> (GraphModule, state names)
        self.phased: dict = {}         # (stage, index, variant) -> the graph cut into phases (split_phases)
        self.names: dict = {}          # group tag name -> this rank's process group name
        self.pg = None
        self.gloo = False
        sch = info.schedule or {}
        self.flight = InFlight(self._issue, sch.get("priority"), sch.get("partition_bytes"), sch.get("credit_bytes"))
        self.running: dict = {}        # (stage, index) -> its sum under way (inflight.Running), between issue and wait
        self.started = 0

    # ---- binding the graphs' calls ----------------------------------------------------------------------------
    def setup(self, ex) -> None:
        if dist.is_initialized() and len(self.info.dp_ranks) > 1:
            self.pg = group(self.info.dp_ranks, "dp")
            self.names = {"dp": self.pg.group_name}
            self.gloo = "gloo" in str(dist.get_backend(self.pg))
        for parts in ex.p.graphs.values():
            for sg in parts.values():
                bound = False
                for n in sg.gm.graph.nodes:
                    # bucket_sum / bucket_sum_wait, or a call an earlier rank state of this process bound (the graphs
                    # of a program built here are shared: a second runner() binds them again)
                    if n.op != "call_function" or n.args[1:2] != (self.info.feature,):
                        continue
                    if n.target is bucket_sum_wait or _bound(n.target, "wait"):
                        n.target = self.wait
                    elif n.target is bucket_sum or _bound(n.target, "sum") or _bound(n.target, "issue"):
                        n.target = self.issue if n.kwargs.get("overlapped") else self.sum
                    else:
                        continue
                    bound = True
                if bound:
                    sg.gm.recompile()

    # ---- one bucket, one step ------------------------------------------------------------------------------
    def sum(self, flat: torch.Tensor, feature: str, stage: int, index: int, overlapped: bool = False) -> torch.Tensor:
        """Bucket ``(stage, index)``'s sum at once (an eager method's; module docstring)."""
        key = (stage, index)
        b = self._bucket(key)
        m, step, state = self.method, self.steps[key], self.state[key]
        variant = m.variant(b, step, state)
        inputs = self.inputs(b, step, state, variant)
        if m.eager:
            summed, new = m.sum(flat, dict(state), inputs, b, EagerComm(b.dp, b.dp_rank, self.pg), variant)
        else:
            gm, names = self._graph(b, variant, flat, state, inputs)
            out = gm(flat, *[state[k] for k in names], *inputs)
            summed, new = out[0], dict(zip(names, out[1:]))
        self._check(b, flat, summed, state, new)
        self._done(key, b, new)
        return summed

    def issue(self, flat: torch.Tensor, feature: str, stage: int, index: int, overlapped: bool = True) -> torch.Tensor:
        """Begin bucket ``(stage, index)``'s sum (module docstring); returns ``flat``, the handle :meth:`wait`
        reads."""
        key = (stage, index)
        b = self._bucket(key)
        if key in self.running:
            raise RuntimeError(f"rank {self.rank}: bucket {index} of stage {stage} begins its sum again before the "
                               "last one was waited: the graph calls bucket_sum twice for it without bucket_sum_wait "
                               "between -- plan again (parallelize without plan=)")
        m, step, state = self.method, self.steps[key], self.state[key]
        variant = m.variant(b, step, state)
        inputs = self.inputs(b, step, state, variant)
        _, names = self._graph(b, variant, flat, state, inputs)
        phased = self._phases(b, variant)
        env = dict(zip(phased.inputs, [flat, *[state[k] for k in names], *inputs]))
        sch = self.info.schedule
        prio = sch["priority"][key] if sch else self.started
        self.started += 1
        run = Running(key, prio, phased, env)
        self.running[key] = (run, flat, state, names)
        self.flight.ready(run)
        return flat

    def wait(self, handle: torch.Tensor, feature: str, stage: int, index: int) -> torch.Tensor:
        """Bucket ``(stage, index)``'s sum, which :meth:`issue` began: every sum in flight runs to its end (the
        first wait of a step), then this bucket's result and new state are taken."""
        key = (stage, index)
        got = self.running.pop(key, None)
        if got is None:
            raise RuntimeError(f"rank {self.rank}: the graph waits for the sum of bucket {index} of stage {stage}, "
                               "which no bucket_sum began in this step -- plan again (parallelize without plan=)")
        run, flat, state, names = got
        if run.result is None:
            self.flight.drain()
        b = self.buckets[key]
        summed, new = run.result[0], dict(zip(names, run.result[1:]))
        self._check(b, flat, summed, state, new)
        self._done(key, b, new)
        return summed

    def _done(self, key, b: BucketInfo, new: dict) -> None:
        """Bucket ``key``'s step is summed: its new state kept, its step counted, what the method records of it
        (:meth:`Method.step_record`) kept."""
        self.state[key] = dict(new)
        self.steps[key] += 1
        rec = self.method.step_record(b, self.state[key])
        if rec is not None:
            self.records[key].append(rec)

    def _bucket(self, key) -> BucketInfo:
        b = self.buckets.get(key)
        if b is None:
            raise RuntimeError(f"rank {self.rank}: a graph sums bucket {key[1]} of stage {key[0]}, for which "
                               f"{type(self.method).__name__} holds no state (it holds {sorted(self.buckets)}): the "
                               "Plan section and the graphs disagree -- plan again (parallelize without plan=)")
        return b

    def _phases(self, b: BucketInfo, variant):
        """Bucket ``b``'s traced sum for ``variant`` cut into phases (made once, beside the graph)."""
        key = (b.stage, b.index, variant)
        got = self.phased.get(key)
        if got is None:
            gm, _ = self.graphs[key]
            got = self.phased[key] = split_phases(gm, f"{type(self.method).__name__}.sum (stage {b.stage}, bucket "
                                                      f"{b.index})")
        return got

    def _issue(self, coll, t: torch.Tensor) -> torch.Tensor:
        """One collective (or piece) of a phased sum, on the rank's group: on gloo an all-gather by the path safe
        beside other collectives in flight (``fxpar.collectives.gloo_all_gather_into_tensor``)."""
        target = coll.target
        if self.gloo and target is C10D.all_gather_into_tensor.default:
            target = gloo_all_gather_into_tensor
        return target(t, *coll.args)

    def inputs(self, b: BucketInfo, step: int, state: dict, variant) -> list:
        """The host inputs of bucket ``b``'s sum at ``step``: the method's (:meth:`Method.host_inputs`). A method's
        own rank state (:attr:`Method.rank_state`) may hand over more of what the rank holds."""
        return list(self.method.host_inputs(b, step, state, variant, self.gen))

    def _graph(self, b: BucketInfo, variant, flat, state, inputs):
        """The traced sum of bucket ``b`` for ``variant`` (traced at its first use, then kept)."""
        key = (b.stage, b.index, variant)
        got = self.graphs.get(key)
        if got is None:
            names = sorted(state)
            with _disable_current_modes():     # tracing is no step's work: the rank's counters do not see it
                gm = copy.deepcopy(kept_sum(self.method, b, variant, flat, state, inputs, names))
            if self.names:
                bind_groups(gm, self.names)
                lower_for_backend(gm, anywhere=True)   # gloo: every gather by the path safe beside other collectives
            got = self.graphs[key] = (gm, names)
        return got

    def _check(self, b, flat, summed, state, new) -> None:
        what = f"{type(self.method).__name__}.sum (stage {b.stage}, bucket {b.index})"
        if not isinstance(summed, torch.Tensor) or summed.shape != flat.shape or summed.dtype != flat.dtype:
            got = (f"{tuple(summed.shape)} {summed.dtype}" if isinstance(summed, torch.Tensor)
                   else type(summed).__name__)
            raise RuntimeError(f"{what} returned {got} for the bucket of {tuple(flat.shape)} {flat.dtype}: return the "
                               "summed bucket in the bucket's shape and dtype")
        if set(new) != set(state):
            raise RuntimeError(f"{what} returned state {sorted(new)}, but init_state made {sorted(state)}: return "
                               "the same keys")
        for k, v in new.items():
            if v.shape != state[k].shape or v.dtype != state[k].dtype:
                raise RuntimeError(f"{what} returned state {k!r} of {tuple(v.shape)} {v.dtype}; init_state made "
                                   f"{tuple(state[k].shape)} {state[k].dtype}: keep each state tensor's shape and "
                                   "dtype")

    def report(self):
        """``{(stage, index): the method's report of that bucket}`` for buckets it reports on (None: none)."""
        out = {}
        for k, b in sorted(self.buckets.items()):
            recs = self.records.get(k)
            r = self.method.report(b, self.state[k], records=list(recs)) if recs else self.method.report(b, self.state[k])
            if r is not None:
                out[k] = r
        return out or None

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def save(self) -> dict:
        out = {"state": {bucket_key(*k): {n: t.clone() for n, t in st.items()} for k, st in self.state.items()},
               "steps": {bucket_key(*k): n for k, n in self.steps.items()},
               "generator": self.gen.get_state().clone()}
        if any(self.records.values()):
            out["records"] = {bucket_key(*k): list(v) for k, v in self.records.items()}
        host = self.method.host_state()
        if host is not None:
            out["host"] = host
        return out

    def load(self, saved: dict) -> None:
        mine = {bucket_key(*k): k for k in self.buckets}
        missing = sorted(set(mine) - set(saved.get("state", {})))
        if missing:
            raise RuntimeError(f"rank {self.rank}: the checkpoint holds no {type(self.method).__name__} state for "
                               f"bucket(s) {missing}: it was saved by a program with other buckets or stages")
        for name, k in mine.items():
            st = saved["state"][name]
            if set(st) != set(self.state[k]) or any(st[n].shape != self.state[k][n].shape for n in st):
                raise RuntimeError(f"rank {self.rank}: the checkpoint's {type(self.method).__name__} state of bucket "
                                   f"{name} ({ {n: tuple(t.shape) for n, t in st.items()} }) is not this program's "
                                   f"({ {n: tuple(t.shape) for n, t in self.state[k].items()} }): it was saved with "
                                   "other method options or buckets")
            self.state[k] = {n: t.clone() for n, t in st.items()}
            self.steps[k] = int(saved["steps"][name])
            self.records[k] = list(saved.get("records", {}).get(name, []))
        self.gen.set_state(saved["generator"].clone())
        if "host" in saved:
            self.method.load_host_state(saved["host"])
        elif self.method.host_state() is not None:
            raise RuntimeError(f"rank {self.rank}: the checkpoint holds no state of {self.method.summary()}'s own "
                               "objects (a DDP hook's state object), which this run keeps: it was saved by a run "
                               "without them; resume from a checkpoint this method saved")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values())


def _bound(target, name: str) -> bool:
    """Whether ``target`` is a rank state's method ``name`` (bound by an earlier :meth:`CompressState.setup`)."""
    return isinstance(getattr(target, "__self__", None), CompressState) and target.__name__ == name


def trace_sum(method: Method, b: BucketInfo, variant, flat, state: dict, inputs: list, names: list,
              group: str | None = None) -> torch.fx.GraphModule:
    """``method.sum`` of bucket ``b`` for ``variant`` as a graph ``(flat, *state[names], *inputs) -> (summed,
    *new_state[names])``, traced on fake tensors; its collectives name ``group`` (default the tag ``"fxpar:dp"``)."""
    comm = Comm(b.dp, b.dp_rank, group)
    n_state = len(names)

    def one(flat, *rest):
        st = dict(zip(names, rest[:n_state]))
        summed, new = method.sum(flat, st, list(rest[n_state:]), b, comm, variant)
        return (summed, *[new[k] for k in names])
    return make_fx(one, tracing_mode="fake")(flat, *[state[k] for k in names], *inputs)


# traced sums kept in this process: (method class, its options, bucket, variant, state names, the bucket's, the
# state's and the inputs' shapes, strides, dtypes and devices (a host input that is no tensor: its repr), group) ->
# graph. A sum traces on fake tensors, so its graph is a function of these: a bucket summed again (the same program
# planned or run again, a plan's pieces beside its costed collectives) is traced once. Least recently used first out.
_KEPT: OrderedDict = OrderedDict()
KEPT_SUMS = 64                 # the largest sums (ALQ's adaptation) hold about 2 MB of graph each


def kept_sum(method: Method, b: BucketInfo, variant, flat, state: dict, inputs: list, names: list,
             group: str | None = None) -> torch.fx.GraphModule:
    """:func:`trace_sum`, traced once per key (above) and shared: read it, or change a ``copy.deepcopy`` of it."""
    shapes = tuple((tuple(t.shape), t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else repr(t)
                   for t in [flat, *[state[k] for k in names], *inputs])
    key = (type(method), repr(sorted(method.to_dict().items())), b, variant, tuple(names), shapes, group)
    try:
        gm = _KEPT.get(key)
    except TypeError:                # a variant that is not hashable: traced every time
        return trace_sum(method, b, variant, flat, state, inputs, names, group)
    if gm is None:
        gm = _KEPT[key] = trace_sum(method, b, variant, flat, state, inputs, names, group)
        while len(_KEPT) > KEPT_SUMS:
            _KEPT.popitem(last=False)
    _KEPT.move_to_end(key)
    return gm
