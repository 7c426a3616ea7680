"""Step time of fxpar pipeline parallelism vs torch.distributed.pipelining (PipelineStage +
ScheduleGPipe / Schedule1F1B): same model and weights, same ranks, microbatches, split point,
optimizer and global batches, measured in one run on one LocalCluster (gloo, CPU).

    python benchmarks/bench_pipeline_vs_torch.py [--pp 2] [--microbatches 8] [--steps 10] [--rounds 3] [--layers 8] [--d 128]

The model is a GPT with an untied LM head (torch's pipelining cannot share a weight between
stages). fxpar cuts it with split_points=["blocks.<layers/pp>", ...]; the torch side builds the same
stages by hand (stage 0: embeddings + first blocks; last stage: the rest + ln_f + head, the loss
being the schedule's loss_fn). Both train with AdamW; step 0's loss of each side is printed (they
must agree) together with the largest loss difference over all steps. fxpar and torch alternate
``--rounds`` times per schedule to spread machine load over both. Prints, per schedule, the median
step time (slowest rank, warm-up steps dropped) of each and the ratio fxpar/torch (goal: <= 1.0),
and the fastest step of each (less sensitive to other load on the machine).
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.testing import gpt_loss  # noqa: E402
from fxpar.testing.torch_pipelining import UntiedGPT, pipelining_worker  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternate fxpar/torch this many times per schedule")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--schedules", nargs="*", default=["gpipe", "1f1b"])
    args = ap.parse_args()
    if args.layers % args.pp:
        ap.error("--layers must be a multiple of --pp")

    torch.manual_seed(0)
    model = UntiedGPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=args.heads, max_seq=args.seq)
    n = args.warmup + args.steps
    tokens = torch.randint(0, args.vocab, (n, args.batch, args.seq + 1))
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    opt = (torch.optim.AdamW, {"lr": args.lr})
    per = args.layers // args.pp
    cuts = [per * s for s in range(1, args.pp)]
    split_points = [f"blocks.{c}" for c in cuts]

    params = sum(p.numel() for p in model.parameters())
    print(f"UntiedGPT {args.layers} layers, d={args.d}, heads={args.heads}, vocab={args.vocab}, "
          f"{params / 1e6:.2f}M params; global batch {args.batch}x{args.seq}; pp={args.pp} gloo ranks "
          f"(1 thread each); {args.microbatches} microbatches; split {split_points}; AdamW lr={args.lr}; "
          f"{args.warmup} warm-up + {args.steps} timed steps x {args.rounds} rounds")
    rows = []
    with fxpar.LocalCluster(args.pp) as lc:
        for name in args.schedules:
            strategy = fxpar.Strategy(pp=args.pp, schedule=name, microbatches=args.microbatches,
                                      split_points=split_points)
            program = fxpar.parallelize(model, fxpar.ClusterSpec.local(args.pp), batches[0], loss_fn=gpt_loss,
                                        optimizer=opt, strategy=strategy)
            ours, theirs, loss_diff = [], [], 0.0
            for r in range(args.rounds):
                res = program.run_local(batches, cluster=lc)
                ours += res.step_times[args.warmup:]
                out = lc.run(pipelining_worker, [(model, batches, cuts, opt, name, args.microbatches,
                                                  args.warmup)] * args.pp)
                theirs += [max(o["step_times"][i] for o in out) for i in range(args.steps)]
                t_losses = out[-1]["losses"]
                loss_diff = max(loss_diff, max(abs(a - b) for a, b in zip(res.losses, t_losses)))
                if r == 0:
                    print(f"{name}: step-0 loss fxpar {res.losses[0]:.6f}  torch {t_losses[0]:.6f}  "
                          f"(last step {res.losses[-1]:.6f} vs {t_losses[-1]:.6f})")
            rows.append((name, statistics.median(ours), statistics.median(theirs), min(ours), min(theirs),
                         loss_diff))

    print(f"\n{'schedule':<8} {'fxpar ms':>9} {'torch ms':>9} {'fxpar/torch':>11}   {'min: fxpar':>10} {'torch':>7} "
          f"{'ratio':>6} {'max |dloss|':>11}")
    for name, a, b, amin, bmin, d in rows:
        print(f"{name:<8} {a * 1e3:9.1f} {b * 1e3:9.1f} {a / b:11.3f}   {amin * 1e3:10.1f} {bmin * 1e3:7.1f} "
              f"{amin / bmin:6.3f} {d:11.2e}")


if __name__ == "__main__":
    main()
