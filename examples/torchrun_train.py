"""The same program on many machines: every rank runs this script under torchrun.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py
    # BytePS: 2 workers + 1 CPU summation server (the last rank; it runs the same loop, with no batch of its own)
    torchrun --standalone --nproc-per-node 3 examples/torchrun_train.py --cpu-servers 1
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
    ap.add_argument("--cpu-servers", type=int, default=0,
                    help="BytePS CPU summation servers (the last ranks); the other world - K ranks are dp workers")
    ap.add_argument("--save", default=None, help="after the steps, write a checkpoint there (every rank calls save)")
    args = ap.parse_args()
    if args.cpu_servers and args.tp > 1:
        ap.error(f"--cpu-servers {args.cpu_servers} with --tp {args.tp}: BytePS sums data-parallel gradients alone; "
                 "drop one of them")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    workers, k = world - args.cpu_servers, args.cpu_servers
    torch.manual_seed(0)
    model = GPT().double()
    batches = [(torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))) for _ in range(args.steps)]
    if k:
        strategy = fxpar.Strategy(dp=workers, grad_sync="byteps")
    else:
        split = dict(sharding="megatron") if args.tp > 1 else {}
        strategy = fxpar.Strategy(dp=workers // args.tp, tp=args.tp, **split)
    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(workers, cpu_servers=k), batches[0], loss_fn=gpt_loss,
                                optimizer=(torch.optim.AdamW, {"lr": 1e-2}), strategy=strategy)
    with program.runner() as runner:       # leaving the block waits for every rank, then leaves the group
        losses = [runner.step(b) for b in batches]
        state = runner.state_dict()        # collective: every rank calls it (each holds part of the state)
        if args.save:
            runner.save(args.save)         # collective too; a CPU server holds no state and writes nothing
        if runner.rank == 0:
            print("losses", " ".join(f"{x:.15e}" for x in losses))
            print("checksum", f"{sum(float(v.double().sum()) for v in state.values()):.15e}")
        if k and runner.rank == world - 1:     # a server: what it summed, per step
            print("served", " ".join(str(st["recv_bytes"]) for st in runner.per_step))
            print("server_losses", " ".join(f"{x:.15e}" for x in losses))     # step() returns the workers' loss


if __name__ == "__main__":
    main()
