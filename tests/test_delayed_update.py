"""ZeRO-Offload's one-step delayed parameter update: W(t+1) = W(t) - lr·grad f(W(t-1)),
checked against a single-process reference of that rule (fxpar.testing.async_reference, PipeDream-2BW's), with
plain data parallelism and composed with ZeRO stages 1-3 (ZeRO-Offload's layout: the update on each rank's chunks)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import meta as M
from fxpar.collectives import C10D
from fxpar.testing import MLP, gpt_loss, max_abs_diff, reference_training, regression_batches, tiny_gpt, token_batches
from fxpar.testing.async_reference import pipedream_2bw_reference

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
TOL = 1e-10


def _gpt_data(n):
    return tiny_gpt(), token_batches(n), gpt_loss


def _mlp_data(n):
    torch.manual_seed(0)
    return MLP().double(), regression_batches(n), F.mse_loss


@pytest.mark.numerics
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


@pytest.mark.structure
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


def _check_rule(clusters, prog, model, batches, loss_fn, opt, dp):
    res = prog.run_local(batches, cluster=clusters.get(dp))
    ref_losses, ref_state = pipedream_2bw_reference(model, batches, loss_fn, opt)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    sync_losses, _ = reference_training(model, batches, loss_fn, opt)
    assert abs(res.losses[1] - sync_losses[1]) > 1e-8          # not synchronous training


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("zero,dp,case", [
    (1, 2, "gpt_adamw"), (1, 4, "gpt_adamw"), (2, 2, "gpt_adamw"), (2, 4, "gpt_adamw"),
    (1, 4, "mlp_sgd_momentum"), (2, 4, "mlp_sgd_momentum"), (3, 2, "gpt_adamw"), (3, 4, "mlp_sgd_momentum")])
def test_delayed_update_on_zero_chunks_follows_its_rule(clusters, zero, dp, case):
    """ZeRO-Offload as the paper runs it: gradients reduce-scattered into each rank's chunk, the optimizer (state in
    host memory) on chunks, one step late. dp=4 pads some chunks (the MLP's 8-element biases do not, the GPT's
    odd shapes do)."""
    model, batches, loss_fn = (_gpt_data if case == "gpt_adamw" else _mlp_data)(4)
    opt = ADAMW if case == "gpt_adamw" else SGD_M
    prog = fxpar.parallelize(model, dp, batches[0], loss_fn, opt, strategy=fxpar.Strategy(
        dp=dp, zero=zero, offload=("optimizer",), delayed_update=True))
    _check_rule(clusters, prog, model, batches, loss_fn, opt, dp)


def _nodes(sg, pred):
    return [n for n in sg.gm.graph.nodes if pred(n)]


@pytest.mark.slow
@pytest.mark.structure
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_delayed_zero_structure(zero):
    """The steady step keeps one reduce-scatter per bucket, waited in its step and handed on as the carry; the update
    reads the carried chunks (last step's gradients) after the last backward node, on chunk-shaped parameters and
    state; stages 1-2 then all-gather the updated chunks (one per bucket); forward reads the parameters as given
    (stage 3: gathered from the chunks before the update). FIRST has no update; DRAIN only the update. Small
    buckets, so that there are several."""
    model, batches, loss_fn = _gpt_data(1)
    prog = fxpar.parallelize(model, 2, batches[0], loss_fn, ADAMW, strategy=fxpar.Strategy(
        dp=2, zero=zero, bucket_cap_mb=0.01, first_bucket_cap_mb=0.01, delayed_update=True))
    graphs = prog.stages[0].graphs
    assert sorted(graphs) == ["DRAIN", "FIRST", "FULL"]
    sg = graphs["FULL"]
    g = sg.gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    phs = dict(zip(g.find_nodes(op="placeholder"), sg.inputs))
    is_rs = lambda n: n.target is C10D.reduce_scatter_tensor.default              # noqa: E731
    is_ag = lambda n: n.target is C10D.all_gather_into_tensor.default             # noqa: E731
    rs = _nodes(sg, is_rs)
    n_buckets = len(prog.plan.section("data_parallel").buckets[0])
    assert n_buckets > 1 and len(rs) == n_buckets
    carries_in = [ph for ph, (r, _) in phs.items() if r == "carry"]
    carries_out = [o for o, (r, _) in zip(g.find_nodes(op="output")[0].args[0], sg.outputs) if r == "carry"]
    assert len(carries_in) == len(carries_out) == n_buckets
    assert all(o.target is C10D.wait_tensor.default and is_rs(o.args[0]) for o in carries_out)
    updates = _nodes(sg, lambda n: M.get(n, M.PHASE) == "optimizer" and ("_foreach_" in str(n.target)
                                                                          or "_fused_adamw_" in str(n.target)))
    # the model's backward (not the zero pass's gradient plumbing: slices of the chunks, the carried chunk's wait)
    last_bwd = max(_nodes(sg, lambda n: M.get(n, M.PHASE) == "backward" and M.get(n, M.PASS) != "zero"),
                   key=order.__getitem__)
    assert updates and min(order[n] for n in updates) > order[last_bwd]
    chunk_roles = {"param_shard"} if zero < 3 else {"param"}
    sizes = {k: c for k, (_, c) in prog.stages[0].joint.meta["fxpar_zero"]["keys"].items()}
    for ph, (role, key) in phs.items():
        if role in chunk_roles:
            assert tuple(ph.meta["val"].shape) == (sizes[key],)        # the update works on this rank's chunk
    reads_carry = set(carries_in)
    for n in g.nodes:                                                  # what the carried gradients reach
        if n.op == "call_function" and any(a in reads_carry for a in n.all_input_nodes):
            reads_carry.add(n)
    assert not [n for n in reads_carry if M.get(n, M.PHASE) in ("forward", "backward")]
    first_fwd = min(_nodes(sg, lambda n: M.get(n, M.PHASE) == "forward"), key=order.__getitem__)
    fwd_reads = {a for n in _nodes(sg, lambda n: M.get(n, M.PHASE) == "forward") for a in n.all_input_nodes}
    assert not (fwd_reads & reads_carry) and order[first_fwd] < min(order[n] for n in updates)
    if zero < 3:
        ags = _nodes(sg, is_ag)
        assert len(ags) == n_buckets and min(order[n] for n in ags) > max(order[n] for n in updates)
        assert {r for ph, (r, _) in phs.items() if ph in fwd_reads} >= {"param"}
    else:
        gathers = [n for n in _nodes(sg, is_ag) if M.get(n, M.PHASE) == "forward"]
        assert gathers and all(phs.get(n.args[0], ("",))[0] == "param" for n in gathers)
    assert not _nodes(graphs["FIRST"], lambda n: M.get(n, M.PHASE) == "optimizer")
    assert len(_nodes(graphs["FIRST"], is_rs)) == n_buckets
    assert not _nodes(graphs["DRAIN"], lambda n: M.get(n, M.PHASE) in ("forward", "backward"))
    assert {r for r, _ in graphs["DRAIN"].inputs} >= {"carry", "opt_state"}
    assert any("delayed_update with zero" in note for note in prog.plan.notes)


@pytest.mark.structure
def test_delayed_update_refuses_what_it_cannot_carry():
    with pytest.raises(fxpar.StrategyError, match="data parallelism"):
        fxpar.Strategy(dp=2, pp=2, delayed_update=True)
    with pytest.raises(fxpar.StrategyError, match="not yet composed with ZeRO's reduce-scatter"):
        fxpar.Strategy(dp=2, zero=2, comm_schedule="bytescheduler")
    with pytest.raises(fxpar.StrategyError, match="drop partition_mb and credit_mb"):
        fxpar.Strategy(dp=2, zero=1, delayed_update=True, partition_mb=1.0)
    model, batches, loss_fn = _mlp_data(1)
    with pytest.raises(fxpar.StrategyError, match="not possible here"):
        fxpar.parallelize(model, 2, batches[0], loss_fn, (torch.optim.RMSprop, {"lr": 1e-2}),
                          strategy=fxpar.Strategy(dp=2, delayed_update=True))
