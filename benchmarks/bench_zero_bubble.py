"""Zero bubble (ZB-H1, ``schedule="zb1p"``) vs 1F1B, fxpar and torch.distributed.pipelining side by side
in one run: step time, measured idle fraction, and the cost model's predicted idle fraction.

    python benchmarks/bench_zero_bubble.py [--pp 2] [--microbatches 4 8] [--steps 8] [--rounds 3] [--compile]

Same model (a GPT with an untied LM head, 8 layers, d=128), same weights, batches, ranks and AdamW on
every side. fxpar runs ``1f1b`` and ``zb1p`` (one stage per rank, backward split into I and W);
torch runs ``Schedule1F1B`` (one stage per rank) and, where it applies, ``ScheduleInterleavedZeroBubble``
and ``ScheduleZBVZeroBubble`` (torch's zero-bubble schedules need two stages per rank: the model is
cut into 2·pp stages for them). Sides alternate ``--rounds`` times on one LocalCluster. Printed per
microbatch count: the median step time (slowest rank, warm-up dropped) of each side and its ratio to
torch's 1F1B (the goal for zb1p: <= 0.90), fxpar's measured idle fraction (1 - compute time / (ranks x
step time), compute = F/B/I/W) and the cost model's, on a ClusterSpec calibrated on this machine first
unless ``--no-calibrate``: ``idle est`` counts as compute the F/B/I/W graphs only, as the executor does
(``Estimate.idle_fraction_where``), ``est all`` every graph, the optimizer STEP included
(``Estimate.idle_fraction``), ``no late`` as ``idle est`` without the calibrated ``late_recv_s`` (a receive
posted after its send while the sender computes; printed with the cluster). ``--compile``: fxpar's ``1f1b`` and
``zb1p`` also with ``compile=True`` (every F, B, I, W, REDUCE_GRAD and STEP graph through inductor; each rank compiles
at its first step, a warm-up step, and loads from inductor's cache in later rounds), the same rows beside the eager
ones; torch's sides stay eager.
"""
import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cost_models  # noqa: E402
import fxpar  # noqa: E402
from fxpar.schedule import ActionKind, get_schedule, parse_action, simulate  # noqa: E402
from fxpar.testing import gpt_loss  # noqa: E402
from fxpar.testing.torch_pipelining import UntiedGPT, pipelining_worker  # noqa: E402


_WORK = {ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.FULL}


def is_work(label: str) -> bool:
    """A compute action (F/B/I/W/FULL), the executor's definition of busy time."""
    try:
        return parse_action(label, rank=0).kind in _WORK
    except Exception:  # noqa: BLE001 - a message or an unlabelled graph
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--torch", nargs="*", default=["1f1b", "interleaved_zb", "zbv"])
    ap.add_argument("--no-calibrate", action="store_true")
    ap.add_argument("--compile", action="store_true", help="also fxpar's schedules with compile=True")
    args = ap.parse_args()
    pp = args.pp
    torch.manual_seed(0)
    model = UntiedGPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=4, max_seq=args.seq)
    n = args.warmup + args.steps
    tokens = torch.randint(0, args.vocab, (n, args.batch, args.seq + 1))
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    opt = (torch.optim.AdamW, {"lr": 1e-3})
    cuts1 = [args.layers // pp * s for s in range(1, pp)]
    cuts2 = [args.layers // (2 * pp) * s for s in range(1, 2 * pp)]
    cluster = fxpar.ClusterSpec.local(pp) if args.no_calibrate else fxpar.ClusterSpec.calibrate(world_size=pp)
    print(f"UntiedGPT {args.layers} layers d={args.d}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"params; batch {args.batch}x{args.seq}; pp={pp}; {args.warmup}+{args.steps} steps x {args.rounds} rounds; "
          f"cluster {'calibrated' if not args.no_calibrate else 'default'}: {cluster}, "
          f"op overhead {cluster.device.op_overhead_s * 1e6:.2f} us, late recv {cluster.device.late_recv_s * 1e3:.2f} ms")
    with fxpar.LocalCluster(pp) as lc:
        for m in args.microbatches:
            progs = {f"{name}{' compiled' if c else ''}": fxpar.parallelize(
                model, cluster, batches[0], gpt_loss, opt, strategy=fxpar.Strategy(
                    pp=pp, schedule=name, microbatches=m, split_points=[f"blocks.{c}" for c in cuts1], compile=c))
                for c in ((False, True) if args.compile else (False,)) for name in ("1f1b", "zb1p")}
            times = {k: [] for k in [f"fxpar {n}" for n in progs] + [f"torch {t}" for t in args.torch]}
            idle = {k: [] for k in progs}
            losses = {}
            for _ in range(args.rounds):
                for name, prog in progs.items():
                    res = prog.run_local(batches, cluster=lc)
                    times[f"fxpar {name}"] += res.step_times[args.warmup:]
                    idle[name] += res.bubble[args.warmup:]
                    losses[f"fxpar {name}"] = res.losses
                for t in args.torch:
                    cuts = cuts1 if t in ("1f1b", "gpipe") else cuts2
                    out = lc.run(pipelining_worker, [(model, batches, cuts, opt, t, m, args.warmup)] * pp)
                    times[f"torch {t}"] += [max(o["step_times"][i] for o in out) for i in range(args.steps)]
                    losses[f"torch {t}"] = next(o["losses"] for o in out if o["losses"] is not None)
            base = statistics.median(times["torch 1f1b"]) if "torch 1f1b" in times else None
            print(f"\nm={m} (load average {os.getloadavg()[0]:.1f}): dry-run bubble (F=1, B=2 | F=I=W=1): 1f1b "
                  f"{simulate(get_schedule('1f1b', pp, m)).bubble_fraction:.3f}, zb1p "
                  f"{simulate(get_schedule('zb1p', pp, m), F=1, I=1, W=1).bubble_fraction:.3f}")
            print(f"{'side':<26} {'median ms':>9} {'min ms':>7} {'/ torch 1f1b':>12} {'idle meas':>9} {'idle est':>8} "
                  f"{'est all':>7} {'no late':>7} {'|dloss| vs torch 1f1b':>22}")
            ref = losses.get("torch 1f1b")
            for k, ts in times.items():
                med = statistics.median(ts)
                name = k.split(" ", 1)[1]
                meas = f"{statistics.mean(idle[name]):9.3f}" if k.startswith("fxpar") else f"{'':9}"
                e = progs[name].estimate() if k.startswith("fxpar") else None
                est = f"{e.idle_fraction_where(is_work):8.3f}" if e else f"{'':8}"
                est_all = f"{e.idle_fraction:7.3f}" if e else f"{'':7}"
                if e:
                    p = progs[name]
                    cl0 = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, late_recv_s=0.0))
                    e0 = cost_models.estimate({r: p._calls(r) for r in range(p.world_size)}, cl0)
                no_late = f"{e0.idle_fraction_where(is_work):7.3f}" if e else f"{'':7}"
                dl = max(abs(a - b) for a, b in zip(losses[k], ref)) if ref else float("nan")
                print(f"{k:<26} {med * 1e3:9.1f} {min(ts) * 1e3:7.1f} {med / base if base else float('nan'):12.3f} "
                      f"{meas} {est} {est_all} {no_late} {dl:22.2e}")


if __name__ == "__main__":
    main()
