"""Wall time of fxpar.parallelize() (capture + plan + lower) for a 12-layer GPT of hidden 768
(GPT-2 small: vocab 50257, 124M parameters), dp=2. Goal: under 3 s on a 2-core machine.

    python benchmarks/bench_parallelize.py [--layers 12] [--d 768] [--repeat 3]
    python benchmarks/bench_parallelize.py --tiny dp2|pp2_1f1b|dp2_z3 [--repeat 8]
    python benchmarks/bench_parallelize.py --compile [--cache-dir DIR]

``--compile``: the time ``Strategy(dp=2, compile=True)`` spends compiling GPT-2 small, twice, each in a fresh process
of its own on one inductor cache directory (a new, empty one unless ``--cache-dir``): the first compiles (cold cache),
the second finds every graph in inductor's FX graph cache. Each process runs ``parallelize`` and then
``program.compiled_code(0)``, which compiles every graph rank 0 runs as the rank does at its first call (from the
graphs' shapes, for the CPU threads ``run_local`` gives a rank); printed: wall and CPU seconds of each part (CPU: the
process's and its children's that ended and were reaped: inductor's compile workers, as far as their pool reaped
them), and the load average.

``--tiny``: ``fxpar.testing.tiny_gpt`` (2 layers, width 16, float64, the model most tests train) on an 8 x 16 batch
with the strategy named, AdamW: the per-call cost a numerics test pays in its own process.

The first call in a process also pays make_fx's one-time warm-up; both are reported, each with the process's CPU time
(on a shared machine, compare CPU times: wall time follows the load, printed first). Last, what capture's check
of the model's Python state costs (two snapshots of every module's plain attributes, compared; median of 20).
"""
import argparse
import os
import resource
import subprocess
import tempfile
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.capture import _attributes_changed, _module_attributes  # noqa: E402
from fxpar.testing import GPT, gpt_loss, tiny_gpt  # noqa: E402

TINY = {"dp2": dict(dp=2), "pp2_1f1b": dict(pp=2, microbatches=2, schedule="1f1b"), "dp2_z3": dict(dp=2, zero=3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tiny", choices=sorted(TINY))
    ap.add_argument("--compile", action="store_true", help="compile time of GPT-2 small, cold and cached")
    ap.add_argument("--cache-dir", default=None, help="--compile: inductor's cache directory (default: a new one)")
    ap.add_argument("--compile-once", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny:
        return tiny(args.tiny, args.repeat)
    if args.compile:
        return compile_twice(args)
    if args.compile_once:
        return compile_once(args)
    model = GPT(vocab=50257, d=args.d, layers=args.layers, heads=args.d // 64, max_seq=args.seq)
    x = torch.randint(0, 50257, (4, args.seq))
    print(f"GPT {args.layers}x{args.d}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"load average {os.getloadavg()[0]:.1f}")
    for i in range(args.repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        p = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), (x, x), loss_fn=gpt_loss,
                              optimizer=(torch.optim.AdamW, {"lr": 3e-4}), strategy=fxpar.Strategy(dp=2))
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        nodes = len(p.graphs(0)["step"].graph.nodes)
        print(f"{'first' if i == 0 else 'again'}: parallelize {dt:.2f}s, CPU {cpu:.2f}s (capture {p.timings['capture']:.2f}s, "
              f"plan+lower {p.timings['lower']:.2f}s), {nodes} nodes, {len(p.plan.section('data_parallel').buckets[0])} buckets")
    took = []
    for _ in range(20):
        t0 = time.perf_counter()
        _attributes_changed(_module_attributes(model), _module_attributes(model))
        took.append(time.perf_counter() - t0)
    print(f"Python-state check at capture: {statistics.median(took) * 1e3:.1f} ms "
          f"({sum(1 for _ in model.modules())} modules)")


def _cpu() -> float:
    """CPU seconds of this process and of its children that ended (inductor's compile workers)."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def compile_once(args) -> None:
    """In this process: parallelize GPT-2 small with compile=True, then compile rank 0's graphs."""
    model = GPT(vocab=50257, d=args.d, layers=args.layers, heads=args.d // 64, max_seq=args.seq)
    x = torch.randint(0, 50257, (4, args.seq))
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), _cpu()
    p = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), (x, x), loss_fn=gpt_loss,
                          optimizer=(torch.optim.AdamW, {"lr": 3e-4}), strategy=fxpar.Strategy(dp=2, compile=True))
    t1, c1 = time.perf_counter(), _cpu()
    from torch._dynamo.utils import counters
    code = p.compiled_code(0)
    t2 = time.perf_counter()
    from torch._inductor.async_compile import shutdown_compile_workers
    shutdown_compile_workers()           # the workers' CPU counts once they have ended
    c2 = _cpu()
    eager = [k for k, v in code.items() if v.startswith("# runs eager")]
    print(f"  parallelize {t1 - t0:.1f} s wall, {c1 - c0:.1f} s CPU; compiling rank 0's graphs "
          f"({', '.join(code)}; eager: {', '.join(eager) or 'none'}) {t2 - t1:.1f} s wall, {c2 - c1:.1f} s CPU "
          f"(inductor FX graph cache: {counters['inductor']['fxgraph_cache_hit']} hit, "
          f"{counters['inductor']['fxgraph_cache_miss']} miss); load average {load:.1f} -> {os.getloadavg()[0]:.1f}")


def compile_twice(args) -> None:
    """Two fresh processes on one inductor cache directory: cold, then cached."""
    cache = args.cache_dir or tempfile.mkdtemp(prefix="fxpar_bench_parallelize_")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    print(f"GPT {args.layers}x{args.d}, seq {args.seq}, batch 4, AdamW, Strategy(dp=2, compile=True); inductor cache "
          f"{cache}; torch {torch.__version__}, {os.cpu_count()} cores")
    for what in ("first (cold cache)", "second (cached)"):
        print(what)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--compile-once", "--layers", str(args.layers), "--d", str(args.d),
                        "--seq", str(args.seq)], env=env, check=True)
        print(f"  process total {time.perf_counter() - t0:.1f} s wall (imports included)")


def tiny(name: str, repeat: int) -> None:
    model, x = tiny_gpt(), torch.randint(0, 32, (8, 16))
    st = fxpar.Strategy(**TINY[name])
    print(f"tiny_gpt, {st}, load average {os.getloadavg()[0]:.1f}")
    cpu = []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fxpar.parallelize(model, fxpar.ClusterSpec.local(st.size), (x, x), loss_fn=gpt_loss,
                          optimizer=(torch.optim.AdamW, {"lr": 1e-3}), strategy=st)
        cpu.append(time.process_time() - c0)
        print(f"parallelize {time.perf_counter() - t0:.3f}s, CPU {cpu[-1]:.3f}s")
    warm = sorted(cpu[1:])
    if warm:
        print(f"warm CPU: median {statistics.median(warm):.3f}s, {warm[0]:.3f}-{warm[-1]:.3f}s; "
              f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
