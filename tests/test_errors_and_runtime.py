"""Bad input gets an error naming the user's thing; a failing rank stops everyone, with its traceback."""
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.testing import MLP


def _batch(n=4):
    return (torch.randn(n, 16), torch.randn(n, 8))


@pytest.mark.structure
def test_batch_not_divisible_by_dp():
    with pytest.raises(fxpar.StrategyError, match=r"example_inputs\[0\] has batch 6 \(shape \(6, 16\)\), which dp=4 does not divide"):
        fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(4), _batch(6), loss_fn=F.mse_loss)


@pytest.mark.structure
def test_strategy_size_differs_from_cluster():
    with pytest.raises(fxpar.StrategyError, match=r"dp\*tp\*pp = 2 ranks but the ClusterSpec has 4"):
        fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(4), _batch(), loss_fn=F.mse_loss,
                          strategy=fxpar.Strategy(dp=2))


@pytest.mark.structure
def test_strategy_values_are_checked():
    with pytest.raises(fxpar.StrategyError, match=r"dp=0"):
        fxpar.Strategy(dp=0)
    with pytest.raises(fxpar.StrategyError, match=r"schedule='zigzag'"):
        fxpar.Strategy(pp=2, schedule="zigzag")


class Explode(nn.Module):
    """Raises on rank 1 only, at run time (not while tracing)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x):
        return self.lin(x)


def _explode_on_rank1(payload, batches):
    import torch.distributed as dist
    from fxpar.runtime.executor import train     # the one executor's worker entry (was fxpar.program._train)
    if dist.get_rank() == 1:
        raise RuntimeError("rank one blew up in the user's code")
    return train(payload, batches)    # rank 0 would block forever in the all_reduce


@pytest.mark.slow
@pytest.mark.numerics
def test_failing_rank_stops_all_ranks_and_shows_its_traceback():
    p = fxpar.parallelize(Explode(), fxpar.ClusterSpec.local(2), _batch(), loss_fn=F.mse_loss)
    lc = fxpar.LocalCluster(2)
    t0 = time.monotonic()
    with pytest.raises(fxpar.RankFailedError, match=r"rank 1 failed(.|\n)*rank one blew up") as info:
        lc.run(_explode_on_rank1, [(p.payload(r), [_batch()]) for r in range(2)])
    assert time.monotonic() - t0 < 15
    assert info.value.rank == 1 and "Traceback" in info.value.traceback_text
    assert not lc.alive and all(not proc.is_alive() for proc in lc.procs)


@pytest.mark.slow
@pytest.mark.numerics
def test_stuck_ranks_time_out_with_their_names():
    def _sleep_on_rank0(x):
        import torch.distributed as dist
        if dist.get_rank() == 0:
            time.sleep(30)
        return x

    lc = fxpar.LocalCluster(2)
    with pytest.raises(fxpar.RankFailedError, match=r"timed out.*ranks still busy: \[0\]"):
        lc.run(_sleeper, [(0,), (1,)], timeout_s=3)


def _sleeper(x):
    import torch.distributed as dist
    if dist.get_rank() == 0:
        time.sleep(30)
    return x
