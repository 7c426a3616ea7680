"""Synchronisation methods with microbatches: DiLoCo, SlowMo, and SSP and DSSP at bound 0, against the one-process
references of their math, every replica to 1e-10 in float64, beside Local SGD's and asynchronous averaging's
microbatch cases (``tests/test_sync_local_sgd.py``, ``tests/test_sync_async_avg.py``). Two microbatches per shard
accumulate into the shard's gradient, so the references, which take each shard whole, are the same math."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import sync as S
from fxpar.testing import MLP, reference_training
from fxpar.testing.compress import mlp_batches
from fxpar.testing.sync import local_sgd_reference, nesterov_outer, slowmo_outer

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
NESTEROV = (torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})


def _model():
    torch.manual_seed(0)
    return MLP(layers=2).double()


def _close(got: dict, want: dict, msg=""):
    assert got and sorted(k for k in want if k in got) == sorted(got)
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-10, atol=1e-10, msg=f"{msg} {k}")


@pytest.mark.numerics
@pytest.mark.parametrize("method,outer", [
    (S.DiLoCo(period=2, outer=NESTEROV), nesterov_outer(0.7, 0.9)),
    (S.SlowMo(period=2, slow_lr=1.5, slow_momentum=0.5), slowmo_outer(0.1, 1.5, 0.5)),
], ids=["DiLoCo", "SlowMo"])
def test_outer_methods_with_microbatches_equal_their_reference(clusters, method, outer):
    """dp=2, 2 microbatches per shard, H=2, 5 steps: the losses and every replica equal the one-process reference
    with the outer step written out."""
    model, batches = _model(), mlp_batches(5)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=F.mse_loss, optimizer=SGD_M,
                             strategy=fxpar.Strategy(dp=2, microbatches=2, sync=method))
    res = prog.run_local(batches, cluster=clusters.get(2))
    losses, reps = local_sgd_reference(model, batches, F.mse_loss, SGD_M, 2, 2, outer=outer)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r in range(2):
        _close(res.features[r]["sync"]["replica"], reps[r], f"replica {r}")


@pytest.mark.numerics
@pytest.mark.parametrize("method,servers", [(S.SSP(staleness=0), 1), (S.DSSP(low=0, high=0), 2)],
                         ids=["SSP-s0", "DSSP-0-0-two-servers"])
def test_ssp_bound_zero_with_microbatches_is_synchronous_sgd(clusters, method, servers):
    """SSP(staleness=0) over one server, DSSP(0, 0) over two, 2 microbatches per shard: a clock is a shard's
    accumulated gradient, and every read waits for every worker's previous clock: synchronous SGD-momentum on the
    global batch, every worker, to 1e-10."""
    model, batches = _model(), mlp_batches(4)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2, cpu_servers=servers), batches[0], loss_fn=F.mse_loss,
                             optimizer=SGD_M, strategy=fxpar.Strategy(dp=2, microbatches=2, sync=method))
    res = prog.run_local(batches, cluster=clusters.get(2 + servers))
    losses, state = reference_training(model, batches, F.mse_loss, SGD_M)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    _close(res.state_dict(), state)
    for r in range(2):
        _close(res.features[r]["sync"]["replica"], state, f"worker {r}")
