"""Synchronisation methods on a real task: Local SGD, hierarchical Local SGD, DiLoCo, SlowMo, SSP, DSSP, DABMD (full
and ring mixing) and BAGUA's asynchronous averaging beside synchronous dp, the loss against steps and against wall
time.

The task is ``compression_convergence.py``'s: a small character-level GPT on the Python documentation's topic pages
(``pydoc_data.topics``, bytes, vocabulary 256), the same batches and the same AdamW for every method, at ``--ranks``
gloo ranks (SSP and DSSP: as many workers and one CPU parameter server; DABMD: each rank's shard in 2 microbatches,
the pieces it may take or leave). Each method's loss per step and the run's wall time
go to a CSV, its final loss (the mean of the last ``--tail`` steps) beside synchronous dp's in a table, and, where
matplotlib is installed (``pip install -e ".[plot]"``), the curves (against steps, and against seconds) to a PNG.

    python benchmarks/sync_convergence.py [--steps 300] [--ranks 4] [--period 8] [--out docs/img]
    python benchmarks/sync_convergence.py --only sync,DSSP,DABMD,AsyncAveraging --tag _async
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import fxpar  # noqa: E402
from fxpar import sync as S  # noqa: E402
from fxpar.testing import gpt_loss  # noqa: E402
from compression_convergence import task  # noqa: E402


def methods(period: int, ranks: int) -> dict:
    """label -> (sync method or None, CPU servers, more Strategy arguments)."""
    half = max(1, ranks // 2)
    return {
        "sync dp": (None, 0, {}),
        f"LocalSGD H={period}": (S.LocalSGD(period=period, warmup_steps=20), 0, {}),
        f"LocalSGD hier. {{{period // 2}: {half}, {period}: {ranks}}}": (
            S.LocalSGD(warmup_steps=20, hierarchical={max(1, period // 2): half, period: ranks}), 0, {}),
        f"DiLoCo H={period}": (S.DiLoCo(period=period, warmup_steps=20,
                                        outer=(torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})), 0, {}),
        f"SlowMo H={period}": (S.SlowMo(period=period, warmup_steps=20, slow_lr=1.0, slow_momentum=0.5), 0, {}),
        "SSP s=2": (S.SSP(staleness=2), 1, {}),
        "DSSP [1, 4]": (S.DSSP(low=1, high=4), 1, {}),
        # no straggler here: every rank takes both microbatches of its shard within the round's 0.5 s
        "DABMD full": (S.DABMD(round_time_s=0.5, mixing="full"), 0, {"microbatches": 2}),
        "DABMD ring": (S.DABMD(round_time_s=0.5, mixing="ring"), 0, {"microbatches": 2}),
        "AsyncAveraging 1 s": (S.AsyncAveraging(interval_s=1.0, warmup_steps=20), 0, {}),
    }


def plot(curves: dict, times: dict, path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib not installed: no plot; pip install -e '.[plot]')")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    k = 10
    for j, (label, ys) in enumerate(curves.items()):
        smooth = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
        style = dict(label=label, lw=2.0 if label == "sync dp" else 1.0,
                     color="black" if label == "sync dp" else plt.cm.tab10.colors[j % 10])
        axes[0].plot(smooth, **style)
        per_step = times[label] / len(ys)
        axes[1].plot([per_step * (i + 1) for i in range(len(ys))], smooth, **style)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("seconds (the run's wall time spread evenly over its steps)")
    for ax in axes:
        ax.set_ylabel(f"training loss (mean of {k} steps)")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--period", type=int, default=8)
    ap.add_argument("--chars", type=int, default=300_000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--only", default=None, help="comma-separated labels' first words (e.g. 'sync,LocalSGD')")
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--tag", default="", help="suffix of the CSV and PNG names (e.g. '_async' for a run of --only)")
    args = ap.parse_args(argv)
    _, batches, model = task(args)
    print(f"char GPT {args.layers} layers, d={args.d}, {sum(p.numel() for p in model.parameters()) / 1e3:.0f}K "
          f"params; global batch {args.batch}x{args.seq}; {args.steps} steps; {args.ranks} gloo ranks; AdamW lr {args.lr}")
    opt = (torch.optim.AdamW, {"lr": args.lr})
    curves, times, table = {}, {}, []
    for label, (method, servers, more) in methods(args.period, args.ranks).items():
        if args.only and label.split()[0] not in args.only.split(","):
            continue
        cluster = fxpar.ClusterSpec.local(args.ranks, cpu_servers=servers)
        program = fxpar.parallelize(model, cluster, batches[0], loss_fn=gpt_loss, optimizer=opt,
                                    strategy=fxpar.Strategy(dp=args.ranks, sync=method, **more))
        with fxpar.LocalCluster(args.ranks + servers) as ranks:
            t0 = time.perf_counter()
            result = program.run_local(batches, cluster=ranks, measure_comm=True)
            wall = time.perf_counter() - t0
        losses = [float(x) for x in result.losses]
        curves[label], times[label] = losses, wall
        sent = sum(b for step in result.comm_calls[0] for _, b in step) / args.steps
        final = sum(losses[-args.tail:]) / args.tail
        table.append((label, final, sent, wall))
        print(f"  {label:>28}: final loss {final:.4f}, {wall:.0f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"sync_convergence{args.tag}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + list(curves))
        for i in range(args.steps):
            w.writerow([i] + [f"{curves[k][i]:.6f}" for k in curves])
        w.writerow(["wall_s"] + [f"{times[k]:.2f}" for k in curves])
    base = dict((r[0], r[1]) for r in table).get("sync dp")
    print(f"\n| method | collective bytes per step, rank 0 (mean) | wall time (s) | final loss (mean of last "
          f"{args.tail}) | vs sync dp |")
    print("|---|---|---|---|---|")
    for label, final, sent, wall in table:
        rel = f"{final / base - 1:+.2%}" if base else "-"
        print(f"| {label} | {sent:,.0f} | {wall:.1f} | {final:.4f} | {rel} |")
    plot(curves, times, out / f"sync_convergence{args.tag}.png",
         f"synchronisation methods, {args.ranks} ranks, AdamW, char GPT on pydoc_data.topics")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
