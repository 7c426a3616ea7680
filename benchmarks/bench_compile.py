"""Step time of fxpar ``Strategy(dp=2, compile=True)`` vs torch DDP and vs DDP on a ``torch.compile``d model, and
the time the ranks spend compiling: with an empty inductor cache (the first ``parallelize`` + run of the model) and
with the cache it left (a second ``parallelize`` of the same model). Same model, ranks, buckets and batches as
``bench_dp_vs_ddp.py`` (GPT, 4 layers, d=256), measured in one run on one LocalCluster (gloo, CPU).

    python benchmarks/bench_compile.py [--world-size 2] [--steps 20] [--rounds 2] [--layers 4] [--d 256] [--cpu]

Prints the compile times, median step times, and the ratios (goals: fxpar compiled <= 0.85x DDP and <= 0.95x
DDP + torch.compile). ``--cpu``: also eager and compiled fxpar on the same ranks, one step of each in turn
(``program.runner()``), with each rank's wall and CPU seconds per step: CPU time is what the step costs where other
work shares the cores and wall times scatter.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.testing import GPT, ddp_worker, gpt_loss  # noqa: E402


def _compile_seconds(res) -> tuple:
    """The slowest rank's seconds in compilation (or waiting for the rank that compiled), and inductor's cache
    outcomes per graph over the ranks (``miss``: one rank compiled it; ``hit``: it was loaded)."""
    secs = max(sum(g["seconds"] for g in f["compile"].values()) for f in res.features.values())
    cache = {}
    for f in res.features.values():
        for label, g in f["compile"].items():
            cache.setdefault(label, []).append(g["cache"])
    return secs, {label: "/".join(sorted(set(v))) for label, v in cache.items()}


def alternate(programs: dict, batches: list, warmup: int, steps: int) -> dict:
    """On a rank: one step of each program's runner in turn, ``steps`` times after ``warmup`` each; per program its
    ``(wall, process CPU)`` seconds per step."""
    import torch.distributed as dist
    runners = {k: p.runner() for k, p in programs.items()}
    for r in runners.values():
        for b in batches[:warmup]:
            r.step(b)
    out = {k: [] for k in runners}
    for i in range(steps):
        for k, r in runners.items():
            dist.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            r.step(batches[warmup + i])
            out[k].append((time.perf_counter() - w0, time.process_time() - c0))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--rounds", type=int, default=2, help="alternate the three this many times")
    ap.add_argument("--cache-dir", default=None, help="inductor's cache directory (default: a new, empty one)")
    ap.add_argument("--cpu", action="store_true", help="also eager vs compiled fxpar in turn: wall and CPU per step")
    args = ap.parse_args()
    # an empty inductor cache of our own: the first program pays compilation, the second finds it cached
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="fxpar_bench_compile_")
    print(f"inductor cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']}")
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=max(1, args.d // 64), max_seq=args.seq)
    n = args.warmup + args.steps
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq)), torch.randint(0, args.vocab, (args.batch, args.seq)))
               for _ in range(n)]
    opt = (torch.optim.AdamW, {"lr": 1e-3})
    w = args.world_size
    make = lambda compile=True: fxpar.parallelize(  # noqa: E731
        model, fxpar.ClusterSpec.local(w), batches[0], loss_fn=gpt_loss, optimizer=opt,
        strategy=fxpar.Strategy(dp=w, bucket_cap_mb=args.bucket_mb, compile=compile))
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {args.layers} layers, d={args.d}, vocab={args.vocab}, {params / 1e6:.1f}M params; global batch "
          f"{args.batch}x{args.seq}; {w} gloo ranks; bucket {args.bucket_mb} MB; AdamW")
    ours, ddp, ddp_c, rounds = [], [], [], []
    with fxpar.LocalCluster(w) as lc:
        for i, what in enumerate(("first", "cached")):
            t0 = time.perf_counter()
            program = make()
            built = time.perf_counter() - t0
            res = program.run_local(batches[:1])      # fresh rank processes: only inductor's disk cache carries over
            secs, cache = _compile_seconds(res)
            print(f"{what:6} parallelize {built:.1f} s + compilation on the ranks {secs:.1f} s (inductor cache: "
                  + ", ".join(f"{k} {v}" for k, v in cache.items()) + ")")
        for _ in range(args.rounds):
            mine = program.run_local(batches, cluster=lc).step_times[args.warmup:]
            theirs = []
            for compiled in (False, True):
                got = lc.run(ddp_worker, [(model, batches, gpt_loss, opt, args.bucket_mb, args.warmup, None, compiled)] * w)
                theirs.append([max(o["step_times"][i] for o in got) for i in range(args.steps)])
            ours += mine
            ddp += theirs[0]
            ddp_c += theirs[1]
            rounds.append(tuple(statistics.median(mine) / statistics.median(t) for t in theirs))
        if args.cpu:
            both = {"eager": make(False), "compiled": program}
            got = lc.run(alternate, [(both, batches, args.warmup, args.steps)] * w)
            for k in both:
                wall = statistics.median(max(o[k][i][0] for o in got) for i in range(args.steps))
                cpu = statistics.median(statistics.mean(o[k][i][1] for o in got) for i in range(args.steps))
                print(f"fxpar {k:8} in turn: median step {wall * 1000:.1f} ms wall, {cpu * 1000:.1f} ms CPU a rank")
            for j, what in ((0, "wall"), (1, "CPU")):
                r = [statistics.mean(o["compiled"][i][j] for o in got) / statistics.mean(o["eager"][i][j] for o in got)
                     for i in range(args.steps)]
                print(f"compiled / eager fxpar, {what}: median {statistics.median(r):.3f} "
                      f"({min(r):.2f}-{max(r):.2f} over steps)")
    print("per-round ratios (/ DDP, / DDP + torch.compile): " + " ".join(f"{a:.3f},{b:.3f}" for a, b in rounds))
    a, b, c = statistics.median(ours), statistics.median(ddp), statistics.median(ddp_c)
    print(f"fxpar dp compile=True        median step {a * 1000:.1f} ms")
    print(f"torch DDP                    median step {b * 1000:.1f} ms")
    print(f"torch DDP + torch.compile    median step {c * 1000:.1f} ms")
    print(f"ratio fxpar compiled / DDP {a / b:.3f} (goal <= 0.85); / DDP + torch.compile {a / c:.3f} (goal <= 0.95)")


if __name__ == "__main__":
    main()
