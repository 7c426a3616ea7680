"""ZeRO: shard optimizer state, gradients and parameters over the data-parallel ranks.

    python3 examples/zero.py                 # ZeRO-1, 2 and 3 on 2 ranks, then ZeRO-3 with state in files
    python3 examples/zero.py --stage 3

Each stage trains the same small GPT as single-process PyTorch does (float64, so the match is exact to
rounding) and prints what each rank holds: parameters, accumulated gradients and optimizer state, in
bytes, next to the ZeRO paper's formulas (§5.1) for weights of W bytes in all with Adam's two moments and no
separate master copy: 2W + 2W/N (stage 1), W + 3W/N (stage 2), 4W/N (stage 3), against 4W without ZeRO.
"""
import argparse
import tempfile

import torch

import fxpar
from fxpar.testing import GPT, gpt_loss, max_abs_diff, reference_training


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), action="append")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, layers=2, heads=2).double()
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):
        idx = torch.randint(0, 64, (8, 17), generator=g)
        batches.append((idx[:, :-1], idx[:, 1:]))
    opt = (torch.optim.AdamW, {"lr": 1e-3})
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, opt)
    psi = sum(p.numel() for p in model.parameters()) * 8          # bytes of the weights (float64)
    n = 2
    formula = {1: 2 * psi + 2 * psi / n, 2: psi + 3 * psi / n, 3: 4 * psi / n}
    with fxpar.LocalCluster(n) as cluster:
        for stage in args.stage or (1, 2, 3):
            strategy = fxpar.Strategy(dp=n, zero=stage, microbatches=2)   # 2 microbatches: gradients accumulate
            program = fxpar.parallelize(model, n, batches[0], gpt_loss, opt, strategy=strategy)
            res = program.run_local(batches, cluster=cluster)
            held = res.state_bytes[0]
            total = held["params"] + held["grads"] + held["optimizer"]
            print(f"ZeRO-{stage}: rank 0 holds params {held['params']} B, grads {held['grads']} B, optimizer "
                  f"{held['optimizer']} B = {total} B (formula {formula[stage]:.0f} B); max |loss - single-process| = "
                  f"{max(abs(a - b) for a, b in zip(res.losses, ref_losses)):.1e}, max |param - single-process| = "
                  f"{max_abs_diff(res.state_dict(), ref_state):.1e}")
        with tempfile.TemporaryDirectory() as d:
            strategy = fxpar.Strategy(dp=n, zero=3, offload=("params", "optimizer"), offload_to="disk", offload_dir=d)
            program = fxpar.parallelize(model, n, batches[0], gpt_loss, opt, strategy=strategy)
            res = program.run_local(batches, cluster=cluster)
            print(f"ZeRO-3 with parameters and optimizer state in files under {d}: {res.state_bytes[0]['on_disk']} B "
                  f"on disk per rank; max |param - single-process| = {max_abs_diff(res.state_dict(), ref_state):.1e}")


if __name__ == "__main__":
    main()
