"""What each rank of the calibration times: compute (matmul, bandwidth, per-op dispatch, softmax, norms, gelu,
attention, ``index_add_``), and, in a gloo group, the link (all_reduce by size, a collective's issue, small collectives
as a step issues them, ops after a collective, gloo's threads' CPU, what a transfer takes from overlapped compute, a
late receive). :mod:`fxpar.tools.calibrate` spawns the ranks and turns these figures into a ClusterSpec; the netns
harness of ``benchmarks/`` calls :func:`measure_link` on ranks it starts itself.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from fxpar.collectives import gloo_all_gather_into_tensor
from fxpar.host import COMM_THREAD_NAMES

__all__ = ["INDEX_ROWS", "INDEX_TABLE", "LATE_BYTES", "NARROW_SHAPE", "SDPA_SHAPE", "SELECT_LEVELS", "SELECT_NUMEL",
           "narrow_matmuls", "selection_probes", "SIZES",
           "measure_compute", "measure_late_recv", "measure_link", "op_overhead", "time_shared"]


_MIN_SECONDS = 0.25     # time each measurement over at least this long: a short burst of other load
_MAX_REPS = 400         # on a shared host then moves the median of many samples, not the figure
SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)


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
SDPA_SHAPE = (4, 8, 128, 64)        # batch, heads, sequence, head dim


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
    ``fxpar.tools.runtime_cost.action_overhead_s`` is scaled to the ranks' per-op cost)."""
    ops, n_ops = _tiny_ops_graph()
    return _time(ops, reps) / n_ops


def time_shared(fn, seconds: float = 4 * _MIN_SECONDS) -> float:
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


def measure_compute(reps: int, sync=None, shared: bool = False) -> dict:
    """The compute figures, each the median of single calls (a barrier before each with ``sync``), or where the
    ranks share the cores (``shared``) each a loop's mean over the same wall time on every rank (:func:`time_shared`)."""
    def timed(fn) -> float:
        return time_shared(fn) if shared else _time(fn, reps, sync)
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
    qkv = [tuple(torch.randn(*SDPA_SHAPE) for _ in range(3))
           for _ in range(_sets(3 * 4 * torch.Size(SDPA_SHAPE).numel()))]
    t_sdpa = timed(_rotating(qkv, lambda t: torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True)))
    table = torch.zeros(*INDEX_TABLE)
    rows = torch.randn(INDEX_ROWS, INDEX_TABLE[1])
    ids = [torch.randint(0, INDEX_TABLE[0], (INDEX_ROWS,)) for _ in range(64)]
    t_index = timed(_rotating(ids, lambda i: table.index_add_(0, i, rows)))
    t_narrow = timed(narrow_matmuls())
    t_select = {cls: timed(fn) for cls, (_, _, fn) in selection_probes().items()}
    return {"matmul_narrow_s": t_narrow, "selection_s": t_select,
            "gelu_s": t_gelu, "gelu_backward_s": t_gelu_bwd, "sdpa_s": t_sdpa,"op_overhead_s": t_op, "mm_flops": 2 * n**3 / t_mm, "add_bytes_per_s": 12 * x.numel() / t_add,
            "softmax_s": t_sm, "layer_norm_s": t_ln, "softmax_numel": s.numel(), "index_add_s": t_index}


SELECT_NUMEL = 1 << 22     # a gradient bucket's size class (a 25 MB bucket holds 6.5M float32 values)
SELECT_LEVELS = 4          # a 3-bit quantizer's levels, exponential (NUQSGD's, ALQ's and AMQ's start): 0, 1/4, 1/2, 1


def selection_probes() -> dict:
    """``{op class: (aten op, args, call)}``: one op of each class ``cost_models.compute`` prices per element
    (``SELECTION_CLASSES``), on :data:`SELECT_NUMEL` values as a compressed bucket sum runs them -- the 1% largest
    (``topk``), each value's level among :data:`SELECT_LEVELS` (``searchsorted``: a value's magnitude over its chunk
    of 1024's norm, as a quantizer searches; the time depends on where the values fall: levels that split them, as
    4-bit NUQSGD's 2^-6 .. 2^-4 do, take 2-3x as long, a branch mispredicted per value), the level's value
    (``x[ids]``), a random permutation (``randperm``), uniform draws (``rand``), each from a generator of its
    own, and a select over a nearly constant mask (``where``: the values within 3 standard deviations, 99.7%, else
    0; a mask that flips at random costs up to 5x as much)."""
    aten = torch.ops.aten
    n = SELECT_NUMEL
    x = torch.randn(n)
    chunks = x.view(-1, 1024).abs()     # a quantizer's search: magnitudes over their chunk's norm, exponential levels
    r = (chunks / torch.linalg.vector_norm(chunks, dim=1, keepdim=True)).reshape(-1)
    levels = torch.cat([torch.zeros(1), 2.0 ** torch.arange(2 - SELECT_LEVELS, 1.0)])
    ids = torch.randint(0, SELECT_LEVELS, (n,))
    gen = torch.Generator().manual_seed(0)
    inside, zero = x.abs() < 3, torch.zeros(())
    return {"topk": (aten.topk.default, [x, n // 100], lambda: torch.topk(x, n // 100)),
            "search": (aten.searchsorted.Tensor, [levels, r], lambda: torch.searchsorted(levels, r, right=True)),
            "gather": (aten.index.Tensor, [levels, [ids]], lambda: levels[ids]),
            "randperm": (aten.randperm.default, [n], lambda: torch.randperm(n, generator=gen)),
            "random": (aten.rand.default, [[n]], lambda: torch.rand(n, generator=gen)),
            "select": (aten.where.self, [inside, x, zero], lambda: torch.where(inside, x, zero))}


NARROW_SHAPE = (2, 512, 2048, 2)    # k, n, m, r: PowerSGD at rank 2 on a width-512 MLP's two weights (k of each)


def narrow_matmuls():
    """One call: a low-rank factor's matmuls, PowerSGD's ``P = M Q`` and ``Q = M^T P`` (``bmm``; output ``r``
    columns), on a batch of ``k`` ``n x m`` matrices and one of ``k`` ``m x n`` (a transformer MLP's two weights:
    CPU kernels run the two orientations at different rates), cycled over :func:`_rotating` sets;
    ``4 * 2 * k * n * m * r`` FLOPs in all."""
    k, n, m, r = NARROW_SHAPE

    def one(ms):
        for a in ms:
            torch.bmm(a, torch.ones(k, a.shape[2], r))
            torch.bmm(a.transpose(1, 2), torch.ones(k, a.shape[1], r))
    return _rotating([(torch.randn(k, n, m), torch.randn(k, m, n)) for _ in range(_sets(2 * k * n * m * 4))], one)
INDEX_TABLE = (200_000, 32)     # 24.4 MiB: larger than a core's caches, as an embedding table is
INDEX_ROWS = 4096
LATE_BYTES = 128 << 10
_LATE_REPS = 40


def _busy(seconds: float, a, b) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        torch.mm(a, b)


def measure_late_recv(rank: int, reps: int = _LATE_REPS, nbytes: int = LATE_BYTES) -> list:
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


def measure_link(sizes=SIZES, reps: int = 5, in_step_seconds: float = _MIN_SECONDS) -> dict:
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
