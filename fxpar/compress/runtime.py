"""A compression method on a rank: its per-bucket state, step counters and generator, and the bucket sums it runs.

The compression pass (:mod:`fxpar.compress.feature`) puts one call of :func:`bucket_sum` where each data-parallel
bucket's all-reduce was. When the rank starts, its :class:`CompressState` binds those calls to itself
(:meth:`CompressState.setup`); each call then, on the host:

1. asks the method which graph sums the bucket at this step (:meth:`Method.variant`, from the bucket's own step
   counter and state) and for the tensors made on the host (:meth:`Method.host_inputs`, from the rank's generator);
2. runs that variant's graph: :meth:`Method.sum` traced once per (bucket, variant) with ``make_fx`` on fake
   tensors, its collectives bound to the rank's dp group (``bind_groups``) and, on gloo, every gather through the
   path that is safe beside other collectives (``lower_for_backend``) -- or, for an ``eager`` method (a DDP comm
   hook), ``sum`` itself with an :class:`EagerComm` on the rank's group;
3. keeps the new state and counts the step.

Everything it keeps -- each bucket's state tensors, each bucket's step counter, the generator's state and the
method's own objects (:meth:`Method.host_state`: a DDP hook's state object) -- is saved in checkpoints
(:meth:`CompressState.save`) and restored bitwise (:meth:`CompressState.load`). The
collectives the traced graphs issue run inside the executor's ``CommCounter`` like any other graph's; an eager
method's ``dist.*`` calls are counted there too (``c10d`` ops).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import _disable_current_modes

from fxpar.collectives import lower_for_backend
from fxpar.feature import RankState
from fxpar.runtime.groups import bind_groups, group

from .method import BucketInfo, Comm, Method

__all__ = ["bucket_sum", "CompressInfo", "CompressState", "EagerComm", "bucket_key", "generator_for"]


def bucket_key(stage: int, index: int) -> str:
    """The name of a bucket's entries in checkpoints: ``"s<stage>b<index>"``."""
    return f"s{stage}b{index}"


def generator_for(method: Method) -> torch.Generator:
    """The rank's generator for ``method``: seeded from its ``seed`` option, 0 if it has none (the same on every
    rank; a method that wants draws of its own per rank draws for every rank and keeps its own)."""
    return torch.Generator().manual_seed(int(getattr(method, "seed", 0) or 0))


def bucket_sum(flat: torch.Tensor, feature: str, stage: int, index: int) -> torch.Tensor:
    """What the compression pass puts in a graph in place of a bucket's all-reduce: the bucket ``flat`` (this rank's
    gradients, scaled by 1/dp) summed over dp by feature ``feature``'s method. On a rank, :class:`CompressState`
    replaces each call by its own :meth:`CompressState.sum`; called here, the graph runs outside a rank."""
    raise RuntimeError(f"graph calls fxpar.compress.runtime.bucket_sum for feature {feature!r} (stage {stage}, bucket "
                       f"{index}) outside a rank: run the program (run_local, runner()) -- its ranks bind the call to "
                       "their compression state")


@dataclass(frozen=True)
class CompressInfo:
    """What a rank's :class:`CompressState` starts from (picklable): the feature, the method, the buckets of the
    stages the rank holds (``dp_rank`` set) and the ranks of its dp group."""
    feature: str
    method: Method
    buckets: tuple
    dp_ranks: tuple


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
        self.graphs: dict = {}         # (stage, index, variant) -> (GraphModule, state names)
        self.names: dict = {}          # group tag name -> this rank's process group name
        self.pg = None

    # ---- binding the graphs' calls ----------------------------------------------------------------------------
    def setup(self, ex) -> None:
        if dist.is_initialized() and len(self.info.dp_ranks) > 1:
            self.pg = group(self.info.dp_ranks, "dp")
            self.names = {"dp": self.pg.group_name}
        for parts in ex.p.graphs.values():
            for sg in parts.values():
                bound = False
                for n in sg.gm.graph.nodes:
                    # bucket_sum, or a call an earlier rank state of this process bound (the graphs of a program
                    # built here are shared: a second runner() binds them again)
                    if n.op == "call_function" and n.args[1:2] == (self.info.feature,) and (
                            n.target is bucket_sum or getattr(n.target, "__func__", None) is CompressState.sum):
                        n.target = self.sum
                        bound = True
                if bound:
                    sg.gm.recompile()

    # ---- one bucket, one step ------------------------------------------------------------------------------
    def sum(self, flat: torch.Tensor, feature: str, stage: int, index: int) -> torch.Tensor:
        key = (stage, index)
        b = self.buckets.get(key)
        if b is None:
            raise RuntimeError(f"rank {self.rank}: a graph sums bucket {index} of stage {stage}, for which "
                               f"{type(self.method).__name__} holds no state (it holds {sorted(self.buckets)}): the "
                               "Plan section and the graphs disagree -- plan again (parallelize without plan=)")
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
        self.state[key] = dict(new)
        self.steps[key] = step + 1
        return summed

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
                gm = trace_sum(self.method, b, variant, flat, state, inputs, names)
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
            r = self.method.report(b, self.state[k])
            if r is not None:
                out[k] = r
        return out or None

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def save(self) -> dict:
        out = {"state": {bucket_key(*k): {n: t.clone() for n, t in st.items()} for k, st in self.state.items()},
               "steps": {bucket_key(*k): n for k, n in self.steps.items()},
               "generator": self.gen.get_state().clone()}
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
        self.gen.set_state(saved["generator"].clone())
        if "host" in saved:
            self.method.load_host_state(saved["host"])
        elif self.method.host_state() is not None:
            raise RuntimeError(f"rank {self.rank}: the checkpoint holds no state of {self.method.summary()}'s own "
                               "objects (a DDP hook's state object), which this run keeps: it was saved by a run "
                               "without them; resume from a checkpoint this method saved")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values())


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
