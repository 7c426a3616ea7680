"""Small models for the pipeline tests (and structure tests of stage cutting that need no ranks)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
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
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
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


def gpt_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_batches(n: int, batch: int = 8, seq: int = 8, vocab: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out


def skip_batches(n: int, batch: int = 8, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(n)]


def reference_train(model: nn.Module, loss_fn, batches, optimizer) -> tuple:
    """Single-process training: the losses and final state every pipeline run must reproduce."""
    cls, kw = optimizer
    opt = cls(model.parameters(), **kw)
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = loss_fn(model(*b[:-1]), b[-1])
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
