"""fxpar.compress.packing: b-bit codes packed into bytes and back, and Elias's code lengths."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxpar.compress.packing import (bit_length, elias_gamma_length, elias_omega_length, pack_bits, packed_nbytes,
                                    unpack_bits)

pytestmark = pytest.mark.structure


@pytest.mark.parametrize("bits", range(1, 9))
def test_round_trip_every_width(bits):
    g = torch.Generator().manual_seed(bits)
    for n in (0, 1, 7, 8, 9, 63, 1000, 1001):
        codes = torch.randint(0, 2 ** bits, (n,), generator=g, dtype=torch.uint8)
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8
        assert packed.shape[0] == packed_nbytes(n, bits) == -(-n * bits // 8)
        assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_bit_order_is_least_significant_first():
    # codes 5, 1, 7 in 3 bits: the stream 101 100 111 (LSB first) = 5 | 1 << 3 | 7 << 6 = 461 = bytes 205, 1
    assert pack_bits(torch.tensor([5, 1, 7], dtype=torch.uint8), 3).tolist() == [205, 1]
    assert pack_bits(torch.tensor([1, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [0b1101]
    assert pack_bits(torch.tensor([0xA, 0x3], dtype=torch.uint8), 4).tolist() == [0x3A]


def test_packing_traces_with_fixed_shapes():
    gm = make_fx(lambda c: unpack_bits(pack_bits(c, 5), 5, 37), tracing_mode="fake")(
        torch.zeros(37, dtype=torch.uint8))
    codes = torch.randint(0, 32, (37,), dtype=torch.uint8)
    assert torch.equal(gm(codes), codes)


def test_widths_outside_one_to_eight_are_refused():
    for bits in (0, 9):
        with pytest.raises(ValueError, match=rf"bits={bits}: packing takes 1 to 8 bits per code"):
            pack_bits(torch.zeros(4, dtype=torch.uint8), bits)


def _gamma(x: int) -> str:
    b = bin(x)[2:]
    return "0" * (len(b) - 1) + b


def _omega(x: int) -> str:
    code = "0"
    while x > 1:
        b = bin(x)[2:]
        code = b + code
        x = len(b) - 1
    return code


def test_elias_lengths_match_the_codes():
    x = torch.arange(1, 2049)
    assert bit_length(x).tolist() == [v.bit_length() for v in range(1, 2049)]
    assert elias_gamma_length(x).tolist() == [len(_gamma(v)) for v in range(1, 2049)]
    assert elias_omega_length(x).tolist() == [len(_omega(v)) for v in range(1, 2049)]


def test_elias_lengths_on_known_values():
    # gamma: 2 floor(log2 x) + 1; omega: 1 -> "0", 2 -> "100", 4 -> "101000", 8 -> "1110000",
    # 16 -> "10100100000", 100 -> 13 bits, 2^20 -> 1 + 21 + 5 + 3 + 2 bits
    x = torch.tensor([1, 2, 3, 4, 7, 8, 15, 16, 17, 100, 2 ** 20])
    assert elias_gamma_length(x).tolist() == [1, 3, 3, 5, 5, 7, 7, 9, 9, 13, 41]
    assert elias_omega_length(x).tolist() == [1, 3, 3, 6, 6, 7, 7, 11, 11, 13, 32]
    assert [_omega(v) for v in (1, 2, 4, 8, 16)] == ["0", "100", "101000", "1110000", "10100100000"]
