"""Measure this machine and return a :class:`~fxpar.cluster.ClusterSpec` with its own figures.

    >>> spec = ClusterSpec.calibrate(world_size=2)          # about 10 s on a 2-core machine
    >>> spec, raw = calibrate(world_size=2, return_measurements=True)

What each rank times is in :mod:`fxpar.tools.probes`; this module spawns the ranks and fits their figures.

``world_size`` processes are spawned (``torch.multiprocessing``, start method ``spawn``) and
joined in a gloo group on 127.0.0.1 at a free port (a socket bound to port 0). While all ranks
run at once, as they will in training, each times (with a barrier before each repetition; where there are
more threads in all ranks than cores, a loop's mean over 1 s of wall time on every rank at once instead,
:func:`~fxpar.tools.probes.time_shared`, so that each rank measures its share of the cores as in training):

- a GraphModule of 200 tiny aten ops (views, slices, copies, adds: :func:`~fxpar.tools.probes._mixed_ops_graph`) ->
  ``device.op_overhead_s`` (per-op dispatch cost);
- ``torch.mm`` on fp32 ``n x n`` matrices, cycling over 32 MiB of operand pairs so that each call reads them from
  memory as a step's matmuls do (:func:`~fxpar.tools.probes._rotating`) -> ``device.peak_flops`` (efficiency ``matmul`` = 1);
- an fp32 ``add`` over 4M elements (12 bytes per element moved) -> ``device.mem_bandwidth``;
- softmax and layer_norm -> ``efficiency["softmax"]``, ``efficiency["norm"]``: the fraction of
  peak that makes the roofline of :mod:`cost_models.compute` give the measured time; likewise
  gelu (1M elements) -> ``efficiency["transcendental"]`` (erf, exp, tanh, ... pointwise ops), gelu_backward ->
  ``efficiency["transcendental_backward"]`` (their backward ops: 1.8-2x the forward's time per element), and
  causal scaled-dot-product attention (q, k, v of ``4 x 8 x 128 x 64``, a GPT-sized head; operands cycled as the
  matmul's) ->
  ``efficiency["attention"]`` (forward and backward);
- a low-rank factor's matmuls (:func:`~fxpar.tools.probes.narrow_matmuls`: ``bmm`` of 2 x 512 x 2048 and 2 x 2048 x
  512 matrices by a 2-column factor, and their transposes: PowerSGD's ``P = M Q`` and ``Q = M^T P`` on a
  transformer MLP's weights) -> ``efficiency["matmul_narrow"]``: CPU kernels run such matmuls, whose output has a
  few columns, at 1-3% of a square matmul's FLOP rate (a compressed bucket sum's matmuls are priced at it:
  ``cost_models.compute.inner_compute``);
- one op of each class that runs element by element (:func:`~fxpar.tools.probes.selection_probes`, on 2^22 values:
  ``topk`` of the 1%, ``searchsorted`` among 4 levels, a look-up ``levels[ids]``, ``randperm``, ``rand``, a ``where``
  over a nearly constant mask) -> ``efficiency["topk"]``, ``["search"]``, ``["gather"]``, ``["randperm"]``,
  ``["random"]``, ``["select"]``
  (:func:`selection_efficiency`: the fraction of peak at which the class's FLOPs, ``cost_models.compute``'s rule, take
  the measured time). On this 2-core machine, one thread per rank, CPU time under other load, against a matmul's 65-70
  GFLOP/s: ``topk`` 1.4 ns per ``n log2 k`` (efficiency about 0.01), ``searchsorted`` 4 ns per ``n log2(levels + 1)``
  (0.004), the look-up 3 ns a value (0.005), ``randperm`` 35 ns a value (0.0004: a random access per value into a
  table larger than the caches), ``rand`` 3.6 ns a value (0.004), ``where`` 0.7 ns a value (0.017; comparisons and
  ``scatter`` are priced at it too): 2-60x what their bytes take at the measured
  bandwidth. A compressed bucket sum's TopK selection, its quantizers' level search and look-ups, and the draws its
  method makes on the host (``Method.host_inputs``: RandomK's permutations, the quantizers' uniforms) are priced at
  them;
- ``index_add_`` of 4096 rows of 32 at fresh random indices into a 200000 x 32 table -> ``device.index_row_s``, what
  it takes per row beyond its bytes at that bandwidth (ATen's CPU kernel adds the rows one by one, each a random
  access: 20-40 ns a row on a 2-core machine, 1.5-2x the bytes' time; :func:`index_row_overhead`);
- where the ranks' threads outnumber the cores, the process CPU seconds over the wall seconds of those shared loops
  (at most 1), the ranks' mean -> ``device.core_share``: the share of a core a rank's compute runs on (about
  cores / ranks on an idle machine, less under other load; 1 where the ranks have cores of their own), and the
  machine's cores -> ``device.host_cores``: where the ranks outnumber them, the cost model prices a rank computing
  while fewer of them compute at its larger share (``cost_models.simulate.CoreSharing``);
- ``all_reduce`` of sizes 4 KiB .. 16 MiB (after a barrier each time);
- the *issue* of a small collective (two or more ranks; a functional ``all_reduce`` and an
  ``all_gather_into_tensor`` of 1 KiB after a barrier, timed from the call to its return, before the
  wait): the mean of the two medians is ``device.collective_issue_s``, the CPU a rank spends per
  collective a graph issues (gloo's work setup and small copies on the caller's thread; 90-220 µs on
  a 2-core machine);
- what a transfer takes from the compute it *overlaps* (:func:`~fxpar.tools.probes._measure_overlap_cpu`: a block of matmuls and adds
  timed alone and with an all_reduce of 1 and 4 MiB in flight; the ranks' mean) -> ``device.comm_cpu_per_byte``
  where the ranks' threads fill the cores (gloo's threads and the kernel's socket and softirq work then run on
  the cores compute needs: 1.5-1.8 ms per MiB on a 2-core machine's loopback, where a blocking all_reduce takes
  0.8), with gloo's threads' own CPU per collective (:func:`~fxpar.tools.probes._measure_comm_cpu`) -> ``device.comm_cpu_s``;
- small collectives *as a step issues them* (two or more ranks; :func:`~fxpar.tools.probes._measure_in_step`): rounds of 20 tiny
  adds, a functional ``all_reduce`` (or ``all_gather_into_tensor``) of 1 KiB and its wait, back to back
  without a barrier, less the same rounds without the collective: what one costs inside a step, the ranks'
  skew and the wake-up of gloo's threads included, which a barrier before each one hides (on a 2-core
  machine 0.9-1.5 ms per all_reduce back to back against 0.4-0.6 ms after a barrier);
- ops *after a collective* (two or more ranks; :func:`~fxpar.tools.probes._measure_cold_ops`): a graph of 20 kinds of training op
  (:func:`~fxpar.tools.probes._training_ops_graph`) timed back to back and with a 1 KiB all_reduce issued and waited between calls;
  the difference over the kinds is ``device.cold_op_s``, what an op costs more the first time its kind runs after
  the rank's communication (3-6 µs on a 2-core machine, where the ops run 2-3x as long right after a collective:
  what ran on the core meanwhile pushed their code and data out of its caches); the in-step loops above have their
  adds' share taken off (``raw["in_step_measured"]`` keeps what was timed);
- a *late receive* (two or more ranks): rank 0 posts an ``isend`` of 128 KiB (a pipeline
  activation of this size class) to rank 1 and goes on computing (matmuls, 20 ms); rank 1
  computes 5 ms, then receives. The receive's wait, averaged (the mean: idle time adds up,
  and the wait is heavy-tailed, a median hides it) over ``late_reps`` repeats, less the
  message's own transfer time, is ``device.late_recv_s``: on CPU ranks that share cores,
  gloo finishes a write the receiver was not yet reading on the sender's CPU, which must be
  scheduled beside the sender's compute (0.2-13 ms per receive on a 2-core machine).

Each figure is the median over at least ``reps`` runs and at least 0.25 s of running, so that a
burst of other load on a shared host moves a few samples rather than the figure.

The all_reduce times are fitted by least squares to ``T(S) = a + b·S`` and read as the ring
model ``T = 2(N-1)α + 2(N-1)/N · S/B`` (Patarasuk & Yuan 2009), so ``B = 2(N-1) / (N·b)``; α is
taken from the small collectives in a step (:func:`in_step_alpha`: the model's issue + ``2(N-1)α``
for the all_reduce and issue + ``(N-1)α`` for the all_gather equal to what was measured), not from
the fit's intercept ``a / (2(N-1))`` (kept as ``raw["alpha_fit"]``), which the large sizes decide and
which came out 66, 437 and 729 µs in three runs within an hour here. Both become ``intra_node``
(:func:`measure_link` and :func:`link_spec`, which the netns harness of ``benchmarks/`` also uses to
measure its veth). Each rank uses ``cores // world_size``
threads so ranks do not fight for cores.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import replace

import torch

from fxpar.cluster import ClusterSpec, LinkSpec
from fxpar.host import raise_comm_threads, reuse_freed_memory
from cost_models.compute import op_cost
from fxpar.tools.probes import (INDEX_ROWS, INDEX_TABLE, LATE_BYTES, NARROW_SHAPE, SDPA_SHAPE, SIZES,
                                measure_compute, measure_late_recv, measure_link, selection_probes)

__all__ = ["calibrate", "fit_alpha_beta", "free_port", "in_step_alpha", "in_step_slots", "late_recv_overhead",
           "index_row_overhead", "selection_efficiency", "link_spec", "overlap_per_byte", "pin_rank", "rank_cores"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit_alpha_beta(sizes, times, n: int) -> tuple[float, float]:
    """(α seconds, B bytes/s) of the ring all_reduce model fitted to (size, seconds) pairs."""
    k = len(sizes)
    mx, my = sum(sizes) / k, sum(times) / k
    sxx = sum((x - mx) ** 2 for x in sizes)
    b = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx if sxx else 0.0
    a = my - b * mx
    b = max(b, 1e-15)
    a = max(a, 0.0)
    steps = max(1, 2 * (n - 1))
    return a / steps, steps / n / b if n > 1 else 1.0 / b


def selection_efficiency(cls: str, seconds: float, peak: float) -> float:
    """``efficiency[cls]`` of an op class ``cost_models.compute`` prices per element (``SELECTION_CLASSES``): the
    fraction of ``peak`` at which that class's FLOPs (its rule, on the probe's op: :func:`~fxpar.tools.probes.
    selection_probes`) take the measured ``seconds``."""
    target, args, call = selection_probes()[cls]
    flops = float(op_cost(target, args, call()).flops)
    return min(1.0, flops / (peak * seconds))


def late_recv_overhead(waits, nbytes: int, link) -> float:
    """``device.late_recv_s``: the mean of the measured late-receive waits less the transfer the cost
    model already charges for the message (``link.latency + nbytes / link.bandwidth``), at least 0."""
    if not waits:
        return 0.0
    return max(0.0, sum(waits) / len(waits) - (link.latency + nbytes / link.bandwidth))


def index_row_overhead(compute: dict) -> float:
    """``device.index_row_s``: the measured ``index_add_`` of :data:`~fxpar.tools.probes.INDEX_ROWS` rows at fresh random indices into a
    :data:`~fxpar.tools.probes.INDEX_TABLE` table, less what its bytes take at the measured bandwidth (the cost model's roofline,
    ``cost_models.compute``: each row read and written, the source read, the indices), per row."""
    r, d = INDEX_ROWS, INDEX_TABLE[1]
    nbytes = 3 * r * d * 4 + r * 8
    return max(0.0, compute["index_add_s"] - nbytes / compute["add_bytes_per_s"]) / r


def in_step_slots(in_step: dict, issue_s: float) -> int | None:
    """How many small collectives a rank progresses at once, as :func:`~fxpar.tools.probes._measure_in_step` found. With issue
    ``i`` on the rank's thread and the rest on the link, the simulator puts the ``pair`` (all_reduce issued,
    then the all_gather issued and waited) at ``max(ar, i + ag)`` with two slots (gloo's two worker threads,
    ``cost_models.comm.GLOO_THREADS``: the transfers overlap) and at ``max(2i, ar) + ag - i`` with one (the
    all_gather's transfer waits for the all_reduce's); the nearer to the measured pair wins, two on a tie.
    Where the ranks' threads fill the cores, a small collective's time is CPU work (thread hand-offs, socket
    calls), which two at once share: one slot; where it is waiting (for a wake-up, for the peer), they overlap.
    None when ``pair`` was not measured."""
    if not {"pair", "all_reduce", "all_gather"} <= set(in_step):
        return None
    ar, ag, pair, i = in_step["all_reduce"], in_step["all_gather"], in_step["pair"], issue_s
    two, one = max(ar, i + ag), max(2 * i, ar) + ag - i
    return 2 if abs(pair - two) <= abs(pair - one) else 1


def in_step_alpha(in_step: dict, issue_s: float, n: int) -> float:
    """The ring's per-step latency α that makes the cost model's small collectives take what
    :func:`~fxpar.tools.probes._measure_in_step` measured: ``issue_s + 2(N-1)α`` for the all_reduce and ``issue_s + (N-1)α`` for
    the all_gather (:mod:`cost_models.comm`); the mean of the two."""
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1}
    got = [max(0.0, t - issue_s) / steps[k] for k, t in in_step.items() if k in steps and n > 1]
    return sum(got) / len(got) if got else 0.0


def overlap_per_byte(raw: dict) -> float:
    """``DeviceSpec.comm_cpu_per_byte`` from :func:`~fxpar.tools.probes.measure_link`'s figures: what a transfer took from the compute it
    overlapped, per byte (:func:`~fxpar.tools.probes._measure_overlap_cpu`); gloo's threads' own CPU per byte where that was not measured."""
    over, cpu = raw.get("overlap_cpu"), raw.get("comm_cpu")
    return over["per_byte_s"] if over else cpu["per_byte_s"] if cpu else 0.0


def link_spec(raw: dict, n: int) -> LinkSpec:
    """The :class:`LinkSpec` of :func:`~fxpar.tools.probes.measure_link`'s figures on ``n`` ranks: the bandwidth from the slope of
    the ring fit over the sizes (:func:`fit_alpha_beta`), the latency α as a step sees it (:func:`in_step_alpha`)
    when measured, else the fit's intercept (written into ``raw`` as ``alpha``, ``alpha_fit``, ``bandwidth``)."""
    sizes, times = zip(*raw["all_reduce"])
    alpha, beta = fit_alpha_beta(sizes, times, n)
    raw["alpha_fit"], raw["bandwidth"] = alpha, beta
    if raw.get("in_step"):     # α as a step sees it (small collectives back to back), not the fit's intercept
        alpha = in_step_alpha(raw["in_step"], raw.get("collective_issue_s", 0.0), n)
    raw["alpha"] = alpha
    return LinkSpec(beta, alpha)


def rank_cores(rank: int, world: int, cores: int | None = None) -> set:
    """The cores rank ``rank`` of ``world`` is pinned to when ranks are pinned: the machine's cores cut into
    ``world`` equal runs (rank r gets the r-th), or core ``r % cores`` when there are more ranks than cores.
    Unpinned, a 2-core machine moves a 2 ms step between 2.1 and 4.4 ms from run to run (the scheduler puts
    both ranks, and gloo's threads, on one core or not); pinned, 2.29-2.41 ms in four runs."""
    cores = cores or os.cpu_count() or 1
    if world > cores:
        return {rank % cores}
    k = cores // world
    return set(range(rank * k, (rank + 1) * k))


def pin_rank(rank: int, world: int) -> None:
    """Pin this process (and the threads it starts) to :func:`rank_cores`; nothing where the OS cannot."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, rank_cores(rank, world))


def _worker(rank, world_size, port, sizes, reps, queue, threads=None, pin=False, comm_priority=False):
    import torch.distributed as dist
    reuse_freed_memory()                 # as fxpar's ranks run (ClusterSpec.host_memory_reuse, on by default)
    if pin:
        pin_rank(rank, world_size)
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    dist.barrier()                       # the group's threads are up (and have named themselves)
    if comm_priority and raise_comm_threads() is None:     # the same machine: every rank is refused alike
        if rank == 0:
            queue.put({"comm_priority_refused": True})
        dist.destroy_process_group()
        return
    try:
        # more ranks than cores: each figure a loop's mean over the same wall time on every rank (time_shared), so
        # every rank's loop runs beside the others' as in training (a barrier before each call staggers them, and a
        # single call fits in a time slice: either way a rank times its ops as if alone -- 23-125 GFLOP/s per rank
        # from run to run with 4 ranks on 2 cores)
        shared = world_size * torch.get_num_threads() > (os.cpu_count() or 1)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        compute = measure_compute(reps, None if shared else dist.barrier, shared)
        # the share of a core each rank's compute ran on (DeviceSpec.core_share): its CPU seconds over the wall
        # seconds of the shared loops, the ranks' mean; a core of its own where they do not share
        share = torch.tensor([min(1.0, (time.process_time() - cpu0) / (time.perf_counter() - wall0)) if shared
                              else 1.0], dtype=torch.float64)
        dist.all_reduce(share)
        compute["core_share"] = float(share) / world_size
        dist.barrier()
        link = measure_link(sizes, reps)
        late = measure_late_recv(rank)
        if rank == 1:
            queue.put({"late_recv": late})
        if rank == 0:
            queue.put({"compute": compute, "threads": torch.get_num_threads(), **link})
    finally:
        dist.destroy_process_group()


def _usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or ``taskset`` narrows), else the
    machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):          # no affinity on this platform
        return os.cpu_count() or 0


def calibrate(world_size: int = 2, sizes=SIZES, reps: int = 5, return_measurements: bool = False,
              threads: int | None = None, pin: bool = False, comm_priority: bool = False):
    """Measure ``world_size`` local gloo ranks; a ClusterSpec (and the raw figures if asked).

    ``threads``: torch's intra-op threads per rank while measuring (default: this machine's cores split
    evenly over the ranks); set it to what the ranks of the run being planned will use. ``pin``: each rank
    pinned to its own cores (:func:`rank_cores`), for runs whose ranks are pinned alike (the netns harness's).
    ``comm_priority``: the ranks' gloo threads under SCHED_FIFO (``fxpar.host.raise_comm_threads``) while measuring,
    and the spec says so (``ClusterSpec.comm_priority``: the runtime then does the same); a ValueError where
    the OS refuses it."""
    import torch.multiprocessing as mp
    base = ClusterSpec.local(world_size)
    if world_size == 1:
        raw = {"compute": measure_compute(reps), "all_reduce": []}
    else:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        mp.start_processes(_worker, args=(world_size, free_port(), tuple(sizes), reps, queue, threads, pin,
                                          comm_priority),
                           nprocs=world_size, join=True, start_method="spawn")
        raw = {}
        while not queue.empty():
            raw.update(queue.get())
        if raw.get("comm_priority_refused"):
            raise ValueError("ClusterSpec.calibrate(comm_priority=True): this process may not put gloo's threads "
                             "under SCHED_FIFO (it needs root or CAP_SYS_NICE, on Linux). Run as a user who may, or "
                             "calibrate (and run) with comm_priority=False.")
    c = raw["compute"]
    peak, bw = c["mm_flops"], c["add_bytes_per_s"]
    numel = c["softmax_numel"]
    eff = {"matmul": 1.0, "conv": 1.0, "attention": 1.0, "elementwise": 1.0, "memory": 1.0,
           # roofline: flops/(peak*eff) = measured time; 5 FLOPs/element as cost_models.compute counts
           "softmax": min(1.0, 5 * numel / (peak * c["softmax_s"])),
           "norm": min(1.0, 5 * numel / (peak * c["layer_norm_s"]))}
    if "gelu_s" in c:                      # 1 FLOP per element; attention 4·b·h·s²·d FLOPs (cost_models.compute)
        b, h, s_, d = SDPA_SHAPE
        eff["transcendental"] = min(1.0, numel / (peak * c["gelu_s"]))
        if "gelu_backward_s" in c:
            eff["transcendental_backward"] = min(1.0, numel / (peak * c["gelu_backward_s"]))
        eff["attention"] = min(1.0, 4 * b * h * s_ * s_ * d / (peak * c["sdpa_s"]))
    if "matmul_narrow_s" in c:             # four matmuls of 2·k·n·m·r FLOPs (M Q and M^T P, two orientations)
        k, n_, m_, r = NARROW_SHAPE
        eff["matmul_narrow"] = min(1.0, 4 * 2 * k * n_ * m_ * r / (peak * c["matmul_narrow_s"]))
    for cls, t in c.get("selection_s", {}).items():
        eff[cls] = selection_efficiency(cls, t, peak)
    device = replace(base.device, peak_flops=peak, mem_bandwidth=bw, efficiency=eff,
                     op_overhead_s=c.get("op_overhead_s", base.device.op_overhead_s),
                     index_row_s=index_row_overhead(c) if "index_add_s" in c else 0.0,
                     core_share=min(1.0, max(1e-3, c.get("core_share", 1.0))), host_cores=_usable_cores())
    spec = replace(base, device=device, comm_priority=bool(comm_priority))
    if raw["all_reduce"]:
        spec = replace(spec, intra_node=link_spec(raw, world_size))
    if raw.get("collective_issue_s"):
        spec = replace(spec, device=replace(spec.device, collective_issue_s=raw["collective_issue_s"]))
    if raw.get("cold_op_s"):
        spec = replace(spec, device=replace(spec.device, cold_op_s=raw["cold_op_s"]))
    cpu, over = raw.get("comm_cpu"), raw.get("overlap_cpu")
    if (cpu or over) and world_size * raw.get("threads", 1) >= (os.cpu_count() or 1):
        # the ranks' threads fill the cores: what gloo's threads run per collective, and what a transfer takes from
        # the compute it overlaps per byte, are compute's time (DeviceSpec.comm_cpu_s, comm_cpu_per_byte)
        spec = replace(spec, device=replace(spec.device, comm_cpu_s=cpu["per_collective_s"] if cpu else 0.0,
                                            comm_cpu_per_byte=overlap_per_byte(raw)))
    slots = in_step_slots(raw.get("in_step") or {}, raw.get("collective_issue_s", 0.0))
    if slots:
        raw["collective_slots"] = slots
        spec = replace(spec, device=replace(spec.device, collective_slots=slots))
    if raw.get("late_recv"):
        raw["late_recv_s"] = late_recv_overhead(raw["late_recv"], LATE_BYTES, spec.intra_node)
        spec = replace(spec, device=replace(spec.device, late_recv_s=raw["late_recv_s"]))
    return (spec, raw) if return_measurements else spec
