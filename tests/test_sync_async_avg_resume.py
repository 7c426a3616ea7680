"""Checkpoints of BAGUA's asynchronous model averaging (``S.AsyncAveraging``).

Deterministic mode (``every_steps=k``): saved in the middle of a window (the replicas apart), a fresh program resumed
from the checkpoint and trained on equals the run that never stopped, bitwise, on every replica, with its averagings
after the same steps. Timed mode (``interval_s``): a clock decides when it averages, so no bitwise claim; the resumed
run starts its loop again and averages, and its corrections keep the replicas' mean.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import sync as S
from fxpar.testing import MLP
from fxpar.testing.compress import mlp_batches
from fxpar.testing.resume import assert_resume_is_exact

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


def _model():
    torch.manual_seed(0)
    return MLP(layers=2).double()


def _program(model, batches, method, dp=2):
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(dp), batches[0], loss_fn=F.mse_loss, optimizer=SGD_M,
                             strategy=fxpar.Strategy(dp=dp, sync=method))


@pytest.mark.numerics
def test_every_k_steps_resumes_every_replica_bitwise_in_the_middle_of_a_window(clusters, tmp_path):
    """every_steps=3 after 1 warm-up step: averagings after steps 1 and 4; saved after step 2 (one local step into
    the window, the replicas apart), 3 more == 6 straight, bitwise, per replica."""
    model, batches = _model(), mlp_batches(6)
    method = S.AsyncAveraging(every_steps=3, warmup_steps=1)
    whole, first, second = assert_resume_is_exact(_program(model, batches, method), batches, 3, clusters.get(2),
                                                  tmp_path / "ck")
    apart = first.features
    assert max((apart[0]["sync"]["replica"][k] - apart[1]["sync"]["replica"][k]).abs().max().item()
               for k in apart[0]["sync"]["replica"]) > 1e-8          # saved with the replicas apart
    assert whole.features[0]["sync"]["applied_steps"] == [1, 4]
    # the resumed run's record goes on from the checkpoint's: the averaging after step 1, then its own after step 4
    assert first.features[0]["sync"]["applied_steps"] == [1]
    assert second.features[0]["sync"]["applied_steps"] == [1, 4] and second.features[0]["sync"]["averagings"] == 2
    for r in range(2):
        a, b = whole.features[r]["sync"]["replica"], second.features[r]["sync"]["replica"]
        assert sorted(a) == sorted(b)
        for k in a:
            assert torch.equal(a[k], b[k]), (r, k)


@pytest.mark.numerics
@pytest.mark.slow
def test_timed_mode_resumes_and_averages_again(clusters, tmp_path):
    """interval_s=2 ms: saved after 20 steps, resumed for 20 more; the resumed run's loop averages again (its count
    goes on from the checkpoint's, the same on both ranks), and each averaging's corrections sum to zero over the
    ranks."""
    model, batches = _model(), mlp_batches(40)
    method = S.AsyncAveraging(interval_s=0.002, warmup_steps=2)
    first = _program(model, batches, method).run_local(batches[:20], cluster=clusters.get(2),
                                                       save_to=tmp_path / "ck")
    saved = first.features[0]["sync"]["averagings"]
    res = _program(model, batches, method).run_local(batches[20:], cluster=clusters.get(2),
                                                     resume_from=tmp_path / "ck")
    assert len(res.losses) == 20
    a, b = (res.features[r]["sync"] for r in range(2))
    assert a["averagings"] == b["averagings"] > saved == first.features[1]["sync"]["averagings"]
    assert len(a["fingerprints"]) == len(b["fingerprints"]) == a["averagings"]
    for (fa, na), (fb, nb) in zip(a["fingerprints"], b["fingerprints"]):
        assert na > 0 and nb > 0
        assert abs(fa + fb) <= 1e-9 * (na + nb), (fa, fb)
