"""Event simulation of per-rank programs: a compute lane and a comm lane per rank.

Each rank's graph is compiled (once per distinct program, see :func:`compile_program`) into a
list of steps::

    ("compute", seconds, segment)      nodes between two comm events, costed by cost_models.compute
    ("issue", k)                       the k-th comm node is handed to the comm lane
    ("wait", k)                        wait_tensor: compute blocks until comm k has finished

A collective the graph returns without waiting on it is *deferred* (``Program.deferred``): on its
own the graph still blocks on it at once, but in a sequence of graphs
(:mod:`cost_models.sequence`) a later graph's ``wait_tensor`` on a placeholder waits on it
(``Program.placeholder_waits``).

Rules (those of NCCL/gloo communicators, and of PyTorch's pipelining dry-run
``_simulate_comms_compute``): a rank's comm lane runs its collectives one at a time in issue
order (under gloo, whose process group works on two threads, up to two at a time: their latencies
overlap, their bytes share the wire; see :func:`simulate`); a collective starts when every rank of its
group has issued it and every such lane is free, and takes :func:`cost_models.comm.comm_info_cost`
seconds on all of them; the i-th
collective a rank issues over a group matches the i-th one every other member issues over it.
Point-to-point messages (``send``/``recv``) do not queue behind collectives: each ordered pair
``(src, dst)`` is its own channel (isend/irecv, MPI's non-overtaking order per pair), where the
n-th send src->dst matches the n-th recv at dst from src and starts once both are issued and
the channel is free. Lanes and channels share no bandwidth in this model. A message whose
receive is posted after its send while the sender computes takes ``DeviceSpec.late_recv_s``
longer (measured by :mod:`fxpar.tools.calibrate`; see :func:`simulate`). An op that is the first of its kind since
the rank's last communication runs cold and pays ``DeviceSpec.cold_op_s`` more (:func:`cold_ops`). A comm node that no
``wait_tensor`` reads blocks at once. When no rank can move, or a comm is never matched, the
programs deadlock and the error names who waits on whom.

Shared cores (:class:`CoreSharing`): where a node's CPU ranks outnumber its cores (``DeviceSpec.host_cores``),
the compute figures are those calibrate() measured while every rank computed at once; a rank computing while fewer
of its node's ranks compute runs faster, at its processor-sharing rate (:meth:`CoreSharing.speed`). The simulation
then advances all ranks in time order together, each compute step at the rate the ranks computing beside it allow.
Elsewhere (GPUs, a core per rank, ``host_cores`` 0) every compute step takes its seconds as costed.

Speed: ranks whose programs are the same graph object (or the same code on the same input
shapes) are costed once; when every group's members share a program, one representative per
class is simulated and its timeline shared (the usual data/tensor-parallel case).
"""
from __future__ import annotations

import copy
import operator
from bisect import bisect_right

import torch.fx

from fxpar import meta as M

from .compute import GraphCompute, graph_compute, pays_dispatch
from .memory import liveness

__all__ = ["Program", "CoreSharing", "cold_ops", "compile_program", "simulate", "SimResult", "DeadlockError",
           "slowed"]

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_P2P = ("send", "recv")


class DeadlockError(RuntimeError):
    """The per-rank programs cannot all finish: some rank waits on a comm others never issue."""


class Program:
    """One rank's graph, compiled: steps, per-segment node times, comm nodes, memory.

    ``deferred``: comm index -> names under which the graph returns that collective unwaited.
    ``placeholder_waits``: ``(i, name)``: before ``steps[i]`` a ``wait_tensor`` reads placeholder
    ``name`` (a collective an earlier graph of a sequence issued; ignored on a graph's own).
    ``cluster.device`` is the rank's device: :func:`cost_models.estimate.estimate` hands each rank of a
    heterogeneous cluster the cluster on its own (``ClusterSpec.on_device``).
    """

    def __init__(self, gm, cluster, fused: bool = False):
        self.gm = gm
        gc = graph_compute(gm, cluster.device)
        if fused:                 # compiled by an op-fusing compiler: its kernels' times (cost_models.fusion)
            from .fusion import fused_times
            _, times, _ = fused_times(gm, cluster.device)
            gc = GraphCompute(costs=gc.costs, times=times, defaulted=gc.defaulted)
        self.compute = gc
        self.comm_nodes: list = []
        self.segments: list = []          # list of [(node name, seconds)]
        self.steps: list = []
        self.deferred: dict = {}
        self.placeholder_waits: list = []
        comm_index: dict = {}
        waited: set = set()
        seg: list = []
        comm_cpu_s = 0.0
        returned = _returned_nodes(gm)
        cold_s = getattr(cluster.device, "cold_op_s", 0.0)
        cold = cold_ops(gm, cluster.device) if cold_s > 0 else {}
        if fused:                 # a node fused into another's kernel runs no code of its own
            cold = {n: k for n, k in cold.items() if gc.times.get(n, 0.0) > 0 or n.op == "output"}

        def flush():
            if seg:
                self.segments.append(list(seg))
                self.steps.append(("compute", sum(t for _, t in seg), len(self.segments) - 1))
                seg.clear()

        for n in gm.graph.nodes:
            if M.COMM.name in n.meta:
                t = gc.times.get(n, 0.0)     # the call that issues it runs on the rank's CPU first (its
                if t > 0:                    # DeviceSpec.collective_issue_s); the transfer starts after it
                    seg.append((n.name, t))
                flush()
                k = comm_index[n] = len(self.comm_nodes)
                self.comm_nodes.append(n)
                self.steps.append(("issue", k))
                cpu = comm_cpu(n.meta[M.COMM.name], cluster.device)
                if cpu > 0:                  # its threads' CPU, beside the transfer, taken from the rank's compute
                    seg.append((f"{n.name} (comm CPU)", cpu))
                    comm_cpu_s += cpu
                    flush()
                if not any(u.target is _WAIT for u in n.users) and not _waited_via_getitem(n):
                    self.steps.append(("wait", k))   # blocking comm op
                    waited.add(k)
                    names = [a.name for a in (n, *n.users) if a in returned and
                             (a is n or a.target is operator.getitem)]
                    if names:
                        self.deferred[k] = tuple(names)
            elif n.op == "call_function" and n.target is _WAIT:
                src = n.args[0]
                while src not in comm_index and isinstance(src, torch.fx.Node) and src.target is operator.getitem:
                    src = src.args[0]
                if src in comm_index and comm_index[src] not in waited:
                    flush()
                    self.steps.append(("wait", comm_index[src]))
                    waited.add(comm_index[src])
                elif isinstance(src, torch.fx.Node) and src.op == "placeholder" and src not in waited:
                    flush()
                    self.placeholder_waits.append((len(self.steps), src.name))
                    waited.add(src)
            else:
                t = gc.times.get(n, 0.0)
                if t > 0:
                    seg.append((n.name, t))
                if n in cold:                # its kind's first run since the rank's last communication
                    seg.append((f"{n.name} (cold)", cold[n] * cold_s))
        flush()
        self.compute_time_s = gc.time_s + comm_cpu_s + cold_s * sum(cold.values())
        self.liveness = liveness(gm)
        self.infos = [n.meta[M.COMM.name] for n in self.comm_nodes]
        self.comm_names = [n.name for n in self.comm_nodes]

    slowdown: float = 1.0             # a straggler's copy (:func:`slowed`): its compute takes this many times as long

    @property
    def class_key(self):
        """Equal for programs that run the same steps (the same code on the same shapes) as fast."""
        return (id(self.compute), self.slowdown)


def slowed(program, factor: float):
    """A copy of ``program`` (a :class:`Program` or a :class:`cost_models.sequence.SequenceProgram`) whose compute
    takes ``factor`` times as long, communication unchanged: a straggler (``ClusterSpec.slowdown``). Its class key
    differs, so the simulation waits for it wherever a collective pairs it with others."""
    p = copy.copy(program)
    p.steps = [("compute", st[1] * factor, st[2]) if st[0] == "compute" else st for st in program.steps]
    p.segments = [[(name, t * factor) for name, t in seg] for seg in program.segments]
    p.compute_time_s = program.compute_time_s * factor
    if getattr(program, "parts", None) is not None:       # a sequence: its graphs' own figures too
        p.parts = [None if q is None else slowed(q, factor) for q in program.parts]
    p.slowdown = program.slowdown * factor
    return p


def cold_ops(gm, device=None) -> dict:
    """The nodes of ``gm`` that run cold, each with how many ``DeviceSpec.cold_op_s`` it pays on top of its cost.

    An aten op runs cold (1) where it is the first of its kind (its target) since the rank issued or waited on a
    communication (a node with ``fxpar_comm`` meta, a ``wait_tensor``). The graph runs every step, so a kind's
    first node counts from its last node in the previous call: it is warm only where no communication lies between
    them, around the end. The runtime's own work around the graph (``device.action_overhead_s``, charged on the
    output node) runs once a step, after the graph's communication, so all of it runs cold: the output node pays
    as many as the ops that work is worth (``action_overhead_s / op_overhead_s``, the unit calibrate() measures
    it in). Empty for a graph without communication."""
    epoch, seen, out_node = 0, {}, None
    for n in gm.graph.nodes:
        if M.COMM.name in n.meta or (n.op == "call_function" and n.target is _WAIT):
            epoch += 1
        elif n.op == "call_function" and pays_dispatch(n):
            seen.setdefault(n.target, []).append((epoch, n))
        elif n.op == "output":
            out_node = n
    out: dict = {}
    if epoch == 0:
        return out
    for runs in seen.values():
        prev = runs[-1][0] - epoch           # the kind's last run in the previous call, in this call's count
        for e, n in runs:
            if e > prev:
                out[n] = 1.0
            prev = e
    action, op = getattr(device, "action_overhead_s", 0.0), getattr(device, "op_overhead_s", 0.0)
    if out_node is not None and action > 0 and op > 0:
        out[out_node] = action / op
    return out


def comm_cpu(info, device) -> float:
    """CPU seconds a collective's own threads take from its rank's compute (``DeviceSpec.comm_cpu_s`` per collective
    -- a node issuing several, ``info.parts``, pays it for each -- + ``comm_cpu_per_byte`` x its buffer's bytes; 0
    where calibrate() found spare cores for them)."""
    per, per_byte = getattr(device, "comm_cpu_s", 0.0), getattr(device, "comm_cpu_per_byte", 0.0)
    if not (per or per_byte) or info is None or info.kind in ("send", "recv"):
        return 0.0
    return per * max(1, len(getattr(info, "parts", ()))) + per_byte * info.nbytes


def _returned_nodes(gm) -> set:
    out = [n for n in gm.graph.nodes if n.op == "output"]
    found: set = set()
    if out:
        torch.fx.node.map_arg(out[0].args, found.add)
    return found


def _waited_via_getitem(n) -> bool:
    return any(u.target is operator.getitem and any(w.target is _WAIT for w in u.users) for u in n.users)


def compile_program(gm, cluster, cache: dict, fused: bool = False) -> Program:
    """The :class:`Program` of ``gm``, shared by graph identity, then by (code, input shapes); ``fused``: priced as an
    op-fusing compiler runs it (:mod:`cost_models.fusion`)."""
    ikey = id(gm) if not fused else ("fused", id(gm))
    p = cache.get(ikey)
    if p is not None:
        return p
    phs = tuple((tuple(v.shape), v.dtype) if hasattr(v, "shape") else repr(v)
                for v in (n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"))
    skey = (hash(gm.code), phs) + (("fused",) if fused else ())
    base = cache.get(skey)
    if base is not None and base.gm.code == gm.code:
        p = Program.__new__(Program)
        p.__dict__.update(base.__dict__)
        p.gm = gm
        p.liveness = base.liveness.rebound(base.gm, gm)     # the step walk links graphs by their own fake storages
        p.comm_nodes = [n for n in gm.graph.nodes if M.COMM.name in n.meta]
        p.infos = [n.meta[M.COMM.name] for n in p.comm_nodes]
        p.comm_names = [n.name for n in p.comm_nodes]
    else:
        p = Program(gm, cluster, fused)
        cache[skey] = p
    cache[ikey] = p
    return p


class CoreSharing:
    """How the CPU ranks of a node share its cores while they compute: processor sharing.

    A node of ``cores`` cores (``DeviceSpec.host_cores``) runs ``ranks`` ranks (``ClusterSpec.devices_per_node``), one
    compute thread each; calibrate() measured the compute figures while every rank computed at once, each on
    ``share`` of a core (``DeviceSpec.core_share``: its CPU seconds over the wall seconds). What kept the share
    under ``cores / ranks`` is other load on the node, ``background = cores / share - ranks`` threads as busy as a
    rank (0 where the share came out at least the fair one). The scheduler gives every runnable thread an equal
    part, at most a core: with ``k`` of the ranks computing, each runs on ``min(1, cores / (k + background))`` of
    a core, :meth:`speed` times as fast as calibrated. With ``k = ranks`` that is 1: a step in which every rank
    computes at once (data parallelism's) is priced as before.

    ``node_of``: rank -> node index (only the ranks whose node shares its cores; the others compute as costed);
    ``nodes``: node index -> ``(cores, ranks, background)``."""

    def __init__(self, node_of: dict, nodes: dict):
        self.node_of = node_of
        self.nodes = nodes

    @classmethod
    def of(cls, cluster, ranks) -> "CoreSharing | None":
        """The sharing of ``cluster``'s nodes among ``ranks`` (the worker ranks of a step), or None where no node's
        CPU ranks outnumber its cores (``DeviceSpec.host_cores`` 0, GPUs, a core per rank): there every compute step
        takes its seconds as costed."""
        per = getattr(cluster, "devices_per_node", 1)
        world = getattr(cluster, "world_size", per)
        node_of, nodes = {}, {}
        for r in ranks:
            if not 0 <= r < world:
                continue                              # a CPU server: a machine of its own
            d = cluster.device_of(r) if hasattr(cluster, "device_of") else cluster.device
            cores = getattr(d, "host_cores", 0)
            if d.kind != "cpu" or not cores or per <= cores:
                continue
            node = r // per
            share = min(1.0, max(1e-6, getattr(d, "core_share", 1.0)))
            nodes.setdefault(node, (cores, per, max(0.0, cores / share - per)))
            node_of[r] = node
        return cls(node_of, nodes) if node_of else None

    def speed(self, node: int, computing: int) -> float:
        """How many times as fast as calibrated a rank of ``node`` computes while ``computing`` of its node's ranks
        (itself included) compute: ``min(1, cores / (computing + background))`` over the same at every rank."""
        cores, ranks, background = self.nodes[node]
        return min(1.0, cores / (computing + background)) / min(1.0, cores / (ranks + background))


class SimResult:
    """Per-rank outcome: compute intervals, comm intervals, end time."""

    def __init__(self):
        self.compute: list = []     # (start, dur, segment index)
        self.comm: list = []        # (start, dur, comm index)
        self.end = 0.0


def _group_key(info):
    if info.kind in _P2P:
        return ("p2p", info.ranks[0], info.ranks[-1])
    return tuple(sorted(info.ranks))


def simulate(programs: dict, durations: dict, symmetric: bool = False, late_recv_s: float | dict = 0.0,
             latency: dict | None = None, slots: int = 1, sharing: CoreSharing | None = None) -> dict:
    """Run ``programs`` (rank -> Program); ``durations[rank][k]`` is comm k's seconds.

    ``slots`` > 1 (gloo: ``cost_models.comm.GLOO_THREADS``, its worker threads per group): a rank's
    collectives still start in issue order, but a collective may start while up to ``slots - 1`` earlier
    ones are in flight. In flight together, their latency parts (``latency[rank][k]``, from
    :func:`cost_models.comm.latency_part`) overlap and their bytes share the wire: a collective ends at
    ``max(start + its seconds, the wire's end + its byte time)``. With one collective in flight at a
    time this is the one-lane rule above.

    A program is anything with ``steps``, ``infos`` and ``comm_names`` (a :class:`Program`, or a
    :class:`cost_models.sequence.SequenceProgram`). With ``symmetric=True`` each rank is simulated
    alone: its collectives start when its own lane is free, which is exact when every member of
    each group runs the same program.

    ``late_recv_s`` (``DeviceSpec.late_recv_s``, measured by :mod:`fxpar.tools.calibrate`): a
    send/recv pair whose receive is issued after its send *while the sender is computing* takes that
    much longer on both ends: the receiver was not reading when the send was posted, and gloo
    finishes the write on the sender's CPU, which must be scheduled beside the sender's compute.
    A receive that is already waiting when the send comes, or whose sender is itself waiting,
    costs only the transfer. Which messages pay depends on the timeline, which the overheads
    shift: the simulation is re-run with the set found on the previous run until the set is
    stable (at most ``_LATE_PASSES`` runs; usually two). A dict ``{rank: seconds}`` gives each sender its own
    (a heterogeneous cluster's devices).

    ``sharing`` (:class:`CoreSharing`, not with ``symmetric``): ranks of a node share its cores; every rank
    advances in time order, each compute step at :meth:`CoreSharing.speed` of the ranks of its node computing
    meanwhile, so that its recorded interval is the wall time it took. None: each compute step takes its seconds.
    """
    multi = (latency, slots) if slots > 1 and latency is not None else None
    if isinstance(late_recv_s, dict) and not any(late_recv_s.values()):
        late_recv_s = 0.0
    if not late_recv_s:
        return _simulate_once(programs, durations, symmetric, 0.0, frozenset(), None, multi, sharing)
    penalize: frozenset = frozenset()
    for _ in range(_LATE_PASSES):
        late: list = []
        res = _simulate_once(programs, durations, symmetric, late_recv_s, penalize, late, multi, sharing)
        busy = frozenset(cid for cid, src, t_r in late if _computing(res[src].compute, t_r))
        if busy == penalize:
            break
        penalize = busy
    return res


_LATE_PASSES = 4


def _computing(intervals: list, t: float) -> bool:
    """Whether one of the ``(start, dur, _)`` compute intervals (in time order) covers ``t``."""
    i = bisect_right(intervals, t, key=lambda x: x[0]) - 1
    return i >= 0 and intervals[i][0] <= t < intervals[i][0] + intervals[i][1]


def _simulate_once(programs, durations, symmetric, late_recv_s, penalize, late, multi=None, sharing=None) -> dict:
    """One run; the p2p pairs in ``penalize`` take ``late_recv_s`` longer; ``late`` (a list, or None)
    collects ``(pair id, sender, recv issue time)`` of each pair whose recv was issued after its send.
    ``multi``: (latency parts, slots) for collectives that may overlap; ``sharing``: shared cores (see
    :func:`simulate`)."""
    ranks = sorted(programs)
    res = {r: SimResult() for r in ranks}
    pc = dict.fromkeys(ranks, 0)
    t_c = dict.fromkeys(ranks, 0.0)
    # a lane is a rank's collective lane (key: the rank) or one p2p channel end (key: (rank, group))
    lane: dict = dict.fromkeys(ranks, 0.0)
    queue: dict = {r: [] for r in ranks}     # lane -> comm ids in issue order
    qhead: dict = dict.fromkeys(ranks, 0)
    seq: dict = {}                           # (rank, group key) -> count issued
    issued: dict = {}                        # comm id -> {rank: (issue time, k)}
    end_of: dict = {}                        # (rank, k) -> end time

    gid_of: dict = {}                        # id(CommInfo.ranks) -> small int naming the group
    gid_key: dict = {}                       # group key -> small int
    gmembers: list = []                      # small int -> member ranks
    gp2p: list = []                          # small int -> is a p2p channel

    def group_id(info):
        p2p = info.kind in _P2P
        g = gid_of.get((id(info.ranks), p2p))
        if g is None:
            key = _group_key(info)
            g = gid_key.setdefault(key, len(gid_key))
            if g == len(gmembers):
                gmembers.append(key[1:] if p2p else key)
                gp2p.append(p2p)
            gid_of[(id(info.ranks), p2p)] = g
        return g

    def members(cid):
        return (cid[2],) if symmetric else gmembers[cid[0]]

    def lane_of(m, g):
        if gp2p[g]:
            lk = (m, g)
            if lk not in queue:
                lane[lk], queue[lk], qhead[lk] = 0.0, [], 0
            return lk
        return m

    at_head: dict = {}                       # comm id -> members that issued it and have it next in line
    if multi is not None:                    # a rank's collective slots: their end times, its wire, last start
        lat, n_slots = multi
        slot_end = {r: [0.0] * n_slots for r in ranks}
        wire_end = dict.fromkeys(ranks, 0.0)
        last_start = dict.fromkeys(ranks, 0.0)

    def resolve(cid, work):
        mem = members(cid)
        got = issued[cid]
        g = cid[0]
        if multi is not None and not gp2p[g]:
            resolve_overlapping(cid, work, mem, got)
            return
        lanes = [lane_of(m, g) for m in mem] if gp2p[g] else mem
        start = max(max(got[m][0], lane[lk]) for m, lk in zip(mem, lanes))
        extra = 0.0
        if late is not None and gp2p[g] and len(mem) == 2 and got[mem[0]][0] < got[mem[1]][0]:
            late.append((cid, mem[0], got[mem[1]][0]))
            pay = late_recv_s.get(mem[0], 0.0) if isinstance(late_recv_s, dict) else late_recv_s
            extra = pay if cid in penalize else 0.0
        for m, lk in zip(mem, lanes):
            k = got[m][1]
            dur = durations[m][k] + extra
            lane[lk] = start + dur
            end_of[(m, k)] = start + dur
            res[m].comm.append((start, dur, k))
            advance(lk, work)

    def advance(lk, work):
        qhead[lk] += 1
        if qhead[lk] < len(queue[lk]):
            nxt = queue[lk][qhead[lk]]
            at_head[nxt] = at_head.get(nxt, 0) + 1
            if at_head[nxt] == len(members(nxt)):
                work.append(nxt)

    def resolve_overlapping(cid, work, mem, got):
        """A collective on ranks with several slots: it starts after its issue, after the previous one on each
        member started, and when a slot is free; latencies overlap, bytes queue on the wire."""
        start = max(max(got[m][0], last_start[m], min(slot_end[m])) for m in mem)
        end = 0.0
        for m in mem:
            k = got[m][1]
            dur, lp = durations[m][k], lat[m][k]
            end = max(end, start + dur, wire_end[m] + (dur - lp))
        for m in mem:
            k = got[m][1]
            ends = slot_end[m]
            ends[ends.index(min(ends))] = end
            wire_end[m] = max(wire_end[m], start) + (durations[m][k] - lat[m][k])
            last_start[m] = start
            lane[m] = min(ends)
            end_of[(m, k)] = end
            res[m].comm.append((end - durations[m][k], durations[m][k], k))   # its own seconds, ending when it ends
            advance(m, work)

    def issue(r, k, t):
        g = group_id(programs[r].infos[k])
        n = seq.get((r, g), 0)
        seq[(r, g)] = n + 1
        cid = (g, n, r) if symmetric else (g, n)
        issued.setdefault(cid, {})[r] = (t, k)
        lk = lane_of(r, g) if gp2p[g] else r
        queue[lk].append(cid)
        if qhead[lk] == len(queue[lk]) - 1:          # nothing ahead of it on this lane
            at_head[cid] = at_head.get(cid, 0) + 1
            if at_head[cid] == len(members(cid)):
                work = [cid]
                while work:
                    resolve(work.pop(), work)

    if sharing is not None:
        _run_shared(ranks, programs, res, pc, t_c, end_of, issue, sharing)
    moved = True
    while moved:
        moved = False
        for r in ranks:
            steps = programs[r].steps
            i, t = pc[r], t_c[r]
            while i < len(steps):
                st = steps[i]
                if st[0] == "compute":
                    res[r].compute.append((t, st[1], st[2]))
                    t += st[1]
                elif st[0] == "issue":
                    issue(r, st[1], t)
                else:
                    e = end_of.get((r, st[1]))
                    if e is None:
                        break
                    t = max(t, e)
                i += 1
            if i != pc[r]:
                moved = True
            pc[r], t_c[r] = i, t
    stuck = [r for r in ranks if pc[r] < len(programs[r].steps)]
    unmatched = [lk for lk in queue if qhead[lk] < len(queue[lk])]
    if stuck or unmatched:
        raise DeadlockError(_deadlock_message(programs, stuck, unmatched, queue, qhead, issued, pc, members, lane_of))
    for r in ranks:
        comm_end = max((s + d for s, d, _ in res[r].comm), default=0.0)
        res[r].end = max(t_c[r], comm_end)
    return res


def _run_shared(ranks, programs, res, pc, t_c, end_of, issue, sharing) -> None:
    """Advance every rank in time order, each compute step at :meth:`CoreSharing.speed` of the ranks of its node
    computing meanwhile (processor sharing): at each moment the ranks not computing run their issues and finished
    waits; then time moves to the next end of a compute step or of a wait, each computing rank doing
    ``speed x elapsed`` seconds of its step's (calibrated) work. Leaves ``pc``/``t_c`` where the ranks stopped (all
    done, or blocked on a comm nobody completes: the caller's loop reports the deadlock)."""
    now = 0.0
    left: dict = {}                    # rank -> (seconds of work left in its compute step, when the step started)
    wake: dict = {}                    # rank -> when the comm it waits on ends (later than now)
    node_of = sharing.node_of
    while True:
        for r in ranks:                # what each idle rank does at this moment
            steps, i = programs[r].steps, pc[r]
            if r in left or r in wake or i == len(steps):
                continue
            while i < len(steps):
                st = steps[i]
                if st[0] == "compute":
                    if st[1] > 0:
                        left[r] = (st[1], now)
                        break
                    res[r].compute.append((now, st[1], st[2]))
                elif st[0] == "issue":
                    issue(r, st[1], now)
                else:
                    e = end_of.get((r, st[1]))
                    if e is None:
                        break
                    if e > now:
                        wake[r] = e
                        break
                i += 1
            pc[r], t_c[r] = i, now
        for r in ranks:                # an issue above may have ended a wait of a rank swept before it
            if r not in left and r not in wake and pc[r] < len(programs[r].steps):
                st = programs[r].steps[pc[r]]
                if st[0] == "wait" and end_of.get((r, st[1])) is not None:
                    break
        else:
            r = None
        if r is not None:
            continue
        if not left and not wake:
            return
        computing: dict = {}
        for r in left:
            node = node_of.get(r)
            if node is not None:
                computing[node] = computing.get(node, 0) + 1
        rate = {r: sharing.speed(node_of[r], computing[node_of[r]]) if r in node_of else 1.0 for r in left}
        nxt = min([now + w / rate[r] for r, (w, _) in left.items()] + list(wake.values()))
        for r in list(left):
            w, start = left[r]
            if now + w / rate[r] <= nxt:           # its step ends now
                st = programs[r].steps[pc[r]]
                res[r].compute.append((start, nxt - start, st[2]))
                del left[r]
                pc[r], t_c[r] = pc[r] + 1, nxt
            else:
                left[r] = (w - (nxt - now) * rate[r], start)
        for r in [r for r, e in wake.items() if e <= nxt]:
            del wake[r]
            pc[r], t_c[r] = pc[r] + 1, nxt
        now = nxt


def _describe(programs, r, k) -> str:
    info = programs[r].infos[k]
    return (f"{info.kind} #{k} ({programs[r].comm_names[k]}, axis {info.axis!r}, group {tuple(info.ranks)})")


def _deadlock_message(programs, stuck, unmatched, queue, qhead, issued, pc, members, lane_of) -> str:
    lines = []
    cid_of = {(r, k): cid for cid, got in issued.items() for r, (_, k) in got.items()}

    def why(r, cid):
        missing = [m for m in members(cid) if m not in issued.get(cid, {})]
        text = f"ranks not yet issued: {missing}"
        if not missing:                      # all issued: something older holds a member's lane
            for m in members(cid):
                lk = lane_of(m, cid[0])
                head = queue[lk][qhead[lk]]
                if head != cid:
                    text += (f"; rank {m}'s lane is held by {_describe(programs, m, issued[head][m][1])}, "
                             f"which ranks {[x for x in members(head) if x not in issued[head]]} never issue")
                    break
        return text

    for r in stuck[:8]:
        k = programs[r].steps[pc[r]][1]
        lines.append(f"rank {r} waits on {_describe(programs, r, k)}; {why(r, cid_of[(r, k)])}")
    seen = set()
    for lk in unmatched:
        cid = queue[lk][qhead[lk]]
        r = lk[0] if isinstance(lk, tuple) else lk
        if cid in seen or r in stuck or len(lines) >= 8:
            continue
        seen.add(cid)
        k = issued[cid][r][1]
        lines.append(f"rank {r}'s {_describe(programs, r, k)} never completes; {why(r, cid)}")
    return ("the per-rank programs deadlock:\n  " + "\n  ".join(lines) +
            "\nEvery member of a group must issue its collectives in the same order, and the n-th send "
            "from a rank to another must meet the n-th recv there; check the comm order the passes "
            "(or the schedule) produced for these ranks.")
