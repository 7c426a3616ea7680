"""``estimate(graphs, cluster) -> Estimate``: step time, per-rank time/bytes/memory, a timeline.

    >>> est = estimate({0: gm0, 1: gm1}, ClusterSpec.local(2))          # one graph per rank
    >>> est = estimate({0: [("F0.0", f0), send, ...], 1: [...]}, cl)    # a sequence per rank
    >>> est.step_time_s, est.ranks[0].comm_bytes, est.ranks[1].peak_memory_bytes
    >>> est.idle_fraction, est.ranks[1].idle_fraction                   # the pipeline bubble
    >>> est.idle_fraction_where(lambda label: label[0] in "FBIW")       # only these graphs count as work
    >>> est.timeline("step.json")       # open in chrome://tracing or https://ui.perfetto.dev
    >>> print(est)                      # the text explain() shows

A rank's value is a GraphModule (its whole step) or a list of items run in order: graphs, send/
recv messages, waits (see :mod:`cost_models.sequence`). Ranks with the same program are costed
once; when every communication group contains only ranks of one program class, one rank per
class is simulated (see :mod:`cost_models.simulate`).
"""
from __future__ import annotations

import json
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field

from .comm import GLOO_THREADS, comm_info_cost, latency_part
from .sequence import SequenceProgram, compile_sequence
from .simulate import CoreSharing, compile_program, simulate, slowed

__all__ = ["RankEstimate", "Estimate", "estimate", "straggler_factor"]


@dataclass
class RankEstimate:
    """What one rank does in one step (seconds, bytes)."""
    rank: int
    compute_time_s: float
    comm_time_s: float
    comm_bytes: float                 # bytes this rank puts on the wire
    peak_memory_bytes: float
    end_time_s: float
    overlap_s: float                  # comm time hidden under compute
    memory_breakdown: dict = field(default_factory=dict)
    idle_fraction: float = 0.0        # 1 - compute_time_s / the step time of all ranks

    @property
    def exposed_comm_s(self) -> float:
        return self.comm_time_s - self.overlap_s

    @property
    def idle_s(self) -> float:
        return max(0.0, self.end_time_s - self.compute_time_s)

    @property
    def overlap_fraction(self) -> float:
        return self.overlap_s / self.comm_time_s if self.comm_time_s > 0 else 0.0


class Estimate:
    """Result of :func:`estimate`. ``ranks[i]`` is rank i's :class:`RankEstimate`."""

    def __init__(self, ranks: list, sims: dict, programs: dict, cluster, symmetric: bool, classes: int,
                 shared_cores: bool = False):
        self.ranks = ranks
        self.shared_cores = shared_cores      # compute priced at processor-sharing rates (CoreSharing)
        self.step_time_s = max((r.end_time_s for r in ranks), default=0.0)
        for r in ranks:
            r.idle_fraction = 1 - r.compute_time_s / self.step_time_s if self.step_time_s > 0 else 0.0
        self._sims, self._programs = sims, programs
        self.cluster = cluster
        self.symmetric = symmetric
        self.program_classes = classes
        self.items_per_rank = max((len(p.items) if isinstance(p, SequenceProgram) else 1
                                   for p in programs.values()), default=0)
        self.defaulted: Counter = Counter()
        self.notes: list = []         # lines a feature adds on how it priced the step (printed last)
        graphs: dict = {}
        for p in programs.values():
            for g in (p.programs if isinstance(p, SequenceProgram) else (p,)):
                graphs[id(g.compute)] = g
        for g in graphs.values():
            self.defaulted.update(g.compute.defaulted)

    @property
    def idle_fraction(self) -> float:
        """``1 - sum(compute time) / (ranks x step time)``: the pipeline bubble, over all ranks. Every graph's
        compute counts (the optimizer STEP too); a pipeline executor that counts only F/B/I/W as busy is
        matched by :meth:`idle_fraction_where`."""
        if not self.ranks or self.step_time_s <= 0:
            return 0.0
        return 1 - sum(r.compute_time_s for r in self.ranks) / (len(self.ranks) * self.step_time_s)

    def work_time_s(self, rank: int, is_work) -> float:
        """Compute seconds of ``rank``'s graphs whose label ``is_work(label)`` accepts (a rank given as
        one GraphModule: its label is ``#0``)."""
        p = self._programs[rank]
        if not isinstance(p, SequenceProgram):
            if not is_work("#0"):
                return 0.0
            return sum(d for _, d, _ in self._sims[rank].compute) if self.shared_cores else p.compute_time_s
        if self.shared_cores:         # each graph's compute took the wall time of its steps at their shared rates
            return sum(d for _, d, seg in self._sims[rank].compute if is_work(p.label(p.seg_item[seg])))
        return sum(part.compute_time_s for i, part in enumerate(p.parts) if part is not None and is_work(p.label(i)))

    def idle_fraction_where(self, is_work) -> float:
        """:attr:`idle_fraction` counting as compute only the graphs whose label ``is_work(label)``
        accepts: e.g. the compute actions alone (F/B/I/W), as a pipeline executor measures its bubble,
        leaving the optimizer step and gradient reduction as not-work."""
        if not self.ranks or self.step_time_s <= 0:
            return 0.0
        return 1 - sum(self.work_time_s(r.rank, is_work) for r in self.ranks) / (len(self.ranks) * self.step_time_s)

    def actions(self, rank: int) -> list:
        """``(label, start_s, end_s)`` of each item of ``rank``'s sequence that ran something.

        A graph spans its first to its last compute segment (a graph with no compute is left
        out); a message, its transfer. A rank given as one GraphModule is one item, ``#0``.
        """
        p = self._programs[rank]
        if not isinstance(p, SequenceProgram):
            spans = [(s, s + d) for s, d, _ in self._sims[rank].compute]
            return [("#0", spans[0][0], spans[-1][1])] if spans else []
        return [(p.label(i), lo, hi) for i, lo, hi in self._spans(rank)]

    def _spans(self, rank: int) -> list:
        p, sim = self._programs[rank], self._sims[rank]
        span: dict = {}
        for start, dur, seg in sim.compute:
            i = p.seg_item[seg]
            lo, hi = span.get(i, (start, start + dur))
            span[i] = (min(lo, start), max(hi, start + dur))
        for start, dur, k in sim.comm:
            i = p.comm_item[k]
            if p.parts[i] is None:
                span[i] = (start, start + dur)
        return [(i, *span[i]) for i in sorted(span)]

    def timeline(self, path: str, ranks=None) -> str:
        """Write a Chrome trace (``traceEvents``): per rank a compute lane (tid 0) and a comm lane (tid 1)."""
        ranks = sorted(self._programs)[:64] if ranks is None else list(ranks)
        events = []
        for r in ranks:
            p, sim = self._programs[r], self._sims[r]
            events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
            for tid, lane in ((0, "compute"), (1, "comm")):
                events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": lane}})
            seq = isinstance(p, SequenceProgram)
            if seq:                   # one enclosing span per graph, named by its label
                for i, lo, hi in self._spans(r):
                    if p.parts[i] is not None:
                        events.append({"name": p.label(i), "ph": "X", "pid": r, "tid": 0, "ts": lo * 1e6,
                                       "dur": (hi - lo) * 1e6, "cat": "action"})
            for start, _, seg in sim.compute:
                t = start
                for name, dur in p.segments[seg]:
                    events.append({"name": name, "ph": "X", "pid": r, "tid": 0, "ts": t * 1e6, "dur": dur * 1e6,
                                   "cat": "compute"})
                    t += dur
            for start, dur, k in sim.comm:
                info = p.infos[k]
                events.append({"name": f"{info.kind}[{info.axis}] {p.comm_names[k]}", "ph": "X", "pid": r,
                               "tid": 1, "ts": start * 1e6, "dur": dur * 1e6, "cat": "comm",
                               "args": {"bytes": info.nbytes, "group": list(info.ranks)[:16]}})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return path

    def __str__(self) -> str:
        ms = 1e3
        lines = [f"estimated step time {self.step_time_s * ms:.3f} ms on {len(self.ranks)} rank(s) "
                 f"({self.program_classes} distinct program(s){', symmetric' if self.symmetric else ''})"]
        seq = self.items_per_rank > 1
        if seq:
            lines[0] += (f", up to {self.items_per_rank} actions per rank; idle fraction (pipeline bubble) "
                         f"{100 * self.idle_fraction:.1f}%")
        seen = set()
        for r in self.ranks:
            key = (round(r.compute_time_s, 12), round(r.comm_time_s, 12), r.peak_memory_bytes)
            if key in seen:
                continue
            seen.add(key)
            same = sum(1 for x in self.ranks if (round(x.compute_time_s, 12), round(x.comm_time_s, 12),
                                                   x.peak_memory_bytes) == key)
            lines.append(f"  rank {r.rank}{f' (+{same - 1} alike)' if same > 1 else ''}: compute "
                         f"{r.compute_time_s * ms:.3f} ms, comm {r.comm_time_s * ms:.3f} ms "
                         f"({r.comm_bytes / 2**20:.2f} MiB sent, {100 * r.overlap_fraction:.0f}% overlapped), "
                         f"idle {r.idle_s * ms:.3f} ms{f' ({100 * r.idle_fraction:.1f}% of the step)' if seq else ''}, "
                         f"peak memory {r.peak_memory_bytes / 2**20:.1f} MiB")
            mem = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r.memory_breakdown.items() if v and k != "carried")
            if mem:
                held = r.memory_breakdown.get("carried", 0.0)
                lines.append(f"    at peak (MiB): {mem}" + (f" (of these, {held / 2**20:.1f} held from earlier "
                                                             "graphs of the step)" if held else ""))
        if self.defaulted:
            ops = ", ".join(f"{k} x{v}" for k, v in self.defaulted.most_common())
            lines.append(f"  ops costed by the default rule (bytes in+out, 1 FLOP/element): {ops}")
        lines += [f"  {ln}" for ln in self.notes]
        return "\n".join(lines)


def _overlap(compute: list, comm: list) -> float:
    """Sum over comm intervals of the time each spends under compute (``(start, dur, _)`` lists).

    Compute intervals never overlap each other (one compute lane); comm intervals may (a p2p
    channel beside the collective lane), and each counts its own hidden time.
    """
    a = sorted((s, s + d) for s, d, _ in compute if d > 0)
    starts = [lo for lo, _ in a]
    before = [0.0]                              # before[i]: compute time of a[:i]
    for lo, hi in a:
        before.append(before[-1] + hi - lo)

    def covered(t):                             # compute time in [0, t]
        i = bisect_left(starts, t)
        if i and a[i - 1][1] > t:
            return before[i - 1] + t - a[i - 1][0]
        return before[i]

    return sum(covered(s + d) - covered(s) for s, d, _ in comm if d > 0)


def _symmetry_classes(programs: dict):
    """rank -> class key such that one rank per class can stand for all, or None.

    Exact when, for every comm op k of every rank r, each member m of r's group G runs the same
    program and uses G at the same positions k; then all members issue, start and finish every
    collective together. Send/recv pairs different programs, so it never holds for them.
    """
    gid_of_obj: dict = {}
    interned: dict = {}
    groups: list = []
    sig_cache: dict = {}
    cls_of: dict = {}
    members: dict = {}
    for r, p in programs.items():
        sig = sig_cache.get(id(p))
        if sig is None:
            out = []
            for info in p.infos:
                if info.kind in ("send", "recv"):
                    return None
                g = gid_of_obj.get(id(info.ranks))
                if g is None:
                    t = tuple(sorted(info.ranks))
                    g = interned.setdefault(t, len(interned))
                    if g == len(groups):
                        groups.append(frozenset(t))
                    gid_of_obj[id(info.ranks)] = g
                out.append(g)
            sig = sig_cache[id(p)] = tuple(out)
        key = (p.class_key, sig)
        cls_of[r] = key
        members.setdefault(key, set()).add(r)
    positions: dict = {}
    for key in members:
        pos: dict = {}
        for k, g in enumerate(key[1]):
            pos.setdefault(g, []).append(k)
        positions[key] = {g: tuple(v) for g, v in pos.items()}
    for key, mem in members.items():
        for g, ks in positions[key].items():
            grp = groups[g]
            if not mem <= grp:
                return None            # a rank calls a collective of a group it is not in
            if grp <= mem:
                continue
            for m in grp:
                km = cls_of.get(m)
                if km is None or km[0] != key[0] or positions[km].get(g) != ks:
                    return None
    return cls_of


def straggler_factor(factor: float, device) -> float:
    """How many times as long a straggler's compute takes: ``1 + (factor - 1) * device.core_share``.

    The harness (``fxpar.runtime.executor.straggle``) sleeps ``factor - 1`` times each compute action's CPU
    seconds, the smaller of its wall and process CPU time. On a core of its own (``core_share`` 1) that is its
    wall time and the compute takes ``factor`` times as long; where the ranks share the cores, the cost model's
    compute seconds are wall seconds at the rank's share of a core (``DeviceSpec.core_share``, from calibrate()),
    of which the CPU seconds, and so the sleep, are that share: 4 ranks on 2 cores, ``factor`` 2 -> 1.5.
    While the straggler sleeps the others have its core too; that is not modelled (the step comes out long by at
    most the sleep's share of the cores the others would have used)."""
    return 1 + (factor - 1) * min(1.0, max(0.0, getattr(device, "core_share", 1.0)))


def estimate(graphs: dict, cluster, algorithm: str = "auto", server_nodes=None) -> Estimate:
    """Cost and simulate one training step of the per-rank ``graphs``.

    ``graphs[rank]`` is a GraphModule (the rank's whole step) or a list of items the rank runs in
    order (graphs, ``(label, graph)``, :class:`~cost_models.sequence.Item`, send/recv
    ``CommInfo``, ``("wait", label)``; see :mod:`cost_models.sequence`). ``server_nodes[j]``: the
    worker node BytePS's CPU server ``j`` sits on (default: machines of their own; ``cost_models.comm``).
    In a heterogeneous cluster (``cluster.devices``) each rank's graphs are costed on its own device
    (``cluster.device_of(rank)``), a late receive costs its sender's ``late_recv_s``, and the gloo collectives in
    flight at once are the fewest any device allows (``collective_slots``). A straggler of ``cluster.slowdown``
    (``{rank: factor}`` pairs) runs its compute :func:`straggler_factor` times as long
    (:func:`cost_models.simulate.slowed`); a collective starts when its slowest member issues it, so synchronous data
    parallelism's step is the straggler's. Where a node's CPU ranks outnumber its cores (``DeviceSpec.host_cores``),
    a rank computes faster while fewer of its node's ranks compute (:class:`cost_models.simulate.CoreSharing`), and
    its ``compute_time_s`` is the wall time its compute took at those rates.
    """
    caches: dict = {}

    def on_own_device(r):          # a heterogeneous cluster: each rank's graphs costed on its own device
        if not getattr(cluster, "devices", ()):
            return cluster, caches.setdefault(None, {})
        d = cluster.device_of(r)
        return cluster.on_device(d), caches.setdefault(d, {})

    programs = {}
    for r, g in graphs.items():
        cl, cache = on_own_device(r)
        programs[r] = (compile_sequence(g, cl, cache, r) if isinstance(g, (list, tuple))
                       else compile_program(g, cl, cache))
    for r, factor in getattr(cluster, "slowdown", ()):      # stragglers: their compute's CPU seconds, slept again
        if r in programs and factor != 1:
            device = cluster.device_of(r) if hasattr(cluster, "device_of") else cluster.device
            programs[r] = slowed(programs[r], straggler_factor(factor, device))
    comm_cache: dict = {}
    durations, wire, latency = {}, {}, {}
    for r, p in programs.items():
        key = tuple(id(i) for i in p.infos)
        if key not in comm_cache:
            costs = []
            for info in p.infos:
                ck = (info.kind, info.nbytes, tuple(info.ranks), info.axis, getattr(info, "parts", ()))
                c = comm_cache.get(ck)
                if c is None:
                    c = comm_cache[ck] = comm_info_cost(info, cluster, algorithm, server_nodes)
                costs.append(c)
            comm_cache[key] = ([c.time_s for c in costs], sum(c.wire_bytes for c in costs),
                               [latency_part(i, cluster, c.time_s) for i, c in zip(p.infos, costs)])
        durations[r], wire[r], latency[r] = comm_cache[key]
    # gloo runs a group's collectives on GLOO_THREADS worker threads: that many may be in flight at once, unless
    # calibrate() found this machine's ranks progress fewer (DeviceSpec.collective_slots); one figure for the
    # simulation, so a heterogeneous cluster's fewest (its ranks' collectives progress together)
    devices = getattr(cluster, "devices", ()) or (cluster.device,)
    slots = min(getattr(d, "collective_slots", 0) or GLOO_THREADS for d in devices)
    # a late receive costs the sender's CPU its DeviceSpec.late_recv_s: each sender's own on a heterogeneous cluster
    late_recv = ({r: cluster.device_of(r).late_recv_s for r in programs} if getattr(cluster, "devices", ())
                 else getattr(cluster.device, "late_recv_s", 0.0))
    multi = {"latency": latency, "slots": slots} if getattr(cluster, "backend", "gloo") == "gloo" else {}
    cls_of = _symmetry_classes(programs)
    # ranks that share a node's cores compute faster while fewer of them compute (CoreSharing); one class of ranks
    # computes in lockstep, every rank at once, at the calibrated rate: the symmetric simulation is then exact
    sharing = CoreSharing.of(cluster, programs)
    if sharing is not None and cls_of is not None and len(set(cls_of.values())) == 1:
        sharing = None
    symmetric = cls_of is not None and sharing is None
    if symmetric:
        reps: dict = {}
        for r, key in cls_of.items():
            reps.setdefault(key, r)
        rep_sims = simulate({r: programs[r] for r in reps.values()}, durations, symmetric=True, **multi)
        sims = {r: rep_sims[reps[key]] for r, key in cls_of.items()}
    else:
        sims = simulate(programs, durations, late_recv_s=late_recv, sharing=sharing, **multi)
    ranks, done = [], {}
    for r in sorted(programs):
        p, sim = programs[r], sims[r]
        key = (id(sim), p.class_key, id(durations[r]))
        if key not in done:
            done[key] = (sum(d for _, d, _ in sim.comm), _overlap(sim.compute, sim.comm))
        comm_t, ov = done[key]
        if isinstance(p, SequenceProgram):
            peak, breakdown = p.peak_bytes, dict(p.memory_breakdown)
        else:
            peak, breakdown = p.liveness.peak_bytes, dict(p.liveness.peak_breakdown)
        busy = p.compute_time_s if sharing is None else sum(d for _, d, _ in sim.compute)   # at its shared rate
        ranks.append(RankEstimate(r, busy, comm_t, wire[r], peak, sim.end, ov, breakdown))
    classes = len({p.class_key for p in programs.values()})
    return Estimate(ranks, sims, programs, cluster, symmetric, classes, sharing is not None)
