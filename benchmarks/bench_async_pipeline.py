"""Samples per second of the asynchronous pipelines without weight stashing against 1F1B, on local gloo ranks.

    python benchmarks/bench_async_pipeline.py [--pp 2 4] [--microbatches 8] [--steps 8] [--layers 8] [--d 128]

For each pp: 1F1B (a flush every step, one update per batch), Pipelined Backpropagation with spike compensation and
weight prediction, and PipeMare with its warm-up and discrepancy correction (one window over every batch, an update
per microbatch, no flush), all with SGD and momentum 0.9 on the same GPT (LM head untied: the asynchronous schedules refuse tied weights) and batches. Prints samples/s (the ranks'
training time, startup and compilation left out), the simulator's bubble for the same action lists (F=1, B=2), and
the weight versions the ranks held at once (the most over stages).
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.planner import build_schedule  # noqa: E402
from fxpar.schedule import simulate  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402

SCHEDULES = {
    "1f1b": {},
    "pipelined_bp": {"correction": "sc+lwp"},
    "pipemare": {"lr_warmup": 8, "discrepancy_correction": True},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    torch.manual_seed(0)
    vocab = 512
    model = GPT(vocab=vocab, d=args.d, layers=args.layers, heads=4, max_seq=args.seq, tie_weights=False)
    tokens = torch.randint(0, vocab, (args.steps, args.batch, args.seq + 1))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    opt = (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9})
    print(f"GPT d={args.d} layers={args.layers}, batch {args.batch}x{args.seq}, m={args.microbatches}, "
          f"{args.steps} batches, {torch.get_num_threads()} threads per rank")
    print(f"{'pp':>2} {'schedule':<13} {'samples/s':>9} {'vs 1f1b':>7} {'bubble sim':>10} {'versions':>8} {'wall s':>7}")
    for pp in args.pp:
        base = None
        with fxpar.LocalCluster(pp) as lc:
            for name, options in SCHEDULES.items():
                strategy = fxpar.Strategy(pp=pp, schedule=name, microbatches=args.microbatches, **options)
                prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(pp), batches[0], gpt_loss, opt,
                                         strategy=strategy)
                t0 = time.perf_counter()
                res = prog.run_local(batches, cluster=lc)
                wall = time.perf_counter() - t0
                rate = args.steps * args.batch / sum(res.step_times)
                base = base or rate
                # the run's actions: 1F1B's one step (repeated), the asynchronous schedules' one window
                bubble = simulate(build_schedule(prog.plan, args.steps)).bubble_fraction
                versions = max(res.peak_versions.values()) if res.peak_versions else 1
                print(f"{pp:>2} {name:<13} {rate:9.1f} {rate / base:7.2f} {bubble:10.3f} {versions:>8} {wall:7.1f}")


if __name__ == "__main__":
    main()
