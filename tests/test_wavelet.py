"""Wavelet (Wang et al., MLSys'21): tick-tock waves on data-parallel ranks, ``Strategy(dp=n, schedule="wavelet")``,
and over pipeline stages, ``Strategy(pp=p, schedule="wavelet")``.

Structure: the generator's order (the tock wave half a cycle behind the tick wave, one update per step; with pp > 1
the tock wave's stages in reverse rank order, its forward in the slot of the tick wave's backward on every rank);
the Strategy's defaults; the batch search. Numerics (float64, gloo ranks): both waves' gradients are summed before one
update, so training equals single-process training on the global batch to 1e-10, every parameter (pp = 1 and
pp = 2, 3); in the same run the tracker's measured peak per rank is the predicted one within 1%, and one wave's
timeline combined with itself half a cycle later (max over t of M(t) + M(t + T/2); with pp > 1 rank r's tick
timeline with rank pp-1-r's) is that prediction within 1%. Cost: under one memory budget
Wavelet fits a batch that plain dp does not.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fxpar
from fxpar.features.wavelet import largest_batch, wave_peak
from fxpar.schedule import ScheduleError, simulate, validate
from fxpar.schedule.wavelet import wavelet
from fxpar.testing import gpt_loss, max_abs_diff, reference_training, token_batches
from fxpar.testing.models import GPT

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
_RUNS: dict = {}
_RANK_PARAMS: dict = {}


def _gpt():
    """Four blocks, the head untied: a rank holding both chunks holds each parameter once."""
    torch.manual_seed(0)
    return GPT(vocab=64, d=32, layers=4, heads=2, tie_weights=False).double()


def _batches(n: int = 2, batch: int = 8):
    return token_batches(n, batch=batch, seq=16, vocab=64)


def _run(clusters, dp=2, pp=1, **options):
    """(program, result, reference) of 2 steps at dp x pp under Wavelet with the tracker on, once per session."""
    key = (dp, pp) + tuple(sorted(options.items()))
    if key not in _RUNS:
        batches = _batches()
        prog = fxpar.parallelize(_gpt(), fxpar.ClusterSpec.local(dp * pp), batches[0], gpt_loss, ADAMW,
                                 strategy=fxpar.Strategy(dp=dp, pp=pp, schedule="wavelet", **options))
        if pp > 1:                          # each rank's own copies of its stages, as torchrun's ranks train them
            _RANK_PARAMS[key] = clusters.get(dp * pp).run(_rank_params, [(prog, batches)] * (dp * pp))
        res = prog.run_local(batches, cluster=clusters.get(dp * pp), measure_memory=True)
        _RUNS[key] = (prog, res, reference_training(_gpt(), batches, gpt_loss, ADAMW))
    return _RUNS[key]


# ---- structure ----------------------------------------------------------------------------------------
@pytest.mark.structure
def test_the_tock_wave_runs_half_a_cycle_behind_the_tick_wave():
    s = wavelet(1, 2)
    assert s.format_lists().splitlines()[1] == "rank 0: F0.0 F1.0 B1.0 F0.1 B0.0 F1.1 B1.1 RG1 B0.1 RG0 STEP0 STEP1"
    validate(s)
    assert simulate(s).bubble_fraction == 0.0
    # four chunks, two microbatches per wave: each wave keeps its own order, the tock wave starts as the tick wave's
    # first backward does, and every chunk steps once, after both waves
    s = wavelet(1, 4, v=4)
    acts = [a.short() for a in s.actions[0]]
    tick = [a for a in acts if a[0] in "FB" and a.endswith((".0", ".1"))]
    tock = [a for a in acts if a[0] in "FB" and a.endswith((".2", ".3"))]
    cycle = lambda i: [f"F{c}.{i}" for c in range(4)] + [f"B{c}.{i}" for c in (3, 2, 1, 0)]   # noqa: E731
    assert tick == cycle(0) + cycle(1) and tock == cycle(2) + cycle(3)
    assert acts.index("F0.2") == acts.index("B3.0") + 1
    assert [a for a in acts if a.startswith("STEP")] == ["STEP0", "STEP1", "STEP2", "STEP3"] == acts[-4:]
    assert dict(s.stage_to_rank) == {c: (0,) for c in range(4)}


@pytest.mark.structure
def test_over_pipeline_ranks_the_tock_wave_runs_in_reverse():
    """pp > 1: the tick wave's stage s on rank s, the tock wave's on rank p-1-s; on every rank the tock wave's forward
    follows the tick wave's backward (the same slot, the tick's first), and its backward the tick's next forward."""
    s = wavelet(2, 2)
    assert s.format_lists().splitlines()[1:] == [
        "rank 0: F0.0 SF0.0>1 RB0.0<1 B0.0 RF1.1<1 F1.1 B1.1 SB1.1>1 RG0 RG1 STEP0 STEP1",
        "rank 1: RF1.0<0 F1.0 B1.0 SB1.0>0 F0.1 SF0.1>0 RB0.1<0 B0.1 RG0 RG1 STEP0 STEP1"]
    for p, m in ((4, 4), (3, 2)):
        s = wavelet(p, m)
        validate(s)
        simulate(s)                         # no deadlock
        k = m // 2
        assert dict(s.stage_to_rank) == {c: tuple(sorted({c, p - 1 - c})) for c in range(p)}
        for r in range(p):
            acts = [a.short() for a in s.actions[r] if a.kind.name in ("F", "B")]
            q = p - 1 - r
            want = [f"F{r}.0"]
            for j in range(k):              # tick B then tock F (one slot), tick F then tock B (the next)
                want += [f"B{r}.{j}", f"F{q}.{k + j}"] + ([f"F{r}.{j + 1}"] if j + 1 < k else []) + [f"B{q}.{k + j}"]
            assert acts == want, (p, r, acts)
            held = sorted({r, q})
            assert [a.short() for a in s.actions[r][-2 * len(held):]] == \
                [f"RG{c}" for c in held] + [f"STEP{c}" for c in held]
    with pytest.raises(ScheduleError, match=r"over p > 1 ranks the model is in p stages"):
        wavelet(2, 2, v=3)


@pytest.mark.structure
def test_the_strategy_gives_each_wave_a_microbatch():
    st = fxpar.Strategy(dp=2, schedule="wavelet")
    assert st.microbatches == 2 and st.wave_chunks == 2
    assert "schedule=wavelet" in str(st)
    assert fxpar.Strategy(dp=2, schedule="wavelet", microbatches=6, wave_chunks=3).microbatches == 6
    st = fxpar.Strategy(pp=2, schedule="wavelet")
    assert st.microbatches == 2 and st.wave_chunks is None
    with pytest.raises(fxpar.StrategyError, match=r"Strategy\(pp=2, wave_chunks=2\): with pp > 1 .* drop wave_chunks"):
        fxpar.Strategy(pp=2, schedule="wavelet", wave_chunks=2)


@pytest.mark.structure
def test_largest_batch_stops_at_the_first_that_does_not_fit():
    seen = []

    def peak(b):
        seen.append(b)
        return 100 + 10 * b
    assert largest_batch(peak, 200, [2, 4, 8, 16, 32]) == (8, 180)
    assert seen == [2, 4, 8, 16]
    assert largest_batch(peak, 100, [2, 4]) == (None, 120)


# ---- numerics and measured memory -----------------------------------------------------------------------
@pytest.mark.numerics
def test_wavelet_is_synchronous_training_on_both_waves_batch(clusters):
    """dp=2, one microbatch per wave, two chunks: the waves' gradients summed before one update per step."""
    prog, res, (ref_losses, ref_state) = _run(clusters)
    assert prog.plan.n_stages == 2 and prog.plan.stage_to_rank == [[0], [0]]
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
    est = prog.estimate()
    for r in range(2):
        pred, got = est.ranks[r].peak_memory_bytes, res.peak_memory_bytes[r]
        assert abs(got - pred) <= 0.01 * pred, (r, got, pred)
        waves = wave_peak(prog, r)          # one wave's timeline, combined with itself half a cycle later
        assert abs(waves.combined - pred) <= 0.01 * pred, (r, waves.combined, pred)
        assert waves.shared < waves.one_wave <= waves.combined
    text = prog.explain()
    assert "Wavelet (Wang et al., MLSys'21)" in text and "max over t of M(t) + M(t+T/2)" in text


@pytest.mark.slow
@pytest.mark.numerics
def test_two_microbatches_per_wave_over_four_chunks(clusters):
    prog, res, (ref_losses, ref_state) = _run(clusters, microbatches=4, wave_chunks=4)
    assert prog.plan.n_stages == 4
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
    est = prog.estimate()       # four chunks whose gradient sums have the same code: each keeps its own storages
    for r in range(2):
        pred, got = est.ranks[r].peak_memory_bytes, res.peak_memory_bytes[r]
        assert abs(got - pred) <= 0.01 * pred, (r, got, pred)


@pytest.mark.numerics
def test_wavelet_over_two_pipeline_ranks(clusters):
    """pp=2: the tick wave down (stage 0 on rank 0), the tock wave up (stage 0 on rank 1); each stage's two copies sum
    both waves' gradients before one update: synchronous training on the global batch, every rank's parameters."""
    prog, res, (ref_losses, ref_state) = _run(clusters, dp=1, pp=2)
    _check_pipelined(prog, res, ref_losses, ref_state, _RANK_PARAMS[(1, 2)])


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("dp,pp,m", [(2, 2, 4), (1, 3, 2)], ids=["dp2pp2", "pp3"])
def test_wavelet_over_pipeline_ranks_with_dp_and_a_middle_stage(clusters, dp, pp, m):
    """dp=2 x pp=2, two microbatches per wave; pp=3, whose middle stage runs both waves on one rank."""
    prog, res, (ref_losses, ref_state) = _run(clusters, dp=dp, pp=pp, microbatches=m)
    _check_pipelined(prog, res, ref_losses, ref_state, _RANK_PARAMS[(dp, pp, ("microbatches", m))])


def _rank_params(program, batches):
    """One rank's parameters of every stage it holds, after training on ``batches`` (run on each rank)."""
    runner = program.runner()
    for b in batches:
        runner.step(b)
    return {k: v.detach().clone() for ps in runner.executor.params.values() for k, v in ps.items()}


def _check_pipelined(prog, res, ref_losses, ref_state, ranks):
    pp = prog.plan.pp
    assert prog.plan.n_stages == pp and prog.plan.stage_to_rank == [sorted({s, pp - 1 - s}) for s in range(pp)]
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
    world = prog.plan.dp * pp
    for r, params in enumerate(ranks):                # every rank's copy of each stage it holds
        held = [k for s in range(pp) if r // prog.plan.width in prog.plan.stage_to_rank[s]
                for k in prog.plan.stage_params[s]]
        assert sorted(params) == sorted(held), r
        assert max(float((v - ref_state[k]).abs().max()) for k, v in params.items()) < 1e-10, r
    est = prog.estimate()
    for r in range(world):
        pred, got = est.ranks[r].peak_memory_bytes, res.peak_memory_bytes[r]
        assert abs(got - pred) <= 0.01 * pred, (r, got, pred)
        waves = wave_peak(prog, r)          # rank r's tick timeline with rank pp-1-r's half a cycle later
        assert abs(waves.combined - pred) <= 0.01 * pred, (r, waves.combined, pred)
        assert waves.one_wave < waves.combined
    assert "tock wave's on rank" in prog.explain()


# ---- the batch that fits ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.cost
def test_wavelet_fits_a_batch_plain_dp_does_not():
    """At one global batch the two waves together need less than plain dp's one step over the same batch: a budget
    between the two runs Wavelet and refuses nothing, and the run of the waves is refused when the budget is below
    their peak, naming both."""
    batch = _batches(1, batch=16)[0]

    def program(device_bytes, **strategy):
        cluster = fxpar.ClusterSpec.local(2)
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=device_bytes))
        return fxpar.parallelize(_gpt(), cluster, batch, gpt_loss, ADAMW, strategy=fxpar.Strategy(dp=2, **strategy))
    plain = program(2**30).estimate().ranks[0].peak_memory_bytes
    waves = program(2**30, schedule="wavelet")
    peak = waves.estimate().ranks[0].peak_memory_bytes
    assert peak < 0.9 * plain, (peak, plain)
    small = program(int(peak) - 1, schedule="wavelet")
    with pytest.raises(fxpar.StrategyError, match=r"the two waves do not fit: rank 0's combined peak is .* MiB .*"
                                                  r"against a budget of .* MiB"):
        small.run_local([batch])
