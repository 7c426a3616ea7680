"""HetPipe on a simulated heterogeneous cluster: speed-aware stage cuts against FLOP-balanced cuts.

Two virtual workers of two stages each (``Strategy(dp=2, pp=2, schedule="hetpipe", staleness=D)``), two CPU parameter
servers (one per stage); the second stage's ranks are ``--factor`` times slower (the straggler harness:
``ClusterSpec.local(4, slowdown={2: f, 3: f})``; pipeline rank 1 of both virtual workers). The speed-aware cut is the
one HetPipe plans; the FLOP-balanced cut is the one the plain cut search gives (``Plan.section("hetpipe").flop_cuts``),
passed as ``split_points``. The model is an MLP of ``--layers`` equal hidden layers (float64, SGD-momentum); every
run trains on the same batches.

Measured per cut: samples per second over the steps after the first (the median step interval, from the ranks'
action timelines), and ``program.estimate()``'s step time on the same ClusterSpec.

    python benchmarks/bench_hetpipe.py [--steps 10] [--layers 24] [--hidden 256] [--batch 128] [--microbatches 8] [--factor 2.0]
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

import fxpar
from fxpar.testing import MLP

OPT = (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9})


def _batches(n: int, batch: int, width: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, dtype=torch.float64, generator=g),
             torch.randn(batch, width, dtype=torch.float64, generator=g)) for _ in range(n)]


def _step_ends(res) -> list:
    """Per step, when the last worker finished it (seconds from the first worker's first action)."""
    t0 = min(tl[0][0][3] for tl in res.timelines.values())
    return [max(res.timelines[r][i][-1][4] for r in res.timelines) - t0 for i in range(len(res.losses))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--staleness", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = MLP(d_in=args.hidden, hidden=args.hidden, d_out=args.hidden, layers=args.layers).double()
    batches = _batches(args.steps, args.batch, args.hidden)
    cluster = fxpar.ClusterSpec.local(4, cpu_servers=2, slowdown={2: args.factor, 3: args.factor})
    lc = fxpar.LocalCluster(6)
    rows = []
    try:
        speed = None
        for label in ("speed-aware cut", "FLOP-balanced cut"):
            extra = {} if speed is None else {"split_points": speed.plan.section("hetpipe").flop_cuts}
            prog = fxpar.parallelize(model, cluster, batches[0], loss_fn=F.mse_loss, optimizer=OPT,
                                     strategy=fxpar.Strategy(dp=2, pp=2, microbatches=args.microbatches,
                                                             schedule="hetpipe", staleness=args.staleness, **extra))
            speed = speed or prog
            sec = prog.plan.section("hetpipe")
            res = prog.run_local(batches, cluster=lc)
            ends = _step_ends(res)
            step = statistics.median(b - a for a, b in zip(ends, ends[1:]))
            rows.append((label, prog.plan.cuts, sec.stage_times(), args.batch / step, prog.estimate().step_time_s,
                         res.losses[-1]))
    finally:
        lc.close()
    print(f"2 virtual workers x 2 stages, stage 1's ranks {args.factor:g}x slower, D={args.staleness}, MLP "
          f"{args.layers}x{args.hidden}, batch {args.batch} in {args.microbatches} microbatches, {args.steps} steps")
    print("| cut | cuts | stage forward times (model) | samples/s | × FLOP cut | estimate() step | final loss |")
    print("|---|---|---|---|---|---|---|")
    base = rows[1][3]
    for label, cuts, times, sps, est, loss in rows:
        print(f"| {label} | {cuts} | {', '.join(f'{t * 1e6:.0f} us' for t in times)} | {sps:.1f} | {sps / base:.2f} | "
              f"{est * 1e3:.2f} ms | {loss:.4f} |")


if __name__ == "__main__":
    main()
