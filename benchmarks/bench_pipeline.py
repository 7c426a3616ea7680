"""Pipeline schedules on local gloo ranks: step time, measured vs simulated bubble, activation memory.

    python benchmarks/bench_pipeline.py [--pp 2] [--microbatches 8] [--steps 6] [--layers 8] [--d 128]

For each schedule: median step time, the bubble measured on the ranks (1 - compute time / (ranks x step
time)) next to the simulator's figure for the same action lists (F=1, B=2), and the activation bytes the
ranks measured holding at once (per rank: the sum over its stages of their peak). Also the single-process
step time on the same global batch. On a 2-core machine with pp=2 each rank has one core, so
measured bubbles include gloo and Python overhead that the simulator leaves out.

Then, with ``--calibrate``, the measured idle fraction against the simulator fed with measured times:

    python benchmarks/bench_pipeline.py --calibrate --pp 2 --microbatches 8 --steps 8 --schedules gpipe 1f1b

per schedule: the ranks' mean F and B time per stage (steps after the first; zb1p's I and W are timed
as B's two halves), the isend posting time after each F (B) (added to that F (B): the simulator's sends
take no time), the STEP time, the REDUCE_GRAD time before it (the gradient collectives: the tied
embedding), and the boundary message latency (half a gloo round trip of the activation tensor, measured
on the same ranks) go into ``simulate(schedule, F={s: ...}, B={s: ...}, comm=..., reduce=..., step=...)``;
it prints the measured idle fraction (1 - compute time / (ranks x step time), mean over
steps after the first), the simulated one for those durations, and their ratio (target: within 15%); then
the simulated idle fraction with receives costing nothing (``no recv``) and with the unit durations F=1, B=2.
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
from fxpar.schedule import ActionKind, simulate  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--schedules", nargs="*", default=["gpipe", "1f1b", "interleaved", "zb1p", "chimera"])
    ap.add_argument("--calibrate", action="store_true", help="measured idle fraction vs simulate() on measured times")
    args = ap.parse_args()
    if args.calibrate:
        return calibrate(args)
    model, batches, opt = _setup(args)
    ref = copy.deepcopy(model)
    o = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    times = []
    for x, y in batches:
        t0 = time.perf_counter()
        o.zero_grad()
        gpt_loss(ref(x), y).backward()
        o.step()
        times.append(time.perf_counter() - t0)
    print(f"single process: {statistics.median(times[1:]) * 1e3:.1f} ms/step "
          f"(GPT d={args.d} layers={args.layers}, batch {args.batch}x{args.seq})")
    print(f"{'schedule':<12} {'ms/step':>8} {'bubble meas':>11} {'bubble sim':>10} {'act KiB/rank meas':>17}")
    with fxpar.LocalCluster(args.pp) as lc:
        for name in args.schedules:
            strategy = fxpar.Strategy(pp=args.pp, schedule=name, microbatches=args.microbatches)
            try:
                prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(args.pp), batches[0], gpt_loss, opt,
                                         strategy=strategy)
            except fxpar.FxparError as e:
                print(f"{name:<12} skipped: {str(e).splitlines()[0][:80]}")
                continue
            res = prog.run_local(batches, cluster=lc)
            sim = simulate(prog.pipe_schedule)
            act = max(sum(res.peak_activation_bytes.get(s, 0) for s in prog.plan.rank_stages(r))
                      for r in range(args.pp))
            print(f"{name:<12} {statistics.median(res.step_times[1:]) * 1e3:8.1f} "
                  f"{statistics.median(res.bubble[1:]):11.3f} {sim.bubble_fraction:10.3f} {act / 1024:17.0f}")


def _pingpong(rank: int, shape, dtype, n: int) -> float:
    """Half the mean round trip of one ``shape`` tensor between ranks 0 and 1 (seconds)."""
    import torch.distributed as dist
    t = torch.zeros(shape, dtype=dtype)
    peer = 1 - rank
    if rank > 1:
        return 0.0
    for k in range(n + 5):
        if k == 5:
            t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)
    return (time.perf_counter() - t0) / n / 2


def _per_stage(res, prog, kind: str, first: int = 1) -> dict:
    """Mean seconds of ``kind`` actions per stage over steps ``first``.. on the ranks holding the stage."""
    out = {}
    for s in range(prog.pipe_schedule.n_stages):
        tot = cnt = 0
        for r, steps in res.action_times.items():
            for w in steps[first:]:
                t, c = w.get((kind, s), (0.0, 0))
                tot, cnt = tot + t, cnt + c
        out[s] = tot / cnt if cnt else 0.0
    return out


def _messages(res, prog, first: int = 1) -> list:
    """(sending stage, receiving stage, send posted, receive started, receive ended) for every message of
    steps ``first``.. . The ranks share one host clock (perf_counter is CLOCK_MONOTONIC on Linux)."""
    out = []
    for k in range(first, min(len(t) for t in res.timelines.values())):
        posted = {(kind, st, i): t0 for tl in res.timelines.values() for kind, st, i, t0, _ in tl[k]
                  if kind in ("SF", "SB")}
        for tl in res.timelines.values():
            for kind, st, i, u0, u1 in tl[k]:
                if kind in ("RF", "RB"):
                    src = st - 1 if kind == "RF" else st + 1
                    out.append((src, st, posted[("S" + kind[1], src, i)], u0, u1))
    return out


def _comm_model(res, prog) -> tuple:
    """``(latency per sending stage, receive overhead per receiving stage)``: a receive posted after its data
    was sent still takes time (gloo copies it in) -- the overhead, folded into the compute after it; a receive
    that waited ends ``latency + overhead`` after the send was posted."""
    msgs = _messages(res, prog)
    n = prog.pipe_schedule.n_stages
    over = {s: statistics.mean([u1 - u0 for _, d, t0, u0, u1 in msgs if d == s and u0 > t0] or [0.0])
            for s in range(n)}
    lat = {s: max(0.0, statistics.median([u1 - t0 - over[d] for src, d, t0, u0, u1 in msgs if src == s and u0 <= t0]
                                         or [0.0])) for s in range(n)}
    return lat, over


def _setup(args):
    """The model, batches and optimizer both modes of this benchmark use."""
    torch.manual_seed(0)
    vocab = 512
    model = GPT(vocab=vocab, d=args.d, layers=args.layers, heads=4, max_seq=args.seq)
    tokens = torch.randint(0, vocab, (args.steps, args.batch, args.seq + 1))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    return model, batches, (torch.optim.AdamW, {"lr": 1e-3})


def calibrate(args):
    model, batches, opt = _setup(args)
    print(f"GPT d={args.d} layers={args.layers}, batch {args.batch}x{args.seq}, pp={args.pp}, "
          f"m={args.microbatches}, {args.steps} steps (the first left out)")
    print(f"{'schedule':<9} {'F ms/stage':>16} {'B ms/stage':>16} {'latency ms':>10} {'recv ms':>10} {'pp ms':>7} {'RG+step ms':>12} "
          f"{'idle meas':>9} {'idle sim':>8} {'ratio':>6} {'no recv':>9} {'F=1,B=2':>8}")
    with fxpar.LocalCluster(args.pp) as lc:
        for name in args.schedules:
            strategy = fxpar.Strategy(pp=args.pp, schedule=name, microbatches=args.microbatches)
            prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(args.pp), batches[0], gpt_loss, opt,
                                     strategy=strategy)
            res = prog.run_local(batches, cluster=lc)
            _, shape, dtype = prog.stages[0].messages["acts_out"][0]
            idle_comm = lc.run(_pingpong, [(r, shape, dtype, 50) for r in range(args.pp)])[0]
            comm, over = _comm_model(res, prog)
            F, B = _per_stage(res, prog, "F"), _per_stage(res, prog, "B")
            I, W = _per_stage(res, prog, "I"), _per_stage(res, prog, "W")   # noqa: E741 - zb1p: B = I + W
            B = {s: B[s] or I[s] + W[s] for s in B}
            step = _per_stage(res, prog, "STEP")
            reduce = _per_stage(res, prog, "RG")       # the gradient collectives REDUCE_GRAD starts (tied wte)
            # posting an isend costs the sending rank time right after the F (B) that made the tensor; the
            # simulator's sends take none, so it rides on that compute -- and is left out of busy below
            SF, SB = _per_stage(res, prog, "SF"), _per_stage(res, prog, "SB")
            sched = prog.pipe_schedule
            recv_f = {s: over[s] if s > 0 else 0.0 for s in F}                  # an RF comes before each F of s > 0
            recv_b = {s: over[s] if s < sched.n_stages - 1 else 0.0 for s in B}  # an RB before each B of s < last
            split = any(I.values())      # zb1p: the measured I (with its receive and send) and W, not B/2 each
            iw = dict(I={s: recv_b[s] + I[s] + SB[s] for s in I}, W=W) if split else {}
            sim = simulate(sched, F={s: recv_f[s] + F[s] + SF[s] for s in F}, B={s: recv_b[s] + B[s] + SB[s] for s in B},
                           comm=comm, reduce=reduce, step=step, **iw)
            busy = sum(len(sched.where(ActionKind.F, s)) * F[s] + len(sched.where(ActionKind.B, s)) * B[s]
                       + len(sched.where(ActionKind.I, s)) * I[s] + len(sched.where(ActionKind.W, s)) * W[s] for s in F)
            idle_sim = 1 - busy / (sched.n_ranks * sim.makespan)
            bare = simulate(sched, F={s: F[s] + SF[s] for s in F}, B={s: B[s] + SB[s] for s in B}, comm=comm,
                            reduce=reduce, step=step, **(dict(I={s: I[s] + SB[s] for s in I}, W=W) if split else {}))
            idle_bare = 1 - busy / (sched.n_ranks * bare.makespan)      # the same, receives costing nothing
            meas = statistics.mean(res.bubble[1:])
            fmt = lambda d: "/".join(f"{v * 1e3:.2f}" for _, v in sorted(d.items()))  # noqa: E731
            both = {s: reduce[s] + step[s] for s in step}
            print(f"{name:<9} {fmt(F):>16} {fmt(B):>16} {fmt(comm):>10} {fmt(over):>10} {idle_comm * 1e3:7.2f} {fmt(both):>12} {meas:9.3f} "
                  f"{idle_sim:8.3f} {meas / idle_sim:6.2f} "
                  f"{idle_bare:9.3f} {simulate(prog.pipe_schedule).bubble_fraction:8.3f}")


if __name__ == "__main__":
    main()
