"""Gradient compression on a real task: a small character-level GPT on a fixed text, every method beside plain dp.

The text is the Python documentation's topic pages that every CPython ships (``pydoc_data.topics``, about
750 KB; the first ``--chars`` characters), read as bytes (vocabulary 256). The same model, the same batches
(random windows, fixed seed) and the same AdamW for every method, at ``--ranks`` gloo ranks; each method's loss
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


def text_ids(chars: int) -> torch.Tensor:
    import pydoc_data.topics as topics
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))[:chars]
    return torch.tensor(list(text.encode("utf-8", "replace")), dtype=torch.long)


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
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--out", default="docs/img")
    args = ap.parse_args(argv)
    ids = text_ids(args.chars)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - args.seq - 1, (args.steps, args.batch), generator=g)
    batches = [(torch.stack([ids[s:s + args.seq] for s in row]), torch.stack([ids[s + 1:s + args.seq + 1] for s in row]))
               for row in starts]
    torch.manual_seed(0)
    model = GPT(vocab=256, d=args.d, layers=args.layers, heads=max(1, args.d // 16), max_seq=args.seq)
    params = sum(p.numel() for p in model.parameters())
    print(f"char GPT {args.layers} layers, d={args.d}, {params / 1e3:.0f}K params; {len(ids)} characters of "
          f"pydoc_data.topics; global batch {args.batch}x{args.seq}; {args.steps} steps; {args.ranks} gloo ranks")
    curves, table = {}, []
    with fxpar.LocalCluster(args.ranks) as cluster:
        for label, method in methods(args.methods).items():
            t0 = time.perf_counter()
            program = fxpar.parallelize(model, fxpar.ClusterSpec.local(args.ranks), batches[0], loss_fn=gpt_loss,
                                        optimizer=(torch.optim.AdamW, {"lr": args.lr}),
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
    with open(out / "compression_convergence.csv", "w", newline="") as f:
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
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib not installed: no plot; pip install -e '.[plot]')")
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
        k = 10
        for label, ys in curves.items():
            smooth = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
            ax.plot(smooth, label=label, lw=2.0 if label == "allreduce" else 1.0)
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (mean of {k} steps)")
        ax.set_title(f"gradient compression, {args.ranks} ranks, char GPT on pydoc_data.topics")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "compression_convergence.png", dpi=110)
        print(f"\nplot: {out / 'compression_convergence.png'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
