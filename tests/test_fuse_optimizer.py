"""The traced Adam/AdamW update as one fused in-place kernel (``passes/fuse_optimizer.py``).

Capture traces the update as ``torch._foreach_*`` ops; where the update runs in place on CPU, each chain becomes
one ``_fused_adamw_`` / ``_fused_adam_`` call (torch.optim's ``fused=True`` kernel). Proven here: the kernel the
plan chooses and why; the graphs every road makes (one stage, cross-iteration per bucket, dp x pp) carry one
fused call per update and no list op; N gloo ranks equal single-process torch training (float64, 1e-10) for
AdamW, Adam with L2 weight decay and ``fused=True``; a chain that is not the plan's is left alone; the cost model
costs the fused call as one pass over memory.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.optim import resolve_optimizer
from fxpar.testing import MLP, gpt_loss, max_abs_diff, reference_training, tiny_gpt, token_pairs

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
ADAM_L2 = (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05, "betas": (0.8, 0.95), "eps": 1e-6})
ADAMW_FUSED = (torch.optim.AdamW, {"lr": 1e-2, "fused": True})
SMALL = dict(partition_mb=0.004, credit_mb=0.008)


def _update_ops(gm):
    return [str(n.target).split(".")[1] for n in gm.graph.nodes if n.op == "call_function"
            and n.meta.get("fxpar_phase") == "optimizer" and ("_foreach_" in str(n.target) or "_fused_" in str(n.target))]


def _assert_matches(res, model, batches, loss_fn, opt):
    ref_losses, ref_state = reference_training(model, batches, loss_fn, opt)
    for a, b in zip(res.losses, ref_losses):
        assert abs(a - b) <= 1e-10 * max(1.0, abs(b))
    assert max_abs_diff(res.state_dict(), ref_state) <= 1e-10


# ---- the plan's choice ---------------------------------------------------------------------------------
@pytest.mark.structure
@pytest.mark.parametrize("opt,device,asynchronous,kernel,why", [
    (ADAMW, "cpu", False, "fused", "default"),
    (ADAMW_FUSED, "cpu", False, "fused", "fused=True asked"),
    ((torch.optim.Adam, {"lr": 1e-3, "fused": False}), "cpu", False, "foreach", "fused=False"),
    ((torch.optim.AdamW, {"lr": 1e-3, "foreach": True}), "cpu", False, "foreach", "foreach=True"),
    ((torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}), "cpu", False, "foreach", "Adam and AdamW only"),
    (ADAMW, "cuda", False, "foreach", "CPU only"),
    (ADAMW, "cpu", True, "foreach", "old weight versions"),
])
def test_kernel_choice_says_why(opt, device, asynchronous, kernel, why):
    got, reason = resolve_optimizer(opt).kernel(device, in_place=not asynchronous)
    assert got == kernel and why in reason, reason


@pytest.mark.structure
def test_fused_true_is_traced_now():
    """``fused=True`` keeps the optimizer in the graph (not eager on each rank); it only picks a kernel."""
    spec = resolve_optimizer(ADAMW_FUSED)
    assert spec.traced and not spec.why_not_traced


@pytest.mark.structure
def test_plan_and_explain_name_the_kernel():
    batches = token_pairs(3)
    p = fxpar.parallelize(tiny_gpt(), 1, batches[0], loss_fn=gpt_loss, optimizer=ADAMW)
    assert p.plan.optimizer["kernel"] == "fused" and p.plan.optimizer["hyper"]["weight_decay"] == 0.1
    assert "one fused kernel per update" in p.explain()
    off = fxpar.parallelize(tiny_gpt(), 1, batches[0], loss_fn=gpt_loss,
                            optimizer=(torch.optim.AdamW, {"lr": 1e-2, "fused": False}))
    assert "torch._foreach_* ops (fused=False asked" in off.explain() and "hyper" not in off.plan.optimizer
    mlp_batch = (torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64))
    asyn = fxpar.parallelize(MLP().double(), fxpar.ClusterSpec.local(2), mlp_batch, loss_fn=F.mse_loss, optimizer=ADAMW,
                             strategy=fxpar.Strategy(pp=2, schedule="pipedream", microbatches=2))
    assert asyn.plan.optimizer["kernel"] == "foreach"
    for s in range(2):       # weight stashing: the update stays functional, as list ops
        assert "_fused_adamw_" not in _update_ops(asyn.stages[s].graphs["STEP"].gm)


# ---- the graphs of every road ----------------------------------------------------------------------------
@pytest.mark.structure
def test_one_fused_call_per_bucket_under_cross_iteration():
    """ByteScheduler with cross-iteration overlap cuts the update per bucket and moves each into the next step's
    forward (``passes/comm_schedule.py``): each piece is one fused call there, and in the drain."""
    batches = token_pairs(3)
    p = fxpar.parallelize(tiny_gpt(), fxpar.ClusterSpec.local(2), batches[0], loss_fn=gpt_loss, optimizer=ADAMW,
                          strategy=fxpar.Strategy(dp=2, comm_schedule="bytescheduler", cross_iteration=True, **SMALL))
    n_buckets = len(p.plan.section("data_parallel").buckets[0])
    assert n_buckets > 2
    for kind in ("FULL", "DRAIN"):
        ops = _update_ops(p.stages[0].graphs[kind].gm)
        assert ops == ["_fused_adamw_"] * n_buckets, (kind, ops)
    assert _update_ops(p.stages[0].graphs["FIRST"].gm) == []      # the first step updates nothing of its own


@pytest.mark.slow
@pytest.mark.structure
def test_fused_in_pipeline_stage_graphs():
    """dp=2 x pp=2 with cross-iteration overlap: F_UPDATE (the previous STEP inside the first forward) and STEP
    carry fused calls only; plain 1F1B's STEP too."""
    batches = token_pairs(3, batch=8)
    p = fxpar.parallelize(tiny_gpt(), fxpar.ClusterSpec.local(4), batches[0], loss_fn=gpt_loss, optimizer=ADAMW,
                          strategy=fxpar.Strategy(dp=2, pp=2, microbatches=2, comm_schedule="bytescheduler", **SMALL))
    for s in range(2):
        for kind in ("F_UPDATE", "STEP"):
            ops = _update_ops(p.stages[s].graphs[kind].gm)
            assert ops and set(ops) == {"_fused_adamw_"}, (s, kind, ops)
    plain = fxpar.parallelize(tiny_gpt(), fxpar.ClusterSpec.local(2), batches[0], loss_fn=gpt_loss, optimizer=ADAMW,
                              strategy=fxpar.Strategy(pp=2, microbatches=2))
    assert all(_update_ops(plain.stages[s].graphs["STEP"].gm) == ["_fused_adamw_"] for s in range(2))


# ---- numerics: N gloo ranks equal single-process torch ---------------------------------------------------
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("opt", [ADAMW, ADAM_L2, ADAMW_FUSED], ids=["adamw", "adam_l2", "adamw_fused_true"])
def test_dp2_cross_iteration_fused_matches_single_process(clusters, opt):
    batches = token_pairs(3)
    model = tiny_gpt()
    p = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=gpt_loss, optimizer=opt,
                          strategy=fxpar.Strategy(dp=2, comm_schedule="bytescheduler", cross_iteration=True, **SMALL))
    name = "_fused_adamw_" if opt[0] is torch.optim.AdamW else "_fused_adam_"
    assert set(_update_ops(p.stages[0].graphs["FULL"].gm)) == {name}
    _assert_matches(p.run_local(batches, cluster=clusters.get(2)), model, batches, gpt_loss, opt)


@pytest.mark.numerics
@pytest.mark.parametrize("zero", [1, 3])
def test_dp2_zero_fused_on_chunks_matches_single_process(clusters, zero):
    """ZeRO-3's parameters are this rank's chunks (``param`` inputs): the fused call updates them in place. ZeRO-1's
    update reads a chunk the runtime cuts out of the whole parameter (``param_shard``), which it may not overwrite:
    the fused call updates a copy of each (explain() says so), the moments in place."""
    torch.manual_seed(0)
    model = MLP().double()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 16, generator=g, dtype=torch.float64), torch.randn(8, 8, generator=g, dtype=torch.float64))
               for _ in range(3)]
    p = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=F.mse_loss, optimizer=ADAMW,
                          strategy=fxpar.Strategy(dp=2, zero=zero))
    gm = p.stages[0].graphs["FULL"].gm
    assert _update_ops(gm) == ["_fused_adamw_"]
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default
              and n.meta.get("fxpar_phase") == "optimizer"]
    n_params = len(list(model.parameters()))
    assert len(copies) == (n_params if zero == 1 else 0)
    if zero == 1:
        assert all(c.args[0].op == "placeholder" for c in copies)
        assert "updates a copy of layers_0_weight_chunk (not a parameter or optimizer-state input)" in p.explain()
    _assert_matches(p.run_local(batches, cluster=clusters.get(2)), model, batches, F.mse_loss, ADAMW)


# ---- the matcher and the cost model ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.structure
def test_a_chain_the_plan_does_not_describe_is_left_alone():
    """The matcher checks every constant of the chain against the plan's hyperparameters: with other betas it
    finds nothing to fuse, and the graph is unchanged."""
    from passes.fuse_optimizer import find_adam_chains, fuse_adam
    batches = token_pairs(3)
    p = fxpar.parallelize(tiny_gpt(), 1, batches[0], loss_fn=gpt_loss, optimizer=ADAMW)
    cfg = p.plan.optimizer
    assert len(find_adam_chains(p.captured.gm, cfg)) == 1
    other = {**cfg, "hyper": {**cfg["hyper"], "beta2": 0.99}}
    gm = copy.deepcopy(p.captured.gm)
    before = gm.code
    assert find_adam_chains(gm, other) == [] and fuse_adam(gm, other) == (0, []) and gm.code == before
    adam = {**cfg, "name": "Adam"}            # the decoupled decay's p * (1 - lr * wd) is not Adam's L2 term
    assert find_adam_chains(gm, adam) == []


@pytest.mark.structure
def test_fused_call_costs_one_pass_over_memory():
    from cost_models.compute import graph_compute, node_cost
    from passes.fuse_optimizer import fused_chain_times
    batches = token_pairs(3)
    p = fxpar.parallelize(tiny_gpt(), 1, batches[0], loss_fn=gpt_loss, optimizer=ADAMW)
    gm = p.graphs(0)["step"]
    (fused,) = [n for n in gm.graph.nodes if "_fused_adamw_" in str(n.target)]
    param_bytes = sum(v.numel() * v.element_size() for v in p.payload(0).params.values())
    c = node_cost(fused)
    assert c.bytes == 7 * param_bytes and c.flops == 12 * param_bytes // 8 and c.op_class == "elementwise"
    dev = replace(fxpar.ClusterSpec.local(1).device, op_overhead_s=0.0)     # memory traffic alone: 7 passes vs 25
    chain = graph_compute(p.captured.gm, dev).times
    as_fused = fused_chain_times(p.captured.gm, chain, dev, p.plan.optimizer)
    opt_nodes = [n for n in p.captured.gm.graph.nodes if n.meta.get("fxpar_phase") == "optimizer"]
    t_chain, t_fused = sum(chain[n] for n in opt_nodes), sum(as_fused[n] for n in opt_nodes)
    assert t_fused < t_chain / 3
    # the planner's figure is the graph's: the fused call in the lowered graph costs what the planner booked
    final = graph_compute(gm, dev).times[fused]
    chains_last = [n for n in opt_nodes if as_fused[n] > 0 and n.target == torch.ops.aten._foreach_sub.List]
    assert len(chains_last) == 1 and abs(as_fused[chains_last[0]] - final) <= 1e-12


@pytest.mark.structure
def test_a_parameter_read_after_the_update_is_copied_first():
    """The in-place call would change what a view of the old parameter shows: a parameter read (here through a
    view) after the update is copied first, the copy updated, and the reader sees the old values, as in the
    functional graph (float64, 1e-15); the other parameters are updated in place."""
    from passes.fuse_optimizer import find_adam_chains, fuse_adam
    batches = token_pairs(3)
    p = fxpar.parallelize(tiny_gpt(), 1, batches[0], loss_fn=gpt_loss, optimizer=ADAMW)
    gm = copy.deepcopy(p.captured.gm)
    g = gm.graph
    (chain,) = find_adam_chains(gm, p.plan.optimizer)
    w = next(x for x in chain.params if x.meta["val"].dim() == 2)
    first_opt = next(n for n in g.nodes if n.meta.get("fxpar_phase") == "optimizer")
    with g.inserting_before(first_opt):
        view = g.call_function(torch.ops.aten.t.default, (w,))
    out = g.find_nodes(op="output")[0]
    with g.inserting_before(out):
        late = g.call_function(torch.ops.aten.sum.default, (view,))
    out.args = (tuple(out.args[0]) + (late,),)
    gm.recompile()
    functional = copy.deepcopy(gm)
    fused, notes = fuse_adam(gm, p.plan.optimizer)
    assert fused == 1 and notes == [f"{chain.last.name}: updates a copy of {w.name} ({late.name} reads it after the "
                                    "update)"], notes
    (call,) = [n for n in gm.graph.nodes if "_fused_adamw_" in str(n.target)]
    copied = [x for x in call.args[0] if x.target is torch.ops.aten.clone.default]
    assert [x.args[0] for x in copied] == [w]
    sig = p.captured.signature

    def inputs():
        torch.manual_seed(1)
        args = []
        for ph, (role, key) in zip(functional.graph.find_nodes(op="placeholder"), sig.inputs):
            v = ph.meta["val"]
            args.append(torch.tensor(1e-2, dtype=v.dtype) if role == "lr" else
                        torch.tensor(3.0, dtype=v.dtype) if role == "step" else
                        torch.randint(0, 32, tuple(v.shape)) if role in ("input", "target") else
                        torch.rand(tuple(v.shape), dtype=v.dtype))
        return args
    a, b = gm(*inputs()), functional(*inputs())
    assert len(a) == len(b) and torch.equal(a[-1], b[-1])          # the late reader saw the old parameter
    assert max(((u - v).abs() / (v.abs() + 1)).max().item() for u, v in zip(a, b)) < 1e-15


@pytest.mark.structure
def test_a_gradient_that_is_not_contiguous_is_copied_first():
    """ATen's CPU fused kernel walks each tensor's memory in order, whatever its strides: fed a transposed gradient
    beside a contiguous parameter it pairs the wrong elements (shown here on the kernel itself). A gradient traced
    with other strides (tensor parallelism's ``add`` of a tied weight's two gradients is one) is copied contiguous
    first; tests/test_tensor_parallel.py's tp=4 Tofu GPT runs through it."""
    from passes.fuse_optimizer import find_adam_chains, fuse_adam
    torch.manual_seed(0)
    p, gt, m, v = torch.randn(6, 8), torch.randn(8, 6).t(), torch.rand(6, 8), torch.rand(6, 8)
    outs = []
    for grad in (gt, gt.contiguous()):
        bufs = [p.clone(), m.clone(), v.clone()]
        torch.ops.aten._fused_adamw_.tensor_lr([bufs[0]], [grad], [bufs[1]], [bufs[2]], [], [torch.tensor(1.0)],
                                               lr=torch.tensor(0.1), beta1=0.9, beta2=0.99, weight_decay=0.0,
                                               eps=1e-8, amsgrad=False, maximize=False)
        outs.append(bufs[0])
    assert not torch.equal(outs[0], outs[1])           # the kernel ignores the strides: why the pass copies
    batches = token_pairs(3)
    p_ = fxpar.parallelize(tiny_gpt(), 1, batches[0], loss_fn=gpt_loss, optimizer=ADAMW)
    gm = copy.deepcopy(p_.captured.gm)
    (chain,) = find_adam_chains(gm, p_.plan.optimizer)
    k, grad = next((i, x) for i, x in enumerate(chain.grads) if x.meta["val"].dim() == 2)
    shape = tuple(grad.meta["val"].shape)
    grad.meta["val"] = torch.empty(shape[::-1], dtype=grad.meta["val"].dtype, device="meta").t()   # as if transposed
    fused, notes = fuse_adam(gm, p_.plan.optimizer)
    (call,) = [n for n in gm.graph.nodes if "_fused_adamw_" in str(n.target)]
    copied = call.args[1][k]
    assert fused == 1 and copied.target is torch.ops.aten.clone.default and copied.args[0] is grad
    assert copied.kwargs["memory_format"] == torch.contiguous_format
    assert f"{chain.last.name}: reads a contiguous copy of gradient {grad.name}" in notes
    assert all(x.target is not torch.ops.aten.clone.default for i, x in enumerate(call.args[1]) if i != k)
