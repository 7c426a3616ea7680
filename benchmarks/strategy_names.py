"""Count the lines of the library that name a strategy outside the strategy's own modules.

A strategy's own modules are its feature module (``fxpar/features/<name>.py``), its passes and its cost-model
module; everywhere else (the planner, lowering, the executor, the Plan, explain ...) the core should loop over
features and name none. Prints one table per strategy: file, lines naming it. ``--rev`` counts a git revision
instead of the working tree (e.g. ``--rev HEAD~10``).

    python3 benchmarks/strategy_names.py
    python3 benchmarks/strategy_names.py --rev db95cd7 --summary
"""
from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fxpar", "passes", "cost_models")

# strategy -> (what names it, its own modules: path prefixes)
STRATEGIES = {
    "data_parallel": (r"bucket_cap|first_bucket|broadcast_buffers|BucketGradients|DataParallelGradSync|SyncBuffers|"
                      r"\.buckets\b", ("fxpar/features/data_parallel.py", "passes/data_parallel.py", "passes/bucket.py",
                                         "fxpar/planner_comm.py")),
    "inplace_update": (r"reinplace|ReinplaceOptimizer", ("fxpar/features/inplace_update.py", "passes/reinplace.py",
                                                          "passes/fuse_optimizer.py")),
    "herring": (r"herring|hierarchical_?reduce", ("fxpar/features/herring.py", "passes/herring.py")),
    "byteps": (r"byteps|server_?sum|cpu_servers", ("fxpar/features/byteps.py", "passes/byteps.py",
                                                  "cost_models/byteps", "fxpar/runtime/server.py")),
    "parallax": (r"parallax|sparse_?grad_?sync|sparse_routes|sparse_update", ("fxpar/features/parallax.py",
                                                                              "passes/parallax.py")),
    "zero": (r"\bzero\s*[=:]|plan\.zero|\.zero\b|zero_keys|ZeroShard|ZeroOffload|zero_offload|fxpar_zero|offload_dir|"
             r"offload_to|param_shard|\bZeRO\b", ("fxpar/features/zero", "passes/zero", "fxpar/zero",
                                                  "fxpar/prefetch.py")),
    "tensor_parallel": (r"shardings|tensor_parallel|TensorParallel|tp_split|_tp_|\btofu\b|megatron",
                        ("fxpar/features/tensor_parallel.py", "passes/tensor_parallel.py", "passes/tofu",
                         "passes/sharding/", "passes/lower_sharding.py", "passes/propagate_sharding.py")),
    "recompute": (r"recompute", ("fxpar/features/recompute.py", "passes/recompute.py")),
    "offload_activations": (r"offload_activations|OffloadActivations|\"activations\"",
                            ("fxpar/features/offload_activations.py", "passes/offload.py")),
    "bytescheduler": (r"bytescheduler|comm_schedule|CommSchedule|cross_iteration|grad_order|GradOrder|"
                      r"delayed_update|F_UPDATE|\"DRAIN\"|carry_step|CarryState",
                      ("fxpar/features/bytescheduler.py", "fxpar/features/delayed_update.py", "passes/comm_schedule.py",
                       "passes/grad_order.py", "passes/carry_step.py", "passes/delayed_update.py",
                       "cost_models/comm_tuning.py", "fxpar/backward_order.py")),
    "compile": (r"\bcompile\s*=\s*(True|False)|import compile\b|features\.compile|functional_collectives|"
                r"FunctionalCollectives|CompileState|CompiledGraph", ("fxpar/features/compile.py",
                                                                     "passes/functional_collectives.py")),
    "pipeline": (r"pipedream|\b2bw\b|chimera|zb1p|gpipe|1f1b|interleaved|\bASYNC\b",
                 ("fxpar/features/pipeline", "fxpar/schedule/")),
}


def _files(rev: str | None) -> dict:
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, *PACKAGES], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout for n in names if n.endswith(".py")}


def count(rev: str | None = None) -> dict:
    """strategy -> {file: lines naming it} outside its own modules."""
    files = _files(rev)
    out = {}
    for name, (pattern, own) in STRATEGIES.items():
        rx = re.compile(pattern, re.IGNORECASE)
        per = {}
        for path, text in files.items():
            if path.startswith(own):
                continue
            n = sum(1 for line in text.splitlines() if rx.search(line))
            if n:
                per[path] = n
        out[name] = per
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default=None, help="a git revision (default: the working tree)")
    ap.add_argument("--summary", action="store_true", help="one line per strategy: lines and files")
    args = ap.parse_args()
    for name, per in count(args.rev).items():
        total = sum(per.values())
        print(f"{name}: {total} line(s) in {len(per)} file(s) outside its own modules")
        if not args.summary:
            for path, n in sorted(per.items(), key=lambda kv: -kv[1]):
                print(f"  {n:4d}  {path}")


if __name__ == "__main__":
    main()
