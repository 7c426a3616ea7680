"""Loss semantics across shards and microbatches (docs/semantics.md).

The global batch is cut into dp shards x m microbatches. With ``ignore_index`` spread unevenly over
those pieces, averaging each piece's mean is not single-process training; fxpar's default for a loss
it can see (cross-entropy / NLL) is the global-batch semantics: each piece adds its sum, divided by
the global batch's count of counted targets. ``loss_average="per_shard"`` keeps torch DDP's mean of
the pieces' means. Both are checked against their single-process definitions, under dp=2, a 2-stage
pipeline with microbatches, gradient accumulation and dp x pp, with ``reduction="mean"`` and ``"sum"``.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.testing.reference import ddp_reference, max_abs_diff, reference_training

TOL = 1e-10
SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
CE = F.cross_entropy


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5)).double()


def _batches(n=3, rows=8, ignored=(0, 1, 2, 5), seed=1, ignore_index=-100):
    """Targets ignored unevenly: rows ``ignored`` of each batch (the first quarter entirely, 3 of the first half)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(rows, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 5, (rows,), generator=g)
        y[list(ignored)] = ignore_index
        out.append((x, y))
    return out


def _run(clusters, model, batches, loss_fn, optimizer, **strategy):
    st = fxpar.Strategy(**strategy)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(st.size), batches[0], loss_fn, optimizer, strategy=st)
    res = prog.run_local(batches, cluster=clusters.get(st.size) if st.size > 1 else None)
    return prog, res


def _close(res, ref_losses, ref_state, tol=TOL):
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < tol, (res.losses, ref_losses)
    assert max_abs_diff(res.state_dict(), ref_state) < tol


STRATEGIES = {"dp2": dict(dp=2), "pp2_m2": dict(pp=2, microbatches=2), "accum_m4": dict(microbatches=4),
              "dp2_pp2": dict(dp=2, pp=2, microbatches=2)}


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", list(STRATEGIES.values()), ids=list(STRATEGIES))
def test_uneven_ignore_index_trains_like_single_process_by_default(clusters, strategy):
    model, batches = _model(), _batches()
    ref_losses, ref_state = reference_training(model, batches, CE, ADAMW)
    prog, res = _run(clusters, model, batches, CE, ADAMW, **strategy)
    _close(res, ref_losses, ref_state)
    assert any("global-batch mean" in n for n in prog.plan.notes), prog.plan.notes


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [dict(dp=2), dict(pp=2, microbatches=2)], ids=["dp2", "pp2_m2"])
def test_per_shard_is_ddp_mean_of_piece_means_and_differs_from_single_process(clusters, strategy):
    model, batches = _model(), _batches()
    k = strategy.get("dp", 1) * strategy.get("microbatches", 1)
    # DDP over k shards: contiguous blocks in the order dp ranks, then microbatches, take them
    ddp_losses, ddp_state = ddp_reference(model, batches, CE, SGD_M, dp=k)
    prog, res = _run(clusters, model, batches, CE, SGD_M, loss_average="per_shard", **strategy)
    _close(res, ddp_losses, ddp_state)
    ref_losses, ref_state = reference_training(model, batches, CE, SGD_M)
    assert abs(res.losses[0] - ref_losses[0]) > 1e-3          # the spread is uneven enough to matter
    assert max_abs_diff(res.state_dict(), ref_state) > 1e-4
    assert any("per_shard" in n for n in prog.plan.notes)


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [dict(dp=2), dict(pp=2, microbatches=2)], ids=["dp2", "pp2_m2"])
def test_reduction_sum_reports_and_trains_the_global_sum(clusters, strategy):
    model, batches = _model(), _batches()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    ref_losses, ref_state = reference_training(model, batches, loss_fn, SGD_M)
    _, res = _run(clusters, model, batches, loss_fn, SGD_M, **strategy)
    _close(res, ref_losses, ref_state)
    # per_shard: the mean of the pieces' sums -- 1/k of the real loss (DDP's semantics), said in the docs
    _, shard = _run(clusters, model, batches[:1], loss_fn, SGD_M, loss_average="per_shard", **strategy)
    k = strategy.get("dp", 1) * strategy.get("microbatches", 1)
    assert abs(shard.losses[0] * k - ref_losses[0]) < TOL


LOSSES = {
    "partial_ignore0_smoothing": (functools.partial(F.cross_entropy, ignore_index=0, label_smoothing=0.1), 0),
    "module_weight": (nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, 5, dtype=torch.float64)), -100),
    "nll_loss": (lambda: None, -100),   # replaced below: log_softmax model + F.nll_loss
}


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(LOSSES))
def test_every_visible_loss_option_is_global_under_dp(clusters, name):
    loss_fn, ignore = LOSSES[name]
    model = _model()
    if name == "nll_loss":
        model = nn.Sequential(*model, nn.LogSoftmax(dim=1))
        loss_fn = F.nll_loss
    batches = _batches(ignore_index=ignore)
    ref_losses, ref_state = reference_training(model, batches, loss_fn, ADAMW)
    _, res = _run(clusters, model, batches, loss_fn, ADAMW, dp=2)
    _close(res, ref_losses, ref_state)


@pytest.mark.numerics
def test_probability_targets_are_global(clusters):
    model = _model()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 6, generator=g, dtype=torch.float64),
                torch.softmax(torch.randn(8, 5, generator=g, dtype=torch.float64), 1)) for _ in range(2)]
    ref_losses, ref_state = reference_training(model, batches, CE, SGD_M)
    _, res = _run(clusters, model, batches, CE, SGD_M, dp=2)
    _close(res, ref_losses, ref_state)


@pytest.mark.numerics
def test_a_shard_with_no_counted_target_is_fine(clusters):
    """Every target of dp-rank 0's shard ignored: its own mean would be 0/0 = NaN; the global mean is not."""
    model, batches = _model(), _batches(ignored=(0, 1, 2, 3))
    ref_losses, ref_state = reference_training(model, batches, CE, SGD_M)
    _, res = _run(clusters, model, batches, CE, SGD_M, dp=2)
    _close(res, ref_losses, ref_state)


@pytest.mark.structure
def test_a_loss_fxpar_cannot_see_is_per_shard_with_a_note_and_global_is_refused():
    model, batches = _model(), _batches()

    def my_loss(out, y):
        return F.cross_entropy(out, y)

    prog = fxpar.parallelize(model, 2, batches[0], my_loss, SGD_M, strategy=fxpar.Strategy(dp=2))
    assert any("per_shard" in n and "my_loss" in n for n in prog.plan.notes), prog.plan.notes
    with pytest.raises(fxpar.StrategyError, match=r"loss_average='global'.*my_loss.*loss_average='per_shard'"):
        fxpar.parallelize(model, 2, batches[0], my_loss, SGD_M, strategy=fxpar.Strategy(dp=2, loss_average="global"))


@pytest.mark.structure
def test_graph_takes_the_global_count_as_a_target_column():
    model, batches = _model(), _batches()
    prog = fxpar.parallelize(model, 2, batches[0], CE, SGD_M, strategy=fxpar.Strategy(dp=2))
    sg = prog.stages[0].graphs["FULL"]
    assert [k for r, k in sg.inputs if r == "target"] == ["0", "1"]
    flat = prog._prepare(batches[0], "batches[0]")
    assert len(flat) == 3 and torch.equal(flat[2], torch.full((8,), 4.0, dtype=torch.float64))   # 4 targets count
    # one process, one piece: the loss is traced as written (no count column)
    one = fxpar.parallelize(model, 1, batches[0], CE, SGD_M)
    assert [k for r, k in one.stages[0].graphs["FULL"].inputs if r == "target"] == ["0"]
