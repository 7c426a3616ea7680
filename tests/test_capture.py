"""Capture: the training-step graph, its signature and meta, on the models real users have."""
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar import meta as M
from fxpar.capture import capture_training_step
from fxpar.optim import resolve_optimizer
from fxpar.testing import GPT, BNConvNet, EncoderModel, gpt_loss, max_abs_diff, reference_training

# capture is what these tests test: each build traces (tests/conftest.py)
SHARED_CAPTURES = False

OPTS = [(torch.optim.SGD, {"lr": 0.1}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
        (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}), (torch.optim.AdamW, {"lr": 1e-2})]


def _run_single(model, batches, loss_fn, opt):
    p = fxpar.parallelize(model, 1, batches[0], loss_fn=loss_fn, optimizer=opt)
    return p, p.run_local(batches)


@pytest.mark.numerics
@pytest.mark.parametrize("opt", OPTS, ids=lambda o: f"{o[0].__name__}{sorted(o[1].items())}" if isinstance(o, tuple) else "")
def test_traced_optimizer_equals_torch(opt):
    model = GPT().double()
    batches = [(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))) for _ in range(3)]
    p, res = _run_single(model, batches, gpt_loss, opt)
    assert p.captured.optimizer.traced
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, opt)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) <= 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) <= 1e-10


@pytest.mark.structure
def test_tied_parameter_is_one_placeholder_with_roles_and_phases():
    x = torch.randint(0, 64, (2, 8))
    cap = capture_training_step(GPT(), (x, x), gpt_loss, resolve_optimizer((torch.optim.AdamW, {"lr": 1e-3})))
    ph = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    params = [n for n in ph if M.get(n, M.ROLE) == "param"]
    assert [M.get(n, M.PARAM) for n in params] == cap.param_names
    assert "wte.weight" in cap.param_names and "head.weight" not in cap.param_names
    assert cap.aliases == {"head.weight": "wte.weight"}
    phases = {M.get(n, M.PHASE) for n in cap.gm.graph.nodes if n.op == "call_function"}
    assert phases == {"forward", "backward", "optimizer"}
    # module paths on forward and backward nodes
    mm_modules = {M.get(n, M.MODULE) for n in cap.gm.graph.nodes if n.target is torch.ops.aten.addmm.default}
    assert "blocks.0.qkv" in mm_modules and "blocks.1.fc2" in mm_modules
    bwd = [n for n in cap.gm.graph.nodes if M.get(n, M.PHASE) == "backward" and M.get(n, M.MODULE)]
    assert any(M.get(n, M.MODULE).startswith("blocks.1") for n in bwd)
    grads = [n for n in cap.gm.graph.nodes if M.get(n, M.GRAD_OF)]
    assert sorted(M.get(n, M.GRAD_OF) for n in grads) == sorted(cap.param_names)
    # the learned position table is sliced by sequence length
    assert any(n.target is torch.ops.aten.slice.Tensor and n.args[0].name == "wpe_weight" for n in cap.gm.graph.nodes)
    assert any("scaled_dot_product" in str(n.target) for n in cap.gm.graph.nodes)


@pytest.mark.numerics
def test_transformer_encoder_layer_trains():
    model = EncoderModel().double()
    batches = [(torch.randn(4, 6, 32, dtype=torch.float64), torch.randint(0, 5, (4,))) for _ in range(2)]
    opt = (torch.optim.SGD, {"lr": 0.1})
    _, res = _run_single(model, batches, F.cross_entropy, opt)
    ref_losses, ref_state = reference_training(model, batches, F.cross_entropy, opt)
    assert max_abs_diff(res.state_dict(), ref_state) <= 1e-10


@pytest.mark.structure
def test_batchnorm_buffers_are_outputs():
    x = torch.randn(4, 3, 8, 8)
    cap = capture_training_step(BNConvNet(), (x, torch.zeros(4, dtype=torch.long)), F.cross_entropy,
                                resolve_optimizer(None))
    assert cap.signature.keys("new_buffer", outputs=True) == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]


@pytest.mark.structure
def test_data_dependent_control_flow_names_the_module():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:
                return self.lin(x)
            return x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = Gate()

        def forward(self, x):
            return self.gate(x)

    with pytest.raises(fxpar.CaptureError, match=r"module 'gate' has control flow that depends on tensor values.*torch.where"):
        fxpar.parallelize(Net(), 1, (torch.randn(2, 4), torch.randn(2, 4)), loss_fn=F.mse_loss)


@pytest.mark.structure
def test_non_scalar_loss_is_rejected():
    with pytest.raises(fxpar.CaptureError, match=r"loss of Linear is not a scalar: got \(2, 3\).*reduction='mean'"):
        fxpar.parallelize(nn.Linear(4, 3), 1, (torch.randn(2, 4), torch.randn(2, 3)),
                          loss_fn=lambda o, t: F.mse_loss(o, t, reduction="none"))


@pytest.mark.structure
def test_optimizer_instance_is_rejected_with_advice():
    model = nn.Linear(4, 3)
    with pytest.raises(TypeError, match=r"pass \(torch.optim.X"):
        fxpar.parallelize(model, 1, (torch.randn(2, 4), torch.randn(2, 3)), loss_fn=F.mse_loss,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


class _GcProbe(nn.Module):
    """Records, at every forward, whether Python's cyclic garbage collector is on."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append(gc.isenabled())
        return self.fc(x)


@pytest.mark.structure
@pytest.mark.parametrize("enabled", [True, False], ids=["collector_on", "collector_off"])
def test_the_collector_is_held_off_while_tracing_and_left_as_found(enabled):
    model = _GcProbe()
    in_passes = []

    @fxpar.graph_pass("gc_probe")
    def probe(gm, ctx):
        in_passes.append(gc.isenabled())
        return False

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        p = fxpar.parallelize(model, 1, (torch.randn(4, 8), torch.randn(4, 4)), loss_fn=F.mse_loss,
                              strategy=fxpar.Strategy(passes=[probe]))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert model.seen and not any(model.seen)          # every trace of forward ran with the collector off
    assert in_passes == [False]                        # and so did the passes
    assert "gc_probe" in [h.pass_name for h in p.history(0)]


@pytest.mark.structure
def test_gc_paused_nests_and_restores_on_error():
    from fxpar._tracing import gc_paused
    was = gc.isenabled()
    gc.enable()
    try:
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()              # the inner block found it off and left it off
        assert gc.isenabled()
        with pytest.raises(RuntimeError, match="boom"):
            with gc_paused():
                raise RuntimeError("boom")
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.structure
def test_models_alike_share_a_fingerprint_and_any_traced_difference_parts_them():
    from fxpar.capture import model_fingerprint
    torch.manual_seed(0)
    a, b = GPT(), GPT()
    with torch.no_grad():
        b.wte.weight.add_(1.0)                             # values do not enter: the trace runs on fake tensors
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a) != model_fingerprint(GPT(d=64))          # shapes
    assert model_fingerprint(a) != model_fingerprint(GPT(tie_weights=False))   # ties
    c = GPT(); c.eval()
    assert model_fingerprint(a) != model_fingerprint(c)                 # a module's mode
    d = GPT(); d.blocks[0].flag = True
    assert model_fingerprint(a) != model_fingerprint(d)                 # a plain attribute forward may read
    e, f = GPT(), GPT()
    e.scale, f.scale = torch.ones(2), torch.full((2,), 2.0)             # a tensor attribute: by its bytes
    assert model_fingerprint(e) != model_fingerprint(f)
    g = GPT().double()
    assert model_fingerprint(a) != model_fingerprint(g)                 # dtypes


@pytest.mark.structure
def test_shared_captures_across_models_copy_alike_models_trace_and_keep_warnings():
    import warnings
    import fxpar.capture as C
    spec = resolve_optimizer((torch.optim.SGD, {"lr": 0.1}))
    batch = (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    torch.manual_seed(0)
    with C.shared_captures(across_models=True) as shared:
        first = capture_training_step(GPT(), batch, gpt_loss, spec)
        again = capture_training_step(GPT(), batch, gpt_loss, spec)
        other = capture_training_step(GPT(d=64), batch, gpt_loss, spec)
        with C.unshared_captures():
            fresh = capture_training_step(GPT(), batch, gpt_loss, spec)
    assert shared.hits == 1 and again.gm is not first.gm and again.gm.code == first.gm.code
    assert other.gm.code != first.gm.code and fresh.gm.code == first.gm.code

    class Warns(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            warnings.warn("forward says so", UserWarning)
            return self.fc(x)
    mse = torch.nn.functional.mse_loss
    xy = (torch.randn(2, 4), torch.randn(2, 4))
    with C.shared_captures(across_models=True) as shared:
        m = Warns()
        for _ in range(2):                                 # a capture that warned is traced again, and warns again
            with pytest.warns(UserWarning, match="forward says so"):
                capture_training_step(m, xy, mse, spec)
    assert shared.hits == 0
