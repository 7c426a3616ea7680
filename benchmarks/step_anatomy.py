"""Where a rank's step goes: Parallax's program (bench_param_server.py's Bag) taken apart on 2 ranks.

``--mode step`` (default): each rank builds fxpar's Executor for the program, then puts a timestamp before and
after every collective and ``wait_tensor`` of its own copy of the graph (``--all-nodes``: after every node too),
runs ``--steps`` steps and reports the median and mean of each part (wall time, and the main thread's CPU time:
where the CPU is less than the wall, the thread was waiting or another thread had its core): the executor before
and after the graph, the ops between the collectives, each issue call, each wait. ``estimate()``'s timeline for the same program on
``ClusterSpec.calibrate()`` is printed beside it (``--no-estimate`` to skip the calibration). The ranks run on
127.0.0.1 (``--veth``: one in each namespace of benchmarks/netns_link.py, uncapped; ``--rate R``: that veth capped at R).

``--mode ops``: the program's graph with its collectives stubbed out (the gather a concatenation, the rest the
identity), called in a loop in one process: back to back, after a 0.3 ms sleep, after reading 4 MiB of other
tensors (what the graph's ops cost alone, and after a thread slept or its caches were used).

    python benchmarks/step_anatomy.py [--mode step|ops] [--steps 1000] [--comm-priority] [--pin] [--veth] [--rate R] [--all-nodes]
        [--bag-batch 16] [--bag-seq 8] [--bag-hidden 0]
"""
import argparse
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
from bench_param_server import SGD, Bag  # noqa: E402
from fxpar.collectives import C10D, gloo_all_gather_into_tensor  # noqa: E402

_LOG = []


def _stamp(name):
    _LOG.append((name, time.perf_counter(), time.thread_time()))


_WATCH = {C10D.all_reduce_.default, C10D.all_reduce.default, C10D.all_gather_into_tensor.default,
          gloo_all_gather_into_tensor, C10D.wait_tensor.default}


def _instrument(gm, all_nodes):
    g = gm.graph
    nodes = list(g.nodes)
    with g.inserting_before([n for n in nodes if n.op != "placeholder"][0]):
        g.call_function(_stamp, ("graph start",))
    for n in nodes:
        if n.op == "call_function" and n.target in _WATCH:
            with g.inserting_before(n):
                g.call_function(_stamp, (f"before {n.name}",))
            with g.inserting_after(n):
                g.call_function(_stamp, (f"after {n.name}",))
        elif all_nodes and n.op == "call_function":
            with g.inserting_after(n):
                g.call_function(_stamp, (f"after {n.name}",))
        elif n.op == "output":
            with g.inserting_before(n):
                g.call_function(_stamp, ("graph end",))
    gm.recompile()


def rank_steps(payload, batches, warmup, all_nodes):
    """On a rank: the executor on an instrumented copy of its graphs; per timed step (t0, stamps, t1)."""
    import torch.distributed as dist

    from fxpar.runtime.executor import Executor
    ex = Executor(payload)
    for parts in ex.p.graphs.values():
        for sg in parts.values():
            _instrument(sg.gm, all_nodes)
    dist.barrier()
    out = []
    for i, b in enumerate(batches):
        _LOG.clear()
        t0, c0 = time.perf_counter(), time.thread_time()
        ex.step(b)
        t1, c1 = time.perf_counter(), time.thread_time()
        if i >= warmup:
            out.append(((t0, c0), list(_LOG), (t1, c1)))
    ex.drain()
    return out


def _program(spec, batch):
    return fxpar.parallelize(_bag(), spec, batch, loss_fn=F.cross_entropy, optimizer=SGD,
                             strategy=fxpar.Strategy(dp=2, grad_sync="parallax"))


_SIZE = {"batch": 16, "seq": 8, "hidden": 0}      # --bag-batch, --bag-seq, --bag-hidden (bench_param_server's)


def _bag():
    torch.manual_seed(0)
    return Bag(vocab=200_000, small=_SIZE["seq"], d=32, hidden=_SIZE["hidden"])


def _batches(n):
    g = torch.Generator().manual_seed(3)
    b, s = _SIZE["batch"], _SIZE["seq"]
    return [(torch.randint(0, 200_000, (b, s), generator=g), torch.randint(0, 4, (b,), generator=g)) for _ in range(n)]


def step_mode(args):
    from netns_link import CappedLink, NetnsCluster, parse_rate
    batches = _batches(args.steps + args.warmup)
    spec = replace(fxpar.ClusterSpec.local(2), comm_priority=args.comm_priority)
    prog = _program(spec, batches[0])
    if prog.layout is not None:
        from fxpar.inputs import prepare_batch
        batches = [prepare_batch(prog, b, f"batches[{i}]") for i, b in enumerate(batches)]
    payloads = [prog.payload(r, n_batches=len(batches)) for r in range(2)]
    link = CappedLink(verbose=False)
    if not args.veth and not args.rate:
        link.missing = "127.0.0.1 asked for (--veth for the namespaces)"
    with link:
        if args.rate:
            link.set_rate(parse_rate(args.rate))
        on_veth = link.active                      # (the link is down again after the with)
        with NetnsCluster(2, link, comm_priority=args.comm_priority, pin=args.pin) as cl:
            outs = cl.run(rank_steps, [(p, batches, args.warmup, args.all_nodes) for p in payloads])
    print(f"Parallax on Bag, 2 ranks on {'the veth' if on_veth else '127.0.0.1'}"
          f"{' capped at ' + args.rate if on_veth and args.rate else ''}, comm_priority="
          f"{args.comm_priority}, pin={args.pin}, {args.steps} steps after {args.warmup}; ms per step (median, mean)")
    for r, steps in enumerate(outs):
        parts = {}
        for (t0, c0), log, (t1, c1) in steps:
            prev, pt, pc = "step start", t0, c0
            for name, t, c in log:
                parts.setdefault(f"{prev} -> {name}", []).append(((t - pt) * 1e3, (c - pc) * 1e3))
                prev, pt, pc = name, t, c
            parts.setdefault(f"{prev} -> step end", []).append(((t1 - pt) * 1e3, (c1 - pc) * 1e3))
            parts.setdefault("STEP", []).append(((t1 - t0) * 1e3, (c1 - c0) * 1e3))
        print(f"rank {r}: {'wall median':>82} {'mean':>7} | main thread's CPU median, mean")
        for k, v in parts.items():
            wall, cpu = [w for w, _ in v], [c for _, c in v]
            print(f"  {k:70} {statistics.median(wall):7.3f} {statistics.fmean(wall):7.3f} | "
                  f"{statistics.median(cpu):7.3f} {statistics.fmean(cpu):7.3f}")
    if not args.no_estimate:
        cal = fxpar.ClusterSpec.calibrate(world_size=2, threads=1, comm_priority=args.comm_priority, pin=args.pin)
        est = _program(cal, _batches(1)[0]).estimate()
        sim = est._sims[0]
        print(f"estimate(): step {est.step_time_s * 1e3:.3f} ms; rank 0's compute lane (start, ms) and comm lane:")
        for s, d, seg in sim.compute:
            print(f"  compute {s * 1e3:7.3f} +{d * 1e3:.3f}  segment {seg}")
        for s, d, k in sim.comm:
            print(f"  comm    {s * 1e3:7.3f} +{d * 1e3:.3f}  collective {k}")


def ops_mode(args):
    torch.set_num_threads(1)
    batch = _batches(1)[0]
    prog = _program(fxpar.ClusterSpec.local(2), batch)
    sg = prog.stages[0].graphs["FULL"]
    gm = sg.gm
    stubs = {C10D.all_reduce_.default: lambda x, op, name: x, C10D.wait_tensor.default: lambda x: x,
             C10D.all_gather_into_tensor.default: lambda x, n, name: torch.cat([x] * n)}
    for n in gm.graph.nodes:
        if n.target in stubs:
            n.target = stubs[n.target]
    gm.recompile()
    if prog.layout is not None:
        from fxpar.inputs import prepare_batch
        batch = prepare_batch(prog, batch, "batch")
    mb = tuple(t.narrow(0, 0, t.shape[0] // 2) for t in batch)       # rank 0's half
    args_in = []
    for role, key in sg.inputs:
        if role == "param":
            args_in.append(prog._params[key].detach().clone())
        elif role == "input":
            args_in.append(mb[int(key)])
        elif role == "target":
            args_in.append(mb[prog.n_inputs + int(key)])
        else:                                       # lr, step
            args_in.append(torch.tensor(0.1))
    other = [torch.randn(256, 256) for _ in range(16)]        # 4 MiB
    for gap in ("none", "sleep 0.3 ms", "read 4 MiB"):
        ts = []
        for i in range(args.steps + args.warmup):
            if gap.startswith("sleep"):
                time.sleep(0.0003)
            elif gap.startswith("read"):
                for t in other:
                    t.sum()
            t0 = time.perf_counter()
            gm(*args_in)
            if i >= args.warmup:
                ts.append(time.perf_counter() - t0)
        print(f"graph ops alone, before each call {gap!r}: median {statistics.median(ts) * 1e3:.3f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("step", "ops"), default="step")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--comm-priority", action="store_true")
    ap.add_argument("--veth", action="store_true")
    ap.add_argument("--all-nodes", action="store_true")
    ap.add_argument("--rate", default=None, help="through the veth capped at this rate (e.g. 500mbit; implies --veth)")
    ap.add_argument("--pin", action="store_true", help="each rank on its own core (NetnsCluster(pin=True))")
    ap.add_argument("--no-estimate", action="store_true")
    ap.add_argument("--bag-batch", type=int, default=16, help="global batch (bench_param_server.py's --bag-batch)")
    ap.add_argument("--bag-seq", type=int, default=8)
    ap.add_argument("--bag-hidden", type=int, default=0, help="the Bag's per-token MLP width (0: none)")
    args = ap.parse_args()
    _SIZE.update(batch=args.bag_batch, seq=args.bag_seq, hidden=args.bag_hidden)
    step_mode(args) if args.mode == "step" else ops_mode(args)


if __name__ == "__main__":
    main()
