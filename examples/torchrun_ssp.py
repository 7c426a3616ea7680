"""Parameter-server training under torchrun: stale synchronous parallel (SSP, DSSP) and HetPipe, whose parameter
servers are the last ranks of the launch.

    # SSP: 2 workers (ranks 0, 1) + 1 parameter server (rank 2; it runs the same loop, with no batch of its own)
    torchrun --standalone --nproc-per-node 3 examples/torchrun_ssp.py --method ssp --staleness 0
    # DSSP, the bound chosen per read in [1, 3]
    torchrun --standalone --nproc-per-node 3 examples/torchrun_ssp.py --method dssp
    # HetPipe: 2 virtual workers of 2 stages (ranks 0-3) + 2 parameter servers, one per stage (ranks 4, 5)
    torchrun --standalone --nproc-per-node 6 examples/torchrun_ssp.py --method hetpipe --staleness 0

Every rank builds the same program; ``program.runner()`` gives a worker its part and a server rank its server, so
the loop below runs unchanged on every rank. With ``--save DIR`` the ranks train ``--steps`` steps, save, train
``--steps`` more, then load ``DIR`` and train those again: the servers restart from what the workers loaded, and with
staleness 0 the second time gives the same losses bitwise. ``--out FILE``: rank 0 writes the losses and the trained
state there (``torch.save``).
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar import sync as S  # noqa: E402
from fxpar.testing import MLP  # noqa: E402
from fxpar.testing.compress import mlp_batches  # noqa: E402


def program_for(method: str, staleness: int, world: int, batch):
    """The program every rank builds: SSP / DSSP over ``world - 1`` workers and one server, or HetPipe over
    ``(world - 2) / 2`` pipelines of 2 stages and two servers (one per stage)."""
    torch.manual_seed(0)
    model = MLP(layers=4).double()
    sgd = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    if method == "hetpipe":
        workers = world - 2
        strategy = fxpar.Strategy(dp=workers // 2, pp=2, microbatches=2, schedule="hetpipe", staleness=staleness)
        cluster = fxpar.ClusterSpec.local(workers, cpu_servers=2)
    else:
        workers = world - 1
        sync = S.SSP(staleness=staleness) if method == "ssp" else S.DSSP(low=1, high=3)
        strategy = fxpar.Strategy(dp=workers, sync=sync)
        cluster = fxpar.ClusterSpec.local(workers, cpu_servers=1)
    return model, fxpar.parallelize(model, cluster, batch, loss_fn=F.mse_loss, optimizer=sgd, strategy=strategy)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", choices=("ssp", "dssp", "hetpipe"), default="ssp")
    ap.add_argument("--staleness", type=int, default=0, help="SSP's s, HetPipe's D (DSSP chooses its own in [1, 3])")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--save", default=None, help="save after --steps steps, go on, then load it and repeat")
    ap.add_argument("--out", default=None, help="rank 0 writes the losses and the trained state there")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "3"))
    batches = mlp_batches(2 * args.steps)
    _, program = program_for(args.method, args.staleness, world, batches[0])
    again = []
    with program.runner() as runner:       # leaving the block waits for every rank, then leaves the group
        losses = [runner.step(b) for b in batches[:args.steps]]
        if args.save:
            runner.save(args.save)         # collective: the workers write, each server answers with its clock table
        losses += [runner.step(b) for b in batches[args.steps:]]
        if args.save:
            runner.load(args.save)         # the workers' next step restores the servers from what they loaded
            again = [runner.step(b) for b in batches[args.steps:]]
        state = runner.state_dict()        # collective: every rank calls it, servers too
        if runner.rank == 0:
            print("losses", " ".join(f"{x:.15e}" for x in losses))
            if again:
                print("again", " ".join(f"{x:.15e}" for x in again))
            if args.out:
                torch.save({"losses": losses, "again": again, "state": state}, args.out)


if __name__ == "__main__":
    main()
