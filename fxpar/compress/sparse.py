"""Gradient sparsification: ``TopK`` and ``RandomK``, each with optional error feedback.

Per bucket of ``n`` values, with ``k = max(1, round(ratio * n))`` (Python's ``round``), each rank ``r`` of ``dp``:

    p_r = g_r + e_r                        (g_r: the rank's bucket, already / dp; e_r: its residual, 0 at first)
    I_r = the k indices of the largest |p_r|  (TopK; ``torch.topk`` order)
        | k indices drawn without replacement from the rank's generator  (RandomK)
    v_r = p_r[I_r] * s                     (s = n / k for an unbiased RandomK, else 1)
    e_r <- p_r - scatter(I_r, v_r)         (error feedback on; else e_r stays 0)
    g   = sum over r = 0 .. dp-1 (rank order) of scatter(I_r, v_r)

TopK is the sparsification of Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017
(section 2, with the dropped values kept and added back), whose memory is the error feedback of Stich, Cordonnier
& Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (Algorithm 1, ``mem-SGD``: ``m <- m + g - comp(m + g)``).
RandomK is ``rand_k`` of the same paper (Stich et al. 2018, definition 2.1); scaled by n / k it is unbiased,
E[scatter(I, v)] = p (Wangni et al., NeurIPS 2018, section 3, with every probability k / n).

The pairs travel as one packed buffer per rank: the k indices as int32, then the k values in the bucket's dtype,
as bytes; one all-gather of that buffer, then each rank adds every rank's values into a zero bucket at their
indices, rank 0 first (``index_add``: one rank's indices are distinct, so each add is exact in its order). Bytes
per rank: ``k * (4 + element size)``. With ratio 1 every value is sent at scale 1 and the residual stays 0: plain
synchronous data parallelism, bit for bit at dp=2 (0 + a + b = a + b).

RandomK's draws: every rank's generator is seeded with ``seed`` and stays in step with the others; each step each
bucket draws ``dp`` index sets in rank order (``torch.randperm(n)[:k]``) and a rank keeps its own, so ranks draw
independently and a checkpoint restores the stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fxpar.errors import StrategyError

from .describe import tensor_lines
from .feature import register_method
from .method import BucketInfo, Method

__all__ = ["TopK", "RandomK", "sparse_k", "pack_pairs", "unpack_sum"]

_INDEX = torch.int32


def sparse_k(ratio: float, numel: int) -> int:
    """Values sent per bucket of ``numel``: ``max(1, round(ratio * numel))``."""
    return max(1, min(numel, round(ratio * numel)))


def _check_flag(cls: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise StrategyError(f"{cls}({name}={value!r}): {name} is True or False; pass {name}=True or {name}=False")


def _check_ratio(cls: str, ratio) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise StrategyError(f"{cls}(ratio={ratio!r}): ratio is the fraction of each bucket's values sent; choose a "
                            "number in (0, 1] (1: every value, plain data parallelism)")


def pack_pairs(idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """One buffer of bytes: the indices as int32, then the values."""
    return torch.cat([idx.to(_INDEX).view(torch.uint8), vals.contiguous().view(torch.uint8)])


def unpack_sum(gathered: torch.Tensor, k: int, dp: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's pairs (``gathered``: the all-gathered packed buffers) added into a zero bucket, rank 0 first."""
    rows = gathered.view(dp, -1)
    out = torch.zeros(numel, dtype=dtype)
    for r in range(dp):
        idx = rows[r, :4 * k].clone().view(_INDEX).to(torch.int64)     # a copy: its bytes aligned for the view
        vals = rows[r, 4 * k:].clone().view(dtype)
        out = out.index_add(0, idx, vals)
    return out


class _Sparse(Method):
    """What TopK and RandomK share: error feedback, the packed pairs, their bytes."""

    def init_state(self, bucket: BucketInfo, gen) -> dict:
        return {"residual": torch.zeros(bucket.numel, dtype=bucket.torch_dtype)} if self.error_feedback else {}

    def _plus_residual(self, flat, state):
        return flat + state["residual"] if self.error_feedback else flat

    def _send(self, p, state, idx, scale, bucket, comm):
        """``p`` (bucket + residual): its values at ``idx`` times ``scale`` summed over the ranks; the new state."""
        vals = p[idx] if scale == 1 else p[idx] * scale
        new = dict(state)
        if self.error_feedback:          # e <- p - comp(p)
            new["residual"] = p.index_put((idx,), p[idx] - vals) if scale != 1 else p.index_fill(0, idx, 0)
        k = idx.numel()
        gathered = comm.all_gather(pack_pairs(idx, vals))
        return unpack_sum(gathered, k, comm.size, bucket.numel, p.dtype), new

    def wire_bytes(self, bucket: BucketInfo, variant) -> int:
        return sparse_k(self.ratio, bucket.numel) * (torch.empty((), dtype=_INDEX).element_size()
                                                     + bucket.element_size)


@register_method
@dataclass(frozen=True)
class TopK(_Sparse):
    """The k largest |values| of each bucket (plus its residual) sent as (index, value) pairs."""
    name: ClassVar[str] = "topk"
    paper: ClassVar[str] = "Aji & Heafield, EMNLP 2017; Stich, Cordonnier & Jaggi, NeurIPS 2018 (Algorithm 1)"
    ratio: float = 0.01
    error_feedback: bool = True

    def check(self, dp: int) -> None:
        _check_ratio("TopK", self.ratio)
        _check_flag("TopK", "error_feedback", self.error_feedback)

    def sum(self, flat, state, inputs, bucket, comm, variant):
        k = sparse_k(self.ratio, bucket.numel)
        p = self._plus_residual(flat, state)
        idx = torch.topk(p.abs(), k).indices
        return self._send(p, state, idx, 1, bucket, comm)

    def describe(self, bucket, variant) -> list:
        k = sparse_k(self.ratio, bucket.numel)
        ef = "the rest kept as a residual for the next step" if self.error_feedback else "the rest dropped"
        pct = f"{100 * k / bucket.numel:.3g}%"
        return [f"the {k} of {bucket.numel} largest |values| (gradient + residual) over the bucket's "
                f"{len(bucket.keys)} tensor(s): int32 index + {bucket.dtype} value pairs, one all-gather; {ef}"] + \
            tensor_lines(bucket, f"the top {pct} of the flat bucket's values with their int32 indices (which tensor "
                                 "they fall in changes each step)", self.wire_bytes(bucket, variant),
                         f"top {pct} of values + int32 indices", rule="in proportion to its values (its share if its "
                         "values are as large as the rest's)")


@register_method
@dataclass(frozen=True)
class RandomK(_Sparse):
    """k random values of each bucket, drawn by each rank, sent as (index, value) pairs (scaled by n / k when
    ``unbiased``)."""
    name: ClassVar[str] = "randomk"
    paper: ClassVar[str] = "Stich, Cordonnier & Jaggi, NeurIPS 2018 (rand_k, definition 2.1)"
    ratio: float = 0.01
    unbiased: bool = True
    seed: int = 0
    error_feedback: bool = False

    def check(self, dp: int) -> None:
        _check_ratio("RandomK", self.ratio)
        _check_flag("RandomK", "unbiased", self.unbiased)
        _check_flag("RandomK", "error_feedback", self.error_feedback)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise StrategyError(f"RandomK(seed={self.seed!r}): the seed of the ranks' draws is an int")

    def host_inputs(self, bucket, step, state, variant, gen) -> list:
        k = sparse_k(self.ratio, bucket.numel)
        draws = [torch.randperm(bucket.numel, generator=gen)[:k] for _ in range(bucket.dp)]
        return [draws[bucket.dp_rank]]

    def sum(self, flat, state, inputs, bucket, comm, variant):
        k = sparse_k(self.ratio, bucket.numel)
        scale = bucket.numel / k if self.unbiased else 1
        return self._send(self._plus_residual(flat, state), state, inputs[0], scale, bucket, comm)

    def describe(self, bucket, variant) -> list:
        k = sparse_k(self.ratio, bucket.numel)
        scale = f" scaled by {bucket.numel}/{k}" if self.unbiased and k != bucket.numel else ""
        ef = "; the rest kept as a residual" if self.error_feedback else ""
        pct = f"{100 * k / bucket.numel:.3g}%"
        return [f"{k} of {bucket.numel} values of the bucket's {len(bucket.keys)} tensor(s) drawn at random per "
                f"rank{scale}: int32 index + {bucket.dtype} value pairs, one all-gather{ef}"] + \
            tensor_lines(bucket, f"a random {pct} of the flat bucket's values{scale} with their int32 indices",
                         self.wire_bytes(bucket, variant), f"random {pct} of values + int32 indices",
                         rule="in proportion to its values (its expected share: every value is drawn alike)")
