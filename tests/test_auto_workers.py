"""The automatic planner's forked workers (``fxpar/auto/workers.py``): a task's value, error or death comes back as
such; ``parallelize(strategy=Strategy.auto(workers=2))`` decides exactly as with none, and returns the same
program."""
from __future__ import annotations

import gc
import multiprocessing
import os

import pytest
import torch

import fxpar
from fxpar.auto.workers import Forked, worker_count
from fxpar.testing import GPT, gpt_loss

ADAMW = (torch.optim.AdamW, {"lr": 1e-4})
A100X8 = fxpar.ClusterSpec.preset("a100-80gb", gpus_per_node=8)
FORK = "fork" in multiprocessing.get_all_start_methods()


def _fails():
    raise ValueError("no such block")


@pytest.mark.structure
@pytest.mark.skipif(not FORK, reason="no fork start method here: the planner runs without workers")
def test_a_task_returns_its_value_its_error_or_nothing_if_its_process_dies():
    pool = Forked(2)
    pool.submit("value", lambda: {"step_s": 0.5, "list": [1, 2]})
    pool.submit("error", _fails)
    pool.submit("dies", lambda: os._exit(3))
    pool.start()
    assert pool.result("dies") is None
    assert pool.result("value") == ("ok", {"step_s": 0.5, "list": [1, 2]})
    assert pool.result("error") == ("error", "ValueError: no such block")
    assert pool.started == 3
    pool.close()
    assert worker_count(0) == 0 and worker_count(3) == 3


@pytest.mark.structure
@pytest.mark.skipif(not FORK, reason="no fork start method here: the planner runs without workers")
def test_a_worker_starts_with_the_parents_objects_frozen_and_the_parent_collects_as_before():
    # gc.freeze() before the fork: the child's collector does not walk (and so copy) the pages of every object it
    # inherited; the parent's own collection is unchanged after the fork
    keep = [[i] for i in range(10_000)]            # objects the child inherits
    pool = Forked(1)
    pool.submit("frozen", lambda: (gc.get_freeze_count(), len(keep)))
    pool.start()
    assert gc.get_freeze_count() == 0
    (status, (frozen, n)), = [pool.result("frozen")]
    assert status == "ok" and n == len(keep) and frozen >= len(keep)
    pool.close()


@pytest.mark.structure
@pytest.mark.skipif(not FORK, reason="no fork start method here: the planner runs without workers")
def test_a_hung_task_is_ended_and_answers_nothing():
    """A worker that never answers (a forked copy can hang on a lock another thread held) is ended after the
    timeout, and the caller computes the task itself; the other task still answers."""
    import time
    pool = Forked(2)
    pool.submit("hangs", lambda: time.sleep(600))
    pool.submit("value", lambda: 7)
    pool.start()
    t0 = time.monotonic()
    assert pool.result("hangs", timeout_s=0.5) is None
    assert time.monotonic() - t0 < 30
    assert pool.result("value", timeout_s=30) == ("ok", 7)
    assert not pool.running
    pool.close()


@pytest.mark.structure
@pytest.mark.skipif(not FORK, reason="no fork start method here: the planner runs without workers")
def test_no_workers_by_default_while_the_cpus_are_busy(monkeypatch):
    import fxpar.auto.workers as W
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setattr(W, "_load", lambda: float(cpus))
    assert worker_count(None) == 0 and worker_count(2) == 2
    monkeypatch.setattr(W, "_load", lambda: cpus - 0.5)
    assert worker_count(None) == (cpus if cpus > 1 else 0)


@pytest.mark.structure
def test_no_workers_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert worker_count(None) == 0 and worker_count(2) == 0


@pytest.mark.structure
def test_workers_must_be_a_count():
    for bad in (-1, 1.5, True):
        with pytest.raises(fxpar.StrategyError, match=r"Strategy.auto\(workers=.*an int >= 0"):
            fxpar.Strategy.auto(workers=bad)
    assert fxpar.Strategy.auto(workers=0).workers == 0 and fxpar.Strategy.auto().workers is None


def _printout(prog) -> tuple:
    est = prog.estimate()
    return ([{k: g.code for k, g in prog.graphs(r).items()} for r in range(prog.cluster.world_size)],
            est.step_time_s, [(r.peak_memory_bytes, r.comm_bytes) for r in est.ranks], str(prog.strategy))


@pytest.mark.slow
@pytest.mark.cost
@pytest.mark.skipif(not FORK, reason="no fork start method here: the planner runs without workers")
def test_workers_decide_as_this_process_alone_and_the_pick_is_built_here():
    """A 6-block GPT at 8 A100s (finalists: dp=8 built, dp=4 x tp=2 in both modes probed, a pipeline built):
    with two workers every finalist's figures (whole, probed, composed), the skipped ones, the pick and the returned
    program (every rank's graphs, the estimate) equal those of the planner without workers. The pick here is the
    pipeline, whose whole build ran in a worker: it is built again in this process, which returns it."""
    with torch.device("meta"):
        model = GPT(vocab=1024, d=256, layers=6, heads=4, max_seq=128)
    x = torch.randint(0, 1024, (16, 128), device="meta")
    got = {}
    for workers in (0, 2):
        prog = fxpar.parallelize(model, A100X8, (x, x), gpt_loss, ADAMW, strategy=fxpar.Strategy.auto(workers=workers))
        s = prog.auto_search
        got[workers] = ([(str(c), c.full) for c in s.built], [str(c) for c in s.skipped], str(s.chosen),
                        _printout(prog))
        assert s.seconds.get("workers", 0) == (2 if workers else 0)
    assert got[2] == got[0]
    built = got[0][0]
    assert any("probe" in full for _, full in built) and any("probe" not in full for _, full in built[1:])
    assert "pp=2" in got[0][2]        # the pick's whole build ran in a worker first
    assert "forked worker" in prog.explain()
