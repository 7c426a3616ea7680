"""Activation checkpointing: fxpar ``Strategy(recompute="full")`` vs ``torch.utils.checkpoint`` around each block
of the same model, one rank, side by side in one run: step time and peak memory (the same dispatch-level
tracker, ``fxpar.runtime.measure.MemoryTracker``, for both), with each side's no-recompute run beside it.

    python benchmarks/bench_recompute_vs_torch.py [--layers 4] [--d 128] [--seq 128] [--batch 8] [--steps 10]

Step time: median over the timed steps (after ``--warmup``), no tracker. Peak memory: one more step under the
tracker (torch: its second step, when AdamW's state exists from the start, as fxpar's does).
"""
import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.runtime.measure import MemoryTracker  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402


class Checkpointed(torch.nn.Module):
    """``model`` with ``torch.utils.checkpoint`` (non-reentrant) around each block."""

    def __init__(self, model: GPT):
        super().__init__()
        self.m = model

    def forward(self, idx):
        m = self.m
        x = m.drop(m.wte(idx) + m.wpe.weight[:idx.shape[1]])
        for b in m.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return m.head(m.ln_f(x))


def torch_side(model, batches, opt, warmup):
    cls, kw = opt
    o = cls(model.parameters(), **kw, foreach=True)
    times, peak = [], 0
    for i, (x, y) in enumerate(batches + batches[:2]):
        measure = i >= len(batches)            # two more steps, the second one under the tracker
        state = [list(model.parameters()), [v for st in o.state.values() for v in st.values()]]
        tracker = MemoryTracker(state, inputs=[x, y]) if measure and i == len(batches) + 1 else None
        t0 = time.perf_counter()
        if tracker is not None:
            tracker.__enter__()
        o.zero_grad()
        gpt_loss(model(x), y).backward()
        o.step()
        if tracker is not None:
            tracker.__exit__(None, None, None)
            peak = tracker.peak_bytes
        if warmup <= i < len(batches):
            times.append(time.perf_counter() - t0)
    return times, peak


def fxpar_side(model, batches, opt, recompute, warmup):
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(1), batches[0], gpt_loss, opt,
                             strategy=fxpar.Strategy(recompute=recompute))
    times = prog.run_local(batches).step_times[warmup:]
    res = prog.run_local(batches[:1], measure_memory=True)
    return times, res.peak_memory_bytes[0], prog.estimate().ranks[0].peak_memory_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=max(1, args.d // 32), max_seq=args.seq)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),
                torch.randint(0, args.vocab, (args.batch, args.seq), generator=g))
               for _ in range(args.warmup + args.steps)]
    opt = (torch.optim.AdamW, {"lr": 1e-3})
    psi = sum(p.numel() for p in model.parameters())
    print(f"GPT {args.layers} layers, d={args.d}, vocab={args.vocab}: {psi / 1e6:.2f}M params; batch "
          f"{args.batch}x{args.seq}; 1 rank, 1 thread; AdamW")
    times: dict = {}
    mem: dict = {}
    for _ in range(args.rounds):                   # alternate the sides
        for rc in ("none", "full"):
            t, peak, est = fxpar_side(model, batches, opt, rc, args.warmup)
            times.setdefault(f"fxpar recompute={rc}", []).extend(t)
            mem[f"fxpar recompute={rc}"] = (peak, est)
        for name, m in (("torch eager", copy.deepcopy(model)),
                        ("torch checkpoint", Checkpointed(copy.deepcopy(model)))):
            t, peak = torch_side(m, batches, opt, args.warmup)
            times.setdefault(name, []).extend(t)
            mem[name] = (peak, None)
    mib = 2 ** 20
    print(f"{'side':24s} {'median step':>12s} {'peak':>10s} {'fxpar estimate':>15s}")
    for name, (peak, est) in mem.items():
        e = f"{est / mib:11.2f} MiB" if est else f"{'-':>15s}"
        print(f"{name:24s} {statistics.median(times[name]) * 1e3:9.1f} ms {peak / mib:6.2f} MiB {e}")
    a, b = "fxpar recompute=full", "torch checkpoint"
    print(f"{a} / {b}: step time x{statistics.median(times[a]) / statistics.median(times[b]):.2f}, "
          f"peak memory x{mem[a][0] / mem[b][0]:.2f}")


if __name__ == "__main__":
    main()
