"""ZeRO-1/2/3: the ``zero`` pass on every stage's joint graph.

Numerics: dp ranks with ZeRO reproduce single-process training (float64, 1e-10) on the tied GPT and an
MLP, with SGD-momentum and AdamW, at dp=2 and 4, with gradient accumulation, under pp=2 x dp=2, and with
parameters whose size dp does not divide. Bytes: each rank's parameters, gradient accumulators and
optimizer state equal the paper's formulas; communication per step is 2Ψ (stages 1, 2) and 3Ψ (stage 3)
elements. Structure: one reduce_scatter per bucket, all_gathers where the stage says.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.collectives import collective_nodes
from fxpar.testing import (MLP, SkipMLP, gpt_loss, max_abs_diff, reference_training, regression_batches, tiny_gpt,
                           token_batches)
from fxpar.testing.resume import assert_resume_is_exact

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
TOL = 1e-10


class Odd(torch.nn.Module):
    """Parameters of 15, 3, 21 and 7 elements: dp=4 pads every chunk."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 3)
        self.b = torch.nn.Linear(3, 7)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _check(clusters, model, batches, loss_fn, optimizer, **strategy):
    strategy = fxpar.Strategy(**strategy)
    ref_losses, ref_state = reference_training(model, batches, loss_fn, optimizer)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(strategy.size), batches[0], loss_fn, optimizer,
                             strategy=strategy)
    res = prog.run_local(batches, cluster=clusters.get(strategy.size), measure_comm=True)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL, (res.losses, ref_losses)
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    return prog, res


# ---- numerics -----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_zero_gpt_adamw_matches_single_process(clusters, zero, dp):
    _check(clusters, tiny_gpt(), token_batches(3), gpt_loss, ADAMW, dp=dp, zero=zero, bucket_cap_mb=0.005)


@pytest.mark.numerics
@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_zero_mlp_sgd_momentum_matches_single_process(clusters, zero, dp):
    torch.manual_seed(0)
    _check(clusters, MLP().double(), regression_batches(3), F.mse_loss, SGD_M, dp=dp, zero=zero)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_with_gradient_accumulation(clusters, zero):
    """microbatches=2: F, B, RG, STEP graphs; stage 1 accumulates whole gradients, 2 and 3 their chunks."""
    prog, _ = _check(clusters, tiny_gpt(), token_batches(3, batch=16), gpt_loss, ADAMW, dp=2, zero=zero, microbatches=2)
    kinds = set(prog.stages[0].graphs)
    assert kinds == {"F", "B", "REDUCE_GRAD", "STEP"} | ({"UNSHARD"} if zero == 3 else set())
    rs_in = {k: sum(1 for n in collective_nodes(prog.stages[0].graphs[k].gm) if n.target.__name__.startswith(
        "reduce_scatter")) for k in kinds}
    assert (rs_in["REDUCE_GRAD"] > 0) == (zero == 1) and (rs_in["B"] > 0) == (zero >= 2)


@pytest.mark.numerics
def test_zero_padding_when_dp_does_not_divide_a_parameter(clusters):
    torch.manual_seed(0)
    model = Odd().double()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randn(8, 7, generator=g,
                                                                                 dtype=torch.float64))
               for _ in range(3)]
    for zero in (1, 3):
        _check(clusters, model, batches, F.mse_loss, ADAMW, dp=4, zero=zero)


@pytest.mark.slow
@pytest.mark.numerics
def test_zero1_under_pp2_dp2_tied_gpt(clusters):
    """The tied embedding/LM head is summed over the stages using it and stays whole; the rest is chunked."""
    model = tiny_gpt(layers=4)
    prog, _ = _check(clusters, model, token_batches(3, batch=16), gpt_loss, ADAMW, pp=2, dp=2, zero=1,
                     microbatches=2)
    meta = [s.joint.meta.get("fxpar_zero") for s in prog.stages]
    assert all(m and m["stage"] == 1 for m in meta)
    tied = set(prog.plan.tied)
    assert tied and not tied & {k for m in meta for k in m["keys"]}


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("schedule", ["1f1b", "zb1p"])
def test_zero3_under_pp2_dp2_gathers_once_per_stage_and_step(clusters, schedule):
    """Under a pipeline stage 3 gathers in the schedule's UNSHARD s (before the stage's first forward) and drops
    the whole parameters at RESHARD s (after its last backward): one all_gather per parameter and step, however
    many microbatches."""
    prog, res = _check(clusters, tiny_gpt(), token_batches(3, batch=16), gpt_loss, SGD_M, pp=2, dp=2, zero=3,
                       microbatches=4, schedule=schedule)
    for r in range(4):
        acts = [a.short() for a in prog.schedule(r)]
        s = prog.plan.rank_stages(r)[0]
        first = min(i for i, x in enumerate(acts) if x.startswith(("F", "B", "I", "W")))
        last = max(i for i, x in enumerate(acts) if x.startswith(("B", "W")))
        assert acts[first - 1] == f"UNSHARD{s}" and f"RESHARD{s}" in acts[last + 1:], acts
        keys = prog.stages[s].joint.meta["fxpar_zero"]["keys"]
        for calls in res.comm_calls[r]:
            assert [k for k, _ in calls].count("all_gather") == len(keys)
    assert "UNSHARD" in prog.stages[0].graphs and not any(
        x.target is torch.ops._c10d_functional.all_gather_into_tensor.default
        for k in ("F", "B", "I", "W") if k in prog.stages[0].graphs for x in prog.stages[0].graphs[k].gm.graph.nodes)


# ---- bytes per rank: the paper's formulas -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.numerics
def test_state_bytes_equal_the_papers_formulas(clusters):
    """Ψ parameters of b bytes, Adam's two states (K = 2b): dp alone (b + b + 2b)Ψ; stage 1 2bΨ + 2bΨ/N;
    stage 2 bΨ + 3bΨ/N; stage 3 4bΨ/N (Rajbhandari et al. SC'20 §5.1, with fp32 weights and no fp16 copy).
    Every MLP parameter has a multiple of 4 elements, so no chunk is padded."""
    torch.manual_seed(0)
    model = MLP()
    psi = sum(p.numel() for p in model.parameters())
    b, n = 4, 4
    batches = [(torch.randn(16, 16), torch.randn(16, 8)) for _ in range(2)]
    expect = {0: (b * psi, b * psi, 2 * b * psi), 1: (b * psi, b * psi, 2 * b * psi // n),
              2: (b * psi, b * psi // n, 2 * b * psi // n), 3: (b * psi // n, b * psi // n, 2 * b * psi // n)}
    for zero, (params, grads, opt) in expect.items():
        prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(n), batches[0], F.mse_loss, ADAMW,
                                 strategy=fxpar.Strategy(dp=n, zero=zero, microbatches=2))
        res = prog.run_local(batches, cluster=clusters.get(n))
        for r in range(n):
            got = res.state_bytes[r]
            assert (got["params"], got["grads"], got["optimizer"]) == (params, grads, opt), (zero, r, got)
            assert sum(got.values()) == {0: 16, 1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}[zero] * b * psi / 4


def _read_by_backward(captured) -> set:
    """Parameters the plain (unsharded) joint graph's backward reads, directly or through a forward view."""
    views = {torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten.transpose.int,
             torch.ops.aten.permute.default, torch.ops.aten.expand.default}
    out = set()
    for ph in captured.gm.graph.find_nodes(op="placeholder"):
        if ph.meta.get("fxpar_role") != "param":
            continue
        stack, seen = [ph], set()
        while stack:
            x = stack.pop()
            for u in x.users:
                if u.meta.get("fxpar_phase") == "backward":
                    out.add(ph.meta["fxpar_param"])
                elif u.target in views and u.meta.get("fxpar_phase") == "forward" and u not in seen:
                    seen.add(u)
                    stack.append(u)
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_communication_per_step_is_2psi_or_3psi(clusters, zero):
    """Measured on the ranks: reduce-scatter hands Ψ elements, each all-gather returns Ψ (N times its chunk):
    2Ψ for stages 1 and 2; stage 3 adds backward's gather, of the parameters backward reads (3Ψ in the paper,
    which counts every parameter; here the first layer's weight, whose input needs no gradient, and the
    biases, which backward never reads, are not gathered again)."""
    torch.manual_seed(0)
    model = MLP().double()
    n = 2
    numel = {k: p.numel() for k, p in model.named_parameters()}
    psi = sum(numel.values())
    prog, res = _check(clusters, model, regression_batches(2), F.mse_loss, ADAMW, dp=n, zero=zero)
    again = _read_by_backward(prog.stages[0].captured)
    assert "layers.0.weight" not in again and "layers.1.weight" in again and "layers.0.bias" not in again
    expect = 2 * psi + (sum(numel[k] for k in again) if zero == 3 else 0)
    for r in range(n):
        for calls in res.comm_calls[r]:
            kinds = {k for k, _ in calls}
            assert kinds == {"reduce_scatter", "all_gather"}
            moved = sum(nbytes * (n if kind == "all_gather" else 1) for kind, nbytes in calls) // 8
            assert moved == expect
    # structure: one reduce_scatter per bucket; stage 1/2 one all_gather per bucket, stage 3 two per parameter
    gm = prog.graphs(0)["step"]
    coll = [x.target.__name__.split(".")[0] for x in collective_nodes(gm)]
    n_buckets = len(prog.plan.section("data_parallel").buckets[0])
    assert coll.count("reduce_scatter_tensor") == n_buckets
    n_params = len(prog.plan.stage_params[0])
    assert coll.count("all_gather_into_tensor") == (n_buckets if zero < 3 else n_params + len(again))
    assert "all_reduce" not in coll and "all_reduce_" not in coll


@pytest.mark.structure
def test_zero3_graph_gathers_before_forward_and_again_before_backward():
    torch.manual_seed(0)
    prog = fxpar.parallelize(MLP().double(), fxpar.ClusterSpec.local(2), regression_batches(1)[0], F.mse_loss, ADAMW,
                             strategy=fxpar.Strategy(dp=2, zero=3))
    gm = prog.graphs(0)["step"]
    phases = {}
    for x in collective_nodes(gm):
        if x.target.__name__.startswith("all_gather"):
            phases.setdefault(x.args[0].name, []).append(x.meta["fxpar_phase"])
    assert phases == {"layers_0_weight": ["forward"], "layers_0_bias": ["forward"],
                      "layers_1_weight": ["forward", "backward"], "layers_1_bias": ["forward"],
                      "out_weight": ["forward", "backward"], "out_bias": ["forward"]}, phases
    # the parameter inputs are chunks; the optimizer updates chunks in place
    ph = {x.name: x for x in gm.graph.find_nodes(op="placeholder")}
    assert tuple(ph["layers_0_weight"].meta["val"].shape) == (32 * 16 // 2,)
    # backward derives its transposed weight from its own gather, so no whole weight lives across
    fwd_full = [x for x in gm.graph.nodes if x.meta.get("fxpar_phase") == "forward"
                and x.target is torch.ops.aten.view.default and x.args[0].target is torch.ops.aten.slice.Tensor
                and x.args[0].args[0].target is torch.ops._c10d_functional.wait_tensor.default]
    assert fwd_full and all(u.meta.get("fxpar_phase") == "forward" for f in fwd_full for u in f.users)


# ---- checkpoints hold whole tensors ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.numerics
def test_zero3_resume_is_bitwise_and_loads_without_zero(clusters, tmp_path):
    model, batches = tiny_gpt(), token_batches(4)
    strat = fxpar.Strategy(dp=2, zero=3)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], gpt_loss, ADAMW, strategy=strat)
    _, _, rest = assert_resume_is_exact(prog, batches, 2, clusters.get(2), tmp_path / "c")
    plain = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], gpt_loss, ADAMW,
                              strategy=fxpar.Strategy(dp=2))
    other = plain.run_local(batches[2:], cluster=clusters.get(2), resume_from=tmp_path / "c")
    assert max(abs(a - b) for a, b in zip(other.losses, rest.losses)) < TOL
    assert max_abs_diff(other.state_dict(), rest.state_dict()) < TOL


# ---- bad input ---------------------------------------------------------------------------------------
@pytest.mark.structure
def test_zero_refuses_what_it_cannot_shard():
    b = regression_batches(1)[0]
    with pytest.raises(fxpar.StrategyError, match="dp=1"):
        fxpar.Strategy(zero=1)
    with pytest.raises(fxpar.StrategyError, match="choose 0"):
        fxpar.Strategy(dp=2, zero=4)
    with pytest.raises(fxpar.StrategyError, match="RMSprop is not traced.*zero=0"):
        fxpar.parallelize(MLP().double(), 2, b, F.mse_loss, (torch.optim.RMSprop, {"lr": 1e-2}),
                          strategy=fxpar.Strategy(dp=2, zero=3))
    g = torch.Generator().manual_seed(2)
    skip_batch = (torch.randn(8, 16, generator=g, dtype=torch.float64), torch.randint(0, 4, (8,), generator=g))
    with pytest.raises(fxpar.StrategyError, match="synchronous schedules"):
        fxpar.parallelize(SkipMLP().double(), 4, skip_batch, F.cross_entropy, SGD_M,
                          strategy=fxpar.Strategy(dp=2, pp=2, zero=1, schedule="2bw", microbatches=2))
