"""Measured peak memory per rank over ``program.estimate()``'s prediction, for every ZeRO stage and recompute policy.

    python benchmarks/bench_memory_vs_predicted.py            # markdown table, as in docs/benchmarks.md

Tied GPT (vocab 64, d=32, 2 layers, 2 heads), float64, AdamW, global batch 8×16, 2 steps, dp=2; layouts: one
microbatch (the fused step), two (F, B, REDUCE_GRAD, STEP) and pp=2 × dp=2 with 4 microbatches (1F1B, ZB-H1).
Measured: ``run_local(measure_memory=True)`` (``fxpar.runtime.measure.MemoryTracker``), the most over the steps;
each cell is measured / predicted, the lowest and highest over the ranks. A cell above 1 by exactly one collective's
input is gloo's worker thread releasing that input late (see tests/test_memory_measured.py).
"""
from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fxpar  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
LAYOUTS = [("1 (fused step)", {}), ("2 (F, B, RG, STEP)", {"microbatches": 2}),
           ("pp=2, 4, 1F1B", {"pp": 2, "microbatches": 4, "schedule": "1f1b"}),
           ("pp=2, 4, ZB-H1", {"pp": 2, "microbatches": 4, "schedule": "zb1p"})]


def _gpt():
    torch.manual_seed(0)
    return GPT(vocab=64, d=32, layers=2, heads=2).double()


def _batches(n, batch=8, seq=16):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        idx = torch.randint(0, 64, (batch, seq + 1), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


def ratios(cluster, layout: dict, zero: int, recompute: str) -> list:
    """measured / predicted peak bytes, per rank."""
    world = 2 * layout.get("pp", 1)
    prog = fxpar.parallelize(_gpt(), fxpar.ClusterSpec.local(world), _batches(1)[0], gpt_loss, ADAMW,
                             strategy=fxpar.Strategy(dp=2, zero=zero, recompute=recompute, **layout))
    res = prog.run_local(_batches(2), cluster=cluster, measure_memory=True)
    est = prog.estimate()
    return [res.peak_memory_bytes[r] / est.ranks[r].peak_memory_bytes for r in range(world)]


def main() -> None:
    clusters: dict = {}
    print("| microbatches | recompute | zero=0 | zero=1 | zero=2 | zero=3 |")
    print("|---|---|---|---|---|---|")
    for (name, layout), recompute in itertools.product(LAYOUTS, ("none", "full", "selective")):
        world = 2 * layout.get("pp", 1)
        if world not in clusters:
            clusters[world] = fxpar.LocalCluster(world)
        cells = []
        for zero in range(4):
            r = ratios(clusters[world], layout, zero, recompute)
            lo, hi = min(r), max(r)
            cells.append(f"{lo:.3f}" if abs(hi - lo) < 5e-4 else f"{lo:.3f}–{hi:.3f}")
        print(f"| {name} | {recompute} | " + " | ".join(cells) + " |", flush=True)
    for c in clusters.values():
        c.close()


if __name__ == "__main__":
    main()
