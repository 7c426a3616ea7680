"""Pipeline schedules on local gloo ranks: step time, measured vs simulated bubble, activation memory.

    python benchmarks/bench_pipeline.py [--pp 2] [--microbatches 8] [--steps 6] [--layers 8] [--d 128]

For each schedule: median step time, the bubble measured on the ranks (1 - F/B time / (ranks x step
time)) next to the simulator's figure for the same action lists (F=1, B=2), and the activation bytes a
stage saves per microbatch x the microbatches it holds at once (simulator). Also the single-process
step time on the same global batch. On a 2-core machine with pp=2 each rank has one core, so
measured bubbles include gloo and Python overhead that the simulator leaves out.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.optim import resolve_optimizer  # noqa: E402
from fxpar.pipeline import build_pipeline_program  # noqa: E402
from fxpar.schedule import simulate  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--schedules", nargs="*", default=["gpipe", "1f1b", "interleaved", "chimera"])
    args = ap.parse_args()
    torch.manual_seed(0)
    vocab = 512
    model = GPT(vocab=vocab, d=args.d, layers=args.layers, heads=4, max_seq=args.seq)
    tokens = torch.randint(0, vocab, (args.steps, args.batch, args.seq + 1))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    opt = (torch.optim.AdamW, {"lr": 1e-3})

    ref = GPT(vocab=vocab, d=args.d, layers=args.layers, heads=4, max_seq=args.seq)
    ref.load_state_dict(model.state_dict())
    o = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    times = []
    for x, y in batches:
        t0 = time.perf_counter()
        o.zero_grad()
        gpt_loss(ref(x), y).backward()
        o.step()
        times.append(time.perf_counter() - t0)
    print(f"single process: {statistics.median(times[1:]) * 1e3:.1f} ms/step "
          f"(GPT d={args.d} layers={args.layers}, batch {args.batch}x{args.seq})")
    print(f"{'schedule':<12} {'ms/step':>8} {'bubble meas':>11} {'bubble sim':>10} {'act KiB/rank':>12}")
    with fxpar.LocalCluster(args.pp) as lc:
        for name in args.schedules:
            strategy = fxpar.Strategy(pp=args.pp, schedule=name, microbatches=args.microbatches)
            try:
                prog = build_pipeline_program(model, fxpar.ClusterSpec.local(args.pp), batches[0], gpt_loss,
                                              resolve_optimizer(opt), strategy)
            except fxpar.FxparError as e:
                print(f"{name:<12} skipped: {str(e).splitlines()[0][:80]}")
                continue
            res = prog.run_local(batches, cluster=lc)
            sim = simulate(prog.pipe_schedule)
            act = max(sum(prog.stages[s].saved_bytes for s in prog.pipe_schedule.rank_stages(r))
                      * sim.peak_activations_per_rank[r] for r in range(args.pp))
            print(f"{name:<12} {statistics.median(res.step_times[1:]) * 1e3:8.1f} "
                  f"{statistics.median(res.bubble[1:]):11.3f} {sim.bubble_fraction:10.3f} {act / 1024:12.0f}")


if __name__ == "__main__":
    main()
