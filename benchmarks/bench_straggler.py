"""One straggler among 4 ranks: SSP, DSSP, DABMD and Local SGD against synchronous data parallelism, time to the same
loss.

Rank 3 of ``ClusterSpec.local(4, slowdown={3: 2.0})`` computes twice as long (it sleeps as long again as each of its
compute actions took). Every method trains the same MLP (float64, SGD-momentum) on the same batches of a fixed
regression task; SSP and DSSP add one CPU parameter server (``cpu_servers=1``, a fifth process):

- ``sync dp``: ``Strategy(dp=4)``, every step waits for the straggler;
- ``SSP(s)``: ``Strategy(dp=4, sync=S.SSP(staleness=s))``;
- ``DSSP(low, high)``: ``S.DSSP(low, high)``;
- ``LocalSGD(H)``: ``S.LocalSGD(period=H)``;
- ``DABMD(full)``, ``DABMD(ring)``: ``S.DABMD(round_time_s=t, mixing=...)`` with ``microbatches=4`` (each rank takes
  its shard's microbatches while the round's ``t`` seconds last). ``t`` is ``--round-time``, or (0, the default)
  ``--budget-factor`` (1.25) times a fast rank's median compute seconds per step (its F, B and FULL actions) in a
  run of synchronous dp without the straggler, measured first: the fast ranks fit their whole shard, the straggler
  about ``budget-factor / factor`` of it.

Measured per method: the wall time from the first rank's start to the step after which the training loss (the
workers' shard losses averaged, smoothed over ``--window`` steps) first reaches the target -- the highest smoothed
loss any method ends at, so every method reaches it -- read from the ranks' action timelines; its ratio to
synchronous dp's; the final smoothed loss.

Also, per method, ``estimate()``'s step time against the measured seconds per step (when the last rank finished
each step, from the third step's end to the last's, over the steps between: averaging steps and the others alike,
as ``estimate()`` spreads an averaging over its window), with the straggler, and for synchronous dp (every method
with ``--without``) without it, and the straggler's factor (with over without) measured and estimated, which
the machine's load level cancels out of to first order. The programs are planned on this machine's figures, ``ClusterSpec.calibrate(4)``
measured first (``--no-calibrate``: ``ClusterSpec.local(4)``'s defaults), so that the estimate prices each rank's
share of the cores (``DeviceSpec.core_share``) as the ranks run.

    python benchmarks/bench_straggler.py [--steps 60] [--window 5] [--hidden 256] [--batch 256] [--factor 2.0]
                                         [--round-time 0] [--budget-factor 1.25] [--methods "sync dp,DABMD(ring)"]
                                         [--without] [--no-calibrate]
"""
import argparse
import dataclasses
import re
import statistics

import torch
import torch.nn.functional as F

import fxpar
from fxpar import sync as S
from fxpar.testing import MLP

OPT = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})


def _batches(n: int, batch: int) -> list:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 8, dtype=torch.float64, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(batch, 16, dtype=torch.float64, generator=g)
        out.append((x, torch.tanh(x @ w) + 0.1 * torch.randn(batch, 8, dtype=torch.float64, generator=g)))
    return out


def _smooth(losses: list, k: int) -> list:
    return [statistics.fmean(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]


def _ends(res) -> tuple:
    """Per step, when the last rank finished it (seconds from the first rank's first action)."""
    t0 = min(tl[0][0][3] for tl in res.timelines.values())
    n = len(res.losses)
    return [max(res.timelines[r][i][-1][4] for r in res.timelines) - t0 for i in range(n)]


def _per_step(res) -> float:
    """Measured seconds per step: when the last rank finished each step, from the third step's end to the last's."""
    ends = _ends(res)
    return (ends[-1] - ends[2]) / (len(ends) - 3) if len(ends) > 3 else statistics.median(res.step_times)


def _compute_s(res, rank: int = 0) -> float:
    """A rank's median compute seconds per step (its F, B, I, W and FULL actions), from the third step on."""
    per = [sum(e - t for kind, _, _, t, e in tl if kind in ("F", "B", "I", "W", "FULL")) for tl in res.timelines[rank]]
    return statistics.median(per[2:] or per)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--round-time", type=float, default=0.0)
    ap.add_argument("--budget-factor", type=float, default=1.25)
    ap.add_argument("--methods", default="", help="comma-separated method names to run (default: all)")
    ap.add_argument("--without", action="store_true", help="also run every method without the straggler")
    ap.add_argument("--no-calibrate", action="store_true", help="plan on ClusterSpec.local(4)'s default figures")
    a = ap.parse_args()
    batches = _batches(a.steps, a.batch)
    machine = fxpar.ClusterSpec.local(4) if a.no_calibrate else fxpar.ClusterSpec.calibrate(4)
    print(f"cluster: {machine}; core share per rank {machine.device.core_share:.2f}")

    def program(method, servers: int, slowdown: dict):
        torch.manual_seed(0)
        cluster = dataclasses.replace(machine, cpu_servers=servers, slowdown=slowdown)
        micro = 4 if isinstance(method, S.DABMD) else 1
        return fxpar.parallelize(MLP(hidden=a.hidden, layers=a.layers).double(), cluster, batches[0],
                                 loss_fn=F.mse_loss, optimizer=OPT,
                                 strategy=fxpar.Strategy(dp=4, microbatches=micro, sync=method))

    fast = program(None, 0, {})
    base = fast.run_local(batches)
    budget = a.round_time or a.budget_factor * _compute_s(base)
    print(f"DABMD round_time_s={budget * 1e3:.2f} ms")
    steps = [("sync dp", "without", _per_step(base), fast.estimate().step_time_s)]
    methods = [("sync dp", None, 0), ("SSP(2)", S.SSP(staleness=2), 1), ("SSP(4)", S.SSP(staleness=4), 1),
               ("DSSP(1, 4)", S.DSSP(low=1, high=4), 1), ("LocalSGD(4)", S.LocalSGD(period=4), 0),
               ("DABMD(full)", S.DABMD(round_time_s=budget), 0),
               ("DABMD(ring)", S.DABMD(round_time_s=budget, mixing="ring"), 0)]
    if a.methods:
        methods = [m for m in methods if m[0] in re.split(r",\s*(?![^()]*\))", a.methods)]   # commas outside (...)
    runs = []
    for name, method, servers in methods:
        prog = program(method, servers, {3: a.factor})
        res = prog.run_local(batches)
        runs.append((name, _smooth(res.losses, a.window), _ends(res)))
        steps.append((name, "with", _per_step(res), prog.estimate().step_time_s))
        if isinstance(method, S.DABMD):
            sizes = {r: statistics.fmean(res.features[r]["sync"]["batch_sizes"]) for r in range(4)}
            print(f"{name}: mean samples per round by rank {sizes}")
            print(f"{name}: estimate() {prog.estimate().notes[-1]}")
        if a.without and method is not None:
            alone = program(method, servers, {})
            steps.append((name, "without", _per_step(alone.run_local(batches)), alone.estimate().step_time_s))
    alone = {name: (measured, est) for name, how, measured, est in steps if how == "without"}
    print(f"{'method':<14} {'straggler':>9} {'measured':>9} {'estimate()':>10} {'est/meas':>8} "
          f"{'with/without: measured':>22} {'estimate()':>10}")
    for name, how, measured, est in sorted(steps, key=lambda x: x[1] == "with"):
        ratio = (f"{measured / alone[name][0]:>22.2f} {est / alone[name][1]:>10.2f}"
                 if how == "with" and name in alone else "")
        print(f"{name:<14} {how:>9} {measured * 1e3:>6.1f} ms {est * 1e3:>7.1f} ms {est / measured:>8.2f} {ratio}")
    target = max(smooth[-1] for _, smooth, _ in runs)
    print(f"target: smoothed loss {target:.4f} (the highest any method ends at, after {a.steps} steps)")
    print(f"{'method':<14} {'time to target':>15} {'x sync dp':>10} {'step':>6} {'final loss':>11} {'all steps':>10}")
    sync_t = None
    for name, smooth, ends in runs:
        hit = next(i for i, v in enumerate(smooth) if v <= target)
        sync_t = sync_t or ends[hit]
        print(f"{name:<14} {ends[hit]:>13.2f} s {ends[hit] / sync_t:>10.2f} {hit:>6} {smooth[-1]:>11.4f} "
              f"{ends[-1]:>8.2f} s")


if __name__ == "__main__":
    main()
