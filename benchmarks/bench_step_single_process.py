"""One rank, no communication: fxpar's step graph vs eager PyTorch (forward, backward, AdamW.step)
on the same model and batch, one thread. Isolates the cost of running the captured graph.

    python benchmarks/bench_step_single_process.py [--profile]
"""
import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.runtime.executor import Executor  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of both")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(vocab=2048, d=256, layers=4, heads=4, max_seq=64)
    x, y = torch.randint(0, 2048, (8, 64)), torch.randint(0, 2048, (8, 64))
    program = fxpar.parallelize(model, 1, (x, y), loss_fn=gpt_loss, optimizer=(torch.optim.AdamW, {"lr": 1e-3}))
    ex = Executor(program.payload(0))      # the one executor; a one-stage program runs its fused FULL graph
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def eager():
        opt.zero_grad()
        loss = gpt_loss(ref(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    def timed(fn):
        ts = []
        for _ in range(args.steps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts[3:])

    a, b = timed(lambda: ex.step((x, y))), timed(eager)
    print(f"fxpar step graph {a * 1000:.1f} ms, eager PyTorch {b * 1000:.1f} ms, ratio {a / b:.3f}")
    if args.profile:
        from torch.profiler import profile
        for name, fn in (("fxpar", lambda: ex.step((x, y))), ("eager", eager)):
            with profile() as prof:
                for _ in range(3):
                    fn()
            print(name)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
