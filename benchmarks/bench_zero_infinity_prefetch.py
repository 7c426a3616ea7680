"""ZeRO-Infinity's per-layer read-ahead (``fxpar::prefetch``, passes/zero_offload.py) against first-touch paging.

L layers, each a memory-mapped file of S MB (as ``fxpar.runtime.shards`` keeps offloaded chunks); each layer
"computes" by reading its whole file (a sum) and then a fixed matmul, as a layer computes with its gathered
weight. Before each timed pass the files' pages are written back and evicted from the page cache, file by file
(``posix_fadvise(POSIX_FADV_DONTNEED)`` on these files only: nothing system-wide, /proc/sys/vm untouched), so
the reads come from the disk. Two orders, alternated, several repeats:

* ``first touch``: layer i's pages come in as the sum touches them (synchronous page faults);
* ``prefetch``: ``fxpar.prefetch(layer i+1)`` is called before layer i computes (one ahead, as the pass places
  it), so the kernel's read-ahead of i+1 overlaps i's compute.

Run: ``python benchmarks/bench_zero_infinity_prefetch.py [--layers 8 --mb 64 --work 400]``. It first checks
that eviction works here (a cold read slower than a warm one); if not, it says that no honest measurement is
possible on this machine and stops.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from fxpar import prefetch as P


def _files(root, layers, mb):
    n = mb * 2 ** 20 // 8
    out = []
    for i in range(layers):
        path = os.path.join(root, f"layer{i}.bin")
        f = torch.from_file(path, shared=True, size=n, dtype=torch.float64)
        f.copy_(torch.rand(n, dtype=torch.float64))
        out.append((path, f))
    return out


def _evict(files):
    for path, _ in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _pass(files, a, ahead):
    t = time.perf_counter()
    for i, (_, f) in enumerate(files):
        if ahead and i + 1 < len(files):
            P.prefetch(files[i + 1][1])
        float(f.sum())                         # the layer reads its weights
        a @ a                                  # and computes
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--work", type=int, default=400, help="matmul size per layer (compute to overlap with)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()}; {args.layers} layers x {args.mb} MB; posix_fadvise: {P.ADVICE is not None}")
    a = torch.rand(args.work, args.work, dtype=torch.float64)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        files = _files(root, args.layers, args.mb)
        P.reset()
        for path, f in files:
            P.track(f, path)
        _evict(files)
        t0 = time.perf_counter(); float(files[0][1].sum()); cold = time.perf_counter() - t0
        t0 = time.perf_counter(); float(files[0][1].sum()); warm = time.perf_counter() - t0
        t0 = time.perf_counter(); a @ a; work = time.perf_counter() - t0
        print(f"one layer: cold read {cold * 1e3:.1f} ms, warm read {warm * 1e3:.1f} ms, compute {work * 1e3:.1f} ms")
        if cold < 1.5 * warm:
            print("eviction does not make reads slower here (the 'disk' is cached below this machine): "
                  "no honest measurement of the read-ahead is possible")
            P.reset()
            return
        times = {"first touch": [], "prefetch": []}
        for _ in range(args.repeats):
            for name, ahead in (("first touch", False), ("prefetch", True)):
                _evict(files)
                times[name].append(_pass(files, a, ahead))
        P.reset()
    for name, ts in times.items():
        print(f"{name:12s} median {statistics.median(ts) * 1e3:8.1f} ms  "
              f"(min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})")
    ratio = statistics.median(times["first touch"]) / statistics.median(times["prefetch"])
    print(f"speed-up of the step's read+compute: {ratio:.2f}x")


if __name__ == "__main__":
    main()
