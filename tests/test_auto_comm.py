"""The automatic planner's communication dimensions and recompute under a budget: ByteScheduler
(``comm_schedule="bytescheduler"``), Herring (``grad_sync="herring"``) and ``recompute="auto"``. Every candidate is a
Strategy the features accept; the pruned ranking still starts with the enumerated optimum; ByteScheduler and Herring
are picked where their own cost effect pays, and the built programs' estimates agree; the pins are checked; a
ByteScheduler pick trains like one process."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fxpar
from fxpar.auto.search import finalists, fixed_options
from fxpar.testing import GPT, gpt_loss, max_abs_diff, reference_training, tiny_gpt, token_batches

ADAMW = (torch.optim.AdamW, {"lr": 1e-2})
TOL = 1e-10


def _meta_gpt(vocab: int, batch: int = 32, seq: int = 1024):
    """A 12 x 768 GPT (GPT-2 small's blocks) on ``meta``, ``vocab`` tokens, global batch ``batch`` of ``seq``."""
    with torch.device("meta"):
        model = GPT(vocab=vocab, d=768, layers=12, heads=12, max_seq=seq)
    x = torch.randint(0, vocab, (batch, seq), device="meta")
    return model, (x, x)


def _gloo(preset: str, nodes: int, gpus: int) -> fxpar.ClusterSpec:
    """GPU nodes whose ranks talk over gloo: a flat ring through each node's one NIC (``cost_models.comm``)."""
    return dataclasses.replace(fxpar.ClusterSpec.preset(preset, nodes=nodes, gpus_per_node=gpus), backend="gloo")


def _front(cands: list) -> set:
    return {str(c) for c in cands if not any((o.step_s <= c.step_s and o.peak_bytes < c.peak_bytes) or
                                             (o.step_s < c.step_s and o.peak_bytes <= c.peak_bytes) for o in cands)}


@pytest.mark.structure
def test_every_candidate_is_a_strategy_the_features_accept():
    """On 2 simulated nodes of 2 ranks, the space holds ByteScheduler and Herring candidates, each only where its
    feature composes (dp alone, no ZeRO, no tp, no pipeline), and Strategy() accepts every candidate."""
    model, batches = tiny_gpt(), token_batches(1)
    got = fxpar.auto_plan(model, fxpar.ClusterSpec.local(4, nodes=2, devices_per_node=2), batches[0], gpt_loss,
                          ADAMW, prune=False).search
    bs = [c for c in got.priced if c.comm_schedule == "bytescheduler"]
    herring = [c for c in got.priced if c.grad_sync == "herring"]
    assert bs and herring
    assert all(c.dp > 1 and c.zero == 0 and c.tp == 1 and c.pp == 1 and c.microbatches == 1 for c in bs)
    assert all(c.dp == 4 and c.zero == 0 and c.tp == 1 and c.pp == 1 and c.comm_schedule == "fifo" for c in herring)
    for c in got.priced:
        s = c.strategy()
        assert s.comm_schedule == c.comm_schedule and s.grad_sync == (c.grad_sync or "allreduce")
    # one node: no Herring candidate
    one = fxpar.auto_plan(model, 4, batches[0], gpt_loss, ADAMW, prune=False).search
    assert not any(c.grad_sync == "herring" for c in one.priced)


@pytest.mark.cost
def test_pruning_keeps_the_enumerated_optimum_with_the_new_dimensions():
    """GPT-2 small on 2 gloo nodes of 4 H100s with 6 GiB each: ByteScheduler, Herring and recompute='auto' are in
    the space; the pruned ranking starts with the exhaustive sort's first and is exactly the Pareto front."""
    model, x = _meta_gpt(50257)
    cl = _gloo("h100-80gb", 2, 4)
    cl = dataclasses.replace(cl, device=dataclasses.replace(cl.device, memory_bytes=6 * 2**30))
    pruned = fxpar.auto_plan(model, cl, x, gpt_loss, ADAMW)
    full = fxpar.auto_plan(model, cl, x, gpt_loss, ADAMW, prune=False)
    priced = full.search.priced
    assert any(c.comm_schedule == "bytescheduler" for c in full)
    assert any(c.grad_sync == "herring" for c in full)
    assert any(c.recompute == "auto" for c in full)
    assert str(pruned[0]) == str(full[0])
    assert (pruned[0].step_s, pruned[0].peak_bytes) == min((c.step_s, c.peak_bytes) for c in full)
    assert {str(c) for c in pruned} == _front(list(full))
    # a recompute='auto' candidate fills the room the others leave it, and plans to that budget
    for c in (c for c in priced if c.recompute == "auto" and c.fits):
        assert c.peak_bytes <= full.search.budget_bytes
        assert c.strategy().memory_budget_gb == c.budget_gb and c.memory["activations"] == pytest.approx(
            c.budget_gb * 1e9, rel=1e-9)


@pytest.mark.cost
def test_recompute_auto_is_between_the_policies_where_none_does_not_fit():
    """dp=8 on 8 A100s of 6 GiB, one microbatch: 'none' does not fit; 'auto' under the room left is ranked first,
    slower than 'none' and faster than 'selective' and 'full', its memory at the budget."""
    model, x = _meta_gpt(50257)
    cl = fxpar.ClusterSpec.preset("a100-80gb", gpus_per_node=8)
    cl = dataclasses.replace(cl, device=dataclasses.replace(cl.device, memory_bytes=6 * 2**30))
    got = fxpar.auto_plan(model, cl, x, gpt_loss, ADAMW, prune=False,
                          strategy=fxpar.Strategy.auto(dp=8, microbatches=1, zero=0, comm_schedule="fifo",
                                                       precision="bf16"))
    by = {c.recompute: c for c in got.search.priced}
    assert not by["none"].fits and by["auto"].fits and got[0].recompute == "auto"
    assert by["none"].step_s < by["auto"].step_s < min(by["selective"].step_s, by["full"].step_s)
    assert by["auto"].peak_bytes == pytest.approx(got.search.budget_bytes, rel=1e-6)


@pytest.mark.cost
def test_bytescheduler_is_picked_where_it_pays():
    """A 12 x 768 GPT (small vocabulary: the blocks hold the gradients) on 2 p3.16xlarge (25 Gbps between them,
    V100s: no bf16): data parallelism over all 16 is comm-bound, and ByteScheduler's cross-iteration overlap --
    the first blocks' gradients sent first, waited in the next forward -- is the pick, over 2% ahead of its FIFO
    twin. On one NVLink node of A100s the gradients hide behind backward: FIFO."""
    model, x = _meta_gpt(256)
    got = fxpar.auto_plan(model, fxpar.ClusterSpec.preset("p3.16xlarge", nodes=2, gpus_per_node=8), x, gpt_loss,
                          ADAMW)
    pick = got[0]
    assert pick.comm_schedule == "bytescheduler" and pick.cross_iteration and pick.dp == 16
    twin = min((c for c in got.search.priced if c.comm_schedule == "fifo" and c.dp == 16 and c.zero == 0 and
                c.recompute == pick.recompute and c.microbatches == 1 and c.grad_sync is None),
               key=lambda c: c.step_s)
    assert pick.step_s < 0.98 * twin.step_s
    assert pick.memory["gradients"] == pytest.approx(3 * twin.memory["gradients"])     # carried in and out
    text = got.search.explain()
    assert "bytescheduler (cross-iteration)" in text and "why they lost" in text
    first, _ = finalists(got.search)            # its FIFO twin is a finalist beside it
    assert any(c.comm_schedule == "fifo" and c.family == pick.family for c in first)
    one = fxpar.auto_plan(model, fxpar.ClusterSpec.preset("a100-80gb", gpus_per_node=8), x, gpt_loss, ADAMW)
    assert one[0].comm_schedule == "fifo"


@pytest.mark.slow
@pytest.mark.cost
def test_the_bytescheduler_pick_is_faster_in_the_built_estimate():
    """The p3.16xlarge case above built both ways: the feature's own planning keeps cross-iteration overlap and
    estimate() puts ByteScheduler ahead of FIFO by about what the cheap cost says."""
    model, x = _meta_gpt(256)
    cl = fxpar.ClusterSpec.preset("p3.16xlarge", nodes=2, gpus_per_node=8)
    got = fxpar.auto_plan(model, cl, x, gpt_loss, ADAMW, prune=False)
    bs = next(c for c in got if c.comm_schedule == "bytescheduler" and c.recompute == "none" and c.dp == 16)
    fifo = next(c for c in got if c.comm_schedule == "fifo" and c.recompute == "none" and c.dp == 16 and
                c.zero == 0 and c.microbatches == 1 and c.grad_sync is None)
    built = {}
    for c in (bs, fifo):
        prog = fxpar.parallelize(model, cl, x, gpt_loss, ADAMW, strategy=c.strategy())
        built[c.comm_schedule] = prog.estimate().step_time_s
        if c is bs:
            assert prog.plan.section("bytescheduler").cross_iteration
    cheap_gain = 1 - bs.step_s / fifo.step_s
    built_gain = 1 - built["bytescheduler"] / built["fifo"]
    assert built_gain > 0.02 and abs(cheap_gain - built_gain) < 0.05, (cheap_gain, built_gain)


@pytest.mark.cost
def test_herring_is_picked_across_gloo_nodes_not_across_nccl_ones():
    """GPT-2 small on 2 nodes of 4 H100s. Over gloo (a flat ring through each node's one NIC) Herring's in-node
    reduce-scatter, cross-node sum of a quarter and in-node gather is the pick, over 10% ahead of the flat
    all-reduce. Over NCCL, whose all-reduce is already hierarchical across nodes, it only ties: not picked."""
    model, x = _meta_gpt(50257)
    got = fxpar.auto_plan(model, _gloo("h100-80gb", 2, 4), x, gpt_loss, ADAMW)
    pick = got[0]
    assert pick.grad_sync == "herring" and pick.dp == 8 and pick.bucket_mb is None      # its own bucket size
    flat = min((c for c in got.search.priced if c.grad_sync is None and c.dp == 8 and c.zero == 0 and c.fits and
                c.comm_schedule == "fifo" and c.recompute == pick.recompute and c.microbatches == 1
                and c.precision == pick.precision), key=lambda c: c.step_s)
    assert pick.step_s < 0.9 * flat.step_s
    assert "grad_sync=herring" in got.search.explain()
    nccl = fxpar.auto_plan(model, fxpar.ClusterSpec.preset("h100-80gb", nodes=2, gpus_per_node=4), x, gpt_loss,
                           ADAMW)
    assert nccl[0].grad_sync != "herring"


@pytest.mark.structure
def test_the_new_dimensions_are_pinned_and_bad_pins_named():
    model, batches = tiny_gpt(), token_batches(1)
    two_nodes = fxpar.ClusterSpec.local(4, nodes=2, devices_per_node=2)

    def plan(cluster, **pins):
        return fxpar.auto_plan(model, cluster, batches[0], gpt_loss, ADAMW, strategy=fxpar.Strategy.auto(**pins),
                               prune=False)
    got = plan(2, comm_schedule="bytescheduler")
    assert got and all(c.comm_schedule == "bytescheduler" for c in got.search.priced)
    got = plan(two_nodes, grad_sync="herring")
    assert got and all(c.grad_sync == "herring" for c in got.search.priced)
    got = plan(two_nodes, grad_sync=("allreduce", "herring"), comm_schedule="fifo")
    assert {c.grad_sync for c in got.search.priced} == {None, "herring"}
    assert not any(c.comm_schedule != "fifo" for c in got.search.priced)
    got = plan(2, comm_schedule="bytescheduler", partition_mb=1, credit_mb=2)      # its own options, fixed
    assert got and all(c.strategy(fixed_options(got.search.auto)).partition_mb == 1 for c in got.search.priced)
    with pytest.raises(fxpar.StrategyError, match=r"partition_mb=1.*add comm_schedule='bytescheduler'"):
        plan(2, partition_mb=1)
    got = plan(2, recompute="auto", memory_budget_gb=1.0)
    assert all(c.recompute == "auto" and c.strategy().memory_budget_gb == 1.0 for c in got.search.priced)
    auto = fxpar.Strategy.auto(grad_sync=fxpar.compress.TopK(ratio=0.5))     # a method the search does not price
    assert "grad_sync" in fixed_options(auto)
    with pytest.raises(fxpar.StrategyError, match=r"comm_schedule='lifo' is not .* pin one or more of "
                                                  r"\('fifo', 'bytescheduler'\)"):
        plan(2, comm_schedule="lifo")
    with pytest.raises(fxpar.StrategyError, match=r"grad_sync='herring' sums within nodes.*1 node\(s\) of 2 "
                                                  r"device\(s\).*nodes=2"):
        plan(2, grad_sync="herring")
    with pytest.raises(fxpar.StrategyError, match=r"memory_budget_gb=-1.*positive number of GB"):
        plan(2, memory_budget_gb=-1)
    with pytest.raises(fxpar.StrategyError, match=r"memory_budget_gb=2 is recompute='auto''s budget.*'full'"):
        plan(2, recompute="full", memory_budget_gb=2)


@pytest.mark.slow
@pytest.mark.numerics
def test_a_bytescheduler_pick_trains_like_one_process(clusters):
    """The tiny GPT at 2 ranks with ByteScheduler pinned: the plan auto picks (and builds) carries it, and trains
    like one process (float64, 1e-10)."""
    model, batches = tiny_gpt(), token_batches(3)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], gpt_loss, ADAMW,
                             strategy=fxpar.Strategy.auto(comm_schedule="bytescheduler"))
    assert prog.strategy.comm_schedule == "bytescheduler" and prog.plan.section("bytescheduler") is not None
    assert "bytescheduler" in prog.explain()
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, ADAMW)
    res = prog.run_local(batches, cluster=clusters.get(2))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL


@pytest.mark.slow
@pytest.mark.cost
def test_a_recompute_auto_pick_builds_within_its_budget():
    """The tied GPT at 2 ranks of 300 KiB with recompute='auto' pinned: each finalist plans to the room its other
    memory leaves (memory_budget_gb), the pick's build keeps its saved activations within that budget and its full
    estimate within the memory budget."""
    model, batches = tiny_gpt(), token_batches(1)
    cl = fxpar.ClusterSpec.local(2)
    cl = dataclasses.replace(cl, device=dataclasses.replace(cl.device, memory_bytes=300 * 1024))
    prog = fxpar.parallelize(model, cl, batches[0], gpt_loss, ADAMW, strategy=fxpar.Strategy.auto(recompute="auto"))
    pick = prog.auto_search.chosen
    assert pick.recompute == "auto" and prog.strategy.memory_budget_gb == pick.budget_gb
    section = prog.plan.section("recompute")
    assert section.policy == "auto" and section.budget_bytes == int(pick.budget_gb * 1e9)
    assert all(e["saved_bytes"] * e["in_flight"] <= section.budget_bytes for e in section.stages)
    assert max(r.peak_memory_bytes for r in prog.estimate().ranks) <= 0.9 * cl.device.memory_bytes
