"""``estimate(graphs, cluster) -> Estimate``: step time, per-rank time/bytes/memory, a timeline.

    >>> est = estimate({0: gm0, 1: gm1}, ClusterSpec.local(2))
    >>> est.step_time_s, est.ranks[0].comm_bytes, est.ranks[1].peak_memory_bytes
    >>> est.timeline("step.json")       # open in chrome://tracing or https://ui.perfetto.dev
    >>> print(est)                      # the text explain() shows

Ranks with the same program are costed once; when every communication group contains only
ranks of one program class, one rank per class is simulated (see :mod:`cost_models.simulate`).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from .comm import comm_info_cost
from .simulate import compile_program, simulate

__all__ = ["RankEstimate", "Estimate", "estimate"]


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

    def __init__(self, ranks: list, sims: dict, programs: dict, cluster, symmetric: bool, classes: int):
        self.ranks = ranks
        self.step_time_s = max((r.end_time_s for r in ranks), default=0.0)
        self._sims, self._programs = sims, programs
        self.cluster = cluster
        self.symmetric = symmetric
        self.program_classes = classes
        self.defaulted: Counter = Counter()
        for p in {id(p): p for p in programs.values()}.values():
            self.defaulted.update(p.compute.defaulted)

    def timeline(self, path: str, ranks=None) -> str:
        """Write a Chrome trace (``traceEvents``): per rank a compute lane (tid 0) and a comm lane (tid 1)."""
        ranks = sorted(self._programs)[:64] if ranks is None else list(ranks)
        events = []
        for r in ranks:
            p, sim = self._programs[r], self._sims[r]
            events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
            for tid, lane in ((0, "compute"), (1, "comm")):
                events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": lane}})
            for start, _, seg in sim.compute:
                t = start
                for name, dur in p.segments[seg]:
                    events.append({"name": name, "ph": "X", "pid": r, "tid": 0, "ts": t * 1e6, "dur": dur * 1e6,
                                   "cat": "compute"})
                    t += dur
            for start, dur, k in sim.comm:
                info = p.infos[k]
                events.append({"name": f"{info.kind}[{info.axis}] {p.comm_nodes[k].name}", "ph": "X", "pid": r,
                               "tid": 1, "ts": start * 1e6, "dur": dur * 1e6, "cat": "comm",
                               "args": {"bytes": info.nbytes, "group": list(info.ranks)[:16]}})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return path

    def __str__(self) -> str:
        ms = 1e3
        lines = [f"estimated step time {self.step_time_s * ms:.3f} ms on {len(self.ranks)} rank(s) "
                 f"({self.program_classes} distinct program(s){', symmetric' if self.symmetric else ''})"]
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
                         f"idle {r.idle_s * ms:.3f} ms, peak memory {r.peak_memory_bytes / 2**20:.1f} MiB")
            mem = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r.memory_breakdown.items() if v)
            if mem:
                lines.append(f"    at peak (MiB): {mem}")
        if self.defaulted:
            ops = ", ".join(f"{k} x{v}" for k, v in self.defaulted.most_common())
            lines.append(f"  ops costed by the default rule (bytes in+out, 1 FLOP/element): {ops}")
        return "\n".join(lines)


def _overlap(compute: list, comm: list) -> float:
    """Length of the intersection of two sets of (start, dur, _) intervals."""
    a = sorted((s, s + d) for s, d, _ in compute if d > 0)
    b = sorted((s, s + d) for s, d, _ in comm if d > 0)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


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
        key = (id(p.compute), sig)
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


def estimate(graphs: dict, cluster, algorithm: str = "auto") -> Estimate:
    """Cost and simulate one training step of the per-rank ``graphs`` (rank -> GraphModule)."""
    cache: dict = {}
    programs = {r: compile_program(gm, cluster, cache) for r, gm in graphs.items()}
    comm_cache: dict = {}
    durations, wire = {}, {}
    for r, p in programs.items():
        key = tuple(id(i) for i in p.infos)
        if key not in comm_cache:
            costs = []
            for info in p.infos:
                ck = (info.kind, info.nbytes, tuple(info.ranks))
                c = comm_cache.get(ck)
                if c is None:
                    c = comm_cache[ck] = comm_info_cost(info, cluster, algorithm)
                costs.append(c)
            comm_cache[key] = ([c.time_s for c in costs], sum(c.wire_bytes for c in costs))
        durations[r], wire[r] = comm_cache[key]
    cls_of = _symmetry_classes(programs)
    symmetric = cls_of is not None
    if symmetric:
        reps: dict = {}
        for r, key in cls_of.items():
            reps.setdefault(key, r)
        rep_sims = simulate({r: programs[r] for r in reps.values()}, durations, symmetric=True)
        sims = {r: rep_sims[reps[key]] for r, key in cls_of.items()}
    else:
        sims = simulate(programs, durations)
    ranks, done = [], {}
    for r in sorted(programs):
        p, sim = programs[r], sims[r]
        key = (id(sim), id(p.compute), id(durations[r]))
        if key not in done:
            done[key] = (sum(d for _, d, _ in sim.comm), _overlap(sim.compute, sim.comm))
        comm_t, ov = done[key]
        ranks.append(RankEstimate(r, p.compute_time_s, comm_t, wire[r], p.liveness.peak_bytes, sim.end, ov,
                                  dict(p.liveness.peak_breakdown)))
    classes = len({id(p.compute) for p in programs.values()})
    return Estimate(ranks, sims, programs, cluster, symmetric, classes)
