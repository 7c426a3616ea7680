"""BAGUA's decentralized SGD (``C.Decentralized``): no gradient all-reduce; each dp replica's weights are averaged
with its peers' (``"all"``, ``"ring"``, ``"shift_one"``) every ``communication_interval`` steps, before its update.

Each replica's weights equal the one-process reference (``fxpar.testing.compress.decentralized_reference``: the
replicas, the mixing matrix ``W``, ``x_r <- (W x)_r - lr g_r(x_r)``) to 1e-10 for 4 steps; ``state_dict()`` is the
replicas' average. With ``peers="all"`` and interval 1 the first step is synchronous data-parallel SGD on the global
batch to 1e-10; after it the replicas' gradients are taken at weights that differ, so later steps are not (BAGUA's
order: average, then update with the gradient of the weights before the average). The collectives per step are
measured on the ranks against ``Method.collectives``; a checkpoint at step 2 resumes every replica bitwise.
One averaging on ranks whose weights differ is ``W X``: it keeps the replicas' mean and shrinks their spread by
at most the mixing matrix's second eigenvalue magnitude.

``order="adapt_then_combine"`` (each replica steps, then the stepped weights are averaged: ``x <- W (x - lr g)``)
equals its reference for the ring and shift_one; with ``peers="all"`` and interval 1 it is synchronous data
parallelism to 1e-10 at dp=2 and dp=4 for SGD and for SGD with momentum, Nesterov and weight decay (steps linear in
the gradient and the weights: the replicas stay equal, the mean of the ranks' momentum buffers is data parallelism's
buffer), and not for Adam (not linear in the gradient).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import compress as C
from fxpar.compress.decentralized import peers_of
from fxpar.compress.feature import bucket_infos, method_of
from fxpar.testing import MLP, reference_training
from fxpar.testing.compress import (decentralized_reference, low_precision_decentralized_reference, mixing_matrix,
                                    mlp_batches)
from fxpar.testing.compress_ranks import bucket_for, mix_once

LR = 0.1
ATC = "adapt_then_combine"


def _model(layers=2):
    torch.manual_seed(0)
    return MLP(layers=layers).double()


def _program(model, batches, method, optimizer=None, **strategy):
    strategy = {"dp": 4, **strategy}
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(strategy["dp"] * strategy.get("pp", 1)), batches[0],
                             loss_fn=F.mse_loss, optimizer=optimizer or (torch.optim.SGD, {"lr": LR}),
                             strategy=fxpar.Strategy(grad_sync=method, **strategy))


def _replicas(res, dp) -> list:
    return [res.features[r]["decentralized"]["replica"] for r in range(dp)]


def _close(got: dict, want: dict, msg=""):
    assert sorted(got) == sorted(k for k in want if k in got) and got
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-10, atol=1e-10, msg=f"{msg} {k}")


# ---- the method on its own ----------------------------------------------------------------------------------------
@pytest.mark.structure
def test_peers_bytes_and_lines():
    b = bucket_for(1001, "float64", 4, 1)
    ring, shift, every = C.Decentralized(peers="ring"), C.Decentralized(peers="shift_one"), C.Decentralized()
    assert every.collectives(b, "mix") == [("all_reduce", 8008)] and every.wire_bytes(b, "mix") == 8008
    assert ring.collectives(b, "mix") == [("all_to_all", 2 * 8008)] and shift.wire_bytes(b, "mix") == 8008
    assert every.collectives(b, "local") == [] and every.wire_bytes(b, "local") == 0
    two = C.Decentralized(communication_interval=2)
    assert [two.variant(b, s, {}) for s in range(5)] == ["mix", "local", "mix", "local", "mix"]
    assert [int(two.host_inputs(b, s, {}, None, torch.Generator())[0]) for s in range(5)] == [0, 0, 1, 1, 2]
    # the pairings are bagua's and are the mixing matrix's: symmetric, each rank one peer, changing with k
    for k in range(3):
        w = mixing_matrix("shift_one", 4, k)
        assert torch.equal(w, w.T) and torch.equal(w.sum(1), torch.ones(4, dtype=torch.float64))
        assert [peers_of("shift_one", r, 4, k) for r in range(4)] == [
            [j for j in range(4) if j != r and w[r, j] != 0] for r in range(4)]
    assert [peers_of("shift_one", 0, 4, k) for k in range(3)] == [[2], [3], [2]]
    assert peers_of("ring", 0, 4, 0) == [1, 3] and peers_of("all", 2, 4, 0) == [0, 1, 3]
    line = ring.describe(b, "mix")[0]
    assert "no gradient collective" in line and "both ring neighbours" in line
    low = C.Decentralized(peers="ring", low_precision=True)
    assert [low.variant(b, s, {}) for s in range(3)] == ["low_precision"] * 3
    assert low.collectives(b, "low_precision") == [("all_to_all", 2 * (8 + 1001))]
    assert sorted(low.init_state(b, torch.Generator())) == ["left", "right", "weight"]
    assert "uint8 codes" in low.describe(b, "low_precision")[0]
    assert C.Decentralized.from_dict(ring.to_dict()) == ring
    after = C.Decentralized(peers="ring", communication_interval=2, order=ATC)
    assert [after.variant(b, s, {}) for s in range(3)] == ["mix_after", "local", "mix_after"]
    assert after.collectives(b, "mix_after") == ring.collectives(b, "mix") and after.init_state(b, None) == {}
    assert after.collectives(b, "local") == []
    assert "before the update (combine, then adapt)" in line
    assert "both ring neighbours (16016 B in one all-to-all), weights 1/3, after the update (adapt, then combine)" in \
        after.describe(b, "mix_after")[0]


# ---- against one process ------------------------------------------------------------------------------------------
@pytest.mark.numerics
def test_all_first_step_is_synchronous_sgd_and_later_steps_are_dpsgd(clusters):
    """peers="all", interval 1, plain SGD: the first step's average equals data-parallel SGD on the global batch; over
    4 steps every replica equals the D-PSGD reference, which leaves synchronous SGD (its gradients are taken at the
    replicas' own weights)."""
    model, batches = _model(), mlp_batches(4)
    res = _program(model, batches, C.Decentralized(peers="all"), dp=4).run_local(batches, cluster=clusters.get(4))
    one = _program(model, batches[:1], C.Decentralized(peers="all"), dp=4).run_local(batches[:1],
                                                                                      cluster=clusters.get(4))
    sync_losses, sync_state = reference_training(model, batches[:1], F.mse_loss, (torch.optim.SGD, {"lr": LR}))
    torch.testing.assert_close(one.losses[0], sync_losses[0], rtol=1e-10, atol=1e-10)
    _close(one.state_dict(), sync_state, "first step")
    losses, reps = decentralized_reference(model, batches, F.mse_loss, LR, 4, "all")
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r, got in enumerate(_replicas(res, 4)):
        _close(got, reps[r], f"replica {r}")
    _, sync4 = reference_training(model, batches, F.mse_loss, (torch.optim.SGD, {"lr": LR}))
    gap = max((res.state_dict()[k] - sync4[k]).abs().max().item() for k in reps[0])
    assert gap > 1e-6, gap


@pytest.mark.numerics
@pytest.mark.parametrize("peers,dp,interval,order", [("ring", 4, 1, "combine_then_adapt"),
                                                     ("shift_one", 4, 1, "combine_then_adapt"),
                                                     ("all", 2, 2, "combine_then_adapt"),
                                                     ("shift_one", 2, 2, "combine_then_adapt"),
                                                     ("ring", 4, 1, ATC), ("shift_one", 4, 2, ATC)])
def test_every_replica_equals_the_reference(clusters, peers, dp, interval, order):
    """4 steps: each replica's weights, the losses (the replicas' shard losses averaged) and state_dict() (the
    replicas' average) equal the one-process decentralized SGD of the same order to 1e-10; the collectives per step,
    measured on every rank, are the method's, in number, order and bytes."""
    model, batches = _model(), mlp_batches(4)
    method = C.Decentralized(peers=peers, communication_interval=interval, order=order)
    prog = _program(model, batches, method, dp=dp)
    res = prog.run_local(batches, cluster=clusters.get(dp), measure_comm=True)
    losses, reps = decentralized_reference(model, batches, F.mse_loss, LR, dp, peers, interval, order)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    replicas = _replicas(res, dp)
    for r, got in enumerate(replicas):
        _close(got, reps[r], f"replica {r}")
    _close(res.state_dict(), {k: sum(rep[k] for rep in reps) / dp for k in reps[0]}, "average")
    assert any((replicas[0][k] - replicas[1][k]).abs().max() > 1e-8 for k in replicas[0])   # they differ
    infos = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    for r in range(dp):
        for t, calls in enumerate(res.comm_calls[r]):
            variant = ("mix_after" if order == ATC else "mix") if t % interval == 0 else "local"
            want = [c for b in infos for c in method.collectives(b, variant)]
            assert calls == want, (r, t, calls, want)
            n = sum(b.numel for b in infos) * 8
            assert sum(x for _, x in calls) == (0 if variant == "local" else n * (2 if peers == "ring" else 1))


@pytest.mark.slow
@pytest.mark.numerics
def test_microbatches_average_once_per_step(clusters):
    model, batches = _model(), mlp_batches(3)
    res = _program(model, batches, C.Decentralized(peers="ring"), microbatches=2).run_local(
        batches, cluster=clusters.get(4))
    losses, reps = decentralized_reference(model, batches, F.mse_loss, LR, 4, "ring")
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r, got in enumerate(_replicas(res, 4)):
        _close(got, reps[r], f"replica {r}")


@pytest.mark.numerics
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_low_precision_equals_its_reference(clusters, weight_decay):
    """Low precision (bagua's ring, Tang et al.'s compressed differences), dp=4, three buckets, 4 steps: every
    replica equals ``low_precision_decentralized_reference`` (the same 8-bit codes, each replica's copies of its
    neighbours) to 1e-10; the compression shows (the replicas are not full precision's); per step and bucket one
    all-to-all of ``2 (8 + numel)`` bytes. The update steps from the rank's own weights, so weight decay runs."""
    model, batches = _model(), mlp_batches(4)
    method = C.Decentralized(peers="ring", low_precision=True)
    prog = _program(model, batches, method, optimizer=(torch.optim.SGD, {"lr": LR, "weight_decay": weight_decay}),
                    bucket_cap_mb=0.005)
    infos = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    assert len(infos) == 3
    res = prog.run_local(batches, cluster=clusters.get(4), measure_comm=True)
    losses, reps = low_precision_decentralized_reference(model, batches, F.mse_loss, LR, 4, [b.keys for b in infos],
                                                         weight_decay)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    replicas = _replicas(res, 4)
    for r, got in enumerate(replicas):
        _close(got, reps[r], f"replica {r}")
    _, full = decentralized_reference(model, batches, F.mse_loss, LR, 4, "ring")
    assert max((replicas[0][k] - full[0][k]).abs().max().item() for k in full[0]) > 1e-6
    for r in range(4):
        assert res.comm_calls[r] == [[("all_to_all", 2 * (8 + b.numel)) for b in infos]] * 4


@pytest.mark.numerics
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("optimizer", [(torch.optim.SGD, {"lr": LR}),
                                       (torch.optim.SGD, {"lr": LR, "momentum": 0.9, "nesterov": True,
                                                          "weight_decay": 0.01})],
                         ids=["SGD", "SGD-momentum-nesterov-wd"])
def test_adapt_then_combine_on_the_full_graph_is_data_parallel(clusters, dp, optimizer):
    """peers="all", interval 1, adapt then combine: 4 steps equal plain data parallelism (``Strategy(dp=...)``, the
    gradient all-reduce) to 1e-10 -- the losses, every replica's weights, state_dict() and optimizer_state() (the
    replicas' momentum buffers differ; their average is data parallelism's buffer). The averaging's collectives are
    one all-reduce of each bucket's weights per step, as many as plain dp's gradient all-reduces."""
    model, batches = _model(), mlp_batches(4)
    prog = _program(model, batches, C.Decentralized(peers="all", order=ATC), optimizer=optimizer, dp=dp)
    res = prog.run_local(batches, cluster=clusters.get(dp), measure_comm=True)
    plain = fxpar.parallelize(model, fxpar.ClusterSpec.local(dp), batches[0], loss_fn=F.mse_loss,
                              optimizer=optimizer, strategy=fxpar.Strategy(dp=dp)).run_local(
        batches, cluster=clusters.get(dp), measure_comm=True)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(plain.losses), rtol=1e-10, atol=1e-10)
    want = plain.state_dict()
    _close(res.state_dict(), want, "average")
    for r, got in enumerate(_replicas(res, dp)):
        _close(got, want, f"replica {r}")
    got_opt, want_opt = res.optimizer_state, plain.optimizer_state
    assert sorted(got_opt) == sorted(want_opt) and (want_opt or "momentum" not in optimizer[1])
    for k in want_opt:
        torch.testing.assert_close(got_opt[k], want_opt[k], rtol=1e-10, atol=1e-10, msg=f"optimizer {k}")
    for r in range(dp):
        assert [[kind for kind, _ in step] for step in res.comm_calls[r]] == \
            [[kind for kind, _ in step] for step in plain.comm_calls[r]]
        assert [sum(n for _, n in step) for step in res.comm_calls[r]] == \
            [sum(n for _, n in step) for step in plain.comm_calls[r]]


@pytest.mark.numerics
def test_adapt_then_combine_with_adam_is_not_data_parallel(clusters):
    """Adam's step is not linear in the gradient: averaging the replicas' Adam steps is not Adam's step of the mean
    gradient, so peers="all" with adapt-then-combine leaves data parallelism after the first step (the reduction
    holds for SGD-like steps only)."""
    model, batches = _model(), mlp_batches(3)
    adam = (torch.optim.Adam, {"lr": 1e-2})
    res = _program(model, batches, C.Decentralized(peers="all", order=ATC), optimizer=adam, dp=2).run_local(
        batches, cluster=clusters.get(2))
    _, sync = reference_training(model, batches, F.mse_loss, adam)
    gap = max((res.state_dict()[k] - sync[k]).abs().max().item() for k in sync)
    assert gap > 1e-6, gap


# ---- plan, explain, checkpoints -------------------------------------------------------------------------------------
@pytest.mark.structure
def test_plan_json_round_trip_notes_and_explain():
    model, batches = _model(), mlp_batches(1)
    method = C.Decentralized(peers="shift_one", communication_interval=3)
    prog = _program(model, batches, method)
    text = prog.plan.to_json()
    again = fxpar.Plan.from_json(text)
    assert again.to_json() == text and method_of(again.section("decentralized")) == method
    assert any("the replicas differ between averaging steps" in n and "replicas' average" in n
               for n in prog.plan.notes)
    text = prog.explain()
    (b,) = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    assert f"{b.numel * 8} bytes per rank and step on the wire instead of {b.numel * 8}" in text
    assert "every 3 step(s) the bucket's weights are exchanged with one peer that changes each averaging" in text
    assert "until the method starts" not in text and "D-PSGD" in text
    after = C.Decentralized(peers="all", order=ATC)
    prog = _program(model, batches, after)
    text = prog.plan.to_json()
    again = fxpar.Plan.from_json(text)
    assert again.to_json() == text and method_of(again.section("decentralized")) == after
    assert '"order": "adapt_then_combine"' in text
    assert any("averages them with its peers ('all') after the update" in n for n in prog.plan.notes)
    assert "weights are all-reduced over the 4 replicas" in prog.explain()
    assert "after the update (adapt, then combine)" in prog.explain()


@pytest.mark.numerics
@pytest.mark.parametrize("optimizer,low_precision,order", [
    ((torch.optim.SGD, {"lr": LR, "momentum": 0.9}), False, "combine_then_adapt"),
    ((torch.optim.Adagrad, {"lr": LR}), False, "combine_then_adapt"),
    ((torch.optim.SGD, {"lr": LR, "momentum": 0.9}), True, "combine_then_adapt"),
    ((torch.optim.SGD, {"lr": LR, "momentum": 0.9, "weight_decay": 0.01}), False, ATC)],
    ids=["SGD-momentum", "Adagrad-untraced", "low-precision", "adapt-then-combine"])
@pytest.mark.slow
def test_checkpoint_at_step_2_resumes_every_replica_bitwise(clusters, tmp_path, optimizer, low_precision, order):
    """Ring, dp=4: save after 2 steps, 2 more == 4 straight, bitwise, per replica: each rank's own weights and
    optimizer state (momentum; Adagrad's sums, untraced) are in its checkpoint extra; low precision's copies of the
    neighbours' weights are the method's state."""
    model, batches = _model(), mlp_batches(4)
    method = C.Decentralized(peers="ring", low_precision=low_precision, order=order)
    straight = _program(model, batches, method, optimizer=optimizer).run_local(batches, cluster=clusters.get(4))
    saved = _program(model, batches, method, optimizer=optimizer).run_local(batches[:2], cluster=clusters.get(4),
                                                                            save_to=tmp_path / "ck")
    resumed = _program(model, batches, method, optimizer=optimizer).run_local(
        batches[2:], cluster=clusters.get(4), resume_from=tmp_path / "ck")
    assert resumed.losses == straight.losses[2:]
    for r, (a, b) in enumerate(zip(_replicas(straight, 4), _replicas(resumed, 4))):
        for k in a:
            assert torch.equal(a[k], b[k]), (r, k)
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    # the checkpoint's model keys hold the replicas' average: a run with another strategy loads that model
    plain = fxpar.parallelize(model, fxpar.ClusterSpec.local(1), batches[0], loss_fn=F.mse_loss,
                              optimizer=optimizer).run_local(batches[2:3], resume_from=tmp_path / "ck")
    average = _model()
    average.load_state_dict(saved.state_dict())
    x, y = batches[2]
    torch.testing.assert_close(plain.losses[0], F.mse_loss(average(x), y).item(), rtol=1e-12, atol=0)


# ---- what is refused ------------------------------------------------------------------------------------------
@pytest.mark.structure
def test_weight_decay_is_refused():
    model, batches = _model(), mlp_batches(1)
    prog = _program(model, batches, C.Decentralized(), optimizer=(torch.optim.AdamW, {"lr": 1e-3}))
    with pytest.raises(fxpar.StrategyError, match=r"AdamW\(weight_decay=0.01\).*Pass weight_decay=0 to AdamW"):
        prog.run_local(batches)


@pytest.mark.numerics
@pytest.mark.parametrize("order", ["combine_then_adapt", ATC])
@pytest.mark.parametrize("peers,k", [("ring", 0), ("shift_one", 0), ("shift_one", 1), ("all", 0)])
def test_one_averaging_keeps_the_mean_and_shrinks_the_spread_by_the_second_eigenvalue(clusters, peers, k, order):
    """Lian et al. 2017 (§3, the mixing matrix W symmetric and doubly stochastic): one averaging on 4 ranks whose
    weights differ maps X to W X, so it keeps the replicas' mean, and the spread ||X - mean|| shrinks by at most
    |lambda_2(W)|, the second largest eigenvalue magnitude (1/3 for the ring of 4, 1 for a pairing, 0 for "all")."""
    dp, numel = 4, 257
    out = clusters.get(dp).run(mix_once, [(C.Decentralized(peers=peers, order=order), numel, k)] * dp)
    before = torch.stack([o[0] for o in out])
    after = torch.stack([o[1] for o in out])
    w = mixing_matrix(peers, dp, k)
    torch.testing.assert_close(after, w @ before, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(after.mean(0), before.mean(0), rtol=1e-12, atol=1e-12)
    lam2 = sorted(torch.linalg.eigvalsh(w).abs().tolist())[-2]
    assert lam2 == pytest.approx({"ring": 1 / 3, "shift_one": 1.0, "all": 0.0}[peers], abs=1e-12)
    spread = lambda x: (x - x.mean(0)).norm()      # noqa: E731
    assert spread(after) <= lam2 * spread(before) + 1e-12
    assert spread(after) < spread(before)          # X's spread has a part off W's eigenvalue-1 directions
