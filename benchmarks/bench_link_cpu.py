"""What moving gradients over the capped link costs the CPU (why overlap gains less on 2 cores).

Two gloo ranks in the netns harness (benchmarks/netns_link.py) all-reduce a buffer back to back at each
cap; meanwhile the machine's CPU time (``/proc/stat``: user, system, softirq, ... of every core) and each
rank's own are counted. On a machine whose cores all run compute (here: 2 ranks, 1 thread each, 2 cores),
every CPU-second the transfer costs (gloo's threads, the kernel's TCP/veth/tbf path) is taken from compute
when communication overlaps it -- a cost DDP's un-overlapped all-reduce pays in time it waits anyway.

    python benchmarks/bench_link_cpu.py [--rates 2gbit,1gbit,none] [--mib 14] [--seconds 2]
"""
import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def _cpu_ticks() -> list:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def cpu_cost(nbytes: int, seconds: float) -> dict:
    """All-reduce ``nbytes`` back to back for about ``seconds``; CPU seconds of the machine and this rank."""
    import torch
    import torch.distributed as dist
    buf = torch.zeros(nbytes // 4)
    dist.all_reduce(buf)                                 # warm the connections
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(buf)
    one = time.perf_counter() - t0
    reps = max(2, int(seconds / max(one, 1e-3)))
    reps = torch.tensor(reps)
    dist.all_reduce(reps, op=dist.ReduceOp.MAX)          # every rank runs the same number
    dist.barrier()
    s0, r0, t0 = _cpu_ticks(), os.times(), time.perf_counter()
    for _ in range(int(reps)):
        dist.all_reduce(buf)
    t1, r1, s1 = time.perf_counter(), os.times(), _cpu_ticks()
    d = [b - a for a, b in zip(s0, s1)]
    tick = os.sysconf("SC_CLK_TCK")
    return {"wall_s": t1 - t0, "mib": int(reps) * nbytes / 2**20, "rank_cpu_s": (r1.user - r0.user) + (r1.system - r0.system),
            "machine_busy_s": (sum(d) - d[3] - d[4]) / tick, "softirq_s": d[6] / tick}


def main():
    from bench_link_cpu import cpu_cost as worker    # by module name: the ranks unpickle it
    from netns_link import CappedLink, NetnsCluster, format_rate, parse_rate
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="2gbit,1gbit,none")
    ap.add_argument("--mib", type=float, default=14.0)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    print(f"load average at start: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}; {os.cpu_count()} cores")
    print(f"{'cap':>9} | {'MiB/s':>7} | {'machine CPU ms per MiB':>22} | {'per rank (own) ms/MiB':>21} | "
          f"{'softirq share':>13}")
    with CappedLink() as link:
        with NetnsCluster(2, link) as cl:
            for rate in args.rates.split(","):
                bps = parse_rate(rate)
                link.set_rate(bps)
                outs = cl.run(worker, [(int(args.mib * 2**20), args.seconds)] * 2)
                o = outs[0]
                own = sum(x["rank_cpu_s"] for x in outs) / 2
                print(f"{format_rate(bps):>9} | {o['mib'] / o['wall_s']:7.0f} | {1e3 * o['machine_busy_s'] / o['mib']:22.2f} | "
                      f"{1e3 * own / o['mib']:21.2f} | {o['softirq_s'] / max(o['machine_busy_s'], 1e-9):13.2f}")
    print(f"load average at end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")


if __name__ == "__main__":
    main()
