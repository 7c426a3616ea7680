"""fxpar PowerSGD against torch DDP + ``powerSGD_hook`` and plain DDP over a bandwidth-capped link; and the bytes
and step time of every compression method.

Two gloo ranks, one in each of two network namespaces joined by a veth pair capped with tbf
(benchmarks/netns_link.py; needs root and ``ip netns``, otherwise it says what is missing and runs uncapped). A
GPT of about 25M parameters (``--layers 8 --d 512``), the same batches for everyone, at each cap, alternating the
contenders in ``--rounds`` rounds:

- fxpar ``Strategy(dp=2, grad_sync=C.PowerSGD(rank=R, start_iter=2))`` (each bucket's P all-reduce issued in
  backward as the bucket is made, Q after P's wait, waited before the update: ``fxpar/compress/inflight.py``), and
  the same with ``comm_schedule="bytescheduler"`` (priority by layer, pieces, credit on the compressed collectives);
- DDP with ``powerSGD_hook`` and ``PowerSGDState(matrix_approximation_rank=R, start_powerSGD_iter=2)``, the model
  in one DDP bucket (torch's hook issues collectives from future callbacks: with several buckets the two gloo
  ranks interleave them differently and hang);
- plain DDP (25 MB buckets), and fxpar plain dp.

Goals: fxpar PowerSGD <= 0.9x the hook's step time, and <= 0.5x plain DDP's at 500 Mbit/s. The fxpar programs are
planned at each cap on ``ClusterSpec.calibrate()`` with the link as ``netns_link.calibrate_link`` measures the veth
there, and ``program.estimate()``'s step time is printed beside the measured one (goal: within 25% at 500 Mbit/s),
with the spread of the measured steps (the fastest and slowest step of the cell over its rounds).
Then (``--all-methods``), at ``--methods-rate`` (default 500 Mbit/s; ``none``: uncapped), every method's bytes per
step per rank (measured), its step time, and ``estimate()`` of the method's program planned on that link, then how
many rows' estimates are within 25% of the measured step (and which are not). The bytes come from a run of the
first compressed step with ``measure_comm=True`` (every op through the rank's counting dispatch mode), the step
times from runs without it.

    python benchmarks/bench_compression.py [--rates none,1gbit,500mbit] [--rank 2] [--steps 5] [--rounds 3]
    python benchmarks/bench_compression.py --rates 500mbit --rounds 3 --compile       # + fxpar PowerSGD compiled
    python benchmarks/bench_compression.py --rates 500mbit --all-methods --methods-rounds 2
    python benchmarks/bench_compression.py --rates 500mbit --rounds 0 --steps 4 --all-methods   # the 17 rows only
    python benchmarks/bench_compression.py --rates 500mbit --rounds 0 --steps 4 --all-methods --methods "NUQSGD 4b"
"""
from __future__ import annotations

import argparse
import copy
import statistics
from dataclasses import replace
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import fxpar  # noqa: E402
from fxpar import compress as C  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402
from bench_capped_link import ddp_steps, fxpar_worker, per_step_max  # noqa: E402
from netns_link import CappedLink, NetnsCluster, at_cap, calibrate_link, format_rate, parse_rate  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P  # noqa: E402


def ddp_hook_worker(model, batches, loss_fn, optimizer, warmup, rank, start_iter, bucket_cap_mb):
    """Timed DDP steps with torch's powerSGD_hook (rank > 0) or none (rank 0)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
    from torch.nn.parallel import DistributedDataParallel as DDP
    m = DDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
    if rank:
        state = P.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter,
                                min_compression_rate=2, use_error_feedback=True, warm_start=True)
        m.register_comm_hook(state, P.powerSGD_hook)
    cls, kw = optimizer
    window: list = []
    times = ddp_steps(m, cls(m.parameters(), **kw), batches, loss_fn, warmup, False, window)
    dist.barrier()
    return {"step_times": times, "window": tuple(window)}


def every_method():
    return {"allreduce": "allreduce", "FP16": C.FP16(), "PowerSGD r1": C.PowerSGD(rank=1, start_iter=2),
            "PowerSGD r2": C.PowerSGD(rank=2, start_iter=2), "TopK 1%": C.TopK(ratio=0.01),
            "RandomK 1%": C.RandomK(ratio=0.01), "Wangni 1%": C.Wangni(ratio=0.01), "QSGD 16": C.QSGD(levels=16),
            "NUQSGD 4b": C.NUQSGD(bits=4), "ALQ 3b": C.ALQ(bits=3), "AMQ 3b": C.AMQ(bits=3), "ByteGrad": C.ByteGrad(),
            "Accordion r1-r2": C.Accordion(low=C.PowerSGD(rank=1, start_iter=2), high=C.PowerSGD(rank=2, start_iter=2)),
            # warm-up 2 of the 3 untimed steps: the timed steps send the 8-bit momentum
            "QAdam": C.QAdam(warmup_steps=2),
            # dp=2: "ring" needs 3 ranks; the diffusion order keeps AdamW's weight decay (BAGUA's order refuses it)
            "Decentralized all": C.Decentralized(peers="all", order="adapt_then_combine"),
            "DDPHook powerSGD_hook r2": C.DDPHook(P.powerSGD_hook, P.PowerSGDState(
                process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=2,
                use_error_feedback=True, warm_start=True)),
            "DDPHook allreduce_hook": C.DDPHook(default_hooks.allreduce_hook)}


# methods that carry Adam's moments themselves: the optimizer each pairs with (the others use AdamW, lr 1e-3)
OWN_OPTIMIZER = {"QAdam": (C.QAdamOptimizer, {"lr": 1e-3})}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="none,1gbit,500mbit")
    ap.add_argument("--rank", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--compile", action="store_true",
                    help="also fxpar PowerSGD with compile=True (the step compiled in parts around its bucket sums)")
    ap.add_argument("--all-methods", action="store_true",
                    help="also every method's bytes, step time and estimate() at --methods-rate")
    ap.add_argument("--methods-rate", default="500mbit", help="the link of the --all-methods table (none: uncapped)")
    ap.add_argument("--methods-rounds", type=int, default=1)
    ap.add_argument("--methods", default="", help="only these rows of --all-methods (comma-separated labels)")
    args = ap.parse_args()
    chosen = [x.strip() for x in args.methods.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in every_method()]
    if unknown:
        raise SystemExit(f"--methods: unknown label(s) {', '.join(map(repr, unknown))}; the labels are "
                         f"{', '.join(every_method())}")
    w = 2
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=max(1, args.d // 64), max_seq=args.seq)
    n = args.warmup + args.steps
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq)), torch.randint(0, args.vocab, (args.batch, args.seq)))
               for _ in range(n)]
    opt = (torch.optim.AdamW, {"lr": 1e-3})
    params = sum(p.numel() for p in model.parameters())
    one_bucket_mb = params * 4 / 2**20 + 1

    def program(grad_sync, cluster=None, optimizer=None, **more):
        return fxpar.parallelize(model, cluster or fxpar.ClusterSpec.local(w), batches[0], loss_fn=gpt_loss,
                                 optimizer=optimizer or opt, strategy=fxpar.Strategy(dp=w, grad_sync=grad_sync, **more))
    rates = [parse_rate(r) for r in args.rates.split(",")]
    methods_rate = parse_rate(args.methods_rate)
    calibrated = fxpar.ClusterSpec.calibrate(world_size=w)
    raws: dict = {}
    links = calibrate_link(sorted(set(rates) | ({methods_rate} if args.all_methods else set()), key=str),
                           raw=raws)                 # the veth at each cap, as the ranks will cross it

    def capped(bps):
        link = links.get(bps) or calibrated.intra_node
        return at_cap(replace(calibrated, intra_node=link, inter_node=link), raws.get(bps))
    psgd = C.PowerSGD(rank=args.rank, start_iter=2)
    kinds = {"fxpar PowerSGD": {"grad_sync": psgd},
             "fxpar PowerSGD + ByteScheduler": {"grad_sync": psgd, "comm_schedule": "bytescheduler"},
             "fxpar dp": {"grad_sync": "allreduce"}}
    if args.compile:
        kinds["fxpar PowerSGD compiled"] = {"grad_sync": psgd, "compile": True}
    programs = {}
    for bps in rates:               # each planned (and predicted) on the link it runs on
        cl = capped(bps)
        for k, kw in kinds.items():
            programs[(bps, k)] = program(cluster=cl, **kw)
    payloads = {key: [p.payload(r, n_batches=n) for r in range(w)] for key, p in programs.items()}
    print(f"GPT {args.layers} layers, d={args.d}, vocab={args.vocab}, {params / 1e6:.1f}M params; global batch "
          f"{args.batch}x{args.seq}; {w} gloo ranks; PowerSGD rank {args.rank}; {args.steps} timed steps x "
          f"{args.rounds} rounds per cell; load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    res = {}
    t_start = time.perf_counter()
    with CappedLink() as link:
        print("link: " + ("veth pair, tbf per direction" if link.active else f"UNCAPPED (missing: {link.missing})"))
        with NetnsCluster(w, link) as cl:
            def cell(key, fn, argv):
                outs = cl.run(fn, [argv(r) for r in range(w)])
                res.setdefault(key, []).extend(per_step_max(outs))
            def tables(done):
                """The tables over the rounds done so far (printed after each, so a run cut short still reports)."""
                med = {k: statistics.median(v) for k, v in res.items()}
                print(f"\nmedian step time over {done} round(s), ms (per step, the slower rank)")
                print("| link | fxpar PowerSGD | fxpar PowerSGD + ByteScheduler | DDP + powerSGD_hook | DDP | "
                      "fxpar dp | "
                      "fxpar PowerSGD / hook | fxpar PowerSGD / DDP | + ByteScheduler / hook | + ByteScheduler / DDP |")
                print("|---|---|---|---|---|---|---|---|---|---|")
                for bps in rates:
                    f, fb, h, d, fd = (med[(bps, k)] for k in ("fxpar PowerSGD", "fxpar PowerSGD + ByteScheduler",
                                                               "DDP + powerSGD_hook", "DDP", "fxpar dp"))
                    print(f"| {format_rate(bps)} | {f * 1e3:.0f} | {fb * 1e3:.0f} | {h * 1e3:.0f} | {d * 1e3:.0f} | "
                          f"{fd * 1e3:.0f} | {f / h:.2f} | {f / d:.2f} | {fb / h:.2f} | {fb / d:.2f} |")
                    if (bps, "fxpar PowerSGD compiled") in med:
                        fc = med[(bps, "fxpar PowerSGD compiled")]
                        print(f"|   compiled ({format_rate(bps)}) | {fc * 1e3:.0f} ms | / hook {fc / h:.2f} | "
                              f"/ DDP {fc / d:.2f} | / eager fxpar PowerSGD {fc / f:.2f} |")
                print("\nestimate() against measured (median step, ms; the fastest and slowest step of the cell)")
                print("| link | program | bytes per step (plan) | predicted | measured | spread | "
                      "predicted / measured |")
                print("|---|---|---|---|---|---|---|")
                for bps in rates:
                    for k in kinds:
                        est = programs[(bps, k)].estimate()
                        m, v = med[(bps, k)], res[(bps, k)]
                        print(f"| {format_rate(bps)} | {k} | {int(est.ranks[0].comm_bytes):,} | "
                              f"{est.step_time_s * 1e3:.0f} | "
                              f"{m * 1e3:.0f} | {min(v) * 1e3:.0f}-{max(v) * 1e3:.0f} | {est.step_time_s / m:.2f} |")
            for rnd in range(args.rounds):
                for bps in rates:
                    link.set_rate(bps)
                    for k in kinds:
                        cell((bps, k), fxpar_worker, lambda r, k=k: (payloads[(bps, k)][r], batches, args.warmup))
                    cell((bps, "DDP + powerSGD_hook"), ddp_hook_worker,
                         lambda r: (model, batches, gpt_loss, opt, args.warmup, args.rank, 2, one_bucket_mb))
                    cell((bps, "DDP"), ddp_hook_worker, lambda r: (model, batches, gpt_loss, opt, args.warmup, 0, 2, 25))
                print(f"  round {rnd + 1}/{args.rounds} ({time.perf_counter() - t_start:.0f} s, load average "
                      f"{_load()})", flush=True)
                tables(rnd + 1)
            if args.all_methods:
                link.set_rate(methods_rate)
                spec = capped(methods_rate)
                print(f"\nevery method at {format_rate(methods_rate)}: bytes per step per rank (measured), median step "
                      "time (the fastest and slowest step), estimate() planned on that link")
                print("| method | bytes per step | vs allreduce | step ms | spread ms | estimate ms | "
                      "estimate / measured | load (1 min) |")
                print("|---|---|---|---|---|---|---|---|")
                base = None
                ratios = {}
                chosen = chosen and ["allreduce"] + chosen      # the "vs allreduce" column's base runs first
                for label, gs in every_method().items():
                    if chosen and label not in chosen:
                        continue
                    p = program(gs, cluster=spec, optimizer=OWN_OPTIMIZER.get(label))
                    # the bytes from a counted run (every op through fxpar's counting dispatch mode), the times
                    # from runs without it: the mode's per-op cost is not the method's
                    counted = batches[:args.warmup + 1]
                    pl = [p.payload(r, n_batches=len(counted), measure_comm=True) for r in range(w)]
                    sent = cl.run(_measured_worker, [(pl[r], counted, args.warmup) for r in range(w)])[0]["bytes"]
                    pl = [p.payload(r, n_batches=n) for r in range(w)]
                    times = []
                    for _ in range(args.methods_rounds):
                        outs = cl.run(_measured_worker, [(pl[r], batches, args.warmup) for r in range(w)])
                        times.extend(per_step_max(outs))
                    base = base or sent
                    m, est = statistics.median(times), p.estimate().step_time_s
                    ratios[label] = est / m
                    print(f"| {label} | {sent:,} | {sent / base:.3f} | {m * 1e3:.0f} | {min(times) * 1e3:.0f}-"
                          f"{max(times) * 1e3:.0f} | {est * 1e3:.0f} | {est / m:.2f} | {_load()} |", flush=True)
                outside = {k: r for k, r in ratios.items() if not 0.75 <= r <= 1.25}
                print(f"\nestimate within 25% of measured: {len(ratios) - len(outside)} of {len(ratios)} rows"
                      + (f"; outside: {', '.join(f'{k} {r:.2f}' for k, r in outside.items())}" if outside else ""))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


def _load() -> str:
    """The machine's load average over the last minute (the ratios above depend on it: the ranks share 2 cores)."""
    return Path("/proc/loadavg").read_text().split()[0]


def _measured_worker(payload, batches, warmup):
    from fxpar.runtime.executor import Executor
    ex = Executor(payload)
    for b in batches:
        ex.step(b)
    ex.drain()
    return {"step_times": ex.step_times[warmup:],
            "bytes": sum(b for _, b in ex.comm_calls[-1]) if ex.comm_calls else None}


if __name__ == "__main__":
    main()
