"""Small models that exercise what real models do: tied weights, causal attention, a position
table sliced by sequence length, LayerNorm, residual streams, BatchNorm buffers, skip connections."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MLP", "CNN", "BNConvNet", "GPT", "Block", "MegatronBlock", "EncoderModel", "SkipMLP", "Bag", "gpt_loss",
           "tiny_gpt"]


class MLP(nn.Module):
    def __init__(self, d_in=16, hidden=32, d_out=8, layers=2):
        super().__init__()
        dims = [d_in] + [hidden] * layers
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


class CNN(nn.Module):
    """Conv → ReLU → pool → conv → linear; no batch statistics, so dp equals single-process exactly."""

    def __init__(self, channels=4, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc = nn.Linear(2 * channels * 4 * 4, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


class BNConvNet(nn.Module):
    def __init__(self, channels=4, classes=10):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels * 8 * 8, classes)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


class Block(nn.Module):
    """Pre-LN attention (fused qkv) + MLP. ``dropout > 0``: dropout on the attention's output before its projection
    and on the MLP's hidden activation (split over tp by Megatron's split), and on the MLP's output (whole)."""

    def __init__(self, d, heads, qkv_bias=True, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=qkv_bias), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(self.drop(y))
        return x + self.drop(self.fc2(self.drop(F.gelu(self.fc(self.ln2(x))))))


class MegatronBlock(nn.Module):
    """Pre-LN attention with separate q, k, v, o projections + MLP: the block Megatron-LM splits (column-parallel
    q, k, v, fc1; row-parallel o, fc2). ``in_proj=True`` puts a Linear before it, so the block's input needs a
    gradient."""

    def __init__(self, d=16, heads=4, in_proj=False):
        super().__init__()
        self.heads = heads
        self.inp = nn.Linear(d, d) if in_proj else nn.Identity()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = self.inp(x)
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, self.heads, c // self.heads).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.o(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2-style decoder: token + learned position table (sliced by sequence length), pre-LN
    blocks with causal SDPA, final LayerNorm, LM head tied to the token embedding (unless
    ``tie_weights=False``); ``dropout > 0`` adds GPT-2's embedding dropout, ``block_dropout > 0`` the blocks'
    (:class:`Block`)."""

    def __init__(self, vocab=64, d=32, layers=2, heads=4, max_seq=32, qkv_bias=True, tie_weights=True, dropout=0.0,
                 block_dropout=0.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_seq, d)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.blocks = nn.ModuleList(Block(d, heads, qkv_bias, block_dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie_weights:
            self.head.weight = self.wte.weight
        for emb in (self.wte, self.wpe):          # GPT-2's initialisation (N(0, 1) makes the tied head's logits huge)
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe.weight[:T])
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def tiny_gpt(layers: int = 2, heads: int = 2, dropout: float = 0.0, vocab: int = 32, d: int = 16,
             seed: int | None = 0, block_dropout: float = 0.0) -> GPT:
    """The float64 :class:`GPT` most tests train (vocab 32, width 16, 2 heads). ``seed``: torch's global generator
    is seeded with it first, so every call builds the same weights; ``None`` draws them from the generator as it
    stands."""
    if seed is not None:
        torch.manual_seed(seed)
    return GPT(vocab=vocab, d=d, layers=layers, heads=heads, dropout=dropout, block_dropout=block_dropout).double()


def gpt_loss(logits, targets):
    """Cross-entropy over every position (mean)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class EncoderModel(nn.Module):
    """nn.TransformerEncoderLayer (which torch.fx.symbolic_trace cannot trace) + a linear head."""

    def __init__(self, d=32, heads=4, classes=5):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.enc(x).mean(1))


class SkipMLP(nn.Module):
    """A residual that skips several layers: the input of layer 0 is added after layer 3."""

    def __init__(self, d=16, layers=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h + x)


class Bag(nn.Module):
    """A large embedding (the sparse candidate for Parallax), a small position table, and a dense head over the
    mean of the rows."""

    def __init__(self, vocab=1000, small=6, d=16, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(small, d)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        return self.head((self.emb(ids) + self.pos(pos)).mean(1))
