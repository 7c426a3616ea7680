"""Small models the pipeline tests cut into stages: a GPT whose tied head joins the first and last stage, and an MLP
whose skip connection crosses every cut."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .batches import token_batches

__all__ = ["TinyGPT", "SkipNet", "flat_gpt_loss", "tiny_gpt_batches"]


class _Block(nn.Module):
    """Pre-LN causal attention and a 2x-wide MLP."""

    def __init__(self, d: int, heads: int = 2):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT with the LM head tied to the token embedding (one parameter used by the first and last stage)."""

    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 4, seq: int = 8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class SkipNet(nn.Module):
    """An MLP whose first hidden state is added back three layers later (crosses every stage cut)."""

    def __init__(self, d: int = 16, layers: int = 4):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(layers)])
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.layers(h) + h)


def flat_gpt_loss(logits, targets):
    """Cross-entropy over every position, flattened with ``flatten`` (its trace views by the batch's own sizes,
    where :func:`fxpar.testing.gpt_loss` views by -1: a microbatched step must rewrite them)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_gpt_batches(n: int, batch: int = 8, seq: int = 8, vocab: int = 32, seed: int = 0) -> list:
    """:func:`fxpar.testing.token_batches` for :class:`TinyGPT`: seed 0, inputs and targets contiguous copies."""
    return token_batches(n, batch=batch, seq=seq, vocab=vocab, seed=seed, own_storage=True)
