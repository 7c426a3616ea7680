"""Hugging Face models (built from tiny configs, no download) capture and train like eager PyTorch.

transformers 5.x asks ``is_tracing(tensor)`` before value-dependent mask shortcuts; under fxpar's
``make_fx(functionalize(...))`` capture it would answer False and the capture would fail with a
data-dependent guard error. ``fxpar._tracing.capture_context`` makes it answer True while tracing.
Also here: what a user can do when the value-dependent check is in library code (nn.Transformer).
"""
import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar._tracing import capture_context
from fxpar.capture import capture_training_step
from fxpar.optim import resolve_optimizer
from fxpar.testing.hf import HF_MODELS, hf_example

# capture is what these tests test: each build traces (tests/conftest.py)
SHARED_CAPTURES = False

pytestmark = pytest.mark.structure

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})


@pytest.fixture
def transformers():
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    return tf


def _run_captured(cap, model, batch, lr):
    """One call of the captured step graph, its placeholders filled by role (fresh optimizer state, step 1)."""
    params = dict(model.named_parameters())
    state = {**params, **dict(model.named_buffers())}
    n_in = len(cap.signature.keys("input"))
    by_role = {"param": lambda k: params[k].detach(), "buffer": lambda k: state[k].detach(),
               "opt_state": lambda k: torch.zeros_like(params[k.split(":", 1)[1]]),
               "lr": lambda k: torch.tensor(lr, dtype=torch.float64),
               "step": lambda k: torch.tensor(1.0, dtype=torch.float64),
               "input": lambda k: batch[int(k)], "target": lambda k: batch[n_in + int(k)]}
    outs = cap.gm(*[by_role[r](k) for r, k in cap.signature.inputs])
    return {(r, k): v for (r, k), v in zip(cap.signature.outputs, outs)}


@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_model_captures_and_one_step_equals_eager(transformers, name):
    torch.manual_seed(0)
    model, batch, loss_fn = hf_example(name)
    cap = capture_training_step(model, batch, loss_fn, resolve_optimizer(ADAMW))
    assert cap.optimizer.traced
    got = _run_captured(cap, model, batch, ADAMW[1]["lr"])

    opt = ADAMW[0](model.parameters(), **ADAMW[1])
    loss = loss_fn(model(*batch[:-1]), batch[-1]) if loss_fn is not None else model(*batch)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.step()
    assert abs(got[("loss", "loss")].item() - loss.item()) <= 1e-10
    assert sorted(cap.param_names) == sorted(grads)           # tied weights (wte / lm_head, T5's shared) once
    for k, p in model.named_parameters():
        assert (got[("grad", k)] - grads[k]).abs().max().item() <= 1e-10, k
        assert (got[("new_param", k)] - p.detach()).abs().max().item() <= 1e-10, k


def test_capture_context_answers_is_tracing_and_restores_every_binding(transformers):
    import transformers.masking_utils as masking_utils
    import transformers.utils.import_utils as import_utils
    orig = import_utils.is_tracing
    x = torch.ones(2)
    assert masking_utils.is_tracing(x) is False
    lazy = types.ModuleType("transformers.fxpar_test_lazy")      # loaded before, resolves the name while tracing
    sys.modules[lazy.__name__] = lazy
    with capture_context():
        assert masking_utils.is_tracing(x) is True and import_utils.is_tracing() is True
        assert transformers.utils.is_tracing is not orig
        with capture_context():                                  # nests
            assert masking_utils.is_tracing(x) is True
        assert masking_utils.is_tracing(x) is True
        late = types.ModuleType("transformers.fxpar_test_late")   # a module first imported while tracing
        late.is_tracing = import_utils.is_tracing
        sys.modules[late.__name__] = late
        lazy.is_tracing = import_utils.is_tracing
    try:
        assert masking_utils.is_tracing is orig and import_utils.is_tracing is orig
        assert transformers.utils.is_tracing is orig and late.is_tracing is orig and lazy.is_tracing is orig
    finally:
        del sys.modules[late.__name__], sys.modules[lazy.__name__]


class _Seq2Seq(nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.t = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                dim_feedforward=32, dropout=0.0, batch_first=True)
        self.is_causal = is_causal

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=tgt.dtype)
        return self.t(src, tgt, tgt_mask=mask, tgt_is_causal=self.is_causal)


def _seq2seq_batch():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, t, 16, generator=g, dtype=torch.float64) for t in (5, 4, 4))


def test_nn_transformer_tgt_mask_error_says_which_argument_to_pass():
    """nn.Transformer compares tgt_mask with a causal mask by value (_detect_is_causal_mask): the error
    names the module, the library line and the argument that skips the comparison."""
    with pytest.raises(fxpar.CaptureError) as info:
        capture_training_step(_Seq2Seq(None).double(), _seq2seq_batch(), F.mse_loss, resolve_optimizer(None))
    msg = str(info.value)
    assert "module 't.decoder'" in msg and "torch/nn/modules/transformer.py" in msg
    assert "_detect_is_causal_mask" in msg and "tgt_is_causal=True" in msg
    assert "test_hf_capture.py" in msg                           # the user's line that reached it
    assert "Rewrite it with torch.where" not in msg              # advice for library code, not the user's


def test_nn_transformer_with_tgt_is_causal_captures_and_matches_eager():
    model = _Seq2Seq(True).double()
    batch = _seq2seq_batch()
    cap = capture_training_step(model, batch, F.mse_loss, resolve_optimizer((torch.optim.SGD, {"lr": 0.1})))
    got = _run_captured(cap, model, batch, 0.1)
    loss = F.mse_loss(model(*batch[:-1]), batch[-1])
    loss.backward()
    assert abs(got[("loss", "loss")].item() - loss.item()) <= 1e-10
    assert max((got[("grad", k)] - p.grad).abs().max().item() for k, p in model.named_parameters()) <= 1e-10


def test_user_data_dependent_branch_still_says_rewrite_and_names_the_line():
    class Gate(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    model = nn.Sequential(nn.Linear(4, 4), Gate())
    with pytest.raises(fxpar.CaptureError, match=r"module '1' has control flow.*test_hf_capture.py:\d+: "
                                                  r"`return x \* 2 if x.sum\(\) > 0 else x`.*torch.where"):
        capture_training_step(model, (torch.randn(2, 4), torch.randn(2, 4)), F.mse_loss, resolve_optimizer(None))
