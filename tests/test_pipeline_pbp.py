"""Pipelined Backpropagation and PipeMare compute the math their papers define (DESIGN §6), checked against
:func:`fxpar.testing.async_reference.delayed_pipeline_reference`, float64 to 1e-10; with one stage each is SGD;
each stage holds one weight version (PipeDream holds p - s); the dry run has no bubble in steady state; a resumed
run is the run that never stopped, bitwise."""
from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.features.pipeline_delayed import lr_factor, spike_coefficients, velocity_decay
from fxpar.roles import GraphKind, Role
from fxpar.schedule import get_schedule, simulate, steady_state_bubble
from fxpar.testing import SkipNet, class_batches, max_abs_diff, reference_training
from fxpar.testing.async_reference import delayed_pipeline_reference, pipedream_reference

CE = torch.nn.functional.cross_entropy
SGD = (torch.optim.SGD, {"lr": 0.1})
SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
MARE = {"lr_warmup": 5, "discrepancy_correction": True}


def _program(model, batch, optimizer, **strategy):
    strategy = fxpar.Strategy(**strategy)
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(strategy.size), batch, CE, optimizer, strategy=strategy)


def _check(res, ref):
    ref_losses, ref_state = ref
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10


def _stage_bytes(model, prog) -> list:
    params = dict(model.named_parameters())
    return [sum(params[k].numel() * params[k].element_size() for k in sp.param_keys) for sp in prog.stages]


# ---- the schedule ---------------------------------------------------------------------------------------------
@pytest.mark.structure
@pytest.mark.parametrize("name", ["pipelined_bp", "pipemare"])
@pytest.mark.parametrize("p", [2, 4])
def test_one_version_per_stage_and_no_bubble_in_steady_state(name, p):
    """Every F and B uses the stage's newest version (B k at version k, after k updates); the dry run holds one version
    per stage (PipeDream: p - s); between each rank's first backward and last forward nothing idles, and the
    window's bubble is the one fill and drain, (p-1)/(M+p-1) over M microbatches (1F1B's per step: (p-1)/(m+p-1))."""
    m, n = 4, 3
    sched = get_schedule(name, p, m * n)
    for r, acts in sched.actions.items():
        steps = 0
        for a in acts:
            if a.kind.value == "STEP":
                steps += 1
                assert a.version == steps
            elif a.kind.value in ("F", "B"):
                assert a.version == steps, (r, a)
    sim = simulate(sched)
    assert sim.peak_versions == {s: 1 for s in range(p)}
    assert simulate(get_schedule("pipedream", p, m * n)).peak_versions == {s: p - s for s in range(p)}
    assert steady_state_bubble(sim) == 0.0
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m * n + p - 1))
    assert simulate(get_schedule("1f1b", p, m)).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.structure
def test_forward_saves_no_weights_and_backward_reads_them():
    """``passes.backward_weights``: the forward's saved outputs hold no parameter (nor a view of one); the backward
    reads each weight its input gradient needs as a ``backward_param`` input, and weight prediction turns the
    forward's parameter inputs into ``forward_param``."""
    model, batches = SkipNet().double(), class_batches(1)
    stash = _program(model, batches[0], SGD_M, pp=2, schedule="pipedream", microbatches=4)
    prog = _program(model, batches[0], SGD_M, pp=2, schedule="pipelined_bp", microbatches=4, correction="sc+lwp")
    for s in range(2):
        before, after = stash.stages[s].graphs, prog.stages[s].graphs
        n_saved = lambda sg: sum(r == Role.SAVED for r, _ in sg.outputs)       # noqa: E731
        read = [k for r, k in after[GraphKind.B].inputs if r == Role.BACKWARD_PARAM]
        assert read and all(k.endswith(".weight") for k in read)
        assert n_saved(after[GraphKind.F]) == n_saved(before[GraphKind.F]) - len(read)
        roles = {r for r, _ in after[GraphKind.F].inputs}
        assert (Role.FORWARD_PARAM in roles) == (s == 0) and (Role.PARAM in roles) == (s == 1)   # stage 1: D = 0
    assert [k for r, k in prog.stages[1].graphs[GraphKind.F].inputs if r == Role.PARAM] == ["out.weight", "out.bias"]


@pytest.mark.structure
@pytest.mark.parametrize("m", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("D", [0, 1, 3, 7])
def test_the_constants_keep_what_the_papers_choose_them_for(m, D):
    """Each constant against the property its paper chooses it for, where the delay D is in updates.

    Spike compensation (Kosson et al.): the late gradient's D missed momentum steps at once, b = 1 + m + ... +
    m^(D-1), the rest of its impulse as the undelayed one's from step D on, a m^j = m^(D+j): its total impulse is
    plain momentum's, 1/(1-m), and a steady gradient keeps its velocity (a + b(1-m) = 1); D = 0 is momentum SGD.
    PipeMare (Yang et al.): the warm-up starts stage s at lr/D and ends at lr after K updates, growing
    geometrically (the exponent linear in k); the velocity's decay gamma forgets all but a tenth over D updates."""
    a, b = spike_coefficients(m, D)
    assert b == pytest.approx(sum(m ** j for j in range(D)), rel=1e-12, abs=1e-15)
    assert all(a * m ** j == pytest.approx(m ** (D + j), rel=1e-12) for j in range(5))
    assert b + a / (1 - m) == pytest.approx(1 / (1 - m), rel=1e-12)
    assert a + b * (1 - m) == pytest.approx(1.0, rel=1e-12)
    if D == 0:
        assert (a, b) == (1.0, 0.0) and velocity_decay(D) == 0.0 and lr_factor(D, 0, 10) == 1.0
        return
    K = 10
    f = [lr_factor(D, k, K) for k in range(K + 3)]
    assert f[0] == pytest.approx(1 / D, rel=1e-12) and f[K:] == [1.0] * 3
    assert all(x == pytest.approx(f[0] ** (1 - k / K), rel=1e-12) for k, x in enumerate(f[:K]))
    assert lr_factor(D, 5, 0) == 1.0                         # no warm-up: the base learning rate throughout
    assert velocity_decay(D) ** D == pytest.approx(0.1, rel=1e-12)


@pytest.mark.structure
def test_the_constants_by_hand():
    """The constants' values for a few settings, worked by hand, as docs/strategies/pipelines.md's table states them:
    spike compensation's (a, b) = (m^D, 1 + m + ... + m^(D-1)), PipeMare's warm-up factor D^-(1 - k/K) (k = 0 at a
    stage's first update) and velocity decay 0.1^(1/D). The warm-up against the one independent implementation found,
    Ajanthan et al. (ICML 2025), ``PluralisResearch/AsyncPP`` ``main_with_runtime.py`` ``adjust_learning_rate``: update
    u (0 first) at ``lr / tau^(1 - min((u + 1)/K, 1))``, tau the stage's warm-up forwards (D): the same form and
    delay, counted from 1, so its update u has ``lr_factor``'s factor of update u + 1."""
    by_hand = {(0.9, 0): (1.0, 0.0), (0.9, 1): (0.9, 1.0), (0.9, 2): (0.81, 1.9), (0.5, 3): (0.125, 1.75)}
    for (m, D), ab in by_hand.items():
        assert spike_coefficients(m, D) == pytest.approx(ab, rel=1e-12, abs=1e-15), (m, D)
    assert [lr_factor(4, k, 2) for k in range(4)] == pytest.approx([0.25, 0.5, 1.0, 1.0], rel=1e-12)
    assert [lr_factor(1, k, 3) for k in range(4)] == [1.0] * 4          # D = 1: lr/1 from the start
    assert velocity_decay(1) == pytest.approx(0.1, rel=1e-12)
    assert velocity_decay(2) == pytest.approx(0.1 ** 0.5, rel=1e-12)
    K = 7
    for D in (1, 2, 5):
        for u in range(K + 2):
            independent = 1.0 / D ** (1.0 - min((u + 1) / K, 1.0))
            assert lr_factor(D, u + 1, K) == pytest.approx(independent, rel=1e-12), (D, u)
    assert lr_factor(5, 0, K) == pytest.approx(1 / 5, rel=1e-12)        # fxpar's first update: the full 1/D


# ---- the math ------------------------------------------------------------------------------------------------
@pytest.mark.numerics
@pytest.mark.parametrize("correction", [None, "sc", "lwp", "sc+lwp"])
def test_pipelined_bp_math(clusters, correction):
    model, batches, m = SkipNet().double(), class_batches(3), 4
    prog = _program(model, batches[0], SGD_M, pp=2, schedule="pipelined_bp", microbatches=m, correction=correction)
    res = prog.run_local(batches, cluster=clusters.get(2))
    keys = [sp.param_keys for sp in prog.stages]
    _check(res, delayed_pipeline_reference(model, keys, batches, CE, SGD_M, m, correction=correction))
    if correction is None:      # not PipeDream: the backward reads today's weights, not the forward's stash
        stashed, _ = pipedream_reference(model, keys, batches, CE, SGD_M, m)
        assert abs(res.losses[-1] - stashed[-1]) > 1e-6
    else:                       # the correction changes the math
        plain, _ = delayed_pipeline_reference(model, keys, batches, CE, SGD_M, m)
        assert abs(res.losses[-1] - plain[-1]) > 1e-6


@pytest.mark.slow
@pytest.mark.numerics
def test_pipelined_bp_math_pp4(clusters):
    model, batches, m = SkipNet().double(), class_batches(3), 4
    prog = _program(model, batches[0], SGD_M, pp=4, schedule="pipelined_bp", microbatches=m, correction="sc+lwp")
    res = prog.run_local(batches, cluster=clusters.get(4))
    _check(res, delayed_pipeline_reference(model, [sp.param_keys for sp in prog.stages], batches, CE, SGD_M, m,
                                           correction="sc+lwp"))
    assert res.peak_versions == {s: 1 for s in range(4)}


@pytest.mark.numerics
@pytest.mark.parametrize("pp,optimizer", [(2, SGD_M), pytest.param(4, ADAMW, marks=pytest.mark.slow)])
def test_pipemare_math_and_memory(clusters, pp, optimizer):
    """PipeMare's warm-up and extrapolated backward against the reference; one weight copy per stage, measured by
    the runtime's version store, against PipeDream's stash of p - s versions on the same program."""
    model, batches, m = SkipNet().double(), class_batches(3), 4
    prog = _program(model, batches[0], optimizer, pp=pp, schedule="pipemare", microbatches=m, **MARE)
    res = prog.run_local(batches, cluster=clusters.get(pp))
    keys = [sp.param_keys for sp in prog.stages]
    _check(res, delayed_pipeline_reference(model, keys, batches, CE, optimizer, m, schedule="pipemare", **MARE))
    plain, _ = delayed_pipeline_reference(model, keys, batches, CE, optimizer, m, schedule="pipemare")
    assert abs(res.losses[-1] - plain[-1]) > 1e-6              # warm-up and correction change the math
    stage_bytes = _stage_bytes(model, prog)
    assert res.peak_versions == {s: 1 for s in range(pp)}
    assert res.peak_version_bytes == max(stage_bytes)
    # the velocity estimate: one more weight-sized buffer per stage, reported by the feature's state
    assert sorted(r["delayed_pipeline"]["velocity_bytes"] for r in res.features.values()) == sorted(stage_bytes)
    stash = _program(model, batches[0], optimizer, pp=pp, schedule="pipedream", microbatches=m)
    pd = stash.run_local(batches, cluster=clusters.get(pp))
    assert pd.peak_versions == {s: pp - s for s in range(pp)}
    assert pd.peak_version_bytes > res.peak_version_bytes


# ---- reductions: one stage is SGD ----------------------------------------------------------------------------
@pytest.mark.numerics
@pytest.mark.parametrize("schedule,optimizer,options", [
    ("pipelined_bp", SGD_M, {"correction": "sc+lwp"}),
    ("pipemare", SGD, MARE),
    ("pipemare", SGD_M, MARE),
])
def test_one_stage_is_sgd(clusters, schedule, optimizer, options):
    """pp=1: no gradient is late (D = 0), so every correction is the identity and each microbatch is one SGD step,
    with and without momentum; the Strategy warns that it is SGD."""
    model, batches, m = SkipNet().double(), class_batches(2), 4
    with pytest.warns(UserWarning, match=rf"schedule='{schedule}'.*plain SGD with an update per microbatch"):
        prog = _program(model, batches[0], optimizer, pp=1, schedule=schedule, microbatches=m, **options)
    res = prog.run_local(batches, cluster=clusters.get(1))
    micro = [tuple(t.chunk(m)[j] for t in b) for b in batches for j in range(m)]
    sgd_losses, sgd_state = reference_training(model, micro, CE, optimizer)
    per_batch = [sum(sgd_losses[b * m:(b + 1) * m]) / m for b in range(len(batches))]
    _check(res, (per_batch, sgd_state))


# ---- resume: the run that never stopped -----------------------------------------------------------------------
@pytest.mark.numerics
@pytest.mark.parametrize("schedule,options", [
    ("pipelined_bp", {"correction": "sc+lwp"}),
    ("pipemare", {"lr_warmup": 12, "discrepancy_correction": True}),
])
def test_resume_is_the_run_that_never_stopped(clusters, tmp_path, schedule, options):
    """``run_local(b1, save_to=d)`` then ``run_local(b2, resume_from=d)`` is ``run_local(b1 + b2)`` bit for bit: the
    checkpoint carries each stage's D_s versions before the newest (the resumed window's first D_s forwards read them,
    weight prediction with each version's own momentum), PipeMare's velocity estimate, and the update count its
    warm-up reads (12 updates: the warm-up is still running when the first 8 end)."""
    model, batches, m, pp = SkipNet().double(), class_batches(4), 4, 3
    prog = _program(model, batches[0], SGD_M, pp=pp, schedule=schedule, microbatches=m, **options)
    lc = clusters.get(pp)
    whole = prog.run_local(batches, cluster=lc)
    _check(whole, delayed_pipeline_reference(model, [sp.param_keys for sp in prog.stages], batches, CE, SGD_M, m,
                                             schedule=schedule, **options))
    first = prog.run_local(batches[:2], cluster=lc, save_to=tmp_path / "ck")
    second = prog.run_local(batches[2:], cluster=lc, resume_from=tmp_path / "ck")
    assert first.losses + second.losses == whole.losses
    for got, want in ((second.state_dict(), whole.state_dict()), (second.optimizer_state, whole.optimizer_state)):
        assert want and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # the resumed window starts holding the D_s carried versions beside the newest (its first forwards read them)
    assert whole.peak_versions == {s: 1 for s in range(pp)}
    assert second.peak_versions == {s: pp - s for s in range(pp)}


@pytest.mark.numerics
def test_weight_prediction_resumed_without_the_carried_momentum_is_refused(clusters, tmp_path):
    """A PipeMare checkpoint carries the versions but not their momentum, which weight prediction's first forwards
    of a resumed window predict from: refused, naming the setting."""
    model, batches = SkipNet().double(), class_batches(2)
    _program(model, batches[0], SGD_M, pp=2, schedule="pipemare", microbatches=4).run_local(
        batches[:1], cluster=clusters.get(2), save_to=tmp_path / "ck")
    prog = _program(model, batches[0], SGD_M, pp=2, schedule="pipelined_bp", microbatches=4, correction="lwp")
    with pytest.raises(Exception, match=r"correction='lwp'\) resumes from a checkpoint that does not carry the momentum"):
        prog.run_local(batches[1:], cluster=clusters.get(2), resume_from=tmp_path / "ck")
