"""The asynchronous pipeline schedules refuse an LR scheduler, by name, before any rank starts: they update a stage
after every microbatch (PipeDream, Pipelined Backpropagation, PipeMare) or with a batch's gradient on the version
before (2BW), so "once per batch", when fxpar steps a scheduler, names no update (docs/semantics.md §1). The same
model and scheduler under a synchronous schedule plan."""
import functools

import pytest
import torch

import fxpar
from fxpar.testing import SkipNet, class_batches

CE = torch.nn.functional.cross_entropy
SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
STEP_LR = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)

pytestmark = pytest.mark.structure


def _program(schedule):
    return fxpar.parallelize(SkipNet().double(), fxpar.ClusterSpec.local(2), class_batches(1)[0], CE, SGD_M,
                             strategy=fxpar.Strategy(pp=2, schedule=schedule, microbatches=4), lr_scheduler=STEP_LR)


@pytest.mark.parametrize("schedule", ["pipedream", "2bw", "pipelined_bp", "pipemare"])
def test_an_asynchronous_schedule_refuses_an_lr_scheduler_by_name(schedule):
    with pytest.raises(fxpar.StrategyError, match=rf"schedule '{schedule}' updates weights inside a window of "
                                                  r"microbatches; an lr_scheduler stepped once per batch is not "
                                                  r"defined for it\. Drop lr_scheduler or use a synchronous schedule"):
        _program(schedule)


def test_a_synchronous_schedule_takes_it():
    assert _program("1f1b").plan.schedule == "1f1b"
