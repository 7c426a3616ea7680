"""Seeded batch makers for the small models of :mod:`fxpar.testing.models`: each draws from a generator of its own,
so a call returns the same batches every time and leaves torch's global generator alone."""
from __future__ import annotations

import torch

__all__ = ["token_batches", "token_pairs", "regression_batches", "class_batches", "bag_batches"]


def token_batches(n: int, batch: int = 8, seq: int = 8, vocab: int = 32, seed: int = 1,
                  own_storage: bool = False) -> list:
    """``n`` (inputs, next-token targets) batches of shape ``(batch, seq)`` for :class:`GPT`: one draw of
    ``seq + 1`` tokens per row, shifted by one. The two are views of one tensor unless ``own_storage`` (then each
    is a contiguous copy: a pipeline sends them, a memory measurement counts each)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        x, y = idx[:, :-1], idx[:, 1:]
        if own_storage:
            x, y = x.clone(memory_format=torch.contiguous_format), y.clone(memory_format=torch.contiguous_format)
        out.append((x, y))
    return out


def token_pairs(n: int, batch: int = 8, seq: int = 8, vocab: int = 32, seed: int = 3) -> list:
    """``n`` (inputs, targets) batches of shape ``(batch, seq)`` for :class:`GPT`, the targets drawn apart from the
    inputs (after them, batch by batch)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(n)]


def regression_batches(n: int, batch: int = 8, d_in: int = 16, d_out: int = 8, seed: int = 2,
                       dtype: torch.dtype = torch.float64) -> list:
    """``n`` (inputs ``(batch, d_in)``, targets ``(batch, d_out)``) normal batches for :class:`MLP` and MSE."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g, dtype=dtype), torch.randn(batch, d_out, generator=g, dtype=dtype))
            for _ in range(n)]


def class_batches(n: int, batch: int = 8, d: int = 16, classes: int = 4, seed: int = 0,
                  dtype: torch.dtype = torch.float64) -> list:
    """``n`` (inputs ``(batch, d)``, class labels ``(batch,)`` in ``[0, classes)``) batches for cross-entropy."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d, generator=g, dtype=dtype), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(n)]


def bag_batches(n: int, batch: int = 8, seq: int = 5, vocab: int = 1000, classes: int = 4, seed: int = 3) -> list:
    """``n`` (token ids ``(batch, seq)``, class labels ``(batch,)``) batches for :class:`Bag`."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(n)]
