"""Mixed precision (``Strategy(precision="bf16" | "fp16")``, fxpar/features/precision.py, passes/precision.py).

Numerics: N gloo ranks against ``fxpar.testing.precision.mixed_precision_reference``, the same math in one process
(a bf16 copy of the fp32 masters computes each piece of the step -- dp shard x microbatch -- in eager torch, its
gradients cast to fp32 and summed there, the update on the masters). The reference runs on one thread as each rank
does: CPU kernels that reduce in bf16 (LayerNorm's weight gradient) round differently with another thread count.
Same-math configurations (dp, pp, ZeRO) agree to 1e-6 (float32 update arithmetic in another order: the gradient sum
over ranks and microbatches); tensor parallelism sums bf16 partial products across ranks, a rounding the one-process
matmul does not make, so it is held to bf16's tolerance (2e-2 relative on the loss, 2e-2 on the update's size).
fp16's dynamic loss scale is checked against torch.amp.GradScaler driving the reference, skipped steps included;
where pp, tp or ZeRO split the gradients the update reads, every rank must skip together, also when only one rank's
gradients overflow. ``torch.autocast`` + float32 masters is another rule (autocast runs cross-entropy, log-softmax
and LayerNorm in float32 and keeps parameters float32 outside matmuls): the losses agree within 1e-2 and the updates
within 5%.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.testing import GPT, MLP, class_batches, gpt_loss, max_abs_diff, token_batches
from fxpar.testing.precision import autocast_reference, mixed_precision_reference

SGD = (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9})
ADAM = (torch.optim.Adam, {"lr": 1e-2})


def _model():
    torch.manual_seed(0)
    return GPT(vocab=64, d=32, layers=2, heads=2)


def _batches(n=3):
    return token_batches(n, batch=8, seq=16, vocab=64)


def _run(clusters, opt, batches, model=_model, loss=gpt_loss, **options):
    st = fxpar.Strategy(**options)
    prog = fxpar.parallelize(model(), fxpar.ClusterSpec.local(st.size), batches[0], loss, opt, strategy=st)
    return prog, prog.run_local(batches, cluster=clusters.get(st.size))


def _reference(opt, batches, pieces, model=_model, loss=gpt_loss, **kw):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # as each rank runs
    try:
        return mixed_precision_reference(model(), batches, loss, opt, pieces=pieces, **kw)
    finally:
        torch.set_num_threads(threads)


CASES = {
    "dp2": (dict(dp=2), 2, False),
    "pp2_1f1b": (dict(pp=2, schedule="1f1b", microbatches=2), 2, True),     # the tied embedding on both stages
    "zero2": (dict(dp=2, zero=2), 2, False),
    "zero3": (dict(dp=2, zero=3), 2, False),
}


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_matches_the_same_math_in_one_process(clusters, name):
    options, pieces, untie = CASES[name]
    batches = _batches()
    _, res = _run(clusters, SGD, batches, precision="bf16", **options)
    losses, state, _ = _reference(SGD, batches, pieces, untie=untie)
    assert max(abs(a - b) for a, b in zip(res.losses, losses)) < 1e-6, (res.losses, losses)
    assert max_abs_diff(res.state_dict(), state) < 1e-6
    assert all(v.dtype == torch.float32 for v in res.state_dict().values())      # the masters stay float32


@pytest.mark.numerics
def test_bf16_tensor_parallel_within_bf16_rounding(clusters):
    batches = _batches()
    _, res = _run(clusters, SGD, batches, precision="bf16", tp=2, sharding="megatron")
    losses, state, _ = _reference(SGD, batches, 1)
    start = _model().state_dict()
    assert max(abs(a - b) / b for a, b in zip(res.losses, losses)) < 2e-2, (res.losses, losses)
    got = res.state_dict()
    for k in state:
        step = (state[k] - start[k]).norm()
        assert (got[k] - state[k]).norm() <= 2e-2 * step + 1e-6, k


@pytest.mark.numerics
def test_fp16_dynamic_loss_scale_is_grad_scalers(clusters):
    """A scale so large that fp16's backward overflows: the first steps are skipped (parameters, Adam's moments and
    its step count untouched) and the scale backs off, then grows after each finite step -- as GradScaler does."""
    batches = _batches(4)
    ls = {"init_scale": 2.0 ** 40, "growth_interval": 1, "backoff_factor": 2.0 ** -10}
    prog, res = _run(clusters, ADAM, batches, dp=2, precision="fp16", loss_scale=ls)
    losses, state, info = _reference(ADAM, batches, 2, compute=torch.float16, scaler=ls)
    assert info == {"scale": 2048.0, "skipped_steps": 3}
    assert all(res.features[r]["precision"] == info for r in range(2)), res.features
    assert max(abs(a - b) for a, b in zip(res.losses, losses)) < 1e-6
    assert max_abs_diff(res.state_dict(), state) < 1e-6


# fp16 where the gradients the update reads are split across ranks: (options, pieces of the global batch, untie)
SPLIT = {
    "pp2_1f1b": (dict(pp=2, schedule="1f1b", microbatches=2), 2, True),
    "tp2": (dict(tp=2, sharding="megatron"), 1, False),
    "zero1": (dict(dp=2, zero=1), 2, False),
    "zero3": (dict(dp=2, zero=3), 2, False),
}
OVERFLOW = {"init_scale": 2.0 ** 40, "growth_interval": 1, "backoff_factor": 2.0 ** -10}


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(SPLIT))
def test_fp16_split_gradients_skip_together(clusters, name):
    """pp, tp and ZeRO: each rank checks the gradients its update reads and the found-inf flags are max-reduced over
    the mesh. A scale so large that the first three steps overflow: every rank skips them (SGD's momentum buffer and
    its first-step rule untouched), backs off and grows the scale as torch.amp.GradScaler does, against the same math
    in one process (1e-6; tp within fp16's rounding of its partial sums) and against torch.autocast(float16) with a
    GradScaler (the same steps skipped, the same scale; losses within 1e-2, updates within 5%)."""
    options, pieces, untie = SPLIT[name]
    batches = _batches(5)
    prog, res = _run(clusters, SGD, batches, precision="fp16", loss_scale=OVERFLOW, **options)
    losses, state, info = _reference(SGD, batches, pieces, compute=torch.float16, scaler=OVERFLOW, untie=untie)
    assert info == {"scale": 4096.0, "skipped_steps": 3}
    assert all(res.features[r]["precision"] == info for r in range(2)), res.features
    start, got = _model().state_dict(), res.state_dict()
    if name == "tp2":
        assert max(abs(a - b) / b for a, b in zip(res.losses, losses)) < 2e-3, (res.losses, losses)
        for k in state:
            assert (got[k] - state[k]).norm() <= 1e-2 * (state[k] - start[k]).norm() + 1e-6, k
    else:
        assert max(abs(a - b) for a, b in zip(res.losses, losses)) < 1e-6, (res.losses, losses)
        assert max_abs_diff(got, state) < 1e-6
    ac_losses, ac_state, ac_info = autocast_reference(_model(), batches, gpt_loss, SGD, torch.float16, OVERFLOW)
    assert ac_info == info
    assert max(abs(a - b) for a, b in zip(res.losses, ac_losses)) < 1e-2, (res.losses, ac_losses)
    num = sum(float((got[k] - ac_state[k]).norm() ** 2) for k in ac_state) ** 0.5
    den = sum(float((ac_state[k] - start[k]).norm() ** 2) for k in ac_state) ** 0.5
    assert num < 0.05 * den, (num, den)


class _Shifted(torch.nn.Module):
    """Two Linear layers and a logit shift, its first four classes' entries scaled by 1000: their gradient, 1000 x a
    sum over the batch, is the only one to overflow fp16 at a loss scale of 2^14 -- on the last pipeline stage alone,
    or on the ZeRO rank that holds those entries' chunk (rank 0)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(16, 32)
        self.second = torch.nn.Linear(32, 8)
        self.shift = torch.nn.Parameter(torch.zeros(8))
        self.register_buffer("gain", torch.tensor([1000.0] * 4 + [1.0] * 4))

    def forward(self, x):
        return self.second(torch.tanh(self.first(x))) + self.gain * self.shift


@pytest.mark.numerics
@pytest.mark.parametrize("options", [dict(pp=2, schedule="1f1b", microbatches=2, split_points=["second"]),
                                     dict(dp=2, zero=1)], ids=["pp2", "zero1"])
def test_fp16_one_rank_overflows_every_rank_skips(clusters, options):
    """Only one rank's gradients overflow in the first step: the other rank skips it too (Adam's moments and step
    count untouched on both) and backs off its scale alike, as GradScaler does over the whole model in one process.
    After it (scale 2^6) no gradient can overflow: |a class's gradient| <= 1000 x 2^6 x 1 < 65504."""
    batches = class_batches(4, batch=32, classes=8, dtype=torch.float32)
    ls = {"init_scale": 2.0 ** 14, "backoff_factor": 2.0 ** -8}
    adam = (torch.optim.Adam, {"lr": 1e-3})
    _, res = _run(clusters, adam, batches, model=_Shifted, loss=F.cross_entropy, precision="fp16", loss_scale=ls,
                  **options)
    losses, state, info = _reference(adam, batches, 2, model=_Shifted, loss=F.cross_entropy, compute=torch.float16,
                                     scaler=ls)
    assert info == {"scale": 64.0, "skipped_steps": 1}
    assert all(res.features[r]["precision"] == info for r in range(2)), res.features
    assert max(abs(a - b) for a, b in zip(res.losses, losses)) < 1e-6, (res.losses, losses)
    assert max_abs_diff(res.state_dict(), state) < 1e-6


@pytest.mark.structure
@pytest.mark.parametrize("options", [dict(pp=2, schedule="1f1b", microbatches=2), dict(tp=2, sharding="megatron"),
                                     dict(dp=2, zero=1), dict(dp=2, zero=3)], ids=["pp2", "tp2", "zero1", "zero3"])
def test_structure_one_found_flag_all_reduce_over_the_mesh(options):
    """One all_reduce(max) of a 4-byte flag over every rank, after the step's gradient collectives and before the
    gathers the update makes (ZeRO-1's updated chunks, the pieces tensor parallelism's update reads)."""
    batches = _batches(1)
    st = fxpar.Strategy(precision="fp16", **options)
    prog = fxpar.parallelize(_model(), fxpar.ClusterSpec.local(st.size), batches[0], gpt_loss, SGD, strategy=st)
    assert prog.plan.section("precision").found_over == prog.plan.groups["loss_scale"] == [[0, 1]]
    for r in range(2):
        colls = prog.collectives(r)
        flags = [i for i, c in enumerate(colls) if c.axis == "loss_scale"]
        assert len(flags) == 1, colls
        c = colls[flags[0]]
        assert (c.kind, c.reduce_op, c.ranks, c.nbytes) == ("all_reduce", "max", (0, 1), 4)
        after = {x.kind for x in colls[flags[0] + 1:]}       # what the update gathers: ZeRO's updated chunks, tp's
        assert after == ({"all_gather"} if "zero" in options or "tp" in options else set()) - \
            ({"all_gather"} if options.get("zero") == 3 else set()), colls


@pytest.mark.structure
def test_structure_data_parallel_alone_adds_no_flag():
    """dp alone: every rank's update reads the same summed gradients; fp16 adds no collective to dp's."""
    batches = _batches(1)
    dp = fxpar.parallelize(_model(), fxpar.ClusterSpec.local(2), batches[0], gpt_loss, SGD,
                           strategy=fxpar.Strategy(dp=2, precision="fp16"))
    assert dp.plan.section("precision").found_over == [] and "loss_scale" not in dp.plan.groups
    assert [c.kind for c in dp.collectives(0)] == [c.kind for c in fxpar.parallelize(
        _model(), fxpar.ClusterSpec.local(2), batches[0], gpt_loss, SGD, strategy=fxpar.Strategy(dp=2)).collectives(0)]


@pytest.mark.structure
@pytest.mark.parametrize("options,groups", [
    (dict(dp=2, pp=2, microbatches=2), [[0, 2], [1, 3]]),              # a replica's stages; replicas decide alike
    (dict(dp=2, tp=2, sharding="megatron"), [[0, 1], [2, 3]]),        # a replica's tp pieces
    (dict(dp=2, pp=2, zero=1, microbatches=2), [[0, 1, 2, 3]]),       # ZeRO: each dp rank updates its own chunk
])
def test_found_flags_meet_over_the_ranks_of_one_update(options, groups):
    """The flag is reduced over the ranks holding the parts of one update: a replica's pipeline stages and tp pieces
    (Megatron-LM's model-parallel group: the replicas' summed gradients are the same, so they decide alike), and
    every dp rank as well under ZeRO."""
    batches = _batches(1)
    st = fxpar.Strategy(precision="fp16", **options)
    prog = fxpar.parallelize(_model(), fxpar.ClusterSpec.local(st.size), batches[0], gpt_loss, SGD, strategy=st)
    assert prog.plan.section("precision").found_over == prog.plan.groups["loss_scale"] == groups
    for r in range(4):
        (c,) = [c for c in prog.collectives(r) if c.axis == "loss_scale"]
        assert c.nbytes == 4 and len(c.ranks) == len(groups[0])


@pytest.mark.numerics
def test_reduced_in_bf16_sums_half_the_bytes(clusters):
    """reduce_precision='compute': the bucket travels in bf16 (half the bytes of the float32 one); the update reads
    the sum cast back to float32."""
    batches = _batches(2)
    p32, _ = _run(clusters, SGD, batches[:1], dp=2, precision="bf16")
    p16, res = _run(clusters, SGD, batches, dp=2, precision="bf16", reduce_precision="compute")
    b32 = sum(c.nbytes for c in p32.collectives(0) if c.kind == "all_reduce")
    b16 = sum(c.nbytes for c in p16.collectives(0) if c.kind == "all_reduce")
    assert b32 == 2 * b16 == 4 * sum(p.numel() for p in _model().parameters())
    losses, state, _ = _reference(SGD, batches, 2)
    assert max_abs_diff(res.state_dict(), state) < 5e-2 * 0.5       # one bf16 rounding of the sum, times lr


@pytest.mark.numerics
def test_against_torch_autocast(clusters):
    batches = _batches()
    _, res = _run(clusters, SGD, batches, dp=2, precision="bf16")
    losses, state, _ = autocast_reference(_model(), batches, gpt_loss, SGD)
    start = _model().state_dict()
    assert max(abs(a - b) for a, b in zip(res.losses, losses)) < 1e-2, (res.losses, losses)
    num = sum(float((res.state_dict()[k] - state[k]).norm() ** 2) for k in state) ** 0.5
    den = sum(float((state[k] - start[k]).norm() ** 2) for k in state) ** 0.5
    assert num < 0.05 * den, (num, den)


@pytest.mark.cost
def test_measured_peak_is_the_predicted_one(clusters):
    """bf16 compute from float32 masters with Adam: the rank holds 4 + 8 bytes per parameter between steps (master,
    two moments) and, inside the step, the bf16 copies, bf16 activations and the float32 gradients; the measured
    peak is the estimate's within 1%."""
    batches = _batches(2)
    st = fxpar.Strategy(dp=2, precision="bf16")
    prog = fxpar.parallelize(_model(), fxpar.ClusterSpec.local(2), batches[0], gpt_loss, ADAM, strategy=st)
    res = prog.run_local(batches, cluster=clusters.get(2), measure_memory=True)
    est = prog.estimate()
    psi = sum(p.numel() for p in _model().parameters())
    micro = 2 * 4 * 16 * 8
    assert res.held_memory_bytes[0] == 12 * psi + micro
    for r in range(2):
        late = max(c.nbytes for c in prog.collectives(r))
        pred, got = est.ranks[r].peak_memory_bytes, res.peak_memory_bytes[r]
        assert 0.99 * pred <= got <= 1.01 * pred + late, (r, got, pred)


@pytest.mark.cost
@pytest.mark.parametrize("zero", [1, 3])
def test_fp16_with_zero_holds_float32_master_chunks(clusters, zero):
    """fp16 with ZeRO and Adam: between steps a rank holds its float32 masters (whole at ZeRO-1, its chunk at ZeRO-3),
    the chunks of Adam's two moments, the microbatch and the loss scale's 16 bytes of state, to the byte; the
    measured peak is the estimate's within 1%."""
    batches = _batches(2)
    st = fxpar.Strategy(dp=2, zero=zero, precision="fp16")
    prog = fxpar.parallelize(_model(), fxpar.ClusterSpec.local(2), batches[0], gpt_loss, ADAM, strategy=st)
    res = prog.run_local(batches, cluster=clusters.get(2), measure_memory=True)
    est = prog.estimate()
    psi = sum(p.numel() for p in _model().parameters())
    chunks = sum((p.numel() + 1) // 2 for p in _model().parameters())
    micro = 2 * 4 * 16 * 8
    masters = 4 * psi if zero == 1 else 4 * chunks
    assert res.held_memory_bytes[0] == res.held_memory_bytes[1] == masters + 8 * chunks + micro + 16
    for r in range(2):
        late = max(c.nbytes for c in prog.collectives(r))
        pred, got = est.ranks[r].peak_memory_bytes, res.peak_memory_bytes[r]
        assert 0.99 * pred <= got <= 1.01 * pred + late, (r, got, pred)


@pytest.mark.structure
def test_structure_casts_in_and_gradients_back():
    batches = _batches(1)
    prog = fxpar.parallelize(_model(), fxpar.ClusterSpec.local(2), batches[0], gpt_loss, SGD,
                             strategy=fxpar.Strategy(dp=2, precision="bf16"))
    (gm,) = prog.graphs(0).values()
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    n_params = len(list(_model().parameters()))
    assert sum(n.kwargs["dtype"] == torch.bfloat16 and n.args[0].op == "placeholder" for n in casts) == n_params   # tokens stay int64
    assert sum(n.kwargs["dtype"] == torch.float32 and n.meta.get("fxpar_grad_of") is not None for n in casts) \
        == n_params
    assert [c.nbytes for c in prog.collectives(0) if c.kind == "all_reduce"][0] > 0
    assert "precision" in prog.plan.features and "bf16" in prog.explain()


@pytest.mark.structure
@pytest.mark.parametrize("options,words", [
    (dict(precision="bf8"), "choose one of"),
    (dict(precision="bf16", reduce_precision="fp8"), "reduce_precision"),
    (dict(precision="bf16", loss_scale={}), "fp16 only"),
    (dict(precision="fp16", loss_scale={"init": 1.0}), "init_scale"),
])
def test_bad_settings_are_refused_by_name(options, words):
    with pytest.raises(fxpar.StrategyError, match=words):
        fxpar.Strategy(**options)


@pytest.mark.structure
@pytest.mark.parametrize("options,words", [
    (dict(pp=2, schedule="pipedream"), "asynchronous schedule"),
    (dict(pp=2, schedule="interleaved", microbatches=2), "hold several stages"),
])
def test_fp16_schedules_without_one_step_are_refused(options, words):
    batches = class_batches(1, classes=8, dtype=torch.float32)
    st = fxpar.Strategy(precision="fp16", **options)
    with pytest.raises(fxpar.StrategyError, match=words):
        fxpar.parallelize(MLP(layers=3), fxpar.ClusterSpec.local(st.size), batches[0], F.cross_entropy, SGD,
                          strategy=st)


@pytest.mark.structure
def test_fp16_with_an_eager_optimizer_is_refused():
    batches = _batches(1)
    with pytest.raises(fxpar.StrategyError, match="eager optimizer"):
        fxpar.parallelize(_model(), fxpar.ClusterSpec.local(1), batches[0], gpt_loss, (torch.optim.Adagrad, {"lr": 0.1}),
                          strategy=fxpar.Strategy(precision="fp16"))
