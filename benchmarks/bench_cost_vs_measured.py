"""Cost-model predictions vs measurements on this machine, in one run:

1. calibrate this machine (ClusterSpec.calibrate), 2. parallelize a GPT with dp over that
calibrated cluster, 3. predict (program.estimate()), 4. train on local gloo ranks and measure:
median step time, and bytes on the loopback interface (/proc/net/dev, all ranks together,
TCP/IP headers included) per step.

    python benchmarks/bench_cost_vs_measured.py [--world-size 2] [--layers 4] [--d 256] [--steps 20]
    python benchmarks/bench_cost_vs_measured.py --tp 2 --sharding megatron     # tensor parallelism instead of dp
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402


def _lo_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        if line.strip().startswith("lo:"):
            return int(line.split(":", 1)[1].split()[8])     # transmitted bytes
    return -1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (the rest of the world is dp)")
    ap.add_argument("--sharding", default="megatron", help="with --tp: auto | megatron | annotations")
    args = ap.parse_args()
    w = args.world_size
    cluster = fxpar.ClusterSpec.calibrate(world_size=w)
    print(f"calibrated: {cluster}; per-op overhead {cluster.device.op_overhead_s * 1e6:.1f} us, "
          f"all_reduce alpha {cluster.intra_node.latency * 1e6:.0f} us")
    torch.manual_seed(0)
    model = GPT(vocab=2048, d=args.d, layers=args.layers, heads=max(1, args.d // 64), max_seq=args.seq)
    batches = [(torch.randint(0, 2048, (args.batch, args.seq)), torch.randint(0, 2048, (args.batch, args.seq)))
               for _ in range(args.steps + 3)]
    program = fxpar.parallelize(model, cluster, batches[0], loss_fn=gpt_loss, optimizer=(torch.optim.AdamW, {"lr": 1e-3}),
                                strategy=fxpar.Strategy(dp=w // args.tp, tp=args.tp, bucket_cap_mb=args.bucket_mb,
                                                        **(dict(sharding=args.sharding) if args.tp > 1 else {})))
    print(f"strategy: {program.strategy}")
    est = program.estimate()
    with fxpar.LocalCluster(w) as lc:
        program.run_local(batches[:3], cluster=lc)           # warm-up
        before = _lo_bytes()
        res = program.run_local(batches[3:], cluster=lc)
        lo = (_lo_bytes() - before) / args.steps
    measured = statistics.median(res.step_times)
    predicted_bytes = sum(r.comm_bytes for r in est.ranks)
    print(f"step time: predicted {est.step_time_s * 1000:.1f} ms, measured median {measured * 1000:.1f} ms, "
          f"ratio predicted/measured {est.step_time_s / measured:.2f}")
    print(f"bytes per step, all ranks: predicted {predicted_bytes / 2**20:.2f} MiB on the wire (ring), loopback "
          f"measured {lo / 2**20:.2f} MiB (ratio {lo / predicted_bytes:.3f}; includes TCP/IP headers and control traffic)")


if __name__ == "__main__":
    main()
