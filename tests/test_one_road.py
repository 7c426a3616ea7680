"""One road: every strategy is a Plan of stages, one pass list over each stage's joint graph,
split into the graphs its schedule calls, run by one executor. These tests check that the road is
one: a user's pass runs on pipeline stages as on dp programs, gradient sync under dp x pp is the
bucket pass's collectives, a Plan edited by hand drives a pipeline, every strategy has the same
API, the runtime needs nothing from ``node.meta``, and zero-bubble and gradient accumulation
reproduce single-process training."""
from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.collectives import collective_nodes
from fxpar.testing import (SkipMLP, gpt_loss, max_abs_diff, reference_training, regression_batches, tiny_gpt,
                           token_batches)

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
CE = torch.nn.functional.cross_entropy
TOL = 1e-10


def _check(clusters, model, batches, loss_fn, optimizer, lr_scheduler=None, plan=None, **strategy):
    strategy = fxpar.Strategy(**strategy)
    ref_losses, ref_state = reference_training(model, batches, loss_fn, optimizer, lr_scheduler)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(strategy.size), batches[0], loss_fn, optimizer,
                             strategy=strategy, lr_scheduler=lr_scheduler, plan=plan)
    res = prog.run_local(batches, cluster=clusters.get(strategy.size) if strategy.size > 1 else None)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL, (res.losses, ref_losses)
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    return prog, res


# ---- a user's pass runs on every stage graph, on every strategy -----------------------------------------
class CountNodes(fxpar.Pass):
    name = "count_nodes"

    def run(self, gm, ctx):
        ctx.notes.append(f"count_nodes: stage {ctx.stage}: {len(gm.graph.nodes)} nodes")
        return fxpar.PassResult(gm, modified=False, info={"nodes": len(gm.graph.nodes)})


class TagLoss(fxpar.Pass):
    """Inserts ``mul(loss, 1.0)`` feeding the loss output: a node of its own, in the forward graph."""
    name = "tag_loss"

    def run(self, gm, ctx):
        sig = gm.meta["fxpar_signature"]
        out = gm.graph.find_nodes(op="output")[0]
        outs = list(out.args[0])
        idx = sig.index("loss", outputs=True)
        for i in idx:
            with gm.graph.inserting_before(out):
                new = gm.graph.call_function(torch.ops.aten.mul.Tensor, (outs[i], 1.0))
            new.meta.update({"val": outs[i].meta["val"], fxpar.meta.PHASE.name: "forward"})
            outs[i] = new
        out.args = (tuple(outs),)
        return fxpar.PassResult(gm, modified=bool(idx))


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [dict(pp=2, microbatches=4), dict(pp=2, dp=2, microbatches=2),
                                      dict(dp=2)], ids=["pp2", "dp2xpp2", "dp2"])
def test_custom_passes_run_on_every_stage_graph(clusters, strategy):
    prog, _ = _check(clusters, tiny_gpt(layers=4), token_batches(2, batch=8), gpt_loss, SGD_M,
                     passes=[CountNodes(), TagLoss()], **strategy)
    for rank in range(prog.world_size):
        hist = prog.history(rank)
        held = prog.plan.rank_stages(rank)
        for s in held:
            names = [h.pass_name for h in hist if h.info["stage"] == s]
            assert "count_nodes" in names and "tag_loss" in names, names
            assert [h for h in hist if h.info["stage"] == s and h.pass_name == "count_nodes"][0].info["nodes"] > 0
    last = prog.plan.n_stages - 1
    kind = "FULL" if prog.plan.n_stages == 1 else "F"
    tagged = [n for n in prog.stages[last].graphs[kind].gm.graph.nodes if n.meta.get("fxpar_pass") == "tag_loss"]
    assert len(tagged) == 1 and tagged[0].target is torch.ops.aten.mul.Tensor
    assert any("count_nodes: stage" in n for n in prog.stages[0].notes)


# ---- gradient sync under dp x pp: the bucket pass's collectives, in REDUCE_GRAD ------------------------
@pytest.mark.slow
@pytest.mark.numerics
def test_dp_pp_gradient_sync_is_the_bucket_collectives_in_backward_order(clusters):
    strategy = dict(pp=2, dp=2, microbatches=2, bucket_cap_mb=0.004)   # small buckets: several per stage
    prog, res = _check(clusters, tiny_gpt(layers=4), token_batches(2, batch=8), gpt_loss, ADAMW, **strategy)
    plan = prog.plan
    for s, stage in enumerate(prog.stages):
        rg = stage.graphs["REDUCE_GRAD"].gm
        comms = [n.meta["fxpar_comm"] for n in collective_nodes(rg)]
        buckets = plan.section("data_parallel").buckets[s]
        assert len(comms) == len(buckets) > 1
        for info, keys in zip(comms, buckets):
            group = plan.grad_groups[s][keys[0]]
            assert info.axis == group and info.kind == "all_reduce"
            nbytes = sum(int(torch.Size(stage.captured.param_shapes[k]).numel()) for k in keys) * 8
            assert info.nbytes == nbytes
        # issued in the order backward produces the gradients: each bucket's last gradient comes later
        grad_pos = {n.meta["fxpar_grad_of"]: i for i, n in enumerate(stage.captured.gm.graph.nodes)
                    if "fxpar_grad_of" in n.meta}
        last = [max(grad_pos[k] for k in keys) for keys in buckets]
        assert last == sorted(last)
        # nothing else in the stage's graphs communicates but sends/receives
        for kind, sg in stage.graphs.items():
            if kind != "REDUCE_GRAD":
                assert not collective_nodes(sg.gm), kind
    # the tied embedding is summed over every rank holding a stage that uses it, once per rank
    assert plan.tied == {"wte.weight": [0, 1]}
    assert plan.groups["tied.wte.weight"] == [[0, 1, 2, 3]]
    rank0 = [c for c in prog.collectives(0) if c.kind == "all_reduce"]
    assert sum(c.axis == "tied.wte.weight" for c in rank0) == 1


@pytest.mark.slow
@pytest.mark.numerics
def test_measured_collectives_equal_the_graphs(clusters):
    prog = fxpar.parallelize(tiny_gpt(layers=4), 4, token_batches(1)[0], gpt_loss, SGD_M,
                             strategy=fxpar.Strategy(pp=2, dp=2, microbatches=2))
    res = prog.run_local(token_batches(2), cluster=clusters.get(4), measure_comm=True)
    for r in range(4):
        want = [(c.kind, c.nbytes) for c in prog.collectives(r) if c.kind not in ("send", "recv")]
        assert res.comm_calls[r] == [want, want]


# ---- a Plan edited by hand drives a pipeline -----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.numerics
def test_plan_round_trip_with_an_edited_cut(clusters):
    model, batches = tiny_gpt(layers=4), token_batches(2)
    prog = fxpar.parallelize(model, 2, batches[0], gpt_loss, SGD_M, strategy=fxpar.Strategy(pp=2, microbatches=4))
    assert prog.plan.cuts == ["blocks.2"]
    text = prog.plan.to_json().replace('"blocks.2"', '"blocks.1"', 1)
    edited = fxpar.Plan.from_json(text)
    assert edited.cuts == ["blocks.1"]
    by_plan, res = _check(clusters, model, batches, gpt_loss, SGD_M, plan=edited, pp=2, microbatches=4)
    assert by_plan.plan.cuts == ["blocks.1"] and by_plan.split.cuts == ["blocks.1"]
    _, res2 = _check(clusters, model, batches, gpt_loss, SGD_M, pp=2, microbatches=4, split_points=["blocks.1"])
    assert res.losses == res2.losses
    sp = by_plan.plan.stage_params                                 # the stages follow the edited cut
    assert any(k.startswith("blocks.1.") for k in sp[1]) and not any(k.startswith("blocks.1.") for k in sp[0])


# ---- the same API for every strategy ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [dict(dp=2), dict(pp=2, microbatches=4), dict(pp=2, schedule="zb1p", microbatches=4),
                                      dict(pp=2, schedule="chimera", microbatches=4), dict(microbatches=2)],
                         ids=["dp2", "1f1b", "zb1p", "chimera", "accumulate"])
def test_lr_scheduler_tuple_and_same_api_everywhere(clusters, strategy):
    sched = (torch.optim.lr_scheduler.StepLR, {"step_size": 1, "gamma": 0.5})
    prog, res = _check(clusters, tiny_gpt(layers=4), token_batches(3), gpt_loss, ADAMW, lr_scheduler=sched, **strategy)
    est = prog.estimate()
    assert est.step_time_s > 0 and len(est.ranks) == prog.world_size
    text = prog.explain()
    assert "plan:" in text and "estimate" in text
    for r in range(prog.world_size):
        assert prog.graphs(r) and prog.schedule(r) and prog.history(r)
        assert isinstance(prog.collectives(r), list)
    assert fxpar.Plan.from_json(prog.plan.to_json()) == prog.plan


@pytest.mark.numerics
def test_2bw_plan_and_estimate(clusters):
    prog = fxpar.parallelize(SkipMLP().double(), 2, (torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 4, (8,))),
                             CE, SGD_M, strategy=fxpar.Strategy(pp=2, schedule="2bw", microbatches=2))
    assert prog.estimate().step_time_s > 0 and "asynchronous" in prog.explain()


# ---- the runtime reads no node.meta ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.numerics
def test_runtime_needs_no_node_meta(clusters):
    model, batches = tiny_gpt(layers=4), token_batches(2)
    prog = fxpar.parallelize(model, 2, batches[0], gpt_loss, ADAMW, strategy=fxpar.Strategy(pp=2, schedule="zb1p",
                                                                                            microbatches=4))
    ref = prog.run_local(batches, cluster=clusters.get(2))
    for stage in prog.stages:
        for sg in stage.graphs.values():
            for n in sg.gm.graph.nodes:
                n.meta.clear()
            sg.gm.recompile()
    res = prog.run_local(batches, cluster=clusters.get(2))
    assert res.losses == ref.losses and max_abs_diff(res.state_dict(), ref.state_dict()) == 0


# ---- zero bubble and gradient accumulation reproduce single-process training -----------------------------
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [dict(pp=2), dict(pp=4), dict(pp=2, dp=2)], ids=["pp2", "pp4", "pp2xdp2"])
def test_zb1p_matches_single_process(clusters, strategy):
    batch = 16 if strategy.get("dp") else 8
    prog, res = _check(clusters, tiny_gpt(layers=4), token_batches(3, batch=batch), gpt_loss, ADAMW, schedule="zb1p",
                       microbatches=4, **strategy)
    kinds = {k for s in prog.stages for k in s.graphs}
    assert kinds == {"F", "I", "W", "REDUCE_GRAD", "STEP"}


@pytest.mark.numerics
def test_zb1p_skip_connection_and_untraced_optimizer(clusters):
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 16, generator=g, dtype=torch.float64), torch.randint(0, 4, (8,), generator=g))
               for _ in range(3)]
    torch.manual_seed(0)
    _check(clusters, SkipMLP().double(), batches, CE, (torch.optim.RMSprop, {"lr": 1e-2}), pp=2, schedule="zb1p",
           microbatches=2)


@pytest.mark.slow
@pytest.mark.numerics
def test_gradient_accumulation_without_a_pipeline(clusters):
    prog, _ = _check(clusters, tiny_gpt(layers=4), token_batches(2, batch=16), gpt_loss, ADAMW, dp=2, microbatches=4)
    assert str(prog.schedule(0)).startswith("rank 0: F0.0 B0.0 F0.1 B0.1")


@pytest.mark.structure
def test_one_microbatch_dp_is_one_fused_graph():
    prog = fxpar.parallelize(tiny_gpt(layers=4), 2, token_batches(1)[0], gpt_loss, ADAMW, strategy=fxpar.Strategy(dp=2))
    assert list(prog.graphs(0)) == ["step"] and [a.short() for a in prog.schedule(0)] == ["FULL0.0"]


@pytest.mark.structure
def test_schedule_needs_a_pipeline():
    with pytest.raises(fxpar.StrategyError, match="needs a pipeline"):
        fxpar.parallelize(tiny_gpt(layers=4), 1, token_batches(1)[0], gpt_loss, SGD_M,
                          strategy=fxpar.Strategy(schedule="1f1b", microbatches=2))



# ---- found in review: several tied parameters, shared buffers with accumulation, a hand-written step order ----
class _TwoTied(torch.nn.Module):
    """Layers a and b used by both stages, in opposite orders: stage 0 runs a then b, stage 1 b then a, so each
    stage's backward produces their gradients in another order (four tied keys over one pair of ranks)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.l0, self.l1 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.l0(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return self.a(torch.tanh(self.b(torch.tanh(self.l1(h)))))


@pytest.mark.numerics
def test_several_tied_parameters_meet_in_the_same_order(clusters):
    torch.manual_seed(0)
    prog, _ = _check(clusters, _TwoTied().double(), regression_batches(3, d_in=8, seed=1), torch.nn.functional.mse_loss,
                     (torch.optim.SGD, {"lr": 0.1}), pp=2, microbatches=2, split_points=["l1"])
    assert len(prog.plan.tied) == 4
    # each tied group is its own process group, so its one collective per rank pairs with the right tensor
    assert {n for n, _ in prog.plan.all_groups()} >= {f"tied.{k}" for k in prog.plan.tied}


class _Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.bn, self.l1 = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.l1(torch.tanh(self.bn(self.l0(x))))


@pytest.mark.numerics
def test_batchnorm_with_gradient_accumulation_matches_torch():
    """torch accumulating over 2 microbatches: each forward updates the running statistics in turn."""
    import copy
    torch.manual_seed(0)
    model, batches, mse = _Normed().double(), regression_batches(3, d_in=8, seed=1), torch.nn.functional.mse_loss
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for x, y in batches:
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            loss = mse(ref(xs), ys) / 2
            loss.backward()
            total += float(loss.detach())
        opt.step()
        ref_losses.append(total)
    prog = fxpar.parallelize(model, 1, batches[0], mse, (torch.optim.SGD, {"lr": 0.1}),
                             strategy=fxpar.Strategy(microbatches=2))
    res = prog.run_local(batches)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref.state_dict()) < TOL       # running statistics included


@pytest.mark.numerics
def test_a_hand_written_step_order_that_would_use_an_unreduced_tied_gradient_is_refused(clusters):
    from fxpar.schedule import get_schedule

    class Shared(torch.nn.Module):      # a is used by stages 0 (rank 0), 1 and 3 (both rank 1, which reduces it in
        def __init__(self):             # stage 1: STEP3 must come after STEP1, which the swapped schedule breaks)
            super().__init__()
            self.a = torch.nn.Linear(8, 8, bias=False)
            self.l = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            h = self.l[0](torch.tanh(self.a(x)))
            h = self.a(torch.tanh(self.l[1](h)))
            h = self.l[2](torch.tanh(h))
            return self.a(torch.tanh(self.l[3](h)))

    torch.manual_seed(0)
    text = str(get_schedule("interleaved", 2, 4))
    swapped = text.replace("STEP0    STEP1", "STEP0    STEPX").replace("STEP2    STEP3", "STEP2    STEP1").replace(
        "STEPX", "STEP3")
    assert swapped != text
    prog = fxpar.parallelize(Shared().double(), 2, regression_batches(1, d_in=8, seed=1)[0], torch.nn.functional.mse_loss,
                             (torch.optim.SGD, {"lr": 0.1}), strategy=fxpar.Strategy(
                                 pp=2, schedule=swapped, microbatches=4, split_points=["l.1", "l.2", "l.3"]))
    with pytest.raises(fxpar.RankFailedError, match=r"STEP3 needs the reduced gradient of 'a.weight'.*STEP1 before STEP3"):
        prog.run_local(regression_batches(3, d_in=8, seed=1), cluster=clusters.get(2))
