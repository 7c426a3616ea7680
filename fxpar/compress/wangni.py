"""Wangni sparsification: keep each value with a probability that grows with its size, rescaled so the sum is
unbiased.

Wangni, Wang, Liu & Zhang, "Gradient Sparsification for Communication-Efficient Distributed Optimization",
NeurIPS 2018. For a bucket ``g`` of ``d`` values and a density ``rho`` (``ratio``), the probabilities are
``p_i = min(1, lambda |g_i|)`` with ``sum_i p_i = rho d`` (the paper's eq. 6 / Algorithm 2); Algorithm 3 (the
greedy algorithm) finds them without solving for ``lambda``: start from ``p_i = min(1, rho d |g_i| / ||g||_1)``,
then ``iters`` times rescale the unsaturated ones by ``c = (rho d - d + |I|) / sum_{i in I} p_i`` (``I``: those
with ``p_i < 1``), clipping at 1. Every step keeps ``sum_i p_i <= rho d``.

Value ``i`` is kept with probability ``p_i`` and sent as ``g_i / p_i``: ``E[Q(g)] = g`` and
``E||Q(g) - g||^2 = sum_i g_i^2 (1 / p_i - 1)`` (the paper's eq. 4), whatever the joint law of the keep decisions.

**Which values are kept**: systematic sampling (Madow & Madow, "On the theory of systematic sampling, I", Ann.
Math. Statist. 15(1), 1944) with one uniform ``u`` per bucket and step: with ``C_i = p_1 + ... + p_i``, value ``i``
is kept when ``floor(C_i + u) > floor(C_(i-1) + u)``, which happens with probability exactly ``p_i``. Unlike
independent draws, the number kept is ``floor(C_d + u) <= ceil(rho d)`` on every draw, so the (index, value)
pairs fit a buffer of ``K = ceil(rho d)`` slots without ever dropping one (the cumulative sums are capped at
``K``, which only binds on rounding error): the kept value ``i`` goes to slot ``floor(C_i + u) - 1``. Unused slots
send index 0 and value 0, which add nothing.

**What travels**: per rank ``K`` values (the bucket's dtype) and ``K`` int32 indices, one uint8 buffer, one
``all_gather``; each rank adds every rank's pairs into a zero bucket in rank order (``index_add``), so every rank
holds the same sum. ``u`` is :meth:`host_inputs`, drawn from this rank's own generator
(:func:`fxpar.compress.quantize.rank_generator`: the ranks draw independently).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from fxpar.compress.describe import tensor_lines
from fxpar.compress.feature import register_method
from fxpar.compress.method import BucketInfo, Comm, Method
from fxpar.compress.quantize import rank_generator
from fxpar.errors import StrategyError

__all__ = ["Wangni", "wangni_probabilities", "capacity", "sparsify", "densify"]


def capacity(numel: int, ratio: float) -> int:
    """Slots per rank: ``ceil(ratio * numel)`` (at least 1)."""
    return max(1, math.ceil(ratio * numel))


def wangni_probabilities(g: torch.Tensor, ratio: float, iters: int) -> torch.Tensor:
    """Algorithm 3 of Wangni et al. (2018): ``p_i = min(1, lambda |g_i|)`` with ``sum p <= ratio * d``.

    No select over a per-value mask where arithmetic gives the same bits: a rescaling round multiplies every value
    by ``c >= 1`` and clips at 1, which leaves the saturated ones (exactly 1, or NaN) as they are. The unsaturated
    mass keeps its select (a NaN must add 0, which a product by the mask does not give), over a mask that few
    values cross; their count is ``count_nonzero`` (a bool ``sum`` widens each to int64 first: 3x its time on
    CPU)."""
    a = g.abs()
    target = ratio * g.shape[0]
    l1 = a.sum()
    ok = l1 > 0                     # false where every value is 0 or one is NaN: then every p_i is 0
    p = torch.where(ok, torch.clamp(target * a / torch.where(ok, l1, torch.ones_like(l1)), max=1.0), 0.0)
    for _ in range(iters):
        active = p < 1
        mass = torch.where(active, p, 0.0).sum()
        budget = target - (g.shape[0] - torch.count_nonzero(active))
        c = torch.where(mass > 0, budget / torch.where(mass > 0, mass, torch.ones_like(mass)), torch.ones_like(mass))
        c = torch.clamp(c, min=1.0)
        p = torch.clamp(c * p, max=1.0)
    return p


def sparsify(g: torch.Tensor, p: torch.Tensor, u: torch.Tensor, k: int) -> tuple:
    """``(values, indices)``, ``k`` slots each: the kept values ``g_i / p_i`` and their int32 indices, in index
    order, then zeros (systematic sampling with the uniform ``u``, a 1-element tensor).

    Every value is scattered: a kept one to its slot, the others to slot ``k``, past the ``k`` returned, so what they
    carry there (``g_i / p_i`` with ``p_i = 0``: inf or NaN; their own index) is never read."""
    u = u.to(device=g.device, dtype=torch.float64)
    cum = torch.clamp(torch.cumsum(p.to(torch.float64), 0), max=float(k))
    hits = torch.floor(cum + u)
    keep = torch.cat([hits[:1] > torch.floor(u), hits[1:] > hits[:-1]])
    slot = torch.where(keep, hits.to(torch.int64) - 1, k)
    vals = g.new_zeros(k + 1).scatter(0, slot, g / p)
    idx = slot.new_zeros(k + 1).scatter(0, slot, torch.arange(g.shape[0], dtype=torch.int64, device=g.device))
    return vals[:k], idx[:k].to(torch.int32)


def densify(vals: torch.Tensor, idx: torch.Tensor, numel: int, into: torch.Tensor | None = None) -> torch.Tensor:
    """The pairs added into ``into`` (or a zero bucket of ``numel``)."""
    base = vals.new_zeros(numel) if into is None else into
    return base.index_add(0, idx.to(torch.int64), vals)


@register_method
@dataclass(frozen=True)
class Wangni(Method):
    """Wangni et al. (NeurIPS 2018): keep value i with probability ``p_i = min(1, lambda |g_i|)`` of expected
    density ``ratio``, send ``g_i / p_i``; ``iters`` rounds of the paper's greedy Algorithm 3."""
    name: ClassVar[str] = "wangni"
    paper: ClassVar[str] = ("Wangni, Wang, Liu & Zhang, Gradient Sparsification for Communication-Efficient "
                            "Distributed Optimization, NeurIPS 2018")
    ratio: float = 0.01
    seed: int = 0
    iters: int = 2

    def __post_init__(self):
        self.check(0)

    def check(self, dp: int) -> None:
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise StrategyError(f"Wangni(ratio={r!r}): ratio is the expected fraction of each bucket sent and must "
                                "be in (0, 1]; pass e.g. ratio=0.01")
        if isinstance(self.iters, bool) or not isinstance(self.iters, int) or self.iters < 0:
            raise StrategyError(f"Wangni(iters={self.iters!r}): iters, the greedy rescaling rounds of Wangni et "
                                "al.'s Algorithm 3, must be an int >= 0; pass e.g. iters=2")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise StrategyError(f"Wangni(seed={self.seed!r}): seed must be an int")

    def host_inputs(self, bucket: BucketInfo, step: int, state: dict, variant, gen: torch.Generator) -> list:
        return [torch.rand(1, generator=rank_generator(bucket, gen), dtype=torch.float64)]

    def sum(self, flat, state, inputs, bucket, comm: Comm, variant) -> tuple:
        n, k = flat.shape[0], capacity(flat.shape[0], self.ratio)
        p = wangni_probabilities(flat, self.ratio, self.iters)
        vals, idx = sparsify(flat, p, inputs[0], k)
        buf = torch.cat([vals.view(torch.uint8), idx.view(torch.uint8)])
        everyone = comm.all_gather(buf).view(comm.size, buf.shape[0])
        vbytes = k * flat.element_size()
        summed = flat.new_zeros(n)
        for r in range(comm.size):
            block = everyone[r]
            summed = densify(block[:vbytes].clone().view(flat.dtype), block[vbytes:].clone().view(torch.int32), n,
                             into=summed)
        return summed, state

    def wire_bytes(self, bucket: BucketInfo, variant) -> int:
        return capacity(bucket.numel, self.ratio) * (bucket.element_size + 4)

    def describe(self, bucket: BucketInfo, variant) -> list:
        k = capacity(bucket.numel, self.ratio)
        return [f"Wangni: keep each value with p_i = min(1, lambda |g_i|), expected density {self.ratio}; "
                f"{k} (value, int32 index) slots per rank: {bucket.numel * bucket.element_size} B -> "
                f"{self.wire_bytes(bucket, variant)} B, all-gathered"] + \
            tensor_lines(bucket, f"values kept with probability growing with |g_i| (expected {self.ratio:g} of the "
                                 "flat bucket) and sent as g_i / p_i with their int32 indices, in fixed slots",
                         self.wire_bytes(bucket, variant), "kept values + int32 indices",
                         rule="in proportion to its values (the slots are the bucket's, filled by whichever "
                              "values are kept)")
