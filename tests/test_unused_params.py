"""Parameters the loss never reaches: torch.optim skips a parameter whose ``.grad`` is None
-- no weight decay, no momentum, no optimizer state -- and so must every fxpar strategy. They stay in
``state_dict()`` (so ``load_state_dict(strict=True)`` works) and in checkpoints, unchanged.

The model has a module its forward never calls (``unused``) and a weight used only through ``.detach()``
(``gate``): both get ``.grad is None`` in torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.testing import class_batches, max_abs_diff, reference_training

TOL = 1e-10
OPTIMIZERS = {"adamw_wd": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
              "sgd_momentum_wd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01})}
STRATEGIES = {"one_stage": dict(), "dp2": dict(dp=2), "pp2": dict(pp=2, microbatches=2)}
NEVER = ["gate", "unused.weight", "unused.bias"]


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.unused = nn.Linear(8, 8)                 # never called
        self.gate = nn.Parameter(torch.ones(8))       # used only through .detach(): no gradient
        self.out = nn.Linear(8, 5)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x * self.gate.detach())


def _model():
    torch.manual_seed(0)
    return WithUnused().double()


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", list(STRATEGIES.values()), ids=list(STRATEGIES))
@pytest.mark.parametrize("opt", list(OPTIMIZERS.values()), ids=list(OPTIMIZERS))
def test_unused_parameters_follow_torch_optim(clusters, strategy, opt):
    model, batches = _model(), class_batches(3, d=8, classes=5, seed=1)
    ref_losses, ref_state = reference_training(model, batches, F.cross_entropy, opt)
    st = fxpar.Strategy(**strategy)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(st.size), batches[0], F.cross_entropy, opt, strategy=st)
    res = prog.run_local(batches, cluster=clusters.get(st.size) if st.size > 1 else None)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    sd = res.state_dict()
    assert list(sd) == list(model.state_dict())                     # every key, in the model's order
    assert max_abs_diff(sd, ref_state) < TOL
    for k in NEVER:                                                 # not moved: no weight decay, no momentum
        assert torch.equal(sd[k], model.state_dict()[k]), k
    assert not [k for k in res.optimizer_state if k.split(":", 1)[-1] in NEVER]   # no optimizer state born
    WithUnused().double().load_state_dict(sd, strict=True)
    assert any(str(NEVER) in n and "no gradient" in n for n in prog.plan.notes), prog.plan.notes
    for stage in prog.stages:
        assert not set(stage.param_keys) & set(NEVER)
        assert not {k for r, k in stage.captured.signature.outputs if r == "grad"} & set(NEVER)


@pytest.mark.numerics
def test_an_eager_optimizer_skips_them_too(clusters):
    opt = (torch.optim.RMSprop, {"lr": 1e-2, "weight_decay": 0.1})       # not traced: torch's own step per rank
    model, batches = _model(), class_batches(2, d=8, classes=5, seed=1)
    ref_losses, ref_state = reference_training(model, batches, F.cross_entropy, opt)
    prog = fxpar.parallelize(model, 2, batches[0], F.cross_entropy, opt, strategy=fxpar.Strategy(dp=2))
    res = prog.run_local(batches, cluster=clusters.get(2))
    assert max_abs_diff(res.state_dict(), ref_state) < TOL


@pytest.mark.numerics
def test_checkpoint_under_pp_holds_them_and_loads_in_plain_pytorch(clusters, tmp_path):
    import torch.distributed.checkpoint as dcp
    model, batches = _model(), class_batches(2, d=8, classes=5, seed=1)
    prog = fxpar.parallelize(model, 2, batches[0], F.cross_entropy, OPTIMIZERS["adamw_wd"],
                             strategy=fxpar.Strategy(pp=2, microbatches=2))
    res = prog.run_local(batches, cluster=clusters.get(2), save_to=tmp_path / "ckpt")
    fresh = WithUnused().double()
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt"))
    fresh.load_state_dict(sd, strict=True)
    assert max_abs_diff(fresh.state_dict(), res.state_dict()) == 0


@pytest.mark.structure
def test_a_loss_that_reaches_no_parameter_is_refused_by_name():
    class Constant(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x.sum() * 0 + self.w.detach().sum()

    with pytest.raises(fxpar.CaptureError, match=r"loss of Constant does not depend on any of its trainable "
                                                 r"parameters \(w\).*Check that forward uses its parameters"):
        fxpar.parallelize(Constant(), 1, (torch.randn(2, 3),), None)
