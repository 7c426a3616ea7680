"""Measure this machine and return a :class:`~fxpar.cluster.ClusterSpec` with its own figures.

    >>> spec = ClusterSpec.calibrate(world_size=2)          # about 10 s on a 2-core machine
    >>> spec, raw = calibrate(world_size=2, return_measurements=True)

``world_size`` processes are spawned (``torch.multiprocessing``, start method ``spawn``) and
joined in a gloo group on 127.0.0.1 at a free port (a socket bound to port 0). While all ranks
run at once, as they will in training, each times (with a barrier before each repetition; where there are
more threads in all ranks than cores, a loop's mean over 1 s of wall time on every rank at once instead,
:func:`_time_shared`, so that each rank measures its share of the cores as in training):

- a GraphModule of 200 tiny aten ops (views, slices, copies, adds: :func:`_mixed_ops_graph`) ->
  ``device.op_overhead_s`` (per-op dispatch cost);
- ``torch.mm`` on fp32 ``n x n`` matrices, cycling over 32 MiB of operand pairs so that each call reads them from
  memory as a step's matmuls do (:func:`_rotating`) -> ``device.peak_flops`` (efficiency ``matmul`` = 1);
- an fp32 ``add`` over 4M elements (12 bytes per element moved) -> ``device.mem_bandwidth``;
- softmax and layer_norm -> ``efficiency["softmax"]``, ``efficiency["norm"]``: the fraction of
  peak that makes the roofline of :mod:`cost_models.compute` give the measured time; likewise
  gelu (1M elements) -> ``efficiency["transcendental"]`` (erf, exp, tanh, ... pointwise ops), gelu_backward ->
  ``efficiency["transcendental_backward"]`` (their backward ops: 1.8-2x the forward's time per element), and
  causal scaled-dot-product attention (q, k, v of ``4 x 8 x 128 x 64``, a GPT-sized head; operands cycled as the
  matmul's) ->
  ``efficiency["attention"]`` (forward and backward);
- ``index_add_`` of 4096 rows of 32 at fresh random indices into a 200000 x 32 table -> ``device.index_row_s``, what
  it takes per row beyond its bytes at that bandwidth (ATen's CPU kernel adds the rows one by one, each a random
  access: 20-40 ns a row on a 2-core machine, 1.5-2x the bytes' time; :func:`index_row_overhead`);
- ``all_reduce`` of sizes 4 KiB .. 16 MiB (after a barrier each time);
- the *issue* of a small collective (two or more ranks; a functional ``all_reduce`` and an
  ``all_gather_into_tensor`` of 1 KiB after a barrier, timed from the call to its return, before the
  wait): the mean of the two medians is ``device.collective_issue_s``, the CPU a rank spends per
  collective a graph issues (gloo's work setup and small copies on the caller's thread; 90-220 µs on
  a 2-core machine);
- what a transfer takes from the compute it *overlaps* (:func:`_measure_overlap_cpu`: a block of matmuls and adds
  timed alone and with an all_reduce of 1 and 4 MiB in flight; the ranks' mean) -> ``device.comm_cpu_per_byte``
  where the ranks' threads fill the cores (gloo's threads and the kernel's socket and softirq work then run on
  the cores compute needs: 1.5-1.8 ms per MiB on a 2-core machine's loopback, where a blocking all_reduce takes
  0.8), with gloo's threads' own CPU per collective (:func:`_measure_comm_cpu`) -> ``device.comm_cpu_s``;
- small collectives *as a step issues them* (two or more ranks; :func:`_measure_in_step`): rounds of 20 tiny
  adds, a functional ``all_reduce`` (or ``all_gather_into_tensor``) of 1 KiB and its wait, back to back
  without a barrier, less the same rounds without the collective: what one costs inside a step, the ranks'
  skew and the wake-up of gloo's threads included, which a barrier before each one hides (on a 2-core
  machine 0.9-1.5 ms per all_reduce back to back against 0.4-0.6 ms after a barrier);
- ops *after a collective* (two or more ranks; :func:`_measure_cold_ops`): a graph of 20 kinds of training op
  (:func:`_training_ops_graph`) timed back to back and with a 1 KiB all_reduce issued and waited between calls;
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
import statistics
import time
from dataclasses import replace

import torch

from fxpar.cluster import ClusterSpec, LinkSpec
from fxpar.collectives import gloo_all_gather_into_tensor
from fxpar.host import COMM_THREAD_NAMES, raise_comm_threads, reuse_freed_memory

__all__ = ["calibrate", "fit_alpha_beta", "free_port", "in_step_alpha", "in_step_slots", "late_recv_overhead",
           "index_row_overhead", "link_spec", "measure_link", "op_overhead", "overlap_per_byte", "pin_rank", "rank_cores"]

_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)


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


def late_recv_overhead(waits, nbytes: int, link) -> float:
    """``device.late_recv_s``: the mean of the measured late-receive waits less the transfer the cost
    model already charges for the message (``link.latency + nbytes / link.bandwidth``), at least 0."""
    if not waits:
        return 0.0
    return max(0.0, sum(waits) / len(waits) - (link.latency + nbytes / link.bandwidth))


_MIN_SECONDS = 0.25     # time each measurement over at least this long: a short burst of other load
_MAX_REPS = 400         # on a shared host then moves the median of many samples, not the figure


def _time(fn, reps: int, sync=None, min_seconds: float = _MIN_SECONDS) -> float:
    """Median seconds of ``fn`` over at least ``reps`` runs and ``min_seconds`` of running. With
    ``sync`` (a barrier), every rank runs the same number of repetitions: rank 0 decides."""
    fn()
    out, start = [], time.perf_counter()
    while True:
        if sync is not None:
            sync()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
        more = len(out) < reps or (time.perf_counter() - start < min_seconds and len(out) < _MAX_REPS)
        if sync is not None:
            more = _agree(more)
        if not more:
            return statistics.median(out)


def _agree(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (so all ranks repeat a collective equally often)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0])
    dist.broadcast(t, 0)
    return bool(t.item())


_TINY_OPS = 200
_SDPA_SHAPE = (4, 8, 128, 64)        # batch, heads, sequence, head dim


def _adds_graph(n: int) -> torch.fx.GraphModule:
    """A GraphModule of ``n`` chained aten adds, run as fxpar runs its graphs."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = x
    for _ in range(n):
        y = g.call_function(torch.ops.aten.add.Tensor, (y, x))
    g.output(y)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _mixed_ops_graph(n: int) -> torch.fx.GraphModule:
    """A GraphModule of about ``n`` aten ops on 8-element tensors in the mix a training graph is made of: views
    and slices, a transpose, copies into fresh buffers, elementwise ops, a concatenation (rounds of eleven)."""
    aten = torch.ops.aten
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = x
    for _ in range(max(1, n // 10)):
        a = g.call_function(aten.view.default, (y, [2, 4]))
        b = g.call_function(aten.slice.Tensor, (a, 0, 0, 2))
        c = g.call_function(aten.clone.default, (g.call_function(aten.t.default, (b,)),))
        d = g.call_function(aten.reshape.default, (g.call_function(aten.mul.Tensor, (c, 2.0)), [-1]))
        e = g.call_function(aten.slice.Tensor, (g.call_function(aten.cat.default, ([d, d],)), 0, 0, 8))
        buf = g.call_function(aten.empty.memory_format, ([8],), {"dtype": torch.float32})
        y = g.call_function(aten.copy_.default, (buf, g.call_function(aten.add.Tensor, (e, x))))
    g.output(y)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _tiny_ops_graph():
    """About :data:`_TINY_OPS` aten ops on 8-element tensors (:func:`_mixed_ops_graph`), and how many: the per-op
    dispatch cost (the compute is negligible). The mix, not adds alone: on a 2-core machine an add costs 2.2 µs
    and the mix 3.1 µs an op, and a graph's views, slices and copies are most of its nodes."""
    gm, t = _mixed_ops_graph(_TINY_OPS), torch.ones(8)
    n = sum(1 for node in gm.graph.nodes if node.op == "call_function")
    return lambda: gm(t), n


def op_overhead(reps: int = 5) -> float:
    """Seconds one tiny aten op of :func:`_mixed_ops_graph` costs in this process, alone (the unit in which
    ``fxpar.runtime.measure.action_overhead_s`` is scaled to the ranks' per-op cost)."""
    ops, n_ops = _tiny_ops_graph()
    return _time(ops, reps) / n_ops


def _time_shared(fn, seconds: float = 4 * _MIN_SECONDS) -> float:
    """Seconds per call of ``fn`` where the ranks share the cores: every rank (from a barrier, all at once) calls
    it for ``seconds`` of wall time; the wall time over the calls. One call is often shorter than the
    scheduler's time slice and then runs on a core of its own, so the median of single calls reports a core per
    rank (4 ranks on 2 cores: 58-125 GFLOP/s per rank from run to run); the loop's mean is each rank's share."""
    import torch.distributed as dist
    fn()
    if dist.is_initialized():
        dist.barrier()
    count, start = 0, time.perf_counter()
    while True:
        fn()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / count


_COLD_BYTES = 32 << 20      # more than a core's L2 (1-2 MiB on current x86 and Arm server cores) by far


def _sets(nbytes: int) -> int:
    """How many operand sets of ``nbytes`` each :func:`_rotating` cycles over so that they fill ``_COLD_BYTES``."""
    return max(2, -(-_COLD_BYTES // max(1, nbytes)))


def _rotating(sets: list, fn):
    """A call that runs ``fn`` on the next of ``sets`` each time: a training step's matmuls and attention read
    operands that other ops have since pushed out of the core's caches, and the same small operands timed back to
    back stay in L2 (a 512x512 fp32 matmul on one core here: 157 GFLOP/s on one pair, 148 cycling over 16; the
    4-layer GPT's mm and addmm ran 8-10% slower in the step than the calibration's figure had them)."""
    i = [0]

    def call():
        j = i[0] % len(sets)
        i[0] += 1
        return fn(sets[j])
    return call


def _measure_compute(reps: int, sync=None, shared: bool = False) -> dict:
    """The compute figures, each the median of single calls (a barrier before each with ``sync``), or where the
    ranks share the cores (``shared``) each a loop's mean over the same wall time on every rank (:func:`_time_shared`)."""
    def timed(fn) -> float:
        return _time_shared(fn) if shared else _time(fn, reps, sync)
    n = 512
    mm = _rotating([(torch.randn(n, n), torch.randn(n, n)) for _ in range(_sets(2 * n * n * 4))],
                   lambda ab: torch.mm(*ab))
    x, y = torch.randn(4 << 20), torch.randn(4 << 20)
    s = torch.randn(1024, 1024)
    t_mm = timed(mm)
    t_add = timed(lambda: torch.add(x, y))
    t_sm = timed(lambda: torch.softmax(s, -1))
    t_ln = timed(lambda: torch.nn.functional.layer_norm(s, (1024,)))
    ops, n_ops = _tiny_ops_graph()
    t_op = timed(ops) / n_ops
    t_gelu = timed(lambda: torch.nn.functional.gelu(s))
    t_gelu_bwd = timed(lambda: torch.ops.aten.gelu_backward(s, s))
    qkv = [tuple(torch.randn(*_SDPA_SHAPE) for _ in range(3))
           for _ in range(_sets(3 * 4 * torch.Size(_SDPA_SHAPE).numel()))]
    t_sdpa = timed(_rotating(qkv, lambda t: torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True)))
    table = torch.zeros(*_INDEX_TABLE)
    rows = torch.randn(_INDEX_ROWS, _INDEX_TABLE[1])
    ids = [torch.randint(0, _INDEX_TABLE[0], (_INDEX_ROWS,)) for _ in range(64)]
    t_index = timed(_rotating(ids, lambda i: table.index_add_(0, i, rows)))
    return {"gelu_s": t_gelu, "gelu_backward_s": t_gelu_bwd, "sdpa_s": t_sdpa,"op_overhead_s": t_op, "mm_flops": 2 * n**3 / t_mm, "add_bytes_per_s": 12 * x.numel() / t_add,
            "softmax_s": t_sm, "layer_norm_s": t_ln, "softmax_numel": s.numel(), "index_add_s": t_index}


_INDEX_TABLE = (200_000, 32)     # 24.4 MiB: larger than a core's caches, as an embedding table is
_INDEX_ROWS = 4096


def index_row_overhead(compute: dict) -> float:
    """``device.index_row_s``: the measured ``index_add_`` of :data:`_INDEX_ROWS` rows at fresh random indices into a
    :data:`_INDEX_TABLE` table, less what its bytes take at the measured bandwidth (the cost model's roofline,
    ``cost_models.compute``: each row read and written, the source read, the indices), per row."""
    r, d = _INDEX_ROWS, _INDEX_TABLE[1]
    nbytes = 3 * r * d * 4 + r * 8
    return max(0.0, compute["index_add_s"] - nbytes / compute["add_bytes_per_s"]) / r


_LATE_BYTES = 128 << 10
_LATE_REPS = 40


def _busy(seconds: float, a, b) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        torch.mm(a, b)


def _measure_late_recv(rank: int, reps: int = _LATE_REPS, nbytes: int = _LATE_BYTES) -> list:
    """Rank 1's receive waits (seconds) for messages rank 0 posted 5 ms earlier and then computed
    past (ranks 0 and 1 only; other ranks just join the barriers)."""
    import torch.distributed as dist
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    t = torch.ones(nbytes // 4)
    out = []
    for _ in range(reps):
        dist.barrier()
        if rank == 0:
            work = dist.isend(t, 1)
            _busy(0.02, a, b)
            work.wait()
        elif rank == 1:
            _busy(0.005, a, b)
            start = time.perf_counter()
            dist.recv(t, 0)
            out.append(time.perf_counter() - start)
    return out


_ISSUE_NUMEL = 256
_ISSUE_REPS = 30


def _runtime_gather():
    """The all-gather op fxpar's runtime runs on this process's default group: under gloo
    ``fxpar.collectives.gloo_all_gather_into_tensor`` (``lower_for_backend``: the functional op can corrupt the
    heap beside another collective in flight, as the in-step pair below has it), else the functional op."""
    import torch.distributed as dist
    if "gloo" in str(dist.get_backend()):
        return gloo_all_gather_into_tensor
    return torch.ops._c10d_functional.all_gather_into_tensor.default


def _measure_issue(reps: int = _ISSUE_REPS) -> float:
    """Seconds from calling a functional collective to its return (its handle), before the wait: the mean of
    the medians for ``all_reduce`` and ``all_gather_into_tensor`` of 1 KiB. Every rank runs ``reps`` of each."""
    import torch.distributed as dist
    name, n = dist.group.WORLD.group_name, dist.get_world_size()
    ops = torch.ops._c10d_functional
    t = torch.ones(_ISSUE_NUMEL)
    gather = _runtime_gather()
    issue = {"all_reduce": lambda: ops.all_reduce(t, "sum", name),
             "all_gather": lambda: gather(t, n, name)}
    medians = []
    for fn in issue.values():
        out = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            handle = fn()
            out.append(time.perf_counter() - start)
            ops.wait_tensor(handle)
        medians.append(statistics.median(out))
    return sum(medians) / len(medians)


_STEP_OPS = 20          # tiny adds between two collectives of the in-step loop (a step's ops around its syncs)
_STEP_LOOP = 20         # collectives per timed loop


def _measure_in_step(reps: int = 5, min_seconds: float = _MIN_SECONDS) -> dict:
    """Seconds one small collective (1 KiB) adds to a step, issued and waited as a graph does it: a loop of
    ``_STEP_LOOP`` rounds of {``_STEP_OPS`` tiny adds, the functional collective, its ``wait_tensor``}, no
    barrier inside, less the same loop without the collective; the median over at least ``reps`` loops and
    ``min_seconds``, for ``all_reduce`` and ``all_gather_into_tensor``. Back to back, each collective pays what
    a barrier before it would hide: the ranks' skew and the wake-up of gloo's threads on each side.
    ``pair``: the two in flight together, as a step issues them (the all_reduce issued, the adds, the
    all_gather issued and waited, then the all_reduce waited), less the loop with twice the adds: whether a
    rank progresses two collectives at once (:func:`in_step_slots`)."""
    import torch.distributed as dist
    name, n = dist.group.WORLD.group_name, dist.get_world_size()
    ops = torch.ops._c10d_functional
    gm = _adds_graph(_STEP_OPS)
    t = torch.ones(_ISSUE_NUMEL)
    gather = _runtime_gather()
    ar = lambda: ops.all_reduce(t, "sum", name)                  # noqa: E731
    ag = lambda: gather(t, n, name)                              # noqa: E731

    def pair():
        a = ar()
        gm(t)
        ops.wait_tensor(ag())
        ops.wait_tensor(a)
    rounds = {None: None, "all_reduce": lambda: ops.wait_tensor(ar()), "all_gather": lambda: ops.wait_tensor(ag()),
              "adds2": lambda: gm(t), "pair": pair}
    out = {}
    for key, fn in rounds.items():
        def loop():
            for _ in range(_STEP_LOOP):
                gm(t)
                if fn is not None:
                    fn()
        out[key] = _time(loop, reps, dist.barrier, min_seconds) / _STEP_LOOP
    base, base2 = out.pop(None), out.pop("adds2")
    return {k: max(0.0, v - (base2 if k == "pair" else base)) for k, v in out.items()}


_COLD_ROUNDS = 600      # rounds of the cold-op measurement (each rank the same count: the collectives must match)


def _training_ops_graph():
    """A GraphModule of 20 kinds of aten op a training step is made of, one of each, on tensors of 8-64 elements
    (an embedding lookup and its ``index_add_`` update, ``addmm``, ``mm``, ``_log_softmax``, reductions, views,
    copies, a ``_foreach`` op, ...), its arguments, and how many kinds: the unit of :func:`_measure_cold_ops`."""
    aten = torch.ops.aten
    g = torch.fx.Graph()
    x, w, ids, tab, acc = (g.placeholder(name) for name in ("x", "w", "ids", "tab", "acc"))

    def op(target, *args, **kwargs):
        return g.call_function(target, args, kwargs)
    e = op(aten.embedding.default, tab, ids)                                   # [8, 8]
    m = op(aten.mean.dim, e, [0])                                              # [8]
    v = op(aten.view.default, m, [1, 8])
    logits = op(aten.addmm.default, x, v, w)
    ls = op(aten._log_softmax.default, logits, 1, False)
    s = op(aten.sum.dim_IntList, ls, [0], True)
    mm = op(aten.mm.default, v, op(aten.t.default, w))
    d = op(aten.div.Scalar, op(aten.expand.default, op(aten.unsqueeze.default, mm, 0), [2, 1, 8]), 8)
    flat = op(aten.slice.Tensor, op(aten.reshape.default, op(aten.clone.default, d), [-1]), 0, 0, 8)
    buf = op(aten.empty.memory_format, [16], dtype=torch.float32)
    cp = op(aten.copy_.default, buf, op(aten.cat.default, [flat, flat]))
    fm = op(aten._foreach_mul.Scalar, [cp, m], 0.5)
    acc2 = op(aten.index_add_.default, acc, 0, ids, op(aten.mul.Tensor, e, 0.1))   # into a buffer, not the table:
    g.output((fm, s, acc2))                                                        # the rows read stay the same
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    args = (torch.randn(1, 8), torch.randn(8, 8), torch.randint(0, 1000, (8,)), torch.randn(1000, 8),
            torch.zeros(1000, 8))
    kinds = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    return gm, args, len(kinds)


def _measure_cold_ops(rounds: int = _COLD_ROUNDS) -> dict:
    """``device.cold_op_s``: what a kind of op costs more the first time it runs after the rank issued or waited on a
    collective. Every rank runs :func:`_training_ops_graph` ``rounds`` times back to back, then ``rounds`` times
    with a functional ``all_reduce`` of 1 KiB issued and waited between calls, timing only the graph; the
    difference of the medians (the first sixth of each dropped) over the graph's kinds of op. On a 2-core machine a
    step's ops take 2-3x as long right after its collectives as back to back (3-6 µs more per kind): what the core
    ran meanwhile (gloo's threads, the kernel's network path, other processes while it idled) has pushed the ops'
    code and data out of its caches."""
    import torch.distributed as dist
    name = dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional
    gm, args, kinds = _training_ops_graph()
    t = torch.ones(_ISSUE_NUMEL)
    medians = {}
    for key in ("back_to_back", "after_collective"):
        dist.barrier()
        out = []
        for _ in range(rounds):
            start = time.perf_counter()
            gm(*args)
            out.append(time.perf_counter() - start)
            if key == "after_collective":
                ops.wait_tensor(ops.all_reduce(t, "sum", name))
        medians[key] = statistics.median(out[rounds // 6:])
    return {**medians, "kinds": kinds,
            "cold_op_s": max(0.0, medians["after_collective"] - medians["back_to_back"]) / kinds}


def in_step_slots(in_step: dict, issue_s: float) -> int | None:
    """How many small collectives a rank progresses at once, as :func:`_measure_in_step` found. With issue
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
    :func:`_measure_in_step` measured: ``issue_s + 2(N-1)α`` for the all_reduce and ``issue_s + (N-1)α`` for
    the all_gather (:mod:`cost_models.comm`); the mean of the two."""
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1}
    got = [max(0.0, t - issue_s) / steps[k] for k, t in in_step.items() if k in steps and n > 1]
    return sum(got) / len(got) if got else 0.0


def _comm_threads_cpu() -> float | None:
    """CPU seconds this process's gloo threads (:data:`COMM_THREAD_NAMES`) have run so far, from
    ``/proc/self/task/*/schedstat`` (Linux); None where there is none."""
    task, total, found = "/proc/self/task", 0.0, False
    if not os.path.isdir(task):
        return None
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/comm") as f:
                if f.read().strip() not in COMM_THREAD_NAMES:
                    continue
            with open(f"{task}/{tid}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
            found = True
        except (OSError, ValueError, IndexError):
            continue
    return total if found else None


_CPU_SIZES = ((1 << 10, 60), (4 << 20, 8))     # (bytes, all_reduces back to back)


def _measure_comm_cpu() -> dict | None:
    """CPU seconds gloo's threads spend on this rank per ``all_reduce``: a run of blocking all_reduces of each of
    :data:`_CPU_SIZES` back to back, the threads' CPU over their count (after the barrier that starts it), fitted
    as ``per_collective_s + per_byte_s · bytes`` through the two sizes. On a 2-core machine about 0.1 ms and
    1 ms per MiB. None where ``/proc`` does not say."""
    import torch.distributed as dist
    got = []
    for size, k in _CPU_SIZES:
        t = torch.ones(size // 4)
        dist.all_reduce(t)
        dist.barrier()
        c0 = _comm_threads_cpu()
        if c0 is None:
            return None
        for _ in range(k):
            dist.all_reduce(t)
        got.append((size, (_comm_threads_cpu() - c0) / k))
    (s0, t0), (s1, t1) = got
    per_byte = max(0.0, (t1 - t0) / (s1 - s0))
    return {"per_collective_s": max(0.0, t0 - per_byte * s0), "per_byte_s": per_byte, "samples": got}


_OVERLAP_SIZES = (1 << 20, 4 << 20)   # bytes of the all_reduce that overlaps the compute block


def _compute_block(n: int, a, b, x, y, z) -> None:
    """A step's kind of compute: ``n`` rounds of a matmul and a memory-bound add (about 1.5 ms a round here)."""
    for _ in range(n):
        torch.mm(a, b)
        torch.add(x, y, out=z)


def _measure_overlap_cpu(sizes=_OVERLAP_SIZES, reps: int = 5) -> dict:
    """What a transfer takes from the compute it overlaps, per collective and per byte: on every rank at once, a
    block of compute (:func:`_compute_block`, three times as long as a blocking ``all_reduce`` of the size, 20 ms at
    least) timed alone and, right after, with a functional ``all_reduce`` issued before it and waited after it; the
    median of the differences over ``reps`` pairs, per size, fitted as ``per_collective_s + per_byte_s · bytes``.
    Where the ranks' threads fill the cores, gloo's threads and the kernel's network path (sockets, softirq: not
    all of it on gloo's threads, :func:`_measure_comm_cpu`) run on the cores the compute needs: on a 2-core machine
    about 1.5 ms per MiB on loopback and 2-3 ms per MiB through a tbf-capped veth, where a blocking all_reduce takes
    0.8 ms per MiB uncapped. ``hidden``: the median wait after a block (near zero: the block hid the transfer)."""
    import torch.distributed as dist
    name = dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional
    if dist.get_world_size() * torch.get_num_threads() > (os.cpu_count() or 1):
        reps *= 3                  # more ranks than cores: each block's time depends on the others' time slices
    a, b = torch.randn(256, 256), torch.randn(256, 1024)
    x, y, z = torch.randn(1 << 20), torch.randn(1 << 20), torch.empty(1 << 20)
    start = time.perf_counter()
    _compute_block(4, a, b, x, y, z)
    per_round = torch.tensor((time.perf_counter() - start) / 4)
    dist.all_reduce(per_round, op=dist.ReduceOp.MAX)        # every rank runs the same blocks
    got, waits = [], []
    for size in sizes:
        buf = torch.ones(size // 4)
        blocking = _time(lambda: dist.all_reduce(buf), 3, dist.barrier, 0.0)
        rounds = torch.tensor(max(0.02, 3 * blocking) / float(per_round)).ceil().int()
        dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
        diffs = []
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            _compute_block(int(rounds), a, b, x, y, z)
            alone = time.perf_counter() - t
            dist.barrier()
            t = time.perf_counter()
            handle = ops.all_reduce(buf, "sum", name)
            _compute_block(int(rounds), a, b, x, y, z)
            w = time.perf_counter()
            ops.wait_tensor(handle)
            end = time.perf_counter()
            diffs.append((end - t) - alone)
            waits.append(end - w)
        added = torch.tensor(statistics.median(diffs), dtype=torch.float64)
        dist.all_reduce(added)                             # every rank's figure: the mean of the ranks' medians
        got.append((size, float(added) / dist.get_world_size()))
    (s0, t0), (s1, t1) = got
    per_byte = max(0.0, (t1 - t0) / (s1 - s0))
    return {"per_collective_s": max(0.0, t0 - per_byte * s0), "per_byte_s": per_byte, "samples": got,
            "hidden": statistics.median(waits)}


def measure_link(sizes=_SIZES, reps: int = 5, in_step_seconds: float = _MIN_SECONDS) -> dict:
    """Every rank of the current (gloo) process group calls it: the link's raw figures -- ``all_reduce``:
    (bytes, seconds) of a blocking all_reduce per size, after a barrier each time; ``collective_issue_s``
    (:func:`_measure_issue`); ``in_step``: seconds per small collective back to back (:func:`_measure_in_step`).
    :func:`link_spec` turns them into a :class:`LinkSpec`. The netns harness of ``benchmarks/`` runs it on
    ranks on either side of its capped veth. ``in_step_seconds``: the least time each in-step loop runs."""
    import torch.distributed as dist
    comm = []
    for size in sizes:
        t = torch.ones(size // 4)
        comm.append((size, _time(lambda: dist.all_reduce(t), reps, dist.barrier)))
    cold = _measure_cold_ops()
    measured = _measure_in_step(reps, in_step_seconds)
    # the in-step loops' adds after each collective ran cold (one kind of op; twice a round in the pair's loop),
    # which the simulator charges on the ops (cold_op_s), not on the collective
    c = cold["cold_op_s"]
    in_step = {k: max(0.0, v - (2 if k == "pair" else 1) * c) for k, v in measured.items()}
    return {"all_reduce": comm, "collective_issue_s": _measure_issue(), "cold_ops": cold, "cold_op_s": c,
            "in_step": in_step, "in_step_measured": measured, "comm_cpu": _measure_comm_cpu(),
            "overlap_cpu": _measure_overlap_cpu(reps=reps)}


def overlap_per_byte(raw: dict) -> float:
    """``DeviceSpec.comm_cpu_per_byte`` from :func:`measure_link`'s figures: what a transfer took from the compute it
    overlapped, per byte (:func:`_measure_overlap_cpu`); gloo's threads' own CPU per byte where that was not measured."""
    over, cpu = raw.get("overlap_cpu"), raw.get("comm_cpu")
    return over["per_byte_s"] if over else cpu["per_byte_s"] if cpu else 0.0


def link_spec(raw: dict, n: int) -> LinkSpec:
    """The :class:`LinkSpec` of :func:`measure_link`'s figures on ``n`` ranks: the bandwidth from the slope of
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
        # more ranks than cores: each figure a loop's mean over the same wall time on every rank (_time_shared), so
        # every rank's loop runs beside the others' as in training (a barrier before each call staggers them, and a
        # single call fits in a time slice: either way a rank times its ops as if alone -- 23-125 GFLOP/s per rank
        # from run to run with 4 ranks on 2 cores)
        shared = world_size * torch.get_num_threads() > (os.cpu_count() or 1)
        compute = _measure_compute(reps, None if shared else dist.barrier, shared)
        dist.barrier()
        link = measure_link(sizes, reps)
        late = _measure_late_recv(rank)
        if rank == 1:
            queue.put({"late_recv": late})
        if rank == 0:
            queue.put({"compute": compute, "threads": torch.get_num_threads(), **link})
    finally:
        dist.destroy_process_group()


def calibrate(world_size: int = 2, sizes=_SIZES, reps: int = 5, return_measurements: bool = False,
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
        raw = {"compute": _measure_compute(reps), "all_reduce": []}
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
        b, h, s_, d = _SDPA_SHAPE
        eff["transcendental"] = min(1.0, numel / (peak * c["gelu_s"]))
        if "gelu_backward_s" in c:
            eff["transcendental_backward"] = min(1.0, numel / (peak * c["gelu_backward_s"]))
        eff["attention"] = min(1.0, 4 * b * h * s_ * s_ * d / (peak * c["sdpa_s"]))
    device = replace(base.device, peak_flops=peak, mem_bandwidth=bw, efficiency=eff,
                     op_overhead_s=c.get("op_overhead_s", base.device.op_overhead_s),
                     index_row_s=index_row_overhead(c) if "index_add_s" in c else 0.0)
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
        raw["late_recv_s"] = late_recv_overhead(raw["late_recv"], _LATE_BYTES, spec.intra_node)
        spec = replace(spec, device=replace(spec.device, late_recv_s=raw["late_recv_s"]))
    return (spec, raw) if return_measurements else spec
