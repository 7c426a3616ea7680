"""What one small collective costs inside a step, and how much that moves from second to second.

A step made of a handful of small collectives (Parallax's: the pairs' all-gather, the dense rest's all-reduce,
≈ 75 small ops) is predicted by ``Program.estimate()`` from what ``ClusterSpec.calibrate()`` measured a small
collective to cost. This measures that cost several times in one pair of processes, a few seconds apart, four
ways, on 2 gloo ranks over loopback (1 KiB functional all-reduces; ``_STEP_OPS`` tiny adds as the step's other
work, as ``fxpar.tools.probes._measure_in_step`` does):

- ``blocking``: all-reduces back to back, gloo's threads' CPU per collective (``_measure_comm_cpu``, what
  ``DeviceSpec.comm_cpu_s`` is set from), and its per-MiB figure;
- ``in step``: {adds, all-reduce, wait} in a loop: wall per round, gloo's threads' CPU and the main thread's;
- ``overlapped``: {all-reduce issued, 10× the adds while it is in flight, wait}: wall per round against
  ``adds only`` (the 10× adds without the collective): what overlapping a small collective with compute saves;
- ``hidden behind compute``: an all-reduce of 1 KiB, 1 MiB and 4 MiB issued, then ``--compute-ms`` of 256×256
  matmuls (far longer than the transfer), then its wait, against the matmuls alone: the step time a collective
  costs when there is compute enough to hide all of it (on full cores: its CPU, taken from the compute).

    python benchmarks/bench_small_collective.py [--reps 4] [--rounds 300] [--compute-ms 20] [--comm-priority]
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _hidden(ops, name, compute_s: float, reps: int = 3, rounds: int = 40) -> list:
    """(bytes, [step time added per collective, s], [gloo threads' CPU per collective, s]) for each size."""
    import torch
    import torch.distributed as dist

    from fxpar.tools import probes as C
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(50):
        torch.mm(a, b)
    k = max(1, int(compute_s / ((time.perf_counter() - t0) / 50)))
    k = torch.tensor(k)
    dist.all_reduce(k, op=dist.ReduceOp.MAX)         # the same compute on both ranks

    def work():
        for _ in range(int(k)):
            torch.mm(a, b)
    out = []
    for size in (1 << 10, 1 << 20, 4 << 20):
        t = torch.ones(size // 4)
        added, cpu = [], []
        for _ in range(reps):
            dist.barrier()
            w0 = time.perf_counter()
            for _ in range(rounds):
                work()
            base = (time.perf_counter() - w0) / rounds
            dist.barrier()
            c0, w0 = C._comm_threads_cpu(), time.perf_counter()
            for _ in range(rounds):
                h = ops.all_reduce(t, "sum", name)
                work()
                ops.wait_tensor(h)
            added.append((time.perf_counter() - w0) / rounds - base)
            cpu.append((C._comm_threads_cpu() - c0) / rounds)
        out.append((size, added, cpu))
    return out


def _worker(rank, port, reps, rounds, comm_priority, compute_ms, queue):
    import torch
    import torch.distributed as dist

    from fxpar.tools import probes as C
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    name = dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional
    gm = C._adds_graph(C._STEP_OPS)
    t = torch.ones(C._ISSUE_NUMEL)
    dist.all_reduce(t)
    if C._comm_threads_cpu() is None:
        raise SystemExit("bench_small_collective: gloo's threads' CPU is read from /proc/self/task/*/schedstat (Linux); "
                         "this system has none: run it on Linux")
    if comm_priority:
        from fxpar.host import raise_comm_threads
        dist.barrier()
        if raise_comm_threads() is None:
            raise SystemExit("--comm-priority: gloo's threads could not be raised (needs root or CAP_SYS_NICE)")
        dist.barrier()

    def timed(body):
        dist.barrier()
        c0, m0, w0 = C._comm_threads_cpu(), time.thread_time(), time.perf_counter()
        for _ in range(rounds):
            body()
        return ((time.perf_counter() - w0) / rounds, (C._comm_threads_cpu() - c0) / rounds,
                (time.thread_time() - m0) / rounds)

    def in_step():
        gm(t)
        ops.wait_tensor(ops.all_reduce(t, "sum", name))

    def overlapped():
        a = ops.all_reduce(t, "sum", name)
        for _ in range(10):
            gm(t)
        ops.wait_tensor(a)

    def adds():
        for _ in range(10):
            gm(t)
    for _ in range(reps):
        blk = C._measure_comm_cpu()
        row = {"blocking_cpu": blk["per_collective_s"], "blocking_cpu_per_mib": blk["per_byte_s"] * 2**20,
               "in_step": timed(in_step), "overlapped": timed(overlapped), "adds": timed(adds)}
        if rank == 0:
            queue.put(row)
        time.sleep(1.0)
    hidden = _hidden(ops, name, compute_ms * 1e-3)
    if rank == 0:
        queue.put(hidden)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=4, help="measurements, about 1.5 s apart")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--compute-ms", type=float, default=20.0, help="the compute a collective hides behind (last table)")
    ap.add_argument("--comm-priority", action="store_true", help="gloo's threads under SCHED_FIFO (needs root)")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    from fxpar.tools.calibrate import free_port
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    print(f"load average at start: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}; {os.cpu_count()} cores; "
          f"2 ranks, 1 torch thread each; 1 KiB all-reduces" + ("; gloo's threads SCHED_FIFO" if args.comm_priority else ""))
    mp.start_processes(_worker, args=(free_port(), args.reps, args.rounds, args.comm_priority, args.compute_ms, queue), nprocs=2,
                       start_method="spawn")
    rows = [queue.get() for _ in range(args.reps)]
    hidden = queue.get()
    us = lambda x: f"{x * 1e6:6.0f}"      # noqa: E731
    print(f"{'rep':>3} | {'blocking: gloo CPU/coll':>23} | {'ms/MiB':>6} | {'in step: wall':>13} | {'gloo CPU':>8} | "
          f"{'main CPU':>8} | {'overlapped: wall':>16} | {'adds only':>9} | {'added':>6}   (µs per round)")
    for i, r in enumerate(rows):
        print(f"{i:>3} | {us(r['blocking_cpu']):>23} | {r['blocking_cpu_per_mib'] * 1e3:6.2f} | {us(r['in_step'][0]):>13} | "
              f"{us(r['in_step'][1]):>8} | {us(r['in_step'][2]):>8} | {us(r['overlapped'][0]):>16} | "
              f"{us(r['adds'][0]):>9} | {us(r['overlapped'][0] - r['adds'][0]):>6}")
    walls = [r["in_step"][0] for r in rows]
    added = [r["overlapped"][0] - r["adds"][0] for r in rows]
    print(f"in-step wall per small collective: min {min(walls) * 1e6:.0f}, median {statistics.median(walls) * 1e6:.0f}, "
          f"max {max(walls) * 1e6:.0f} µs (max/min {max(walls) / min(walls):.2f}); overlapped, the collective still adds "
          f"{min(added) * 1e6:.0f}-{max(added) * 1e6:.0f} µs to a round whose adds alone take "
          f"{min(r['adds'][0] for r in rows) * 1e6:.0f}-{max(r['adds'][0] for r in rows) * 1e6:.0f} µs")
    print(f"hidden behind {args.compute_ms:g} ms of matmuls (3 measurements each): step time added per collective, "
          f"and gloo's threads' CPU per collective (ms)")
    for size, added, cpu in hidden:
        print(f"  {size / 2**10:6.0f} KiB: added {', '.join(f'{x * 1e3:.2f}' for x in added)}; gloo CPU "
              f"{', '.join(f'{x * 1e3:.2f}' for x in cpu)}")
    print(f"load average at end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")


if __name__ == "__main__":
    main()
