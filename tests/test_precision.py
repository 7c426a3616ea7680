"""Mixed precision (``Strategy(precision="bf16" | "fp16")``, fxpar/features/precision.py, passes/precision.py).

Numerics: N gloo ranks against ``fxpar.testing.precision.mixed_precision_reference``, the same math in one process
(a bf16 copy of the fp32 masters computes each piece of the step -- dp shard x microbatch -- in eager torch, its
gradients cast to fp32 and summed there, the update on the masters). The reference runs on one thread as each rank
does: CPU kernels that reduce in bf16 (LayerNorm's weight gradient) round differently with another thread count.
Same-math configurations (dp, pp, ZeRO) agree to 1e-6 (float32 update arithmetic in another order: the gradient sum
over ranks and microbatches); tensor parallelism sums bf16 partial products across ranks, a rounding the one-process
matmul does not make, so it is held to bf16's tolerance (2e-2 relative on the loss, 2e-2 on the update's size).
fp16's dynamic loss scale is checked against torch.amp.GradScaler driving the reference, skipped steps included.
``torch.autocast`` + float32 masters is another rule (autocast runs cross-entropy, log-softmax and LayerNorm in
float32 and keeps parameters float32 outside matmuls): the losses agree within 1e-2 and the updates within 5%.
"""
from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.testing import GPT, gpt_loss, max_abs_diff, token_batches
from fxpar.testing.precision import autocast_reference, mixed_precision_reference

SGD = (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9})
ADAM = (torch.optim.Adam, {"lr": 1e-2})


def _model():
    torch.manual_seed(0)
    return GPT(vocab=64, d=32, layers=2, heads=2)


def _batches(n=3):
    return token_batches(n, batch=8, seq=16, vocab=64)


def _run(clusters, opt, batches, **options):
    st = fxpar.Strategy(**options)
    prog = fxpar.parallelize(_model(), fxpar.ClusterSpec.local(st.size), batches[0], gpt_loss, opt, strategy=st)
    return prog, prog.run_local(batches, cluster=clusters.get(st.size))


def _reference(opt, batches, pieces, **kw):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # as each rank runs
    try:
        return mixed_precision_reference(_model(), batches, gpt_loss, opt, pieces=pieces, **kw)
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
    losses, state = autocast_reference(_model(), batches, gpt_loss, SGD)
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
    (dict(dp=2, zero=3, precision="fp16"), "zero=3"),
    (dict(pp=2, precision="fp16"), "pp=2"),
])
def test_bad_settings_are_refused_by_name(options, words):
    with pytest.raises(fxpar.StrategyError, match=words):
        fxpar.Strategy(**options)


@pytest.mark.structure
def test_fp16_with_an_eager_optimizer_is_refused():
    batches = _batches(1)
    with pytest.raises(fxpar.StrategyError, match="eager optimizer"):
        fxpar.parallelize(_model(), fxpar.ClusterSpec.local(1), batches[0], gpt_loss, (torch.optim.Adagrad, {"lr": 0.1}),
                          strategy=fxpar.Strategy(precision="fp16"))
