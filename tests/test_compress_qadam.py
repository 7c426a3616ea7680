"""BAGUA's QAdam (``C.QAdam`` with ``fxpar.compress.QAdamOptimizer``): Adam on the all-reduced gradient for
``warmup_steps`` steps, then the second moment frozen and each rank's momentum averaged as min-max uint8 codes.

With ``warmup_steps`` at least the steps run it is data-parallel Adam: equal to ``torch.optim.Adam`` in one process
on the global batch to 1e-10. After warm-up, every rank's bucket sum equals the same math in one process
(``fxpar.testing.compress.qadam_bucket_math``: each rank's momentum, the 8-bit average with the same rounding, the
frozen ``v``) bit for bit, and a program equals that math trained in one process to 1e-10. The collectives per bucket
are one all-reduce of the full-precision bucket in warm-up and ByteGrad's all-to-all and all-gather of uint8 codes
after, measured on the ranks equal to ``wire_bytes``; the Plan section round-trips through JSON; a checkpoint taken
after warm-up resumes bitwise.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import compress as C
from fxpar.compress.bytegrad import chunk_size
from fxpar.compress.feature import bucket_infos, method_of
from fxpar.testing import MLP, gpt_loss, reference_training, tiny_gpt, token_batches
from fxpar.testing.compress import mlp_batches, qadam_bucket_math, qadam_reference
from fxpar.testing.compress_ranks import bucket_for, sum_steps

LR = 0.01
BETAS = (0.8, 0.99)


def _model(layers=2):
    torch.manual_seed(0)
    return MLP(layers=layers).double()


def _program(model, batches, method, optimizer=None, **strategy):
    strategy = {"dp": 2, **strategy}
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(strategy["dp"] * strategy.get("pp", 1)), batches[0],
                             loss_fn=F.mse_loss, optimizer=optimizer or (C.QAdamOptimizer, {"lr": LR}),
                             strategy=fxpar.Strategy(grad_sync=method, **strategy))


def _bucket_calls(b, variant) -> list:
    if variant == "warmup":
        return [("all_reduce", b.numel * b.element_size)]
    m = chunk_size(b.numel, b.dp)
    return [("all_to_all", b.dp * (8 + m)), ("all_gather", 8 + m)]


def _close(res, losses, state):
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    got = res.state_dict()
    for k, v in state.items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-10, msg=k)


# ---- the method on its own ----------------------------------------------------------------------------------------
@pytest.mark.structure
def test_variants_bytes_and_lines():
    m = C.QAdam(warmup_steps=3)
    b = bucket_for(1001, "float32", 4, 1)
    st = m.init_state(b, torch.Generator())
    assert sorted(st) == ["exp_avg", "exp_avg_sq"] and all(t.dtype == torch.float32 and t.shape == (1001,)
                                                           for t in st.values())
    assert [m.variant(b, s, st) for s in range(5)] == ["warmup"] * 3 + ["compress"] * 2
    assert m.wire_bytes(b, "warmup") == 1001 * 4
    assert m.wire_bytes(b, "compress") == 5 * (8 + 251) == C.ByteGrad().wire_bytes(b, None)
    bc1, bc2 = m.host_inputs(b, 4, st, "compress", torch.Generator())
    assert bc1.item() == 1 - 0.9 ** 5 and bc2.item() == (1 - 0.999 ** 5) ** 0.5
    warm, after = m.describe(b, "warmup"), m.describe(b, "compress")
    assert "all-reduced in full precision (4004 B)" in warm[0] and "v frozen" in after[0] and "1295 B" in after[0]
    assert m == C.QAdam.from_dict(m.to_dict()) and C.QAdam(betas=[0.9, 0.999]) == C.QAdam()


@pytest.mark.numerics
def test_sum_on_ranks_equals_the_same_math(clusters):
    """dp=2, traced on a gloo group: 2 warm-up steps then 2 compressed, every rank's direction and moments equal
    the one-process math bit for bit, and the collectives' bytes equal ``wire_bytes``."""
    method, numel, dp = C.QAdam(warmup_steps=2, betas=BETAS, eps=1e-6), 1001, 2
    records = clusters.get(dp).run(sum_steps, [(method, numel, "float64", 4, True)] * dp)
    mom = sq = torch.zeros(numel, dtype=torch.float64)
    b = bucket_for(numel, "float64", dp)
    for step in range(4):
        flats = [rr[step]["flat"] for rr in records]
        d, mom, sq = qadam_bucket_math(flats, mom, sq, step + 1, 2, BETAS, 1e-6)
        variant = "warmup" if step < 2 else "compress"
        for rr in records:
            assert rr[step]["variant"] == variant
            assert torch.equal(rr[step]["summed"], d)
            assert torch.equal(rr[step]["state"]["exp_avg"], mom) and torch.equal(rr[step]["state"]["exp_avg_sq"], sq)
            assert rr[step]["calls"] == _bucket_calls(b, variant)
            assert sum(n for _, n in rr[step]["calls"]) == method.wire_bytes(b, variant)
    # after warm-up v stays; the momentum travelled in 8 bits: not the exact mean of the ranks' momenta
    assert torch.equal(records[0][3]["state"]["exp_avg_sq"], records[0][1]["state"]["exp_avg_sq"])
    exact = torch.lerp(records[0][2]["state"]["exp_avg"], sum(rr[3]["flat"] for rr in records), 1 - BETAS[0])
    assert not torch.equal(records[0][3]["state"]["exp_avg"], exact)


# ---- programs -----------------------------------------------------------------------------------------------------
@pytest.mark.numerics
def test_all_warmup_equals_adam_in_one_process(clusters):
    """``warmup_steps >= steps``: data-parallel Adam, equal to torch.optim.Adam on the global batch."""
    model, batches = _model(), mlp_batches(4)
    res = _program(model, batches, C.QAdam(warmup_steps=4, betas=BETAS, eps=1e-6)).run_local(
        batches, cluster=clusters.get(2), measure_comm=True)
    losses, state = reference_training(model, batches, F.mse_loss,
                                       (torch.optim.Adam, {"lr": LR, "betas": BETAS, "eps": 1e-6}))
    _close(res, losses, state)


@pytest.mark.numerics
def test_after_warmup_equals_the_algorithm_in_one_process(clusters):
    """Two buckets, 2 warm-up steps then 3 compressed: losses and parameters equal the one-process math; per bucket
    and step the ranks measured one all-reduce of the bucket in warm-up, then ByteGrad's two uint8 collectives."""
    model, batches = _model(layers=3), mlp_batches(5)
    method = C.QAdam(warmup_steps=2, betas=BETAS, eps=1e-6)
    prog = _program(model, batches, method, bucket_cap_mb=0.004)
    infos = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    assert len(infos) >= 2
    rows = prog.plan.section("qadam").stages[0]
    assert [r["wire_bytes"] for r in rows] == [method.wire_bytes(b, "compress") for b in infos]
    assert [r["first_step"]["wire_bytes"] for r in rows] == [b.numel * 8 for b in infos]
    res = prog.run_local(batches, cluster=clusters.get(2), measure_comm=True)
    losses, state = qadam_reference(model, batches, F.mse_loss, LR, 2, [b.keys for b in infos], 2, BETAS, 1e-6)
    _close(res, losses, state)
    for r in range(2):
        assert res.comm_calls[r] == [[c for b in infos for c in _bucket_calls(b, "warmup")]] * 2 + \
            [[c for b in infos for c in _bucket_calls(b, "compress")]] * 3
    # the compressed steps are not Adam's
    adam = reference_training(model, batches, F.mse_loss, (torch.optim.Adam, {"lr": LR, "betas": BETAS, "eps": 1e-6}))
    assert max(abs(a - b) for a, b in zip(res.losses[3:], adam[0][3:])) > 1e-9


@pytest.mark.numerics
@pytest.mark.slow
def test_microbatches_sum_once_per_step(clusters):
    """Under microbatches the momentum is formed from the step's accumulated gradient, once per step."""
    model, batches = _model(), mlp_batches(4, batch=16)
    method = C.QAdam(warmup_steps=2, betas=BETAS, eps=1e-6)
    prog = _program(model, batches, method, microbatches=2)
    infos = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    res = prog.run_local(batches, cluster=clusters.get(2))
    losses, state = qadam_reference(model, batches, F.mse_loss, LR, 2, [b.keys for b in infos], 2, BETAS, 1e-6,
                                    microbatches=2)
    _close(res, losses, state)


@pytest.mark.structure
def test_plan_json_round_trip_and_explain():
    model, batches = _model(), mlp_batches(1)
    method = C.QAdam(warmup_steps=7, betas=BETAS, eps=1e-6)
    prog = _program(model, batches, method)
    text = prog.plan.to_json()
    again = fxpar.Plan.from_json(text)
    assert again.section("qadam") == prog.plan.section("qadam") and again.to_json() == text
    assert method_of(again.section("qadam")) == method
    # a handed-back Plan's options are the ones that run
    edited = fxpar.Plan.from_json(text)
    edited.section("qadam").method["warmup_steps"] = 3
    prog2 = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=F.mse_loss,
                              optimizer=(C.QAdamOptimizer, {"lr": LR}), plan=edited)
    assert prog2.plan.section("qadam").method["warmup_steps"] == 3
    lines = prog.explain()
    (b,) = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    assert f"wire_bytes={method.wire_bytes(b, 'compress')} (all_to_all of " in lines
    assert f"until the method starts: wire_bytes={b.numel * 8} (all_reduce of {b.numel * 8} bytes)" in lines
    assert "v frozen" in lines and "QAdamOptimizer scales by lr" in lines and "BAGUA" in lines


@pytest.mark.numerics
def test_checkpoint_after_warmup_resumes_bitwise(clusters, tmp_path):
    """Warm-up 2, save at step 3 (one compressed step in), 3 more steps == 6 straight, bitwise: m, the frozen v and
    the step counter are in the checkpoint."""
    model, batches = _model(), mlp_batches(6)
    method = C.QAdam(warmup_steps=2, betas=BETAS, eps=1e-6)
    straight = _program(model, batches, method).run_local(batches, cluster=clusters.get(2))
    _program(model, batches, method).run_local(batches[:3], cluster=clusters.get(2), save_to=tmp_path / "ck")
    resumed = _program(model, batches, method).run_local(batches[3:], cluster=clusters.get(2),
                                                         resume_from=tmp_path / "ck")
    assert resumed.losses == straight.losses[3:]
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    restart = _program(model, batches, method).run_local(batches[3:], cluster=clusters.get(2))
    assert restart.losses != straight.losses[3:]


# ---- what is refused ------------------------------------------------------------------------------------------
@pytest.mark.structure
@pytest.mark.parametrize("opt", [(torch.optim.Adam, {"lr": 1e-3}), (torch.optim.SGD, {"lr": 0.1})],
                         ids=["Adam", "SGD"])
def test_any_other_optimizer_is_refused(opt):
    model, batches = _model(), mlp_batches(1)
    with pytest.raises(fxpar.StrategyError) as e:
        _program(model, batches, C.QAdam(), optimizer=opt)
    msg = str(e.value)
    assert f"with optimizer {opt[0].__name__}" in msg and "optimizer=(fxpar.compress.QAdamOptimizer" in msg
    assert "QAdam(betas=..., eps=...)" in msg


@pytest.mark.structure
def test_a_weight_tied_across_stages_is_refused():
    model = tiny_gpt()
    batches = token_batches(1, batch=4)
    with pytest.raises(fxpar.StrategyError, match=r"the gradient of .* is summed over group .*tied across pipeline "
                                                  r"stages.*Untie it, or train without pp"):
        fxpar.parallelize(model, fxpar.ClusterSpec.local(4), batches[0], loss_fn=gpt_loss,
                          optimizer=(C.QAdamOptimizer, {"lr": LR}),
                          strategy=fxpar.Strategy(dp=2, pp=2, microbatches=2, grad_sync=C.QAdam()))


@pytest.mark.cost
def test_the_eager_optimizer_step_is_priced(monkeypatch):
    """QAdamOptimizer is not traced: each rank runs it eagerly after its graph (Executor._eager_step), and
    estimate() prices that step -- per parameter tensor of n values 7 aten ops (the weight copied into torch's
    parameter, the gradient detached and cloned onto it, torch's ``grad * lr`` and ``sub_``, the new weight detached
    and cloned out), elementwise bytes 5 n (``grad * lr`` reads and writes n, ``sub_`` reads 2 n and writes n) and
    copy bytes 7 n (``copy_`` in and out 3 n, each clone 2 n), times the element size -- serial at the step's end:
    the step time is the graph's plus that step's roofline time and dispatch."""
    model, batches = _model(), mlp_batches(1)
    prog = _program(model, batches, C.QAdam(warmup_steps=2))
    assert not prog.optimizer.traced
    params = list(model.parameters())
    n, es = sum(p.numel() for p in params), params[0].element_size()
    ops, flops, nbytes, classes = prog.eager_step_compute(0)
    assert ops == 7 * len(params)
    assert dict((c, b) for c, _, b in classes) == {"elementwise": 5 * n * es, "copy": 7 * n * es}
    assert nbytes == 12 * n * es
    from cost_models.compute import inner_time
    dev = prog.cluster.device_of(0)
    t = inner_time((ops, flops, nbytes, 0, classes), dev) + ops * dev.op_overhead_s
    assert t > 0
    est = prog.estimate()
    assert any("QAdamOptimizer is not traced" in line for line in est.notes)
    monkeypatch.setattr(fxpar.Program, "_price_eager_step", lambda self, est: None)
    base = _program(model, batches, C.QAdam(warmup_steps=2)).estimate()
    assert est.step_time_s == pytest.approx(base.step_time_s + t, rel=1e-12)
    assert est.ranks[0].compute_time_s == pytest.approx(base.ranks[0].compute_time_s + t, rel=1e-12)
    # a traced optimizer's step is in its graph: nothing is added
    traced = _program(model, batches, "allreduce", optimizer=(torch.optim.SGD, {"lr": 0.1}))
    assert traced.optimizer.traced and traced.eager_step_compute(0) == (0, 0, 0, ())
