"""Keyword inputs: ``example_inputs`` as a dict (Hugging Face style ``input_ids=``,
``attention_mask=``, ``labels=``), or positional tensors plus a dict; batch dim 0 in every tensor. The model
is called with the keyword arguments, ``run_local`` batches take the same structure, and training matches
single-process training under dp, pp and dp x pp."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.testing.reference import max_abs_diff

TOL = 1e-10
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
V = 16


class KwModel(nn.Module):
    """HF-like: ``model(input_ids=, attention_mask=, labels=)`` returns a dict with ``logits`` (and ``loss``)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, V)

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = self.emb(input_ids)
        if attention_mask is not None:
            x = x * attention_mask.unsqueeze(-1)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        out = {"logits": self.head(x)}
        if labels is not None:
            out["loss"] = F.cross_entropy(out["logits"].flatten(0, 1), labels.flatten())
        return out


def _model():
    torch.manual_seed(0)
    return KwModel().double()


def _hf_batches(n=3, rows=8, seq=6):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (rows, seq), generator=g)
        mask = (torch.rand(rows, seq, generator=g) > 0.2).double()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.roll(-1, 1)})
    return out


def _reference(model, batches, loss_of):
    m = copy.deepcopy(model)
    opt = ADAMW[0](m.parameters(), **ADAMW[1])
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = loss_of(m, b)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, m.state_dict()


def _run(clusters, model, batches, loss_fn, **strategy):
    st = fxpar.Strategy(**strategy)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(st.size), batches[0], loss_fn, ADAMW, strategy=st)
    return prog, prog.run_local(batches, cluster=clusters.get(st.size) if st.size > 1 else None)


def _close(res, ref):
    assert max(abs(a - b) for a, b in zip(res.losses, ref[0])) < TOL, (res.losses, ref[0])
    assert max_abs_diff(res.state_dict(), ref[1]) < TOL


STRATEGIES = {"dp2": dict(dp=2), "pp2": dict(pp=2, microbatches=2), "dp2_pp2": dict(dp=2, pp=2, microbatches=2)}


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", list(STRATEGIES.values()), ids=list(STRATEGIES))
def test_a_dict_batch_with_labels_and_the_models_own_loss(clusters, strategy):
    model, batches = _model(), _hf_batches()
    ref = _reference(model, batches, lambda m, b: m(**b)["loss"])
    prog, res = _run(clusters, model, batches, None, **strategy)
    _close(res, ref)
    assert prog.layout.kwargs == ("input_ids", "attention_mask", "labels")


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [dict(dp=2), dict(pp=2, microbatches=2)], ids=["dp2", "pp2"])
def test_positional_target_plus_keyword_inputs_with_a_loss_fn(clusters, strategy):
    def loss_fn(out, y):
        return F.cross_entropy(out["logits"].flatten(0, 1), y.flatten())

    model = _model()
    batches = [((b["labels"],), {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]})
               for b in _hf_batches()]
    ref = _reference(model, batches, lambda m, b: loss_fn(m(**b[1]), b[0][0]))
    _, res = _run(clusters, model, batches, loss_fn, **strategy)
    _close(res, ref)


@pytest.mark.numerics
def test_positional_inputs_then_a_trailing_dict(clusters):
    """``(input_ids, target, {"attention_mask": ...})``: positional inputs, the target last, keywords after."""
    def loss_fn(out, y):
        return F.cross_entropy(out["logits"].flatten(0, 1), y.flatten())

    model = _model()
    batches = [(b["input_ids"], b["labels"], {"attention_mask": b["attention_mask"]}) for b in _hf_batches()]
    ref = _reference(model, batches, lambda m, b: loss_fn(m(b[0], **b[2]), b[1]))
    prog, res = _run(clusters, model, batches, loss_fn, dp=2)
    _close(res, ref)
    # flat order: positional inputs, keyword inputs, targets; each named as the user indexes it
    assert prog.layout.describe(1, "batches[0]") == "batches[0][2]['attention_mask']"
    assert prog.layout.describe(2, "batches[0]") == "batches[0][1] (the target)"


@pytest.mark.numerics
def test_keys_in_another_order_are_the_same_batch(clusters):
    model, batches = _model(), _hf_batches(2)
    shuffled = [{k: b[k] for k in ("labels", "attention_mask", "input_ids")} for b in batches]
    ref = _reference(model, batches, lambda m, b: m(**b)["loss"])
    prog = fxpar.parallelize(model, 2, batches[0], None, ADAMW, strategy=fxpar.Strategy(dp=2))
    _close(prog.run_local(shuffled, cluster=clusters.get(2)), ref)


@pytest.mark.structure
def test_keyword_names_are_checked_against_forward():
    model, batches = _model(), _hf_batches(1)
    bad = {"input_id": batches[0]["input_ids"], "labels": batches[0]["labels"]}
    with pytest.raises(fxpar.errors.InputError, match=r"example_inputs\['input_id'\]: KwModel.forward has no "
                                                      r"argument 'input_id'.*did you mean 'input_ids'"):
        fxpar.parallelize(model, 1, bad, None, ADAMW)


@pytest.mark.slow
@pytest.mark.numerics
def test_hugging_face_gpt2_with_a_dict_batch(clusters):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    model = GPT2LMHeadModel(cfg).double()
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 64, (4, 8), generator=g)
        batches.append({"input_ids": ids, "attention_mask": torch.ones(4, 8, dtype=torch.long), "labels": ids})
    ref = _reference(model, batches, lambda m, b: m(**b).loss)     # ModelOutput with .loss (float32 loss)
    for strategy in (dict(dp=2), dict(pp=2, microbatches=2)):
        _, res = _run(clusters, model, batches, None, **strategy)
        assert max(abs(a - b) for a, b in zip(res.losses, ref[0])) < 1e-6     # HF upcasts the loss to float32
        assert max_abs_diff(res.state_dict(), ref[1]) < 1e-10
