"""The automatic planner: how long it takes to plan, and how its pick compares with the plans it passed over.

    python benchmarks/bench_planner.py plan [--megatron-1t] [--build]    # planning time (fxpar.auto_plan), warm
    python benchmarks/bench_planner.py measure [--ranks 2 4] [--calibration DIR]   # auto's pick against 4 more, run
    python benchmarks/bench_planner.py megatron [--rows 1 2 ...] [--auto]   # Megatron-LM's Table 1 (SC'21)
    python benchmarks/bench_planner.py alpa [--gpus 8 16 ...] [--no-auto]   # Alpa's GPT points (OSDI'22)

``plan``: GPT-2 small (12 layers, h=768, seq 1024, global batch 32) on 8 A100s (one node), and a 32-layer h=4096
GPT (32 heads, seq 2048, global batch 512) on 64 A100s (8 nodes), both on the ``meta`` device: the first call (cold:
imports and the fake-tensor warm-up) and the best of three more (warm), the profile's share, the candidates priced,
and the plan ranked first. ``--build`` also times ``parallelize(strategy="auto")`` (the finalists built or probed), with the finalists past the first
estimated in forked workers (the default) and without (``Strategy.auto(workers=0)``), CPU here and in the workers;
``--megatron-1t`` adds Megatron-LM's 1T row (Table 1, row 10: 128 layers, h=25600, on 3,072 A100s), unpinned.

``alpa``: Alpa's GPT benchmark on p3.16xlarge machines (tests/test_auto_alpa.py: the published figures and where
they come from): for its measured 8-GPU point and each point of its Figure 7(a), fxpar's cheap cost of the plan Alpa
reports (where a dp x tp x pp mesh expresses it) and of ``fxpar.auto_plan``'s pick (fp16 and full recompute pinned,
as both systems ran), as TFLOPS per GPU the way Alpa counts them, beside Alpa's and Megatron-LM's published figures.

``measure``: for each world size of ``--ranks`` (2 and 4), ``ClusterSpec.calibrate(n)`` (once per run; with
``--calibration DIR`` kept in DIR/local-<n>.json and read from there by later runs), then for each model (the tied
GPT of ``fxpar.testing``, a Hugging Face Llama built from a ``LlamaConfig``, an MLP; float64)
``parallelize(strategy="auto")`` and the first ``--candidates`` (5) of its ranking that fit: auto's pick, then the
next by predicted step (the built finalists by their full estimate, then the rest by the cheap cost), each built
with ``strategy=c.strategy()``. All run on one set of ranks, ``--rounds`` (3) rounds of ``--steps`` (6) steps, round
by round in turn (each round starting one candidate later), after one uncounted warm-up run; a candidate's time is
the median of its steps after the first ``--warmup`` (1) of each run, all rounds together, a step the slowest
rank's. Each row gives the predicted step (the built program's ``estimate()``), the measured median, its ratio to
the fastest, and the 1-minute load over its runs (``--max-load``: wait before each run while the load is higher,
``--max-wait`` s at most; ``--nice``: the calibration and the ranks at that priority). A candidate that does not
build is listed, not measured.
"""
import argparse
import contextlib
import os
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
from fxpar._tracing import BatchLayout  # noqa: E402
from fxpar.auto.search import as_auto, choose, fixed_options, search  # noqa: E402
from fxpar.capture import shared_captures  # noqa: E402
from fxpar.testing import GPT, MLP, gpt_loss, regression_batches, token_batches  # noqa: E402

ADAMW = (torch.optim.AdamW, {"lr": 1e-4})


def _children_cpu() -> float:
    """CPU seconds of this process's ended children (the planner's forked workers)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


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
        for workers in (None, 0):      # finalists past the first in forked workers (one per CPU), then none
            t0, c0, k0 = time.perf_counter(), time.process_time(), _children_cpu()
            prog = fxpar.parallelize(model, cluster, (batch, batch), gpt_loss, ADAMW,
                                     strategy=fxpar.Strategy.auto(workers=workers))
            found = prog.auto_search
            sec, probed = found.seconds, sum("probe" in c.full for c in found.built)
            print(f"  parallelize(strategy=Strategy.auto(workers={workers})): {time.perf_counter() - t0:.1f}s "
                  f"({time.process_time() - c0:.1f}s CPU here, {_children_cpu() - k0:.1f}s in "
                  f"{sec.get('workers', 0)} workers; search {sec['search']:.2f}s, finalists {sec['build']:.1f}s: "
                  f"{len(found.built) - probed} built, {probed} probed, {len(found.skipped)} not built), chose "
                  f"{prog.strategy}; load {os.getloadavg()[0]:.1f}")
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


def _models(steps: int):
    """The models ``measure`` runs: (name, model, ``steps`` global batches, loss), float64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fxpar.testing.hf import CausalLM, lm_loss
    gpt = GPT(vocab=256, d=64, layers=4, heads=4, max_seq=64).double()
    yield "tied GPT (4 x 64, seq 64, batch 16)", gpt, token_batches(steps, batch=16, seq=64, vocab=256), gpt_loss
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, use_cache=False,
                      attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    llama = CausalLM(LlamaForCausalLM(cfg)).double()
    yield "HF Llama (4 x 64, seq 64, batch 16)", llama, token_batches(steps, batch=16, seq=64, vocab=256), lm_loss
    mlp = MLP(d_in=256, hidden=512, d_out=16, layers=4).double()
    yield "MLP (4 x 512, batch 64)", mlp, regression_batches(steps, batch=64, d_in=256, d_out=16), \
        torch.nn.functional.mse_loss


@contextlib.contextmanager
def _niced(nice: int | None):
    """This process (and the ranks it spawns meanwhile) at scheduling priority ``nice``; ``None``: as it is."""
    old = os.getpriority(os.PRIO_PROCESS, 0)
    if nice is not None:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, old)


def _calibrated(n: int, cache_dir: str | None, memo: dict, nice: int | None) -> "fxpar.ClusterSpec":
    """``ClusterSpec.calibrate(n)``, once per run (and, with ``--calibration DIR``, read from DIR/local-<n>.json
    when a run wrote it there)."""
    if n in memo:
        return memo[n]
    path = Path(cache_dir) / f"local-{n}.json" if cache_dir else None
    if path is not None and path.exists():
        memo[n] = fxpar.ClusterSpec.from_json(str(path))
    else:
        t0 = time.perf_counter()
        with _niced(nice):
            memo[n] = fxpar.ClusterSpec.calibrate(n)
        print(f"calibrated {n} ranks in {time.perf_counter() - t0:.0f}s (load {os.getloadavg()[0]:.1f})", flush=True)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            memo[n].to_json(str(path))
    d = memo[n].device
    print(f"{n} ranks: core_share {d.core_share:.3f} on {d.host_cores or '?'} cores (processor sharing where the ranks "
          "outnumber them)", flush=True)
    return memo[n]


def _auto(model, cluster, batch, loss) -> tuple:
    """``parallelize(strategy="auto")``'s search and choice (fxpar/api.py), keeping every finalist's program:
    (the search, strategy text -> program)."""
    built = {}

    def build(strategy):
        built[str(strategy)] = fxpar.parallelize(model, cluster, batch, loss, ADAMW, strategy=strategy)
        return built[str(strategy)]
    found = search(model, cluster, BatchLayout.of(batch, loss).flatten(batch, "batch"), loss, ADAMW, as_auto("auto"))
    with shared_captures():
        choose(found, build)
    return found, built


def _measured_set(s, n: int) -> tuple:
    """(auto's pick and the next ``n - 1`` fitting candidates of its ranking ``s``, what was passed over and why)."""
    picked, skipped = [s.chosen], []
    for c in s.ranked:
        if len(picked) == n:
            break
        if c is s.chosen:
            continue
        if not c.fits:
            skipped.append((c, (c.full or {}).get("note") or "predicted over memory"))
            continue
        picked.append(c)
    return picked, skipped


def _wait_for_load(limit: float | None, max_wait_s: float) -> None:
    """Sleep while this machine's 1-minute load is over ``limit`` (at most ``max_wait_s``)."""
    t0 = time.perf_counter()
    while limit is not None and os.getloadavg()[0] > limit and time.perf_counter() - t0 < max_wait_s:
        time.sleep(5)


def measure(args):
    """Auto's pick and the next candidates of its ranking, run for real on a calibrated cluster, round by round."""
    memo: dict = {}
    for n in args.ranks:
        cluster = _calibrated(n, args.calibration, memo, args.nice)
        for name, model, batches, loss in _models(args.steps):
            batches = [tuple(t.double() if t.is_floating_point() else t for t in b) for b in batches]
            if args.only and not any(k.lower() in name.lower() for k in args.only):
                continue
            s, built = _auto(model, cluster, batches[0], loss)
            cands, skipped = _measured_set(s, args.candidates)
            progs = []
            for c in cands:
                st = c.strategy(fixed_options(s.auto))
                try:
                    p = built.get(str(st)) or fxpar.parallelize(model, cluster, batches[0], loss, ADAMW, strategy=st)
                    progs.append((c, p, p.estimate().step_time_s))
                except Exception as e:  # noqa: BLE001 - a candidate that does not build is reported, not measured
                    skipped.append((c, f"not built: {type(e).__name__}: {str(e)[:120]}"))
            times = {id(c): [] for c, _, _ in progs}
            loads = {id(c): [] for c, _, _ in progs}
            with _niced(args.nice):             # the ranks inherit the priority; the builds above ran without it
                lc = fxpar.LocalCluster(n)
            try:
                progs[0][1].run_local(batches[:2], cluster=lc)      # the ranks' first run (imports): not counted
                for r in range(args.rounds):        # candidates alternate, each round from the next, so a change
                    for c, p, _ in progs[r % len(progs):] + progs[:r % len(progs)]:     # of load hits all alike
                        _wait_for_load(args.max_load, args.max_wait)
                        loads[id(c)].append(os.getloadavg()[0])
                        res = p.run_local(batches, cluster=lc)
                        times[id(c)] += res.step_times[args.warmup:]
            finally:
                lc.close()
            med = {k: statistics.median(v) for k, v in times.items()}
            fastest = min(med.values())
            pick_ratio = med[id(s.chosen)] / fastest
            print(f"\n{name}, {n} ranks ({args.rounds} rounds x {args.steps} steps, median of steps "
                  f"{args.warmup + 1}.., step = slowest rank): auto's pick {pick_ratio:.2f}x the fastest", flush=True)
            print(f"  {'plan':<58} {'predicted':>10} {'measured':>10} {'/fastest':>8} {'load':>10}")
            for c, p, pred in progs:
                tag = " <- pick" if c is s.chosen else ""
                ld = loads[id(c)]
                print(f"  {str(c)[:58]:<58} {pred * 1e3:>8.2f}ms {med[id(c)] * 1e3:>8.2f}ms "
                      f"{med[id(c)] / fastest:>7.2f}x {min(ld):>4.1f}-{max(ld):<4.1f}{tag}", flush=True)
            for c, why in skipped:
                print(f"  not measured: {c}: {why}")


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
    ap.add_argument("--steps", type=int, default=6, help="measure: steps per run")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="measure: world sizes")
    ap.add_argument("--rounds", type=int, default=3, help="measure: runs of every candidate, alternating")
    ap.add_argument("--warmup", type=int, default=1, help="measure: steps of each run not counted")
    ap.add_argument("--candidates", type=int, default=5, help="measure: auto's pick and the next ones run")
    ap.add_argument("--calibration", help="measure: a folder for ClusterSpec.calibrate(n)'s result, local-<n>.json")
    ap.add_argument("--max-load", type=float, help="measure: before each run, wait while the 1-minute load is over it")
    ap.add_argument("--max-wait", type=float, default=120, help="measure: seconds --max-load waits at most")
    ap.add_argument("--nice", type=int, help="measure: the calibration and the ranks at this priority (as root, a "
                    "negative value favours them over other work on the cores)")
    ap.add_argument("--only", nargs="+", help="measure: models whose name contains one of these (gpt, llama, mlp)")
    args = ap.parse_args()
    {"plan": plan, "measure": measure, "megatron": megatron, "alpa": alpa}[args.what](args)


if __name__ == "__main__":
    main()
