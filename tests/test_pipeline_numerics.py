"""Pipeline numerics (DESIGN §5): every synchronous schedule, run on gloo ranks, reproduces
single-process training of the same model on the same global batches, float64, to 1e-10."""
from __future__ import annotations

import functools

import pytest
import torch

import fxpar
from fxpar.testing import (SkipMLP, SkipNet, TinyGPT, class_batches, flat_gpt_loss, gpt_loss, max_abs_diff,
                           reference_training, tiny_gpt, tiny_gpt_batches, token_batches)

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
CE = torch.nn.functional.cross_entropy
TOL = 1e-10


def _check(clusters, model, batches, loss_fn, optimizer, lr_scheduler=None, **strategy):
    strategy = fxpar.Strategy(**strategy)
    ref_losses, ref_state = reference_training(model, batches, loss_fn, optimizer, lr_scheduler)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(strategy.size), batches[0], loss_fn, optimizer,
                             strategy=strategy, lr_scheduler=lr_scheduler)
    res = prog.run_local(batches, cluster=clusters.get(strategy.size))
    state = res.state_dict()
    assert set(state) == set(ref_state)            # the model's own keys, tied alias included
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL, (res.losses, ref_losses)
    assert max_abs_diff(state, ref_state) < TOL
    return prog, res


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb1p", "chimera"])
def test_tied_gpt_pp2_matches_single_process(clusters, schedule):
    _, res = _check(clusters, TinyGPT().double(), tiny_gpt_batches(3), flat_gpt_loss, SGD_M,
                    pp=2, schedule=schedule, microbatches=4)
    assert res.state_dict()["head.weight"] is res.state_dict()["wte.weight"]


@pytest.mark.slow
@pytest.mark.numerics
def test_skip_connection_across_the_cut_pp2_adamw(clusters):
    prog, res = _check(clusters, SkipNet().double(), class_batches(3), CE, ADAMW,
                       pp=2, schedule="1f1b", microbatches=4, split_points=["layers.2"])
    assert [k for r, k in prog.split.stages[1].inputs if r == "act"] == \
        [k for r, k in prog.split.stages[0].outputs]      # the skip tensor and the stream cross together
    assert len(prog.split.stages[0].outputs) == 2
    # 3 steps x 4 microbatches, one message each way per microbatch, each message 2 tensors of
    # 2 rows x 16 float64 (the stream and the skip; their gradients on the way back)
    for r in (0, 1):
        assert res.comm[r]["sends"] == 12 and res.comm[r]["recvs"] == 12
        assert res.comm[r]["sent_bytes"] == 12 * 2 * (2 * 16 * 8)


@pytest.mark.slow
@pytest.mark.numerics
def test_lead_gpt_with_adamw_and_lr_scheduler(clusters):
    model, batches = tiny_gpt(), token_batches(3)
    sched = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)   # picklable for the ranks
    _check(clusters, model, batches, gpt_loss, ADAMW, sched, pp=2, schedule="gpipe", microbatches=4)


@pytest.mark.numerics
def test_untraced_optimizer_runs_eagerly_per_stage(clusters):
    _check(clusters, SkipMLP().double(), class_batches(3), CE, (torch.optim.RMSprop, {"lr": 1e-2}),
           pp=2, schedule="1f1b", microbatches=2)


@pytest.mark.slow
@pytest.mark.numerics
def test_gpt_pp2_dp2(clusters):
    _check(clusters, TinyGPT().double(), tiny_gpt_batches(3, batch=16), flat_gpt_loss, SGD_M,
           pp=2, dp=2, schedule="1f1b", microbatches=4)


@pytest.mark.slow
@pytest.mark.numerics
def test_gpt_pp4_1f1b_tied_first_and_last_stage(clusters):
    prog, _ = _check(clusters, TinyGPT().double(), tiny_gpt_batches(3), flat_gpt_loss, ADAMW,
                     pp=4, schedule="1f1b", microbatches=4)
    assert prog.split.shared_params == {"wte.weight": [0, 3]}


@pytest.mark.numerics
@pytest.mark.parametrize("schedule", ["gpipe", "chimera"])
def test_skip_pp4(clusters, schedule):
    _check(clusters, SkipNet().double(), class_batches(3), CE, SGD_M, pp=4, schedule=schedule, microbatches=4)


@pytest.mark.slow
@pytest.mark.numerics
def test_gpt_pp4_interleaved_eight_stages(clusters):
    prog, _ = _check(clusters, TinyGPT().double(), tiny_gpt_batches(3), flat_gpt_loss, SGD_M,
                     pp=4, schedule="interleaved", microbatches=4)
    assert len(prog.stages) == 8 and prog.split.shared_params == {"wte.weight": [0, 7]}


@pytest.mark.slow
@pytest.mark.numerics
def test_chimera_pp2_dp2_replicated_stages_and_tied_weights(clusters):
    """Chimera holds every stage twice per pipeline; with dp=2 gradients meet over both kinds of replica."""
    prog, _ = _check(clusters, TinyGPT().double(), tiny_gpt_batches(2, batch=16), flat_gpt_loss, ADAMW,
                     pp=2, dp=2, schedule="chimera", microbatches=4)
    assert prog.pipe_schedule.stage_to_rank == {0: (0, 1), 1: (0, 1)}
    assert prog.plan.stage_to_rank == [[0, 1], [0, 1]]


@pytest.mark.numerics
def test_model_returning_its_own_loss(clusters):
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = SkipNet().double()

        def forward(self, x, y):
            return CE(self.net(x), y)

    _check(clusters, WithLoss(), class_batches(2), None, SGD_M, pp=2, schedule="1f1b", microbatches=2,
           split_points=["net.layers.2"])


def _runner_job(program, batches):
    runner = program.runner()              # the group is already up on a LocalCluster rank, as under torchrun
    losses = [runner.step(b) for b in batches]
    return losses, runner.state_dict()


@pytest.mark.slow
@pytest.mark.numerics
def test_rank_runner_the_torchrun_path(clusters):
    model, batches = TinyGPT().double(), tiny_gpt_batches(2)
    ref_losses, ref_state = reference_training(model, batches, flat_gpt_loss, SGD_M)
    strategy = fxpar.Strategy(pp=2, schedule="1f1b", microbatches=4)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], flat_gpt_loss, SGD_M, strategy=strategy)
    out = clusters.get(2).run(_runner_job, [(prog, batches)] * 2)
    for losses, state in out:               # every rank gets the global loss and the whole state
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL
        assert max_abs_diff(state, ref_state) < TOL


@pytest.mark.slow
@pytest.mark.structure
def test_stage_step_runs_in_place_bitwise():
    """Synchronous schedules update a stage's weights and moments in place: the STEP graph, cut out of the
    stage's joint graph after reinplace_optimizer, writes into its own parameter and state inputs (the new
    weights *are* the old buffers) and is bitwise equal to the functional update (the optimizer's traced
    foreach step, ``OptimizerSpec.step_all``, run eagerly on the same values). AdamW with ``fused=False``: its
    list ops run in place (the default, one fused call per update, is tests/test_fuse_optimizer.py's).
    The step is part of each stage's joint graph."""
    from fxpar.optim import resolve_optimizer
    for opt in [(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": False}),
                (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True})]:
        spec = resolve_optimizer(opt)
        torch.manual_seed(0)
        prog = fxpar.parallelize(SkipNet().double(), fxpar.ClusterSpec.local(2), class_batches(1)[0], CE, opt,
                                 strategy=fxpar.Strategy(pp=2, schedule="1f1b", microbatches=2))
        for st in prog.stages:
            sg = st.graphs["STEP"]
            ops = [n.target._schema.name for n in sg.gm.graph.nodes if n.op == "call_function" and
                   hasattr(n.target, "_schema") and n.target._schema.name.startswith("aten::_foreach_")]
            assert ops and any(o.endswith("_") for o in ops)
            shapes, keys = st.captured.param_shapes, st.param_keys

            def inputs():
                torch.manual_seed(1)
                args = []
                for role, key in sg.inputs:
                    if role in ("param", "grad"):
                        args.append(torch.randn(shapes[key], dtype=torch.float64))
                    elif role == "opt_state":
                        args.append(torch.rand(shapes[key.split(":", 1)[1]], dtype=torch.float64))
                    elif role == "lr":
                        args.append(torch.tensor(1e-2, dtype=torch.float64))
                    elif role == "step":
                        args.append(torch.tensor(3.0, dtype=torch.float64))
                    else:
                        raise AssertionError(f"unexpected STEP input {role} {key}")
                return args

            a_in = inputs()
            a = dict(zip(sg.outputs, sg.gm(*a_in)))
            b = dict(zip(sg.inputs, inputs()))
            states = [[b[("opt_state", f"{name}:{k}")] for k in keys] for name in spec.state_names]
            new_p, new_s = spec.step_all([b[("param", k)] for k in keys], [b[("grad", k)] for k in keys], states,
                                         b[("lr", "lr")], b[("step", "step")])
            for i, k in enumerate(keys):
                assert torch.equal(a[("new_param", k)], new_p[i]), k
                for j, name in enumerate(spec.state_names):
                    assert torch.equal(a[("new_opt_state", f"{name}:{k}")], new_s[j][i]), (name, k)
            given = dict(zip(sg.inputs, a_in))
            # the new weights and moments *are* the old buffers
            assert [a[("new_param", k)] is given[("param", k)] for k in keys] == [True] * len(keys)
            assert all(a[("new_opt_state", f"{name}:{k}")] is given[("opt_state", f"{name}:{k}")]
                       for k in keys for name in spec.state_names)
