"""Gradient compression on a real task: a small character-level GPT on a fixed text, every method beside plain dp.

The text is the Python documentation's topic pages that every CPython ships (``pydoc_data.topics``, about
750 KB; the first ``--chars`` characters), read as bytes (vocabulary 256). The same model, the same batches
(random windows, fixed seed) and the same AdamW for every method (QAdam, which carries Adam's moments itself, with
its ``QAdamOptimizer`` at the same learning rate), at ``--ranks`` gloo ranks; each method's loss
per step goes to a CSV, its final loss (the mean of the last ``--tail`` steps) beside plain dp's in a table, and,
where matplotlib is installed (``pip install -e ".[plot]"``), the curves to a PNG.

    python benchmarks/compression_convergence.py [--steps 300] [--ranks 4] [--methods all] [--out docs/img]

A method passes when its final loss is within ``--margin`` (relative) of plain dp's.
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

import fxpar  # noqa: E402
from fxpar import compress as C  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P  # noqa: E402


def methods(names: str) -> dict:
    """The methods compared with plain dp (``"allreduce"``), by label."""
    table = {
        "allreduce": "allreduce",
        "fp16": lambda: C.FP16(),
        "powersgd-r1": lambda: C.PowerSGD(rank=1, start_iter=10),
        "powersgd-r2": lambda: C.PowerSGD(rank=2, start_iter=10),
        "topk-1%": lambda: C.TopK(ratio=0.01, error_feedback=True),
        "randomk-10%": lambda: C.RandomK(ratio=0.1, unbiased=False, error_feedback=True),
        "wangni-10%": lambda: C.Wangni(ratio=0.1),
        "qsgd-16": lambda: C.QSGD(levels=16, bucket=1024),
        "nuqsgd-4b": lambda: C.NUQSGD(bits=4, bucket=1024),
        "alq-3b": lambda: C.ALQ(bits=3),
        "amq-3b": lambda: C.AMQ(bits=3),
        "accordion": lambda: C.Accordion(low=C.PowerSGD(rank=1, start_iter=10), high=C.PowerSGD(rank=2, start_iter=10)),
        "bytegrad": lambda: C.ByteGrad(),
        "qadam": lambda: C.QAdam(warmup_steps=100),
        # BAGUA's decentralized SGD on a ring; the diffusion order, since BAGUA's order refuses AdamW's weight decay
        "decentralized-ring": lambda: C.Decentralized(peers="ring", order="adapt_then_combine"),
        # BAGUA's low-precision decentralized SGD (ring, the weights' change as 8-bit codes; any optimizer)
        "decentralized-ring-8bit": lambda: C.Decentralized(peers="ring", low_precision=True),
        # torch's own hook run on fxpar's buckets, set as powersgd-r2
        "ddphook-powersgd-r2": lambda: C.DDPHook(P.powerSGD_hook, P.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10, min_compression_rate=2,
            use_error_feedback=True, warm_start=True)),
    }
    want = list(table) if names == "all" else ["allreduce"] + [n for n in names.split(",") if n != "allreduce"]
    out = {}
    for n in want:
        if n not in table:
            raise SystemExit(f"--methods: unknown method {n!r}; choose from {', '.join(table)} or 'all'")
        v = table[n]
        try:
            out[n] = v if isinstance(v, str) else v()
        except AttributeError as e:          # a method this checkout does not ship
            print(f"skipping {n}: {e}")
    return out


# methods that carry the optimizer's moments themselves, and the optimizer each pairs with, given the learning rate
OWN_OPTIMIZER = {"qadam": lambda lr: (C.QAdamOptimizer, {"lr": lr})}


def plot(curves: dict, path: Path, title: str) -> None:
    """The loss curves (a 10-step running mean) to ``path``, where matplotlib is installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib not installed: no plot; pip install -e '.[plot]')")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    k = 10
    colors = plt.cm.tab20.colors
    for j, (label, ys) in enumerate(curves.items()):
        smooth = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
        ax.plot(smooth, label=label, color="black" if label == "allreduce" else colors[(2 * j) % 20],
                lw=2.0 if label == "allreduce" else 1.0, ls=("-", "--", ":", "-.")[j % 4])
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {k} steps)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def from_csv(path: Path) -> dict:
    """The curves a run wrote (``--replot``)."""
    with open(path) as f:
        rows = list(csv.reader(f))
    return {label: [float(r[j + 1]) for r in rows[1:]] for j, label in enumerate(rows[0][1:])}


def text_ids(chars: int) -> torch.Tensor:
    import pydoc_data.topics as topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))[:chars]
    return torch.tensor(list(text.encode("utf-8", "replace")), dtype=torch.long)


def task(args) -> tuple:
    """``(ids, batches, model)``: the text, ``args.steps`` batches of ``args.batch`` random windows of ``args.seq``
    bytes (fixed seed), and the char GPT (seeded), the same for every method and every script that uses it."""
    ids = text_ids(args.chars)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - args.seq - 1, (args.steps, args.batch), generator=g)
    batches = [(torch.stack([ids[s:s + args.seq] for s in row]), torch.stack([ids[s + 1:s + args.seq + 1] for s in row]))
               for row in starts]
    torch.manual_seed(0)
    model = GPT(vocab=256, d=args.d, layers=args.layers, heads=max(1, args.d // 16), max_seq=args.seq)
    return ids, batches, model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--methods", default="all")
    ap.add_argument("--chars", type=int, default=300_000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                    help="adamw, or SGD with Nesterov momentum 0.9 (the optimizer PowerSGD's paper trains with)")
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--tag", default="", help="suffix of the CSV and PNG names")
    ap.add_argument("--replot", default=None, help="a CSV this script wrote: plot it again, train nothing")
    args = ap.parse_args(argv)
    if args.replot:
        p = Path(args.replot)
        plot(from_csv(p), p.with_suffix(".png"), f"gradient compression, {args.ranks} ranks, {args.optimizer}, "
             "char GPT on pydoc_data.topics")
        return 0
    ids, batches, model = task(args)
    params = sum(p.numel() for p in model.parameters())
    print(f"char GPT {args.layers} layers, d={args.d}, {params / 1e3:.0f}K params; {len(ids)} characters of "
          f"pydoc_data.topics; global batch {args.batch}x{args.seq}; {args.steps} steps; {args.ranks} gloo ranks; "
          f"{args.optimizer} lr {args.lr}")
    opt = ((torch.optim.AdamW, {"lr": args.lr}) if args.optimizer == "adamw" else
           (torch.optim.SGD, {"lr": args.lr, "momentum": 0.9, "nesterov": True}))
    curves, table = {}, []
    with fxpar.LocalCluster(args.ranks) as cluster:
        for label, method in methods(args.methods).items():
            t0 = time.perf_counter()
            program = fxpar.parallelize(model, fxpar.ClusterSpec.local(args.ranks), batches[0], loss_fn=gpt_loss,
                                        optimizer=OWN_OPTIMIZER[label](args.lr) if label in OWN_OPTIMIZER else opt,
                                        strategy=fxpar.Strategy(dp=args.ranks, grad_sync=method))
            result = program.run_local(batches, cluster=cluster, measure_comm=True)
            losses = [float(x) for x in result.losses]
            curves[label] = losses
            calls = result.comm_calls[0]          # rank 0: per step, (kind, bytes) of each collective
            sent = sum(b for _, b in calls[-1])
            final = sum(losses[-args.tail:]) / args.tail
            table.append((label, final, sent, time.perf_counter() - t0))
            print(f"  {label:>12}: final loss {final:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    base = dict((r[0], r[1]) for r in table)["allreduce"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"compression_convergence{args.tag}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + list(curves))
        for i in range(args.steps):
            w.writerow([i] + [f"{curves[k][i]:.6f}" for k in curves])
    print(f"\n| method | bytes sent per step per rank | final loss (mean of last {args.tail}) | vs plain dp | "
          f"within {args.margin:.0%} |")
    print("|---|---|---|---|---|")
    ok = True
    for label, final, sent, _ in table:
        rel = final / base - 1
        good = rel <= args.margin
        ok &= good
        print(f"| {label} | {sent:,} | {final:.4f} | {rel:+.2%} | {'yes' if good else 'NO'} |")
    plot(curves, out / f"compression_convergence{args.tag}.png",
         f"gradient compression, {args.ranks} ranks, {args.optimizer}, char GPT on pydoc_data.topics")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
