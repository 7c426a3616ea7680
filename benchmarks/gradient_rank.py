"""How much of each step's gradient a rank-r approximation holds, over the convergence task's training.

PowerSGD sends a rank-r approximation of each matrix gradient (with error feedback, of the gradient plus the
residual). This trains the char GPT of ``compression_convergence.py`` in one process on its global batches, under
its ``sgd`` recipe (the same model, batches, optimizer and schedule as its plain dp), and at chosen steps prints,
over every gradient PowerSGD compresses (each viewed as ``(shape[0], -1)``, as ``powerSGD_hook`` does), the share
of the squared Frobenius norm the top ``r`` singular directions hold: ``sum_i<r s_i^2 / sum_i s_i^2``, summed over
the matrices (weighted by their norms), for r = 1, 2, 4.

    python benchmarks/gradient_rank.py [--steps 300] [--at 10,30,60,100,150,200,250,299]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from compression_convergence import paper_lr_factor, task  # noqa: E402
from fxpar.testing import gpt_loss  # noqa: E402

RANKS = (1, 2, 4)


def shares(model: torch.nn.Module) -> dict:
    """``{r: share}``: the top-r singular directions' part of the squared norm of every matrix gradient."""
    held = dict.fromkeys(RANKS, 0.0)
    total = 0.0
    for p in model.parameters():
        if p.grad is None or p.dim() < 2:
            continue              # vectors travel uncompressed
        s2 = torch.linalg.svdvals(p.grad.reshape(p.shape[0], -1).double()) ** 2
        total += float(s2.sum())
        for r in RANKS:
            held[r] += float(s2[:r].sum())
    return {r: held[r] / total for r in RANKS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--at", default="10,30,60,100,150,200,250,299")
    ap.add_argument("--ranks", type=int, default=4, help="the convergence run's ranks (its warm-up starts at 1/ranks)")
    ap.add_argument("--sgd-lr", type=float, default=0.1)
    args = ap.parse_args(argv)
    at = {int(x) for x in args.at.split(",")}
    conv = argparse.Namespace(chars=300_000, seq=64, batch=32, d=64, layers=2, steps=args.steps)
    _, batches, model = task(conv)
    opt = torch.optim.SGD(model.parameters(), lr=args.sgd_lr, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: paper_lr_factor(s, args.steps, args.ranks))
    print("| step | loss | " + " | ".join(f"rank {r} share" for r in RANKS) + " |")
    print("|---|---|" + "---|" * len(RANKS))
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = gpt_loss(model(x), y)
        loss.backward()
        if step in at:
            sh = shares(model)
            print(f"| {step} | {loss.item():.3f} | " + " | ".join(f"{sh[r]:.3f}" for r in RANKS) + " |", flush=True)
        opt.step()
        sched.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
