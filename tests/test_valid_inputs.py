"""Valid input that must plan and train: Hugging Face models under every tensor-parallel mode, meta-device
planning, and the refusals that stand in where fxpar cannot take a model as it is.

* BERT at tp=2 (Megatron preset, Tofu's search, layouts) trains as one process (float64, 1e-10): its
  ``LayerNorm`` parameters' placeholders are renamed by fx (``layer_norm``), and the lowering finds them.
* The Megatron preset splits HF attention by heads -- q/k/v column-parallel through the rotary embedding
  (Llama), a fused ``query_key_value`` (GPT-NeoX: its ``[heads, 3, head_dim]`` rows cut by heads), OPT's
  separate projections, Whisper's encoder, decoder and cross-attention -- and the o projection row-parallel;
  tp=2 trains as one process. Where it leaves a Linear whole (GPT-J's eager attention: bmm and a float32 cast),
  ``explain()`` names the module and the op.
* Tofu's search on Phi with dropout eliminates flat where block boundaries would build wide tables.
* A meta-device model with meta example inputs and ``cross_entropy`` plans (dp=2: the global-batch count).
* ``nn.Embedding(max_norm=...)`` and ``offload=('activations',)`` are refused by name, with what to do.

Llama's ``LlamaRMSNorm`` computes in float32 whatever the model's dtype, so a sum reordered by tensor
parallelism (1e-16) becomes a float32 rounding (1e-8); the test's Llama norms compute in the model's dtype
(the same formula) so that the comparison is exact.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.batch_semantics import batch_reductions
from fxpar.testing.hf import VOCAB, CausalLM, hf_batches, hf_example, lm_loss
from fxpar.testing.reference import max_abs_diff, reference_training

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
SGD = (torch.optim.SGD, {"lr": 0.1})
TOL = 1e-10
SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
BERT_LAYOUTS = {"model.bert.encoder.layer.*.intermediate.dense.weight": ("tp", None),
                "model.bert.encoder.layer.*.intermediate.dense.bias": ("tp",),
                "model.bert.encoder.layer.*.output.dense.weight": (None, "tp")}


@pytest.fixture(scope="module")
def tf():
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    return tf


def _rms_in_model_dtype(model: nn.Module) -> nn.Module:
    """Every ``*RMSNorm`` computes in its input's dtype (HF's casts to float32): the same formula, exact in float64."""
    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(forward, m)
    return model


def _decoder(tf, name: str, dropout: float = 0.0) -> nn.Module:
    """A tiny HF decoder from a config (no download), float64, wrapped as ``model(input_ids) -> logits``."""
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, use_cache=False, **SPECIAL)
    if name == "llama":
        return _rms_in_model_dtype(hf_example("llama", n_layers=2)[0])
    if name == "neox":
        m = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                                   max_position_embeddings=32, rotary_pct=0.5, attention_dropout=0.0,
                                                   hidden_dropout=0.0, **common))
    elif name == "opt":
        m = tf.OPTForCausalLM(tf.OPTConfig(hidden_size=32, num_attention_heads=4, ffn_dim=64,
                                           max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0,
                                           attention_dropout=0.0, **common))
    elif name == "phi":
        m = tf.PhiForCausalLM(tf.PhiConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                           max_position_embeddings=32, partial_rotary_factor=0.5, resid_pdrop=dropout,
                                           embd_pdrop=dropout, attention_dropout=dropout, **common))
    elif name == "gptj":
        m = tf.GPTJForCausalLM(tf.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=2, n_positions=32,
                                             rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                             use_cache=False, **SPECIAL))
    else:
        raise ValueError(name)
    return CausalLM(m).double()


def _tp_run(clusters, model, batches, loss_fn, sharding, opt=ADAMW):
    ref_losses, ref_state = reference_training(model, batches, loss_fn, opt)
    st = fxpar.Strategy(tp=2, sharding=sharding)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn, opt, strategy=st)
    res = prog.run_local(batches, cluster=clusters.get(2))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL, (res.losses, ref_losses)
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    return prog


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["megatron", "auto", "layouts"])
def test_bert_at_tp2_trains_as_one_process(clusters, tf, mode):
    torch.manual_seed(0)
    model, _, loss_fn = hf_example("bert", n_layers=2)
    prog = _tp_run(clusters, model, hf_batches("bert", 2, batch=4), loss_fn,
                   BERT_LAYOUTS if mode == "layouts" else mode)
    split = [k for k, v in prog.plan.section("tensor_parallel").stages[0]["params"].items() if any(v)]
    assert "model.bert.encoder.layer.0.intermediate.dense.weight" in split or mode == "auto", split


# the attention projections the preset must split: (column-parallel weights, row-parallel weight) of layer 0
ATTENTION = {
    "llama": (["model.model.layers.0.self_attn.q_proj", "model.model.layers.0.self_attn.k_proj",
               "model.model.layers.0.self_attn.v_proj"], "model.model.layers.0.self_attn.o_proj"),
    "neox": (["model.gpt_neox.layers.0.attention.query_key_value"], "model.gpt_neox.layers.0.attention.dense"),
    "opt": (["model.model.decoder.layers.0.self_attn.q_proj", "model.model.decoder.layers.0.self_attn.k_proj",
             "model.model.decoder.layers.0.self_attn.v_proj"], "model.model.decoder.layers.0.self_attn.out_proj"),
}


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("name", list(ATTENTION))
def test_megatron_splits_hf_attention_by_heads_and_trains_as_one_process(clusters, tf, name):
    torch.manual_seed(0)
    prog = _tp_run(clusters, _decoder(tf, name), hf_batches("llama", 2, batch=4), lm_loss, "megatron")
    entry = prog.plan.section("tensor_parallel").stages[0]
    cols, row = ATTENTION[name]
    for m in cols:
        assert entry["megatron"][f"{m}.weight"] == ["tp", None], (m, entry["megatron"])
    assert entry["megatron"][f"{row}.weight"] == [None, "tp"]
    text = prog.explain()
    for m in cols:
        assert f"{m}: split weight ('tp', None)" in text, text
    assert f"{row}: split weight (None, 'tp')" in text
    left = [x for x in text.splitlines() if "Megatron preset left" in x]
    assert not any(f"{m} (" in x for x in left for m in cols + [row]), left


@pytest.mark.structure
def test_megatron_names_the_linears_it_leaves_whole_and_why(tf):
    """GPT-J computes attention eagerly (a float32 cast, bmm, softmax): the preset leaves q/k/v/out whole and
    explain() says so, module by module, with the op each output met and what to do."""
    model = _decoder(tf, "gptj")
    b = hf_batches("llama", 1, batch=4)[0]
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), b, lm_loss, SGD,
                             strategy=fxpar.Strategy(tp=2, sharding="megatron"))
    whole = dict(prog.plan.section("tensor_parallel").stages[0]["megatron_whole"])
    assert "aten.bmm" in whole["model.transformer.h.0.attn.v_proj"], whole
    assert "aten._to_copy" in whole["model.transformer.h.0.attn.q_proj"], whole
    assert "model.transformer.h.0.mlp.fc_in" not in whole                  # the MLP is split
    text = prog.explain()
    assert "the Megatron preset left" in text and "model.transformer.h.0.attn.q_proj (its output meets" in text
    assert "Split them with layouts" in text


class SpeechSeq2Seq(nn.Module):
    """``model(input_features, decoder_input_ids, labels) -> loss`` for Whisper: the model computes its own
    cross-entropy."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_features, decoder_input_ids, labels):
        return self.model(input_features=input_features, decoder_input_ids=decoder_input_ids, labels=labels).loss


def _whisper(tf) -> nn.Module:
    """A tiny Whisper (one encoder and one decoder layer, 4 heads) from a config, float64: 8 mel bins, 16 frames."""
    cfg = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=1, decoder_layers=1, d_model=32,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                           max_source_positions=8, max_target_positions=16, dropout=0.0, attention_dropout=0.0,
                           activation_dropout=0.0, use_cache=False, decoder_start_token_id=1, **SPECIAL)
    return SpeechSeq2Seq(tf.WhisperForConditionalGeneration(cfg)).double()


def _whisper_batches(n: int, rows: int = 4) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, 16, generator=g, dtype=torch.float64),
             torch.randint(3, VOCAB, (rows, 6), generator=g), torch.randint(3, VOCAB, (rows, 6), generator=g))
            for _ in range(n)]


@pytest.mark.slow
@pytest.mark.numerics
def test_megatron_splits_whisper_attention_by_heads_and_trains_as_one_process(clusters, tf):
    """Encoder self-attention, decoder self-attention and cross-attention: q/k/v column-parallel (k without a
    bias), out_proj row-parallel; tp=2 equals one process for 2 AdamW steps. Its forward holds no batch-wide
    statistic (the convolutions and attention act within each row)."""
    torch.manual_seed(0)
    prog = _tp_run(clusters, _whisper(tf), _whisper_batches(2), None, "megatron")
    entry = prog.plan.section("tensor_parallel").stages[0]
    text = prog.explain()
    attentions = ["model.model.encoder.layers.0.self_attn", "model.model.decoder.layers.0.self_attn",
                  "model.model.decoder.layers.0.encoder_attn"]
    for att in attentions:
        for m in ("q_proj", "k_proj", "v_proj"):
            assert entry["megatron"][f"{att}.{m}.weight"] == ["tp", None], (att, m, entry["megatron"])
            assert f"{att}.{m}: split weight ('tp', None)" in text
        assert entry["megatron"][f"{att}.out_proj.weight"] == [None, "tp"]
    assert not entry.get("megatron_whole"), entry.get("megatron_whole")
    assert "Megatron preset left" not in text
    assert not batch_reductions(prog.stages[0].captured.gm, prog.stages[0].captured.signature)


@pytest.mark.slow
@pytest.mark.structure
def test_tofu_on_phi_with_dropout_eliminates_flat_where_blocks_would_be_wide(tf, monkeypatch):
    """Phi's parallel attention + MLP with dropout masks saved for backward: eliminating block by block keeps
    every block's boundary and builds a 5e8-entry table; the flat order's largest is 1e7. The search takes the
    flat one, and its optimum is the block-by-block one's (both exact)."""
    import passes.tofu
    import fxpar.features.tensor_parallel as tp_feature
    grabbed = {}
    search = passes.tofu.tofu_search

    def grab(gm, *a, **kw):
        grabbed["found"] = search(gm, *a, **kw)
        grabbed["call"] = (gm, a, kw)
        return grabbed["found"]
    monkeypatch.setattr(tp_feature.tofu, "tofu_search", grab)
    model = _decoder(tf, "phi", dropout=0.1)
    fxpar.parallelize(model, fxpar.ClusterSpec.local(2), hf_batches("llama", 1, batch=4)[0], lm_loss, SGD,
                      strategy=fxpar.Strategy(tp=2, sharding="auto"))
    found = grabbed["found"]
    assert found.blocks[0].get("flat") and found.max_table <= 2 ** 24, (found.blocks, found.max_table)
    assert "one flat elimination" in found.explain(limit=0)
    gm, a, kw = grabbed["call"]
    flat = search(gm, *a, **{**kw, "blocks": "flat"})
    assert found.predicted == flat.predicted


@pytest.mark.structure
@pytest.mark.parametrize("strategy", [dict(dp=2), dict(dp=2, microbatches=2), dict()])
def test_a_meta_model_with_meta_inputs_and_cross_entropy_plans(strategy):
    """No values to count or check: the global-batch count column is planned by shape; the plan is the one the
    same model on the CPU gets."""
    def build(device):
        torch.manual_seed(0)
        with torch.device(device):
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    st = fxpar.Strategy(**strategy)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    on_meta = fxpar.parallelize(build("meta"), fxpar.ClusterSpec.local(st.size), (x.to("meta"), y.to("meta")),
                                F.cross_entropy, SGD, strategy=st)
    on_cpu = fxpar.parallelize(build("cpu"), fxpar.ClusterSpec.local(st.size), (x, y), F.cross_entropy, SGD,
                               strategy=st)
    assert [(c.kind, c.nbytes) for c in on_meta.collectives(0)] == [(c.kind, c.nbytes) for c in on_cpu.collectives(0)]
    ops = [{k: [str(n.target) for n in g.graph.nodes] for k, g in p.graphs(0).items()} for p in (on_meta, on_cpu)]
    assert ops[0] == ops[1]                          # the same graph, its constants made on the meta device


class MaxNormEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(16, 8, max_norm=1.0)
        self.fc = nn.Linear(8, 4)

    def forward(self, idx):
        return self.fc(self.tok(idx).mean(1))


@pytest.mark.structure
def test_an_embedding_with_max_norm_is_refused_by_module_and_option():
    idx, y = torch.randint(0, 16, (4, 5)), torch.randint(0, 4, (4,))
    with pytest.raises(fxpar.errors.CaptureError, match=r"module 'tok' \(nn.Embedding\) has max_norm=1.0.*"
                                                       r"write to a parameter during forward.*without max_norm"):
        fxpar.parallelize(MaxNormEmbedding(), fxpar.ClusterSpec.local(1), (idx, y), F.cross_entropy, SGD)


@pytest.mark.structure
def test_offload_activations_points_to_its_own_option():
    with pytest.raises(fxpar.StrategyError, match=r"offload=\('activations',\).*offload_activations=True\)"):
        fxpar.Strategy(dp=2, zero=3, offload=("activations",))
    with pytest.raises(fxpar.StrategyError, match=r"offload_activations=True, offload=\('optimizer',\)\)"):
        fxpar.Strategy(dp=2, zero=3, offload=("activations", "optimizer"))


class _LSTMHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


@pytest.mark.numerics
def test_an_lstm_whose_two_biases_share_one_gradient_trains_at_dp2(clusters):
    """In float32 torch's LSTM backward returns one tensor as both ``bias_ih`` and ``bias_hh``'s gradient: each
    parameter gets its own gradient node, both are synchronised, and dp=2 trains as one process (float32 sums
    reordered: 1e-6)."""
    torch.manual_seed(0)
    model = _LSTMHead()
    batches = [(torch.randn(8, 5, 4), torch.randint(0, 3, (8,))) for _ in range(2)]
    prog = fxpar.parallelize(model, 2, batches[0], F.cross_entropy, SGD, strategy=fxpar.Strategy(dp=2))
    buckets = [k for b in prog.plan.section("data_parallel").buckets[0] for k in b]
    assert {"rnn.bias_ih_l0", "rnn.bias_hh_l0"} <= set(buckets)
    res = prog.run_local(batches, cluster=clusters.get(2))
    ref_losses, ref_state = reference_training(model, batches, F.cross_entropy, SGD)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-6
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-6
