"""BAGUA's ByteGrad: 8-bit min-max quantisation with scatter-reduce-gather.

Gan, Lian, Zhang, Liu et al., "BAGUA: Scaling up Distributed Learning with System Relaxations", PVLDB 15(4), 2022
(§3, the ``centralized, low precision`` primitive; bagua's ``bytegrad`` algorithm). The bucket is cut into ``dp``
chunks, chunk ``c`` summed by rank ``c``:

1. each rank quantises each of its chunks to uint8 against the chunk's float32 minimum and maximum;
2. ``all_to_all``: rank ``c`` receives chunk ``c`` from every rank; it dequantises them and adds them in rank order;
3. it quantises that sum again (its own minimum and maximum);
4. ``all_gather``: every rank receives every summed chunk and dequantises it.

**Quantising** a chunk ``x`` with ``lo`` and ``hi`` (its minimum and maximum rounded outward to float32, so
``lo <= x_i <= hi``): ``q_i = round((x_i - lo) / step)`` with ``step = (hi - lo) / 255``, decoded as
``lo + q_i * step``. Rounding to nearest errs by at most ``step / 2 = (hi - lo) / 510`` per value (up to a few
ulp of ``hi - lo`` from the arithmetic). A constant chunk (``hi == lo``) is exact.

**Error of the sum**: value ``i`` of chunk ``c`` errs from the exact sum by at most
``sum_r (hi_rc - lo_rc) / 510 + (hi_c - lo_c) / 510``: one step per sending rank ``r`` and one for the summed
chunk (``hi_c - lo_c``: the range of the decoded sum), up to float rounding.

**What travels**: per chunk 8 bytes (float32 ``lo`` and ``hi``) and ``m = ceil(numel / dp)`` codes: a rank hands
``dp (8 + m)`` bytes to the all-to-all and ``8 + m`` to the all-gather.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from fxpar.compress.describe import tensor_lines
from fxpar.compress.feature import register_method
from fxpar.compress.method import BucketInfo, Comm, Method

__all__ = ["ByteGrad", "quantize_rows", "dequantize_rows", "chunk_size"]


def chunk_size(numel: int, dp: int) -> int:
    return -(-numel // dp)


def _outward32(x: torch.Tensor, toward: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    wrong = (x32.to(x.dtype) > x) if toward < 0 else (x32.to(x.dtype) < x)
    return torch.where(wrong, torch.nextafter(x32, torch.full_like(x32, toward)), x32)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` as 8 bytes (float32 min and max) and one uint8 code per value: ``[rows, 8 + cols]``."""
    lo32 = _outward32(x.amin(dim=1), -math.inf)
    hi32 = _outward32(x.amax(dim=1), math.inf)
    lo, hi = lo32.to(x.dtype).unsqueeze(1), hi32.to(x.dtype).unsqueeze(1)
    step = (hi - lo) / 255
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.where(step > 0, torch.round((x - lo) / safe), 0.0).clamp(0, 255).to(torch.uint8)
    head = torch.stack([lo32, hi32], dim=1).contiguous().view(torch.uint8)         # [rows, 8]
    return torch.cat([head, q], dim=1)


def dequantize_rows(packed: torch.Tensor, dtype) -> torch.Tensor:
    """The values :func:`quantize_rows` wrote, ``[rows, cols]`` in ``dtype``."""
    head = packed[:, :8].clone(memory_format=torch.contiguous_format).view(torch.float32).to(dtype)   # [rows, 2]
    lo, hi = head[:, :1], head[:, 1:]
    return lo + packed[:, 8:].to(dtype) * ((hi - lo) / 255)


@register_method
@dataclass(frozen=True)
class ByteGrad(Method):
    """BAGUA's ByteGrad (Gan et al., VLDB 2022): per chunk min-max uint8 codes, scatter-reduce-gather."""
    name: ClassVar[str] = "bytegrad"
    paper: ClassVar[str] = ("Gan, Lian, Zhang, Liu et al., BAGUA: Scaling up Distributed Learning with System "
                            "Relaxations, PVLDB 15(4) 2022 (ByteGrad)")

    def sum(self, flat, state, inputs, bucket, comm: Comm, variant) -> tuple:
        n, dp = flat.shape[0], comm.size
        m = chunk_size(n, dp)
        x = flat if m * dp == n else torch.cat([flat, flat.new_zeros(m * dp - n)])
        mine = comm.all_to_all(quantize_rows(x.view(dp, m)).reshape(-1)).view(dp, 8 + m)
        parts = dequantize_rows(mine, flat.dtype)
        chunk = parts[0]
        for r in range(1, dp):
            chunk = chunk + parts[r]
        everyone = comm.all_gather(quantize_rows(chunk.view(1, m)).reshape(-1)).view(dp, 8 + m)
        return dequantize_rows(everyone, flat.dtype).reshape(-1)[:n], state

    def wire_bytes(self, bucket: BucketInfo, variant) -> int:
        m = chunk_size(bucket.numel, bucket.dp)
        return (bucket.dp + 1) * (8 + m)

    def describe(self, bucket: BucketInfo, variant) -> list:
        m = chunk_size(bucket.numel, bucket.dp)
        return [f"ByteGrad: {bucket.dp} chunks of {m} values as uint8 codes and a float32 min and max; "
                f"all-to-all {bucket.dp * (8 + m)} B then all-gather {8 + m} B per rank "
                f"({bucket.numel * bucket.element_size} B uncompressed)"] + \
            tensor_lines(bucket, f"each value as a uint8 code against its chunk's float32 min and max (the flat "
                                 f"bucket cut into {bucket.dp} chunks of {m})", self.wire_bytes(bucket, variant),
                         "uint8 codes + min/max share")
