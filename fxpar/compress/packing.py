"""Bit packing of fixed-width codes, and the lengths of Elias's universal codes.

``pack_bits(codes, bits)`` writes ``n`` codes of ``bits`` bits each (``0 <= code < 2**bits``, ``1 <= bits <= 8``)
into ``ceil(n * bits / 8)`` bytes, least significant bit first: code ``i`` occupies bits ``i*bits .. i*bits+bits-1``
of the stream, and bit ``j`` of the stream is bit ``j % 8`` of byte ``j // 8``. ``unpack_bits`` reads them back.
Both are plain tensor code with shapes fixed by ``n`` and ``bits``, so a method's traced ``sum`` calls them.

Eight codes make ``bits`` whole bytes, so the packer groups codes by eight into one 64-bit word
(``sum_j code_j << (bits * j)``) and cuts the word into bytes::

    codes (bits=3)   5        1        7        0   ...        word = 5 | 1<<3 | 7<<6 | ...
    bytes            word & 0xff, (word >> 8) & 0xff, (word >> 16) & 0xff

Elias's codes (Elias, "Universal codeword sets and representations of the integers", IEEE Trans. Inf. Theory
21(2), 1975): the gamma code of a positive integer ``x`` is ``floor(log2 x)`` zeros and ``x`` in binary,
``2 floor(log2 x) + 1`` bits; the omega (recursive) code writes ``x`` in binary, prefixed recursively by the
code of its length minus one, ending in a 0 bit: ``1 + sum`` of the binary lengths of ``x, L(x) - 1, ...`` down
to 1. NUQSGD (Ramezani-Kebrya et al., JMLR 2021) counts its messages in the recursive code;
:func:`elias_omega_length` gives the bits per integer (``fxpar.compress.quantize.elias_bit_count`` adds them up).
"""
from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes", "bit_length", "elias_gamma_length", "elias_omega_length"]


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits take packed: ``ceil(n * bits / 8)``."""
    return (int(n) * int(bits) + 7) // 8


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r}: packing takes 1 to 8 bits per code")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (1-D, integer, each in ``[0, 2**bits)``) packed into a uint8 tensor of ``packed_nbytes(n, bits)``."""
    _check_bits(bits)
    n = codes.shape[0]
    if bits == 8:
        return codes.to(torch.uint8)
    groups = (n + 7) // 8
    c = codes.to(torch.int64)
    if groups * 8 != n:
        c = torch.cat([c, c.new_zeros(groups * 8 - n)])
    shifts = torch.arange(8, dtype=torch.int64, device=codes.device) * bits
    words = (c.view(groups, 8) << shifts).sum(dim=1)                  # disjoint bit fields: the sum is their OR
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=codes.device) * 8
    out = ((words.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return out[:packed_nbytes(n, bits)]


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` codes :func:`pack_bits` wrote into ``packed``, as uint8."""
    _check_bits(bits)
    if bits == 8:
        return packed[:n].to(torch.uint8)
    groups = (n + 7) // 8
    b = packed.to(torch.int64)
    full = groups * bits
    if full != b.shape[0]:
        b = torch.cat([b, b.new_zeros(full - b.shape[0])])
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=packed.device) * 8
    words = (b.view(groups, bits) << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, dtype=torch.int64, device=packed.device) * bits
    codes = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:n].to(torch.uint8)


def bit_length(x: torch.Tensor) -> torch.Tensor:
    """Binary length of each positive integer in ``x`` (``floor(log2 x) + 1``), exact in integer arithmetic."""
    x = x.to(torch.int64)
    out = torch.zeros_like(x)
    for k in range(63):
        out += (x >> k) > 0
    return out


def elias_gamma_length(x: torch.Tensor) -> torch.Tensor:
    """Bits of Elias's gamma code of each positive integer in ``x``: ``2 floor(log2 x) + 1``."""
    return 2 * (bit_length(x) - 1) + 1


def elias_omega_length(x: torch.Tensor) -> torch.Tensor:
    """Bits of Elias's omega (recursive) code of each positive integer in ``x``: the final 0 bit, then while
    ``x > 1`` the binary of ``x`` (``bit_length(x)`` bits) and recursion on ``bit_length(x) - 1``."""
    x = x.to(torch.int64)
    total = torch.ones_like(x)
    while bool((x > 1).any()):
        more = x > 1
        length = bit_length(x)
        total = total + torch.where(more, length, torch.zeros_like(length))
        x = torch.where(more, length - 1, x)
    return total
