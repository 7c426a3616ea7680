"""Streaming DiLoCo's 4-bit pseudo-gradients: the E3M0 format, its wire buffer, and the float32 mean over the ranks.

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch" (2025), send
the outer gradients in a 4-bit floating-point format with one sign bit, three exponent bits and no mantissa bit
(E3M0) and accumulate them in float32. What the format leaves open is ours:

* **scale** -- each tensor is sent with one float32 scale, its largest magnitude (``max |x|`` in float32): the
  values are coded relative to it, so the largest one arrives exactly;
* **grid** -- of the eight exponent codes, 0 is zero and ``j = 1..7`` is ``2^(j - 7)`` times the scale (the powers of
  two from ``scale / 64`` to ``scale``); the sign bit is bit 3 (a zero's sign bit is 0);
* **rounding** -- to the nearest grid value, a tie to the larger magnitude (deterministic: every rank codes alike);
* **wire** -- per tensor, its scale's 4 bytes then its codes two to a byte (the even-indexed value in the low
  nibble; an odd count padded with a zero code): ``4 + ceil(n / 2)`` bytes for ``n`` values (:func:`wire_bytes`).

A fragment's buffers are all-gathered over dp, not all-reduced: a sum of 4-bit codes is not a 4-bit code, and a
float32 all-reduce of the dequantized values would sum them in the collective's order. Each rank dequantizes every
rank's buffer to float32 and sums them in rank order (:func:`mean_of`), so the mean is the same float32 bits on every
rank.
"""
from __future__ import annotations

import torch

__all__ = ["FORMATS", "E3M0", "quantize", "dequantize", "encode", "decode", "wire_bytes", "mean_of"]

E3M0 = "e3m0"
FORMATS = (E3M0,)              # the formats built
_TOP = 7                       # the largest exponent code: the scale itself
_SIGN = 8                      # the sign bit of a code


def quantize(x: torch.Tensor) -> tuple:
    """``(codes, scale)``: ``x``'s values as E3M0 codes (uint8, one per value, ``x``'s shape) and its float32 scale
    (a 0-d tensor, ``max |x|`` in float32)."""
    v = x.detach().to(torch.float32)
    a = v.abs()
    scale = a.max() if a.numel() else torch.zeros((), dtype=torch.float32, device=v.device)
    if not scale > 0:
        return torch.zeros(x.shape, dtype=torch.uint8, device=v.device), scale.clone()
    r = a / scale                                            # in [0, 1]
    m, e = torch.frexp(r)                                    # r = m 2^e, m in [0.5, 1)
    k = e - (m < 0.75).to(e.dtype)                           # the nearer of 2^(e-1), 2^e (0.75: the tie, upward)
    j = (k + _TOP).clamp(min=0, max=_TOP)
    small = 2.0 ** -_TOP                                     # half the smallest step: nearer 2^-6 than 0 from here
    j = torch.where(r >= small, j.clamp(min=1), torch.zeros_like(j))
    code = j.to(torch.uint8) | ((v < 0) & (j > 0)).to(torch.uint8) * _SIGN
    return code, scale.clone()


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E3M0 ``codes`` (uint8) with their float32 ``scale`` back as float32 values (exact: a power of two times
    the scale)."""
    j = (codes & (_SIGN - 1)).to(torch.int32)
    mag = torch.ldexp(scale.to(torch.float32).expand(codes.shape), j - _TOP)
    mag = torch.where(j > 0, mag, torch.zeros_like(mag))
    return torch.where((codes & _SIGN) > 0, -mag, mag)


def wire_bytes(numel: int) -> int:
    """The bytes one tensor of ``numel`` values takes on the wire: its float32 scale and its codes two to a byte."""
    return 4 + (int(numel) + 1) // 2


def encode(tensors: list) -> torch.Tensor:
    """``tensors`` (in order) as one uint8 wire buffer: per tensor its scale's 4 bytes, then its packed codes."""
    parts = []
    for t in tensors:
        codes, scale = quantize(t)
        flat = codes.reshape(-1)
        if flat.numel() % 2:
            flat = torch.cat([flat, flat.new_zeros(1)])
        parts.append(scale.reshape(1).view(torch.uint8))
        parts.append(flat[0::2] | (flat[1::2] << 4))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)      # no tensors: an empty buffer


def decode(buf: torch.Tensor, shapes: list) -> list:
    """A wire buffer of :func:`encode` back as float32 tensors of ``shapes`` (in order)."""
    out, at = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        scale = buf[at:at + 4].clone().view(torch.float32).reshape(())
        at += 4
        packed = buf[at:at + (n + 1) // 2]
        at += (n + 1) // 2
        codes = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:n]
        out.append(dequantize(codes, scale).reshape(shape))
    return out


def mean_of(bufs: list, shapes: list) -> list:
    """The float32 mean of every rank's dequantized tensors (``bufs``: the ranks' wire buffers in rank order): the
    sum in rank order, then divided by the ranks' count, in float32."""
    total = None
    for buf in bufs:
        vals = decode(buf, shapes)
        total = vals if total is None else [a + b for a, b in zip(total, vals)]
    return [t / len(bufs) for t in total]
