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

from dataclasses import dataclass, field, replace

from cost_models.comm import collective_cost
from cost_models.compute import fp32_share
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
    bucket_mb: float | None = None        # gradient bucket size (None: DDP's 25 MiB)
    step_s: float = 0.0
    peak_bytes: float = 0.0
    comm_bytes: float = 0.0
    memory: dict = field(default_factory=dict)      # class -> bytes at the peak
    time: dict = field(default_factory=dict)        # part -> seconds of the step
    fits: bool = True
    full: dict | None = None                        # the built program's estimate: step_s, peak_bytes, comm_bytes
    note: str = ""

    def options(self) -> dict:
        """The Strategy keywords of this candidate."""
        kw = dict(dp=self.dp, tp=self.tp, pp=self.pp, microbatches=self.microbatches)
        if self.schedule is not None:
            kw["schedule"] = self.schedule
        if self.zero:
            kw["zero"] = self.zero
        if self.recompute != "none":
            kw["recompute"] = self.recompute
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
        out += [f"recompute={self.recompute}"] if self.recompute != "none" else []
        out += [f"grad_sync={self.grad_sync}"] if self.grad_sync else []
        out += [self.precision] if self.precision != "fp32" else []
        out += [f"offload={'+'.join(self.offload)}"] if self.offload else []
        out += [f"bucket={self.bucket_mb:g}MiB"] if self.bucket_mb is not None else []
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
        cap = (bucket_mb * 2**20) if bucket_mb is not None else BUCKET_BYTES
        n = max(1, -(-int(nbytes) // int(cap))) if nbytes > 0 and hide else 1
        each = self.comm(kind, nbytes / n, ranks)
        total = n * each.time_s
        exposed = max(total - last_bwd, each.time_s) if hide else total
        return exposed, n * each.wire_bytes

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
    return {"makespan": makespan, "last_bwd": B[max(B, key=B.get)], "stage_params": stage_params, "acts": acts,
            "work": 2 * prof.largest(b), "per_rank_stages": per_rank_stages, "sent": sent, "prof": prof,
            "time": {"compute": k * comp, "recompute": k * rec, "tp comm": k * tpc,
                     "pp comm": 0.0 if sched is None else 2 * k * p2p,
                     "pipeline bubble": max(makespan - busy, 0.0)}}


def cost_candidate(c: Candidate, pr: _Pricer) -> Candidate:
    """Fill ``c``'s cheap figures; ``c.note`` says why it cannot run (then ``c.fits`` is False and its step is
    infinite). The part its ZeRO stage, offload and bucket size do not change is priced once (:func:`_pipeline`)."""
    key = (c.precision, c.dp, c.tp, c.pp, c.schedule, c.microbatches, c.recompute)
    if key not in pr._lines:
        pr._lines[key] = _pipeline(c, pr)
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
    c.memory = {"parameters": held, "gradients": grads, "optimizer state": states, "activations": line["acts"],
                "workspace": line["work"]}
    c.peak_bytes = sum(c.memory.values())
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
        if pr.search_buckets and c.bucket_mb is None and c.zero != 1:   # DDP's 25 MiB unless another is faster
            got = {bk: pr.dp_sum(kind, g_bytes, dp_ranks, bk, last_bwd) for bk in (None,) + BUCKETS_MB if bk != 25}
            c.bucket_mb = min(got, key=lambda bk: (got[bk][0], bk is not None))
        if c.zero == 0:
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
    upd = chunk
    tensors = prof.param_tensors / (c.pp if c.pp > 1 else 1)
    if "optimizer" in c.offload:       # the gradient chunk down, the update on the host, the new chunk up
        opt_t = 2 * upd / HOST_LINK + upd * (3 + 2 * pr.n_state) / HOST_MEMORY
    else:
        opt_t = max(upd * (3 + 2 * pr.n_state) / (d.mem_bandwidth * (d.efficiency or {}).get("memory", 1.0))
                    + OPT_OPS_PER_TENSOR * tensors * getattr(d, "op_overhead_s", 0.0) for d in devs)
    c.step_s = line["makespan"] + sync_t + opt_t
    c.comm_bytes = sent
    c.time = {**line["time"], "dp sync": sync_t, "optimizer": opt_t}
    return c
