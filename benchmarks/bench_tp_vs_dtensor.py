"""fxpar tensor parallelism (tp=2, ``sharding="megatron"`` and ``"auto"``) vs torch DTensor tensor parallelism
(``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``), and a 1-process baseline: step time, same
model, same batches, same ranks (gloo, CPU), side by side in one run.

    python benchmarks/bench_tp_vs_dtensor.py [--d 256] [--layers 4] [--seq 128] [--batch 8] [--steps 8] [--rounds 2]
    python benchmarks/bench_tp_vs_dtensor.py --compile [--no-profile]

The model is a GPT-like stack whose blocks have separate q/k/v/o Linears and an MLP (fc1, fc2), so Megatron's
split (Shoeybi et al. 2019, §3) applies fully: q, k, v, fc1 column-parallel, o, fc2 row-parallel, attention on
each rank's heads. Embeddings, layer norms and the LM head stay replicated on the torch side (what
``parallelize_module`` leaves alone); fxpar's megatron preset leaves them replicated too, ``"auto"`` decides itself.
The attention block reads its head count from the local width of q (``q.shape[-1] // head_dim``), as torchtitan
does, so the same module runs whole, or on half the heads under DTensor.

1. Agreement: a small float64 run of every side (a few AdamW steps) against one process; the largest loss
   difference is printed, and the benchmark says DISAGREE where it exceeds 1e-10.
2. Step time: float32, the slowest rank's time per step, median over the timed steps after ``--warmup``; the
   sides alternate on one LocalCluster (1 thread per rank) for ``--rounds`` rounds. The 1-process baseline
   (eager forward + backward + ``AdamW.step``) runs with 1 and with 2 threads (the 2-rank runs use 2 cores).
   torch's sides use ``AdamW(foreach=True)``; on the DTensor side that needs ``implicit_replication()`` around
   ``step()`` (foreach over split DTensors and plain replicated tensors raises "got mixed torch.Tensor and
   DTensor"); ``--foreach 0`` runs the per-tensor loop instead.
3. Where the time goes: the collectives of one step per side (count, bytes; ``fxpar.runtime.measure.CommCounter``)
   and, unless ``--no-profile``, rank 0's ``torch.profiler`` self CPU time per op and step, side by side (fxpar:
   two profiled runs of different lengths subtracted, so only steady steps count).

``--compile``: two sides more, ``Strategy(tp=2, sharding="megatron", compile=True)`` (each rank's step graph through
inductor, compiled at its first step, a warm-up step) and DTensor with ``torch.compile`` on the parallelized model
(forward and backward through inductor at the first warm-up step; the AdamW update eager, as on the plain DTensor
side), in the same rounds; the agreement check then includes the compiled fxpar side.
"""
import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402

TOL = 1e-10


class Block(nn.Module):
    """Pre-LN attention (separate q, k, v, o) + MLP. Heads are counted from q's (local) width."""

    def __init__(self, d, heads):
        super().__init__()
        self.head_dim = d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h) for lin in (self.q, self.k, self.v))
        heads = q.shape[-1] // self.head_dim                      # local heads under tensor parallelism
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, heads * self.head_dim)
        x = x + self.o(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TPGPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make(args, dtype):
    torch.manual_seed(0)
    model = TPGPT(args.vocab, args.d, args.layers, args.heads, args.seq).to(dtype)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),
                torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)) for _ in range(args.n)]
    return model, batches


OPT = (torch.optim.AdamW, {"lr": 1e-3})


# ---- torch sides -----------------------------------------------------------------------------------------------

def single_process(model, batches, warmup, threads):
    """Eager forward + backward + AdamW on the whole batch, one process: (losses, step times after warm-up)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m = copy.deepcopy(model)
        o = OPT[0](m.parameters(), **OPT[1], foreach=True)
        losses, times = [], []
        for i, (x, y) in enumerate(batches):
            t0 = time.perf_counter()
            o.zero_grad()
            loss = loss_fn(m(x), y)
            loss.backward()
            o.step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        return losses, times
    finally:
        torch.set_num_threads(old)


def dtensor_model(model):
    """torch's tensor parallelism on this rank: Megatron's plan per block over a 1-D "cpu" mesh of all ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = copy.deepcopy(model)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
            "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    for blk in m.blocks:
        parallelize_module(blk, mesh, plan)
    return m


def dtensor_worker(model, batches, warmup, foreach, profile=False, compiled=False):
    """One rank of DTensor tp: every rank sees the whole batch. Returns losses, step times, the collectives of one
    more (untimed) step and, with ``profile``, rank 0's per-step profile of the steps after warm-up instead."""
    import contextlib

    from fxpar.runtime.measure import CommCounter
    from torch.distributed.tensor.experimental import implicit_replication
    m = dtensor_model(model)
    o = OPT[0](m.parameters(), **OPT[1], foreach=foreach)
    if compiled:
        m = torch.compile(m)
    # foreach AdamW over DTensor (split Linears) and plain tensors (embeddings, norms, head) raises "got mixed
    # torch.Tensor and DTensor"; torch's documented remedy is implicit_replication(): plain tensors count as
    # replicated DTensors inside it. Without foreach the update loops over tensors and needs nothing.
    replicate = implicit_replication if foreach else contextlib.nullcontext
    prof = _profiler() if profile else None
    losses, times, comm = [], [], None
    for i, (x, y) in enumerate(batches):
        if prof is not None and i == warmup:
            prof.__enter__()
        t0 = time.perf_counter()
        o.zero_grad()
        loss = loss_fn(m(x), y)
        loss.backward()
        with replicate():
            o.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    prof = _stop(prof)
    if profile:
        steps = len(batches) - warmup
        prof = {k: (t / steps / 1e3, c / steps) for k, (t, c) in prof.items()} if prof else prof
    elif len(batches) > warmup:                                     # one untimed step more, its collectives counted
        with CommCounter() as counter:
            o.zero_grad()
            loss_fn(m(batches[-1][0]), batches[-1][1]).backward()
            with replicate():
                o.step()
        comm = counter.calls
    return {"losses": losses, "step_times": times, "profile": prof, "comm": comm}


# ---- fxpar side ------------------------------------------------------------------------------------------------

def fxpar_program(model, batches, sharding, world, passes=(), compile=False):
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(world), batches[0], loss_fn, OPT,
                             strategy=fxpar.Strategy(tp=world, sharding=sharding, passes=list(passes), compile=compile))


def fxpar_side(model, batches, sharding, world, compile=False):
    """``(label, program)``, or ``(label, None)`` with the error printed where building fails: the benchmark goes
    on with the other sides and says so."""
    label = f"fxpar {sharding}{' compiled' if compile else ''}"
    try:
        return label, fxpar_program(model, batches, sharding, world, compile=compile)
    except Exception as e:                  # noqa: BLE001 -- reported, the side is left out
        print(f"{label}: FAILS to build, left out: {type(e).__name__}: {str(e).splitlines()[0]}")
        return label, None


_PROF = {}


def _profiler():
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU])


def _stop(prof):
    """Stop ``prof``; on rank 0 return ``{op: (self CPU us, calls)}``."""
    if prof is None:
        return None
    prof.__exit__(None, None, None)
    import torch.distributed as dist
    if dist.get_rank() != 0:
        return None
    return {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()}


def prof_start():
    """Runs on each rank of the LocalCluster: start a profiler that spans the next run_local on that rank."""
    _PROF["p"] = _profiler()
    _PROF["p"].__enter__()


def prof_stop():
    return _stop(_PROF.pop("p"))


def fxpar_profile(prog, lc, batches, warmup, steps):
    """Rank 0's per-step ``{op: (self ms, calls)}``: two profiled runs, ``warmup + 1`` and ``warmup + 1 + steps``
    steps, subtracted -- what is left is ``steps`` steady steps, without the first step's one-off work or the
    gathering of the trained state at the end of run_local."""
    out = []
    for n in (warmup + 1, warmup + 1 + steps):
        world = lc.world_size
        lc.run(prof_start, [()] * world)
        prog.run_local(batches[:n], cluster=lc)
        out.append(lc.run(prof_stop, [()] * world)[0])
    short, long = out
    return {k: ((t - short.get(k, (0, 0))[0]) / steps / 1e3, (c - short.get(k, (0, 0))[1]) / steps)
            for k, (t, c) in long.items()}


def comm_per_step(calls) -> str:
    """``[(kind, bytes)]`` of one step -> "kind x count (MiB)" per kind."""
    by = {}
    for kind, nbytes in calls:
        c, b = by.get(kind, (0, 0))
        by[kind] = (c + 1, b + nbytes)
    return ", ".join(f"{k} x{c} ({b / 2**20:.1f} MiB)" for k, (c, b) in sorted(by.items())) or "none"


def print_profiles(profiles, rows=16):
    """Side by side: the ops with the most self CPU time per step on any side (ms/step, calls/step)."""
    names = list(profiles)
    top = sorted({k for p in profiles.values() for k in p}, key=lambda k: -max(p.get(k, (0, 0))[0]
                                                                                for p in profiles.values()))[:rows]
    print(f"\nrank 0, self CPU ms per step (calls per step), after warm-up:\n{'op':52s}" +
          "".join(f"{n:>22s}" for n in names))
    for k in top:
        cells = "".join(f"{profiles[n].get(k, (0, 0))[0]:11.1f} ({profiles[n].get(k, (0, 0))[1]:6.1f})" for n in names)
        print(f"{k[:52]:52s}{cells}")
    print(f"{'total':52s}" + "".join(f"{sum(t for t, _ in profiles[n].values()):11.1f} {'':8s}" for n in names))


def _tp_note(prog):
    """The tensor_parallel pass's notes from explain() (what was split, collectives, Tofu vs Megatron)."""
    lines = [ln.strip() for ln in prog.explain().splitlines() if "tensor_parallel:" in ln or "tofu:" in ln]
    return " | ".join(dict.fromkeys(lines)) or "(no tensor_parallel note in explain())"


# ---- the run ---------------------------------------------------------------------------------------------------

_SIDES = (("megatron", False), ("auto", False))


def agreement(args, lc, world, steps=4):
    """float64, small: every side's losses for ``steps`` AdamW steps; prints each side's largest difference from one
    process and each fxpar side's from DTensor, and says DISAGREE above ``TOL``."""
    small = argparse.Namespace(vocab=64, d=32, layers=2, heads=4, seq=16, batch=4, n=steps)
    model, batches = make(small, torch.float64)
    ref, _ = single_process(model, batches, 0, 1)
    losses = {}
    for sharding, compiled in _SIDES + ((("megatron", True),) if args.compile else ()):
        label, prog = fxpar_side(model, batches, sharding, world, compiled)
        if prog is not None:
            losses[label] = prog.run_local(batches, cluster=lc).losses
    out = lc.run(dtensor_worker, [(model, batches, 0, args.foreach)] * world)
    losses["DTensor"] = out[0]["losses"]
    ranks = max(abs(a - b) for o in out for a, b in zip(o["losses"], out[0]["losses"]))
    gap = lambda xs, ys: max(abs(a - b) for a, b in zip(xs, ys))    # noqa: E731
    verdict = lambda d: "agree" if d <= TOL else f"DISAGREE (> {TOL:g})"   # noqa: E731
    print(f"agreement, float64 (d={small.d}, {small.layers} layers, {steps} AdamW steps; 1-process losses "
          f"{', '.join(f'{x:.6f}' for x in ref)}):")
    for side, ls in losses.items():
        d = gap(ls, ref)
        print(f"  max |{side} - 1 process| = {d:.3e}  {verdict(d)}")
    for side, ls in losses.items():
        if side != "DTensor":
            d = gap(ls, losses["DTensor"])
            print(f"  max |{side} - DTensor|   = {d:.3e}  {verdict(d)}")
    print(f"  DTensor ranks' losses differ by at most {ranks:.3e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--foreach", type=int, default=1, help="DTensor side: AdamW(foreach=...)")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--compile", action="store_true", help="also fxpar megatron compile=True and DTensor + torch.compile")
    args = ap.parse_args()
    args.n = args.warmup + args.steps
    world = 2
    model, batches = make(args, torch.float32)
    psi = sum(p.numel() for p in model.parameters())
    print(f"TPGPT {args.layers} layers, d={args.d}, {args.heads} heads, vocab {args.vocab}: {psi / 1e6:.2f}M params; "
          f"batch {args.batch}x{args.seq}; float32; AdamW(lr=1e-3); {world} gloo ranks, 1 thread each")
    with fxpar.LocalCluster(world) as lc:
        agreement(args, lc, world)
        progs = {}
        for sharding, compiled in _SIDES + ((("megatron", True),) if args.compile else ()):
            t0 = time.perf_counter()
            label, prog = fxpar_side(model, batches, sharding, world, compiled)
            if prog is not None:
                progs[label] = prog
                print(f"parallelize({label}): {time.perf_counter() - t0:.1f} s; {_tp_note(prog)}")
        dts = ("DTensor", "DTensor + torch.compile") if args.compile else ("DTensor",)
        times = {s: [] for s in [*progs, *dts, "1 process, 1 thread", "1 process, 2 threads"]}
        for r in range(args.rounds):
            for name, prog in progs.items():
                times[name] += prog.run_local(batches, cluster=lc).step_times[args.warmup:]
            for side in dts:
                out = lc.run(dtensor_worker, [(model, batches, args.warmup, args.foreach, False, side != "DTensor")]
                             * world)
                times[side] += [max(o["step_times"][i] for o in out) for i in range(args.steps)]
                if side == "DTensor":
                    dt_comm = out[0]["comm"]
            print(f"round {r}: load average {os.getloadavg()[0]:.1f}; medians "
                  + ", ".join(f"{k} {statistics.median(v[-args.steps:]) * 1e3:.1f} ms" for k, v in times.items()
                              if v and not k.startswith("1 process")))
            times["1 process, 1 thread"] += single_process(model, batches, args.warmup, 1)[1]
            times["1 process, 2 threads"] += single_process(model, batches, args.warmup, 2)[1]
        print("\ncollectives per step, rank 0:")
        for name, prog in progs.items():
            res = prog.run_local(batches[:args.warmup + 1], cluster=lc, measure_comm=True)
            print(f"  {name:20s} {comm_per_step(res.comm_calls[0][-1])}")
        print(f"  {'DTensor':20s} {comm_per_step(dt_comm)}")
        if args.profile:
            k = max(1, min(6, args.steps - 1))
            profiles = {name: fxpar_profile(prog, lc, batches, args.warmup, k) for name, prog in progs.items()}
            out = lc.run(dtensor_worker, [(model, batches[:args.warmup + k], args.warmup, args.foreach, True)] * world)
            profiles["DTensor"] = out[0]["profile"]
            print_profiles(profiles)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    b1, b2, dt = med["1 process, 1 thread"], med["1 process, 2 threads"], med["DTensor"]
    print(f"\nstep time, {args.rounds} round(s) x {args.steps} steps after {args.warmup} warm-up; "
          "ratios are of medians")
    print(f"{'side':22s} {'median':>10s} {'min':>9s} {'max':>9s} {'/ 1 proc 1 thr':>15s} {'/ 1 proc 2 thr':>15s} "
          f"{'/ DTensor':>10s}")
    for name, ts in times.items():
        print(f"{name:22s} {med[name] * 1e3:7.1f} ms {min(ts) * 1e3:6.1f} ms {max(ts) * 1e3:6.1f} ms "
              f"{med[name] / b1:14.2f}x {med[name] / b2:14.2f}x {med[name] / dt:9.2f}x")


if __name__ == "__main__":
    main()
