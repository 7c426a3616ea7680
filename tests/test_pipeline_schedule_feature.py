"""Pipeline schedules are features (fxpar/features/pipeline*): a user's schedule is one PipelineSchedule subclass
registered from the user's own file (here: GPipe with its backwards in forward order, written with the public
schedule IR), enabled by its name in ``Strategy(schedule=...)``, run at pp=2 on gloo against single-process
training, and unregistered; the built-in families each own their names, and the core asks the Plan whether the
schedule is asynchronous."""
from __future__ import annotations

import json

import pytest
import torch

import fxpar
from fxpar.feature import schedule_features, schedule_names, unregister_feature
from fxpar.features.pipeline import PipelineSchedule
from fxpar.planner import is_asynchronous
from fxpar.schedule import Schedule, ensure_reduce_grad, get_schedule, simulate
from fxpar.schedule.wavelet import wavelet
from fxpar.testing import (SkipNet, TinyGPT, class_batches, flat_gpt_loss, max_abs_diff, reference_training,
                           tiny_gpt_batches)

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
CE = torch.nn.functional.cross_entropy


def fifo_gpipe(p: int, m: int) -> Schedule:
    """GPipe whose backwards run in forward order (microbatch 0 first), written as the schedule IR's text."""
    lines = [f"# schedule name=fifo_gpipe ranks={p} stages={p} microbatches={m} "
             f"placement={','.join(f'{s}:{s}' for s in range(p))}"]
    for r in range(p):
        acts = []
        first, last = r == 0, r == p - 1
        for i in range(m):
            acts += ([] if first else [f"RF{r}.{i}<{r - 1}"]) + [f"F{r}.{i}"] + ([] if last else [f"SF{r}.{i}>{r + 1}"])
        for i in range(m):
            acts += ([] if last else [f"RB{r}.{i}<{r + 1}"]) + [f"B{r}.{i}"] + ([] if first else [f"SB{r}.{i}>{r - 1}"])
        lines.append(f"rank {r}: " + " ".join(acts + [f"STEP{r}"]))
    return ensure_reduce_grad(Schedule.parse("\n".join(lines) + "\n"))


class FifoGPipe(PipelineSchedule):
    name = "fifo_gpipe"
    doc = "GPipe with the backwards in forward order"
    schedules = {"fifo_gpipe": fifo_gpipe}
    papers = {"fifo_gpipe": "GPipe, backwards first-in first-out (a test's own schedule)"}


@pytest.fixture
def fifo():
    fxpar.register_feature(FifoGPipe)
    try:
        yield FifoGPipe
    finally:
        unregister_feature(FifoGPipe.name)


@pytest.mark.numerics
def test_user_schedule_feature_matches_single_process(clusters, fifo):
    model, batches = TinyGPT(layers=2).double(), tiny_gpt_batches(2)
    ref_losses, ref_state = reference_training(model, batches, flat_gpt_loss, SGD_M)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], flat_gpt_loss, SGD_M,
                             strategy=fxpar.Strategy(pp=2, schedule="fifo_gpipe", microbatches=4))
    assert prog.plan.schedule == "fifo_gpipe" and not prog.asynchronous
    assert [n for n, sec in prog.plan.features.items() if sec.picks_schedule] == ["fifo_gpipe"]
    assert list(prog.plan.features)[0] == "fifo_gpipe"          # decided first: the others may ask about it
    assert str(prog.schedule(1)).startswith("rank 1: RF1.0<0 F1.0 RF1.1<0 F1.1 RF1.2<0 F1.2 RF1.3<0 F1.3 B1.0 SB1.0>0")
    assert "GPipe, backwards first-in first-out" in prog.explain()
    res = prog.run_local(batches, cluster=clusters.get(2))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10


@pytest.mark.structure
def test_user_schedule_feature_plan_round_trip_and_unregister(fifo):
    assert "fifo_gpipe" in schedule_names(asynchronous=False) and simulate(fifo_gpipe(3, 4)).bubble_fraction > 0
    prog = fxpar.parallelize(SkipNet().double(), fxpar.ClusterSpec.local(2), class_batches(1)[0], CE, SGD_M,
                             strategy=fxpar.Strategy(pp=2, schedule="fifo_gpipe", microbatches=2))
    text = prog.plan.to_json()
    assert json.loads(text)["features"]["fifo_gpipe"] == {"schedule": "fifo_gpipe"}
    back = fxpar.Plan.from_json(text)
    assert back.schedule == "fifo_gpipe" and str(back) == str(prog.plan)
    assert "fifo_gpipe: fifo_gpipe, synchronous: one weight version, flushed every step" in str(prog.plan)
    again = fxpar.parallelize(SkipNet().double(), fxpar.ClusterSpec.local(2), class_batches(1)[0], CE, SGD_M,
                              strategy=fxpar.Strategy(pp=2, microbatches=2), plan=back)
    assert again.plan.schedule == "fifo_gpipe" and again.plan.cuts == prog.plan.cuts
    unregister_feature(FifoGPipe.name)
    with pytest.raises(fxpar.StrategyError, match=r"Strategy\(schedule='fifo_gpipe'\): choose one of"):
        fxpar.Strategy(pp=2, schedule="fifo_gpipe", microbatches=2)


@pytest.mark.structure
def test_builtin_schedule_families_and_the_asynchronous_question():
    """Each built-in name enables exactly one schedule feature; the Plan (and, before it, the Strategy) says
    asynchronous exactly for the schedules whose actions name weight versions (a stage updates inside the window)."""
    owners = {}
    # HetPipe's virtual workers: two or more; Wavelet's waves: on each data-parallel rank, one stage
    mesh = {"hetpipe": {"dp": 2, "pp": 2}, "wavelet": {"dp": 2, "pp": 1}}
    for name in schedule_names():
        st = fxpar.Strategy(**mesh.get(name, {"dp": 1, "pp": 2}), schedule=name, microbatches=2)
        on = [f.name for f in schedule_features() if f.enabled(st)]
        assert len(on) == 1, (name, on)
        owners[name] = on[0]
        sched = wavelet(1, 2) if name == "wavelet" else get_schedule(name, 2, 2)    # Wavelet's: one pipeline rank
        versions = any(a.version is not None for acts in sched.actions.values() for a in acts)
        assert is_asynchronous(st) == versions, name
    assert owners == {"gpipe": "pipeline_flush", "1f1b": "pipeline_flush", "interleaved": "pipeline_flush",
                      "zb1p": "zero_bubble", "chimera": "chimera", "pipedream": "pipedream", "2bw": "pipedream",
                      "pipelined_bp": "delayed_pipeline", "pipemare": "delayed_pipeline", "hetpipe": "hetpipe",
                      "wavelet": "wavelet"}
    assert not is_asynchronous(fxpar.Strategy(pp=2)) and not is_asynchronous(fxpar.Strategy(dp=2))
    prog = fxpar.parallelize(SkipNet().double(), fxpar.ClusterSpec.local(2), class_batches(1)[0], CE, SGD_M,
                             strategy=fxpar.Strategy(pp=2, schedule="2bw", microbatches=2))
    assert prog.plan.asynchronous and prog.asynchronous and prog.plan.schedule == "2bw"
    assert fxpar.Plan.from_json(prog.plan.to_json()).asynchronous
    one = fxpar.parallelize(SkipNet().double(), fxpar.ClusterSpec.local(2), class_batches(1)[0], CE, SGD_M,
                            strategy=fxpar.Strategy(dp=2))
    assert one.plan.schedule == "single" and one.plan.schedule_section is None and not one.plan.asynchronous


@pytest.mark.structure
def test_a_schedule_feature_that_takes_a_builtin_name_is_refused_when_planned(fifo):
    class Twin(PipelineSchedule):
        name = "twin_1f1b"
        schedules = {"1f1b": fifo_gpipe}
    fxpar.register_feature(Twin)
    try:
        with pytest.raises(fxpar.StrategyError, match=r"schedule features \['pipeline_flush', 'twin_1f1b'\] all "
                                                      r"build schedule '1f1b'; unregister one of them"):
            fxpar.parallelize(SkipNet().double(), fxpar.ClusterSpec.local(2), class_batches(1)[0], CE, SGD_M,
                              strategy=fxpar.Strategy(pp=2, schedule="1f1b", microbatches=2))
    finally:
        unregister_feature(Twin.name)


@pytest.mark.structure
def test_editing_the_plans_schedule():
    """``plan.schedule`` edits the schedule feature's section: a name the same family builds is taken when the Plan is
    handed back; another family's name is refused naming that family; a one-stage Plan has no schedule to edit."""
    def build(**kw):
        return fxpar.parallelize(SkipNet().double(), fxpar.ClusterSpec.local(2), class_batches(1)[0], CE, SGD_M, **kw)
    plan = build(strategy=fxpar.Strategy(pp=2, microbatches=2)).plan
    assert plan.schedule == "1f1b"
    plan.schedule = "gpipe"
    prog = build(strategy=fxpar.Strategy(pp=2, microbatches=2), plan=plan)
    assert prog.plan.schedule == "gpipe" and str(prog.schedule(1)) == "rank 1: " + " ".join(
        a.short() for a in get_schedule("gpipe", 2, 2).actions[1])
    plan.schedule = "zb1p"
    with pytest.raises(fxpar.StrategyError, match=r"'pipeline_flush' section names schedule 'zb1p'.*feature "
                                                  r"'zero_bubble' does: make the Plan with Strategy\(pp=2, "
                                                  r"schedule='zb1p'\)"):
        build(strategy=fxpar.Strategy(pp=2, microbatches=2), plan=plan)
    with pytest.raises(ValueError, match=r"Plan.schedule = 'gpipe': this Plan runs the one-stage program"):
        fxpar.Plan().schedule = "gpipe"
