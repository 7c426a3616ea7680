"""Local SGD and DiLoCo against DDP over a bandwidth-capped link: the time to reach the same training loss.

Two gloo ranks, one in each of two network namespaces joined by a veth pair capped with tbf
(benchmarks/netns_link.py; needs root and ``ip netns``, otherwise it says what is missing and runs uncapped). The
task is ``compression_convergence.py``'s text (``pydoc_data.topics``, bytes, vocabulary 256) with a char GPT of about
25M parameters (``--layers 8 --d 512``: 100 MB of float32 gradients a step, 1.6 s a direction at 500 Mbit/s) and a
small global batch (8 windows of 32 bytes) so that the link, not the 2 shared cores, sets DDP's step time; the same
batches (fixed seed) and the same AdamW for every method:

- torch DDP (25 MB buckets) and fxpar plain dp (``Strategy(dp=2)``): synchronous, the reference;
- fxpar ``Strategy(dp=2, sync=S.LocalSGD(period=H))``: every replica steps on its own shard, the parameters are
  averaged every ``H`` steps (Lin et al., ICLR 2020);
- fxpar ``Strategy(dp=2, sync=S.DiLoCo(period=H, outer=(SGD, lr 0.7, momentum 0.9, Nesterov)))``: the outer settings
  of Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023 (arXiv:2311.08105):
  Nesterov momentum, outer learning rate 0.7, momentum 0.9; the inner optimizer is the user's AdamW (the paper's
  inner optimizer too).

Neither averaging method has a synchronous warm-up here (``--sync-warmup``): every synchronous step costs a full
all-reduce over the capped link. The target is the training loss DDP reaches after ``--target-step`` steps, each
curve smoothed by the mean of the last ``--smooth`` steps (the loss of one step is the mean of both ranks' losses on
their halves of the global batch). Every method trains ``--steps`` steps; a method's time to target is the wall time
from the start of its first step to the end of the first step whose smoothed loss is at or below the target (the
later of the two ranks; both share this machine's ``time.perf_counter()`` clock). Steps a method needs beyond DDP's
count against it.

    python3 benchmarks/bench_sync_link.py [--rates 500mbit,none] [--steps 40] [--target-step 20] [--period 8]
    python3 benchmarks/netns_link.py --cleanup      # leftovers of a run that was killed hard
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import fxpar  # noqa: E402
from fxpar import sync as S  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402
from compression_convergence import text_ids  # noqa: E402
from netns_link import CappedLink, NetnsCluster, format_rate, parse_rate  # noqa: E402

__all__ = ["make_task", "methods", "smoothed", "time_to_target", "main"]


def make_task(args) -> tuple:
    """``(batches, model)``: ``args.steps`` global batches of ``args.batch`` random windows of ``args.seq`` bytes of
    the text (fixed seed) and the char GPT (seeded), the same for every method."""
    ids = text_ids(args.chars)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - args.seq - 1, (args.steps, args.batch), generator=g)
    batches = [(torch.stack([ids[s:s + args.seq] for s in row]), torch.stack([ids[s + 1:s + args.seq + 1] for s in row]))
               for row in starts]
    torch.manual_seed(0)
    model = GPT(vocab=256, d=args.d, layers=args.layers, heads=max(1, args.d // 64), max_seq=args.seq)
    return batches, model


def methods(period: int, warmup: int) -> dict:
    """label -> fxpar sync method (None: plain dp); torch DDP is run apart."""
    return {
        "fxpar dp": None,
        f"fxpar LocalSGD H={period}": S.LocalSGD(period=period, warmup_steps=warmup),
        f"fxpar DiLoCo H={period}": S.DiLoCo(period=period, warmup_steps=warmup,
                                              outer=(torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})),
    }


def fxpar_loss_worker(payload, batches):
    """Every step of one rank: ``(its loss, perf_counter at the step's end)``; ``t0``: the first step's start."""
    import torch.distributed as dist
    from fxpar.runtime.executor import Executor
    ex = Executor(payload)
    dist.barrier()
    t0 = time.perf_counter()
    out = []
    for b in batches:
        loss = ex.step(b)
        out.append((float(loss), time.perf_counter()))
    ex.drain()
    dist.barrier()
    return {"t0": t0, "steps": out}


def ddp_loss_worker(model, batches, lr, bucket_cap_mb):
    """torch DDP on this rank's half of each global batch, AdamW; the same record as :func:`fxpar_loss_worker`."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, world = dist.get_rank(), dist.get_world_size()
    m = DDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    dist.barrier()
    t0 = time.perf_counter()
    out = []
    for b in batches:
        n = b[0].shape[0] // world
        x, y = (t[rank * n:(rank + 1) * n] for t in b)
        opt.zero_grad()
        loss = gpt_loss(m(x), y)
        loss.backward()
        opt.step()
        out.append((loss.item(), time.perf_counter()))
    dist.barrier()
    return {"t0": t0, "steps": out}


def combine(outs) -> tuple:
    """``(losses, seconds)`` per step: the mean of the ranks' losses, and the time from the earlier rank's start to
    the later rank's end of that step."""
    t0 = min(o["t0"] for o in outs)
    n = len(outs[0]["steps"])
    losses = [sum(o["steps"][i][0] for o in outs) / len(outs) for i in range(n)]
    secs = [max(o["steps"][i][1] for o in outs) - t0 for i in range(n)]
    return losses, secs


def smoothed(losses: list, k: int) -> list:
    """The mean of the last ``k`` steps (fewer at the start)."""
    return [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]


def time_to_target(losses: list, secs: list, target: float, k: int, rtol: float = 1e-6):
    """``(step count, seconds)`` at the first step whose smoothed loss is <= ``target`` (within ``rtol``: fxpar dp and
    DDP sum the same float32 gradients in another order, and their losses differ in the 7th digit);
    ``(None, None)`` if none."""
    for i, v in enumerate(smoothed(losses, k)):
        if v <= target * (1 + rtol):
            return i + 1, secs[i]
    return None, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="500mbit", help="comma-separated caps (none: uncapped veth)")
    ap.add_argument("--steps", type=int, default=40, help="steps every method trains")
    ap.add_argument("--target-step", type=int, default=20, help="the target is DDP's smoothed loss after this step")
    ap.add_argument("--smooth", type=int, default=5)
    ap.add_argument("--period", type=int, default=8)
    ap.add_argument("--sync-warmup", type=int, default=0, help="synchronous steps before the averaging methods' own")
    ap.add_argument("--chars", type=int, default=300_000)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="seconds one method's run may take on the ranks (a loaded 2-core machine needs many)")
    ap.add_argument("--csv", default="", help="write every method's loss and seconds per step here (one file per cap: "
                    "the cap is added to the name)")
    ap.add_argument("--only", default="", help="comma-separated method labels' second words (dp,LocalSGD,DiLoCo)")
    args = ap.parse_args(argv)
    if not 1 <= args.target_step <= args.steps:
        ap.error(f"--target-step {args.target_step} must be between 1 and --steps {args.steps}")
    w = 2
    batches, model = make_task(args)
    params = sum(p.numel() for p in model.parameters())
    opt = (torch.optim.AdamW, {"lr": args.lr})
    chosen = {x.strip() for x in args.only.split(",") if x.strip()}
    programs = {}
    for label, method in methods(args.period, args.sync_warmup).items():
        if chosen and label.split()[1] not in chosen:
            continue
        p = fxpar.parallelize(model, fxpar.ClusterSpec.local(w), batches[0], loss_fn=gpt_loss, optimizer=opt,
                              strategy=fxpar.Strategy(dp=w, sync=method))
        programs[label] = [p.payload(r, n_batches=len(batches)) for r in range(w)]
    rates = [parse_rate(r) for r in args.rates.split(",")]
    print(f"char GPT {args.layers} layers, d={args.d}, {params / 1e6:.1f}M params "
          f"({params * 4 / 2**20:.0f} MiB of float32 gradients); global batch {args.batch}x{args.seq}; {args.steps} "
          f"steps; {w} gloo ranks; AdamW lr {args.lr}; target: DDP's loss (mean of {args.smooth}) after step "
          f"{args.target_step}; load average {_load()}", flush=True)
    t_start = time.perf_counter()
    with CappedLink() as link:
        print("link: " + ("veth pair, tbf per direction" if link.active else f"UNCAPPED (missing: {link.missing})"))
        with NetnsCluster(w, link, timeout_s=args.timeout) as cl:
            for bps in rates:
                link.set_rate(bps)
                runs = {}
                loads = {}
                runs["torch DDP"] = combine(cl.run(ddp_loss_worker, [(model, batches, args.lr, 25)] * w))
                loads["torch DDP"] = _load()
                print(f"  {format_rate(bps)} torch DDP: {runs['torch DDP'][1][-1]:.1f} s "
                      f"({time.perf_counter() - t_start:.0f} s, load {loads['torch DDP']})", flush=True)
                for label, pl in programs.items():
                    runs[label] = combine(cl.run(fxpar_loss_worker, [(pl[r], batches) for r in range(w)]))
                    loads[label] = _load()
                    print(f"  {format_rate(bps)} {label}: {runs[label][1][-1]:.1f} s "
                          f"({time.perf_counter() - t_start:.0f} s, load {loads[label]})", flush=True)
                report(runs, loads, bps, args)
                if args.csv:
                    write_csv(runs, Path(args.csv), bps)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 0


def report(runs: dict, loads: dict, bps, args) -> None:
    ddp_losses, ddp_secs = runs["torch DDP"]
    target = smoothed(ddp_losses, args.smooth)[args.target_step - 1]
    _, ddp_t = time_to_target(ddp_losses, ddp_secs, target, args.smooth)
    print(f"\nlink {format_rate(bps)}: target loss {target:.4f} (DDP, mean of steps "
          f"{max(1, args.target_step - args.smooth + 1)}-{args.target_step})")
    print(f"| method | ms per step (mean) | steps to target | seconds to target | vs DDP | final loss (mean of last "
          f"{args.smooth}) | load (1 min) |")
    print("|---|---|---|---|---|---|---|")
    for label, (losses, secs) in runs.items():
        n, t = time_to_target(losses, secs, target, args.smooth)
        final = sum(losses[-args.smooth:]) / args.smooth
        reached = f"{n} | {t:.1f} | {t / ddp_t:.2f}" if n else f"not in {len(losses)} | - | -"
        print(f"| {label} | {secs[-1] / len(secs) * 1e3:.0f} | {reached} | {final:.4f} | {loads[label]} |")
    print(f"\nsmoothed loss (mean of {args.smooth}) every 5 steps:")
    for label, (losses, _) in runs.items():
        sm = smoothed(losses, args.smooth)
        print(f"  {label:>24}: " + " ".join(f"{v:.3f}" for v in sm[4::5]))


def write_csv(runs: dict, path: Path, bps) -> None:
    import csv
    path = path.with_name(f"{path.stem}_{format_rate(bps)}{path.suffix or '.csv'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + [f"{k} {x}" for k in runs for x in ("loss", "s")])
        n = len(next(iter(runs.values()))[0])
        for i in range(n):
            w.writerow([i + 1] + [f"{v:.6f}" for losses, secs in runs.values() for v in (losses[i], secs[i])])
    print(f"curves: {path}")


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


if __name__ == "__main__":
    raise SystemExit(main())
