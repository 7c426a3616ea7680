"""Step time of fxpar data parallelism vs torch DistributedDataParallel: same model, ranks,
bucket size and batches, measured in one run on one LocalCluster (gloo, CPU).

    python benchmarks/bench_dp_vs_ddp.py [--world-size 2] [--steps 20] [--layers 4] [--d 256]

Prints median step times and the ratio fxpar/DDP (goal: <= 1.0).
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.testing import GPT, ddp_worker, gpt_loss  # noqa: E402


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
    ap.add_argument("--rounds", type=int, default=4, help="alternate fxpar/DDP this many times")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=max(1, args.d // 64), max_seq=args.seq)
    n = args.warmup + args.steps
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq)), torch.randint(0, args.vocab, (args.batch, args.seq)))
               for _ in range(n)]
    opt = (torch.optim.AdamW, {"lr": 1e-3})
    w = args.world_size
    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(w), batches[0], loss_fn=gpt_loss, optimizer=opt,
                                strategy=fxpar.Strategy(dp=w, bucket_cap_mb=args.bucket_mb))
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {args.layers} layers, d={args.d}, vocab={args.vocab}, {params / 1e6:.1f}M params; global batch "
          f"{args.batch}x{args.seq}; {w} gloo ranks; bucket {args.bucket_mb} MB; {len(program.plan.section('data_parallel').buckets[0])} bucket(s)")
    ours, theirs, per_round = [], [], []
    with fxpar.LocalCluster(w) as lc:
        for _ in range(args.rounds):
            res = program.run_local(batches, cluster=lc)
            mine = res.step_times[args.warmup:]
            out = lc.run(ddp_worker, [(model, batches, gpt_loss, opt, args.bucket_mb, args.warmup)] * w)
            ddp = [max(o["step_times"][i] for o in out) for i in range(args.steps)]
            ours += mine
            theirs += ddp
            per_round.append(statistics.median(mine) / statistics.median(ddp))
    a, b = statistics.median(ours), statistics.median(theirs)
    print("per-round ratios " + " ".join(f"{r:.3f}" for r in per_round))
    print(f"fxpar dp  median step {a * 1000:.1f} ms")
    print(f"torch DDP median step {b * 1000:.1f} ms")
    print(f"ratio fxpar/DDP {a / b:.3f}")


if __name__ == "__main__":
    main()
