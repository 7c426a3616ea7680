"""Herring, Parallax and BytePS vs flat all-reduce vs torch DDP over a bandwidth-capped link.

Every rank runs in one of two network namespaces joined by a tbf-capped veth pair (benchmarks/netns_link.py;
needs root and ``ip netns``, otherwise it says what is missing and runs uncapped). One run visits every cap
(``--rates``, default none, 2gbit, 1gbit, 500mbit) once per round (``--rounds``), every method at every cap:

- **Herring** (Thangakrishnan et al., SC'20), the 4-layer GPT of bench_capped_link.py on 4 ranks: ranks 0, 1
  in namespace A and 2, 3 in B, so the namespaces *are* the two nodes of ``ClusterSpec.local(4, nodes=2,
  devices_per_node=2)`` and the cap is the link between them. ``Strategy(dp=4, grad_sync="herring")`` against
  fxpar's flat all-reduce (``grad_sync="allreduce"``) and torch DDP (25 MB buckets) on the same 4 ranks.
- **Parallax** (Kim et al., EuroSys'19), :class:`Bag` (tests/test_parallax.py's model with a large table),
  2 ranks, one per namespace: ``grad_sync="parallax"`` vs ``"allreduce"`` vs DDP, and DDP with
  ``nn.Embedding(sparse=True)`` (torch's own sparse route: gloo all-gathers the (index, row) pairs). Plain SGD,
  so that torch's sparse route can run at all (AdamW and SGD-momentum refuse sparse gradients); under plain SGD
  fxpar's plan updates only the touched rows too (``Plan.section("parallax").sparse_update``: route ``rows``).
- **BytePS** (Jiang et al., OSDI'20), the GPT, n=2 workers (rank 0 in A, rank 1 in B) + k=1 CPU summation
  server (rank 2) in B: ``ClusterSpec.local(2, cpu_servers=1)``, ``grad_sync="byteps"`` vs all-reduce vs DDP.
  Placement: a BytePS server is a machine of its own, so every byte a worker pushes or pulls goes through
  that worker's NIC. The link is worker 0's NIC here: with the server in B, *all* of worker 0's traffic
  (its all-reduce half and its push/pull half) crosses the link, as the paper's model has it; worker 1's
  push/pull to the server stays inside B (a second NIC the harness does not cap). ``byteps4``: n=4 workers
  (0, 1 in A; 2, 3 in B) + 1 server (rank 4, in B), 5 processes, against the 4-rank all-reduce and DDP. Only
  k=1: NetnsCluster puts the first half of the ranks in A, which with k=2 would move a worker or server across.

Measured per cell: the median step time of the slower rank, and the bytes that crossed the link per step,
read from the veth's counters (``/proc/net/dev`` inside namespace A, rank 0; both directions; TCP/IP headers
included; every step, warm-up ones too, over the number of steps). Predicted: ``Program.estimate()`` of the program
that runs, on ``ClusterSpec.calibrate()`` (this machine's compute and loopback) as 2 nodes -- the namespaces --
whose ``inter_node`` link is the veth as ``netns_link.calibrate_link`` measures it at each cap before the run; the link's bytes from each method's traffic formula; for BytePS also the closed
form of ``cost_models.byteps_traffic.predict`` (communication alone).

    python benchmarks/bench_param_server.py [--rates none,2gbit,1gbit,500mbit] [--steps 4] [--warmup 2] [--rounds 2]
        [--only herring,byteps4,byteps,parallax] [--bucket-mb MB] [--bag-steps 30] [--bag-warmup 12] [--threads T] [--pin]
        [--bag-batch 256] [--bag-seq 16] [--bag-hidden 512] [--comm-priority]
    python benchmarks/netns_link.py --cleanup      # leftovers of a run that was killed hard
"""
import argparse
import copy
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import fxpar  # noqa: E402
from cost_models import byteps_traffic as B  # noqa: E402
from fxpar.cluster import LinkSpec  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402
from bench_capped_link import ddp_steps  # noqa: E402
from netns_link import CappedLink, NetnsCluster, at_cap, calibrate_link, format_rate, parse_rate  # noqa: E402

ADAMW = (torch.optim.AdamW, {"lr": 1e-3})
SGD = (torch.optim.SGD, {"lr": 0.1})


class Bag(torch.nn.Module):
    """tests/test_parallax.py's model: a large embedding (few rows touched per step), a small one, a dense head;
    with ``hidden`` > 0 a per-token MLP (d -> hidden -> d, GELU, residual) before the mean, the dense compute a
    real model has beside its table. ``sparse=True`` gives torch's sparse embedding gradient (for DDP's own
    sparse route)."""

    def __init__(self, vocab=1000, small=6, d=16, classes=4, sparse=False, hidden=0):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d, sparse=sparse)
        self.pos = torch.nn.Embedding(small, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.GELU(),
                                       torch.nn.Linear(hidden, d)) if hidden else None
        self.head = torch.nn.Linear(d, classes)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        x = self.emb(ids) + self.pos(pos)
        if self.mlp is not None:
            x = x + self.mlp(x)
        return self.head(x.mean(1))


# ---- on the ranks ----------------------------------------------------------------------------------------
def _link_counters(dev):
    """(tx, rx) bytes of veth ``dev`` as this process's namespace sees it (None where there is no such device)."""
    if dev is None:
        return None
    for line in open("/proc/net/dev").read().splitlines()[2:]:
        name, rest = line.split(":", 1)
        if name.strip() == dev:
            f = rest.split()
            return int(f[8]), int(f[0])
    return None


def _crossed(c0, c1, n_steps):
    if c0 is None or c1 is None:
        return None
    return {"a_to_b": (c1[0] - c0[0]) / n_steps, "b_to_a": (c1[1] - c0[1]) / n_steps}


def fx_cell(payload, batches, warmup, dev=None, extras=()):
    """An fxpar rank: a rank beside the workers serves (a BytePS server sums, fxpar.runtime.server); a worker runs
    ``Executor.step`` per batch, drains, releases the servers. Rank 0 reads the link's counters around the steps."""
    from fxpar.feature import ExtraRank
    from fxpar.runtime.executor import Executor
    if isinstance(payload, ExtraRank):
        payload.serve()
        return None
    ex = Executor(payload)
    c0 = _link_counters(dev) if payload.rank == 0 else None
    for b in batches:
        ex.step(b)
    ex.drain()
    for s in extras:
        s.release()
    c1 = _link_counters(dev) if payload.rank == 0 else None
    return {"step_times": ex.step_times[warmup:], "link": _crossed(c0, c1, len(batches))}


def ddp_cell(model, batches, loss_fn, optimizer, bucket_cap_mb, warmup, dev=None):
    """torch DDP, timed as bench_capped_link's ``ddp_bench_worker``; rank 0 reads the link's counters after
    DDP's construction (its broadcast of the weights is not a step's traffic)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = dist.get_rank()
    m = DDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
    cls, kw = optimizer
    opt = cls(m.parameters(), **kw)
    dist.barrier()
    c0 = _link_counters(dev) if rank == 0 else None
    times = ddp_steps(m, opt, batches, loss_fn, warmup)
    c1 = _link_counters(dev) if rank == 0 else None
    dist.barrier()
    return {"step_times": times, "link": _crossed(c0, c1, len(batches))}


# ---- in the parent: programs, predictions ----------------------------------------------------------------
_LINKS = {}              # bps -> LinkSpec of the veth measured at that cap (netns_link.calibrate_link)
_RAW = {}                # bps -> that cap's raw figures (what an overlapped transfer takes from compute: at_cap)


def capped(spec, bps):
    """``spec`` (2 nodes: the namespaces) with the link between them at ``bps`` (None: uncapped): the veth as
    measured at that cap through the harness, with what a transfer there takes from the compute it overlaps, else
    (no harness) the cap's nominal rate with the loopback's α."""
    if bps in _LINKS:
        return at_cap(replace(spec, inter_node=_LINKS[bps]), _RAW.get(bps))
    return replace(spec, inter_node=spec.intra_node if bps is None else LinkSpec(bps / 8, spec.intra_node.latency))


def predicted_steps(prog, model, batch, loss_fn, opt, strategy, spec, rates):
    """``Program.estimate().step_time_s`` of the program that runs (its Plan handed back, so every choice the
    planner made for it is kept) on ``spec`` with the link at each cap."""
    out = {}
    for bps in rates:
        plan = fxpar.Plan.from_json(prog.plan.to_json())
        again = fxpar.parallelize(model, capped(spec, bps), batch, loss_fn=loss_fn, optimizer=opt, strategy=strategy,
                                  plan=plan)
        out[bps] = again.estimate().step_time_s
    return out


class Section:
    """Methods (name -> (rank function, per-rank arguments)) that run on one world of ranks; sections with the
    same ``table`` are printed together (BytePS's servers need a world of their own)."""

    def __init__(self, table, world, methods, predicted, link_bytes):
        self.table, self.world, self.methods = table, world, methods
        self.predicted, self.link_bytes = predicted, link_bytes


def fx_method(prog, batches, warmup, n_ranks):
    """Per-rank argument builder for an fxpar program (BytePS: workers, then servers)."""
    n = len(batches)
    if prog.layout is not None:          # as run_local does: the loss's extra columns (fxpar/inputs.py)
        from fxpar.inputs import prepare_batch
        batches = [prepare_batch(prog, b, f"batches[{i}]") for i, b in enumerate(batches)]
    payloads = [prog.payload(r, n_batches=n) for r in range(prog.world_size)]
    servers = prog.extra_ranks()
    assert prog.world_size + len(servers) == n_ranks, (prog.world_size, len(servers), n_ranks)
    return fx_cell, lambda dev: [(p, batches, warmup, dev, servers) for p in payloads] + \
        [(s, None, warmup) for s in servers]


def ddp_method(model, batches, loss_fn, opt, warmup, world, mb=25.0):
    return ddp_cell, lambda dev: [(model, batches, loss_fn, opt, mb, warmup, dev)] * world


_SPECS = {}


_THREADS = [None]        # --threads: torch threads per rank, in the calibration and the runs
_PIN = [False]           # --pin: every rank on its own cores, in the calibration and the runs
_PRIO = [False]          # --comm-priority: gloo's threads under SCHED_FIFO, in the calibration and the runs


def calibrated(world):
    """``ClusterSpec.calibrate(world)`` once per world size; 4 ranks are 2 nodes x 2 (the namespaces)."""
    if world not in _SPECS:
        spec = fxpar.ClusterSpec.calibrate(world_size=world, threads=_THREADS[0], pin=_PIN[0], comm_priority=_PRIO[0])
        _SPECS[world] = capped(replace(spec, nodes=2, devices_per_node=world // 2), None)   # planned on the veth
    return _SPECS[world]


def gpt_table(world):
    return f"GPT on {world} ranks ({world // 2} in A | {world // 2} in B)"


def ring_link_bytes(nbytes, n):
    """Bytes a ring all-reduce over ranks 0..n-1 (the first half in A) puts on the link per step, both ways:
    the ring crosses the cut once each way ((n/2-1) -> n/2 and n-1 -> 0), each hop carrying 2(n-1)/n · S."""
    return 2 * B.allreduce_bytes(nbytes, n)


def baseline_section(args, gpt, batches, n):
    """fxpar's flat all-reduce (``--bucket-mb`` buckets) and DDP (25 MB) on the GPT over n ranks."""
    spec, v = calibrated(n), _nbytes(gpt)
    st = fxpar.Strategy(dp=n, grad_sync="allreduce", bucket_cap_mb=args.bucket_mb)
    prog = fxpar.parallelize(gpt, spec, batches[0], loss_fn=gpt_loss, optimizer=ADAMW, strategy=st)
    return Section(gpt_table(n), n, {"fxpar allreduce": fx_method(prog, batches, args.warmup, n),
                                     "DDP 25MB": ddp_method(gpt, batches, gpt_loss, ADAMW, args.warmup, n)},
                   {"fxpar allreduce": predicted_steps(prog, gpt, batches[0], gpt_loss, ADAMW, st, spec, args.rates)},
                   {"fxpar allreduce": ring_link_bytes(v, n), "DDP 25MB": ring_link_bytes(v, n)})


def herring_section(args, gpt, batches):
    """Herring on 2 nodes x 2 ranks: per bucket of V bytes, ranks 0<->2 and 1<->3 all-reduce a V/2 shard across
    the link (V/2 each way per pair); the reduce-scatter and all-gather stay inside each namespace. "herring at
    wait": the same Plan edited to ``section("herring").overlap = False`` (steps 2-3 after backward, passes/herring.py)."""
    spec, v = calibrated(4), _nbytes(gpt)
    st = fxpar.Strategy(dp=4, grad_sync="herring", bucket_cap_mb=args.bucket_mb)
    prog = fxpar.parallelize(gpt, spec, batches[0], loss_fn=gpt_loss, optimizer=ADAMW, strategy=st)
    plan = fxpar.Plan.from_json(prog.plan.to_json())
    plan.section("herring").overlap = False
    late = fxpar.parallelize(gpt, spec, batches[0], loss_fn=gpt_loss, optimizer=ADAMW, strategy=st, plan=plan)
    bc = prog.plan.section("herring").bucket_choice
    print(f"herring: {len(prog.plan.section('data_parallel').buckets[0])} buckets of {bc['cap_bytes'] / 2**20:g} MiB ({bc['by']}"
          + (": predicted " + ", ".join(f"{mb} MiB {t * 1e3:.1f} ms" for mb, t in bc["tried"].items()) if "tried" in bc
             else "") + ")", flush=True)
    link = 2 * 2 * B.allreduce_bytes(v / 2, 2)
    return Section(gpt_table(4), 4, {"fxpar herring": fx_method(prog, batches, args.warmup, 4),
                                     "herring at wait": fx_method(late, batches, args.warmup, 4)},
                   {"fxpar herring": predicted_steps(prog, gpt, batches[0], gpt_loss, ADAMW, st, spec, args.rates)},
                   {"fxpar herring": link, "herring at wait": link})


def byteps_section(args, gpt, batches, n, k):
    """BytePS, n workers (half in A, half in B) + k CPU servers after them (in B). Link bytes per step: the
    workers' ring all-reduce of their W part crosses the cut as any ring does; the n/2 workers of A push k·P
    across and pull k·P back (P: one server's partition)."""
    spec = replace(calibrated(n), cpu_servers=k, server_nodes=(1,) * k)    # the servers sit in namespace B (node 1)
    st = fxpar.Strategy(dp=n, grad_sync="byteps")
    prog = fxpar.parallelize(gpt, spec, batches[0], loss_fn=gpt_loss, optimizer=ADAMW, strategy=st)
    sizes = {key: p.numel() * 4 for key, p in gpt.named_parameters()}
    vs = [sum(sizes[key] for key in b) for b in prog.plan.section("data_parallel").buckets[0]]
    split = [B.split_bucket(x // 4, n, k) for x in vs]
    w, p = sum(s[0] for s in split) * 4, sum(s[1] for s in split) * 4
    link = ring_link_bytes(w, n) + 2 * (n // 2) * k * p
    name = f"fxpar byteps k={k}"
    sec = Section(gpt_table(n), n + k, {name: fx_method(prog, batches, args.warmup, n + k)},
                  {name: predicted_steps(prog, gpt, batches[0], gpt_loss, ADAMW, st, spec, args.rates)}, {name: link})
    closed = {bps: B.predict(vs, n, k, bandwidth=(bps / 8 if bps else spec.intra_node.bandwidth)) for bps in args.rates}
    return sec, closed


def parallax_section(args):
    """Parallax on Bag, 2 ranks: the sparse route gathers each rank's T token ids (int64) and T rows; the dense
    rest is all-reduced (2 ranks: V each way). torch's sparse embedding gradient goes the same way in gloo."""
    torch.manual_seed(0)
    model = Bag(vocab=args.vocab_big, small=args.bag_seq, d=args.bag_d, hidden=args.bag_hidden)
    sparse = copy.deepcopy(model)
    sparse.emb.sparse = True
    n = args.bag_warmup + args.bag_steps          # a step is ms: more of them, for a median that holds still
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, args.vocab_big, (args.bag_batch, args.bag_seq), generator=g),
                torch.randint(0, 4, (args.bag_batch,), generator=g)) for _ in range(n)]
    spec = calibrated(2)
    methods, predicted = {}, {}
    for name in ("parallax", "allreduce"):
        st = fxpar.Strategy(dp=2, grad_sync=name)
        prog = fxpar.parallelize(model, spec, batches[0], loss_fn=F.cross_entropy, optimizer=SGD, strategy=st)
        if name == "parallax":
            px = prog.plan.section("parallax")
            route = px.routes["emb.weight"]
            update = px.sparse_update["emb.weight"]["route"]   # plain SGD: "rows"
            assert px.sparse == ["emb.weight"], px
        methods[f"fxpar {name}"] = fx_method(prog, batches, args.bag_warmup, 2)
        predicted[f"fxpar {name}"] = predicted_steps(prog, model, batches[0], F.cross_entropy, SGD, st, spec, args.rates)
        if name == "parallax":       # the same pairs, the update through a dense [V, d] gradient (the route before rows)
            plan = fxpar.Plan.from_json(prog.plan.to_json())
            plan.section("parallax").sparse_update["emb.weight"]["route"] = "dense"
            dense_upd = fxpar.parallelize(model, spec, batches[0], loss_fn=F.cross_entropy, optimizer=SGD, strategy=st,
                                          plan=plan)
            methods["parallax dense upd"] = fx_method(dense_upd, batches, args.bag_warmup, 2)
    methods["DDP 25MB"] = ddp_method(model, batches, F.cross_entropy, SGD, args.bag_warmup, 2)
    methods["DDP sparse emb"] = ddp_method(sparse, batches, F.cross_entropy, SGD, args.bag_warmup, 2)
    v = _nbytes(model)
    dense = v - model.emb.weight.numel() * 4
    t = args.bag_batch // 2 * args.bag_seq
    pairs = 2 * (t * 8 + t * args.bag_d * 4 + dense)
    table = (f"Parallax: Bag, table {args.vocab_big}x{args.bag_d} ({model.emb.weight.numel() * 4 / 2**20:.1f} MiB), "
             f"{t} tokens per rank" + (f", MLP {args.bag_d}-{args.bag_hidden}-{args.bag_d}" if args.bag_hidden else "") + ", 2 ranks (A | B), plain SGD; the plan's routes for emb.weight: sparse "
             f"{route['sparse_bytes'] / 2**10:.1f} KiB vs dense {route['dense_bytes'] / 2**20:.1f} MiB per rank, "
             f"update route {update!r}")
    return Section(table, 2, methods, predicted, {"fxpar parallax": pairs, "parallax dense upd": pairs,
                                                  "fxpar allreduce": 2 * v,
                                                  "DDP 25MB": 2 * v, "DDP sparse emb": pairs})


def _nbytes(model):
    return sum(p.numel() for p in model.parameters()) * 4


# ---- the run ---------------------------------------------------------------------------------------------
def per_step_max(outs):
    outs = [o for o in outs if o is not None]
    return [max(o["step_times"][i] for o in outs) for i in range(len(outs[0]["step_times"]))]


def loadavg():
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(sections, args):
    res, link_meas, loads = {}, {}, []
    t0 = time.perf_counter()
    with CappedLink() as link:
        print("link: " + (f"veth {link.names.dev_a} <-> {link.names.dev_b}, tbf per direction, no latency (no netem)"
                          if link.active else f"UNCAPPED 127.0.0.1 (missing: {link.missing})"), flush=True)
        dev = link.names.dev_a if link.active else None
        for rnd in range(args.rounds):
            for sec in sections:                 # every round visits every cap of every section
                with NetnsCluster(sec.world, link, threads=_THREADS[0], pin=_PIN[0], comm_priority=_PRIO[0]) as cl:
                    for bps in args.rates:
                        link.set_rate(bps)
                        for name, (fn, argv) in sec.methods.items():
                            outs = cl.run(fn, argv(dev))
                            key = (sec.table, name, bps)
                            res.setdefault(key, []).extend(per_step_max(outs))
                            if outs[0]["link"] is not None:
                                link_meas.setdefault(key, []).append(outs[0]["link"])
                print(f"    {sec.table}: {', '.join(sec.methods)} done (load {loadavg()})", flush=True)
            loads.append(loadavg())
            print(f"  round {rnd + 1}/{args.rounds} done ({time.perf_counter() - t0:.0f} s, load {loads[-1]})",
                  flush=True)
    return res, link_meas, loads, time.perf_counter() - t0


def report(sections, res, link_meas, args, closed):
    """One table per model and world: median step (the slower rank), its quartiles and mean, the prediction (against
    the median, and against the mean: ``estimate()`` predicts a run's time per step, and where steps are heavy-tailed
    -- a few ms of small collectives, one in ten waiting a scheduler tick -- the mean is what a run takes), the
    link's bytes per step (measured on the veth, and by the method's formula), the ratio to fxpar all-reduce and
    DDP (of the medians)."""
    tables = {}
    for sec in sections:
        tables.setdefault(sec.table, []).append(sec)
    for table, secs in tables.items():
        names = [nm for sec in secs for nm in sec.methods]
        pred = {k: v for sec in secs for k, v in sec.predicted.items()}
        formula = {k: v for sec in secs for k, v in sec.link_bytes.items()}
        print(f"\n{table}")
        print(f"{'cap':>8} | {'method':>18} | {'step ms':>7} | {'quartiles':>9} | {'mean':>6} | {'predicted':>9} | "
              f"{'pred/meas':>9} | {'pred/mean':>9} | "
              f"{'link MiB/step':>13} | {'formula':>7} | {'/allreduce':>10} | {'/DDP':>5}")
        for bps in args.rates:
            med = {nm: statistics.median(res[(table, nm, bps)]) for nm in names}
            for nm in names:
                ts = res[(table, nm, bps)]
                q = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) > 1 else [med[nm]] * 3
                p = pred.get(nm, {}).get(bps)
                lm = link_meas.get((table, nm, bps))
                mib = statistics.median(x["a_to_b"] + x["b_to_a"] for x in lm) / 2**20 if lm else float("nan")
                mean = statistics.fmean(ts)
                rel = lambda other: f"{med[nm] / med[other]:.3f}" if other in med else "-"   # noqa: E731
                print(f"{format_rate(bps):>8} | {nm:>18} | {med[nm] * 1e3:7.1f} | {q[0] * 1e3:4.0f}-{q[2] * 1e3:<4.0f} | "
                      f"{mean * 1e3:6.1f} | "
                      + (f"{p * 1e3:9.1f} | {p / med[nm]:9.2f} | {p / mean:9.2f}" if p else f"{'-':>9} | {'-':>9} | {'-':>9}")
                      + f" | {mib:13.2f} | {formula.get(nm, float('nan')) / 2**20:7.2f} | "
                      f"{rel('fxpar allreduce'):>10} | {rel('DDP 25MB'):>5}")
    for n, per_rate in closed.items():
        print(f"\nBytePS closed form, n={n} workers, k=1 (cost_models.byteps_traffic.predict; communication alone, no overlap):")
        for bps, c in per_rate.items():
            print(f"  {format_rate(bps):>8}: byteps {c['time_s'] * 1e3:7.1f} ms vs ring all-reduce "
                  f"{c['allreduce_time_s'] * 1e3:7.1f} ms (gain {c['gain']:.2f}; per worker "
                  f"{c['worker_bytes'] / 2**20:.1f} MiB, per server {c['server_bytes'] / 2**20:.1f} MiB, all-reduce "
                  f"{c['allreduce_bytes'] / 2**20:.1f} MiB)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="none,2gbit,1gbit,500mbit")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="herring,byteps4,byteps,parallax", help="any of herring, parallax, byteps, byteps4 "
                    "(BytePS with 4 workers + 1 server: 5 processes on this machine)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab-big", type=int, default=200_000)
    ap.add_argument("--bag-d", type=int, default=32)
    ap.add_argument("--bag-seq", type=int, default=16)
    ap.add_argument("--bag-batch", type=int, default=256)
    ap.add_argument("--bag-hidden", type=int, default=512, help="the Bag's per-token MLP width (0: none)")
    ap.add_argument("--bag-warmup", type=int, default=12,
                    help="warm-up steps of the Parallax section (the first cell on fresh ranks ran 30-40%% slower for "
                         "tens of steps)")
    ap.add_argument("--bag-steps", type=int, default=30,
                    help="timed steps per round of the Parallax section (its steps take milliseconds: the median of "
                         "a few is noise)")
    ap.add_argument("--pin", action="store_true",
                    help="pin every rank to its own cores (fxpar.tools.calibrate.rank_cores), in the calibration too")
    ap.add_argument("--comm-priority", action="store_true",
                    help="every rank's gloo threads under SCHED_FIFO (ClusterSpec.comm_priority), torch DDP's too, in "
                         "the calibration too")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per rank (default: the cores split over the ranks); the calibration uses the same")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="fxpar's bucket cap (MB) for the GPT sections (default: DDP's 25 MB; Herring's chosen by the planner)")
    args = ap.parse_args()
    args.rates = [parse_rate(r) for r in args.rates.split(",")]
    only = args.only.split(",")
    _THREADS[0], _PIN[0], _PRIO[0] = args.threads, args.pin, args.comm_priority
    print(f"load average at start: {loadavg()}", flush=True)
    _LINKS.update(calibrate_link(args.rates, threads=args.threads, pin=args.pin, comm_priority=args.comm_priority,
                                 raw=_RAW))
    for bps, link in _LINKS.items():
        print(f"veth measured at {format_rate(bps)}: {link.bandwidth * 8 / 1e9:.2f} Gbit/s, α {link.latency * 1e6:.0f} us",
              flush=True)
    torch.manual_seed(0)
    gpt = GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=max(1, args.d // 64), max_seq=args.seq)
    n = args.warmup + args.steps
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq)), torch.randint(0, args.vocab, (args.batch, args.seq)))
               for _ in range(n)]
    v = _nbytes(gpt)
    print(f"GPT {args.layers} layers, d={args.d}, vocab={args.vocab}: {v / 4e6:.2f}M parameters, {v / 2**20:.1f} MiB "
          f"of fp32 gradients; global batch {args.batch}x{args.seq}; AdamW", flush=True)
    sections, closed = [], {}
    if "herring" in only or "byteps4" in only:
        sections.append(baseline_section(args, gpt, batches, 4))
    if "herring" in only:
        sections.append(herring_section(args, gpt, batches))
    if "byteps4" in only:
        sec, closed[4] = byteps_section(args, gpt, batches, 4, 1)
        sections.append(sec)
    if "byteps" in only:
        sections.append(baseline_section(args, gpt, batches, 2))
        sec, closed[2] = byteps_section(args, gpt, batches, 2, 1)
        sections.append(sec)
    if "parallax" in only:
        sections.append(parallax_section(args))
    for w, spec in _SPECS.items():
        print(f"calibrated ({w} ranks): {spec.intra_node.bandwidth * 8 / 1e9:.2f} Gbit/s all-reduce bus, "
              f"α {spec.intra_node.latency * 1e6:.0f} us, {spec.device.peak_flops / 1e9:.1f} GFLOP/s matmul per rank")
    print(f"planned {len(sections)} sections; load average {loadavg()}; {args.steps} timed steps ({args.bag_steps} for Parallax) after "
          f"{args.warmup} warm-up ({args.bag_warmup} for Parallax), x {args.rounds} rounds per cell", flush=True)
    res, link_meas, loads, total = run(sections, args)
    report(sections, res, link_meas, args, closed)
    print(f"\ntotal {total:.0f} s; load average after each round: {'; '.join(loads)} (this run's own ranks, "
          "2 to 5 processes, count in it)")


if __name__ == "__main__":
    main()
