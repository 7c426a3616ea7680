"""fxpar ZeRO-3 vs torch FSDP2 (``fully_shard``), and fxpar zero=0 vs torch DDP: step time and peak memory per
rank, same model, same batches, same ranks (gloo, CPU), side by side in one run.

    python benchmarks/bench_zero_vs_fsdp.py [--layers 4] [--d 128] [--steps 10] [--rounds 2]

Step time: the slowest rank's, median over the timed steps (after ``--warmup``), runs without any tracker.
Peak memory: a separate short run of each side under the same dispatch-level tracker
(``fxpar.runtime.measure.MemoryTracker``): parameters, optimizer state, buffers and the rank's microbatch
count from the start, then every storage an op makes until it dies. torch's AdamW makes its state at the first
step, so its figure is the peak of the second step (the state then exists from the start); fxpar's state exists
before its first step. The torch side runs with ``foreach=True`` AdamW, fxpar traces the same update.
"""
import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.runtime.measure import MemoryTracker  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402


def torch_worker(kind, model, batches, opt, warmup, measure):
    """One rank of torch DDP (``kind="ddp"``) or FSDP2 (``"fsdp"``: ``fully_shard`` on each block, then the root)."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    m = copy.deepcopy(model)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        m = DDP(m, bucket_cap_mb=25.0)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    cls, kw = opt
    o = cls(m.parameters(), **kw, foreach=True)
    times, peaks, held = [], [], []
    for i, b in enumerate(batches):
        n = b[0].shape[0] // world
        x, y = (t[rank * n:(rank + 1) * n] for t in b)
        state = [list(m.parameters()), [v for st in o.state.values() for v in st.values()], list(m.buffers())]
        tracker = MemoryTracker(state, inputs=[x, y]) if measure else None
        t0 = time.perf_counter()
        if tracker is not None:
            tracker.__enter__()
        o.zero_grad()
        loss = gpt_loss(m(x), y)
        loss.backward()
        o.step()
        if tracker is not None:
            tracker.__exit__(None, None, None)
            peaks.append(tracker.peak_bytes)
            held.append(tracker.held_bytes)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"step_times": times, "peaks": peaks, "held": held}


def fxpar_side(model, batches, opt, world, zero, lc, warmup, measure):
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(world), batches[0], gpt_loss, opt,
                             strategy=fxpar.Strategy(dp=world, zero=zero))
    res = prog.run_local(batches, cluster=lc, measure_memory=measure)
    if measure:
        return max(res.peak_memory_bytes.values()), max(res.held_memory_bytes.values()), prog
    return res.step_times[warmup:], prog


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=max(1, args.d // 32), max_seq=args.seq)
    g = torch.Generator().manual_seed(1)
    n = args.warmup + args.steps
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),
                torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)) for _ in range(n)]
    opt = (torch.optim.AdamW, {"lr": 1e-3})
    w = args.world_size
    psi = sum(p.numel() for p in model.parameters())
    print(f"GPT {args.layers} layers, d={args.d}, vocab={args.vocab}: {psi / 1e6:.2f}M params "
          f"({psi * 4 / 2**20:.1f} MiB fp32); global batch {args.batch}x{args.seq}; {w} gloo ranks; AdamW")
    pairs = (("fxpar zero=3", 3, "torch FSDP2", "fsdp"), ("fxpar zero=0", 0, "torch DDP", "ddp"))
    times = {name: [] for p in pairs for name in (p[0], p[2])}
    mem = {}
    with fxpar.LocalCluster(w) as lc:
        for ours, zero, theirs, kind in pairs:              # memory: 2 steps each under the tracker
            peak, held, prog = fxpar_side(model, batches[:2], opt, w, zero, lc, 0, True)
            mem[ours] = (peak, held, prog.estimate().ranks[0].peak_memory_bytes)
            out = lc.run(torch_worker, [(kind, model, batches[:2], opt, 0, True)] * w)
            mem[theirs] = (max(o["peaks"][1] for o in out), max(o["held"][1] for o in out), None)
        for _ in range(args.rounds):                        # time: alternate the sides, no tracker
            for ours, zero, theirs, kind in pairs:
                times[ours] += fxpar_side(model, batches, opt, w, zero, lc, args.warmup, False)[0]
                out = lc.run(torch_worker, [(kind, model, batches, opt, args.warmup, False)] * w)
                times[theirs] += [max(o["step_times"][i] for o in out) for i in range(args.steps)]
    mib = 2 ** 20
    print(f"{'side':14s} {'median step':>12s} {'peak/rank':>10s} {'held at start':>14s} {'fxpar estimate':>15s}")
    for name, (peak, held, est) in mem.items():
        e = f"{est / mib:12.2f} MiB" if est else f"{'-':>15s}"
        print(f"{name:14s} {statistics.median(times[name]) * 1e3:9.1f} ms {peak / mib:6.2f} MiB "
              f"{held / mib:10.2f} MiB {e}")
    for ours, _, theirs, _ in pairs:
        print(f"{ours} / {theirs}: step time x{statistics.median(times[ours]) / statistics.median(times[theirs]):.2f}, "
              f"peak memory x{mem[ours][0] / mem[theirs][0]:.2f}")


if __name__ == "__main__":
    main()
