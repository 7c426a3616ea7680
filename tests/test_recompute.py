"""Activation checkpointing : ``passes/recompute.py`` on every stage's joint graph.

Numerics: every policy trains as single-process training (float64, 1e-10) alone (one stage: dp=2, and two
microbatches) and with pp=2; with dropout, recompute is bit for bit the program without it (masks are saved,
never redrawn). Structure: ``full`` keeps one tensor per block boundary, and the bytes the runtime measures
equal the planner's prediction; ``auto`` meets its budget and names the smallest feasible one when refused.
Revolve's closed form equals a brute-force dynamic program."""
from __future__ import annotations

import functools
import json
import operator
import re

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.errors import StrategyError
from fxpar.testing import (BNConvNet, SkipMLP, ddp_reference, gpt_loss, max_abs_diff, reference_training,
                           regression_batches, tiny_gpt, token_batches)
from passes import recompute as R

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
MSE = torch.nn.functional.mse_loss
TOL = 1e-10
BUDGET_GB = 60e-6          # between the smallest feasible plan and keeping everything, for the test GPT


def _save_matmuls_and_norms(node):
    """A user's policy: keep matmul and layer-norm outputs, recompute the rest."""
    name = str(node.target)
    return "save" if any(k in name for k in ("mm", "layer_norm")) else "recompute"


def _strategy(policy, **kw):
    if policy == "auto":
        return fxpar.Strategy(recompute="auto", memory_budget_gb=BUDGET_GB, **kw)
    return fxpar.Strategy(recompute=policy, **kw)


def _run(clusters, model, batches, loss_fn, optimizer, strategy):
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(strategy.size), batches[0], loss_fn, optimizer,
                             strategy=strategy)
    res = prog.run_local(batches, cluster=clusters.get(strategy.size) if strategy.size > 1 else None)
    return prog, res


def _check(clusters, model, batches, loss_fn, optimizer, strategy):
    ref_losses, ref_state = reference_training(model, batches, loss_fn, optimizer)
    prog, res = _run(clusters, model, batches, loss_fn, optimizer, strategy)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL, (res.losses, ref_losses)
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    return prog, res


POLICIES = ["none", "full", "selective", "auto", _save_matmuls_and_norms]
LAYOUTS = {"dp2": dict(dp=2), "mb2": dict(microbatches=2), "pp2": dict(pp=2, microbatches=2)}


# ---- numerics: every policy, alone and with pp=2 -----------------------------------------------------------
_CASES = [(p, lay) for p in POLICIES for lay in LAYOUTS if p != "none" or lay == "mb2"]   # none: the baseline elsewhere


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("policy,layout", _CASES,
                         ids=[f"{p if isinstance(p, str) else 'callable'}-{lay}" for p, lay in _CASES])
def test_every_policy_matches_single_process_training(clusters, policy, layout):
    strategy = _strategy(policy, **LAYOUTS[layout])
    prog, res = _check(clusters, tiny_gpt(), token_batches(2, own_storage=True), gpt_loss, ADAMW, strategy)
    rc = prog.plan.section("recompute")
    if policy == "none":
        assert rc is None and "recompute" not in prog.plan.passes
        return
    assert prog.plan.passes[0] == "recompute"              # before data_parallel / bucket
    assert len(rc.stages) == prog.plan.n_stages
    copied = [n for st in prog.stages for n in st.joint.graph.nodes if "fxpar_recompute_of" in n.meta]
    assert copied and all(n.meta["fxpar_phase"] == "backward" and n.meta.get("fxpar_pass") == "recompute"
                          for n in copied)
    if policy == "auto" and layout != "dp2":              # F/B graphs: the runtime measures the saved bytes
        for s, b in res.peak_activation_bytes.items():
            assert b <= rc.budget_bytes, (s, b, rc)


@pytest.mark.numerics
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_skip_connection_model_with_pp2(clusters, policy):
    torch.manual_seed(0)
    prog, _ = _check(clusters, SkipMLP().double(), regression_batches(2, d_out=4), MSE, SGD_M, _strategy(policy, pp=2, microbatches=2))
    assert any("fxpar_recompute_of" in n.meta for st in prog.stages for n in st.joint.graph.nodes)


# ---- dropout: masks saved, never redrawn --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("layout", ["mb2", "pp2"])
def test_dropout_recompute_is_bitwise_the_program_without_it(clusters, layout):
    batches = token_batches(2, own_storage=True)
    _, base = _run(clusters, tiny_gpt(dropout=0.1), batches, gpt_loss, SGD_M, _strategy("none", **LAYOUTS[layout]))
    for policy in ("full", "selective", "auto"):
        prog, res = _run(clusters, tiny_gpt(dropout=0.1), batches, gpt_loss, SGD_M, _strategy(policy, **LAYOUTS[layout]))
        assert res.losses == base.losses, policy
        assert max_abs_diff(res.state_dict(), base.state_dict()) == 0.0, policy
        for st in prog.stages:
            fwd = {n.name: n for n in st.captured.gm.graph.nodes}
            origins = [fwd[n.meta["fxpar_recompute_of"]] for n in st.joint.graph.nodes if "fxpar_recompute_of" in n.meta]
            assert origins and not any(R.is_random(o) for o in origins)
            bern = [n for n in st.joint.graph.nodes if n.target is torch.ops.aten.bernoulli.p]
            if bern:          # the mask (or the mask scaled by 1/(1-p)) is one of F's saved values
                kept = {k for r, k in st.graphs["F"].outputs if r == "saved"}
                assert kept & ({bern[0].name} | {u.name for u in bern[0].users}), policy


# ---- BatchNorm: running statistics written once; its output recomputed from the saved batch statistics ------
_BN_OPS = (torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default,
           torch.ops.aten._batch_norm_with_update.default)


@pytest.mark.numerics
@pytest.mark.parametrize("policy", ["full", "selective", "auto"])
@pytest.mark.parametrize("dp", [1, 2])
def test_batch_norm_running_statistics_are_updated_once(clusters, policy, dp):
    """conv + BatchNorm2d + Linear, 3 SGD steps: parameters, running_mean/var and num_batches_tracked equal
    single-process torch (dp=1) or DDP's per-rank statistics (dp=2) to 1e-12; the BatchNorm runs once."""
    torch.manual_seed(0)
    model = BNConvNet().double()
    batches = [(torch.randn(8, 3, 8, 8, dtype=torch.float64), torch.randint(0, 10, (8,))) for _ in range(3)]
    sgd = (torch.optim.SGD, {"lr": 0.1})
    ref_losses, ref_state = (reference_training(model, batches, F.cross_entropy, sgd) if dp == 1
                             else ddp_reference(model, batches, F.cross_entropy, sgd, dp))
    kw = dict(memory_budget_gb=13e-6 / dp) if policy == "auto" else {}
    prog, res = _run(clusters, model, batches, F.cross_entropy, sgd, fxpar.Strategy(recompute=policy, dp=dp, **kw))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-12
    state = res.state_dict()
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert (state[k].double() - ref_state[k].double()).abs().max().item() < 1e-12, k
    assert max_abs_diff(state, ref_state) < 1e-12
    joint = prog.stages[0].joint.graph
    assert [n.meta["fxpar_phase"] for n in joint.nodes if n.target in _BN_OPS] == ["forward"]
    copied = [n for n in joint.nodes if "fxpar_recompute_of" in n.meta]
    assert copied
    if policy != "full":        # selective and auto recompute the BatchNorm's output, from its saved statistics
        fwd = {n.name: n for n in prog.stages[0].captured.gm.graph.nodes}
        assert any(fwd[n.meta["fxpar_recompute_of"]].args[0].target in _BN_OPS for n in copied
                   if fwd[n.meta["fxpar_recompute_of"]].target is operator.getitem)


@pytest.mark.structure
def test_a_policy_cannot_mark_a_batch_norm_for_recompute():
    """A BatchNorm in training mode writes its running statistics: no policy recomputes it, and a Plan that
    names it is refused by name."""
    x = torch.randn(4, 3, 8, 8)
    prog = fxpar.parallelize(BNConvNet(), 1, (x, torch.zeros(4, dtype=torch.long)), F.cross_entropy, SGD_M,
                             strategy=fxpar.Strategy(recompute=lambda n: "recompute"))
    bn = next(n for n in prog.stages[0].captured.gm.graph.nodes if n.target in _BN_OPS)
    assert R.writes_input(bn) and bn.name not in prog.plan.section("recompute").stages[0]["recompute"]
    plan = fxpar.Plan.from_json(prog.plan.to_json())
    plan.section("recompute").stages[0]["recompute"].append(bn.name)
    with pytest.raises(fxpar.errors.PassError, match=f"{bn.name} .*writes its input"):
        fxpar.parallelize(BNConvNet(), 1, (x, torch.zeros(4, dtype=torch.long)), F.cross_entropy, SGD_M,
                          strategy=fxpar.Strategy(recompute=lambda n: "recompute"), plan=plan)


# ---- structure: full keeps the block boundaries; measured bytes equal the prediction -----------------------
@pytest.mark.slow
@pytest.mark.numerics
def test_full_saves_block_boundaries_and_measured_bytes_equal_predicted():
    layers, batches = 4, token_batches(2, own_storage=True)
    figures = {}
    for policy in ("none", "full", "selective"):
        prog, res = _run(None, tiny_gpt(layers=layers), batches, gpt_loss, SGD_M, _strategy(policy, microbatches=2))
        st = prog.stages[0]
        roles = {ph.name: r for ph, (r, _) in zip(st.captured.gm.graph.find_nodes(op="placeholder"),
                                                  st.captured.signature.inputs)}
        names = prog.plan.section("recompute").stages[0]["recompute"] if policy != "none" else []
        _, saved = R.demands(st.captured.gm, names)
        predicted = R.saved_bytes(saved, roles)
        assert res.peak_activation_bytes[0] == predicted, policy
        if policy != "none":
            assert prog.plan.section("recompute").stages[0]["saved_bytes"] == predicted
        f_saved = [k for r, k in st.graphs["F"].outputs if r == "saved"]
        assert sorted(f_saved) == sorted(n.name for n in saved)
        acts = [n for n in saved if roles.get(R._root(n).name) not in ("param", "buffer")]
        figures[policy] = (predicted, len(f_saved), acts)
    (none_b, none_n, _), (full_b, full_n, full_acts), (sel_b, sel_n, _) = (figures[p] for p in ("none", "full", "selective"))
    assert full_b < sel_b < none_b and full_n < none_n and sel_n < none_n
    # full: one (batch, seq, d) tensor per block boundary -- the input of each block and the last one's output
    b, t, d = 4, 8, 16
    hidden = [n for n in full_acts if tuple(n.meta["val"].shape) == (b, t, d) and not n.name.startswith("getitem")]
    assert len(hidden) == layers + 1, [n.name for n in hidden]
    # the rest: the batch (input, target), the final norm's output, the logits and the loss's total weight
    rest = [n for n in full_acts if n not in hidden]
    assert len(rest) == 5 and {"input0", "target0"} <= {n.name for n in rest}, [n.name for n in rest]
    assert {n.meta.get("fxpar_module") for n in rest} >= {"ln_f", "head"}


# ---- auto: meets the budget; refuses one below the smallest feasible plan ------------------------------------
@pytest.mark.slow
@pytest.mark.numerics
def test_auto_meets_budget_with_least_recompute():
    batches = token_batches(2, own_storage=True)
    prog, res = _run(None, tiny_gpt(layers=4), batches, gpt_loss, SGD_M,
                     fxpar.Strategy(recompute="auto", memory_budget_gb=100e-6, microbatches=2))
    entry = prog.plan.section("recompute").stages[0]
    assert res.peak_activation_bytes[0] == entry["saved_bytes"] <= prog.plan.section("recompute").budget_bytes
    assert entry["smallest_bytes"] <= entry["saved_bytes"]
    full, _ = _run(None, tiny_gpt(layers=4), batches, gpt_loss, SGD_M, _strategy("full", microbatches=2))
    full_entry = full.plan.section("recompute").stages[0]
    # the budget is above full's bytes: auto buys less recompute than full with it, and keeps fewer bytes than none
    assert full_entry["saved_bytes"] <= prog.plan.section("recompute").budget_bytes
    assert entry["recompute_flops"] < full_entry["recompute_flops"]
    assert 0 < entry["recompute_flops"]
    assert json.loads(prog.plan.to_json())["features"]["recompute"]["policy"] == "auto"


@pytest.mark.slow
@pytest.mark.structure
def test_auto_refuses_a_budget_below_the_smallest_plan_and_names_it():
    batches = token_batches(1, own_storage=True)
    with pytest.raises(StrategyError, match="below the smallest feasible plan") as e:
        fxpar.parallelize(tiny_gpt(), 1, batches[0], gpt_loss, SGD_M,
                          strategy=fxpar.Strategy(recompute="auto", memory_budget_gb=1e-9, microbatches=2))
    smallest = int(re.search(r"plan: (\d+) bytes", str(e.value)).group(1))
    prog = fxpar.parallelize(tiny_gpt(), 1, batches[0], gpt_loss, SGD_M,        # exactly that budget is feasible
                             strategy=fxpar.Strategy(recompute="auto", memory_budget_gb=smallest / 1e9, microbatches=2))
    assert prog.plan.section("recompute").stages[0]["saved_bytes"] == smallest


@pytest.mark.structure
def test_bad_recompute_arguments_are_refused():
    with pytest.raises(StrategyError, match="choose one of"):
        fxpar.Strategy(recompute="everything")
    with pytest.raises(StrategyError, match="needs memory_budget_gb"):
        fxpar.Strategy(recompute="auto")
    with pytest.raises(fxpar.errors.PassError, match="returned 'offload' for node"):
        fxpar.parallelize(tiny_gpt(), 1, token_batches(1, own_storage=True)[0], gpt_loss, SGD_M,
                          strategy=fxpar.Strategy(recompute=lambda n: "offload", microbatches=2))


@pytest.mark.slow
@pytest.mark.numerics
def test_callable_policy_is_recorded_by_name_and_the_plan_drives_a_rebuild():
    batches = token_batches(2, own_storage=True)
    prog, res = _run(None, tiny_gpt(), batches, gpt_loss, SGD_M, _strategy(_save_matmuls_and_norms, microbatches=2))
    plan = fxpar.Plan.from_json(prog.plan.to_json())
    assert plan.section("recompute").policy == "callable:_save_matmuls_and_norms"
    again = fxpar.parallelize(tiny_gpt(), 1, batches[0], gpt_loss, SGD_M, strategy=fxpar.Strategy(microbatches=2), plan=plan)
    assert again.plan.section("recompute").stages == prog.plan.section("recompute").stages
    res2 = again.run_local(batches)
    assert res2.losses == res.losses and res2.peak_activation_bytes == res.peak_activation_bytes


# ---- Revolve ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _brute_force(n: int, c: int) -> int:
    """Least forward steps to reverse ``n`` steps holding ``c`` checkpoints (one holds the start), by trying
    every place for the next checkpoint: advance j steps, store, reverse the n-j after it with c-1 slots,
    then the first j with c."""
    if n == 1:
        return 0
    if c == 1:
        return n - 1 + _brute_force(n - 1, 1)          # restart from the only checkpoint for each step
    return min(j + _brute_force(n - j, c - 1) + _brute_force(j, c) for j in range(1, n))


@pytest.mark.structure
def test_revolve_closed_form_equals_brute_force():
    for c in range(1, 7):
        for n in range(1, 61):
            assert R.revolve_forward_steps(n, c) == _brute_force(n, c), (n, c)
    # closed forms: one checkpoint recomputes from the start, n(n-1)/2; n = β(c, r) costs r·n − β(c+1, r−1)
    assert [R.revolve_forward_steps(n, 1) for n in range(1, 7)] == [0, 1, 3, 6, 10, 15]
    assert R.revolve_forward_steps(10, 3) == 2 * 10 - 5          # β(3, 2) = C(5, 3) = 10 steps: r = 2, β(4, 1) = 5
    assert R.revolve_forward_steps(20, 3) == 3 * 20 - 15         # β(3, 3) = 20 steps: r = 3, β(4, 2) = 15
