"""The largest global batch that fits a memory budget per rank: Wavelet's two waves against plain data parallelism.

    PYTHONPATH=. python3 benchmarks/bench_wavelet_batch.py [--budget-mib 6] [--sizes 8,16,32,64,128] [--measure]

A float64 GPT (4 blocks, width 64, vocab 256, sequence 32, untied head), AdamW, dp=2 on this machine's gloo ranks.
For each global batch both programs are built and their per-rank peak predicted (``program.estimate()``: plain dp
runs one fused step; Wavelet runs its tick and tock waves, one microbatch each, half a cycle apart on the model in
two chunks); :func:`fxpar.features.wavelet.largest_batch` picks the largest that fits the budget. ``--measure``
also trains one step of each at the two largest batches with the tracker on (``run_local(measure_memory=True)``)
and prints the measured peak beside the predicted one.
"""
from __future__ import annotations

import argparse

import torch

import fxpar
from fxpar.features.wavelet import largest_batch, wave_peak
from fxpar.testing import gpt_loss, token_batches
from fxpar.testing.models import GPT

ADAMW = (torch.optim.AdamW, {"lr": 1e-3})
MIB = 2**20


def _model():
    torch.manual_seed(0)
    return GPT(vocab=256, d=64, layers=4, heads=4, max_seq=32, tie_weights=False).double()


def _batch(b: int):
    return token_batches(1, batch=b, seq=32, vocab=256)[0]


def _program(b: int, wavelet: bool):
    strategy = fxpar.Strategy(dp=2, schedule="wavelet") if wavelet else fxpar.Strategy(dp=2)
    return fxpar.parallelize(_model(), fxpar.ClusterSpec.local(2), _batch(b), gpt_loss, ADAMW, strategy=strategy)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-mib", type=float, default=6.0)
    ap.add_argument("--sizes", default="8,16,32,64,128")
    ap.add_argument("--measure", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    budget = args.budget_mib * MIB
    progs = {}

    def peak_of(wavelet):
        def peak(b):
            progs[(wavelet, b)] = p = _program(b, wavelet)
            return p.estimate().ranks[0].peak_memory_bytes
        return peak
    print(f"budget {args.budget_mib} MiB per rank; dp=2; global batch sizes {sizes}")
    print("| global batch | plain dp peak (MiB) | Wavelet peak (MiB) | Wavelet M(t)+M(t+T/2) (MiB) |")
    print("|---|---|---|---|")
    fit = {}
    for wavelet in (False, True):
        fit[wavelet] = largest_batch(peak_of(wavelet), budget, sizes)
    for b in sizes:
        row = [str(b)]
        for wavelet in (False, True):
            p = progs.get((wavelet, b))
            row.append(f"{p.estimate().ranks[0].peak_memory_bytes / MIB:.2f}" if p is not None else "-")
        p = progs.get((True, b))
        row.append(f"{wave_peak(p).combined / MIB:.2f}" if p is not None else "-")
        print("| " + " | ".join(row) + " |")
    print(f"largest batch that fits: plain dp {fit[False][0]}, Wavelet {fit[True][0]}")
    if args.measure:
        lc = fxpar.LocalCluster(2)
        try:
            for wavelet in (False, True):
                b = fit[wavelet][0]
                if b is None:
                    continue
                p = progs[(wavelet, b)]
                res = p.run_local([_batch(b)], cluster=lc, measure_memory=True)
                print(f"{'Wavelet' if wavelet else 'plain dp'} at batch {b}: measured {res.peak_memory_bytes[0] / MIB:.3f} "
                      f"MiB, predicted {p.estimate().ranks[0].peak_memory_bytes / MIB:.3f} MiB (rank 0)")
        finally:
            lc.close()


if __name__ == "__main__":
    main()
