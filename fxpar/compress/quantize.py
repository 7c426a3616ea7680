"""Stochastic quantizers of a gradient bucket: QSGD, NUQSGD, ALQ and AMQ.

All four quantize the same way and differ in their levels ``0 = l_0 < l_1 < ... < l_s = 1``:

- QSGD (Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD: Communication-Efficient SGD via Gradient Quantization and
  Encoding", NeurIPS 2017, §3.1): uniform levels ``l_j = j / s``.
- NUQSGD (Ramezani-Kebrya, Faghri, Markov, Aksenov, Alistarh & Roy, "NUQSGD: Provably Communication-efficient
  Data-parallel SGD via Nonuniform Quantization", JMLR 22(114), 2021, §3): exponential levels
  ``{0, 2^-(s-1), ..., 1/2, 1}``, ``l_j = 2^(j-s)``.
- ALQ and AMQ (Faghri, Tabrizian, Markov, Alistarh, Roy & Ramezani-Kebrya, "Adaptive Gradient Quantization for
  Data-Parallel SGD", NeurIPS 2020, §3): levels adapted to the gradients. ALQ moves each level by coordinate
  descent on the expected variance (§3.1); AMQ keeps exponential levels ``{0, p^(s-1), ..., p, 1}`` and adapts the
  multiplier ``p`` (§3.2). ``AMQ`` at ``p = 1/2`` has NUQSGD's levels.

**Quantizing** (QSGD eq. 1 with general levels; Faghri et al. eq. 1): the bucket is cut into chunks of ``bucket``
values; per chunk ``v`` the scale is its L2 norm ``||v||``, rounded up to a float32 ``S >= ||v||`` (what travels);
each value's normalised magnitude ``r = |v_i| / S`` lies in ``[l_t, l_t+1]`` and is rounded up to ``l_t+1`` with
probability ``(r - l_t) / (l_t+1 - l_t)``, down otherwise, from a uniform draw ``u_i``. So ``E[Q(v)_i] = v_i``
(unbiased) and, per value, ``E[(Q(v)_i - v_i)^2] = S^2 (l_t+1 - r)(r - l_t)`` (Faghri et al. eq. 3):
:func:`expected_variance` is that sum. The paper bounds it by:

- QSGD (Lemma 3.1): ``min(n / s^2, sqrt(n) / s) ||v||^2`` per chunk of ``n`` values;
- NUQSGD: ``(1/8 + min(n / 4^s, 2^(1-s) sqrt(n))) ||v||^2`` per chunk (the form of the paper's variance bound, and
  derived in two lines: on ``[l_j, 2 l_j]`` the variance ``(2 l_j - r)(r - l_j) <= r^2 / 8`` and the ``r^2`` sum to
  at most 1; below ``l_1 = 2^(1-s)`` it is at most ``min(l_1^2 / 4, l_1 r)`` and ``sum r <= sqrt(n)``).

The uniform draws are :meth:`~fxpar.compress.method.Method.host_inputs`: one float per value of the bucket, from
:func:`rank_generator`. The generator the runtime hands a method is the same on every rank (seeded from the
method's ``seed``, 0 here); each step it draws one seed per rank, and each rank draws its values from a generator
seeded with its own: the ranks' draws differ, and the shared generator, which checkpoints save, advances alike on
every rank.

**What travels**: ``s`` levels and a sign make ``2s + 1`` signed codes ``s + sign * level`` in ``bits`` bits
(QSGD: ``bits = ceil(log2(2s + 1))``; NUQSGD, ALQ, AMQ: ``s = 2^(bits-1) - 1``), packed with
:mod:`fxpar.compress.packing`, after the chunks' float32 scales: one uint8 buffer of
``4 * ceil(numel / bucket) + ceil(numel * bits / 8)`` bytes per rank. One ``all_gather`` hands every rank every
rank's buffer; each rank decodes them and adds them in rank order, so every rank holds the same sum. (A
reduce-scatter of quantized values is not possible without decoding in between; a gather keeps one collective
and is exact to reproduce: every rank's estimate is the same tensor.)

**Levels are state** for ALQ and AMQ: the same on every rank because they are computed from the decoded sum,
which every rank holds bit for bit. At steps ``0, update_every, 2 update_every, ...`` the sum's graph also adapts
the levels to the sum's normalised values (the ``"adapt"`` variant), weighting each value by its chunk's squared
norm, so the objective is the expected variance of quantizing that sum (Faghri et al. eq. 4 with the empirical
distribution of the normalised values). ALQ: each interior level in turn moves to the point in
``(l_j-1, l_j+1)`` that minimises that variance, the current level among the candidates (a minimum of a
piecewise-linear function lies at a data point), ``sweeps`` times; AMQ: the multiplier moves to the best of the
current one and a grid over ``(0, 1)``. Neither can raise the variance on the data it adapts to.

**Elias bits**: NUQSGD counts a message in Elias's recursive code (§4 of the paper): the 32-bit norm per chunk,
and per value the recursive Elias code of its level index plus one, and a sign bit where the level is nonzero.
:func:`elias_bit_count` counts that; the fixed-width packed code is what travels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from fxpar.compress.describe import tensor_lines
from fxpar.compress.feature import register_method
from fxpar.compress.method import BucketInfo, Comm, Method
from fxpar.compress.packing import elias_omega_length, pack_bits, packed_nbytes, unpack_bits
from fxpar.errors import StrategyError

__all__ = ["QSGD", "NUQSGD", "ALQ", "AMQ", "rank_generator", "uniform_levels", "exponential_levels", "encode", "decode",
           "quantize_dequantize", "level_indices", "expected_variance", "normalised", "alq_adapt", "amq_adapt",
           "elias_bit_count", "elias_bits_of_indices", "elias_value_bits", "encode_with_indices", "halving_intervals",
           "qsgd_variance_bound", "nuqsgd_variance_bound"]


# ---- levels --------------------------------------------------------------------------------------------------
def uniform_levels(s: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """QSGD's ``{0, 1/s, ..., 1}``."""
    return torch.arange(s + 1, dtype=dtype, device=device) / s


def exponential_levels(s: int, p=0.5, dtype=torch.float64) -> torch.Tensor:
    """``{0, p^(s-1), ..., p, 1}`` (NUQSGD at ``p = 1/2``; AMQ's family). ``p`` may be a 0-d or 1-element tensor."""
    p = torch.as_tensor(p, dtype=dtype).reshape(1)
    powers = torch.pow(p, torch.arange(s - 1, -1, -1, dtype=dtype, device=p.device))
    return torch.cat([p.new_zeros(1), powers])


def rank_generator(bucket: BucketInfo, gen: torch.Generator) -> torch.Generator:
    """This rank's generator for one step's draws: ``gen`` (the same on every rank) draws one seed per dp rank; the
    generator seeded with rank ``bucket.dp_rank``'s seed is returned."""
    seeds = torch.randint(0, 2 ** 62, (max(bucket.dp, 1),), generator=gen)
    return torch.Generator().manual_seed(int(seeds[max(bucket.dp_rank, 0)]))


# ---- quantizing ----------------------------------------------------------------------------------------------
def _chunks(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    n = flat.shape[0]
    m = -(-n // chunk)
    if m * chunk != n:
        flat = torch.cat([flat, flat.new_zeros(m * chunk - n)])
    return flat.view(m, chunk)


def _scales(v: torch.Tensor) -> torch.Tensor:
    """Per chunk (row of ``v``) its L2 norm as a float32 no smaller than the norm."""
    norm = torch.linalg.vector_norm(v, dim=1)
    s32 = norm.to(torch.float32)
    return torch.where(s32.to(norm.dtype) < norm, torch.nextafter(s32, torch.full_like(s32, math.inf)), s32)


def level_indices(r: torch.Tensor, levels: torch.Tensor, u: torch.Tensor, halving: bool = False) -> torch.Tensor:
    """Stochastic rounding of ``r`` (in ``[0, 1]``) to ``levels``: the index of the level above with probability
    ``(r - l_t) / (l_t+1 - l_t)`` (``u`` uniform in ``[0, 1)``), else of the level below. ``halving``: ``levels``
    are NUQSGD's, ``{0, 2^-(s-1), ..., 1/2, 1}``, whose interval is read from ``r``'s exponent
    (:func:`halving_intervals`) instead of searched for."""
    s = levels.shape[0] - 1
    if halving:
        t = halving_intervals(r, s)
    else:
        t = (torch.searchsorted(levels, r, right=True) - 1).clamp(0, s - 1)
    lo, hi = levels[t], levels[t + 1]
    return t + (u < (r - lo) / (hi - lo)).to(t.dtype)


def halving_intervals(r: torch.Tensor, s: int) -> torch.Tensor:
    """Per value of ``r`` (in ``[0, 1]``), the index ``t`` of its interval ``[l_t, l_t+1)`` among NUQSGD's levels
    ``l_0 = 0, l_j = 2^(j-s)`` (the last interval closed: ``t <= s - 1``) -- what ``searchsorted(levels, r,
    right=True) - 1`` clamped to ``[0, s - 1]`` gives, bit for bit, read from the exponent instead: ``r = m 2^e``
    with ``m`` in ``[1/2, 1)`` (``frexp``, exact) lies in ``[2^(e-1), 2^e)``, so ``t = e - 1 + s``, clamped, and 0
    where ``r`` is 0. A binary search over levels that split the values (NUQSGD's do: they are dense where
    normalised magnitudes lie) mispredicts a branch per comparison on CPU, 2-5x the time of these elementwise ops."""
    _, e = torch.frexp(r)
    return ((e + (s - 1)).clamp(0, s - 1) * (r > 0)).to(torch.int64)


def encode(flat: torch.Tensor, levels: torch.Tensor, u: torch.Tensor, chunk: int, bits: int) -> torch.Tensor:
    """``flat`` quantized: the chunks' float32 scales and the packed signed codes, one uint8 buffer."""
    return encode_with_indices(flat, levels, u, chunk, bits)[0]


def encode_with_indices(flat: torch.Tensor, levels: torch.Tensor, u: torch.Tensor, chunk: int, bits: int,
                        halving: bool = False) -> tuple:
    """``(buffer, indices)``: :func:`encode`'s buffer and each value's level index (int64), the magnitude part of
    its code. ``halving``: ``levels`` are NUQSGD's (:func:`level_indices`)."""
    n, s = flat.shape[0], levels.shape[0] - 1
    v = _chunks(flat, chunk)
    scale32 = _scales(v)
    scale = scale32.to(flat.dtype).unsqueeze(1)
    r = torch.where(scale > 0, v.abs() / torch.where(scale > 0, scale, torch.ones_like(scale)), 0.0)
    idx = level_indices(r.reshape(-1)[:n], levels.to(device=flat.device, dtype=flat.dtype), u.to(flat.device),
                        halving)
    # s - idx where the value is negative, s + idx elsewhere: integer arithmetic, without a select over a mask
    # that flips at random (4-5x a comparison's time on CPU)
    codes = torch.addcmul(s + idx, idx, (flat < 0).to(idx.dtype), value=-2)
    return torch.cat([scale32.view(torch.uint8), pack_bits(codes, bits)]), idx


def decode(buf: torch.Tensor, levels: torch.Tensor, n: int, chunk: int, bits: int, dtype) -> torch.Tensor:
    """The values :func:`encode` wrote into ``buf`` (``n`` of them, in ``dtype``)."""
    s = levels.shape[0] - 1
    m = -(-n // chunk)
    scale = buf[:4 * m].clone().view(torch.float32).to(dtype)
    signed = unpack_bits(buf[4 * m:], bits, n).to(torch.int64) - s
    mag = levels.to(device=buf.device, dtype=dtype)[signed.abs()]
    # the code's sign on the level (levels are >= +0: the bits of -mag where the code is negative, of mag elsewhere),
    # without a select over a mask that flips at random (4-5x a comparison's time on CPU)
    val = torch.copysign(mag, signed.to(dtype))
    return (_chunks(val, chunk) * scale.unsqueeze(1)).reshape(-1)[:n]


def quantize_dequantize(flat, levels, u, chunk: int, bits: int) -> torch.Tensor:
    """``Q(flat)``: what one rank's bucket decodes to on every rank."""
    return decode(encode(flat, levels, u, chunk, bits), levels, flat.shape[0], chunk, bits, flat.dtype)


def normalised(flat: torch.Tensor, chunk: int, scale: str = "float32") -> tuple:
    """``(r, w)``: each value's magnitude over its chunk's scale (``"float32"``: the scale that travels;
    ``"exact"``: the norm), and its weight, the chunk's squared scale (float64, ``numel`` each)."""
    n = flat.shape[0]
    v = _chunks(flat.to(torch.float64), chunk)
    sc = _scales(v).to(torch.float64) if scale == "float32" else torch.linalg.vector_norm(v, dim=1)
    sc = sc.unsqueeze(1)
    safe = torch.where(sc > 0, sc, torch.ones_like(sc))
    r = (v.abs() / safe).reshape(-1)[:n]
    w = (sc * sc).expand_as(v).reshape(-1)[:n]
    return r, w


def expected_variance(flat: torch.Tensor, levels: torch.Tensor, chunk: int) -> torch.Tensor:
    """``E||Q(flat) - flat||^2 = sum_i S_c^2 (l_t+1 - r_i)(r_i - l_t)`` (Faghri et al. 2020, eq. 3), float64."""
    r, w = normalised(flat, chunk)
    return _variance(r, w, levels.to(device=flat.device, dtype=torch.float64))


def _variance(r, w, levels):
    s = levels.shape[0] - 1
    t = (torch.searchsorted(levels, r, right=True) - 1).clamp(0, s - 1)
    return (w * (levels[t + 1] - r) * (r - levels[t])).sum()


def qsgd_variance_bound(flat: torch.Tensor, s: int, chunk: int) -> torch.Tensor:
    """QSGD Lemma 3.1 summed over chunks: ``sum_c min(n_c / s^2, sqrt(n_c) / s) ||v_c||^2``."""
    return _chunk_bound(flat, chunk, lambda n: min(n / s ** 2, math.sqrt(n) / s))


def nuqsgd_variance_bound(flat: torch.Tensor, s: int, chunk: int) -> torch.Tensor:
    """NUQSGD's bound summed over chunks: ``sum_c (1/8 + min(n_c / 4^s, 2^(1-s) sqrt(n_c))) ||v_c||^2``."""
    return _chunk_bound(flat, chunk, lambda n: 0.125 + min(n / 4.0 ** s, 2.0 ** (1 - s) * math.sqrt(n)))


def _chunk_bound(flat, chunk, eps):
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, flat.shape[0], chunk):
        v = flat[start:start + chunk].to(torch.float64)
        total = total + eps(v.shape[0]) * (v * v).sum()
    return total


def elias_value_bits(s: int) -> list:
    """Per level index ``j`` in ``0..s``: the bits NUQSGD's Elias-coded message spends on a value of that index,
    the Elias omega code of ``j + 1`` and a sign bit where ``j > 0`` (Python ints: a table the traced sum indexes)."""
    return [omega_bits(j + 1) + (1 if j > 0 else 0) for j in range(s + 1)]


def omega_bits(x: int) -> int:
    """Bits of Elias's omega code of the positive integer ``x`` (the final 0, then the recursive groups)."""
    total = 1
    while x > 1:
        total += x.bit_length()
        x = x.bit_length() - 1
    return total


def elias_bits_of_indices(idx: torch.Tensor, s: int, chunks: int) -> torch.Tensor:
    """The Elias-coded message's bits (an int64 0-d tensor) of values with level indices ``idx`` (``s`` levels per
    sign) in ``chunks`` chunks: 32 per chunk (the norm) plus :func:`elias_value_bits` per value; traceable."""
    # summed in int32 where the sum cannot overflow it (CPU sums int32 into int32 with vector instructions, at its
    # bytes' time; a sum that widens each value, int8 or int32 into int64, converts value by value, 20-30x that),
    # else in int64
    bits = elias_value_bits(s)
    wide = idx.numel() * max(bits) >= 2 ** 31
    table = torch.tensor(bits, dtype=torch.int64 if wide else torch.int32, device=idx.device)
    return table[idx].sum(dtype=table.dtype).to(torch.int64) + 32 * chunks


def elias_bit_count(flat: torch.Tensor, levels: torch.Tensor, u: torch.Tensor, chunk: int) -> int:
    """Bits of ``Q(flat)`` in NUQSGD's Elias-coded message: 32 per chunk (the norm), and per value the recursive
    Elias code of its level index plus one, and a sign bit where that index is nonzero."""
    n = flat.shape[0]
    r, _ = normalised(flat, chunk)
    idx = level_indices(r, levels.to(torch.float64), u.to(torch.float64))
    return int(32 * -(-n // chunk) + elias_omega_length(idx + 1).sum() + (idx > 0).sum())


ELIAS_SAMPLE_CHUNKS = 256      # NUQSGD.expected_elias_bits: whole chunks counted exactly before scaling


# ---- adapting levels (ALQ, AMQ) ---------------------------------------------------------------------------------
def _sorted_prefix_sums(flat: torch.Tensor, chunk: int) -> tuple:
    """``(r, P)``: the normalised values sorted, and ``P[m, k] = sum_{i<k} w_i r_i^m`` for ``m = 0, 1, 2`` (float64,
    ``(3, n + 1)``), ``w`` each value's weight (:func:`normalised`). The weighted count, mass and second moment of
    the values in any index range ``[i, k)`` are then ``P[:, k] - P[:, i]``: the expected variance over an interval
    of levels is a few lookups, whatever the interval holds."""
    r, w = normalised(flat, chunk)
    r, order = torch.sort(r)
    w = w[order]
    moments = torch.stack([w, w * r, w * r * r])
    return r, torch.cat([moments.new_zeros(3, 1), torch.cumsum(moments, 1)], 1)


def alq_adapt(flat: torch.Tensor, levels: torch.Tensor, chunk: int, sweeps: int) -> torch.Tensor:
    """ALQ's coordinate descent (Faghri et al. 2020, §3.1) on the expected variance of quantizing ``flat``: each
    interior level in turn moves to the minimiser over the data points strictly between its neighbours, when that
    is lower than where it is. Returns the new levels (float64).

    The variance of the values in ``[a, b]`` with one level at ``x`` between, the values below ``x`` (indices
    ``[i_a, k)`` of the sorted values) and the rest (``[k, i_b)``), is
    ``sum_[i_a,k) w (x - r)(r - a) + sum_[k,i_b) w (b - r)(r - x) = C + (a - b) (P1[k] - x P0[k]) + D x`` with
    ``C = P2[i_a] - P2[i_b] - a P1[i_a] + b P1[i_b]`` and ``D = P1[i_b] - P1[i_a] + a P0[i_a] - b P0[i_b]``
    (:func:`_sorted_prefix_sums`; a value equal to ``a``, ``x`` or ``b`` adds zero on either side). So one level's
    step is that line at every data point ``x = r_k`` (``P1[k] - r_k P0[k]`` computed once) and at the level itself,
    a few tensor ops over all candidates at once; the levels go in turn, as coordinate descent does, each from its
    neighbours' latest values."""
    r, P = _sorted_prefix_sums(flat, chunk)
    n = r.shape[0]
    q = P[1, :n] - r * P[0, :n]                 # P1[k] - r_k P0[k], per candidate r_k
    lv = levels.to(device=flat.device, dtype=torch.float64)
    s = lv.shape[0] - 1
    at_level = [torch.arange(s + 1, device=flat.device) == j for j in range(s)]
    outside = torch.full_like(r, math.inf)
    for _ in range(sweeps):
        for j in range(1, s):
            bounds = lv[j - 1:j + 2]                                      # [a, x0, b]
            a, x0, b = bounds[0], bounds[1], bounds[2]
            at = P[:, torch.searchsorted(r, bounds)]                      # (moment, [i_a, k0, i_b])
            u = at[1:] - bounds * at[:-1]            # P1 - y P0 and P2 - y P1 at each bound y's index
            ends = u[:, 0] - u[:, 2]
            minus_d, c, a_b = ends[0], ends[1], a - b
            f = torch.where((r > a) & (r < b), c + a_b * q - minus_d * r, outside)
            best, k = torch.min(f, 0)
            here = c + a_b * u[0, 1] - minus_d * x0
            lv = torch.where(at_level[j], torch.where(best < here, r.take(k), x0), lv)
    return lv


def amq_adapt(flat: torch.Tensor, p: torch.Tensor, s: int, chunk: int, grid: int) -> torch.Tensor:
    """AMQ (Faghri et al. 2020, §3.2): the multiplier among the current one and ``grid`` points evenly inside
    ``(0, 1)`` whose levels ``{0, p^(s-1), ..., 1}`` give the least expected variance on ``flat`` (the current
    one on a tie). Returns a 1-element float64 tensor.

    Every candidate at once: their levels are the rows of a ``(grid + 1, s + 1)`` tensor; each interval
    ``[l_t, l_t+1]`` holds the sorted values ``[i_t, i_t+1)`` and adds
    ``sum w (l_t+1 - r)(r - l_t) = -S2 + (l_t + l_t+1) S1 - l_t l_t+1 S0`` (``S`` from
    :func:`_sorted_prefix_sums`; a value on a level adds zero on either side)."""
    r, P = _sorted_prefix_sums(flat, chunk)
    p = p.to(device=flat.device, dtype=torch.float64).reshape(1)
    cands = torch.cat([p, torch.arange(1, grid + 1, dtype=torch.float64, device=flat.device) / (grid + 1)])
    powers = torch.pow(cands.unsqueeze(1), torch.arange(s - 1, -1, -1, dtype=torch.float64, device=flat.device))
    lv = torch.cat([powers.new_zeros(grid + 1, 1), powers], 1)                    # exponential_levels per row
    sums = P[:, torch.searchsorted(r, lv)].diff(dim=2)                            # (moment, candidate, interval)
    lo, hi = lv[:, :-1], lv[:, 1:]
    var = ((lo + hi) * sums[1] - sums[2] - lo * hi * sums[0]).sum(1)
    return cands.index_select(0, torch.argmin(var).reshape(1))


# ---- the methods --------------------------------------------------------------------------------------------
def _check_int(method: str, option: str, value, lo: int, hi: int | None, why: str, example: int) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        rng = f"an int from {lo} to {hi}" if hi is not None else f"an int >= {lo}"
        raise StrategyError(f"{method}({option}={value!r}): {option} must be {rng} ({why}); pass e.g. "
                            f"{option}={example}")


@dataclass(frozen=True)
class _Quantizer(Method):
    """A stochastic quantizer: subclasses give ``_s()``, ``_bits()`` and ``_levels(state)``."""
    adaptive: ClassVar[bool] = False
    halving: ClassVar[bool] = False      # NUQSGD's fixed levels: each value's interval read from its exponent

    def __post_init__(self):
        self._check_options()

    def _check_options(self) -> None:
        _check_int(type(self).__name__, "bucket", self.bucket, 1, None, "values per chunk sharing one scale",
                   1024)

    def check(self, dp: int) -> None:
        self._check_options()

    def _s(self) -> int:
        raise NotImplementedError

    def _bits(self) -> int:
        raise NotImplementedError

    def _levels(self, state: dict) -> torch.Tensor:
        raise NotImplementedError

    def host_inputs(self, bucket: BucketInfo, step: int, state: dict, variant, gen: torch.Generator) -> list:
        return [torch.rand(bucket.numel, generator=rank_generator(bucket, gen), dtype=bucket.torch_dtype)]

    def sum(self, flat, state, inputs, bucket, comm: Comm, variant) -> tuple:
        levels, n, bits = self._levels(state), flat.shape[0], self._bits()
        buf, idx = encode_with_indices(flat, levels, inputs[0], self.bucket, bits, self.halving)
        everyone = comm.all_gather(buf).view(comm.size, buf.shape[0])
        summed = decode(everyone[0], levels, n, self.bucket, bits, flat.dtype)
        for r in range(1, comm.size):
            summed = summed + decode(everyone[r], levels, n, self.bucket, bits, flat.dtype)
        return summed, {**self._next_state(summed, state, variant), **self._sent_state(idx, n)}

    def _next_state(self, summed, state, variant) -> dict:
        return state

    def _sent_state(self, idx, n: int) -> dict:
        """State entries made from this rank's level indices, the codes it sent (NUQSGD: their Elias bits)."""
        return {}

    def wire_bytes(self, bucket: BucketInfo, variant) -> int:
        return 4 * -(-bucket.numel // self.bucket) + packed_nbytes(bucket.numel, self._bits())

    def describe(self, bucket: BucketInfo, variant) -> list:
        before = bucket.numel * bucket.element_size
        head = (f"{type(self).__name__}: {self._s()} levels a sign, {self._bits()}-bit codes and a float32 norm per "
                f"{self.bucket} values; {before} B -> {self.wire_bytes(bucket, variant)} B per rank, all-gathered")
        if self.adaptive and variant == "adapt":
            head += "; levels adapted to the sum after this step"
        how = (f"each value as a {self._bits()}-bit code (a sign and one of {self._s()} levels) + a float32 norm per "
               f"{self.bucket}-value chunk of the flat bucket")
        return [head] + [f"  {x}" for x in tensor_lines(bucket, how, self.wire_bytes(bucket, variant),
                                                         f"{self._bits()}-bit codes + norm share")]


@register_method
@dataclass(frozen=True)
class QSGD(_Quantizer):
    """QSGD (Alistarh et al., NeurIPS 2017): ``levels`` uniform levels per sign, one L2 norm per ``bucket`` values."""
    name: ClassVar[str] = "qsgd"
    paper: ClassVar[str] = ("Alistarh, Grubic, Li, Tomioka & Vojnovic, QSGD: Communication-Efficient SGD via "
                            "Gradient Quantization and Encoding, NeurIPS 2017")
    levels: int = 16
    bucket: int = 1024

    def _check_options(self) -> None:
        _check_int("QSGD", "levels", self.levels, 1, 127, "a sign and a level travel in at most 8 bits", 16)
        super()._check_options()

    def _s(self) -> int:
        return self.levels

    def _bits(self) -> int:
        return max(1, math.ceil(math.log2(2 * self.levels + 1)))

    def _levels(self, state):
        return uniform_levels(self.levels)


@dataclass(frozen=True)
class _BitsQuantizer(_Quantizer):
    def _check_options(self) -> None:
        _check_int(type(self).__name__, "bits", self.bits, 2, 8,
                   "bits per value, a sign included: 2**(bits-1) - 1 levels per sign", 4)
        super()._check_options()

    def _s(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def _bits(self) -> int:
        return self.bits


@register_method
@dataclass(frozen=True)
class NUQSGD(_BitsQuantizer):
    """NUQSGD (Ramezani-Kebrya et al., JMLR 2021): ``s = 2^(bits-1) - 1`` exponential levels per sign."""
    name: ClassVar[str] = "nuqsgd"
    paper: ClassVar[str] = ("Ramezani-Kebrya, Faghri, Markov, Aksenov, Alistarh & Roy, NUQSGD: Provably "
                            "Communication-efficient Data-parallel SGD via Nonuniform Quantization, JMLR 2021")
    bits: int = 4
    bucket: int = 1024
    halving: ClassVar[bool] = True

    def _levels(self, state):
        return exponential_levels(self._s())

    # ---- the Elias-coded count of what each step sent ----
    def init_state(self, bucket: BucketInfo, gen: torch.Generator) -> dict:
        """``elias_bits``: the Elias-coded bits (:func:`elias_bit_count`'s count) of the codes this rank sent for
        the bucket at its latest step (int64, 0 before the first)."""
        return {"elias_bits": torch.zeros((), dtype=torch.int64)}

    def _sent_state(self, idx, n: int) -> dict:
        return {"elias_bits": elias_bits_of_indices(idx, self._s(), -(-n // self.bucket))}

    def step_record(self, bucket: BucketInfo, state: dict):
        return int(state["elias_bits"])

    def report(self, bucket: BucketInfo, state: dict, records=()) -> dict:
        """``RunResult.features[rank]["nuqsgd"][(stage, bucket)]``: ``elias_bits``, per step the Elias-coded bits of
        the codes this rank sent (the paper's count, §4, from the real codes); ``packed_bits``, the fixed-width bits
        that travel each step; ``elias_over_packed``: their ratio over the run's steps."""
        packed = 8 * self.wire_bytes(bucket, None)
        bits = [int(b) for b in records]
        return {"elias_bits": bits, "packed_bits": packed,
                "elias_over_packed": (sum(bits) / (packed * len(bits))) if bits else None}

    def elias_bits(self, flat: torch.Tensor, u: torch.Tensor) -> int:
        """The bits NUQSGD's Elias-coded message of ``flat`` would take with draws ``u`` (:func:`elias_bit_count`)."""
        return elias_bit_count(flat, self._levels({}), u, self.bucket)

    def expected_elias_bits(self, numel: int) -> int:
        """:meth:`elias_bits` of a bucket of ``numel`` values, estimated on a standard-normal gradient (seed 0, its
        own generator): exact up to :data:`ELIAS_SAMPLE_CHUNKS` chunks; beyond, the per-value bits of that many
        whole chunks scaled to ``numel`` plus 32 bits per chunk of the bucket."""
        gen = torch.Generator().manual_seed(0)
        sample = min(numel, ELIAS_SAMPLE_CHUNKS * self.bucket)
        g = torch.randn(sample, generator=gen, dtype=torch.float64)
        u = torch.rand(sample, generator=gen, dtype=torch.float64)
        bits = self.elias_bits(g, u)
        if sample == numel:
            return bits
        per_value = (bits - 32 * -(-sample // self.bucket)) / sample
        return int(round(per_value * numel)) + 32 * -(-numel // self.bucket)

    def describe(self, bucket: BucketInfo, variant) -> list:
        lines = super().describe(bucket, variant)
        est = self.expected_elias_bits(bucket.numel)
        fixed = 8 * self.wire_bytes(bucket, variant)
        return lines[:1] + [
            f"  Elias-coded (the paper's count, §4: a 32-bit norm per chunk, per value the Elias omega code of its "
            f"level index + 1 and a sign bit where nonzero): about {est} bits ({-(-est // 8)} B, "
            f"{est / fixed:.3g}x the {fixed} bits sent), estimated on a standard-normal gradient of "
            f"{bucket.numel} values (seed 0); the packed fixed-width codes are what travels; the run counts it per "
            "step from the codes each rank sent: RunResult.features[rank]['nuqsgd'][(stage, bucket)]"] + lines[1:]


@dataclass(frozen=True)
class _Adaptive(_BitsQuantizer):
    adaptive: ClassVar[bool] = True

    def _check_options(self) -> None:
        _check_int(type(self).__name__, "update_every", self.update_every, 1, None, "steps between level updates",
                   100)
        super()._check_options()

    def variant(self, bucket: BucketInfo, step: int, state: dict):
        return "adapt" if step % self.update_every == 0 else "fixed"


@register_method
@dataclass(frozen=True)
class ALQ(_Adaptive):
    """ALQ (Faghri et al., NeurIPS 2020): ``2^(bits-1) - 1`` levels per sign, initialised exponentially (NUQSGD's)
    and moved by ``sweeps`` rounds of coordinate descent on the sum every ``update_every`` steps."""
    name: ClassVar[str] = "alq"
    paper: ClassVar[str] = ("Faghri, Tabrizian, Markov, Alistarh, Roy & Ramezani-Kebrya, Adaptive Gradient "
                            "Quantization for Data-Parallel SGD, NeurIPS 2020 (ALQ)")
    bits: int = 3
    bucket: int = 1024
    update_every: int = 100
    sweeps: int = 4

    def _check_options(self) -> None:
        _check_int("ALQ", "sweeps", self.sweeps, 1, None, "coordinate-descent rounds per update", 4)
        super()._check_options()

    def init_state(self, bucket, gen) -> dict:
        return {"levels": exponential_levels(self._s())}

    def _levels(self, state):
        return state["levels"]

    def _next_state(self, summed, state, variant):
        if variant != "adapt":
            return state
        return {"levels": alq_adapt(summed, state["levels"], self.bucket, self.sweeps)}


@register_method
@dataclass(frozen=True)
class AMQ(_Adaptive):
    """AMQ (Faghri et al., NeurIPS 2020): levels ``{0, p^(s-1), ..., p, 1}``, ``s = 2^(bits-1) - 1``, the
    multiplier ``p`` (from ``multiplier``) chosen on the sum every ``update_every`` steps among the current one and
    ``grid`` evenly spaced values in (0, 1)."""
    name: ClassVar[str] = "amq"
    paper: ClassVar[str] = ("Faghri, Tabrizian, Markov, Alistarh, Roy & Ramezani-Kebrya, Adaptive Gradient "
                            "Quantization for Data-Parallel SGD, NeurIPS 2020 (AMQ)")
    bits: int = 3
    bucket: int = 1024
    update_every: int = 100
    multiplier: float = 0.5
    grid: int = 19

    def _check_options(self) -> None:
        m = self.multiplier
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < 1:
            raise StrategyError(f"AMQ(multiplier={m!r}): multiplier must be a number in (0, 1), the ratio between "
                                "consecutive levels; pass e.g. multiplier=0.5 (NUQSGD's levels)")
        _check_int("AMQ", "grid", self.grid, 1, None, "candidate multipliers tried per update", 19)
        super()._check_options()

    def init_state(self, bucket, gen) -> dict:
        return {"multiplier": torch.tensor([float(self.multiplier)], dtype=torch.float64)}

    def _levels(self, state):
        return exponential_levels(self._s(), state["multiplier"])

    def _next_state(self, summed, state, variant):
        if variant != "adapt":
            return state
        return {"multiplier": amq_adapt(summed, state["multiplier"], self._s(), self.bucket, self.grid)}
