"""Tiny Hugging Face ``transformers`` models built from configs (no download), for tests and examples.

HF models take keyword arguments (``input_ids=``, ``attention_mask=``, ``labels=``) and return a
``ModelOutput``; the wrappers here take positional tensors and return a tensor (the logits, or
the model's own loss), so that ``example_inputs`` is a plain tuple::

    model, batch, loss_fn = hf_example("llama", n_layers=4)
    loss = loss_fn(model(*batch[:-1]), batch[-1])        # loss_fn is None for T5: model(*batch) is the loss
    batches = hf_batches("llama", n=3, batch=4)            # a short run of fresh batches of the same kind

Dropout is off in every config, so a captured step can be compared with eager training exactly.
``transformers`` is imported only when a model is built.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["CausalLM", "MaskedLM", "Seq2SeqLM", "lm_loss", "masked_lm_loss", "tiny_gpt2", "tiny_llama",
           "tiny_bert", "tiny_t5", "hf_example", "hf_batch", "hf_batches",
           "HF_MODELS", "VOCAB"]

VOCAB = 64
_SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


class CausalLM(nn.Module):
    """``model(input_ids) -> logits`` for a ``*ForCausalLM`` (GPT-2, Llama, Mistral …)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


class MaskedLM(nn.Module):
    """``model(input_ids, attention_mask) -> logits`` for a ``*ForMaskedLM`` (BERT …)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class Seq2SeqLM(nn.Module):
    """``model(input_ids, attention_mask, labels) -> loss`` for a ``*ForConditionalGeneration`` (T5 …):
    the model shifts ``labels`` right into its decoder inputs and computes its own cross-entropy."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def lm_loss(logits, targets):
    """Cross-entropy over every position (mean)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def masked_lm_loss(logits, labels):
    """Cross-entropy over the masked positions only (labels -100 elsewhere), as BERT's own loss."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def tiny_gpt2(n_layers: int = 2) -> CausalLM:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=n_layers, n_head=2, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_SPECIAL)
    return CausalLM(GPT2LMHeadModel(cfg))


def tiny_llama(n_layers: int = 2) -> CausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
                      attention_dropout=0.0, **_SPECIAL)
    return CausalLM(LlamaForCausalLM(cfg))


def tiny_bert(n_layers: int = 2) -> MaskedLM:
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=n_layers, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, use_cache=False, pad_token_id=0)
    return MaskedLM(BertForMaskedLM(cfg))


def tiny_t5(n_layers: int = 2) -> Seq2SeqLM:
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=n_layers, num_decoder_layers=n_layers,
                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return Seq2SeqLM(T5ForConditionalGeneration(cfg))


def hf_example(name: str, n_layers: int = 2, batch: int = 2, seq: int = 8, dtype=torch.float64,
               generator: torch.Generator | None = None):
    """``(model, example_batch, loss_fn)`` for ``name`` in :data:`HF_MODELS`; ``loss_fn`` is None when the
    model returns its loss. The batch has padding (``attention_mask`` zeros) where the model takes a mask."""
    g = generator or torch.Generator().manual_seed(0)
    builders = {"gpt2": tiny_gpt2, "llama": tiny_llama, "bert": tiny_bert, "t5": tiny_t5}
    if name not in builders:
        raise ValueError(f"unknown Hugging Face example {name!r}; choose from {HF_MODELS}")
    example = hf_batch(name, batch, seq, g)
    loss_fn = {"gpt2": lm_loss, "llama": lm_loss, "bert": masked_lm_loss, "t5": None}[name]
    return builders[name](n_layers).to(dtype), example, loss_fn


def hf_batch(name: str, batch: int = 2, seq: int = 8, generator: torch.Generator | None = None) -> tuple:
    """One batch for the :func:`hf_example` model ``name``, in the order its wrapper takes it:
    ``(input_ids, targets)`` (GPT-2, Llama), ``(input_ids, attention_mask, labels)`` (BERT: labels on
    every third position, -100 elsewhere; T5: decoder labels of length ``seq // 2``).

    Where the model takes a mask, the first row is padded (mask 0 on its last two positions). Every row
    counts the same number of label positions (BERT: every third; the others: all), so a shard or
    microbatch of whole rows weighs as much in the mean loss as any other: the mean of per-shard means
    is the global-batch mean, and dp or microbatching reproduces single-process training exactly."""
    if name not in HF_MODELS:
        raise ValueError(f"unknown Hugging Face example {name!r}; choose from {HF_MODELS}")
    g = generator or torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    if name in ("gpt2", "llama"):
        return ids, torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - 2:] = 0                                   # the first sequence is padded
    if name == "bert":
        labels = torch.full((batch, seq), -100)
        labels[:, 1::3] = ids[:, 1::3]                      # predict every third token
        return ids, mask, labels
    return ids, mask, torch.randint(3, VOCAB, (batch, seq // 2), generator=g)


def hf_batches(name: str, n: int, batch: int = 4, seq: int = 8, seed: int = 1) -> list:
    """``n`` batches of :func:`hf_batch` drawn from one seeded generator (a short training run)."""
    g = torch.Generator().manual_seed(seed)
    return [hf_batch(name, batch, seq, g) for _ in range(n)]


HF_MODELS = ("gpt2", "llama", "bert", "t5")
