"""fxpar ByteScheduler vs torch DDP vs fxpar FIFO buckets over a bandwidth-capped link.

Two gloo ranks in two network namespaces joined by a tbf-capped veth pair (benchmarks/netns_link.py; needs
root and ``ip netns``, otherwise it says what is missing and runs uncapped). The 4-layer GPT of
benchmarks/bench_capped_link.py, the same batches for everyone, AdamW, at each cap in one run, every cell
visited once per round (``--rounds``):

- fxpar ``Strategy(dp=2, comm_schedule="bytescheduler")``, partition and credit tuned by the cost model for
  *that* cap: the program is planned on ``ClusterSpec.calibrate()`` (this machine's compute) with the link set
  to the veth as ``netns_link.calibrate_link`` measures it at the cap's rate before the run (without the
  harness: the nominal rate), and with what a transfer at that cap takes from the compute it overlaps
  (``netns_link.at_cap``); each rank runs ``Executor(payload).step(batch)`` (cross-iteration overlap: each step's
  update is applied in the next);
- the same with each ``grad_order`` of ``--orders`` forced (default ``natural``: backward as traced), to show what
  reordering backward adds (the tuned program may run backward in the next forward's need order,
  ``passes/grad_order.py``);
- fxpar FIFO: ``Strategy(dp=2, bucket_cap_mb=25)`` (DDP-style buckets);
- torch DDP with 25 MB buckets (its default) and with each size of ``--sweep-mb``; the best of them;
- the same DDP cells with ``AdamW(fused=True)``: fxpar runs a traced Adam/AdamW update as ATen's fused kernel on
  CPU (``passes/fuse_optimizer.py``) where torch.optim's CPU default updates one tensor at a time, so these cells
  give DDP the same kernel (``DDPf``; ``BS/DDPf25``, ``BS/bestf``: fxpar against them);
- DDP's compute alone (``no_sync()``), for the share of the step spent waiting on communication.

Each round visits the cells of a cap in a rotated order (round r starts at the r-th), so that no method is always
the first to run after the cap changes or after another method's memory was freed.

Each cell is reported twice: its mean step (the timed steps' wall time, from the first rank to start them to the
last to end them, over their number; the median over rounds: ``bench_capped_link.window_mean``) -- the throughput,
and the fair figure for cross-iteration overlap, whose step begins by waiting for the previous step's pieces, so
that per-step times alternate between ranks and steps while the window does not -- and the median of the per-step
maxima over ranks. The ``compute`` cell (barriers between its steps) is the mean of its steps. Also the cost model's predicted ByteScheduler step (the Plan's ``bytescheduler`` section, ``stages[0]['predicted_step_s']``)
against the measured one. The link adds bandwidth limits only (no netem: no latency).

    python benchmarks/bench_bytescheduler.py [--rates none,2gbit,1gbit,500mbit] [--steps 5] [--warmup 2] [--rounds 3]
                                             [--orders natural,priority] [--batch 16] [--threads N] [--pin] [--comm-priority]
"""
import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import fxpar  # noqa: E402
from bench_capped_link import ddp_bench_worker, fxpar_worker, per_step_max, window_mean  # noqa: E402
from fxpar.cluster import LinkSpec  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402
from netns_link import CappedLink, NetnsCluster, at_cap, calibrate_link, format_rate, parse_rate  # noqa: E402


def build(model, batches, opt, cluster, strategy, n):
    prog = fxpar.parallelize(model, cluster, batches[0], loss_fn=gpt_loss, optimizer=opt, strategy=strategy)
    return prog, [prog.payload(r, n_batches=n) for r in range(cluster.world_size)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="none,2gbit,1gbit,500mbit")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--sweep-mb", default="1,5")
    ap.add_argument("--orders", default="natural", help="forced grad_order cells besides the tuned one: natural,priority")
    ap.add_argument("--pin", action="store_true",
                    help="pin every rank to its own cores (fxpar.tools.calibrate.rank_cores), in the calibration too")
    ap.add_argument("--comm-priority", action="store_true",
                    help="every rank's gloo threads under SCHED_FIFO (ClusterSpec.comm_priority), torch DDP's too, in "
                         "the calibration too")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per rank (default: the cores split over the ranks); the calibration uses the same")
    args = ap.parse_args()
    w = 2
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=max(1, args.d // 64), max_seq=args.seq)
    n = args.warmup + args.steps
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq)), torch.randint(0, args.vocab, (args.batch, args.seq)))
               for _ in range(n)]
    opt = (torch.optim.AdamW, {"lr": 1e-3})
    opt_fused = (torch.optim.AdamW, {"lr": 1e-3, "fused": True})     # DDP with the kernel fxpar's update runs
    print(f"load average at start: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    calibrated = fxpar.ClusterSpec.calibrate(world_size=w, threads=args.threads, pin=args.pin,
                                             comm_priority=args.comm_priority)
    rates = [parse_rate(r) for r in args.rates.split(",")]
    raws: dict = {}
    links = calibrate_link(rates, threads=args.threads, pin=args.pin, comm_priority=args.comm_priority, raw=raws)      # the veth at each cap, as the ranks will cross it
    for bps, lk in links.items():
        print(f"veth measured at {format_rate(bps)}: {lk.bandwidth * 8 / 1e9:.2f} Gbit/s, α {lk.latency * 1e6:.0f} us, "
              f"an overlapped transfer takes {at_cap(calibrated, raws.get(bps)).device.comm_cpu_per_byte * 2**20 * 1e3:.2f} "
              "ms of compute per MiB")
    sweep = [float(x) for x in args.sweep_mb.split(",") if x]
    fifo, fifo_payloads = build(model, batches, opt, calibrated, fxpar.Strategy(dp=w, bucket_cap_mb=25), n)
    orders = [o for o in args.orders.split(",") if o]
    bs, forced = {}, {}
    for bps in rates:       # planned for the link it will run on: the tuner sees the cap
        link = links.get(bps) or (calibrated.intra_node if bps is None else
                                  LinkSpec(bps / 8, calibrated.intra_node.latency))
        cl = at_cap(replace(calibrated, intra_node=link, inter_node=link), raws.get(bps))
        bs[bps] = build(model, batches, opt, cl, fxpar.Strategy(dp=w, comm_schedule="bytescheduler"), n)
        for o in orders:
            forced[(bps, o)] = build(model, batches, opt, cl, fxpar.Strategy(dp=w, comm_schedule="bytescheduler",
                                                                             grad_order=o), n)
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {args.layers} layers, d={args.d}, vocab={args.vocab}, {params / 1e6:.2f}M params "
          f"({params * 4 / 2**20:.1f} MiB of fp32 gradients); global batch {args.batch}x{args.seq}; {w} gloo ranks; "
          f"{args.steps} timed steps x {args.rounds} rounds per cell; {os.cpu_count()} cores, "
          f"{args.threads or max(1, (os.cpu_count() or 1) // w)} torch threads per rank; torch {torch.__version__}")
    for bps in rates:
        e = bs[bps][0].plan.section("bytescheduler").stages[0]
        go = e["grad_order"]
        print(f"  bytescheduler at {format_rate(bps)}: {len(e['pieces'])} pieces, partition "
              f"{e['partition_bytes'] / 2**20:.3g} MiB, credit {e['credit_bytes'] / 2**20:.3g} MiB, backward order "
              f"{go['mode']}" + (f" after the first {go['first']}" if go["mode"] == "hybrid" else "") + ", predicted "
              + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in go.get("tried", {}).items())
              + f" ms (FIFO predicted {e['fifo_predicted_step_s'] * 1e3:.1f} ms)")
    t_start = time.perf_counter()
    res, runs = {}, {}
    with CappedLink() as link:
        print("link: " + (f"veth {link.names.dev_a} <-> {link.names.dev_b}, tbf per direction, no latency (no netem)"
                          if link.active else f"UNCAPPED 127.0.0.1 (missing: {link.missing})"))
        with NetnsCluster(w, link, threads=args.threads, pin=args.pin, comm_priority=args.comm_priority) as cl:
            def cell(key, fn, argv):
                outs = cl.run(fn, [argv(r) for r in range(w)])
                res.setdefault(key, []).extend(per_step_max(outs))
                runs.setdefault(key, []).append(window_mean(outs) if key[1] != "compute" else   # (its barriers)
                                                max(sum(o["step_times"]) / len(o["step_times"]) for o in outs))

            def cells(bps):           # (key, rank function, per-rank arguments) of every cell at a cap
                out = [((bps, "bs"), fxpar_worker, lambda r: (bs[bps][1][r], batches, args.warmup))]
                out += [((bps, f"bs_{o}"), fxpar_worker, lambda r, o=o: (forced[(bps, o)][1][r], batches, args.warmup))
                        for o in orders]
                out.append(((bps, "fifo"), fxpar_worker, lambda r: (fifo_payloads[r], batches, args.warmup)))
                out += [((bps, f"ddp{mb:g}"), ddp_bench_worker,
                         lambda r, mb=mb: (model, batches, gpt_loss, opt, mb, args.warmup, False)) for mb in [25.0] + sweep]
                out += [((bps, f"ddpf{mb:g}"), ddp_bench_worker,
                         lambda r, mb=mb: (model, batches, gpt_loss, opt_fused, mb, args.warmup, False))
                        for mb in [25.0] + sweep]
                out.append(((bps, "compute"), ddp_bench_worker,
                            lambda r: (model, batches, gpt_loss, opt, 25.0, args.warmup, True)))
                return out

            for rnd in range(args.rounds):
                for bps in rates:
                    link.set_rate(bps)
                    todo = cells(bps)      # each round starts at another cell: none is always first after a cap change
                    for key, fn, argv in todo[rnd % len(todo):] + todo[:rnd % len(todo)]:
                        cell(key, fn, argv)
                print(f"  round {rnd + 1}/{args.rounds} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    for title, stat in (("mean step time in ms (a cell's timed steps' wall time, first rank to start to last to end, "
                         "over their number; the median over rounds)", {k: statistics.median(v) for k, v in runs.items()}),
                        ("median step time in ms (per step, the slower rank)",
                         {k: statistics.median(v) for k, v in res.items()})):
        table(title, stat, rates, orders, sweep, bs)
    print("\nquartiles (q1-q3, ms) of the per-step times")
    keys = (["bs"] + [f"bs_{o}" for o in orders] + ["fifo"] + [f"ddp{mb:g}" for mb in [25.0] + sweep]
            + [f"ddpf{mb:g}" for mb in [25.0] + sweep] + ["compute"])
    print(f"{'cap':>9} | " + " | ".join(f"{k:>11}" for k in keys))
    for bps in rates:
        qs = [statistics.quantiles(res[(bps, k)], n=4) for k in keys]
        print(f"{format_rate(bps):>9} | " + " | ".join(f"{q[0] * 1e3:5.0f}-{q[2] * 1e3:<5.0f}" for q in qs))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; load average at end: "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])} (2 ranks of this run count about 2)")


def table(title, med, rates, orders, sweep, bs):
    print("\n" + title)
    print(f"{'cap':>9} | {'ByteSched':>9} | {'predicted':>9} | " + "".join(f"{'BS ' + o:>11} | " for o in orders) + f"{'fxpar FIFO':>10} | {'DDP 25MB':>8} | "
          f"{'best DDP':>14} | {'DDPf 25MB':>9} | {'best DDPf':>14} | {'compute':>7} | {'BS/DDP25':>8} | {'BS/best':>7} | "
          f"{'BS/DDPf25':>9} | {'BS/bestf':>8} | {'pred/meas':>9}")
    for bps in rates:
        b, f, d, c = med[(bps, "bs")], med[(bps, "fifo")], med[(bps, "ddp25")], med[(bps, "compute")]
        df = med[(bps, "ddpf25")]
        bestf_mb = min([25.0] + sweep, key=lambda mb: med[(bps, f"ddpf{mb:g}")])
        bestf = med[(bps, f"ddpf{bestf_mb:g}")]
        bo = "".join(f"{med[(bps, f'bs_{o}')] * 1e3:11.1f} | " for o in orders)
        best_mb = min([25.0] + sweep, key=lambda mb: med[(bps, f"ddp{mb:g}")])
        best = med[(bps, f"ddp{best_mb:g}")]
        pred = bs[bps][0].plan.section("bytescheduler").stages[0]["predicted_step_s"]
        print(f"{format_rate(bps):>9} | {b * 1e3:9.1f} | {pred * 1e3:9.1f} | {bo}{f * 1e3:10.1f} | {d * 1e3:8.1f} | "
              f"{best * 1e3:7.1f} ({best_mb:g} MB) | {df * 1e3:9.1f} | {bestf * 1e3:7.1f} ({bestf_mb:g} MB) | "
              f"{c * 1e3:7.1f} | {b / d:8.3f} | {b / best:7.3f} | {b / df:9.3f} | {b / bestf:8.3f} | {pred / b:9.3f}")


if __name__ == "__main__":
    main()
