"""Tensor parallelism: split each operator of a small GPT over 2 ranks, four ways, and check it trains as one process.

    python3 examples/tensor_parallel.py                    # megatron, layouts, auto (Tofu), and dp=2 x tp=2
    python3 examples/tensor_parallel.py --mode megatron --show-graph

For each sharding mode it prints which parameters are split and how, the collectives the tensor_parallel pass
inserted per step (by phase and kind), the parameter bytes a rank holds, and the largest difference from
single-process PyTorch on the same batches (float64, so the match is exact to rounding).
"""
import argparse

import torch

import fxpar
import fxpar.meta as M
from fxpar.testing import GPT, gpt_loss, max_abs_diff, reference_training, token_batches

MODES = {
    "megatron": dict(tp=2, sharding="megatron"),
    "layouts": dict(tp=2, sharding={"blocks.*.fc.weight": ("tp", None), "blocks.*.fc.bias": ("tp",),
                                    "blocks.*.fc2.weight": (None, "tp")}),
    "auto": dict(tp=2, sharding="auto"),
    "dp2xtp2": dict(dp=2, tp=2, sharding="megatron"),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=sorted(MODES), action="append")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--show-graph", action="store_true", help="print the local graph every tp rank runs")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, layers=2, heads=4).double()
    batches = token_batches(args.steps, batch=8, seq=16, vocab=64)
    opt = (torch.optim.AdamW, {"lr": 1e-3})
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, opt)
    # Tofu's cost model reads the cluster: on loopback figures this tiny model is cheapest kept whole, so the
    # example describes a fast link (as between GPUs in one node) to make the search split it
    fast = {"intra_node": fxpar.LinkSpec(100e9, 1e-6)}
    for mode in args.mode or list(MODES):
        strategy = fxpar.Strategy(**MODES[mode])
        cluster = fxpar.ClusterSpec.local(strategy.size, **(fast if mode == "auto" else {}))
        program = fxpar.parallelize(model, cluster, batches[0], gpt_loss, opt, strategy=strategy)
        res = program.run_local(batches)
        split = {k: tuple(v) for k, v in program.plan.section("tensor_parallel").stages[0]["params"].items() if any(v)}
        comm = {}
        for n in program.graphs(0)["step"].graph.nodes:
            c = n.meta.get(M.COMM.name)
            if c is not None and c.axis.startswith("tp"):
                key = f"{M.get(n, M.PHASE)} {c.kind}"
                comm[key] = comm.get(key, 0) + 1
        print(f"== {strategy}: {len(split)} parameters split, e.g. {dict(list(split.items())[:3])}")
        print(f"   tp collectives per step: {comm or 'none'}")
        print(f"   max |loss - single-process| = {max(abs(a - b) for a, b in zip(res.losses, ref_losses)):.1e}, "
              f"max |param - single-process| = {max_abs_diff(res.state_dict(), ref_state):.1e}")
        if args.show_graph:
            print(program.graphs(0)["step"].code)


if __name__ == "__main__":
    main()
