"""Asynchronous pipelines on a real task: Pipelined Backpropagation (each correction), PipeMare, PipeDream and
PipeDream-2BW beside GPipe at the same pp and microbatches, the loss against samples.

The task is ``compression_convergence.py``'s: a small character-level GPT on the Python documentation's topic pages
(``pydoc_data.topics``, bytes, vocabulary 256), the same batches for every method. The asynchronous schedules refuse
tied weights, so the model is that script's GPT with its LM head untied (the same seed). Every method trains with
the same SGD with momentum (no Nesterov: spike compensation and weight prediction take plain momentum), at one
learning rate chosen for GPipe.

GPipe and 2BW update once per batch (its ``--microbatches`` microbatches' mean gradient); PipeDream, Pipelined
Backpropagation and PipeMare once per microbatch, so at one learning rate they take ``--microbatches`` times as many
steps per sample. The row "no delay" separates that from the delay: the same optimizer stepping once per microbatch,
in order, in one process (``fxpar.testing.reference_training`` on the microbatches; what these schedules compute with
every stage's delay 0).

Each method's loss per batch (the mean over its microbatches, each at the weights its forward used) goes to a CSV,
its final loss (the mean of the last ``--tail`` batches) beside GPipe's in a table, and, where matplotlib is
installed (``pip install -e ".[plot]"``), the curves against samples to a PNG.

At pp=4 the stages' delays are ``D_s = 3, 2, 1, 0`` updates (one at most at pp=2); the files then end in ``_pp4``.

    python benchmarks/pipeline_convergence.py [--steps 300] [--pp 2|4] [--microbatches 4] [--lr 0.1] [--out docs/img]
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
from fxpar.testing import GPT, gpt_loss, reference_training  # noqa: E402
from compression_convergence import from_csv, task  # noqa: E402

BASE = "GPipe"
NO_DELAY = "no delay (one process, update per microbatch)"


def methods(pp: int, warmup: int) -> dict:
    """label -> (pipeline ranks, schedule, its Strategy options)."""
    return {
        BASE: (pp, "gpipe", {}),
        "PB": (pp, "pipelined_bp", {"correction": None}),
        "PB + SC": (pp, "pipelined_bp", {"correction": "sc"}),
        "PB + LWP": (pp, "pipelined_bp", {"correction": "lwp"}),
        "PB + SC+LWP": (pp, "pipelined_bp", {"correction": "sc+lwp"}),
        f"PipeMare (warm-up {warmup}, discrepancy corr.)": (
            pp, "pipemare", {"lr_warmup": warmup, "discrepancy_correction": True}),
        "PipeDream (weight stashing)": (pp, "pipedream", {}),
        "2BW": (pp, "2bw", {}),
        NO_DELAY: (1, None, {}),
    }


def untied_model(args) -> GPT:
    """``task``'s char GPT, seeded the same, with the LM head its own parameter."""
    torch.manual_seed(0)
    return GPT(vocab=256, d=args.d, layers=args.layers, heads=max(1, args.d // 16), max_seq=args.seq,
               tie_weights=False)


def no_delay(model, batches: list, microbatches: int, optimizer) -> list:
    """Losses per batch (the mean of its microbatches) of ``optimizer`` stepping once per microbatch, in order, in one
    process: the update rule of PipeDream, Pipelined Backpropagation and PipeMare with no stage late."""
    micro = [(x.chunk(microbatches)[i], y.chunk(microbatches)[i])
             for x, y in batches for i in range(microbatches)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)         # tiny eager ops: a second intra-op thread only spins on a shared machine
    try:
        losses, _ = reference_training(model, micro, gpt_loss, optimizer)
    finally:
        torch.set_num_threads(threads)
    return [sum(losses[i:i + microbatches]) / microbatches for i in range(0, len(losses), microbatches)]


def write_csv(path: Path, curves: dict, batch: int) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "samples"] + list(curves))
        for i in range(len(next(iter(curves.values())))):
            w.writerow([i, batch * (i + 1)] + [f"{curves[k][i]:.6f}" for k in curves])


def plot(curves: dict, batch: int, path: Path, title: str) -> None:
    """The loss curves (a 10-batch running mean) against samples to ``path``, where matplotlib is installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib not installed: no plot; pip install -e '.[plot]')")
        return
    fig, ax = plt.subplots(figsize=(9, 5.5))
    k = 10
    colors = plt.cm.tab10.colors
    for j, (label, ys) in enumerate(curves.items()):
        smooth = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
        base = label == BASE
        ax.plot([batch * (i + 1) for i in range(len(ys))], smooth, label=label,
                color="black" if base else colors[j % 10], lw=2.2 if base else 1.1,
                ls="-" if base else ("-", "--", ":", "-.")[j % 4])
    finite = [y for ys in curves.values() for y in ys if y == y and abs(y) != float("inf")]
    if BASE in curves:        # a diverged curve would flatten the rest: cut the axis a little above the start
        ax.set_ylim(min(finite) - 0.1, 1.1 * curves[BASE][0])
    ax.set_xlabel("samples (sequences)")
    ax.set_ylabel(f"training loss (mean of {k} batches)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300, help="batches")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--chars", type=int, default=300_000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--warmup", type=int, default=200, help="PipeMare's lr_warmup, in updates (microbatches)")
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--only", default=None, help="comma-separated labels' first words (e.g. 'GPipe,PB')")
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--tag", default="", help="suffix of the CSV and PNG names")
    ap.add_argument("--replot", default=None, help="a CSV this script wrote: plot it again, train nothing")
    args = ap.parse_args(argv)
    title = (f"asynchronous pipelines beside GPipe, pp={args.pp}, {args.microbatches} microbatches, SGD lr {args.lr} "
             f"momentum {args.momentum}, char GPT on pydoc_data.topics")
    if args.pp < 2:
        ap.error(f"--pp {args.pp}: the schedules compared here are pipelines; give --pp 2 or more")
    if args.replot:
        p = Path(args.replot)
        curves = {k: v for k, v in from_csv(p).items() if k != "samples"}
        plot(curves, args.batch, p.with_suffix(".png"), title)
        return 0
    ids, batches, _ = task(args)
    model = untied_model(args)
    print(f"char GPT {args.layers} layers, d={args.d}, untied head, {sum(p.numel() for p in model.parameters()) / 1e3:.0f}K "
          f"params; {len(ids)} characters; batch {args.batch}x{args.seq} in {args.microbatches} microbatches; "
          f"{args.steps} batches; pp={args.pp}; SGD lr {args.lr} momentum {args.momentum}", flush=True)
    opt = (torch.optim.SGD, {"lr": args.lr, "momentum": args.momentum})
    wanted = args.only.split(",") if args.only else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"pipeline_convergence{'' if args.pp == 2 else f'_pp{args.pp}'}{args.tag}"
    curves, table = {}, []
    for label, (pp, schedule, options) in methods(args.pp, args.warmup).items():
        if wanted and label.split()[0] not in wanted:
            continue
        t0 = time.perf_counter()
        if schedule is None:
            losses = no_delay(model, batches, args.microbatches, opt)
        else:
            strategy = fxpar.Strategy(pp=pp, schedule=schedule, microbatches=args.microbatches, **options)
            program = fxpar.parallelize(model, fxpar.ClusterSpec.local(pp), batches[0], loss_fn=gpt_loss,
                                        optimizer=opt, strategy=strategy)
            with fxpar.LocalCluster(pp) as ranks:
                result = program.run_local(batches, cluster=ranks)
            losses = [float(x) for x in result.losses]
        wall = time.perf_counter() - t0
        curves[label] = losses
        final = sum(losses[-args.tail:]) / args.tail
        table.append((label, schedule or "-", pp, final, wall))
        print(f"  {label:>44}: final loss {final:.4f}, {wall:.0f} s wall", flush=True)
        write_csv(out / f"{stem}.csv", curves, args.batch)          # after each method: a stopped run keeps its curves
    base = dict((r[0], r[3]) for r in table).get(BASE)
    print(f"\n| method | `schedule=` | updates per batch | final loss (mean of last {args.tail} batches) | vs GPipe |")
    print("|---|---|---|---|---|")
    per_batch = {"gpipe": 1, "2bw": 1}
    for label, schedule, pp, final, _ in table:
        rel = f"{final / base - 1:+.2%}" if base else "-"
        name = f"`{schedule}`" if schedule != "-" else "-"
        print(f"| {label} | {name} | {per_batch.get(schedule, args.microbatches)} | {final:.4f} | {rel} |")
    plot(curves, args.batch, out / f"{stem}.png", title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
