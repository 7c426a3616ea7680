"""Step time of fxpar ``Strategy(dp=2, compile=True)`` vs torch DDP and vs DDP on a ``torch.compile``d model, and
the time the ranks spend compiling: with an empty inductor cache (the first ``parallelize`` + run of the model) and
with the cache it left (a second ``parallelize`` of the same model). Same model, ranks, buckets and batches as
``bench_dp_vs_ddp.py`` (GPT, 4 layers, d=256), measured in one run on one LocalCluster (gloo, CPU).

    python benchmarks/bench_compile.py [--world-size 2] [--steps 20] [--rounds 2] [--layers 4] [--d 256]

Prints the compile times, median step times, and the ratios (goals: fxpar compiled <= 0.85x DDP and <= 0.95x
DDP + torch.compile).
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
    make = lambda: fxpar.parallelize(model, fxpar.ClusterSpec.local(w), batches[0], loss_fn=gpt_loss,  # noqa: E731
                                     optimizer=opt, strategy=fxpar.Strategy(dp=w, bucket_cap_mb=args.bucket_mb,
                                                                            compile=True))
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
    print("per-round ratios (/ DDP, / DDP + torch.compile): " + " ".join(f"{a:.3f},{b:.3f}" for a, b in rounds))
    a, b, c = statistics.median(ours), statistics.median(ddp), statistics.median(ddp_c)
    print(f"fxpar dp compile=True        median step {a * 1000:.1f} ms")
    print(f"torch DDP                    median step {b * 1000:.1f} ms")
    print(f"torch DDP + torch.compile    median step {c * 1000:.1f} ms")
    print(f"ratio fxpar compiled / DDP {a / b:.3f} (goal <= 0.85); / DDP + torch.compile {a / c:.3f} (goal <= 0.95)")


if __name__ == "__main__":
    main()
