"""Checkpoint and resume: training 6 steps equals training 3, saving, resuming and training 3
more, bitwise; a checkpoint taken under one strategy loads under another and in plain PyTorch; a
half-written checkpoint is refused and the previous one stays intact."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fxpar
from fxpar.runtime.checkpoint import CheckpointError
from fxpar.testing import SkipMLP, class_batches, gpt_loss, max_abs_diff, reference_training, tiny_gpt, token_batches
from fxpar.testing.resume import assert_resume_is_exact

pytestmark = pytest.mark.numerics

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
CE = torch.nn.functional.cross_entropy


CASES = {
    "dp": (lambda: tiny_gpt(dropout=0.1), token_batches, gpt_loss, dict(dp=2)),     # dropout: the RNG resumes too
    "1f1b": (tiny_gpt, token_batches, gpt_loss, dict(pp=2, microbatches=4)),
    "zb1p": (tiny_gpt, token_batches, gpt_loss, dict(pp=2, schedule="zb1p", microbatches=4)),
    "2bw": (lambda: SkipMLP().double(), lambda n: class_batches(n, seed=2), CE, dict(pp=2, schedule="2bw", microbatches=4)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise(clusters, tmp_path, case):
    make, batches_of, loss_fn, strategy = CASES[case]
    torch.manual_seed(0)
    model, batches = make(), batches_of(6)
    st = fxpar.Strategy(**strategy)
    lc = clusters.get(st.size)
    prog = fxpar.parallelize(model, st.size, batches[0], loss_fn, ADAMW, strategy=st,
                             lr_scheduler=None if case == "2bw" else (torch.optim.lr_scheduler.StepLR,
                                                                      {"step_size": 2, "gamma": 0.5}))
    _, first, _ = assert_resume_is_exact(prog, batches, 3, lc, tmp_path / "ck")
    # without resume_from a call starts over from the program's initial weights
    assert prog.run_local(batches[:3], cluster=lc).losses == first.losses


def test_checkpoint_moves_between_strategies_and_into_plain_pytorch(clusters, tmp_path):
    model, batches = SkipMLP().double(), class_batches(6, seed=2)
    ref_losses, ref_state = reference_training(model, batches, CE, ADAMW)
    dp = fxpar.parallelize(model, 2, batches[0], CE, ADAMW, strategy=fxpar.Strategy(dp=2))
    dp.run_local(batches[:3], cluster=clusters.get(2), save_to=tmp_path / "ck")
    pp = fxpar.parallelize(model, 2, batches[0], CE, ADAMW, strategy=fxpar.Strategy(pp=2, microbatches=2))
    res = pp.run_local(batches[3:], cluster=clusters.get(2), resume_from=tmp_path / "ck")
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses[3:])) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
    # plain PyTorch, no process group: the model's own keys
    fresh = SkipMLP().double()
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"))
    fresh.load_state_dict(sd)
    three = reference_training(model, batches[:3], CE, ADAMW)[1]
    assert max_abs_diff(fresh.state_dict(), three) < 1e-10


def test_tied_weights_load_in_plain_pytorch(clusters, tmp_path):
    model, batches = tiny_gpt(), token_batches(2)
    prog = fxpar.parallelize(model, 2, batches[0], gpt_loss, ADAMW, strategy=fxpar.Strategy(pp=2, microbatches=2))
    res = prog.run_local(batches, cluster=clusters.get(2), save_to=tmp_path / "ck")
    fresh = tiny_gpt()
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"))           # every key, the tied alias included
    assert max_abs_diff(sd, res.state_dict()) == 0


def test_half_written_checkpoint_is_refused_and_the_previous_one_stays(clusters, tmp_path, monkeypatch):
    model, batches = SkipMLP().double(), class_batches(4, seed=2)
    prog = fxpar.parallelize(model, 1, batches[0], CE, ADAMW, strategy=fxpar.Strategy())
    good = prog.run_local(batches[:2], save_to=tmp_path / "ck")
    import fxpar.runtime.checkpoint as ckpt

    def killed(*a, **k):
        raise KeyboardInterrupt("killed between the data and the manifest")
    monkeypatch.setattr(ckpt, "_write_manifest", killed)
    with pytest.raises(BaseException, match="killed"):
        prog.run_local(batches[2:], save_to=tmp_path / "ck")
    monkeypatch.undo()
    partial = str(tmp_path / "ck") + ".fxpar-partial"
    assert os.path.isdir(partial)
    with pytest.raises(CheckpointError, match=r"fxpar-partial.*(incomplete|half|not complete)"):
        prog.run_local(batches[2:], resume_from=partial)
    again = prog.run_local(batches[2:], resume_from=tmp_path / "ck")     # the previous checkpoint still loads
    whole = prog.run_local(batches)
    assert good.losses + again.losses == whole.losses
    with pytest.raises(CheckpointError, match="no_such_dir"):
        prog.run_local(batches, resume_from=tmp_path / "no_such_dir")
