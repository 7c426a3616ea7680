"""Reproduces the gloo all-gather fault that fxpar's runtime steps around (fxpar.collectives.lower_for_backend).

Two ranks, one in each namespace of the capped-link harness (benchmarks/netns_link.py; uncapped veth), run the
pattern of Parallax's step (and of ZeRO-3's prefetch, Herring's second half): an all-reduce issued, then an
all-gather issued and waited while it is in flight, then the all-reduce waited. Each ``--ops`` entry runs
``--iters`` such rounds per batch, ``--batches`` batches, on a fresh pair of ranks after any crash:

- ``functional``: ``torch.ops._c10d_functional.all_gather_into_tensor`` (gloo: ``allgather_into_tensor_coalesced``);
- ``fxpar``: ``fxpar::all_gather_into_tensor`` (``dist.all_gather_single(async_op=True)``, gloo's
  ``_allgather_base``), what fxpar's executor runs on gloo groups;
- ``alone``: the functional gather with nothing in flight beside it.

Reported per op: rounds run, ranks that died (``malloc(): unaligned tcache chunk detected``, SIGABRT, or SIGSEGV),
and wrong results (the all-reduce's sum and the gather's rows are checked every round).

    python benchmarks/gloo_gather_stress.py [--ops functional,fxpar,alone] [--iters 10000] [--batches 6] [--loopback]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from netns_link import CappedLink, NetnsCluster  # noqa: E402


def rounds(n: int, op: str) -> int:
    """On a rank: ``n`` rounds of the pattern; returns the number of wrong results."""
    import torch.distributed as dist

    from fxpar.collectives import gloo_all_gather_into_tensor
    rank, world, name = dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional
    gather = gloo_all_gather_into_tensor if op == "fxpar" else ops.all_gather_into_tensor.default
    wrong = 0
    for i in range(n):
        busy = torch.full((388,), float(rank + i))
        ar = ops.all_reduce.default(busy, "sum", name) if op != "alone" else None
        ids = torch.randint(0, 200_000, (64,))
        rows = torch.randn(64, 32)
        rows[:, 0] = rank
        packed = torch.cat([ids.view(torch.uint8), rows.reshape(-1).view(torch.uint8)])
        got = ops.wait_tensor.default(gather(packed, world, name)).view(world, -1)
        back = got[:, 512:].clone().view(torch.float32).view(world, 64, 32)
        wrong += int(not torch.equal(back[:, :, 0], torch.arange(world, dtype=torch.float32)[:, None].expand(world, 64)))
        if ar is not None:
            wrong += int(ops.wait_tensor.default(ar)[0].item() != sum(r + i for r in range(world)))
    return wrong


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="functional,fxpar,alone")
    ap.add_argument("--iters", type=int, default=10_000)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--loopback", action="store_true", help="both ranks on 127.0.0.1 (no namespaces)")
    args = ap.parse_args()
    link = CappedLink()
    if args.loopback:
        link.missing = "--loopback"
    print(f"torch {torch.__version__}; {args.iters} rounds x {args.batches} batches per op", flush=True)
    report = {}
    with link:
        print("link: " + ("uncapped veth between two namespaces" if link.active else f"127.0.0.1 ({link.missing})"),
              flush=True)
        for op in args.ops.split(","):
            done, died, wrong, t0 = 0, [], 0, time.perf_counter()
            cl = None
            try:
                for b in range(args.batches):
                    if cl is None:
                        cl = NetnsCluster(2, link, timeout_s=300.0)
                    try:
                        wrong += sum(cl.run(rounds, [(args.iters, op)] * 2))
                        done += args.iters
                    except RuntimeError as e:
                        died.append(str(e).splitlines()[0])
                        cl = None                      # NetnsCluster closed itself; a fresh pair next batch
                    print(f"  {op}: batch {b + 1}/{args.batches}: {done} rounds clean, {len(died)} died", flush=True)
            finally:
                if cl is not None:
                    cl.close()
            report[op] = (done, died, wrong, time.perf_counter() - t0)
    print("\nop         | rounds completed | ranks died | wrong results | s")
    for op, (done, died, wrong, s) in report.items():
        print(f"{op:10} | {done:16} | {len(died):10} | {wrong:13} | {s:.0f}")
        for d in died:
            print(f"    {d}")


if __name__ == "__main__":
    main()
