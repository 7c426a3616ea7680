"""Parallax: sparse embedding gradients as (row index, row) pairs, dense ones all-reduced; under
plain SGD the pairs update the touched rows directly, under other optimizers they are summed into a dense gradient."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.collectives import C10D, collective_nodes
from fxpar.testing import Bag, bag_batches, max_abs_diff, reference_training

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
SGD = (torch.optim.SGD, {"lr": 0.5})
aten = torch.ops.aten
TOL = 1e-10


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("opt", [ADAMW, SGD_M], ids=["adamw", "sgd_momentum"])
def test_parallax_matches_single_process(clusters, dp, opt):
    torch.manual_seed(0)
    model, batches = Bag().double(), bag_batches(3)
    prog = fxpar.parallelize(model, dp, batches[0], F.cross_entropy, opt,
                             strategy=fxpar.Strategy(dp=dp, grad_sync="parallax"))
    res = prog.run_local(batches, cluster=clusters.get(dp), measure_comm=True)
    ref_losses, ref_state = reference_training(model, batches, F.cross_entropy, opt)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    routes = prog.plan.section("parallax").routes
    # the big table: 2·u·w (u <= 40/dp tokens per rank) against 2(N-1)/N·V·w; the 6-row table is cheaper all-reduced
    assert routes["emb.weight"]["route"] == "sparse" and routes["pos.weight"]["route"] == "dense"
    assert prog.plan.section("parallax").sparse == ["emb.weight"]
    assert not any("emb.weight" in b for b in prog.plan.section("data_parallel").buckets[0])
    # AdamW's moments / SGD's momentum buffer move rows with zero gradient: the dense gradient stays
    upd = prog.plan.section("parallax").sparse_update["emb.weight"]
    assert upd["route"] == "dense" and ("AdamW" in upd["why"] if opt is ADAMW else "momentum=0.9" in upd["why"])
    step = prog.graphs(0)["step"]
    dense = [x for x in step.graph.nodes if x.target is aten.index_add.default]
    assert len(dense) == 1 and dense[0].args[0].target is aten.new_zeros.default
    assert dense[0].meta["val"].shape == (1000, 16)
    # measured: per step each rank gathers its T token ids (int64) and T rows of 16 doubles in one all-gather;
    # the rest in buckets
    t = 8 // dp * 5
    for r in range(dp):
        for calls in res.comm_calls[r]:
            gathers = [n for k, n in calls if k == "all_gather"]
            assert gathers == [t * 8 + t * 16 * 8]
            assert sum(n for k, n in calls if k == "all_reduce") == (6 * 16 + 4 * 16 + 4) * 8


@pytest.mark.slow
@pytest.mark.numerics
def test_parallax_all_dense_when_the_table_is_small(clusters):
    torch.manual_seed(0)
    model, batches = Bag(vocab=8).double(), bag_batches(2, vocab=8)
    prog = fxpar.parallelize(model, 2, batches[0], F.cross_entropy, SGD_M,
                             strategy=fxpar.Strategy(dp=2, grad_sync="parallax"))
    assert prog.plan.section("parallax").sparse == []
    assert not any(x.meta["fxpar_comm"].kind == "all_gather" for x in collective_nodes(prog.graphs(0)["step"]))
    res = prog.run_local(batches, cluster=clusters.get(2))
    ref_losses, _ = reference_training(model, batches, F.cross_entropy, SGD_M)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL


@pytest.mark.structure
def test_parallax_refuses_pipelines():
    with pytest.raises(fxpar.StrategyError, match="data parallelism alone"):
        fxpar.Strategy(dp=2, pp=2, grad_sync="parallax")


def _dup_batches(n, batch=8, seq=5, vocab=1000):
    """Token 7 in every sequence (repeated within each rank's shard and across ranks), and one more repeat."""
    out = bag_batches(n, batch, seq, vocab)
    for ids, _ in out:
        ids[:, 0] = 7
        ids[0, 2] = ids[0, 1]
    return out


def _emb_placeholder(gm):
    return next(x for x in gm.graph.nodes if x.op == "placeholder" and x.meta.get("fxpar_param") == "emb.weight")


def _assert_rows_update(gm, dp):
    """Structure of the touched-rows route on one rank's step graph."""
    emb = _emb_placeholder(gm)
    nodes = list(gm.graph.nodes)
    # no dense [V, d] gradient anywhere: the only nodes of the table's shape are the parameter and its in-place update
    big = [x.name for x in nodes if x.op == "call_function" and isinstance(x.meta.get("val"), torch.Tensor)
           and x.meta["val"].shape == (1000, 16) and x.target is not aten.index_add_.default]
    assert big == []
    assert not any(x.target in (aten.embedding_dense_backward.default, aten.new_zeros.default, aten.index_add.default)
                   and x.meta.get("val") is not None and x.meta["val"].shape[0] == 1000 for x in nodes)
    # one update node for the table, in place, of the gathered rows scaled by lr; the foreach ops never see it
    upd = [x for x in nodes if x.target is aten.index_add_.default]
    assert len(upd) == 1 and upd[0].args[0] is emb and upd[0].kwargs == {}      # alpha 1: ATen's fast path
    ids, scaled = upd[0].args[2], upd[0].args[3]
    neg = scaled.args[1]
    assert scaled.target is aten.mul.Tensor and neg.target is aten.neg.default
    assert neg.args[0].op == "placeholder" and neg.args[0].name == "lr"
    # ids and rows: the two halves of one gathered byte buffer, cut apart and viewed back to int64 / float64
    gathers = [_gathered_by(ids), _gathered_by(scaled.args[0])]
    assert gathers[0] is gathers[1] and gathers[0].target is C10D.all_gather_into_tensor.default
    assert ids.meta["val"].dtype == torch.int64 and scaled.args[0].meta["val"].dtype == torch.float64
    assert upd[0].meta["val"].shape == (1000, 16) and scaled.meta["val"].shape == (8 // dp * 5 * dp, 16)
    foreach = [x for x in nodes if str(x.target).startswith("aten._foreach_")]
    assert foreach and all(emb not in a for x in foreach for a in x.args if isinstance(a, (list, tuple)))
    users = [u for u in emb.users if u.op == "call_function"]
    assert sorted(u.target.__name__ for u in users) == ["embedding.default", "index_add_.default"]
    # the table's gradient is no graph output; its new value is the parameter, updated in place
    sig = gm.meta["fxpar_signature"]
    assert ("grad", "emb.weight") not in sig.outputs and ("grad", "pos.weight") in sig.outputs
    out = dict(zip(sig.outputs, gm.graph.find_nodes(op="output")[0].args[0]))
    assert out[("new_param", "emb.weight")] is emb
    # collectives, in order: the dense rest's bucket, then one gather of the (id, row) pairs' bytes
    comms = [(x.meta["fxpar_comm"].kind, x.meta["fxpar_comm"].nbytes) for x in collective_nodes(gm)]
    t = 8 // dp * 5
    assert comms == [("all_reduce", (6 * 16 + 4 * 16 + 4) * 8), ("all_gather", t * 8 + t * 16 * 8)]


def _gathered_by(x):
    """The all-gather whose waited bytes ``x`` is a view, slice or copy of."""
    while x.target is not C10D.wait_tensor.default:
        assert x.target in (aten.view.default, aten.view.dtype, aten.clone.default, aten.slice.Tensor), x.target
        x = x.args[0]
    return x.args[0]


@pytest.mark.numerics
@pytest.mark.parametrize("dp", [2, 4])
def test_parallax_sgd_updates_only_the_touched_rows(clusters, dp):
    torch.manual_seed(0)
    model, batches = Bag().double(), _dup_batches(3)
    prog = fxpar.parallelize(model, dp, batches[0], F.cross_entropy, SGD,
                             strategy=fxpar.Strategy(dp=dp, grad_sync="parallax"))
    upd = prog.plan.section("parallax").sparse_update
    assert list(upd) == ["emb.weight"] and upd["emb.weight"]["route"] == "rows"
    text = prog.explain()
    assert "emb.weight" in text and "update rows: plain SGD" in text
    # explain()'s memory: the table has no dense gradient under the row update
    grads = next(line for line in text.splitlines() if line.strip().startswith("gradients"))
    dense = sum(p.numel() * 8 for k, p in model.named_parameters() if k != "emb.weight")
    from fxpar.explain import fmt_bytes
    assert grads.split()[1:3] == fmt_bytes(dense).split() and "no dense gradient for ['emb.weight']" in grads
    for r in range(dp):
        _assert_rows_update(prog.graphs(r)["step"], dp)
    res = prog.run_local(batches, cluster=clusters.get(dp), measure_comm=True)
    ref_losses, ref_state = reference_training(model, batches, F.cross_entropy, SGD)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    # rows no batch touched are bit-for-bit the initial ones; the touched ones moved
    touched = torch.cat([ids.flatten() for ids, _ in batches]).unique()
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[touched] = False
    final = res.state_dict()["emb.weight"]
    assert torch.equal(final[untouched], model.emb.weight.detach()[untouched])
    assert (final[touched] != model.emb.weight.detach()[touched]).any(dim=1).all()
    t = 8 // dp * 5
    for r in range(dp):
        for calls in res.comm_calls[r]:
            assert [n for k, n in calls if k == "all_gather"] == [t * 8 + t * 16 * 8]


@pytest.mark.structure
@pytest.mark.parametrize("opt, why", [((torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.01}), "weight_decay=0.01"),
                                      ((torch.optim.Adam, {"lr": 0.1}), "Adam keeps per-row state"),
                                      ((torch.optim.Adagrad, {"lr": 0.1}), "runs eagerly")],
                         ids=["sgd_wd", "adam", "eager"])
def test_parallax_dense_update_for_other_optimizers(opt, why):
    model, batches = Bag().double(), bag_batches(1)
    prog = fxpar.parallelize(model, 2, batches[0], F.cross_entropy, opt,
                             strategy=fxpar.Strategy(dp=2, grad_sync="parallax"))
    upd = prog.plan.section("parallax").sparse_update["emb.weight"]
    assert upd["route"] == "dense" and why in upd["why"]
    step = prog.graphs(0)["step"]
    assert not any(x.target is aten.index_add_.default for x in step.graph.nodes)
    assert ("grad", "emb.weight") in step.meta["fxpar_signature"].outputs


@pytest.mark.numerics
def test_parallax_microbatches_keep_the_dense_update(clusters):
    torch.manual_seed(0)
    model, batches = Bag().double(), _dup_batches(2)
    prog = fxpar.parallelize(model, 2, batches[0], F.cross_entropy, SGD,
                             strategy=fxpar.Strategy(dp=2, microbatches=2, grad_sync="parallax"))
    upd = prog.plan.section("parallax").sparse_update["emb.weight"]
    assert upd["route"] == "dense" and "microbatches=2" in upd["why"]
    res = prog.run_local(batches, cluster=clusters.get(2))
    ref_losses, ref_state = reference_training(model, batches, F.cross_entropy, SGD)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL


@pytest.mark.structure
def test_parallax_refuses_a_rows_update_the_optimizer_does_not_allow():
    model, batches = Bag().double(), bag_batches(1)
    prog = fxpar.parallelize(model, 2, batches[0], F.cross_entropy, SGD_M,
                             strategy=fxpar.Strategy(dp=2, grad_sync="parallax"))
    plan = fxpar.Plan.from_json(prog.plan.to_json())
    plan.section("parallax").sparse_update["emb.weight"]["route"] = "rows"
    with pytest.raises(fxpar.PassError, match=r"emb\.weight in its touched rows only.*'dense'.*plain SGD"):
        fxpar.parallelize(model, 2, batches[0], F.cross_entropy, SGD_M,
                          strategy=fxpar.Strategy(dp=2, grad_sync="parallax"), plan=plan)


class StridedBag(Bag):
    """The table reads every other token: its index tensor is strided (the pass copies it before packing)."""

    def forward(self, ids):
        ids = ids[:, ::2]
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        return self.head((self.emb(ids) + self.pos(pos)).mean(1))


@pytest.mark.numerics
def test_parallax_packs_a_strided_index(clusters):
    torch.manual_seed(0)
    model, batches = StridedBag().double(), bag_batches(3, seq=6)
    prog = fxpar.parallelize(model, 2, batches[0], F.cross_entropy, SGD, strategy=fxpar.Strategy(dp=2, grad_sync="parallax"))
    assert prog.plan.section("parallax").sparse == ["emb.weight"]
    copies = [x for x in prog.graphs(0)["step"].graph.nodes
              if x.target is aten.clone.default and x.kwargs.get("memory_format") == torch.contiguous_format]
    assert len(copies) == 1 and copies[0].users and next(iter(copies[0].users)).target is aten.reshape.default
    res = prog.run_local(batches, cluster=clusters.get(2))
    ref_losses, ref_state = reference_training(model, batches, F.cross_entropy, SGD)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
