"""Asynchronous pipelines compute the math their papers define (DESIGN §5), checked against the
small references in :mod:`fxpar.testing.async_reference`, float64 to 1e-10; the weight versions the
runtime held match the simulator and the papers' counts; a resumed run is the run that never stopped, bitwise."""
from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.runtime.checkpoint import read_manifest
from fxpar.runtime.state import stash_key
from fxpar.schedule import simulate
from fxpar.schedule.registry import get_schedule
from fxpar.testing import (SkipNet, TinyGPT, class_batches, flat_gpt_loss, max_abs_diff, reference_training,
                           tiny_gpt_batches)
from fxpar.testing.async_reference import pipedream_2bw_reference, pipedream_reference

CE = torch.nn.functional.cross_entropy
SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})


def _program(model, batch, optimizer, **strategy):
    strategy = fxpar.Strategy(**strategy)
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(strategy.size), batch, CE, optimizer, strategy=strategy)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("pp,optimizer", [(2, SGD_M), (4, ADAMW)])
def test_pipedream_weight_stashing_math(clusters, pp, optimizer):
    model, batches, m = SkipNet().double(), class_batches(3), 4
    prog = _program(model, batches[0], optimizer, pp=pp, schedule="pipedream", microbatches=m)
    res = prog.run_local(batches, cluster=clusters.get(pp))
    ref_losses, ref_state = pipedream_reference(model, [sp.param_keys for sp in prog.stages], batches, CE,
                                                optimizer, m)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
    # and it is not synchronous training: per-microbatch updates with stale weights differ from it
    sync_losses, _ = reference_training(model, batches, CE, optimizer)
    assert abs(res.losses[-1] - sync_losses[-1]) > 1e-6
    # stage s holds at most p - s versions (its in-flight microbatches' stashes + the newest): the paper's
    # count, and what the simulator predicts for the same 12-microbatch window
    sim = simulate(get_schedule("pipedream", pp, m * len(batches)))
    assert res.peak_versions == sim.peak_versions == {s: pp - s for s in range(pp)}


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("pp", [2, 4])
def test_pipedream_2bw_math(clusters, pp):
    model, batches, m = SkipNet().double(), class_batches(4), 4
    prog = _program(model, batches[0], ADAMW, pp=pp, schedule="2bw", microbatches=m)
    res = prog.run_local(batches, cluster=clusters.get(pp))
    ref_losses, ref_state = pipedream_2bw_reference(model, batches, CE, ADAMW)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
    sim = simulate(get_schedule("2bw", pp, m, n_batches=len(batches)))
    assert res.peak_versions == sim.peak_versions
    assert max(res.peak_versions.values()) == 2       # double-buffered weights: two versions at most
    params = dict(model.named_parameters())
    stage_bytes = [sum(params[k].numel() * 8 for k in sp.param_keys) for sp in prog.stages]
    assert res.peak_version_bytes == 2 * max(stage_bytes)   # the version store's own count of what it held


@pytest.mark.structure
@pytest.mark.parametrize("schedule", ["pipedream", "2bw", "pipelined_bp", "pipemare"])
def test_async_schedule_refuses_tied_parameters(schedule):
    with pytest.raises(fxpar.StrategyError, match=rf"schedule '{schedule}' steps each stage.*wte.weight.*Untie it"):
        fxpar.parallelize(TinyGPT().double(), fxpar.ClusterSpec.local(2), tiny_gpt_batches(1)[0], flat_gpt_loss, SGD_M,
                          strategy=fxpar.Strategy(pp=2, schedule=schedule, microbatches=4))


@pytest.mark.numerics
def test_pipedream_with_data_parallel_replicas(clusters):
    """pp=2 x dp=2: each per-microbatch update averages that microbatch over both replicas."""
    model, batches, m = SkipNet().double(), class_batches(2, batch=16), 4
    prog = _program(model, batches[0], SGD_M, pp=2, dp=2, schedule="pipedream", microbatches=m)
    res = prog.run_local(batches, cluster=clusters.get(4))
    ref_losses, ref_state = pipedream_reference(model, [sp.param_keys for sp in prog.stages], batches, CE,
                                                SGD_M, m, dp=2)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10


def _stash_pairs(res):
    """(F entry, B entry) per (rank, stage, microbatch) from the runtime's weight log."""
    pairs = {}
    for r, log in res.weight_log.items():
        for e in log:
            pairs.setdefault((r, e["stage"], e["mb"]), {})[e["kind"]] = e
    return pairs


@pytest.mark.numerics
@pytest.mark.parametrize("schedule,pp", [("pipedream", 2), ("2bw", 2)])
def test_forward_and_backward_use_bitwise_the_same_weights(clusters, schedule, pp):
    """Weight stashing, checked on the bytes: for every microbatch, the weight tensors its B differentiates
    through (the ones its F saved) hash equal to those its F computed with, and carry F's version, even when
    the stage stepped in between -- then they differ from the stage's newest weights (not vacuous)."""
    model, batches, m = SkipNet().double(), class_batches(3), 4
    prog = _program(model, batches[0], SGD_M, pp=pp, schedule=schedule, microbatches=m)
    res = prog.run_local(batches, cluster=clusters.get(pp), record_weights=True)
    pairs = _stash_pairs(res)
    assert len(pairs) == pp * m * len(batches)            # every stage saw every microbatch
    stale = 0
    for (r, s, i), fb in pairs.items():
        f, b = fb["F"], fb["B"]
        assert f["keys"] == b["keys"] and f["keys"], (s, i)   # the backward reads weights of this stage ...
        assert b["same_storage"]                               # ... held in the store under B's version
        assert f["version"] == b["version"] is not None
        assert f["saved_digest"] == b["saved_digest"], (r, s, i)   # bitwise what F computed with
        assert f["digest"] == b["digest"], (r, s, i)               # the stored version is F's, bit for bit
        if b["steps"] > f["steps"]:                           # the stage stepped between this F and its B
            assert b["newest"] != b["digest"]
            stale += 1
        assert b["versions_held"] <= (2 if schedule == "2bw" else pp - s)
    assert stale > 0          # some microbatches' backward ran while newer weights existed
    if schedule == "2bw":
        assert res.peak_versions == {s: 2 for s in range(pp)}
        assert max(e["versions_held"] for log in res.weight_log.values() for e in log if e["kind"] == "B") == 2


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.numerics
def test_pipedream_resume_is_the_run_that_never_stopped(clusters, tmp_path):
    """``run_local(b1, save_to=d)`` then ``run_local(b2, resume_from=d)`` is ``run_local(b1 + b2)`` bit for bit
    (losses, every parameter, every optimizer state): the checkpoint carries each stage's p-s-1 versions before the
    newest, and the resumed window's first forwards on stage s read them, as the window that never stopped did."""
    model, batches, m, pp = SkipNet().double(), class_batches(4), 4, 3
    prog = _program(model, batches[0], SGD_M, pp=pp, schedule="pipedream", microbatches=m)
    lc = clusters.get(pp)
    whole = prog.run_local(batches, cluster=lc)
    ref_losses, ref_state = pipedream_reference(model, [sp.param_keys for sp in prog.stages], batches, CE, SGD_M, m)
    assert max(abs(a - b) for a, b in zip(whole.losses, ref_losses)) < 1e-10
    assert max_abs_diff(whole.state_dict(), ref_state) < 1e-10
    first = prog.run_local(batches[:2], cluster=lc, save_to=tmp_path / "ck")
    second = prog.run_local(batches[2:], cluster=lc, resume_from=tmp_path / "ck", record_weights=True)
    assert first.losses + second.losses == whole.losses
    assert _bitwise(second.state_dict(), whole.state_dict())
    assert _bitwise(second.optimizer_state, whole.optimizer_state) and whole.optimizer_state
    # what the checkpoint carries: stage s's versions 1 .. p-s-1 updates before the newest, the last stage none
    saved = read_manifest(tmp_path / "ck")["tensors"]
    for s, sp in enumerate(prog.stages):
        for k in sp.param_keys:
            assert [back for back in (1, 2, 3) if stash_key(k, back) in saved] == list(range(1, pp - s))
    # not vacuous: the resumed window's first p-s-1 forwards on stage s read carried weights, older than the newest
    carried = [e for log in second.weight_log.values() for e in log
               if e["kind"] == "F" and e["mb"] < pp - 1 - e["stage"] and e["keys"]]
    assert carried and all(e["version"] == e["mb"] and e["digest"] != e["newest"] for e in carried)
    assert second.peak_versions == {s: pp - s for s in range(pp)}


@pytest.mark.numerics
def test_resume_from_a_checkpoint_that_carries_too_few_versions_is_refused(clusters, tmp_path):
    """A 2BW checkpoint carries one version per stage; PipeDream at pp=3 reads two on stage 0: refused by key."""
    model, batches = SkipNet().double(), class_batches(2)
    _program(model, batches[0], SGD_M, pp=2, schedule="2bw", microbatches=4).run_local(
        batches[:1], cluster=clusters.get(2), save_to=tmp_path / "ck")
    prog = _program(model, batches[0], SGD_M, pp=3, schedule="pipedream", microbatches=4)
    with pytest.raises(Exception, match=r"stash2\.inp\.weight.*same schedule with as many stages"):
        prog.run_local(batches[1:], cluster=clusters.get(3), resume_from=tmp_path / "ck")
