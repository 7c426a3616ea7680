"""Wall time of fxpar.parallelize() (capture + plan + lower) for a 12-layer GPT of hidden 768
(GPT-2 small: vocab 50257, 124M parameters), dp=2. Goal: under 3 s on a 2-core machine.

    python benchmarks/bench_parallelize.py [--layers 12] [--d 768] [--repeat 3]

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
from fxpar.testing import GPT, gpt_loss  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
