"""fxpar data parallel vs torch DDP over a bandwidth-capped link.

Two gloo ranks, one in each of two network namespaces joined by a veth pair capped with tbf
(benchmarks/netns_link.py; needs root and ``ip netns``, otherwise it says what is missing and runs
uncapped). The 4-layer GPT of benchmarks/bench_dp_vs_ddp.py, the same batches for everyone, at each cap
in one run, alternating fxpar / DDP in ``--rounds`` rounds:

- fxpar ``Strategy(dp=2, bucket_cap_mb=25)``, each rank running ``program.payload(rank)`` with
  ``fxpar.runtime.executor.Executor(payload).step(batch)``;
- torch DDP (25 MB buckets, like fxpar.testing.ddp_worker);
- DDP's compute alone: the same step under ``no_sync()`` (no gradient all-reduce). DDP's share of the step
  spent waiting for communication is ``1 - compute / step`` (medians);
- fxpar's share is estimated against the same compute: ``1 - DDP compute / fxpar step``. (A dp-only fxpar
  program is one ``FULL`` graph with its all-reduces inside, so the executor cannot time its waits apart.)
- at ``--sweep-rate`` (1 Gbit/s) also DDP with ``--sweep-mb`` bucket sizes.

The link adds bandwidth limits only: this kernel has no netem, so no latency is added.

    python benchmarks/bench_capped_link.py [--rates none,2gbit,1gbit,500mbit] [--steps 5] [--warmup 2] [--rounds 4]
    python benchmarks/netns_link.py --cleanup      # leftovers of a run that was killed hard
"""
import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import fxpar  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402
from netns_link import CappedLink, NetnsCluster, format_rate, parse_rate  # noqa: E402


def fxpar_worker(payload, batches, warmup):
    """Timed steps; then the drain (a cross-iteration program's last carried update; nothing otherwise), not
    timed, as a run's end does."""
    from fxpar.runtime.executor import Executor
    ex = Executor(payload)
    for i, b in enumerate(batches):
        if i == warmup:
            t0 = time.perf_counter()
        ex.step(b)
    t1 = time.perf_counter()
    ex.drain()
    return {"step_times": ex.step_times[warmup:], "window": (t0, t1)}


def ddp_steps(m, opt, batches, loss_fn, warmup, no_sync=False, window: list | None = None) -> list:
    """Timed DDP steps on this rank's shard of each global batch (the seconds of steps after ``warmup``);
    ``no_sync``: the same step without the gradient all-reduce. ``window``: receives (start of the first timed
    step, end of the last), ``time.perf_counter()`` (one clock for every process of this machine)."""
    import contextlib

    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    times = []
    for i, b in enumerate(batches):
        if no_sync:
            dist.barrier()          # keep the ranks in step as the synchronous run is (not timed)
        t0 = time.perf_counter()
        n = b[0].shape[0] // world
        shard = tuple(t[rank * n:(rank + 1) * n] for t in b)
        opt.zero_grad()
        with m.no_sync() if no_sync else contextlib.nullcontext():
            loss = loss_fn(m(shard[0]), *shard[1:])
            loss.backward()
        opt.step()
        loss.item()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            if i == warmup and window is not None:
                window.append(t0)
    if window is not None:
        window.append(time.perf_counter())
    return times


def ddp_bench_worker(model, batches, loss_fn, optimizer, bucket_cap_mb, warmup, no_sync):
    """fxpar.testing.ddp_worker's timed step; ``no_sync``: the same step without the gradient all-reduce."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    m = DDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
    cls, kw = optimizer
    window: list = []
    times = ddp_steps(m, cls(m.parameters(), **kw), batches, loss_fn, warmup, no_sync, window)
    dist.barrier()
    return {"step_times": times, "window": tuple(window)}


def per_step_max(outs):
    """A step ends when its slowest rank ends: the per-step maximum over ranks."""
    return [max(o["step_times"][i] for o in outs) for i in range(len(outs[0]["step_times"]))]


def window_mean(outs) -> float:
    """A run's seconds per step: from the first rank to start the timed steps to the last rank to end them, over
    their number (the ranks share this machine's ``time.perf_counter()`` clock). Under cross-iteration overlap a
    step begins by waiting for the previous step's pieces, so its own time depends on where the previous one
    ended -- per-step times alternate between steps and ranks -- while the window does not."""
    return (max(o["window"][1] for o in outs) - min(o["window"][0] for o in outs)) / len(outs[0]["step_times"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="none,2gbit,1gbit,500mbit")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="visit every cap and run this many times")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--sweep-rate", default="1gbit")
    ap.add_argument("--sweep-mb", default="1,5,25")
    args = ap.parse_args()
    w = 2
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=max(1, args.d // 64), max_seq=args.seq)
    n = args.warmup + args.steps
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq)), torch.randint(0, args.vocab, (args.batch, args.seq)))
               for _ in range(n)]
    opt = (torch.optim.AdamW, {"lr": 1e-3})
    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(w), batches[0], loss_fn=gpt_loss, optimizer=opt,
                                strategy=fxpar.Strategy(dp=w, bucket_cap_mb=args.bucket_mb))
    payloads = [program.payload(r, n_batches=n) for r in range(w)]
    params = sum(p.numel() for p in model.parameters())
    rates = [parse_rate(r) for r in args.rates.split(",")]
    sweep_rate = parse_rate(args.sweep_rate)
    sweep = [float(x) for x in args.sweep_mb.split(",") if x]
    print(f"GPT {args.layers} layers, d={args.d}, vocab={args.vocab}, {params / 1e6:.2f}M params "
          f"({params * 4 / 2**20:.1f} MiB of fp32 gradients); global batch {args.batch}x{args.seq}; {w} gloo ranks; "
          f"fxpar {len(program.plan.section('data_parallel').buckets[0])} bucket(s) of <= {args.bucket_mb} MB; {args.steps} timed steps "
          f"x {args.rounds} rounds per cell")
    print(f"load average at start: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    t_start = time.perf_counter()
    res = {}
    with CappedLink() as link:
        print("link: " + (f"veth {link.names.dev_a}({link.names.addr_a}) <-> {link.names.dev_b}({link.names.addr_b}), "
                          "tbf per direction, no latency (no netem)" if link.active
                          else f"UNCAPPED 127.0.0.1 (missing: {link.missing})"))
        with NetnsCluster(w, link) as cl:
            def cell(key, fn, argv):
                outs = cl.run(fn, [argv] * w if not callable(argv) else [argv(r) for r in range(w)])
                res.setdefault(key, []).extend(per_step_max(outs))

            # Every round visits every cap (load from elsewhere on the machine spreads over all of them).
            for rnd in range(args.rounds):
                for bps in rates:
                    link.set_rate(bps)
                    cell((bps, "fxpar"), fxpar_worker, lambda r: (payloads[r], batches, args.warmup))
                    cell((bps, "ddp"), ddp_bench_worker, (model, batches, gpt_loss, opt, args.bucket_mb,
                                                          args.warmup, False))
                    cell((bps, "ddp_compute"), ddp_bench_worker, (model, batches, gpt_loss, opt, args.bucket_mb,
                                                                  args.warmup, True))
                    if bps == sweep_rate:
                        for mb in sweep:
                            if mb != args.bucket_mb:
                                cell((bps, f"ddp{mb:g}"), ddp_bench_worker, (model, batches, gpt_loss, opt, mb,
                                                                             args.warmup, False))
                print(f"  round {rnd + 1}/{args.rounds} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print()
    print("median step time in ms (per step, the slower rank); [share of the step waiting on communication: "
          "DDP 1 - compute/step, compute = DDP under no_sync(); fxpar estimated as 1 - DDP compute / fxpar step]")
    print(f"{'cap':>9} | {'fxpar dp':>16} | {'DDP ' + format(args.bucket_mb, 'g') + ' MB':>16} | "
          f"{'DDP compute':>11} | {'fxpar/DDP':>9}")
    for bps in rates:
        f, d, c = med[(bps, "fxpar")], med[(bps, "ddp")], med[(bps, "ddp_compute")]
        print(f"{format_rate(bps):>9} | {f * 1e3:8.1f} [{max(0.0, 1 - c / f):.2f}] | "
              f"{d * 1e3:8.1f} [{max(0.0, 1 - c / d):.2f}] | {c * 1e3:11.1f} | {f / d:9.3f}")
    if sweep_rate in rates:
        c = med[(sweep_rate, "ddp_compute")]
        print(f"\nDDP bucket sweep at {format_rate(sweep_rate)}:")
        for mb in sweep:
            key = (sweep_rate, "ddp") if mb == args.bucket_mb else (sweep_rate, f"ddp{mb:g}")
            print(f"  bucket {mb:>5g} MB: {med[key] * 1e3:8.1f} ms  [comm-wait {max(0.0, 1 - c / med[key]):.2f}]")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; load average at end: "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])} (2 ranks of this run count about 2)")


if __name__ == "__main__":
    main()
