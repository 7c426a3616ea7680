"""Wall time of fxpar.parallelize() (capture + plan + lower) for a 12-layer GPT of hidden 768
(GPT-2 small: vocab 50257, 124M parameters), dp=2. Goal: under 3 s on a 2-core machine.

    python benchmarks/bench_parallelize.py [--layers 12] [--d 768] [--repeat 3]
    python benchmarks/bench_parallelize.py --tiny dp2|pp2_1f1b|dp2_z3 [--repeat 8]

``--tiny``: ``fxpar.testing.tiny_gpt`` (2 layers, width 16, float64, the model most tests train) on an 8 x 16 batch
with the strategy named, AdamW: the per-call cost a numerics test pays in its own process.

The first call in a process also pays make_fx's one-time warm-up; both are reported, each with the process's CPU time
(on a shared machine, compare CPU times: wall time follows the load, printed first). Last, what capture's check
of the model's Python state costs (two snapshots of every module's plain attributes, compared; median of 20).
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.capture import _attributes_changed, _module_attributes  # noqa: E402
from fxpar.testing import GPT, gpt_loss, tiny_gpt  # noqa: E402

TINY = {"dp2": dict(dp=2), "pp2_1f1b": dict(pp=2, microbatches=2, schedule="1f1b"), "dp2_z3": dict(dp=2, zero=3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tiny", choices=sorted(TINY))
    args = ap.parse_args()
    if args.tiny:
        return tiny(args.tiny, args.repeat)
    model = GPT(vocab=50257, d=args.d, layers=args.layers, heads=args.d // 64, max_seq=args.seq)
    x = torch.randint(0, 50257, (4, args.seq))
    print(f"GPT {args.layers}x{args.d}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"load average {os.getloadavg()[0]:.1f}")
    for i in range(args.repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        p = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), (x, x), loss_fn=gpt_loss,
                              optimizer=(torch.optim.AdamW, {"lr": 3e-4}), strategy=fxpar.Strategy(dp=2))
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        nodes = len(p.graphs(0)["step"].graph.nodes)
        print(f"{'first' if i == 0 else 'again'}: parallelize {dt:.2f}s, CPU {cpu:.2f}s (capture {p.timings['capture']:.2f}s, "
              f"plan+lower {p.timings['lower']:.2f}s), {nodes} nodes, {len(p.plan.section('data_parallel').buckets[0])} buckets")
    took = []
    for _ in range(20):
        t0 = time.perf_counter()
        _attributes_changed(_module_attributes(model), _module_attributes(model))
        took.append(time.perf_counter() - t0)
    print(f"Python-state check at capture: {statistics.median(took) * 1e3:.1f} ms "
          f"({sum(1 for _ in model.modules())} modules)")


def tiny(name: str, repeat: int) -> None:
    model, x = tiny_gpt(), torch.randint(0, 32, (8, 16))
    st = fxpar.Strategy(**TINY[name])
    print(f"tiny_gpt, {st}, load average {os.getloadavg()[0]:.1f}")
    cpu = []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fxpar.parallelize(model, fxpar.ClusterSpec.local(st.size), (x, x), loss_fn=gpt_loss,
                          optimizer=(torch.optim.AdamW, {"lr": 1e-3}), strategy=st)
        cpu.append(time.process_time() - c0)
        print(f"parallelize {time.perf_counter() - t0:.3f}s, CPU {cpu[-1]:.3f}s")
    warm = sorted(cpu[1:])
    if warm:
        print(f"warm CPU: median {statistics.median(warm):.3f}s, {warm[0]:.3f}-{warm[-1]:.3f}s; "
              f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
