"""Fault injection: a rank killed mid-run, and a rank whose collective raises, under dp, pp, tp and ZeRO-3.

Every case needs a fresh LocalCluster (a failure stops all its ranks), so each costs a group start-up (5-10 s
on two cores): every case is marked ``slow``.

The fault is injected through a public hook that needs no test-only code in fxpar: ``lr_scheduler=`` is
called on every rank after each step's update, so a scheduler stand-in (:class:`Fault`) that acts on rank r
after step k's update makes that rank die (SIGKILL, as the OOM killer or a user would) or break its process
group (every later collective on it raises) while the other ranks go on into step k+1's collectives."""
from __future__ import annotations

import functools
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxpar

pytestmark = pytest.mark.numerics

X = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(2))
EXIT_WITHIN_S = 30.0


class Fault:
    """Stands in for an LR scheduler; on rank ``rank``, after step ``step``'s update: ``how="kill"`` sends SIGKILL
    to its own process, ``how="collective"`` unregisters its process groups and breaks its point-to-point calls,
    so its next collective, send or receive raises (the peers' connections stay open: only it reports)."""

    def __init__(self, optimizer, rank: int, step: int, how: str):
        self.rank, self.at, self.how, self.done = rank, step, how, 0

    def step(self):
        if dist.get_rank() == self.rank and self.done == self.at:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            torch._C._distributed_c10d._unregister_all_process_groups()     # the graphs' collectives
            dist.isend = dist.irecv = _refuse                                # a pipeline's sends and receives
        self.done += 1

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, d):
        self.done = d["done"]


def _refuse(*args, **kwargs):
    raise RuntimeError("Could not resolve the process group (a point-to-point call on a broken rank)")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 5)).double()


STRATEGIES = {"dp": fxpar.Strategy(dp=2), "pp": fxpar.Strategy(pp=2, microbatches=2),
              "tp": fxpar.Strategy(tp=2, sharding="megatron"), "zero3": fxpar.Strategy(dp=2, zero=3)}


def _fault_run(strategy: str, how: str, rank: int = 1, step: int = 1):
    """Run 4 steps with the fault at ``step`` on ``rank``; return the RankFailedError, the seconds from the run's
    start until every rank had exited, and the ranks' exit codes."""
    program = fxpar.parallelize(_net(), 2, (X, Y), F.cross_entropy, (torch.optim.SGD, {"lr": 0.1}),
                                strategy=STRATEGIES[strategy],
                                lr_scheduler=functools.partial(Fault, rank=rank, step=step, how=how))
    lc = fxpar.LocalCluster(2)
    procs = list(lc.procs)
    t0 = time.monotonic()
    try:
        with pytest.raises(fxpar.RankFailedError) as info:
            program.run_local([(X, Y)] * 4, cluster=lc)
        for p in procs:                    # measured: run_local has returned; each rank must be gone by now
            p.join(timeout=max(0.0, t0 + EXIT_WITHIN_S - time.monotonic()))
        took = time.monotonic() - t0
        return info.value, took, [p.exitcode for p in procs]
    finally:
        lc.close(force=True)


def _check_killed(strategy: str):
    err, took, codes = _fault_run(strategy, "kill")
    msg = str(err)
    assert took < EXIT_WITHIN_S, f"the ranks took {took:.1f} s to exit under {strategy}"
    assert all(c is not None for c in codes), f"a rank is still running under {strategy}: exit codes {codes}"
    assert codes[1] == -signal.SIGKILL
    assert err.rank == 1, msg
    assert re.search(r"rank 1 was killed by SIGKILL at step 1 \(batches\[1\]\) while train", msg), msg
    assert "the other ranks were stopped" in msg


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "pp", "tp", "zero3"])
def test_a_killed_rank_is_named_with_its_step_and_nobody_hangs(strategy):
    _check_killed(strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "pp", "tp", "zero3"])
def test_a_rank_whose_collective_raises_is_named_and_nobody_hangs(strategy):
    err, took, codes = _fault_run(strategy, "collective")
    msg = str(err)
    assert took < EXIT_WITHIN_S and all(c is not None for c in codes), (took, codes)
    assert err.rank == 1, msg
    # it broke after step 1's update: the first collective of step 2 (pp: a send or receive) raises
    assert re.search(r"rank 1 raised at step 2 \(batches\[2\]\) while train:\n", msg), msg
    assert "Could not resolve the process group" in err.traceback_text, msg
