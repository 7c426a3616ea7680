"""The automatic planner's search space and its cheap cost: every candidate is priced from the model's profile
(:mod:`fxpar.auto.profile`) and the cost models' link and schedule figures, without capturing or lowering a graph.

A candidate is ``dp x tp x pp`` (tp the fastest axis, so a tp group sits inside a node first), a pipeline schedule
and a microbatch count, the tp mode, the ZeRO stage, the recompute policy, the compute precision, ZeRO-Offload and
the gradient bucket size. Its cheap figures:

- compute: each stage's forward and backward per microbatch (its blocks, plus the embeddings on the first stage and
  the head and loss on the last), the ops of classes tensor parallelism splits divided by tp; recompute adds the
  forward it repeats ('full': each block's; 'selective': each block's ops that are not matmuls);
- tensor parallelism: two all-reduces of a block's input in forward and two in backward per block (Megatron's
  pairs; without repeated blocks, one each way per pair of Linears), over the tp ranks;
- the pipeline: the schedule's dry run with equal stages (forward 1, backward 2) scaled to the slowest stage's
  forward + backward (plus each message's point-to-point time), which gives the makespan and the microbatches each
  rank holds at once; for the searched synchronous schedules its closed form (:func:`schedule_shape`), for any other
  the generator's action lists dry-run once per pipeline depth and microbatch count;
- data parallelism: the stage's gradients all-reduced over the dp ranks (ZeRO: reduce-scatter + all-gather, and
  ZeRO-3's gathers of each stage's parameters in forward and backward), hidden behind the last backward except
  the last bucket; one collective per bucket (each pays the link's latency), so the bucket size is chosen per
  candidate among ``BUCKETS_MB`` by this cost where the user does not pin it;
- ByteScheduler (``comm_schedule="bytescheduler"``; one stage, one microbatch, plain all-reduce): its own simulation
  (``cost_models.comm_tuning.simulate``, what the feature tunes its partition and credit on) run on the profile's
  timeline, one piece per block's gradients (the parameters outside the blocks ready at the end of backward and
  needed first), over the credits the feature tries, with and without cross-iteration overlap (kept only where it
  is predicted over 2% faster, as the feature decides); what it predicts against FIFO buckets on the same timeline
  is added to the FIFO figure (where FIFO's exposed sum is under ``BS_MIN_SHARE`` of the step, ByteScheduler is
  priced as FIFO: it could gain less than that). Cross-iteration overlap holds two more copies of the gradients (the
  pieces carried in and out of the step, as ``estimate()`` counts them);
- Herring (``grad_sync="herring"``; several nodes, data parallelism alone): each bucket's chain as the feature
  prices it -- reduce-scatter in the node, all-reduce of a shard across nodes, all-gather in the node -- hidden
  behind backward but the last bucket's, plus the issue of its two extra collectives per bucket; the bucket size as
  the feature tunes it: the largest of ``HERRING_BUCKET_MB`` whose step is within 2% of the least;
- recompute ``"auto"`` (the least recompute whose saved activations fit ``memory_budget_gb``; the budget the
  activations' room under the memory budget once the candidate's parameters, gradients, optimizer state and
  workspace are counted, or the pinned ``memory_budget_gb``): searched only where ``"none"`` does not fit that room.
  Priced on the lower convex hull of (activations, recompute time) through ``none``, ``selective`` and ``full`` at
  the room: what recomputing a share of the blocks under one policy and the rest under the next reaches. The
  feature's min-cut plans node by node for the least recompute FLOPs that fit (``passes.recompute.auto_decide``);
  the hull is the cheap cost's figure for it, the built finalist's estimate the exact one;
- mixed precision (``precision="bf16"``): every figure of forward and backward from a profile run in bf16 (half the
  bytes of each activation, message and memory-bound op); the master parameters, the gradients and the optimizer
  state stay in the model's dtype, and a bf16 copy of the rank's parameters is held through the step;
- ZeRO-Offload (``offload=("optimizer",)``, ZeRO-3 also ``"params"``): the optimizer state (and the master chunk)
  off the device; the gradient chunk goes down and the updated chunk up the host link (``HOST_LINK``), the update
  runs at the host's memory bandwidth (``HOST_MEMORY``); offloaded ZeRO-3 chunks come up the host link for each
  gather;
- the optimizer: one pass over the rank's parameters, gradients and states at memory bandwidth;
- memory: the heaviest stage's parameters, gradients and optimizer states (ZeRO's shares), the activations of the
  microbatches in flight, and twice the largest tensor an op makes (a logits tensor and its gradient).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from cost_models.comm import collective_cost
from cost_models.compute import fp32_share
from cost_models.comm_tuning import BucketTiming, simulate as simulate_comm
from ..features.herring import HERRING_BUCKET_MB
from ..schedule import ScheduleError, simulate
from ..schedule.registry import get_schedule
from ..strategy import Strategy

__all__ = ["Candidate", "cost_candidate", "schedule_shape", "SCHEDULES", "BUCKET_BYTES", "BUCKETS_MB", "bf16_supported",
           "rank_devices"]

SCHEDULES = ("1f1b", "interleaved", "zb1p")      # the synchronous pipeline schedules searched
BUCKET_BYTES = 25 * 2**20                         # DDP's bucket: the last one waits for the end of backward
BUCKETS_MB = (5, 25, 100)                         # the gradient bucket sizes the search weighs (MiB)
# The host side of ZeRO-Offload, per GPU (a DeviceSpec carries no host figures): PCIe 4.0 x16, 31.5 GB/s per
# direction (PCI-SIG), the A100's host link; a DGX A100's two EPYC 7742 sockets, 8 channels of DDR4-3200 each
# (2 x 204.8 GB/s), shared by its 8 GPUs. Used for every GPU device.
HOST_LINK = 31.5e9
HOST_MEMORY = 2 * 204.8e9 / 8
# GPUs without bfloat16 arithmetic (compute capability below 8.0): the search gives them no bf16 candidate
NO_BF16 = ("V100", "P100", "T4")
COMPUTE_BYTES = {"bf16": 2, "fp16": 2}
OPT_OPS_PER_TENSOR = 4                            # ops the traced update runs per parameter tensor (copies, views)
ZERO_OPS_PER_TENSOR = 4                           # ops ZeRO adds per parameter tensor (into and out of its chunks)
ZERO3_EXPOSED = 0.5                               # the share of ZeRO-3's gathers the compute does not hide
# ByteScheduler's credits the cheap cost simulates, in units of the largest piece (the feature's credit factors,
# cost_models.comm_tuning), and the gain cross-iteration overlap must show to be kept (the feature's _CROSS_GAIN)
BS_CREDIT_FACTORS = (1, 2, 4, 8)
BS_CROSS_GAIN = 0.02
# below this share of the step, FIFO's exposed gradient sum leaves ByteScheduler too little to gain to be simulated:
# it is priced as FIFO (no cross-iteration), which it can beat by less than that share
BS_MIN_SHARE = 0.01
HERRING_NEAR = 0.02                               # Herring's bucket sizes within 2% count as equal: the larger wins
MEMORY_CLASSES = ("parameters", "gradients", "optimizer state", "activations", "workspace")
TIME_PARTS = ("compute", "recompute", "pipeline bubble", "tp comm", "pp comm", "dp sync", "optimizer")


@dataclass
class Candidate:
    """One point of the search space with its predicted figures (per device, per step)."""
    dp: int
    tp: int
    pp: int
    schedule: str | None = None           # None: the one-stage program (pp = 1)
    microbatches: int = 1
    zero: int = 0
    recompute: str = "none"
    sharding: str | None = None           # the tp mode (tp > 1)
    grad_sync: str | None = None          # a compression method the user allowed
    precision: str = "fp32"               # the compute dtype ("fp32": the model's own)
    offload: tuple = ()                   # ZeRO-Offload: ("optimizer",) or ("optimizer", "params")
    bucket_mb: float | None = None        # gradient bucket size (None: DDP's 25 MiB, or Herring's own choice)
    comm_schedule: str = "fifo"           # "bytescheduler": ByteScheduler's priority, pieces and credit
    budget_gb: float | None = None        # recompute="auto": its memory_budget_gb (the activations' room)
    step_s: float = 0.0
    peak_bytes: float = 0.0
    comm_bytes: float = 0.0
    memory: dict = field(default_factory=dict)      # class -> bytes at the peak
    time: dict = field(default_factory=dict)        # part -> seconds of the step
    fits: bool = True
    full: dict | None = None                        # the built program's estimate: step_s, peak_bytes, comm_bytes
    note: str = ""
    cross_iteration: bool | None = None             # ByteScheduler: whether its cheap cost kept cross-iteration

    def options(self) -> dict:
        """The Strategy keywords of this candidate."""
        kw = dict(dp=self.dp, tp=self.tp, pp=self.pp, microbatches=self.microbatches)
        if self.schedule is not None:
            kw["schedule"] = self.schedule
        if self.zero:
            kw["zero"] = self.zero
        if self.recompute != "none":
            kw["recompute"] = self.recompute
        if self.recompute == "auto" and self.budget_gb is not None:
            kw["memory_budget_gb"] = self.budget_gb
        if self.sharding is not None:
            kw["sharding"] = self.sharding
        if self.grad_sync is not None:
            kw["grad_sync"] = self.grad_sync
        if self.precision != "fp32":
            kw["precision"] = self.precision
        if self.offload:
            kw["offload"] = self.offload
        if self.bucket_mb is not None:
            kw["bucket_cap_mb"] = self.bucket_mb
        if self.comm_schedule != "fifo":
            kw["comm_schedule"] = self.comm_schedule
        return kw

    def strategy(self, fixed: dict | None = None) -> Strategy:
        return Strategy(**{**(fixed or {}), **self.options()})

    @property
    def family(self) -> str:
        """The mesh and its pipeline schedule: ``dp=4 x pp=2 (1f1b)``, ``dp=2 x tp=4``. The tp mode is not part of
        it: the cheap cost cannot tell Megatron's preset from Tofu's search, the finalists build both."""
        parts = [f"{k}={v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp)) if v > 1] or ["dp=1"]
        return " x ".join(parts) + (f" ({self.schedule})" if self.schedule else "")

    @property
    def label(self) -> str:
        """Everything but the mesh: ``m=4, zero=1, recompute=full``."""
        out = [f"sharding={self.sharding}"] if self.sharding else []
        out += [f"m={self.microbatches}"] + ([f"zero={self.zero}"] if self.zero else [])
        out += [f"recompute={self.recompute}" + (f"({self.budget_gb:.4g}GB)" if self.recompute == "auto" and
                                                   self.budget_gb is not None else "")] if self.recompute != "none" else []
        out += [f"grad_sync={self.grad_sync}"] if self.grad_sync else []
        out += [self.precision] if self.precision != "fp32" else []
        out += [f"offload={'+'.join(self.offload)}"] if self.offload else []
        out += [f"bucket={self.bucket_mb:g}MiB"] if self.bucket_mb is not None else []
        out += [self.comm_schedule] if self.comm_schedule != "fifo" else []
        return ", ".join(out)

    @property
    def predicted(self) -> tuple:
        """(step seconds, peak bytes, bytes sent): the built program's where it was built, else the cheap ones."""
        if self.full is not None:
            return self.full["step_s"], self.full["peak_bytes"], self.full["comm_bytes"]
        return self.step_s, self.peak_bytes, self.comm_bytes

    def __str__(self) -> str:
        return f"{self.family}, {self.label}"


class _Pricer:
    """Shared figures for pricing many candidates of one model on one cluster (cached link and schedule costs)."""

    def __init__(self, prof, cluster, global_batch: int, n_state: int, elem_bytes: int, profiles=None,
                 fixed: dict | None = None):
        self.prof, self.cluster, self.B = prof, cluster, global_batch
        self.n_state, self.elem = n_state, elem_bytes
        # every figure a candidate needs one of is the slowest rank's (synchronous training waits for it); memory
        # is checked against the smallest device (search.py)
        self.devs = rank_devices(cluster)
        self.profiles = profiles or {}           # compute dtype -> its profile (see profile_model(dtype=...))
        self.fixed = fixed or {}                 # the options every candidate gets (reduce_precision, ...)
        self.search_buckets = False              # choose each candidate's bucket size among BUCKETS_MB
        self.traced = True                       # the optimizer is traced (ByteScheduler's cross-iteration needs it)
        self.budget = float("inf")               # the bytes a plan may use per device (recompute="auto"'s room)
        self.auto_only = False                   # recompute is pinned to "auto": kept where it recomputes nothing
        self.budget_pin = None                   # Strategy.auto(memory_budget_gb=...): recompute="auto"'s budget
        # a float32 model on a GPU: its matmuls at the TF32 or the plain float32 rate (cost_models.compute.fp32_share)
        self.devs_fp32 = [replace(d, peak_flops=d.peak_flops * fp32_share(d)) if d.kind == "cuda" and elem_bytes == 4
                          else d for d in self.devs]
        self._comm: dict = {}
        self._shapes: dict = {}
        self._lines: dict = {}                   # cost_candidate's shared part, by what fixes it

    def time(self, prof, b: float, tp: int, precision: str) -> dict:
        """``prof.time`` on the slowest device of the cluster (the one whose forward and backward take longest)."""
        devs = self.devs_fp32 if precision == "fp32" else self.devs
        if len(devs) == 1:
            return prof.time(b, tp, devs[0])
        return max((prof.time(b, tp, d) for d in devs),
                   key=lambda t: sum(v for k, v in t.items() if k != "split_fwd"))

    def profile(self, precision: str):
        """The profile whose figures hold under ``precision`` (the model's own for "fp32")."""
        return self.profiles.get(precision, self.prof) if precision != "fp32" else self.prof

    def dp_sum(self, kind: str, nbytes: float, ranks: tuple, bucket_mb: float | None, last_bwd: float,
               hide: bool = True) -> tuple:
        """(exposed seconds, bytes sent) of summing ``nbytes`` of gradients over ``ranks`` in buckets of
        ``bucket_mb`` MiB (None: DDP's 25): one collective per bucket, issued as backward fills it, all hidden
        behind backward but the last bucket's (``hide=False``: one collective of it all after backward)."""
        key = ("dp_sum", kind, nbytes, ranks, bucket_mb, last_bwd, hide)
        got = self._comm.get(key)
        if got is not None:
            return got
        cap = (bucket_mb * 2**20) if bucket_mb is not None else BUCKET_BYTES
        n = max(1, -(-int(nbytes) // int(cap))) if nbytes > 0 and hide else 1
        each = self.comm(kind, nbytes / n, ranks)
        total = n * each.time_s
        exposed = max(total - last_bwd, each.time_s) if hide else total
        got = self._comm[key] = (exposed, n * each.wire_bytes)
        return got

    def bytescheduler(self, line: dict, scale: float, ranks: tuple, bucket_mb: float | None, t_opt: float,
                      cross_ok: bool) -> tuple:
        """``(seconds ByteScheduler's own simulation predicts over FIFO buckets, cross-iteration kept?)`` for a
        one-stage, one-microbatch step whose figures ``line`` holds, its gradients ``scale`` x the parameter bytes
        summed over ``ranks``. The timeline: forward runs the part before the blocks, the blocks, the part after;
        backward the reverse. Each block's gradients are one piece, made as backward leaves the block and needed
        as forward enters it; the parameters outside the blocks are made at the end of backward and needed first
        (a tied embedding's are). FIFO: those pieces packed in backward order into buckets of ``bucket_mb`` (DDP's
        25 MiB), all in flight, waited at the optimizer. ByteScheduler: priority by need, each credit the feature
        tries (``BS_CREDIT_FACTORS`` x the largest piece, and all of it), within the step and, where ``cross_ok``,
        carried into the next step's forward with early updates; cross-iteration only where over ``BS_CROSS_GAIN``
        faster (the feature's rule)."""
        key = ("bs", line["timeline"], scale, ranks, bucket_mb, t_opt, cross_ok)
        got = self._comm.get(key)
        if got is not None:
            return got
        tl = line["timeline"]
        pre_f, blk_f, post_f, pre_b, blk_b, post_b, n = tl
        t_fwd = pre_f + n * blk_f + post_f
        t_bwd = post_b + n * blk_b + pre_b
        blk = self.prof.block_param_bytes * scale
        rest = (self.prof.rest_param_bytes if n else self.prof.param_bytes) * scale
        groups = [(post_b + (n - i) * blk_b, pre_f + i * blk_f, blk) for i in range(n)] + [(t_bwd, 0.0, rest)]
        groups = [g for g in groups if g[2] > 0]
        groups.sort(key=lambda g: g[0])                       # backward order
        devs = self.devs
        issue = max(getattr(d, "collective_issue_s", 0.0) + getattr(d, "comm_cpu_s", 0.0) for d in devs)
        per_byte = max(getattr(d, "comm_cpu_per_byte", 0.0) for d in devs)
        comm_s = lambda nb: self.comm("all_reduce", nb, ranks).time_s      # noqa: E731
        cap = (bucket_mb * 2**20) if bucket_mb is not None else BUCKET_BYTES
        fifo, cur = [], None
        for ready, _, nb in groups:
            if cur is not None and cur[1] + nb <= cap:
                cur[0], cur[1] = ready, cur[1] + nb
            else:
                cur = [ready, nb]
                fifo.append(cur)
        fb = [BucketTiming(r, 0.0, [nb], i) for i, (r, nb) in enumerate(fifo)]
        total = sum(g[2] for g in groups)
        base = simulate_comm(fb, t_fwd, t_bwd, comm_s, int(total) + 1, False, t_opt, issue, per_byte).step_s
        order = sorted(range(len(groups)), key=lambda i: (groups[i][1], -i))
        prio = {i: k for k, i in enumerate(order)}
        bts = [BucketTiming(r, need, [int(nb)], prio[i]) for i, (r, need, nb) in enumerate(groups)]
        big = max(int(g[2]) for g in groups)
        credits = sorted({big * f for f in BS_CREDIT_FACTORS} | {sum(int(g[2]) for g in groups)})
        best = {}
        for cross in ((False, True) if cross_ok else (False,)):
            best[cross] = min(simulate_comm(bts, t_fwd, t_bwd, comm_s, cr, cross, t_opt, issue, per_byte,
                                            early=cross).step_s for cr in credits)
        cross = cross_ok and best[True] < best[False] * (1 - BS_CROSS_GAIN)
        got = self._comm[key] = (best[cross] - base, cross)
        return got

    def herring(self, nbytes: float, world: int, bucket_mb: float | None, last_bwd: float, rest: float) -> tuple:
        """``(exposed seconds, bytes sent, bucket MiB)`` of Herring's sums of ``nbytes`` of gradients over ``world``
        ranks, nodes of ``devices_per_node``: each bucket's chain (reduce-scatter in the node, all-reduce of its
        shard across nodes, all-gather in the node), one after another as backward makes the buckets, hidden behind
        backward but the last one's, and the issue of its two collectives more than an all-reduce per bucket. The
        bucket size: ``bucket_mb``, else as the feature tunes it (``plan_herring_buckets``): among
        ``HERRING_BUCKET_MB`` the largest whose step (``rest`` + the sum's exposed seconds) is within 2% of the
        least."""
        key = ("herring", round(nbytes), world, bucket_mb, round(last_bwd, 12), round(rest, 12))
        got = self._comm.get(key)
        if got is not None:
            return got
        per = self.cluster.devices_per_node
        node, cross = tuple(range(per)), tuple(range(0, world, per))
        issue = max(getattr(d, "collective_issue_s", 0.0) for d in self.devs)
        tried = {}
        for mb in ((bucket_mb,) if bucket_mb is not None else HERRING_BUCKET_MB):
            n = max(1, -(-int(nbytes) // int(mb * 2**20))) if nbytes > 0 else 1
            each, shard = nbytes / n, nbytes / n / per
            parts = (self.comm("reduce_scatter", each, node), self.comm("all_reduce", shard, cross),
                     self.comm("all_gather", shard, node))
            chain = sum(x.time_s for x in parts)
            tried[mb] = (max(n * chain - last_bwd, chain) + 2 * n * issue, n * sum(x.wire_bytes for x in parts))
        least = min(t for t, _ in tried.values())
        mb = max(m for m, (t, _) in tried.items() if rest + t <= (rest + least) * (1 + HERRING_NEAR))
        got = self._comm[key] = (*tried[mb], mb)
        return got

    def comm(self, kind: str, nbytes: float, ranks: tuple):
        key = (kind, round(nbytes), ranks)
        got = self._comm.get(key)
        if got is None:
            got = self._comm[key] = collective_cost(kind, nbytes, ranks, self.cluster)
        return got

    def shape(self, name: str, pp: int, m: int) -> tuple | None:
        """``(stages, makespan, most microbatches in flight on a rank)`` of schedule ``name`` over ``pp`` ranks and
        ``m`` microbatches with every stage as long as the slowest (the slowest sets the pace of the steady state):
        the makespan in units of one stage's forward + backward. None where the generator refuses ``(pp, m)``.
        :func:`schedule_shape` (closed forms, else the dry run), once per ``(name, pp, m)``."""
        key = (name, pp, m)
        if key not in self._shapes:
            self._shapes[key] = schedule_shape(name, pp, m)
        return self._shapes[key]


# The closed forms of the synchronous schedules' dry runs with equal stages (forward 1, backward 2; ZB-H1's backward
# split into I = W = 1): name -> (chunks per rank v, refused?, makespan in units of 3, most in flight on a rank).
# Each is the generator's own dry run (tests/test_auto_planner.py compares them over a grid of p and m):
# 1F1B (m + p - 1)(F + B), at most p microbatches in flight (stage 0); ZB-H1 m(F + I + W) + (p - 1)(F + I - W), p on
# every stage; interleaved v = 2 (m v + p - 1)(F + B) per chunk, rank 0 warming up with 2(p - 1) + (v - 1)p forwards.
_CLOSED = {
    "1f1b": (1, lambda p, m: m < p, lambda p, m: 3 * (m + p - 1), lambda p, m: p),
    "zb1p": (1, lambda p, m: m < p, lambda p, m: 3 * m + p - 1, lambda p, m: p),
    "interleaved": (2, lambda p, m: m < p or m % p != 0, lambda p, m: 3 * (2 * m + p - 1),
                    lambda p, m: min(2 * (p - 1) + p + 1, 2 * m)),
}


def schedule_shape(name: str, pp: int, m: int) -> tuple | None:
    """``(stages, makespan / (F + B), most microbatches in flight on a rank)`` of ``get_schedule(name, pp, m)``
    dry-run with every stage's forward 1 and backward 2, or None where the generator refuses ``(pp, m)``. The
    searched synchronous schedules by their closed forms (``_CLOSED``, the same figures the dry run gives), any
    other by building and dry-running it."""
    closed = _CLOSED.get(name)
    if closed is not None and pp >= 1 and m >= 1:
        v, refused, span, in_flight = closed
        if refused(pp, m):
            return None
        return pp * v, float(span(pp, m)) / 3, in_flight(pp, m)
    try:
        sched = get_schedule(name, pp, m)
    except ScheduleError:
        return None
    sim = simulate(sched)
    return sched.n_stages, sim.makespan / 3, max(sim.peak_activations_per_rank.values())


def rank_devices(cluster) -> list:
    """The distinct devices of ``cluster``'s worker ranks in rank order: ``[cluster.device]`` unless the cluster is
    heterogeneous (``ClusterSpec.heterogeneous``, one device per rank) or has stragglers (``slowdown``: each one's
    device slowed by its factor, ``ClusterSpec.as_heterogeneous``)."""
    if getattr(cluster, "slowdown", ()):
        cluster = cluster.as_heterogeneous()
    out: list = []
    for d in cluster.devices or (cluster.device,):
        if d not in out:
            out.append(d)
    return out


def bf16_supported(device) -> bool:
    """bf16 candidates are searched on GPUs with bfloat16 arithmetic (not on CPU devices, whose float64 and float32
    programs the tests compare to 1e-10, nor on the GPUs of ``NO_BF16``)."""
    return device.kind == "cuda" and not any(n in device.name for n in NO_BF16)


def _stage_split(prof, n_stages: int) -> dict:
    """Stage -> (blocks, holds the pre part, holds the post part), for the stages that differ: the first, the last
    and one of the middle ones (the others are like it, so the slowest and the heaviest stage are among these);
    without repeated blocks every stage gets an equal share of the whole (the balanced cut), so stage 0 stands
    for all."""
    if prof.n_blocks == 0:
        return {0: (0, True, True)}
    per = prof.n_blocks / n_stages
    return {s: (per, s == 0, s == n_stages - 1) for s in sorted({0, min(1, n_stages - 1), n_stages - 1})}


def _pipeline(c: Candidate, pr: _Pricer) -> dict | None:
    """The figures of ``c`` that its mesh, schedule, microbatches, recompute policy and precision fix (stage times,
    makespan, the heaviest stage's parameters and activations), shared by its ZeRO, offload and bucket variants;
    None where the schedule refuses the microbatch count."""
    prof = pr.profile(c.precision)
    b = pr.B / (c.dp * c.microbatches)
    t = pr.time(prof, b, c.tp, c.precision)
    sched = None
    n_stages = 1
    if c.pp > 1:
        sched = pr.shape(c.schedule, c.pp, c.microbatches)
        if sched is None:
            return None
        n_stages = sched[0]
    split = _stage_split(prof, n_stages)
    whole = prof.n_blocks == 0
    share = 1.0 / n_stages if whole else 1.0
    blk_f, blk_b = t[("block", "fwd")], t[("block", "bwd")]
    again = {"none": 0.0, "full": blk_f, "selective": blk_f - t["split_fwd"]["block"]}[c.recompute]
    if whole and c.recompute != "none":      # no blocks: the policy recomputes the whole forward (or its cheap ops)
        pre_f = t[("pre", "fwd")] + t[("post", "fwd")]
        again_whole = pre_f if c.recompute == "full" else pre_f - t["split_fwd"]["pre"] - t["split_fwd"]["post"]
    else:
        again_whole = 0.0
    width = c.dp * c.tp
    tp_ranks = tuple(range(c.tp))
    msg = prof.block_input(b) if prof.n_blocks else 0.0
    if c.tp > 1:
        if prof.n_blocks:
            ar = pr.comm("all_reduce", msg, tp_ranks).time_s
            tp_f_block = tp_b_block = 2 * ar
            tp_whole = 0.0
        else:
            tp_f_block = tp_b_block = 0.0
            tp_whole = sum(pr.comm("all_reduce", x, tp_ranks).time_s for x in prof.linear_pairs(b))
    else:
        tp_f_block = tp_b_block = tp_whole = 0.0
    p2p = pr.comm("send", msg or prof.largest(b) / 4, (0, width)).time_s if c.pp > 1 else 0.0
    F, B, comp, rec, tpc = {}, {}, 0.0, 0.0, 0.0
    for s, (nb, first, last) in split.items():
        f = nb * blk_f + (t[("pre", "fwd")] if first else 0) * (1 if not whole else share) \
            + (t[("post", "fwd")] if last else 0) * (1 if not whole else share)
        bw = nb * blk_b + (t[("pre", "bwd")] if first else 0) * (1 if not whole else share) \
            + (t[("post", "bwd")] if last else 0) * (1 if not whole else share)
        r = nb * again + again_whole * share
        tf = nb * tp_f_block + tp_whole * share
        tb = nb * tp_b_block + tp_whole * share
        F[s], B[s] = f + tf + p2p, bw + r + tb + p2p
        comp, rec, tpc = max(comp, f + bw), max(rec, r), max(tpc, tf + tb)
    m = c.microbatches
    if sched is None:
        makespan, in_flight = m * (F[0] + B[0]), 1
    else:
        makespan, in_flight = sched[1] * max(F[s] + B[s] for s in F), sched[2]
    # parameters of the heaviest stage (the parts outside the blocks counted on it), split by tp
    heavy = max(split.values(), key=lambda x: x[0])
    per_rank_stages = n_stages // c.pp
    stage_params = (heavy[0] * per_rank_stages * prof.block_param_bytes + prof.rest_param_bytes
                    if not whole else prof.param_bytes / c.pp) / c.tp
    saved = prof.saved(b, c.tp, c.recompute)
    blocks_on_rank = heavy[0] * per_rank_stages
    act_stage = (blocks_on_rank * saved["block"] + saved["pre"] + saved["post"]) if not whole else \
        (saved["pre"] + saved["post"]) / c.pp
    scale = in_flight / per_rank_stages if per_rank_stages > 1 else in_flight
    acts = act_stage * scale
    if c.pp > 1 and not whole:      # the embeddings' rank holds the most microbatches; the head's, one at a time
        blk = blocks_on_rank * saved["block"]
        acts = max((blk + saved["pre"]) * scale, blk * scale + saved["post"])
    if c.recompute == "full":
        acts += saved["one_block"] if prof.n_blocks else 0.0
    sent = []                          # bytes each rank sends for tp and for pp, added to the dp sum's in this order
    if c.tp > 1:
        n_ar = (4 * blocks_on_rank if prof.n_blocks else 2 * len(prof.linear_pairs(b)) / c.pp) * m
        sent.append(n_ar * pr.comm("all_reduce", msg if prof.n_blocks else max(prof.linear_pairs(b) or [0.0]),
                                   tp_ranks).wire_bytes)
    if c.pp > 1:
        sent.append(2 * m * per_rank_stages * (msg or prof.largest(b) / 4))
    k = m * per_rank_stages            # the stage passes a rank runs (interleaved: v per microbatch)
    busy = k * (comp + rec + tpc) + (0 if sched is None else 2 * k * p2p)
    timeline = None
    if sched is None and c.tp == 1:    # one stage: where each block's forward and backward fall (ByteScheduler)
        nb = split[0][0]
        timeline = (t[("pre", "fwd")], blk_f, t[("post", "fwd")], t[("pre", "bwd")] + again_whole,
                    blk_b + again, t[("post", "bwd")], int(nb)) if not whole else \
            (F[0], 0.0, 0.0, B[0], 0.0, 0.0, 0)
    return {"makespan": makespan, "last_bwd": B[max(B, key=B.get)], "stage_params": stage_params, "acts": acts,
            "timeline": timeline,
            "work": 2 * prof.largest(b), "per_rank_stages": per_rank_stages, "sent": sent, "prof": prof,
            "time": {"compute": k * comp, "recompute": k * rec, "tp comm": k * tpc,
                     "pp comm": 0.0 if sched is None else 2 * k * p2p,
                     "pipeline bubble": max(makespan - busy, 0.0)}}


AUTO_IS_NONE = "recompute='auto' recomputes nothing here: 'none' fits its budget"


def _auto_line(c: Candidate, pr: _Pricer, other: float) -> dict | str:
    """The figures of ``c`` (``recompute="auto"``) when its saved activations may take ``other`` bytes less than the
    memory budget (or the pinned ``memory_budget_gb``): on the lower convex hull of (activations, recompute time)
    through the policies none, selective and full, at that room. ``AUTO_IS_NONE`` where 'none' fits it; a note
    (str) where even the smallest policy's activations do not."""
    lines = {}
    for rc in ("none", "selective", "full"):
        key = (c.precision, c.dp, c.tp, c.pp, c.schedule, c.microbatches, rc)
        if key not in pr._lines:
            pr._lines[key] = _pipeline(replace(c, recompute=rc), pr)
        lines[rc] = pr._lines[key]
    pinned = pr.budget_pin
    c.budget_gb = pinned if pinned is not None else math.floor(max(pr.budget - other, 0.0) / 1e3) / 1e6
    room = c.budget_gb * 1e9
    none = lines["none"]
    if room >= none["acts"]:
        return AUTO_IS_NONE
    pts = sorted(lines.values(), key=lambda ln: -ln["acts"])      # most activations (least recompute) first
    hull = [pts[0]]
    for q in pts[1:]:
        if q["acts"] >= hull[-1]["acts"]:
            continue
        while len(hull) > 1:     # drop the last vertex while it lies above the segment from the one before it to q
            a, b = hull[-2], hull[-1]
            lean = lambda ln: ln["time"]["recompute"]     # noqa: E731
            if (lean(b) - lean(a)) * (a["acts"] - q["acts"]) >= (lean(q) - lean(a)) * (a["acts"] - b["acts"]):
                hull.pop()
            else:
                break
        hull.append(q)
    if room < hull[-1]["acts"]:
        return (f"recompute='auto' under a budget of {room / 1e9:.4g} GB: below the smallest policy's activations "
                f"({hull[-1]['acts'] / 1e9:.4g} GB, full recompute)")
    a, b = next((hull[i], hull[i + 1]) for i in range(len(hull) - 1) if hull[i + 1]["acts"] <= room)
    w = (a["acts"] - room) / (a["acts"] - b["acts"])
    mix = lambda x, y: x + w * (y - x)                    # noqa: E731
    out = dict(a)
    out.update(makespan=mix(a["makespan"], b["makespan"]), last_bwd=mix(a["last_bwd"], b["last_bwd"]), acts=room,
               work=max(a["work"], b["work"]), time={k: mix(a["time"][k], b["time"][k]) for k in a["time"]},
               timeline=None if a["timeline"] is None else tuple(mix(x, y) for x, y in zip(a["timeline"],
                                                                                         b["timeline"])))
    out["timeline"] = out["timeline"] and out["timeline"][:-1] + (a["timeline"][-1],)
    return out


def cost_candidate(c: Candidate, pr: _Pricer) -> Candidate:
    """Fill ``c``'s cheap figures; ``c.note`` says why it cannot run (then ``c.fits`` is False and its step is
    infinite). The part its ZeRO stage, offload and bucket size do not change is priced once (:func:`_pipeline`)."""
    rc = "none" if c.recompute == "auto" else c.recompute
    key = (c.precision, c.dp, c.tp, c.pp, c.schedule, c.microbatches, rc)
    if key not in pr._lines:
        pr._lines[key] = _pipeline(replace(c, recompute=rc) if rc != c.recompute else c, pr)
    line = pr._lines[key]
    if line is None:
        c.note = f"schedule {c.schedule} cannot run {c.microbatches} microbatches"
        c.fits, c.step_s = False, float("inf")
        return c
    prof, devs, m = line["prof"], pr.devs, c.microbatches
    stage_params, per_rank_stages = line["stage_params"], line["per_rank_stages"]
    grads = stage_params / (c.dp if c.zero >= 2 else 1)
    states = pr.n_state * stage_params / (c.dp if c.zero >= 1 else 1)
    chunk = stage_params / (c.dp if c.zero >= 1 else 1)         # the parameters this rank updates
    held = stage_params / (c.dp if c.zero == 3 else 1)
    gathered = 0.0
    if c.zero == 3:
        gathered = prof.block_param_bytes / c.tp if prof.n_blocks else stage_params * (1 - 1 / c.dp)
        held += gathered
    if "optimizer" in c.offload:       # the state (and the master chunk with ZeRO-1/2) on the host
        states = 0.0
    if "params" in c.offload:          # ZeRO-3's chunks on the host: only the gathered ones on the device
        held = gathered
    cbytes = COMPUTE_BYTES.get(c.precision)
    if cbytes:                         # the compute copy of the parameters a forward and backward read
        held += (stage_params / (c.dp if c.zero == 3 else 1) if "params" not in c.offload else gathered) \
            * cbytes / pr.elem
    if c.recompute == "auto":          # the activations' room under the budget decides what it recomputes
        got = _auto_line(c, pr, held + grads + states + line["work"])
        if got == AUTO_IS_NONE and not pr.auto_only:
            c.note, c.fits, c.step_s = got, False, float("inf")
            return c
        if isinstance(got, str) and got != AUTO_IS_NONE:
            c.memory = {"parameters": held, "gradients": grads, "optimizer state": states,
                        "activations": line["acts"], "workspace": line["work"]}
            c.peak_bytes = sum(c.memory.values())
            c.note, c.fits, c.step_s = got, False, float("inf")
            return c
        line = got if isinstance(got, dict) else line
    c.memory = {"parameters": held, "gradients": grads, "optimizer state": states, "activations": line["acts"],
                "workspace": line["work"]}
    c.peak_bytes = sum(c.memory.values())
    upd = chunk
    tensors = prof.param_tensors / (c.pp if c.pp > 1 else 1)
    if "optimizer" in c.offload:       # the gradient chunk down, the update on the host, the new chunk up
        opt_t = 2 * upd / HOST_LINK + upd * (3 + 2 * pr.n_state) / HOST_MEMORY
    else:
        okey = ("opt", upd, tensors)
        opt_t = pr._comm.get(okey)
        if opt_t is None:
            opt_t = pr._comm[okey] = max(
                upd * (3 + 2 * pr.n_state) / (d.mem_bandwidth * (d.efficiency or {}).get("memory", 1.0))
                + OPT_OPS_PER_TENSOR * tensors * getattr(d, "op_overhead_s", 0.0) for d in devs)
    # data parallelism: the heaviest stage's gradients over its dp ranks (tp index 0 of pipeline rank 0)
    sync_t, sent = 0.0, 0.0
    reduce_bytes = (cbytes if cbytes and pr.fixed.get("reduce_precision") == "compute" else pr.elem)
    g_bytes = stage_params * reduce_bytes / pr.elem * (0.5 if c.grad_sync == "bf16" and pr.elem == 4 else
                                                       0.25 if c.grad_sync == "bf16" else 1.0)
    if c.dp > 1:
        dp_ranks = tuple(d * c.tp for d in range(c.dp))
        last_bwd = line["last_bwd"]
        # all_gather's figure is the shard it sends. ZeRO-1 reduce-scatters once after backward; ZeRO-2 and 3 as the
        # buckets fill; the updated chunks are all-gathered after the update (ZeRO-3: before each use instead)
        kind = "all_reduce" if c.zero == 0 else "reduce_scatter"
        if pr.search_buckets and c.bucket_mb is None and c.zero != 1 and c.grad_sync != "herring" \
                and c.comm_schedule == "fifo":                         # DDP's 25 MiB unless another is faster
            pick = ("bucket", kind, g_bytes, dp_ranks, last_bwd)     # the same for every variant of a line
            if pick not in pr._comm:
                got = {bk: pr.dp_sum(kind, g_bytes, dp_ranks, bk, last_bwd) for bk in (None,) + BUCKETS_MB if bk != 25}
                pr._comm[pick] = min(got, key=lambda bk: (got[bk][0], bk is not None))
            c.bucket_mb = pr._comm[pick]
        if c.grad_sync == "herring":     # its own bucket size unless pinned (the feature tunes it likewise)
            sync_t, sent, _ = pr.herring(g_bytes, c.dp, c.bucket_mb, last_bwd, line["makespan"] + opt_t)
        elif c.comm_schedule == "bytescheduler":
            sync_t, sent = pr.dp_sum("all_reduce", g_bytes, dp_ranks, c.bucket_mb, last_bwd)
            c.cross_iteration = False
            if sync_t > BS_MIN_SHARE * (line["makespan"] + sync_t + opt_t):     # else nothing worth its simulation
                gain, c.cross_iteration = pr.bytescheduler(line, g_bytes / prof.param_bytes, dp_ranks, c.bucket_mb,
                                                           opt_t, pr.traced)
                sync_t = max(sync_t + gain, 0.0)
            if c.cross_iteration:        # the pieces carried into the step and out of it (estimate()'s figure)
                c.memory["gradients"] += 2 * grads
                c.peak_bytes += 2 * grads
        elif c.zero == 0:
            sync_t, sent = pr.dp_sum("all_reduce", g_bytes, dp_ranks, c.bucket_mb, last_bwd)
        else:
            rs_t, rs_sent = pr.dp_sum("reduce_scatter", g_bytes, dp_ranks, c.bucket_mb, last_bwd, hide=c.zero > 1)
            ag = pr.comm("all_gather", stage_params / c.dp, dp_ranks)
            sync_t = rs_t + (ag.time_s if c.zero < 3 else 0.0)
            sent = rs_sent + (ag.wire_bytes if c.zero < 3 else 0.0)
            if c.zero == 3:     # each stage's parameters gathered before its forward and again before its backward
                gathers = 2 * m * per_rank_stages
                sync_t += gathers * ag.time_s * ZERO3_EXPOSED
                sent += gathers * ag.wire_bytes
                if "params" in c.offload:      # each gather first brings the rank's chunk up from the host
                    sync_t += gathers * chunk / HOST_LINK
            sync_t += ZERO_OPS_PER_TENSOR * prof.param_tensors * max(getattr(d, "op_overhead_s", 0.0) for d in devs)
    for x in line["sent"]:
        sent += x
    c.step_s = line["makespan"] + sync_t + opt_t
    c.comm_bytes = sent
    c.time = {**line["time"], "dp sync": sync_t, "optimizer": opt_t}
    return c
