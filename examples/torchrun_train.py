"""The same program on many machines: every rank runs this script under torchrun.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py
    # several machines: torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:PORT examples/torchrun_train.py

Each rank calls the same ``parallelize`` (deterministic: same seed, same batches) and runs only
its own part with ``program.runner()``; rank 0 prints the losses and a checksum of the state.
"""
import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (Megatron's split); the rest is dp")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    model = GPT().double()
    batches = [(torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))) for _ in range(args.steps)]
    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(world), batches[0], loss_fn=gpt_loss,
                                optimizer=(torch.optim.AdamW, {"lr": 1e-2}), strategy=fxpar.Strategy(dp=world // args.tp, tp=args.tp,
                                                                        sharding="megatron"))
    with program.runner() as runner:       # leaving the block waits for every rank, then leaves the group
        losses = [runner.step(b) for b in batches]
        state = runner.state_dict()        # collective: every rank calls it (each holds part of the state)
        if runner.rank == 0:
            print("losses", " ".join(f"{x:.15e}" for x in losses))
            print("checksum", f"{sum(float(v.double().sum()) for v in state.values()):.15e}")


if __name__ == "__main__":
    main()
