"""fxpar.parallelize with pp > 1 returns a program of pipeline stages."""
import pytest
import torch

import fxpar
from fxpar.testing import GPT, gpt_loss, max_abs_diff, reference_training

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("dp,schedule", [(1, "gpipe"), (2, "1f1b")])
def test_parallelize_pipeline_matches_single_process(clusters, dp, schedule):
    model = GPT(layers=4).double()
    batches = [(torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))) for _ in range(3)]
    strategy = fxpar.Strategy(dp=dp, pp=2, schedule=schedule, microbatches=4 // dp)
    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(2 * dp), batches[0], loss_fn=gpt_loss,
                                optimizer=SGD_M, strategy=strategy)
    text = str(program.schedule(0))
    assert "F0.0" in text and "STEP0" in text
    assert set(program.graphs(0)) >= {"stage0.F", "stage0.B"}      # were stage0.forward / stage0.backward
    res = program.run_local(batches, cluster=clusters.get(2 * dp))
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, SGD_M)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) <= 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) <= 1e-10


@pytest.mark.slow
@pytest.mark.structure
def test_user_split_points_and_plan():
    """Split points reach the plan and explain(). A Plan is accepted for pipelines as for every strategy:
    a round-tripped plan gives the same cut
    and stages, and a plan that does not fit the strategy (a blank one-stage Plan for pp=2) is refused."""
    model = GPT(layers=4)
    x = torch.randint(0, 64, (8, 16))
    p = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), (x, x), loss_fn=gpt_loss,
                          strategy=fxpar.Strategy(pp=2, microbatches=4, split_points=["blocks.1"]))
    assert "blocks.1" in p.explain()
    assert p.plan.cuts == ["blocks.1"]
    q = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), (x, x), loss_fn=gpt_loss,
                          strategy=fxpar.Strategy(pp=2, microbatches=4), plan=fxpar.Plan.from_json(p.plan.to_json()))
    assert q.plan.cuts == ["blocks.1"] and q.plan.stage_params == p.plan.stage_params
    # a one-stage Plan handed to a pp=2 Strategy: refused, naming both meshes and the fix
    with pytest.raises(fxpar.StrategyError, match=r"the Plan's mesh_axes .* give dp=1, tp=1, pp=1, but "
                                                  r"Strategy\(.*pp=2.*\) asks for dp=1, tp=1, pp=2.*change dp/tp/pp"):
        fxpar.parallelize(model, fxpar.ClusterSpec.local(2), (x, x), loss_fn=gpt_loss,
                          strategy=fxpar.Strategy(pp=2, microbatches=4), plan=fxpar.Plan())
