"""Distributed Any-Batch Mirror Descent (``S.DABMD``): a time budget per round, a mirror step, a consensus.

Reduction: with the Euclidean map, full mixing and equal batches (fixed, or a budget every rank fits its whole shard
in) it is synchronous SGD on the global batch, every replica, to 1e-10. Against the one-process reference of the
paper's mirror step and consensus (``fxpar.testing.sync.dabmd_reference``): unequal fixed batches and ring mixing,
every rank's parameters and the losses, Euclidean and entropic (a parameter on the simplex stays there). Measured on
the ranks: a straggler's recorded batches are smaller. Checkpoints resume every replica bitwise.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar import sync as S
from fxpar.sync.dabmd import mixing_matrix
from fxpar.sync.feature import method_of
from fxpar.testing import MLP, reference_training
from fxpar.testing.compress import mlp_batches
from fxpar.testing.sync import dabmd_reference

SGD = (torch.optim.SGD, {"lr": 0.1})


def _model():
    torch.manual_seed(0)
    return MLP(layers=2).double()


class Mixture(nn.Module):
    """Three linear experts mixed by ``mix``, a point of the probability simplex."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(16, 8) for _ in range(3))
        self.mix = nn.Parameter(torch.tensor([0.5, 0.3, 0.2]))

    def forward(self, x):
        return sum(self.mix[i] * torch.tanh(e(x)) for i, e in enumerate(self.experts))


def _program(model, batches, method, dp=4, microbatches=2, slowdown=None):
    cluster = fxpar.ClusterSpec.local(dp, slowdown=slowdown or {})
    return fxpar.parallelize(model, cluster, batches[0], loss_fn=F.mse_loss, optimizer=SGD,
                             strategy=fxpar.Strategy(dp=dp, microbatches=microbatches, sync=method))


def _close(got: dict, want: dict, msg=""):
    assert got and sorted(want) == sorted(got)
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-10, atol=1e-10, msg=f"{msg} {k}")


@pytest.mark.numerics
@pytest.mark.parametrize("method", [S.DABMD(round_time_s=None, fixed_microbatches=(2, 2, 2, 2)),
                                    S.DABMD(round_time_s=60.0)], ids=["fixed", "budget-fits-every-microbatch"])
def test_euclidean_full_mixing_equal_batches_is_synchronous_sgd(clusters, method):
    """Every rank takes its whole shard: the mean gradient of the global batch, one SGD step, the average of equal
    replicas -- synchronous SGD, the losses and every replica's parameters to 1e-10."""
    model, batches = _model(), mlp_batches(4)
    res = _program(model, batches, method).run_local(batches, cluster=clusters.get(4))
    losses, state = reference_training(model, batches, F.mse_loss, SGD)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    _close(res.state_dict(), state)
    for r in range(4):
        _close(res.features[r]["sync"]["replica"], state, f"replica {r}")
        assert res.features[r]["sync"]["batch_sizes"] == [2] * 4       # 8 rows / 4 ranks, both microbatches


@pytest.mark.numerics
def test_ring_mixing_unequal_batches_match_the_reference_every_rank(clusters):
    """dp=4, ranks taking 2, 1, 1 and 2 of their 2 microbatches every round, ring mixing: each replica's parameters
    and the losses equal the one-process reference of the mirror step and the ring consensus; the replicas differ
    (a ring is not an average); the recorded batch sizes are the fixed ones."""
    model, batches = _model(), mlp_batches(4)
    method = S.DABMD(round_time_s=None, mixing="ring", fixed_microbatches=(2, 1, 1, 2))
    res = _program(model, batches, method).run_local(batches, cluster=clusters.get(4))
    losses, reps = dabmd_reference(model, batches, F.mse_loss, 0.1, 4, 2, (2, 1, 1, 2), mixing="ring")
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r in range(4):
        _close(res.features[r]["sync"]["replica"], reps[r], f"replica {r}")
        assert res.features[r]["sync"]["batch_sizes"] == [(2, 1, 1, 2)[r]] * 4
    w = "layers.0.weight"
    assert not torch.allclose(reps[0][w], reps[2][w], rtol=0, atol=1e-8)


@pytest.mark.numerics
def test_entropic_map_keeps_the_simplex_parameter_on_the_simplex(clusters):
    """``mix`` stepped by exponentiated gradient, the experts by SGD, ring mixing, unequal batches: every replica
    equals the reference to 1e-10, and every replica's ``mix`` stays positive and sums to 1."""
    torch.manual_seed(0)
    model = Mixture().double()
    batches = mlp_batches(5)
    method = S.DABMD(round_time_s=None, mirror="entropic", mixing="ring", simplex=("mix",),
                     fixed_microbatches=(1, 2, 2, 1))
    res = _program(model, batches, method).run_local(batches, cluster=clusters.get(4))
    losses, reps = dabmd_reference(model, batches, F.mse_loss, 0.1, 4, 2, (1, 2, 2, 1), mirror="entropic",
                                   mixing="ring", simplex=("mix",))
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    start = model.mix.detach().clone()
    for r in range(4):
        got = res.features[r]["sync"]["replica"]
        _close(got, reps[r], f"replica {r}")
        assert bool((got["mix"] > 0).all()) and abs(float(got["mix"].sum()) - 1.0) < 1e-12
        assert not torch.allclose(got["mix"], start, rtol=0, atol=1e-6)       # it moved


@pytest.mark.serial             # timed: under other load every rank's compute stretches and the straggler's stands out less
@pytest.mark.numerics
def test_a_stragglers_recorded_batches_are_smaller(clusters):
    """Rank 3 five times slower, a budget of 50 ms per round over 8 microbatches: over the 4 rounds it takes fewer
    samples than every other rank; every rank takes at least one microbatch (4 samples) per round."""
    torch.manual_seed(0)
    model = MLP(hidden=256, layers=3).double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(128, 16, dtype=torch.float64, generator=g),
                torch.randn(128, 8, dtype=torch.float64, generator=g)) for _ in range(4)]
    res = _program(model, batches, S.DABMD(round_time_s=0.05), microbatches=8,
                   slowdown={3: 5.0}).run_local(batches, cluster=clusters.get(4))
    sizes = {r: res.features[r]["sync"]["batch_sizes"] for r in range(4)}
    assert all(len(s) == 4 and min(s) >= 4 for s in sizes.values()), sizes
    assert sum(sizes[3]) < min(sum(sizes[r]) for r in range(3)), sizes


@pytest.mark.slow
@pytest.mark.numerics
def test_checkpoint_resumes_every_replica_bitwise(clusters, tmp_path):
    """Ring mixing, unequal batches: saved after 2 rounds, 2 more == 4 straight, bitwise, every replica, and the
    batch sizes carry on."""
    model, batches = _model(), mlp_batches(4)
    method = S.DABMD(round_time_s=None, mixing="ring", fixed_microbatches=(1, 2, 1, 2))
    straight = _program(model, batches, method).run_local(batches, cluster=clusters.get(4))
    _program(model, batches, method).run_local(batches[:2], cluster=clusters.get(4), save_to=tmp_path / "ck")
    resumed = _program(model, batches, method).run_local(batches[2:], cluster=clusters.get(4),
                                                         resume_from=tmp_path / "ck")
    assert resumed.losses == straight.losses[2:]
    for r in range(4):
        a, b = straight.features[r]["sync"], resumed.features[r]["sync"]
        assert b["batch_sizes"] == a["batch_sizes"]
        for k in a["replica"]:
            assert torch.equal(a["replica"][k], b["replica"][k]), (r, k)


@pytest.mark.structure
def test_plan_json_notes_explain_and_the_mixing_matrices():
    """The method round-trips through the Plan's JSON; the note and explain() name the budget and the consensus;
    both mixing matrices are doubly stochastic, the ring's 1/3 on the rank and its two neighbours."""
    model, batches = _model(), mlp_batches(1)
    method = S.DABMD(round_time_s=0.25, mirror="euclidean", mixing="ring")
    prog = _program(model, batches, method)
    text = prog.plan.to_json()
    assert fxpar.Plan.from_json(text).to_json() == text and method_of(prog.plan.section("sync")) == method
    assert any("while the round's 0.25 s of computing last" in n and "two ring neighbours" in n
               for n in prog.plan.notes)
    assert "the batch sizes are recorded per rank and round" in prog.explain()
    for mixing in ("full", "ring"):
        p = torch.tensor(mixing_matrix(mixing, 5), dtype=torch.float64)
        torch.testing.assert_close(p.sum(0), torch.ones(5, dtype=torch.float64))
        torch.testing.assert_close(p.sum(1), torch.ones(5, dtype=torch.float64))
    assert mixing_matrix("ring", 5)[0] == [1 / 3, 1 / 3, 0.0, 0.0, 1 / 3]
