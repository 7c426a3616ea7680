"""ZeRO-Offload's one-step delayed parameter update (issue 10 part 4): W(t+1) = W(t) - lr·grad f(W(t-1)),
checked against a single-process reference of that rule (fxpar.testing.async_reference, PipeDream-2BW's)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.testing import GPT, MLP, gpt_loss, max_abs_diff, reference_training, token_batches
from fxpar.testing.async_reference import pipedream_2bw_reference

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
TOL = 1e-10


def _gpt_data(n):
    torch.manual_seed(0)
    model = GPT(vocab=32, d=16, layers=2, heads=2).double()
    out = token_batches(n)
    return model, out, gpt_loss


def _mlp_data(n):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    return MLP().double(), [(torch.randn(8, 16, generator=g, dtype=torch.float64),
                             torch.randn(8, 8, generator=g, dtype=torch.float64)) for _ in range(n)], F.mse_loss


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("case", [("gpt", ADAMW), ("mlp", SGD_M)], ids=["gpt_adamw", "mlp_sgd_momentum"])
def test_delayed_update_follows_its_rule(clusters, case, dp):
    kind, opt = case
    model, batches, loss_fn = (_gpt_data if kind == "gpt" else _mlp_data)(4)
    prog = fxpar.parallelize(model, dp, batches[0], loss_fn, opt, strategy=fxpar.Strategy(dp=dp, delayed_update=True))
    res = prog.run_local(batches, cluster=clusters.get(dp))
    ref_losses, ref_state = pipedream_2bw_reference(model, batches, loss_fn, opt)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    # and it is not synchronous training: the second step already computes with the first step's weights
    sync_losses, _ = reference_training(model, batches, loss_fn, opt)
    assert abs(res.losses[0] - sync_losses[0]) < TOL and abs(res.losses[1] - sync_losses[1]) > 1e-8


def test_steady_step_computes_with_the_parameters_before_the_update():
    model, batches, loss_fn = _mlp_data(1)
    prog = fxpar.parallelize(model, 2, batches[0], loss_fn, SGD_M, strategy=fxpar.Strategy(dp=2, delayed_update=True))
    sg = prog.stages[0].graphs["FULL"]
    g = sg.gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    params = {ph for ph, (role, _) in zip(g.find_nodes(op="placeholder"), sg.inputs) if role == "param"}
    first_fwd = min((n for n in g.nodes if n.meta.get("fxpar_phase") == "forward"), key=order.__getitem__)
    assert all(a in params or a.op != "call_function" for a in first_fwd.all_input_nodes if a.op != "get_attr")
    last_bwd = max((n for n in g.nodes if n.meta.get("fxpar_phase") == "backward"), key=order.__getitem__)
    updates = [n for n in g.nodes if n.meta.get("fxpar_phase") == "optimizer" and "foreach" in str(n.target)]
    assert updates and min(order[n] for n in updates) > order[first_fwd]
    assert max(order[n] for n in updates) > order[last_bwd]
    assert "delayed_update" in " ".join(prog.plan.notes)


def test_delayed_update_refuses_what_it_cannot_carry():
    with pytest.raises(fxpar.StrategyError, match="data parallelism"):
        fxpar.Strategy(dp=2, pp=2, delayed_update=True)
    with pytest.raises(fxpar.StrategyError, match="data parallelism"):
        fxpar.Strategy(dp=2, zero=2, delayed_update=True)
    model, batches, loss_fn = _mlp_data(1)
    with pytest.raises(fxpar.StrategyError, match="not possible here"):
        fxpar.parallelize(model, 2, batches[0], loss_fn, (torch.optim.RMSprop, {"lr": 1e-2}),
                          strategy=fxpar.Strategy(dp=2, delayed_update=True))
