"""What the per-tensor CRC-32 costs a checkpoint: save and load of a ~100 MB checkpoint (one process, a GPT-like set
of float32 tensors) with the checksums fxpar records and checks, and with them replaced by a constant, alternating
round by round; and the checksums alone.

    python benchmarks/bench_checkpoint_checksum.py [--mb 100] [--rounds 5]
"""
import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fxpar.runtime import checkpoint as ck  # noqa: E402


def _state(mb: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = mb * 2**20 // 4 // 64                     # 64 tensors of float32
    return {f"blocks.{i}.weight": torch.randn(n, generator=g) for i in range(64)}


def _round(state: dict, root: Path, checked: bool) -> tuple:
    real = ck.checksum
    if not checked:
        ck.checksum = lambda v: 0
    try:
        path = root / ("on" if checked else "off")
        t0 = time.perf_counter()
        ck.save_checkpoint(path, state, {"step": 1}, rank=0, world_size=1)
        t1 = time.perf_counter()
        ck.load_checkpoint(path, {k: torch.empty_like(v) for k, v in state.items()}, rank=0, world_size=1)
        t2 = time.perf_counter()
    finally:
        ck.checksum = real
    shutil.rmtree(path)
    return t1 - t0, t2 - t1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    state = _state(args.mb)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    times = {True: [], False: []}
    with tempfile.TemporaryDirectory() as d:
        _round(state, Path(d), True)                # warm-up: DCP's import, the page cache
        for _ in range(args.rounds):
            for checked in (False, True):
                times[checked].append(_round(state, Path(d), checked))
    t0 = time.perf_counter()
    for v in state.values():
        ck.checksum(v)
    alone = time.perf_counter() - t0
    med = {c: [statistics.median(x[i] for x in times[c]) for i in (0, 1)] for c in times}
    print(f"checkpoint of {nbytes / 1e6:.1f} MB, {len(state)} tensors, median of {args.rounds} rounds")
    print(f"{'':14}{'save':>10}{'load':>10}")
    print(f"{'no checksums':14}{med[False][0]:>9.3f}s{med[False][1]:>9.3f}s")
    print(f"{'CRC-32':14}{med[True][0]:>9.3f}s{med[True][1]:>9.3f}s")
    print(f"checksums alone: {alone:.3f} s ({nbytes / alone / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
