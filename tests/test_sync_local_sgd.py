"""Local SGD, post-local (``S.LocalSGD(period=H, warmup_steps=W)``): ``W`` synchronous steps, then local steps with the
replicas' parameters averaged after steps ``W, W + H, ...``.

Against torch (which no one here wrote): DDP with ``post_localSGD_hook`` and ``PostLocalSGDOptimizer(...,
PeriodicModelAverager(H, W))`` (``fxpar.testing.sync.post_local_sgd_worker``), every rank's parameters and the losses
to 1e-10, at dp=2 and dp=4, with SGD-momentum and AdamW, with microbatches. Reductions: H=1 equals synchronous data
parallelism with plain SGD and with SGD-momentum (the momentum is linear in the gradients and every replica starts
each step from the same average), not with AdamW. The collectives per step are measured on the ranks; a checkpoint in
the middle of a window resumes every replica bitwise.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import sync as S
from fxpar.compress.feature import bucket_infos
from fxpar.sync.feature import method_of
from fxpar.testing import MLP, reference_training
from fxpar.testing.compress import mlp_batches
from fxpar.testing.sync import local_sgd_reference, post_local_sgd_worker

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.01})


def _model():
    torch.manual_seed(0)
    return MLP(layers=2).double()


def _program(model, batches, method, optimizer=SGD_M, dp=2, **strategy):
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(dp), batches[0], loss_fn=F.mse_loss, optimizer=optimizer,
                             strategy=fxpar.Strategy(dp=dp, sync=method, **strategy))


def _replicas(res, dp) -> list:
    return [res.features[r]["sync"]["replica"] for r in range(dp)]


def _close(got: dict, want: dict, msg=""):
    assert got and sorted(k for k in want if k in got) == sorted(got)
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-10, atol=1e-10, msg=f"{msg} {k}")


@pytest.mark.numerics
@pytest.mark.parametrize("dp,optimizer,period,warmup", [(2, SGD_M, 2, 1), (4, SGD_M, 3, 2), (2, ADAMW, 3, 0),
                                                        (4, ADAMW, 2, 1)],
                         ids=["dp2-SGD-momentum", "dp4-SGD-momentum", "dp2-AdamW", "dp4-AdamW"])
def test_every_rank_equals_torch_post_local_sgd(clusters, dp, optimizer, period, warmup):
    """7 steps: the losses and every rank's parameters equal torch's post-local SGD on as many ranks to 1e-10; the
    replicas differ between averagings; per step the rank issues the warm-up's gradient all-reduce, the averaging's
    all-reduce of every parameter, or nothing, in that number and size."""
    model, batches = _model(), mlp_batches(7)
    method = S.LocalSGD(period=period, warmup_steps=warmup)
    prog = _program(model, batches, method, optimizer, dp)
    res = prog.run_local(batches, cluster=clusters.get(dp), measure_comm=True)
    ddp = clusters.get(dp).run(post_local_sgd_worker, [(model, batches, F.mse_loss, optimizer, period, warmup)] * dp)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ddp[0]["losses"]), rtol=1e-10, atol=1e-10)
    replicas = _replicas(res, dp)
    for r in range(dp):
        _close(replicas[r], ddp[r]["state"], f"rank {r}")
    averaged = method.averaging_steps(7)
    assert averaged == [t for t in range(7) if t >= warmup and (t - warmup) % period == 0]
    assert res.features[0]["sync"]["averaged_steps"] == averaged
    if 6 not in averaged:        # the last step was local: the replicas differ
        assert max((replicas[0][k] - replicas[1][k]).abs().max().item() for k in replicas[0]) > 1e-8
    (b,) = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    nbytes = b.numel * 8
    assert nbytes == sum(v.numel() * 8 for v in replicas[0].values())
    for r in range(dp):
        want = [[("all_reduce", nbytes)] if t < warmup or t in averaged else [] for t in range(7)]
        assert res.comm_calls[r] == want, (r, res.comm_calls[r])
    # state_dict() is the replicas' average
    _close(res.state_dict(), {k: sum(rep[k] for rep in replicas) / dp for k in replicas[0]}, "average")


@pytest.mark.numerics
def test_microbatches_equal_torch_with_accumulation(clusters):
    """Two microbatches per shard: torch accumulates them under no_sync; the hook and the averager count steps."""
    model, batches = _model(), mlp_batches(5)
    method = S.LocalSGD(period=2, warmup_steps=1)
    res = _program(model, batches, method, SGD_M, 2, microbatches=2).run_local(batches, cluster=clusters.get(2))
    ddp = clusters.get(2).run(post_local_sgd_worker, [(model, batches, F.mse_loss, SGD_M, 2, 1, 2)] * 2)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ddp[0]["losses"]), rtol=1e-10, atol=1e-10)
    for r, got in enumerate(_replicas(res, 2)):
        _close(got, ddp[r]["state"], f"rank {r}")


@pytest.mark.numerics
@pytest.mark.parametrize("optimizer,synchronous", [((torch.optim.SGD, {"lr": 0.1}), True), (SGD_M, True),
                                                   (ADAMW, False)], ids=["SGD", "SGD-momentum", "AdamW"])
def test_period_one_is_synchronous_data_parallelism_for_sgd(clusters, optimizer, synchronous):
    """H=1, no warm-up: averaging every step after the update. SGD: mean(x - lr g_r) = x - lr mean(g_r), synchronous
    SGD. SGD-momentum: each replica's buffer holds its own gradients, but the buffers' mean follows the mean
    gradient (the update is linear) and the replicas restart from the same average each step: synchronous too.
    AdamW divides by each replica's own second moment: not synchronous."""
    model, batches = _model(), mlp_batches(4)
    res = _program(model, batches, S.LocalSGD(period=1), optimizer, 4).run_local(batches, cluster=clusters.get(4))
    losses, want = reference_training(model, batches, F.mse_loss, optimizer)
    gap = max((res.state_dict()[k] - want[k]).abs().max().item() for k in want)
    if synchronous:
        torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-12, atol=1e-12)
        assert gap < 1e-12, gap
        for rep in _replicas(res, 4):
            _close(rep, want, "replica")
    else:
        assert gap > 1e-6, gap


@pytest.mark.numerics
def test_one_process_reference_equals_torch_schedule(clusters):
    """``local_sgd_reference`` (the reference DiLoCo and SlowMo are checked against) is post-local SGD: equal to the
    ranks' every replica to 1e-10."""
    model, batches = _model(), mlp_batches(6)
    res = _program(model, batches, S.LocalSGD(period=2, warmup_steps=1), SGD_M, 4).run_local(
        batches, cluster=clusters.get(4))
    losses, reps = local_sgd_reference(model, batches, F.mse_loss, SGD_M, 4, 2, 1)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r, got in enumerate(_replicas(res, 4)):
        _close(got, reps[r], f"replica {r}")


@pytest.mark.numerics
@pytest.mark.parametrize("optimizer", [SGD_M, (torch.optim.Adagrad, {"lr": 0.1})], ids=["SGD-momentum",
                                                                                       "Adagrad-untraced"])
def test_checkpoint_in_the_middle_of_a_window_resumes_every_replica_bitwise(clusters, tmp_path, optimizer):
    """H=3, W=1: averagings after steps 1 and 4; saved after step 2 (the replicas apart, one step into the window),
    3 more steps == 6 straight, bitwise, per replica (its weights and optimizer state are its own)."""
    model, batches = _model(), mlp_batches(6)
    method = S.LocalSGD(period=3, warmup_steps=1)
    straight = _program(model, batches, method, optimizer).run_local(batches, cluster=clusters.get(2))
    _program(model, batches, method, optimizer).run_local(batches[:3], cluster=clusters.get(2),
                                                          save_to=tmp_path / "ck")
    resumed = _program(model, batches, method, optimizer).run_local(batches[3:], cluster=clusters.get(2),
                                                                    resume_from=tmp_path / "ck")
    assert resumed.losses == straight.losses[3:]
    assert resumed.features[0]["sync"]["averaged_steps"] == straight.features[0]["sync"]["averaged_steps"] == [1, 4]
    for r, (a, b) in enumerate(zip(_replicas(straight, 2), _replicas(resumed, 2))):
        for k in a:
            assert torch.equal(a[k], b[k]), (r, k)


@pytest.mark.structure
def test_plan_json_notes_explain_and_estimate():
    """The section round-trips through JSON; the notes say the replicas differ; explain names the averaging steps
    and the bytes per window; estimate() counts the window's mean, P // H bytes per step, where the bucket's
    all-reduce was."""
    model, batches = _model(), mlp_batches(1)
    method = S.LocalSGD(period=4, warmup_steps=2)
    prog = _program(model, batches, method)
    text = prog.plan.to_json()
    again = fxpar.Plan.from_json(text)
    assert again.to_json() == text and method_of(again.section("sync")) == method
    assert any("replicas differ between averagings" in n and "optimizer state is not averaged" in n
               for n in prog.plan.notes)
    (b,) = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    nbytes = b.numel * 8
    out = prog.explain()
    assert "averaged (one all-reduce) after steps 2, 6, 10, 14, ..." in out
    assert "steps 0..1 all-reduce the gradients (warm-up)" in out
    assert f"its parameters, {nbytes} bytes, all-reduced once per averaging ({nbytes // 4} bytes per step" in out
    assert prog.estimate().ranks[0].comm_bytes == nbytes // 4
    plain = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=F.mse_loss, optimizer=SGD_M,
                              strategy=fxpar.Strategy(dp=2))
    assert plain.estimate().ranks[0].comm_bytes == nbytes


@pytest.mark.numerics
@pytest.mark.parametrize("levels", [{2: 2, 4: 4}, {"node": 2, "global": 4}], ids=["period-group", "node-global"])
def test_hierarchical_local_sgd_equals_torch_hierarchical_model_averager(clusters, levels):
    """dp=4 (two nodes of 2): after step t >= W the replicas are averaged within the groups of the largest period
    dividing t -- pairs {0,1},{2,3} every 2 steps, all four every 4 -- as torch's HierarchicalModelAverager (on
    PostLocalSGDOptimizer, its subgroups from dist.new_subgroups) does: every rank's parameters and the losses to
    1e-10; the named form resolves "node" to the ClusterSpec's devices_per_node."""
    model, batches = _model(), mlp_batches(7)
    method = S.LocalSGD(warmup_steps=1, hierarchical=levels)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(4, nodes=2, devices_per_node=2), batches[0],
                             loss_fn=F.mse_loss, optimizer=SGD_M, strategy=fxpar.Strategy(dp=4, sync=method))
    assert method_of(prog.plan.section("sync")).hierarchical == ((2, 2), (4, 4))
    assert [ranks for name, ranks in prog.plan.all_groups() if name == "sync_2"] == [(0, 1), (2, 3)]
    res = prog.run_local(batches, cluster=clusters.get(4), measure_comm=True)
    ddp = clusters.get(4).run(post_local_sgd_worker, [(model, batches, F.mse_loss, SGD_M, 1, 1, 1, {2: 2, 4: 4})] * 4)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ddp[0]["losses"]), rtol=1e-10, atol=1e-10)
    replicas = _replicas(res, 4)
    for r in range(4):
        _close(replicas[r], ddp[r]["state"], f"rank {r}")
    assert res.features[0]["sync"]["averaged_steps"] == [2, 4, 6]
    # after step 6 (pairs only) the pairs agree and the two pairs differ
    assert all(torch.equal(replicas[0][k], replicas[1][k]) for k in replicas[0])
    assert max((replicas[0][k] - replicas[2][k]).abs().max().item() for k in replicas[0]) > 1e-8
    nbytes = sum(v.numel() * 8 for v in replicas[0].values())
    assert res.comm_calls[0] == [[("all_reduce", nbytes)] if t in (0, 2, 4, 6) else [] for t in range(7)]
