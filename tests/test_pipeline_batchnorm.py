"""BatchNorm in pipelines: the stage that runs a BatchNorm updates its running statistics microbatch by microbatch, in
order, so a pipeline trains what one process does with gradient accumulation over the same microbatches (each
normalised with its own statistics: docs/semantics.md, BatchNorm) -- parameters, running statistics and step counts
to 1e-10, and through a checkpoint."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.testing import max_abs_diff

pytestmark = pytest.mark.numerics

OPT = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


class BNStack(nn.Module):
    """Four Linear + BatchNorm + ReLU blocks and a head: a BatchNorm in every stage of a 2- or 4-stage cut."""

    def __init__(self, d=8, blocks=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(d), nn.ReLU()) for _ in range(blocks))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _model():
    torch.manual_seed(0)
    return BNStack().double()


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g, dtype=torch.float64), torch.randn(16, 4, generator=g, dtype=torch.float64))
            for _ in range(n)]


def accumulation_reference(model, batches, m: int):
    """One process: each step's batch in ``m`` microbatches, in order, gradients summed (each loss over m), SGD."""
    ref = _model()
    ref.load_state_dict(model.state_dict())
    opt = OPT[0](ref.parameters(), **OPT[1])
    losses = []
    for x, y in batches:
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            loss = F.mse_loss(ref(xs), ys) / m
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, ref.state_dict()


SCHEDULES = {"gpipe": dict(pp=2, schedule="gpipe", microbatches=2),
             "1f1b": dict(pp=2, schedule="1f1b", microbatches=4),
             "interleaved": dict(pp=2, schedule="interleaved", microbatches=2),
             "zb1p": dict(pp=2, schedule="zb1p", microbatches=2),
             "1f1b_pp4": dict(pp=4, schedule="1f1b", microbatches=4)}
QUICK = ("gpipe", "1f1b")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in QUICK else [pytest.mark.slow]) for n in SCHEDULES])
def test_a_pipeline_with_batch_norm_trains_as_gradient_accumulation(name, clusters):
    options = SCHEDULES[name]
    model, batches = _model(), _batches()
    strategy = fxpar.Strategy(**options)
    program = fxpar.parallelize(model, strategy.size, batches[0], F.mse_loss, OPT, strategy=strategy)
    res = program.run_local(batches, cluster=clusters.get(strategy.size))
    losses, state = accumulation_reference(model, batches, options["microbatches"])
    assert max(abs(a - b) for a, b in zip(res.losses, losses)) < 1e-10
    got = res.state_dict()
    assert int(got["blocks.3.1.num_batches_tracked"]) == 3 * options["microbatches"]
    assert max_abs_diff(got, state) < 1e-10
    running = [k for k in state if "running" in k]
    assert len(running) == 8 and all(not torch.equal(got[k], model.state_dict()[k]) for k in running)


def test_running_statistics_resume_from_a_checkpoint(clusters, tmp_path):
    """2 steps, saved; 1 more from the checkpoint: the same as 3 steps at once, running statistics included (each
    stage's rank saves the statistics it updated)."""
    model, batches = _model(), _batches()
    strategy = fxpar.Strategy(pp=2, schedule="1f1b", microbatches=2)
    program = fxpar.parallelize(model, 2, batches[0], F.mse_loss, OPT, strategy=strategy)
    program.run_local(batches[:2], cluster=clusters.get(2), save_to=tmp_path / "ckpt")
    resumed = program.run_local(batches[2:], cluster=clusters.get(2), resume_from=tmp_path / "ckpt")
    _, state = accumulation_reference(model, batches, 2)
    assert max_abs_diff(resumed.state_dict(), state) < 1e-10
