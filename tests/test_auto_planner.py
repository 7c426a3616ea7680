"""The automatic planner (``strategy="auto"``, ``Strategy.auto``, ``fxpar.auto_plan``): search quality against
enumeration under the same cost model, the plan it picks trains like one process, it never picks a plan predicted
to exceed memory, and its errors name what rules a choice out."""
from __future__ import annotations

import dataclasses
import random
import re
import sys
from pathlib import Path

import pytest
import torch

from cost_models.compute import TF32_SHARE, fp32_share, node_time, op_cost
import fxpar
import fxpar.api as api_mod
import fxpar.capture as capture_mod
from fxpar.auto.profile import profile_model
from fxpar.auto.search import as_auto, finalists, fixed_options, search
from fxpar.auto.space import SCHEDULES, _Pricer, schedule_shape
from fxpar.optim import resolve_optimizer
from fxpar.schedule import ScheduleError, simulate
from fxpar.schedule.registry import get_schedule
from fxpar.testing import GPT, gpt_loss, max_abs_diff, reference_training, tiny_gpt, token_batches

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_planner import _models  # noqa: E402  (the models its measure subcommand runs)

ADAMW = (torch.optim.AdamW, {"lr": 1e-2})
TOL = 1e-10


def _small_memory(world: int, kib: float) -> fxpar.ClusterSpec:
    """``world`` CPU ranks whose devices hold ``kib`` KiB."""
    cl = fxpar.ClusterSpec.local(world)
    return dataclasses.replace(cl, device=dataclasses.replace(cl.device, memory_bytes=int(kib * 1024)))


def _gpt2_small_meta():
    with torch.device("meta"):
        model = GPT(vocab=50257, d=768, layers=12, heads=12, max_seq=1024)
    return model, torch.randint(0, 50257, (32, 1024), device="meta")


# Programs built with one strategy alone (tiny_gpt, 2 ranks, token_batches(1)[0], AdamW), by strategy: the tests
# that compare the search's builds with such a program share it. Only reads follow.
_ALONE: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _shared_alone_builds():
    yield
    _ALONE.clear()


def _alone(strategy: fxpar.Strategy):
    key = repr(strategy)
    if key not in _ALONE:
        _ALONE[key] = fxpar.parallelize(tiny_gpt(), 2, token_batches(1)[0], gpt_loss, ADAMW, strategy=strategy)
    return _ALONE[key]


@pytest.mark.structure
def test_allow_pins_and_margin_are_checked():
    model, batches = tiny_gpt(), token_batches(1)
    with pytest.raises(fxpar.StrategyError, match="allow entry 'lossy'.*known: 'compression'.*'asynchronous'"):
        fxpar.auto_plan(model, 2, batches[0], gpt_loss, ADAMW, strategy=fxpar.Strategy.auto(allow=("lossy",)))
    with pytest.raises(fxpar.StrategyError, match="margin"):
        fxpar.Strategy.auto(margin=1.5)
    with pytest.raises(fxpar.StrategyError, match="did you mean 'bucket_cap_mb'"):
        fxpar.Strategy.auto(bucket_cap_mb2=50)
    auto = fxpar.Strategy.auto(tp=2, zero=(0, 1), bucket_cap_mb=50)
    got = fxpar.auto_plan(model, 2, batches[0], gpt_loss, ADAMW, strategy=auto, prune=False)
    assert {c.tp for c in got} == {2} and {c.zero for c in got} == {0}        # ZeRO is not composed with tp
    assert all(c.strategy(fixed_options(auto)).bucket_cap_mb == 50 for c in got)


@pytest.mark.structure
def test_a_pin_the_world_or_the_model_rules_out_names_both():
    model, batches = tiny_gpt(), token_batches(1)          # 2 layers, 2 heads
    plan = lambda world, **pins: fxpar.auto_plan(model, world, batches[0], gpt_loss, ADAMW,   # noqa: E731
                                                  strategy=fxpar.Strategy.auto(**pins))
    with pytest.raises(fxpar.StrategyError, match="tp=3 does not divide the ClusterSpec's world size 4"):
        plan(4, tp=3)
    with pytest.raises(fxpar.StrategyError, match="tp=4 does not divide GPT's 2 attention heads"):
        plan(4, tp=4)
    with pytest.raises(fxpar.StrategyError, match=r"pp=4 does not divide GPT's 2 layers \(blocks\)"):
        plan(4, pp=4)


@pytest.mark.cost
def test_pruning_keeps_the_enumerated_optimum_of_the_cheap_cost():
    """On GPT-2 small at 8 A100s (hundreds of candidates), the undominated ranking starts with the candidate an
    exhaustive sort of every fitting candidate puts first, and the ranking is exactly the Pareto front."""
    model, x = _gpt2_small_meta()
    cl = fxpar.ClusterSpec.preset("a100-80gb", gpus_per_node=8)
    pruned = fxpar.auto_plan(model, cl, (x, x), gpt_loss, ADAMW)
    full = fxpar.auto_plan(model, cl, (x, x), gpt_loss, ADAMW, prune=False)
    assert len(full) > 100 > len(pruned) > 0
    assert str(pruned[0]) == str(full[0])
    assert (pruned[0].step_s, pruned[0].peak_bytes) == min((c.step_s, c.peak_bytes) for c in full)
    front = [c for c in full if not any((o.step_s <= c.step_s and o.peak_bytes < c.peak_bytes) or
                                        (o.step_s < c.step_s and o.peak_bytes <= c.peak_bytes) for o in full)]
    assert {str(c) for c in pruned} == {str(c) for c in front}


@pytest.mark.slow
@pytest.mark.cost
def test_search_returns_the_enumerated_optimum_of_the_built_programs():
    """Every candidate of a small space built and estimated in full: parallelize(strategy=Strategy.auto(...))
    returns the one with the least predicted step time (ties: memory), having built fewer. The space holds
    ByteScheduler beside FIFO buckets (dp=2, one microbatch)."""
    model, batches = tiny_gpt(), token_batches(1)
    auto = fxpar.Strategy.auto(recompute="none", zero=0, microbatches=(1, 2), schedule="1f1b")
    space = fxpar.auto_plan(model, 2, batches[0], gpt_loss, ADAMW, strategy=auto, prune=False)
    assert len(space) == 8 and sum(c.comm_schedule == "bytescheduler" for c in space) == 1
    built = {}
    for c in space:
        est = _alone(c.strategy()).estimate()
        built[str(c)] = (est.step_time_s, max(r.peak_memory_bytes for r in est.ranks))
    best = min(built, key=built.get)
    prog = fxpar.parallelize(model, 2, batches[0], gpt_loss, ADAMW, strategy=auto)
    assert str(prog.auto_search.chosen) == best, (best, built)
    assert prog.estimate().step_time_s == pytest.approx(built[best][0], rel=1e-9)
    assert len(prog.auto_search.built) < len(space)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("world", [2, 4])
def test_the_plan_auto_picks_trains_like_one_process(clusters, world):
    model, batches = tiny_gpt(), token_batches(3)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(world), batches[0], gpt_loss, ADAMW, strategy="auto")
    assert prog.auto_search.chosen is not None and prog.world_size == world
    text = prog.explain()
    assert "automatic plan" in text and "chosen: " + str(prog.strategy) in text and "why they lost" in text
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, ADAMW)
    res = prog.run_local(batches, cluster=clusters.get(world))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL


@pytest.mark.slow
@pytest.mark.cost
def test_never_predicted_to_exceed_memory_where_plain_dp_does_not_fit():
    model, batches = tiny_gpt(), token_batches(1)
    cl = _small_memory(2, 300)                 # 270 KiB usable per device at the default margin
    dp = fxpar.parallelize(model, cl, batches[0], gpt_loss, ADAMW, strategy=fxpar.Strategy(dp=2)).estimate()
    assert max(r.peak_memory_bytes for r in dp.ranks) > 0.9 * cl.device.memory_bytes
    prog = fxpar.parallelize(model, cl, batches[0], gpt_loss, ADAMW, strategy="auto")
    assert max(r.peak_memory_bytes for r in prog.estimate().ranks) <= 0.9 * cl.device.memory_bytes
    assert all(c.full["peak_bytes"] > 0.9 * cl.device.memory_bytes for c in prog.auto_search.built if not c.fits
               and c.full["note"].startswith("over memory"))


@pytest.mark.structure
def test_no_plan_fits_names_the_smallest_memory_and_its_plan():
    model, batches = tiny_gpt(), token_batches(1)
    with pytest.raises(fxpar.NoPlanFitsError, match=r"smallest predicted peak is .* by Strategy\(.*would fit "
                                                    r"devices of"):
        fxpar.auto_plan(model, _small_memory(2, 20), batches[0], gpt_loss, ADAMW)


@pytest.mark.structure
def test_finalists_are_the_best_of_each_family_with_both_tp_modes():
    model, batches = tiny_gpt(), token_batches(1)
    found = fxpar.auto_plan(model, 2, batches[0], gpt_loss, ADAMW, strategy=fxpar.Strategy.auto(finalists=3)).search
    first, rest = finalists(found)
    fams = list(dict.fromkeys(c.family for c in first))
    assert len(fams) == 3
    for fam in fams:
        best = min((c for c in found.fitting if c.family == fam), key=lambda c: c.step_s)
        assert any(c.step_s == best.step_s for c in first if c.family == fam)
    for c in first:
        if c.tp > 1:
            assert {x.sharding for x in first if x.family == c.family} == {"megatron", "auto"}
    model, x = _gpt2_small_meta()            # bf16 and fp32 points of a tp family: only the fastest, in both modes
    first, _ = finalists(fxpar.auto_plan(model, fxpar.ClusterSpec.preset("a100-80gb", gpus_per_node=8), (x, x),
                                         gpt_loss, ADAMW).search)
    for fam in {c.family for c in first}:
        got = [c for c in first if c.family == fam]
        assert len({str(c).replace("sharding=auto, ", "sharding=megatron, ") for c in got}) == 1
        assert len(got) == (2 if got[0].tp > 1 else 1), [str(c) for c in got]


def _traces(monkeypatch) -> list:
    """The stage captures traced (not copied) from here on, as ``(stage, grad_scale)``."""
    got, trace = [], capture_mod._capture_training_step

    def counted(*a, **k):
        got.append((k.get("stage"), k.get("grad_scale")))
        return trace(*a, **k)
    monkeypatch.setattr(capture_mod, "_capture_training_step", counted)
    return got


def _printout(prog) -> tuple:
    """What a built program is: its plan (the search timings in its notes left out), every rank's graphs, its
    estimate and the loss's classes."""
    plan = re.sub(r"searched in [0-9.e+-]+ s", "searched in T s", prog.plan.to_json())
    est = prog.estimate()
    return (plan, [{k: g.code for k, g in prog.graphs(r).items()} for r in range(prog.cluster.world_size)],
            est.step_time_s, [(r.peak_memory_bytes, r.comm_bytes) for r in est.ranks], prog.loss.n_classes)


@pytest.mark.structure
def test_finalists_on_one_microbatch_share_its_capture_and_build_what_their_own_capture_builds(monkeypatch):
    """A tp point's two modes are captured once; each finalist's program, estimate and plan are those of
    ``parallelize`` with its strategy alone."""
    model, batches = tiny_gpt(), token_batches(1)
    traced, programs, choose = _traces(monkeypatch), {}, api_mod.choose

    def recording(found, build, model=None, workers=0):   # the whole model's builds (a probe's would pass model=),
        # all in this process, where the traces are counted and the programs kept (not in forked workers)
        return choose(found, lambda s, **cut: build(s, **cut) if cut else programs.setdefault(str(s), build(s)),
                      model=model, workers=0)
    monkeypatch.setattr(api_mod, "choose", recording)
    prog = fxpar.parallelize(model, 2, batches[0], gpt_loss, ADAMW, strategy="auto")
    built = prog.auto_search.built
    whole = [c for c in built if c.pp == 1]
    assert any(c.sharding == "megatron" for c in whole) and any(c.sharding == "auto" for c in whole)
    shapes = {(c.dp, c.microbatches) for c in whole}
    assert len([t for t in traced if t[0] is None]) == len(shapes) < len(whole)
    for c in built:
        alone = _alone(c.strategy())
        est = alone.estimate()
        assert c.full["step_s"] == est.step_time_s
        assert c.full["peak_bytes"] == max(r.peak_memory_bytes for r in est.ranks)
        assert _printout(programs[str(alone.strategy)]) == _printout(alone)


class _Coin(torch.nn.Module):
    """A forward that decides in Python (a capture of it may differ from the next)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * (2.0 if random.random() < 2 else 1.0)


@pytest.mark.structure
def test_a_shared_capture_is_a_copy_and_a_python_random_forward_is_traced_each_time(monkeypatch):
    spec = resolve_optimizer(ADAMW)
    batch = (torch.randn(8, 4), torch.randn(8, 4))
    mse = torch.nn.functional.mse_loss
    traced = _traces(monkeypatch)
    plain = torch.nn.Linear(4, 4)
    with capture_mod.shared_captures() as shared:
        a = capture_mod.capture_training_step(plain, batch, mse, spec, grad_scale=0.5)
        b = capture_mod.capture_training_step(plain, batch, mse, spec, grad_scale=0.5)
        c = capture_mod.capture_training_step(plain, (batch[0] + 1, batch[1]), mse, spec, grad_scale=0.5)
        d = capture_mod.capture_training_step(plain, batch, mse, spec, grad_scale=0.25)
    assert len(traced) == 3 and shared.hits == 1          # b is a's copy; other values, another scale: traced
    assert b.gm is not a.gm and b.gm.code == a.gm.code and b.signature == a.signature
    assert c.gm.code == a.gm.code and d.gm.code != a.gm.code
    traced.clear()
    coin = _Coin()
    with capture_mod.shared_captures() as shared, pytest.warns(UserWarning, match="Python-level randomness"):
        capture_mod.capture_training_step(coin, batch, mse, spec)
        capture_mod.capture_training_step(coin, batch, mse, spec)
    assert len(traced) == 2 and shared.hits == 0


@pytest.mark.structure
def test_math_changing_methods_only_when_allowed():
    model, batches = tiny_gpt(), token_batches(1)
    plain = fxpar.auto_plan(model, 2, batches[0], gpt_loss, ADAMW, prune=False)
    assert not any(c.grad_sync or c.schedule == "2bw" for c in plain)
    allowed = fxpar.auto_plan(model, 2, batches[0], gpt_loss, ADAMW, prune=False,
                              strategy=fxpar.Strategy.auto(allow=("compression", "asynchronous")))
    assert any(c.grad_sync == "bf16" for c in allowed) and any(c.schedule == "2bw" for c in allowed)


@pytest.mark.cost
def test_a_heterogeneous_cluster_is_planned_for_its_slowest_and_smallest_device():
    """Each rank's own device, not rank 0's: the candidates are priced as on a cluster of the slowest device, the
    memory budget is the smallest device's, whichever rank holds them; check_fits reads the smallest too."""
    model, batches = tiny_gpt(), token_batches(1)
    fast = fxpar.DeviceSpec("cpu", "fast", 64 * 2**20, 100e9, 20e9, op_overhead_s=8e-6)
    slow = fxpar.DeviceSpec("cpu", "slow", 8 * 2**20, 25e9, 5e9, op_overhead_s=16e-6)
    uniform = dataclasses.replace(fxpar.ClusterSpec.local(4), device=slow)
    ref = fxpar.auto_plan(model, uniform, batches[0], gpt_loss, ADAMW, prune=False)
    want = [(str(c), c.step_s, c.peak_bytes) for c in ref]
    assert ref.search.budget_bytes == 0.9 * slow.memory_bytes
    for order in ([fast, slow, fast, fast], [slow, fast, fast, fast]):
        cl = fxpar.ClusterSpec.heterogeneous(order)
        got = fxpar.auto_plan(model, cl, batches[0], gpt_loss, ADAMW, prune=False)
        assert got.search.budget_bytes == ref.search.budget_bytes
        assert [(str(c), c.step_s, c.peak_bytes) for c in got] == want
        assert "(smallest: slow) (8.0 MiB" in got.search.explain()
        with pytest.raises(fxpar.ClusterSpecError, match="a slow has 8388608 bytes"):
            cl.check_fits(9 * 2**20, "parameter 'w'")
    stragglers = fxpar.ClusterSpec.local(2, slowdown=[(1, 2.0)])       # rank 1 twice as slow: priced as rank 1
    got = fxpar.auto_plan(model, stragglers, batches[0], gpt_loss, ADAMW, prune=False)
    even = fxpar.auto_plan(model, 2, batches[0], gpt_loss, ADAMW, prune=False)
    slowed = {str(c): c.step_s for c in got}
    assert set(slowed) == {str(c) for c in even}
    assert all(slowed[str(c)] > c.step_s for c in even)


@pytest.mark.structure
def test_the_closed_form_pipeline_shapes_are_the_dry_runs():
    """The searched schedules' makespan and microbatches in flight by their closed forms equal their generators' own
    dry runs (forward 1, backward 2) wherever the generator runs, and are None wherever it refuses."""
    checked = 0
    for name in SCHEDULES:
        for p, m in [(p, m) for p in range(2, 6) for m in range(1, 3 * p + 2)] + [(8, 24), (16, 32)]:
            got = schedule_shape(name, p, m)
            try:
                sched = get_schedule(name, p, m)
            except ScheduleError:
                assert got is None, (name, p, m)
                continue
            sim = simulate(sched)
            assert got == (sched.n_stages, sim.makespan / 3, max(sim.peak_activations_per_rank.values())), (name, p, m)
            checked += 1
    assert checked > 60


# ClusterSpec.calibrate(n) on the 2-core machine of docs/benchmarks.md's "Automatic planner" measurements, the
# calibrations that table ran on, rounded: 2 ranks at load 5, 4 ranks at load 9 (four ranks on two shared cores)
CALIBRATED = {
    2: ({"peak_flops": 8.35e10, "mem_bandwidth": 1.53e10, "op_overhead_s": 6.71e-6, "action_overhead_s": 1.05e-4,
         "cold_op_s": 3.36e-6, "collective_issue_s": 2.91e-4, "collective_slots": 1, "comm_cpu_s": 4.74e-4,
         "comm_cpu_per_byte": 0.0, "late_recv_s": 3.29e-3, "index_row_s": 6.42e-8, "core_share": 1.0,
         "efficiency": {"attention": 0.64, "conv": 1.0, "elementwise": 1.0, "matmul": 1.0, "matmul_narrow": 0.0097,
                        "memory": 1.0, "norm": 0.071, "softmax": 0.05, "transcendental": 0.013,
                        "transcendental_backward": 0.0079}}, (8.65e8, 9.69e-4)),
    4: ({"peak_flops": 1.22e10, "mem_bandwidth": 2.31e9, "op_overhead_s": 2.08e-5, "action_overhead_s": 3.17e-4,
         "cold_op_s": 1.44e-5, "collective_issue_s": 1.81e-4, "collective_slots": 2, "comm_cpu_s": 1.32e-3,
         "comm_cpu_per_byte": 2.16e-10, "late_recv_s": 7.47e-4, "index_row_s": 4.85e-7, "core_share": 0.172,
         "efficiency": {"attention": 0.62, "conv": 1.0, "elementwise": 1.0, "matmul": 1.0, "matmul_narrow": 0.02,
                        "memory": 1.0, "norm": 0.062, "softmax": 0.049, "transcendental": 0.028,
                        "transcendental_backward": 0.017}}, (6.76e8, 1.27e-3)),
}
# (model, ranks) -> (the finalists, the cheap ranking's first three) on those profiles
MEASURED_CANDIDATES = {
    ("tied GPT", 2): (["dp=2, m=1", "pp=2 (zb1p), m=2", "pp=2 (1f1b), m=2"],
                      ["dp=2, m=1", "dp=2, m=1, zero=3", "dp=2, m=1, recompute=selective"]),
    ("tied GPT", 4): (["dp=4, m=1", "dp=2 x pp=2 (zb1p), m=2", "pp=4 (zb1p), m=4"],
                      ["dp=4, m=1", "dp=4, m=1, zero=3", "dp=4, m=1, recompute=selective"]),
    ("HF Llama", 2): (["dp=2, m=1", "pp=2 (zb1p), m=2", "pp=2 (1f1b), m=2"],
                      ["dp=2, m=1", "dp=2, m=1, zero=3", "dp=2, m=1, recompute=selective"]),
    ("HF Llama", 4): (["dp=4, m=1, zero=3", "dp=2 x pp=2 (zb1p), m=2", "pp=4 (zb1p), m=4"],
                      ["dp=4, m=1, zero=3", "dp=4, m=1, zero=3, recompute=selective",
                       "dp=4, m=2, zero=2, recompute=selective"]),
    ("MLP", 2): (["pp=2 (zb1p), m=2", "tp=2, sharding=megatron, m=1", "tp=2, sharding=auto, m=1",
                  "dp=2, m=1, zero=2, bucket=5MiB"],
                 ["pp=2 (zb1p), m=2", "pp=2 (zb1p), m=4", "pp=2 (zb1p), m=8"]),
    ("MLP", 4): (["dp=2 x pp=2 (zb1p), m=2, zero=2", "dp=4, m=1, zero=2, bucket=5MiB",
                  "tp=2 x pp=2 (zb1p), sharding=megatron, m=2", "tp=2 x pp=2 (zb1p), sharding=auto, m=2"],
                 ["dp=2 x pp=2 (zb1p), m=2, zero=2", "tp=2 x pp=2 (zb1p), sharding=megatron, m=2",
                  "pp=4 (zb1p), m=4"]),
}


def _calibrated_local(world: int) -> fxpar.ClusterSpec:
    dev, (bw, lat) = CALIBRATED[world]
    cl = fxpar.ClusterSpec.local(world)
    return dataclasses.replace(cl, device=dataclasses.replace(cl.device, **dev),
                               intra_node=dataclasses.replace(cl.intra_node, bandwidth=bw, latency=lat))


@pytest.mark.slow
@pytest.mark.cost
def test_the_candidates_measured_on_this_machine_and_their_order():
    """On the calibrations the measurements in docs/benchmarks.md ran on (fixed, rounded), for the models of
    ``benchmarks/bench_planner.py measure`` (the tied GPT, an HF Llama from a config, an MLP) at 2 and 4 ranks: the
    finalists auto builds (the fastest candidate of each of the three fastest families; a tp family's under both
    modes) and the first three of the cheap ranking, in order."""
    got = {}
    for name, model, batches, loss in _models(1):
        prof = profile_model(model, batches[0], loss)       # one profile for both world sizes
        for world in (2, 4):
            found = search(model, _calibrated_local(world), batches[0], loss, ADAMW, as_auto("auto"), profile=prof)
            got[name.split(" (")[0], world] = ([str(c) for c in finalists(found)[0]],
                                               [str(c) for c in found.ranked[:3]])
    assert got == MEASURED_CANDIDATES


@pytest.mark.structure
@pytest.mark.parametrize("preset,plain", [("a100-80gb", 19.5 / 312), ("h100-80gb", 67 / 989), ("h100-pcie", 51 / 756),
                                          ("h200", 67 / 989), ("v100-32gb", 15.7 / 125)])
def test_a_float32_model_is_priced_at_the_gpus_float32_rate(preset, plain):
    """Torch runs float32 matmuls at the plain float32 rate unless TF32 is allowed; then at TF32's half of the 16-bit
    tensor-core peak, on GPUs that have TF32 (not V100). The planner prices a float32 model's candidates so."""
    dev = fxpar.ClusterSpec.preset(preset).device
    was = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert fp32_share(dev) == (plain if preset.startswith("v100") else TF32_SHARE)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        _plain_prices(dev, preset, plain)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


def _plain_prices(dev, preset, plain):
    """Under torch's default (no TF32): the planner's float32 devices and a built program's per-op price."""
    assert fp32_share(dev) == pytest.approx(plain)
    cl = fxpar.ClusterSpec.preset(preset, gpus_per_node=2)
    f32, bf16 = _Pricer(None, cl, 8, 1, 4), _Pricer(None, cl, 8, 1, 2)
    assert f32.devs_fp32[0].peak_flops == pytest.approx(dev.peak_flops * plain)
    assert bf16.devs_fp32[0].peak_flops == dev.peak_flops           # a 16-bit model's own dtype: the tensor cores
    # a built program's estimate prices each op by its dtype: a float32 matmul as above, a bf16 one at the peak
    a32 = torch.empty(256, 512, device="meta")
    c32 = op_cost(torch.ops.aten.mm.default, [a32, a32.t()], torch.empty(256, 256, device="meta"))
    a16 = a32.to(torch.bfloat16)
    c16 = op_cost(torch.ops.aten.mm.default, [a16, a16.t()], torch.empty(256, 256, device="meta", dtype=torch.bfloat16))
    slow = dataclasses.replace(dev, mem_bandwidth=1e30)       # the FLOP side of the roofline alone
    assert node_time(c32, slow) == pytest.approx(node_time(c16, slow) / plain)
    cpu = fxpar.ClusterSpec.local(2).device
    assert node_time(c32, cpu) == node_time(dataclasses.replace(c32, dtype=None), cpu)
    mine = dataclasses.replace(dev, name="my accelerator")          # a device the user describes: its own peak
    assert fp32_share(mine) == 1.0 and node_time(c32, mine) == node_time(dataclasses.replace(c32, dtype=None), mine)
