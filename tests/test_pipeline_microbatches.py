"""m = 8 microbatches: every synchronous schedule at pp=2 and pp=4, on the tied GPT and on the
skip-connection model, reproduces single-process training (float64, 1e-10); and the activation memory the
ranks measured per stage -- the most microbatches whose saved tensors were alive at once, and the bytes
those tensors held -- equals the simulator's ``peak_activations``, the papers' counts (GPipe: m on every
stage; 1F1B: p - s on stage s) and ``peak x`` the saved bytes per microbatch of the stage's F graph."""
from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.explain import fmt_bytes
from fxpar.schedule import simulate
from fxpar.testing import (SkipNet, TinyGPT, class_batches, flat_gpt_loss, max_abs_diff, reference_training,
                           tiny_gpt_batches)

pytestmark = pytest.mark.numerics

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
CE = torch.nn.functional.cross_entropy
TOL, M = 1e-10, 8


def _run(clusters, model, batches, loss_fn, **strategy):
    strategy = fxpar.Strategy(microbatches=M, **strategy)
    ref_losses, ref_state = reference_training(model, batches, loss_fn, SGD_M)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(strategy.size), batches[0], loss_fn, SGD_M,
                             strategy=strategy)
    res = prog.run_local(batches, cluster=clusters.get(strategy.size))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL, (res.losses, ref_losses)
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    return prog, res


def _model(name, stages):
    if name == "gpt":            # LM head tied to the embedding: first and last stage share it
        return TinyGPT(layers=2 if stages <= 4 else 4).double(), tiny_gpt_batches(2), flat_gpt_loss
    return SkipNet(layers=6).double(), class_batches(2), CE


CASES = [(model, pp, sched) for model in ("gpt", "skip") for pp in (2, 4)
         for sched in ("gpipe", "1f1b", "interleaved", "zb1p", "chimera")]


@pytest.mark.slow
@pytest.mark.parametrize("model,pp,schedule", CASES)
def test_eight_microbatches_match_single_process(clusters, model, pp, schedule):
    m, batches, loss_fn = _model(model, 2 * pp if schedule == "interleaved" else pp)
    prog, res = _run(clusters, m, batches, loss_fn, pp=pp, schedule=schedule)
    sim = simulate(prog.pipe_schedule)
    n = prog.pipe_schedule.n_stages
    if schedule != "chimera":          # one replica per stage: the runtime's count is the simulator's
        assert res.peak_activations == sim.peak_activations
    closed = {"gpipe": {s: M for s in range(n)}, "1f1b": {s: pp - s for s in range(n)}}.get(schedule)
    if closed is not None:
        assert res.peak_activations == closed
    # bytes actually held == microbatches held x the bytes the stage's F graph saves per microbatch
    # (Stage.saved_bytes, predicted from the F graph's saved outputs), as explain() reports them.
    text = prog.explain()
    for s, st in enumerate(prog.stages):
        per_mb = st.saved_bytes
        assert per_mb > 0
        assert res.peak_activation_bytes[s] == res.peak_activations[s] * per_mb, (s, res.peak_activation_bytes)
        n_saved = sum(r == "saved" for r, _ in st.graphs["F"].outputs)
        assert f"F saves {n_saved} tensors ({fmt_bytes(per_mb)}) per microbatch" in text


@pytest.mark.slow
def test_eight_microbatches_pp2_dp2(clusters):
    prog, res = _run(clusters, TinyGPT(layers=2).double(), tiny_gpt_batches(2, batch=16), flat_gpt_loss,
                     pp=2, dp=2, schedule="1f1b")
    assert res.peak_activations == {0: 2, 1: 1}
    for r in range(4):           # what collectives(rank) lists is what the rank sent, over 2 steps
        sends = [c for c in prog.collectives(r) if c.kind == "send"]
        assert res.comm[r]["sends"] == 2 * len(sends) == 2 * M
        assert res.comm[r]["sent_bytes"] == 2 * sum(c.nbytes for c in sends)
