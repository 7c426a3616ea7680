"""Plan and estimate GPT-3 175B (96 layers, d=12288, 96 heads, seq 2048, vocab 50257) on 1,024
simulated A100s (128 nodes x 8), with the model on the meta device: no parameter memory is used.

    python benchmarks/bench_gpt175b_estimate.py [--layers 96] [--nodes 128]

Only data parallelism runs end to end in fxpar today, so the plan is dp=1024: the estimate
reports (correctly) that the replicated AdamW state cannot fit an 80 GB device. Times
parallelize() (capture + plan + lower) and estimate() separately.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--d", type=int, default=12288)
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per rank")
    args = ap.parse_args()
    world = args.nodes * 8
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(vocab=50257, d=args.d, layers=args.layers, heads=args.d // 128, max_seq=2048)
        x = torch.randint(0, 50257, (args.micro_batch * world, 2048))
    n = sum(p.numel() for p in model.parameters())
    t1 = time.perf_counter()
    cluster = fxpar.ClusterSpec.preset("a100-80gb", nodes=args.nodes, gpus_per_node=8)
    program = fxpar.parallelize(model, cluster, (x, x), loss_fn=gpt_loss, optimizer=(torch.optim.AdamW, {"lr": 6e-5}),
                                strategy=fxpar.Strategy(dp=world))
    t2 = time.perf_counter()
    est = program.estimate()
    t3 = time.perf_counter()
    r0 = est.ranks[0]
    print(f"GPT {args.layers}x{args.d}: {n / 1e9:.1f}B parameters on {world} simulated A100s (meta device)")
    print(f"build model {t1 - t0:.1f}s; parallelize {t2 - t1:.1f}s (capture {program.timings['capture']:.1f}s, "
          f"{len(program.graphs(0)['step'].graph.nodes)} nodes); estimate {t3 - t2:.2f}s")
    print(f"estimated step {est.step_time_s:.2f}s: compute {r0.compute_time_s:.2f}s, comm {r0.comm_time_s:.2f}s "
          f"({r0.comm_bytes / 2**30:.0f} GiB sent per rank), peak memory {r0.peak_memory_bytes / 2**30:.0f} GiB per rank")


if __name__ == "__main__":
    main()
