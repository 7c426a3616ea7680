"""A user's strategy as one Feature (examples/custom_strategy.py): error-feedback gradient compression with
per-rank state, at dp=2 and dp=2 x pp=2, against the method's single-process math; its reduction to synchronous
SGD; its collectives; its Plan section, explain() lines, estimate and checkpoint; and the registry's refusals."""
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.feature import unregister_feature
from fxpar.testing import MLP
from fxpar.testing.reference import reference_training as sgd_reference

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SGD = (torch.optim.SGD, {"lr": 0.1})


@pytest.fixture(scope="module")
def ex():
    """The example module, importable by name on the ranks too (they start after examples/ is on sys.path)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module("custom_strategy")
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def ranks(ex):
    """LocalClusters started with examples/ on sys.path, so the ranks can unpickle the example's RankState."""
    made = {}

    def get(n):
        if n not in made:
            made[n] = fxpar.LocalCluster(n)
        return made[n]
    yield get
    for lc in made.values():
        lc.close()


def _model(layers=2):
    torch.manual_seed(0)
    return MLP(layers=layers).double()


def _batches(n, batch=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 16, dtype=torch.float64, generator=g),
             torch.randn(batch, 8, dtype=torch.float64, generator=g)) for _ in range(n)]


def _program(model, batches, **strategy):
    world = strategy.get("dp", 1) * strategy.get("pp", 1)
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(world), batches[0], loss_fn=F.mse_loss, optimizer=SGD,
                             strategy=fxpar.Strategy(**strategy))


def _close(a: dict, b: dict, tol=1e-10):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, pp=2, microbatches=2)], ids=["dp2", "dp2xpp2"])
def test_matches_the_methods_math(ex, ranks, layout):
    model, batches = _model(layers=3), _batches(4)
    prog = _program(model, batches, ef_dtype="float16", **layout)
    res = prog.run_local(batches, cluster=ranks(prog.world_size))
    losses, state = ex.reference_training(model, batches, F.mse_loss, lr=0.1, dp=2, dtype="float16",
                                          microbatches=layout.get("microbatches", 1))
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    _close(res.state_dict(), state)
    # the method is not synchronous SGD: float16 rounding moved the weights (the residuals are in play)
    _, plain = sgd_reference(model, batches, F.mse_loss, SGD)
    assert max((res.state_dict()[k] - plain[k]).abs().max().item() for k in plain) > 1e-6


@pytest.mark.numerics
@pytest.mark.slow
def test_exact_dtype_is_synchronous_sgd(ex, ranks):
    """ef_dtype equal to the gradients' dtype: the rounding is exact, residuals stay 0: plain data parallelism."""
    model, batches = _model(), _batches(3)
    prog = _program(model, batches, dp=2, ef_dtype="float64")
    res = prog.run_local(batches, cluster=ranks(2))
    losses, state = sgd_reference(model, batches, F.mse_loss, SGD)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    _close(res.state_dict(), state)


@pytest.mark.structure
def test_collectives_one_per_bucket_in_the_narrow_dtype(ex):
    model, batches = _model(), _batches(1)
    plain = _program(model, batches, dp=2, bucket_cap_mb=0.004)
    ef = _program(model, batches, dp=2, bucket_cap_mb=0.004, ef_dtype="float16")
    a, b = plain.collectives(0), ef.collectives(0)
    assert len(a) == len(b) >= 2                                   # one all-reduce per bucket, as before
    assert [c.kind for c in b] == ["all_reduce"] * len(a)
    assert [c.nbytes for c in b] == [c.nbytes // 4 for c in a]     # float64 -> float16: a quarter of the bytes
    sec = ef.plan.section("ef16")
    assert [8 * n for n in sec.bucket_numels[0]] == [c.nbytes for c in a]
    code = ef.graphs(0)["step"].code
    assert code.count("torch.float16") >= len(b) and "state_ef16_s0b0" in code


@pytest.mark.structure
def test_plan_section_explain_and_estimate(ex):
    model, batches = _model(), _batches(1)
    prog = _program(model, batches, dp=2, ef_dtype="float16")
    text = prog.explain()
    assert "ef16:" in text and "all-reduced in float16 with error feedback" in text
    assert "ef16: gradient buckets" in str(prog.plan)
    plan = fxpar.Plan.from_json(prog.plan.to_json())
    assert plan == prog.plan and isinstance(plan.section("ef16"), ex.ErrorFeedbackSection)
    again = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=F.mse_loss, optimizer=SGD,
                              strategy=fxpar.Strategy(dp=2, ef_dtype="float16"), plan=plan)
    assert again.graphs(0)["step"].code == prog.graphs(0)["step"].code
    numel = sum(p.numel() for p in model.parameters())
    assert prog.estimate().ranks[0].memory_breakdown["feature ef16"] == 8 * numel     # the float64 residuals


@pytest.mark.numerics
@pytest.mark.slow
def test_checkpoint_resumes_the_residuals_bitwise(ex, ranks, tmp_path):
    model, batches = _model(), _batches(4)
    prog = _program(model, batches, dp=2, ef_dtype="float16")
    straight = prog.run_local(batches, cluster=ranks(2))
    prog.run_local(batches[:2], cluster=ranks(2), save_to=tmp_path / "ck")
    resumed = prog.run_local(batches[2:], cluster=ranks(2), resume_from=tmp_path / "ck")
    assert resumed.losses == straight.losses[2:]
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    # without the residuals the run is another one: the checkpoint's state matters
    fresh = _program(model, batches, dp=2, ef_dtype="float16")
    restart = fresh.run_local(batches[2:], cluster=ranks(2))
    assert restart.losses != straight.losses[2:]


# ---- what the registry refuses -----------------------------------------------------------------------
@pytest.mark.structure
def test_an_option_another_feature_owns_is_refused_naming_both(ex):
    class Copy(fxpar.Feature):
        name = "ef_copy"
        options = {"ef_dtype": fxpar.Option(None)}
    with pytest.raises(fxpar.StrategyError, match=r"'ef_copy'.*'ef_dtype'.*feature 'ef16'"):
        fxpar.register_feature(Copy)

    class Core(fxpar.Feature):
        name = "my_dp"
        options = {"dp": fxpar.Option(1)}
    with pytest.raises(fxpar.StrategyError, match=r"'my_dp'.*'dp'.*core Strategy"):
        fxpar.register_feature(Core)

    class BuiltinOwned(fxpar.Feature):
        name = "my_zero"
        options = {"zero": fxpar.Option(0)}
    with pytest.raises(fxpar.StrategyError, match=r"'my_zero'.*'zero'.*feature 'zero' \(fxpar.features.zero\) owns"):
        fxpar.register_feature(BuiltinOwned)

    class Shared(fxpar.Feature):
        name = "my_sync"
        options = {"grad_sync": fxpar.Option("allreduce")}
    with pytest.raises(fxpar.StrategyError, match=r"'my_sync'.*'grad_sync'.*several features share.*enabled_by"):
        fxpar.register_feature(Shared)

    class Taken(fxpar.Feature):
        name = "ef16"
    with pytest.raises(fxpar.StrategyError, match=r"named 'ef16'.*custom_strategy.*already registered"):
        fxpar.register_feature(Taken)


@pytest.mark.structure
def test_conflicts_and_requirements_name_both_features(ex):
    class Rival(fxpar.Feature):
        name = "rival_sum"
        options = {"rival": fxpar.Option(False)}
        conflicts_with = ("ef16",)

    class Needy(fxpar.Feature):
        name = "needy"
        options = {"needy": fxpar.Option(False)}
        requires = ("ef16",)
    fxpar.register_feature(Rival)
    fxpar.register_feature(Needy)
    try:
        _refusals()
    finally:
        unregister_feature("rival_sum")
        unregister_feature("needy")


def _refusals():
    with pytest.raises(fxpar.StrategyError, match=r"feature 'rival_sum' \(rival=True\) conflicts with feature "
                                                  r"'ef16' \(ef_dtype='float16'\)"):
        fxpar.Strategy(dp=2, ef_dtype="float16", rival=True)
    with pytest.raises(fxpar.StrategyError, match=r"'needy' \(needy=True\) requires feature 'ef16' \(set one of its "
                                                  r"options: ef_dtype\)"):
        fxpar.Strategy(dp=2, needy=True)
    assert fxpar.Strategy(dp=2, ef_dtype="float16", needy=True).needy is True


@pytest.mark.structure
def test_bad_options_are_refused(ex):
    with pytest.raises(fxpar.StrategyError, match=r"Strategy\(ef_dtyp=...\): no registered feature owns option "
                                                  r"'ef_dtyp' \(did you mean 'ef_dtype'\?\)"):
        fxpar.Strategy(dp=2, ef_dtyp="float16")
    with pytest.raises(fxpar.StrategyError, match=r"ef_dtype='int3'"):
        fxpar.Strategy(dp=2, ef_dtype="int3")
    with pytest.raises(fxpar.StrategyError, match=r"needs dp >= 2 \(dp=1\)"):
        fxpar.Strategy(dp=1, ef_dtype="float16")
    # its conflicts_with: the refusal names both features and the options that enabled them
    with pytest.raises(fxpar.StrategyError, match=r"feature 'ef16' \(ef_dtype='float16'\) conflicts with feature "
                                                  r"'zero' \(zero=2\)"):
        fxpar.Strategy(dp=2, ef_dtype="float16", zero=2)
    with pytest.raises(fxpar.StrategyError, match=r"feature 'ef16' .* conflicts with feature 'herring' .*grad_sync='herring'"):
        fxpar.Strategy(dp=2, ef_dtype="float16", grad_sync="herring")


@pytest.mark.structure
def test_plan_json_with_an_unknown_section_or_field_is_refused(ex):
    data = json.loads(_program(_model(), _batches(1), dp=2, ef_dtype="float16").plan.to_json())
    data["features"]["ef16"]["bits"] = 3
    with pytest.raises(ValueError, match=r"section 'ef16' has unknown field\(s\) \['bits'\]; its fields: "
                                         r"\['bucket_numels', 'dtype'\]"):
        fxpar.Plan.from_json(json.dumps(data))
    data["features"] = {"no_such_feature": {}}
    with pytest.raises(ValueError,
                       match=r"unknown feature section 'no_such_feature'; the sections that exist: .*'ef16'"):
        fxpar.Plan.from_json(json.dumps(data))
    data.pop("features")
    data["zero_stage"] = 3
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['zero_stage'\]"):
        fxpar.Plan.from_json(json.dumps(data))


@dataclass
class _Unused(fxpar.PlanSection):
    x: int = 0


@pytest.mark.slow
@pytest.mark.structure
def test_a_section_round_trips_through_json():
    assert _Unused(3).to_dict() == {"x": 3} and _Unused(3).lines() == ["x=3"]
