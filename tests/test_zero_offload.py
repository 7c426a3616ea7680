"""ZeRO-Offload: the ``zero_offload`` pass (passes/zero_offload.py) after ``zero``.

Numerics: ``Strategy(dp=N, zero=1|2, offload=("optimizer",))`` trains like one process (float64, 1e-10) at dp=2
and dp=4, and with ``delayed_update=True`` follows the one-step delayed update rule. Structure: per bucket one
copy of its reduce-scattered chunk to the host right after the chunk's wait, the update reads only host values,
one copy back to the device per bucket right before its all-gather; the collectives are ZeRO's own, unchanged.
fxpar runs CPU ranks, so host and device are both the CPU: this proves the mechanism, not a memory saving.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import meta as M
from fxpar.collectives import C10D, collective_nodes
from fxpar.testing import MLP, gpt_loss, max_abs_diff, reference_training, regression_batches, tiny_gpt, token_batches
from fxpar.testing.async_reference import pipedream_2bw_reference

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3})
TOL = 1e-10
SMALL = dict(bucket_cap_mb=0.005, first_bucket_cap_mb=0.005)        # several buckets on the small GPT
COPY = torch.ops.aten._to_copy.default
OFFLOAD = ("optimizer",)


def _run(clusters, model, batches, loss_fn, opt, reference, **strategy):
    strategy = fxpar.Strategy(offload=OFFLOAD, **strategy)
    prog = fxpar.parallelize(model, strategy.size, batches[0], loss_fn, opt, strategy=strategy)
    assert prog.stages[0].joint.meta["fxpar_zero_offload"]["to_host"] > 0
    res = prog.run_local(batches, cluster=clusters.get(strategy.size))
    ref_losses, ref_state = reference(model, batches, loss_fn, opt)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL, (res.losses, ref_losses)
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    return res


# ---- numerics ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("dp", [2, 4])
def test_zero_offload_matches_single_process(clusters, zero, dp):
    _run(clusters, tiny_gpt(), token_batches(3, batch=8), gpt_loss, ADAMW, reference_training, dp=dp, zero=zero, **SMALL)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("zero,dp", [(1, 2), (2, 4)])
def test_zero_offload_delayed_update_follows_its_rule(clusters, zero, dp):
    """The paper's one-step delayed update (§4.2): the chunk copied to the host in step t is applied in step t+1.
    (``tests/test_delayed_update.py::test_delayed_update_on_zero_chunks_follows_its_rule`` runs the other
    zero x dp cases, all with ``offload=("optimizer",)``, so through this pass too.)"""
    model, batches = tiny_gpt(), token_batches(4, batch=8)
    res = _run(clusters, model, batches, gpt_loss, ADAMW, pipedream_2bw_reference, dp=dp, zero=zero,
               delayed_update=True, **SMALL)
    sync_losses, _ = reference_training(model, batches, gpt_loss, ADAMW)
    assert abs(res.losses[1] - sync_losses[1]) > 1e-8                # not synchronous training


@pytest.mark.numerics
def test_zero_offload_mlp_sgd_momentum_and_accumulation(clusters):
    """SGD-momentum, and microbatches=2 (F, B, REDUCE_GRAD, STEP graphs: the copies go with their wait)."""
    torch.manual_seed(0)
    _run(clusters, MLP().double(), regression_batches(3, batch=16), F.mse_loss, SGD_M, reference_training,
         dp=2, zero=2, microbatches=2)


@pytest.mark.slow
@pytest.mark.numerics
def test_zero3_with_optimizer_offload_matches_single_process(clusters):
    """Stage 3: the updated chunk stays on the host (the master); each gather copies it to the device first."""
    _run(clusters, tiny_gpt(), token_batches(3, batch=8), gpt_loss, ADAMW, reference_training, dp=2, zero=3, **SMALL)


# ---- structure -------------------------------------------------------------------------------------------
def _program(zero, **extra):
    model = tiny_gpt()
    return fxpar.parallelize(model, 2, token_batches(1, batch=8)[0], gpt_loss, ADAMW,
                             strategy=fxpar.Strategy(dp=2, zero=zero, **SMALL, **extra))


def _host_values(g, inputs) -> set:
    """Nodes whose value is in host memory: host-copies, the host-resident inputs, what is made from them alone."""
    host = {ph for ph, (role, _) in zip(g.find_nodes(op="placeholder"), inputs)
            if role in ("param_shard", "opt_state", "lr", "step", "carry")}
    for n in g.nodes:
        if n.op != "call_function":
            continue
        to_host = n.target is COPY and n.kwargs["device"] == torch.device("cpu")
        if to_host and n.args[0].target is C10D.wait_tensor.default:
            host.add(n)
        elif n.target is not COPY and n.all_input_nodes and all(a in host for a in n.all_input_nodes):
            host.add(n)
    return host


@pytest.mark.slow
@pytest.mark.structure
@pytest.mark.parametrize("zero,delayed", [(1, False), (2, False), (2, True)], ids=["1", "2", "2-delayed"])
def test_one_copy_per_bucket_each_way_and_the_update_on_host_values(zero, delayed):
    extra = dict(delayed_update=True) if delayed else {}
    prog, base = _program(zero, offload=OFFLOAD, **extra), _program(zero, **extra)
    sg = prog.stages[0].graphs["FULL"]
    g = sg.gm.graph
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    n_buckets = len(prog.plan.section("data_parallel").buckets[0])
    assert n_buckets > 1
    # the collectives are ZeRO's, unchanged in kind, number and order
    kinds = lambda gm: [n.target for n in collective_nodes(gm)]          # noqa: E731
    assert kinds(sg.gm) == kinds(base.stages[0].graphs["FULL"].gm)
    rs = [n for n in nodes if n.target is C10D.reduce_scatter_tensor.default]
    ags = [n for n in nodes if n.target is C10D.all_gather_into_tensor.default]
    assert len(rs) == len(ags) == n_buckets
    copies = [n for n in nodes if n.target is COPY]
    assert len(copies) == 2 * n_buckets
    for r in rs:                      # to the host: right after the wait, the wait's only reader
        (w,) = r.users
        assert list(w.users) == [nodes[pos[w] + 1]] and nodes[pos[w] + 1].target is COPY
        assert nodes[pos[w] + 1].kwargs["device"] == torch.device("cpu")
        assert M.get(nodes[pos[w] + 1], M.PHASE) == "backward"            # streamed with backward
    host = _host_values(g, sg.inputs)
    updates = [n for n in nodes if M.get(n, M.PHASE) == "optimizer" and ("_foreach_" in str(n.target)
                                                                     or "_fused_adam" in str(n.target))]
    assert updates
    for u in updates:                 # the update reads host values only
        assert all(a in host for a in u.all_input_nodes), (u.name, [a.name for a in u.all_input_nodes if a not in host])
    for ag in ags:                    # back to the device: one per bucket, right before its gather, of updated chunks
        back = ag.args[0]
        assert back.target is COPY and back.kwargs["device"] == torch.device("cpu") and nodes[pos[ag] - 1] is back
        assert back.args[0] in host and back.args[0].target is torch.ops.aten.cat.default
        assert min(pos[u] for u in updates) < pos[back]
    if delayed:                       # the host copies are what is carried to the next step's update
        outs = g.find_nodes(op="output")[0].args[0]
        carried = [o for o, (r, _) in zip(outs, sg.outputs) if r == "carry"]
        assert len(carried) == n_buckets and all(o.target is COPY for o in carried)
        first = prog.stages[0].graphs["FIRST"].gm.graph
        assert sum(n.target is COPY for n in first.nodes) == n_buckets   # FIRST streams, no update, nothing back


@pytest.mark.slow
@pytest.mark.structure
def test_split_graphs_keep_the_copies_with_their_wait():
    """microbatches=2, stage 1: the reduce-scatter and its wait run in REDUCE_GRAD and STEP; the copy to the host goes
    with the wait, the copy back with the gather in STEP."""
    prog = _program(1, offload=OFFLOAD, microbatches=2)
    graphs = prog.stages[0].graphs
    where = {k: sum(n.target is COPY for n in sg.gm.graph.nodes) for k, sg in graphs.items()}
    n_buckets = len(prog.plan.section("data_parallel").buckets[0])
    assert where["F"] == where["B"] == 0 and where["REDUCE_GRAD"] + where["STEP"] == 2 * n_buckets
    step = graphs["STEP"].gm.graph
    for ag in [n for n in step.nodes if n.target is C10D.all_gather_into_tensor.default]:
        assert ag.args[0].target is COPY


@pytest.mark.structure
def test_without_offload_the_pass_does_not_run():
    prog = _program(2)
    assert "zero_offload" not in prog.explain()
    assert "fxpar_zero_offload" not in prog.stages[0].joint.meta
    assert not [n for n in prog.stages[0].graphs["FULL"].gm.graph.nodes if n.target is COPY]
