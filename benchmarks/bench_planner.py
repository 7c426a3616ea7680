"""The automatic planner: how long it takes to plan, and how its pick compares with the plans it passed over.

    python benchmarks/bench_planner.py plan [--megatron-1t] [--build]    # planning time (fxpar.auto_plan), warm
    python benchmarks/bench_planner.py measure         # auto's pick and the next candidates run for real, 2 ranks
    python benchmarks/bench_planner.py megatron [--rows 1 2 ...] [--auto]   # Megatron-LM's Table 1 (SC'21)
    python benchmarks/bench_planner.py alpa [--gpus 8 16 ...] [--no-auto]   # Alpa's GPT points (OSDI'22)

``plan``: GPT-2 small (12 layers, h=768, seq 1024, global batch 32) on 8 A100s (one node), and a 32-layer h=4096
GPT (32 heads, seq 2048, global batch 512) on 64 A100s (8 nodes), both on the ``meta`` device: the first call (cold:
imports and the fake-tensor warm-up) and the best of three more (warm), the profile's share, the candidates priced,
and the plan ranked first. ``--build`` also times ``parallelize(strategy="auto")`` (the finalists built in full);
``--megatron-1t`` adds Megatron-LM's 1T row (Table 1, row 10: 128 layers, h=25600, on 3,072 A100s), unpinned.

``alpa``: Alpa's GPT benchmark on p3.16xlarge machines (tests/test_auto_alpa.py: the published figures and where
they come from): for its measured 8-GPU point and each point of its Figure 7(a), fxpar's cheap cost of the plan Alpa
reports (where a dp x tp x pp mesh expresses it) and of ``fxpar.auto_plan``'s pick (fp16 and full recompute pinned,
as both systems ran), as TFLOPS per GPU the way Alpa counts them, beside Alpa's and Megatron-LM's published figures.

``measure``: for each model (the tied GPT of ``fxpar.testing``, an MLP), ``parallelize(strategy="auto")`` on
2 CPU ranks, then auto's pick and every other built finalist run ``--steps`` steps with ``run_local``; the table
gives each one's predicted step (built program's estimate), its measured median step, and the pick's rank among
the measurements.
"""
import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar.testing import GPT, MLP, gpt_loss, regression_batches, token_batches  # noqa: E402

ADAMW = (torch.optim.AdamW, {"lr": 1e-4})


def _time_plan(name, model, cluster, batch, build: bool):
    t0 = time.perf_counter()
    first = fxpar.auto_plan(model, cluster, (batch, batch), gpt_loss, ADAMW)
    cold = time.perf_counter() - t0
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        got = fxpar.auto_plan(model, cluster, (batch, batch), gpt_loss, ADAMW)
        warm.append(time.perf_counter() - t0)
    s = got.search
    print(f"{name}: {len(s.priced)} candidates, {len(s.ranked)} undominated; cold {cold:.2f}s, warm "
          f"{min(warm):.2f}s (profile {s.seconds['profile']:.2f}s); first: {got[0].strategy()} "
          f"predicted {got[0].step_s * 1e3:.1f} ms, {got[0].peak_bytes / 2**30:.1f} GiB")
    if build:
        t0 = time.perf_counter()
        prog = fxpar.parallelize(model, cluster, (batch, batch), gpt_loss, ADAMW, strategy="auto")
        sec = prog.auto_search.seconds
        print(f"  parallelize(strategy='auto'): {time.perf_counter() - t0:.1f}s (search {sec['search']:.2f}s, "
              f"build {sec['build']:.1f}s), {len(prog.auto_search.built)} finalists built, chose {prog.strategy}")
    del first


def plan(args):
    with torch.device("meta"):
        gpt2 = GPT(vocab=50257, d=768, layers=12, heads=12, max_seq=1024)
    _time_plan("GPT-2 small, 8 x A100", gpt2, fxpar.ClusterSpec.preset("a100-80gb", gpus_per_node=8),
               torch.randint(0, 50257, (32, 1024), device="meta"), args.build)
    with torch.device("meta"):
        big = GPT(vocab=50257, d=4096, layers=32, heads=32, max_seq=2048)
    _time_plan("GPT 32 x 4096, 64 x A100", big, fxpar.ClusterSpec.preset("a100-80gb", nodes=8, gpus_per_node=8),
               torch.randint(0, 50257, (512, 2048), device="meta"), False)
    if args.megatron_1t:
        from tests.test_auto_megatron import ROWS
        from tests.test_auto_megatron import megatron as config
        model, x, cl, _ = config(ROWS[9])
        _time_plan("Megatron-LM 1T (128 x 25600, seq 2048, batch 3072), 3072 x A100", model, cl, x, False)


def _models():
    gpt = GPT(vocab=256, d=64, layers=4, heads=4, max_seq=64).double()
    yield "tied GPT (4 x 64, seq 64)", gpt, token_batches(8, batch=16, seq=64, vocab=256), gpt_loss
    mlp = MLP(d_in=256, hidden=512, d_out=16, layers=4).double()
    yield "MLP (4 x 512)", mlp, regression_batches(8, batch=64, d_in=256, d_out=16), torch.nn.functional.mse_loss


def measure(args):
    cluster = fxpar.ClusterSpec.local(2)
    for name, model, batches, loss in _models():
        batches = [tuple(t.double() if t.is_floating_point() else t for t in b) for b in batches[:args.steps]]
        prog = fxpar.parallelize(model, cluster, batches[0], loss, ADAMW, strategy="auto")
        rows = []
        for c in prog.auto_search.built:
            if c.full is None or c.full.get("note"):
                continue
            p = prog if c is prog.auto_search.chosen else fxpar.parallelize(model, cluster, batches[0], loss, ADAMW,
                                                                           strategy=c.strategy())
            res = p.run_local(batches)
            rows.append((c, c.full["step_s"], statistics.median(res.step_times[1:])))
        fastest = min(r[2] for r in rows)
        print(f"\n{name}, 2 ranks ({args.steps} steps, median of steps 2..):")
        print(f"  {'plan':<48} {'predicted':>10} {'measured':>10}  vs fastest")
        for c, pred, meas in sorted(rows, key=lambda r: r[1]):
            pick = " <- auto's pick" if c is prog.auto_search.chosen else ""
            print(f"  {str(c):<48} {pred * 1e3:>8.2f}ms {meas * 1e3:>8.2f}ms  {meas / fastest:>6.2f}x{pick}")


def megatron(args):
    """Each row of Megatron-LM's Table 1 (tests/test_auto_megatron.py): the cheap cost of Megatron's configuration
    (1F1B, and interleaved where 2 x p divides the layers) against the measured step time; ``--auto``: the plan
    ``fxpar.auto_plan`` ranks first, and its planning time."""
    from tests.test_auto_megatron import ROWS, measured_step_s
    from tests.test_auto_megatron import megatron as config
    for r in args.rows:
        row = ROWS[r - 1]
        model, x, cl, pins = config(row)
        meas = measured_step_s(row)
        for sched in ("1f1b", "interleaved") if row[5] > 1 else (None,):
            if sched == "interleaved" and row[3] % (2 * row[5]):
                continue
            p = {**pins, **({"schedule": sched} if sched else {})}
            t0 = time.perf_counter()
            c = fxpar.auto_plan(model, cl, (x, x), gpt_loss, ADAMW, strategy=fxpar.Strategy.auto(**p), prune=False)[0]
            print(f"row {r} ({row[0]}B, t={row[4]} p={row[5]} d={row[6] // (row[4] * row[5])}, {sched or '-'}): "
                  f"predicted {c.step_s:.2f} s, measured {meas:.2f} s, ratio {c.step_s / meas:.2f}, peak "
                  f"{c.peak_bytes / 2**30:.1f} GiB ({time.perf_counter() - t0:.1f} s)", flush=True)
        if args.auto:
            t0 = time.perf_counter()
            got = fxpar.auto_plan(model, cl, (x, x), gpt_loss, ADAMW)
            print(f"  auto: {got[0]} predicted {got[0].step_s:.2f} s, peak {got[0].peak_bytes / 2**30:.1f} GiB; "
                  f"{len(got.search.priced)} candidates in {time.perf_counter() - t0:.1f} s", flush=True)


def alpa(args):
    """Alpa's GPT points: the cheap cost of Alpa's plan and of auto's pick, in Alpa's TFLOPS per GPU."""
    from tests.test_auto_alpa import FIGURE7, MEASURED, MEASURED_STEP_S, config_pins, setup, tflops
    print(f"{'GPUs':>4} {'model':>5} {'batch':>5}  {'Alpa':>5} {'Megatron':>8}  {'plan':<28} {'fxpar':>5} "
          f"{'vs Alpa':>7}  auto's pick (fxpar TFLOPS, planning time)")
    for point in [MEASURED] + [p for p in FIGURE7 if p[0] in args.gpus]:
        n, name, B, alpa_tf, meg_tf, given = point
        model, x, cl, pins = setup(point)
        line = f"{n:>4} {name:>5} {B:>5}  {alpa_tf:>5.1f} {meg_tf:>8.1f}  "
        if given is None:
            line += f"{'(stages of unlike meshes)':<28} {'':>5} {'':>7}"
        else:
            extra = dict(zero=0, margin=1.0) if point is MEASURED else {}
            strategy = fxpar.Strategy.auto(**pins, **config_pins(point), **extra)
            note = ""
            try:
                c = fxpar.auto_plan(model, cl, (x, x), gpt_loss, ADAMW, prune=False, strategy=strategy)[0]
            except fxpar.StrategyError:        # over 90% of 16 GiB: priced on a copy of the device with 4x the memory
                big = replace(cl, device=replace(cl.device, memory_bytes=4 * cl.device.memory_bytes))
                c = fxpar.auto_plan(model, big, (x, x), gpt_loss, ADAMW, prune=False, strategy=strategy)[0]
                note = f" (over memory: {c.peak_bytes / 2**30:.1f} GiB predicted)"
            tf = tflops(point, c.step_s)
            line += f"{'dp=%d tp=%d pp=%d m=%d' % given:<28} {tf:>5.1f} {tf / alpa_tf:>7.2f}{note}"
            if point is MEASURED:
                line += f" (step {c.step_s:.3f} s, measured {MEASURED_STEP_S} s; peak {c.peak_bytes / 2**30:.1f} GiB)"
        if not args.no_auto:
            t0 = time.perf_counter()
            try:
                got = fxpar.auto_plan(model, cl, (x, x), gpt_loss, ADAMW, strategy=fxpar.Strategy.auto(**pins))
                mark = ""
            except fxpar.NoPlanFitsError:      # without a pipeline the search tries 1, 2, 4 and 8 microbatches only
                many = tuple(2**k for k in range(4, B.bit_length()))
                got, mark = fxpar.auto_plan(model, cl, (x, x), gpt_loss, ADAMW, strategy=fxpar.Strategy.auto(
                    **pins, microbatches=many)), " [microbatches 16.. pinned]"
            line += (f"  {got[0]}: {tflops(point, got[0].step_s):.1f} ({len(got.search.priced)} candidates, "
                     f"{time.perf_counter() - t0:.1f} s){mark}")
        print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("plan", "measure", "megatron", "alpa"))
    ap.add_argument("--rows", type=int, nargs="+", default=list(range(1, 11)), help="megatron: Table 1's rows")
    ap.add_argument("--auto", action="store_true", help="megatron: also fxpar.auto_plan's pick")
    ap.add_argument("--build", action="store_true", help="plan: also time parallelize(strategy='auto') on GPT-2")
    ap.add_argument("--megatron-1t", action="store_true", help="plan: also Megatron-LM 1T on 3,072 GPUs")
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64], help="alpa: Figure 7's points")
    ap.add_argument("--no-auto", action="store_true", help="alpa: only the cost of Alpa's plans")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    {"plan": plan, "measure": measure, "megatron": megatron, "alpa": alpa}[args.what](args)


if __name__ == "__main__":
    main()
