"""Strategy(compile=True) and inductor's FX graph cache: a second program of the same model and Strategy, run again,
compiles nothing -- every graph of every rank is loaded from the cache (``RunResult.features[rank]["compile"]``'s
``cache`` is ``"hit"``) and computes what the first run computed, bitwise."""
import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.testing import MLP

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


def _program():
    torch.manual_seed(0)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    prog = fxpar.parallelize(MLP().double(), fxpar.ClusterSpec.local(2), (x, y), loss_fn=F.mse_loss,
                             optimizer=SGD_M, strategy=fxpar.Strategy(dp=2, compile=True))
    return prog, [(x, y), (x * 0.5, y)]


@pytest.mark.numerics
@pytest.mark.slow
def test_a_second_program_of_the_same_model_loads_every_graph_from_the_cache(clusters):
    first_prog, batches = _program()
    first = first_prog.run_local(batches, cluster=clusters.get(2))
    prog, _ = _program()
    again = prog.run_local(batches, cluster=clusters.get(2))
    for res in (first, again):
        for rank, feats in res.features.items():
            assert feats["compile"] and all(g["compiled"] for g in feats["compile"].values()), (rank, feats)
    for rank, feats in again.features.items():
        assert {label: g["cache"] for label, g in feats["compile"].items()} == {label: "hit" for label in
                                                                               feats["compile"]}, rank
    assert again.losses == first.losses
    for k, v in first.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
