"""Depth probes: a one-stage finalist's full estimate from two small builds instead of one big one.

A program without a pipeline runs every repeated block's ops, collectives and update alike, so its full estimate
(``program.estimate()``: step time, peak memory, bytes sent) is affine in the number of blocks. A probe builds the
finalist on the model cut to its first ``k`` blocks for two depths, k = 1 and 2 (``parallelize`` as it is, the
model's own modules, nothing copied but the containers along the blocks' path), and composes the rest:

    E(L) = E(1) + (L - 1) * (E(2) - E(1))

GPT-2 small at 8 A100s (dp=8 ZeRO-3 and dp=4 x tp=2 under either tp mode, bf16): E(12) from E(1), E(2) equals the
estimate of the 12-block program to 1e-9 (``tests/test_auto_planner.py``). A pipeline is not probed: its stage cuts
balance the blocks against the embedding and the head, so its estimate is not affine in the depth.

    m2 = truncated(model, "blocks", 2)     # the same model with blocks[:2]; parameters shared, not copied
"""
from __future__ import annotations

import copy

import torch

__all__ = ["truncated", "probe_depths", "extrapolate", "PROBE_MIN_BLOCKS"]

PROBE_DEPTHS = (1, 2)
# a probe builds 1 + 2 blocks and the rest of the model twice: worth it from 6 blocks up
PROBE_MIN_BLOCKS = 6


def truncated(model: torch.nn.Module, path: str, k: int) -> torch.nn.Module:
    """``model`` with the ModuleList / Sequential at ``path`` holding its first ``k`` children. Every module on the
    path is a shallow copy with its own child table; the blocks, parameters and buffers are the model's own."""
    root = copy.copy(model)
    root._modules = dict(model._modules)
    parent, names = root, path.split(".") if path else []
    for name in names[:-1]:
        child = copy.copy(parent._modules[name])
        child._modules = dict(child._modules)
        parent._modules[name] = child
        parent = child
    blocks = parent._modules[names[-1]]
    kept = list(blocks._modules.items())[:k]
    cut = copy.copy(blocks)
    cut._modules = dict(kept)
    parent._modules[names[-1]] = cut
    return root


def probe_depths(c, n_blocks: int | None) -> tuple | None:
    """The two depths a finalist is probed at, or None where it is built in full (a pipeline; a model with fewer
    than ``PROBE_MIN_BLOCKS`` repeated blocks, or none; ByteScheduler and Herring, whose own planning -- pieces,
    credit, cross-iteration, bucket size -- is tuned on the captured step, so a cut model's choice is not the whole
    one's; recompute="auto", whose budget is the whole model's)."""
    if c.pp > 1 or not n_blocks or n_blocks < PROBE_MIN_BLOCKS:
        return None
    if getattr(c, "comm_schedule", "fifo") != "fifo" or c.grad_sync == "herring" or c.recompute == "auto":
        return None
    return PROBE_DEPTHS


def extrapolate(a: dict, b: dict, ka: int, kb: int, n: int) -> dict:
    """The figures ``a`` (at ``ka`` blocks) and ``b`` (at ``kb``) composed to ``n`` blocks, each affine in the
    block count."""
    return {k: a[k] + (n - ka) * (b[k] - a[k]) / (kb - ka) for k in a}
