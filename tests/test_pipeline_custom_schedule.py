"""Hand-written schedules: ``Strategy(schedule=...)`` takes a ``fxpar.schedule.Schedule`` or its text. The
program validates and dry-runs it when built: one that deadlocks fails at ``parallelize`` time naming the
step, the ranks and what each waits on; a valid one runs and matches single-process training."""
from __future__ import annotations

import re

import pytest
import torch

import fxpar
from fxpar.schedule import Schedule, ScheduleDeadlockError, ScheduleValidationError, get_schedule
from fxpar.testing import (SkipNet, TinyGPT, class_batches, flat_gpt_loss, max_abs_diff, reference_training,
                           tiny_gpt_batches)

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
CE = torch.nn.functional.cross_entropy


def _permuted_gpipe() -> str:
    """GPipe for p=2, m=4 with the forwards in the order 1 0 3 2 and the backwards 3 1 2 0, written out."""
    return """# schedule name=mine ranks=2 stages=2 microbatches=4 placement=0:0,1:1
rank 0: F0.1 SF0.1>1 F0.0 SF0.0>1 F0.3 SF0.3>1 F0.2 SF0.2>1 RB0.3<1 B0.3 RB0.1<1 B0.1 RB0.2<1 B0.2 RB0.0<1 B0.0 STEP0
rank 1: RF1.1<0 F1.1 RF1.0<0 F1.0 RF1.3<0 F1.3 RF1.2<0 F1.2 B1.3 SB1.3>0 B1.1 SB1.1>0 B1.2 SB1.2>0 B1.0 SB1.0>0 STEP1
"""


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("form", ["text", "object", "grid"])
def test_hand_permuted_gpipe_matches_single_process(clusters, form):
    text = _permuted_gpipe()
    sched = {"text": text, "object": Schedule.parse(text), "grid": str(Schedule.parse(text))}[form]
    model, batches = TinyGPT(layers=2).double(), tiny_gpt_batches(2)
    ref_losses, ref_state = reference_training(model, batches, flat_gpt_loss, SGD_M)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], flat_gpt_loss, SGD_M,
                             strategy=fxpar.Strategy(pp=2, schedule=sched, microbatches=4))
    assert str(prog.schedule(0)).startswith("rank 0: F0.1 SF0.1>1 F0.0")
    assert "hand-written 'mine'" in prog.explain()
    if form != "text":
        return                    # the three forms give one Schedule; run it once
    res = prog.run_local(batches, cluster=clusters.get(2))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10


@pytest.mark.structure
def test_deadlocking_schedule_fails_at_parallelize_time_naming_step_ranks_and_waits():
    # rank 0 waits for a gradient of microbatch 0 before it has sent microbatch 0's activations
    text = get_schedule("1f1b", 2, 2).format_lists()
    text = text.replace("rank 0: F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1", "rank 0: RB0.0<1 F0.0 SF0.0>1 F0.1 SF0.1>1")
    batches = class_batches(1)
    with pytest.raises(ScheduleDeadlockError) as info:
        fxpar.parallelize(SkipNet().double(), fxpar.ClusterSpec.local(2), batches[0], CE, SGD_M,
                          strategy=fxpar.Strategy(pp=2, schedule=text, microbatches=2))
    msg = str(info.value)
    assert "deadlocks at step 0: ranks [0, 1]" in msg
    assert re.search(r"rank 0 waits at step 0 on RB0.0<1 but rank 1 sends it \(SB1.0>0\) only at step 3", msg)
    assert re.search(r"rank 1 waits at step 0 on RF1.0<0 but rank 0 sends it \(SF0.0>1\) only at step 2", msg)
    assert set(info.value.stuck) == {0, 1} and info.value.step == 0


@pytest.mark.structure
def test_schedule_that_does_not_fit_the_strategy():
    text = get_schedule("gpipe", 2, 4).format_lists()
    with pytest.raises(fxpar.StrategyError, match=r"covers 4 microbatches but microbatches=2.*microbatches=4"):
        fxpar.parallelize(SkipNet().double(), fxpar.ClusterSpec.local(2), class_batches(1)[0], CE, SGD_M,
                          strategy=fxpar.Strategy(pp=2, schedule=text, microbatches=2))
    with pytest.raises(fxpar.StrategyError, match=r"Strategy\(schedule=<text>\): cannot read action 'X0.1'"):
        fxpar.Strategy(pp=2, schedule=text.replace("F0.1", "X0.1"), microbatches=4)
    with pytest.raises(ScheduleValidationError, match=r"hand-written schedule 'gpipe': B0.3 appears 0 times"):
        fxpar.parallelize(SkipNet().double(), fxpar.ClusterSpec.local(2), class_batches(1)[0], CE, SGD_M,
                          strategy=fxpar.Strategy(pp=2, schedule=text.replace(" B0.3", ""), microbatches=4))
