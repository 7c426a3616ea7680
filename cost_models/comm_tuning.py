"""ByteScheduler's decisions, simulated: the static issue plan of gradient pieces, its step time, tuning.

ByteScheduler (Peng et al., SOSP'19) sends the gradient pieces of a training step in priority order
(the layer the next forward needs first goes first), in pieces of at most ``partition`` bytes, with at
most ``credit`` bytes in flight: "the next piece goes when one completes". A compiled step has no
scheduler thread, so the plan is made ahead: this module simulates the step on one rank with an
α–β link (``comm_s(nbytes)``: one all_reduce, from :mod:`cost_models.comm`) and the compute times of
the captured graph, and writes down what the rank does at each event of the step:

* ``("ready", b)``: bucket ``b``'s gradients are made (in backward). Pieces whose estimated end has
  passed (with a margin of a quarter of their duration) are waited (free), then queued pieces are issued,
  highest priority first, while credit allows.
  A bucket on a group several pipeline stages share (a tied parameter's, ``eager``; under cross-iteration
  overlap) has all its pieces issued there, waiting for the oldest in flight while credit is short: a stage
  that waits for it in the next step's first forward must not depend on a stage that would issue it only in
  its own first forward, downstream (a deadlock).
* ``("need", b)``: bucket ``b``'s reduced gradients are needed -- with cross-iteration overlap, just
  before the next step's forward first uses its parameters; without, at the optimizer. Its pieces not yet
  issued are issued (waiting for the oldest in flight while credit is short), then waited (the rank
  stalls until they end); then the queue is refilled.
* ``("start", None)`` (cross-iteration overlap on a fused step: ``early``): the next step begins. Every bucket
  whose pieces have landed by then is updated at once (``("update", b)`` ops), before the first forward op,
  and a ``need`` event that must wait for its own pieces first updates the buckets that have landed meanwhile:
  the optimizer's work moves into time the rank would otherwise spend waiting (:func:`_next_forward`).

Each event's ops are ``("issue", piece)`` / ``("wait", piece)`` / ``("update", bucket)``, in order; the graph pass
(``passes.comm_schedule``) materialises them. The link serves pieces in issue order (one process
group: gloo and NCCL run one group's collectives in order). In-flight bytes (issued, not waited)
never exceed the credit, by construction. The predicted step time is forward + backward (+ the optimizer) + the
compute lane's time beyond them: its stalls, and each piece's CPU (its issue, ``DeviceSpec.collective_issue_s``, and
where the ranks fill the cores what its transfer takes from the compute it overlaps, ``comm_cpu_s`` +
``comm_cpu_per_byte`` × its bytes, measured by ``fxpar.tools.calibrate``), paid on the lane from the issue beside the
transfer, so hidden where the rank waits for the piece anyway. That CPU also keeps the tuner from cutting more pieces
than they are worth, and on full cores from overlapping a fast link's transfer at all.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from fxpar import meta as M
from fxpar.roles import Role

from .compute import graph_compute

__all__ = ["BucketTiming", "SimResult", "simulate", "slowest_for", "tune"]

_NEAR = 0.02      # tuning: settings predicted within 2% of the best count as equally good
_MARGIN = 0.25     # a piece is retired (waited for free) only a quarter of its own duration after its predicted end


@dataclass
class BucketTiming:
    """One bucket (a priority group): when backward makes it, when the next forward needs it, its pieces."""
    ready_s: float                 # seconds into backward when its last gradient is made
    need_s: float                  # seconds into forward when its parameters are first used
    pieces: list                   # bytes of each piece, in order
    priority: int = 0              # 0 = needed first
    eager: bool = False            # every piece issued at its ready event (a group several stages share, below)


@dataclass
class SimResult:
    step_s: float                  # forward + backward (+ optimizer, when given) + stall_s
    stall_s: float                 # the compute lane's time beyond compute: waits, and the CPU the pieces take
    events: list = field(default_factory=list)   # [(kind, bucket, [(op, piece id), ...]), ...]
    peak_inflight: int = 0
    pieces: list = field(default_factory=list)   # piece id -> (bucket, index within bucket, bytes)


def simulate(buckets: list, t_fwd: float, t_bwd: float, comm_s, credit: int, cross: bool,
             t_opt: float = 0.0, issue_s: float = 0.0, cpu_per_byte: float = 0.0, early: bool = False) -> SimResult:
    """Simulate one steady-state step and return its issue plan (see the module docstring). ``issue_s``: the
    rank's CPU seconds per piece issued (``DeviceSpec.collective_issue_s``, and ``comm_cpu_s`` where gloo's threads
    share the rank's cores); ``cpu_per_byte``: what moving a byte takes from the rank's compute where it computes
    meanwhile (``DeviceSpec.comm_cpu_per_byte``). Both run on the rank's compute lane when the piece is issued,
    beside its transfer, as ``cost_models.simulate`` has it: a piece the rank then waits for costs
    max(its CPU, its transfer), one that overlaps compute costs its CPU. ``early`` (with ``cross``; a fused step,
    whose graph can put an update anywhere before the first forward use): each bucket's update runs as soon as its
    pieces have landed (:func:`_next_forward`), the next step's ``start`` event and ``("update", bucket)`` ops say
    where; otherwise every update runs at its bucket's ``need`` event and the optimizer's time is added after the
    stalls."""
    pieces = [(b, j, n) for b, bt in enumerate(buckets) for j, n in enumerate(bt.pieces)]
    pid = {(b, j): i for i, (b, j, _) in enumerate(pieces)}
    big = max((n for _, _, n in pieces), default=0)
    if big > credit:
        raise ValueError(f"credit {credit} bytes is below the largest piece ({big} bytes)")
    res = SimResult(0.0, 0.0, pieces=pieces)
    queue: list = []               # (priority, piece id)
    inflight: list = []            # [piece id, end time], issue order
    link = [0.0]                   # when the link is free
    used = [0]

    def issue(p, x, ops):      # returns the compute lane's clock once the piece's CPU is paid
        start = max(x, link[0])
        link[0] = start + comm_s(pieces[p][2])
        inflight.append([p, link[0]])
        used[0] += pieces[p][2]
        res.peak_inflight = max(res.peak_inflight, used[0])
        ops.append(("issue", p))
        return x + issue_s + cpu_per_byte * pieces[p][2]

    def wait(k, ops):
        p, end = inflight.pop(k)
        used[0] -= pieces[p][2]
        ops.append(("wait", p))
        return end

    def retire(x, ops):       # a wait on a piece predicted done blocks when the prediction is short: keep a margin
        while inflight and inflight[0][1] + _MARGIN * comm_s(pieces[inflight[0][0]][2]) <= x:
            wait(0, ops)

    def refill(x, ops):
        while queue and used[0] + pieces[queue[0][1]][2] <= credit:
            x = issue(heapq.heappop(queue)[1], x, ops)
        return x

    def take(b, x, ops):       # bucket b's pieces not issued yet go now, waiting for the oldest in flight while credit is short
        for p in [pid[(b, j)] for j in range(len(buckets[b].pieces))]:
            if any(q == p for _, q in queue):
                queue.remove(next(e for e in queue if e[1] == p))
                heapq.heapify(queue)
                while used[0] + pieces[p][2] > credit:
                    x = max(x, wait(0, ops))
                x = issue(p, x, ops)
        return x

    def land(b, x, ops):       # bucket b's pieces still in flight are waited (the rank stalls until they end)
        for p in [pid[(b, j)] for j in range(len(buckets[b].pieces))]:
            k = next((i for i, (q, _) in enumerate(inflight) if q == p), None)
            if k is not None:                 # not retired already
                x = max(x, wait(k, ops))
        return x

    late = 0.0                       # backward delayed: the pieces' CPU, eager buckets' credit waits
    for b in sorted(range(len(buckets)), key=lambda b: (buckets[b].ready_s, b)):
        x = t_fwd + buckets[b].ready_s + late
        ops: list = []
        for j in range(len(buckets[b].pieces)):
            heapq.heappush(queue, (buckets[b].priority, pid[(b, j)]))
        retire(x, ops)
        x = refill(x, ops)
        if buckets[b].eager:         # all of its pieces go now, waiting for the oldest in flight while credit is short
            x = take(b, x, ops)
        late = x - (t_fwd + buckets[b].ready_s)
        res.events.append(("ready", b, ops))
    if cross and early:
        stall = _next_forward(buckets, pieces, t_fwd, t_bwd, t_opt, late, comm_s, queue, inflight, take, land, retire,
                              refill, res.events)
    else:
        stall = late
        base = t_fwd + t_bwd             # the optimizer (after the waits) or the next forward starts here
        for b in sorted(range(len(buckets)), key=lambda b: (buckets[b].priority, b)):
            x = base + (buckets[b].need_s if cross else 0.0) + stall
            ops = []
            retire(x, ops)
            x = land(b, take(b, x, ops), ops)
            retire(x, ops)
            x = refill(x, ops)
            stall = x - (base + (buckets[b].need_s if cross else 0.0))
            res.events.append(("need", b, ops))
    res.stall_s = stall
    res.step_s = t_fwd + t_bwd + t_opt + stall
    return res


def _next_forward(buckets, pieces, t_fwd, t_bwd, t_opt, late, comm_s, queue, inflight, take, land, retire, refill,
                  events) -> float:
    """The next step's forward under cross-iteration overlap with early updates, on the rank's compute lane; returns
    the step's stall (``late`` included). Each bucket's update costs the optimizer's time in proportion to its bytes
    (the update is element-wise) and runs before the first forward use of its parameters, as soon as its pieces
    have landed: at the step's ``start`` every bucket whose pieces are (predicted, with the margin) done is updated
    first, in priority order, and while a ``need`` event waits for its own pieces it updates the buckets that have
    landed meanwhile -- compute that would otherwise come later, moved into time the rank would spend waiting.
    Each update is an ``("update", bucket)`` op of the event where it runs."""
    total = sum(sum(bt.pieces) for bt in buckets) or 1
    opt = [t_opt * sum(bt.pieces) / total for bt in buckets]
    order = sorted(range(len(buckets)), key=lambda b: (buckets[b].priority, b))
    mine = [{p for p, (pb, _, _) in enumerate(pieces) if pb == b} for b in range(len(buckets))]
    updated: set = set()

    def landed(b, x):
        return (not any(q in mine[b] for _, q in queue)
                and all(end + _MARGIN * comm_s(pieces[p][2]) <= x for p, end in inflight if p in mine[b]))

    def update(b, x, ops):
        x = land(b, x, ops)
        ops.append(("update", b))
        updated.add(b)
        return x + opt[b]

    def fill(x, ops, until=lambda x: False):
        while not until(x):
            c = next((c for c in order if c not in updated and landed(c, x)), None)
            if c is None:
                break
            x = update(c, x, ops)
        return x

    x = t_fwd + t_bwd + late          # the step ends; the compute lane turns to the next step
    ops: list = []
    retire(x, ops)
    x = refill(fill(refill(x, ops), ops), ops)     # queued pieces onto the wire first, then the landed updates
    events.append(("start", None, ops))
    at = 0.0                          # forward seconds run so far
    for b in order:
        x += max(0.0, buckets[b].need_s - at)
        at = max(at, buckets[b].need_s)
        ops = []
        retire(x, ops)
        if b not in updated:
            x = take(b, x, ops)
            x = fill(x, ops, until=lambda x: landed(b, x))
            x = update(b, x, ops)
        retire(x, ops)
        x = refill(x, ops)
        events.append(("need", b, ops))
    x += t_fwd - at
    return x - (t_fwd + t_bwd) - t_fwd - t_opt


def tune(make_buckets, t_fwd: float, t_bwd: float, comm_s, cross: bool, partitions: list, credit_factors: list,
         t_opt: float = 0.0, partition: int | None = None, credit: int | None = None, issue_s: float = 0.0,
         cpu_per_byte: float = 0.0, early: bool = False) -> tuple:
    """Grid search (ByteScheduler tunes with Bayesian optimisation over measured runs; here the simulation is
    cheap, so a grid suffices): ``make_buckets(partition) -> [BucketTiming]``. ``partition``/``credit`` given:
    that value is kept. Returns ``(partition, credit, SimResult, tried)``: among the settings predicted within
    ``_NEAR`` of the least step time, the largest partition, then the largest credit (fewer collectives and
    fewer waits in backward: the prediction's error costs least there)."""
    tried, runs = [], {}
    for part in ([partition] if partition else partitions):
        bts = make_buckets(part)
        biggest = max((n for bt in bts for n in bt.pieces), default=1)
        total = sum(n for bt in bts for n in bt.pieces)
        credits = [credit] if credit else sorted({max(biggest, int(part * f)) for f in credit_factors} | {total})
        for c in credits:
            r = simulate(bts, t_fwd, t_bwd, comm_s, c, cross, t_opt, issue_s, cpu_per_byte, early)
            tried.append((part, c, r.step_s))
            runs[(part, c)] = r
    least = min(t for _, _, t in tried)
    part, c = max((p, c) for p, c, t in tried if t <= least * (1 + _NEAR))
    return part, c, runs[(part, c)], tried


def slowest_for(gm, devices) -> tuple:
    """``(device, per-node seconds)``: the one of ``devices`` on which ``gm``'s compute takes longest (the first on a
    tie; ``cost_models.compute.graph_compute``) and its times. The ranks of a data-parallel group meet at every
    collective, so a plan made once for all of them (the pieces and credit, a bucket size) is simulated on
    the slowest one's timeline (``ClusterSpec.devices_of``: a heterogeneous cluster's devices, stragglers folded in)."""
    best = None
    for d in devices:
        gc = graph_compute(gm, d)
        if best is None or gc.time_s > best[1].time_s:
            best = (d, gc)
    return best[0], best[1].times


def stage_timings(gm, signature, device, backward: list | None = None, times: dict | None = None) -> dict:
    """From a captured joint step: forward/backward/optimizer seconds (``cost_models.compute``), and per parameter
    key when backward makes its gradient (seconds into backward) and when forward first uses it (seconds into
    forward). The times place the events of :func:`simulate`; the node order is the order the step runs, or with
    ``backward`` (``passes.grad_order.reordered_backward``) backward's nodes run in that order. ``times``: the
    per-node seconds, when already computed."""
    times = times if times is not None else graph_compute(gm, device).times
    key_of = {ph: k for ph, (r, k) in zip(gm.graph.find_nodes(op="placeholder"), signature.inputs) if r == Role.PARAM}
    clock = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    ready, need = {}, {}
    nodes = list(gm.graph.nodes)
    if backward is not None:
        moved = set(backward)
        at = next(i for i, n in enumerate(nodes) if n in moved)
        nodes = nodes[:at] + list(backward) + [n for n in nodes[at:] if n not in moved]
    for i, n in enumerate(nodes):
        phase = M.get(n, M.PHASE)
        if phase not in clock:
            continue
        if phase == "forward":
            for a in n.all_input_nodes:
                if a in key_of:       # graph order breaks ties between uses at the same estimated time
                    need.setdefault(key_of[a], clock["forward"] + 1e-12 * i)
        clock[phase] += times.get(n, 0.0)
        key = M.get(n, M.GRAD_OF)
        if phase == "backward" and key is not None:
            ready[key] = clock["backward"]
    return {"t_fwd": clock["forward"], "t_bwd": clock["backward"], "t_opt": clock["optimizer"],
            "ready": ready, "need": need,
            "issue_s": getattr(device, "collective_issue_s", 0.0) + getattr(device, "comm_cpu_s", 0.0),
            "cpu_per_byte": getattr(device, "comm_cpu_per_byte", 0.0)}


def split_rows(shape, itemsize: int, partition: int) -> list:
    """Row ranges (dim 0) of a tensor of ``shape`` in pieces of at most ``partition`` bytes (one row at least:
    a row is the indivisible piece: its slice is a view whatever the tensor's layout)."""
    rows = int(shape[0]) if len(shape) else 1
    row_bytes = itemsize
    for s in shape[1:]:
        row_bytes *= int(s)
    per = max(1, partition // max(1, row_bytes))
    return [(r, min(rows, r + per)) for r in range(0, rows, per)]


class CreditError(ValueError):
    """The credit is below the largest piece: ``piece`` bytes, bucket ``bucket``, at ``partition``."""

    def __init__(self, piece: int, bucket: int, partition: int):
        super().__init__(f"credit below the largest piece ({piece} bytes)")
        self.piece, self.bucket, self.partition = piece, bucket, partition


_PARTITIONS = tuple(int(2**20 * x) for x in (0.25, 0.5, 1, 2, 4, 8, 16, 32))
_CREDIT_FACTORS = (1, 2, 4, 8)


def plan_stage(tm: dict, buckets_at, shape_of, itemsize_of, comm_s, cross: bool, fifo_buckets: list,
               partition: int | None = None, credit: int | None = None, shared=lambda keys: False,
               early: bool = False) -> tuple:
    """ByteScheduler's decisions for one stage: ``(entry, buckets)``. ``tm``: :func:`stage_timings`;
    ``buckets_at(partition) -> [[key, ...]]`` (DDP's packing up to ``partition``); ``fifo_buckets``: the FIFO
    plan, simulated for comparison. ``entry`` holds the chosen partition and credit, how they were chosen
    (every setting tried with its predicted step, best first), the priority order, the pieces ``[bucket, first row, end row]`` (rows None:
    the whole bucket), the events with their ops, the simulated in-flight peak and step times. ``shared(keys)``:
    the bucket's group spans several stages (a tied parameter): every stage must make the same collectives, so it
    is cut only at the partition asked for (the same on every stage), never at a tuned one, and with cross-iteration
    overlap issued whole in its own step (``eager``). ``early``: updates run as soon as their pieces land
    (:func:`simulate`; a fused step's graph only)."""
    size = lambda k: _prod(shape_of(k)) * itemsize_of(k)        # noqa: E731

    def layout(buckets, part):
        need = [min((tm["need"].get(k, tm["t_fwd"]) for k in b), default=0.0) for b in buckets]
        prio = {b: i for i, b in enumerate(sorted(range(len(buckets)), key=lambda b: (need[b], -b)))}
        out, rows = [], []
        for b, keys in enumerate(buckets):
            total = sum(size(k) for k in keys)
            tied = shared(keys)
            cut_at = (partition if tied else part) if part else None
            if cut_at and len(keys) == 1 and total > cut_at:
                cuts = split_rows(shape_of(keys[0]), itemsize_of(keys[0]), cut_at)
                pieces = [total * (r1 - r0) // int(shape_of(keys[0])[0]) for r0, r1 in cuts]
            else:
                cuts, pieces = [None], [total]
            rows += [[b] + (list(c) if c else [None, None]) for c in cuts]
            out.append(BucketTiming(max(tm["ready"].get(k, tm["t_bwd"]) for k in keys), need[b], pieces, prio[b],
                                    eager=tied and cross))
        return out, rows

    fifo = None
    if fifo_buckets:
        fb, _ = layout(fifo_buckets, None)
        for b, bt in enumerate(fb):
            bt.priority = b            # FIFO: backward order, everything in flight, waits at the optimizer
        fifo = simulate(fb, tm["t_fwd"], tm["t_bwd"], comm_s, sum(sum(bt.pieces) for bt in fb), False, tm["t_opt"],
                        tm.get("issue_s", 0.0), tm.get("cpu_per_byte", 0.0))
    try:
        part, cred, sim, tried = tune(lambda p: layout(buckets_at(p), p)[0], tm["t_fwd"], tm["t_bwd"], comm_s, cross,
                                      list(_PARTITIONS), _CREDIT_FACTORS, tm["t_opt"], partition, credit,
                                      tm.get("issue_s", 0.0), tm.get("cpu_per_byte", 0.0), early and cross)
    except ValueError:
        part = partition or _PARTITIONS[0]
        bts = layout(buckets_at(part), part)[0]
        b, piece = max(((b, n) for b, bt in enumerate(bts) for n in bt.pieces), key=lambda t: t[1])
        raise CreditError(piece, b, part) from None
    buckets = buckets_at(part)
    timings, rows = layout(buckets, part)
    entry = {"partition_bytes": part, "credit_bytes": cred,
             "tuned": {"partition": "given" if partition else "cost model", "credit": "given" if credit else "cost model",
                       "tried": [list(t) for t in sorted(tried, key=lambda t: t[2])]},
             "priority": sorted(range(len(timings)), key=lambda b: timings[b].priority), "pieces": rows,
             "events": [[k, b, [list(o) for o in ops]] for k, b, ops in sim.events],
             "peak_inflight_bytes": sim.peak_inflight, "predicted_step_s": sim.step_s,
             "fifo_predicted_step_s": fifo.step_s if fifo else None}
    return entry, buckets


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
