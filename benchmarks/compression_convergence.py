"""Gradient compression on a real task: a small character-level GPT on a fixed text, every method beside plain dp.

The text is the Python documentation's topic pages that every CPython ships (``pydoc_data.topics``, about
750 KB; the first ``--chars`` characters), read as bytes (vocabulary 256). The same model and the same batches
(random windows, fixed seed) for every method, at ``--ranks`` gloo ranks. Each method trains under a recipe and is
compared with plain dp (``allreduce``) trained under the same recipe:

- ``sgd`` (the papers' recipe for the error-feedback methods: PowerSGD, Accordion, TopK, RandomK and torch's
  ``powerSGD_hook``): SGD with Nesterov momentum 0.9 applied to the summed gradient after decompression (Vogels et
  al., NeurIPS 2019, Algorithm 2; epfml/powersgd ``hyperparameters.md``, Tables 1 and 4), lr ``--sgd-lr`` warmed up
  linearly from ``lr / ranks`` over the first 1/60 of the steps and divided by 10 at 1/2 and at 5/6 of them (their
  5-epoch warm-up and decays at epochs 150 and 250 of 300; Accordion, Agarwal et al., MLSys 2021, trains ResNet-18
  with the same warm-up and decays, heavy-ball momentum 0.9); PowerSGD starts compressing at 10% of the steps (torch's ``PowerSGDState`` advice for
  ``start_powerSGD_iter``); ``--sgd-schedule constant`` keeps ``--sgd-lr`` throughout instead;
- ``adamw``: AdamW at a constant ``--lr`` (QAdam, which carries Adam's moments itself, with its
  ``QAdamOptimizer``), PowerSGD from step 10.

``--optimizer paper`` (the default) runs each method under its recipe (the error-feedback methods ``sgd``, the
others ``adamw``); ``--optimizer adamw`` / ``sgd`` runs every method under one recipe. Each method's loss per step
goes to a CSV, its final loss (the mean of the last ``--tail`` steps) beside its recipe's plain dp in a table, and,
where matplotlib is installed (``pip install -e ".[plot]"``), the curves to a PNG.

    python benchmarks/compression_convergence.py [--steps 300] [--ranks 4] [--methods all] [--out docs/img] [--check]

A method meets the margin when its final loss is at most ``--margin`` (relative) above its recipe's plain dp;
``--check`` exits 1 when one does not.
"""
from __future__ import annotations

import argparse
import csv
import functools
import math
import os
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


# the methods whose papers train with SGD + momentum and error feedback: their recipe is ``sgd`` under ``paper``
EF_METHODS = ("powersgd-r1", "powersgd-r2", "powersgd-r4", "accordion", "accordion-r2r4", "topk-1%", "randomk-10%",
              "ddphook-powersgd-r2", "ddphook-powersgd-r4")


def methods(names: str, start_iter: int) -> dict:
    """The methods compared with plain dp (``"allreduce"``), by label; PowerSGD's first compressed step is
    ``start_iter``."""
    psgd = dict(start_iter=start_iter)

    def hook(rank):
        return C.DDPHook(P.powerSGD_hook, P.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter,
            min_compression_rate=2, use_error_feedback=True, warm_start=True))
    table = {
        "allreduce": "allreduce",
        "fp16": lambda: C.FP16(),
        "powersgd-r1": lambda: C.PowerSGD(rank=1, **psgd),
        "powersgd-r2": lambda: C.PowerSGD(rank=2, **psgd),
        # the rank PowerSGD's paper compares on its language model (epfml/powersgd hyperparameters.md, Table 7)
        "powersgd-r4": lambda: C.PowerSGD(rank=4, **psgd),
        "topk-1%": lambda: C.TopK(ratio=0.01, error_feedback=True),
        # Stich et al. 2018's rand_k with memory (PowerSGD's Table 4 "Random K"): unscaled, error feedback
        "randomk-10%": lambda: C.RandomK(ratio=0.1, unbiased=False, error_feedback=True),
        "wangni-10%": lambda: C.Wangni(ratio=0.1),
        "qsgd-16": lambda: C.QSGD(levels=16, bucket=1024),
        "nuqsgd-4b": lambda: C.NUQSGD(bits=4, bucket=1024),
        "alq-3b": lambda: C.ALQ(bits=3),
        "amq-3b": lambda: C.AMQ(bits=3),
        # Accordion's ResNet-18 setting: rank 1 (low) / 2 (high), threshold 0.5; interval 10 of 300 steps (theirs:
        # 10 of 300 epochs)
        "accordion": lambda: C.Accordion(low=C.PowerSGD(rank=1, **psgd), high=C.PowerSGD(rank=2, **psgd),
                                         threshold=0.5, interval=10),
        # the same switching with the language model's rank as the high setting and half of it as the low one
        "accordion-r2r4": lambda: C.Accordion(low=C.PowerSGD(rank=2, **psgd), high=C.PowerSGD(rank=4, **psgd),
                                              threshold=0.5, interval=10),
        "bytegrad": lambda: C.ByteGrad(),
        "qadam": lambda: C.QAdam(warmup_steps=100),
        # BAGUA's decentralized SGD on a ring; the diffusion order, since BAGUA's order refuses AdamW's weight decay
        "decentralized-ring": lambda: C.Decentralized(peers="ring", order="adapt_then_combine"),
        # BAGUA's low-precision decentralized SGD (ring, the weights' change as 8-bit codes; any optimizer)
        "decentralized-ring-8bit": lambda: C.Decentralized(peers="ring", low_precision=True),
        # torch's own hook run on fxpar's buckets, set as powersgd-r2
        "ddphook-powersgd-r2": lambda: hook(2),
        "ddphook-powersgd-r4": lambda: hook(4),
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


def paper_lr_factor(step: int, steps: int, ranks: int) -> float:
    """The ``sgd`` recipe's lr factor at ``step``: linear warm-up from ``1 / ranks`` over the first ``steps / 60``
    steps, then 1, 0.1 from ``steps / 2``, 0.01 from ``5 * steps / 6`` (Vogels et al. 2019's 5-epoch warm-up and
    decays at epochs 150 and 250 of 300)."""
    warm = max(1, round(steps / 60))
    if step < warm:
        return (1 + (ranks - 1) * step / warm) / ranks
    return 1.0 if step < steps // 2 else 0.1 if step < 5 * steps // 6 else 0.01


def paper_schedule(optimizer, steps: int, ranks: int):
    """The ``sgd`` recipe's schedule on a rank's torch optimizer (stepped once per step)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(paper_lr_factor, steps=steps, ranks=ranks))


def recipe(name: str, args) -> dict:
    """``optimizer``, ``lr_scheduler`` and PowerSGD's ``start_iter`` of recipe ``name`` (``sgd`` or ``adamw``)."""
    if name == "sgd":
        constant = args.sgd_schedule == "constant"
        return {"optimizer": (torch.optim.SGD, {"lr": args.sgd_lr, "momentum": 0.9, "nesterov": True}),
                "lr_scheduler": None if constant else functools.partial(paper_schedule, steps=args.steps,
                                                                        ranks=args.ranks),
                "start_iter": max(2, args.steps // 10), "lr": args.sgd_lr,
                "label": f"SGD Nesterov 0.9, lr {args.sgd_lr}" + (" constant" if constant else
                                                                   " (warm-up, /10 at 1/2 and 5/6)")}
    return {"optimizer": (torch.optim.AdamW, {"lr": args.lr}), "lr_scheduler": None, "start_iter": 10,
            "lr": args.lr, "label": f"AdamW, lr {args.lr}"}


# methods that carry the optimizer's moments themselves, and the optimizer each pairs with, given the learning rate
OWN_OPTIMIZER = {"qadam": lambda lr: (C.QAdamOptimizer, {"lr": lr})}


def plot(curves: dict, path: Path, title: str) -> None:
    """The loss curves (a 10-step running mean) to ``path``, where matplotlib is installed: one panel per recipe
    (a column named ``recipe:method``; a name without ``:`` is one panel), each with its plain dp in black."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib not installed: no plot; pip install -e '.[plot]')")
        return
    panels: dict = {}
    for name, ys in curves.items():
        rec, _, label = name.rpartition(":")
        panels.setdefault(rec, {})[label] = ys
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5), squeeze=False)
    k = 10
    colors = plt.cm.tab20.colors
    for ax, (rec, group) in zip(axes[0], panels.items()):
        smooth = {label: [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
                  for label, ys in group.items()}
        base = [y for y in smooth.get("allreduce", next(iter(smooth.values()))) if math.isfinite(y)]
        lo = min(y for ys in smooth.values() for y in ys if math.isfinite(y)) - 0.1
        hi = max(base) + 0.2                # the y range plain dp spans: a diverging curve leaves the plot
        for j, (label, ys) in enumerate(smooth.items()):
            off = any(not math.isfinite(y) or y > hi for y in ys)
            ax.plot(ys, label=label + (" (leaves the plot)" if off else ""),
                    color="black" if label == "allreduce" else colors[(2 * j) % 20],
                    lw=2.0 if label == "allreduce" else 1.0, ls=("-", "--", ":", "-.")[j % 4])
        ax.set_ylim(lo, hi)
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (mean of {k} steps)")
        ax.set_title(f"{title}{', ' + RECIPE_TITLES.get(rec, rec) if rec else ''}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


RECIPE_TITLES = {"sgd": "SGD Nesterov 0.9 + the papers' lr schedule", "adamw": "AdamW"}


def from_csv(path: Path) -> dict:
    """The curves a run wrote (``--replot``)."""
    with open(path) as f:
        rows = list(csv.reader(f))
    return {label: [float(r[j + 1]) for r in rows[1:]] for j, label in enumerate(rows[0][1:])}


def write_csv(curves: dict, path: Path, steps: int) -> None:
    """Every curve so far, one column each (``recipe:method``), one row per step."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + list(curves))
        for i in range(steps):
            w.writerow([i] + [f"{curves[k][i]:.6f}" for k in curves])


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
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (the adamw recipe)")
    ap.add_argument("--sgd-lr", type=float, default=0.1, help="SGD's peak learning rate (the sgd recipe)")
    ap.add_argument("--sgd-schedule", choices=("paper", "constant"), default="paper",
                    help="the sgd recipe's lr schedule: the papers' warm-up and decays, or a constant --sgd-lr")
    ap.add_argument("--optimizer", choices=("paper", "adamw", "sgd"), default="paper",
                    help="paper: each method under its papers' recipe (see the module's text); adamw / sgd: every "
                         "method under that recipe")
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--check", action="store_true", help="exit 1 when a method ends above the margin")
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--tag", default="", help="suffix of the CSV and PNG names")
    ap.add_argument("--replot", default=None, help="a CSV this script wrote: plot it again, train nothing")
    args = ap.parse_args(argv)
    title = f"gradient compression, {args.ranks} ranks, char GPT on pydoc_data.topics"
    if args.replot:
        p = Path(args.replot)
        plot(from_csv(p), p.with_suffix(".png"), title)
        return 0
    ids, batches, model = task(args)
    params = sum(p.numel() for p in model.parameters())
    print(f"char GPT {args.layers} layers, d={args.d}, {params / 1e3:.0f}K params; {len(ids)} characters of "
          f"pydoc_data.topics; global batch {args.batch}x{args.seq}; {args.steps} steps; {args.ranks} gloo ranks; "
          f"recipes: {args.optimizer}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    wanted = list(methods(args.methods, 10))            # the labels only: each recipe builds its own below
    if args.optimizer == "paper":
        runs = [("sgd" if n in EF_METHODS else "adamw", n) for n in wanted if n != "allreduce"]
    else:
        runs = [(args.optimizer, n) for n in wanted if n != "allreduce"]
    recs = list(dict.fromkeys(r for r, _ in runs)) or [args.optimizer if args.optimizer != "paper" else "adamw"]
    runs = [(r, "allreduce") for r in recs] + runs
    runs.sort(key=lambda rn: recs.index(rn[0]))        # each recipe's plain dp first, then its methods
    curves, table = {}, []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with fxpar.LocalCluster(args.ranks) as cluster:
        for rec, label in runs:
            rc = recipe(rec, args)
            method = methods(label, rc["start_iter"])[label]
            t0 = time.perf_counter()
            program = fxpar.parallelize(model, fxpar.ClusterSpec.local(args.ranks), batches[0], loss_fn=gpt_loss,
                                        optimizer=OWN_OPTIMIZER[label](rc["lr"]) if label in OWN_OPTIMIZER else
                                        rc["optimizer"], lr_scheduler=rc["lr_scheduler"],
                                        strategy=fxpar.Strategy(dp=args.ranks, grad_sync=method))
            result = program.run_local(batches, cluster=cluster, measure_comm=True)
            losses = [float(x) for x in result.losses]
            curves[f"{rec}:{label}"] = losses
            calls = result.comm_calls[0]          # rank 0: per step, (kind, bytes) of each collective
            sent = sum(b for _, b in calls[-1])
            tail = losses[-args.tail:]
            final = sum(tail) / len(tail)
            table.append((rec, label, final, sent))
            print(f"  {rec:>5} {label:>24}: final loss {final:.4f} ({time.perf_counter() - t0:.0f} s, load average "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
            write_csv(curves, out / f"compression_convergence{args.tag}.csv", args.steps)   # after each run
    base = {rec: final for rec, label, final, _ in table if label == "allreduce"}
    print(f"\n| recipe | method | bytes sent per step per rank | final loss (mean of last {args.tail}) | "
          f"vs plain dp, same recipe | within {args.margin:.0%} |")
    print("|---|---|---|---|---|---|")
    missed = []
    for rec, label, final, sent in table:
        rel = final / base[rec] - 1
        good = rel <= args.margin          # NaN (diverged) compares False: a miss
        if not good:
            missed.append(f"{label} ({rec})")
        print(f"| {recipe(rec, args)['label']} | {label} | {sent:,} | {final:.4f} | {rel:+.2%} | "
              f"{'yes' if good else 'NO'} |")
    plot(curves, out / f"compression_convergence{args.tag}.png", title)
    if missed:
        print(f"\nabove the {args.margin:.0%} margin: {', '.join(missed)}")
    return 1 if missed and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
