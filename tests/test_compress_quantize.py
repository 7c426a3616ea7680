"""Stochastic quantizers (QSGD, NUQSGD, ALQ, AMQ) and Wangni sparsification.

Math on tensors, float64: unbiased (the mean of N draws within 5 standard errors of the input, per value, the
standard errors from the draws), the empirical variance against the exact expected variance and the paper's bound,
AMQ at 1/2 = NUQSGD, ALQ/AMQ never raise the variance they adapt to, QSGD's distance to the plain sum. Then each
method's ``sum`` on every rank of a gloo group (traced with ``make_fx`` and run, or eager), against the same math
in one process from the same draws, and the bytes the rank hands to the collective against ``wire_bytes``. Then
each method in a program (``parallelize(...).run_local``, dp=2) against the same math in one process.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fxpar
from fxpar import compress as C

from fxpar.collectives import C10D
from fxpar.compress.feature import bucket_infos
from fxpar.compress.method import Comm
from fxpar.compress import quantize as quantize_module
from fxpar.compress.packing import pack_bits, unpack_bits
from fxpar.compress.quantize import (ALQ, AMQ, NUQSGD, QSGD, alq_adapt, amq_adapt, decode, elias_bit_count,
                                     encode, expected_variance, exponential_levels, halving_intervals, level_indices,
                                     normalised, nuqsgd_variance_bound, qsgd_variance_bound,
                                     quantize_dequantize, uniform_levels)
from fxpar.compress.wangni import Wangni, capacity, densify, sparsify, wangni_probabilities
from fxpar.errors import StrategyError
from fxpar.testing import MLP
from fxpar.testing.compress import (adaptive_variance, alq_reference, amq_reference, elias_bits_of_message,
                                    nuqsgd_reference)
from fxpar.testing.compress_ranks import bucket_for, sum_steps, training_reference

N_DRAWS = 20000
Z = 5.0          # the CLT bound: 5 standard errors


def _data(d=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(d, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3.0, d, dtype=torch.float64)
    v[::7] = 0
    return v


def _draws(v, levels, chunk, bits, n=N_DRAWS, seed=1):
    """``n`` independent Q(v), as rows (v's length a multiple of ``chunk``, so every row has v's chunks)."""
    u = torch.rand(n * v.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return quantize_dequantize(v.repeat(n), levels, u, chunk, bits).view(n, -1)


def _assert_unbiased_with_variance(q, v, exact_var):
    n = q.shape[0]
    mean, se = q.mean(0), q.std(0) / math.sqrt(n)
    fixed = se == 0                                  # values every draw gives the same: exactly the input
    assert torch.equal(q[:, fixed], v[fixed].expand(n, -1))
    assert bool(((mean - v).abs() <= Z * se)[~fixed].all()), ((mean - v).abs() / se)[~fixed].max()
    sq = ((q - v) ** 2).sum(1)
    assert abs(sq.mean() - exact_var) <= Z * sq.std() / math.sqrt(n)


# ---- options ------------------------------------------------------------------------------------------------
BAD = [
    (lambda: QSGD(levels=0), r"QSGD\(levels=0\): levels must be an int from 1 to 127"),
    (lambda: QSGD(levels=128), r"QSGD\(levels=128\): levels must be an int from 1 to 127"),
    (lambda: QSGD(bucket=0), r"QSGD\(bucket=0\): bucket must be an int >= 1"),
    (lambda: NUQSGD(bits=1), r"NUQSGD\(bits=1\): bits must be an int from 2 to 8"),
    (lambda: NUQSGD(bits=9), r"NUQSGD\(bits=9\): bits must be an int from 2 to 8"),
    (lambda: NUQSGD(bucket=-4), r"NUQSGD\(bucket=-4\): bucket must be an int >= 1"),
    (lambda: ALQ(bits=0), r"ALQ\(bits=0\): bits must be an int from 2 to 8"),
    (lambda: ALQ(update_every=0), r"ALQ\(update_every=0\): update_every must be an int >= 1"),
    (lambda: AMQ(bits=12), r"AMQ\(bits=12\): bits must be an int from 2 to 8"),
    (lambda: AMQ(multiplier=1.0), r"AMQ\(multiplier=1.0\): multiplier must be a number in \(0, 1\)"),
    (lambda: Wangni(ratio=0), r"Wangni\(ratio=0\): ratio .* must be in \(0, 1\]"),
    (lambda: Wangni(ratio=1.5), r"Wangni\(ratio=1.5\): ratio .* must be in \(0, 1\]"),
    (lambda: Wangni(ratio=-0.01), r"Wangni\(ratio=-0.01\): ratio .* must be in \(0, 1\]"),
]


@pytest.mark.structure
@pytest.mark.parametrize("make,msg", BAD, ids=[m for _, m in BAD])
def test_bad_options_name_the_option_and_the_range(make, msg):
    with pytest.raises(StrategyError, match=msg):
        make()


@pytest.mark.structure
def test_code_widths_and_levels():
    assert QSGD(levels=16)._bits() == 6 and QSGD(levels=15)._bits() == 5 and QSGD(levels=1)._bits() == 2
    assert QSGD(levels=127)._bits() == 8
    assert NUQSGD(bits=4)._s() == 7
    assert torch.equal(NUQSGD(bits=4)._levels({}), torch.tensor([0] + [2.0 ** (j - 7) for j in range(1, 8)],
                                                                    dtype=torch.float64))
    assert torch.equal(uniform_levels(4), torch.tensor([0, 0.25, 0.5, 0.75, 1], dtype=torch.float64))


@pytest.mark.structure
def test_amq_at_one_half_has_nuqsgd_levels():
    v = _data(64)
    u = torch.rand(64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for bits in range(2, 9):
        amq, nuq = AMQ(bits=bits, multiplier=0.5), NUQSGD(bits=bits)
        lv = amq._levels(amq.init_state(bucket_for(64, "float64", 2), torch.Generator()))
        assert torch.equal(lv, nuq._levels({}))
        assert torch.equal(quantize_dequantize(v, lv, u, 16, bits),
                           quantize_dequantize(v, nuq._levels({}), u, 16, bits))


METHODS = [QSGD(levels=16, bucket=32), NUQSGD(bits=4, bucket=32), ALQ(bits=3, bucket=32, update_every=2),
           AMQ(bits=3, bucket=32, update_every=2), Wangni(ratio=0.1)]


@pytest.mark.structure
@pytest.mark.parametrize("method", METHODS, ids=lambda m: type(m).__name__)
def test_traced_sum_is_one_gather_of_wire_bytes(method):
    numel = 101
    b = bucket_for(numel, "float64", 4, 1)
    state = method.init_state(b, torch.Generator().manual_seed(0))
    for step in (0, 1):
        variant = method.variant(b, step, state)
        inputs = method.host_inputs(b, step, state, variant, torch.Generator().manual_seed(1))
        gm = make_fx(lambda f, s, i: method.sum(f, s, i, b, Comm(4, 1), variant), tracing_mode="fake")(
            torch.zeros(numel, dtype=torch.float64), state, inputs)
        colls = [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
                 and n.target.namespace == "_c10d_functional" and n.target is not C10D.wait_tensor.default]
        assert [n.target for n in colls] == [C10D.all_gather_into_tensor.default]
        sent = colls[0].args[0].meta["val"]
        assert sent.dtype == torch.uint8 and sent.numel() == method.wire_bytes(b, variant)
        assert colls[0].args[2] == "fxpar:dp"
        assert method.describe(b, variant)


@pytest.mark.structure
def test_wire_bytes_formulas():
    b = bucket_for(1000, "float32", 4)
    assert QSGD(levels=16, bucket=256).wire_bytes(b, None) == 4 * 4 + math.ceil(1000 * 6 / 8)
    assert NUQSGD(bits=4, bucket=1024).wire_bytes(b, None) == 4 + 500
    assert ALQ(bits=3, bucket=100).wire_bytes(b, "adapt") == 40 + 375
    assert Wangni(ratio=0.01).wire_bytes(b, None) == 10 * (4 + 4)
    assert capacity(1001, 0.01) == 11 and capacity(5, 0.01) == 1


@pytest.mark.structure
@pytest.mark.parametrize("method", [QSGD(), Wangni()], ids=["quantizers", "wangni"])
def test_each_rank_draws_its_own_from_one_shared_stream(method):
    """The runtime's generator is the same on every rank: the draws differ by rank, the streams advance alike."""
    b0, b1 = bucket_for(300, "float64", 2, 0), bucket_for(300, "float64", 2, 1)
    g0, g1 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    u0, u1 = method.host_inputs(b0, 0, {}, None, g0)[0], method.host_inputs(b1, 0, {}, None, g1)[0]
    assert not torch.equal(u0, u1) and torch.equal(g0.get_state(), g1.get_state())
    assert not torch.equal(u0, method.host_inputs(b0, 1, {}, None, g0)[0])      # and by step


@pytest.mark.structure
def test_elias_bit_count_by_hand():
    # one chunk [3, 0, -4] (norm 5): r = 0.6, 0, 0.8 on levels {0, 1/4, 1/2, 1}; u = 0 rounds every value up
    v = torch.tensor([3.0, 0.0, -4.0], dtype=torch.float64)
    idx = level_indices(normalised(v, 4)[0], exponential_levels(3), torch.zeros(3, dtype=torch.float64))
    assert idx.tolist() == [3, 0, 3]
    # 32 (norm) + omega(4) + 1 sign + omega(1) + omega(4) + 1 sign = 32 + 6 + 1 + 1 + 6 + 1
    assert elias_bit_count(v, exponential_levels(3), torch.zeros(3, dtype=torch.float64), 4) == 47
    assert NUQSGD(bits=3, bucket=4).elias_bits(v, torch.zeros(3, dtype=torch.float64)) == 47


# ---- math on tensors ----------------------------------------------------------------------------------------------
@pytest.mark.numerics
@pytest.mark.parametrize("s", [1, 4, 16])
def test_qsgd_unbiased_within_lemma_3_1(s):
    v, chunk = _data(), 16
    levels = uniform_levels(s)
    q = _draws(v, levels, chunk, QSGD(levels=s)._bits())
    exact = expected_variance(v, levels, chunk)
    _assert_unbiased_with_variance(q, v, exact)
    assert ((q - v) ** 2).sum(1).mean() <= qsgd_variance_bound(v, s, chunk)
    assert exact <= qsgd_variance_bound(v, s, chunk)


@pytest.mark.numerics
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_nuqsgd_unbiased_within_its_bound(bits):
    v, chunk = _data(), 16
    m = NUQSGD(bits=bits, bucket=chunk)
    q = _draws(v, m._levels({}), chunk, bits)
    exact = expected_variance(v, m._levels({}), chunk)
    _assert_unbiased_with_variance(q, v, exact)
    assert ((q - v) ** 2).sum(1).mean() <= nuqsgd_variance_bound(v, m._s(), chunk)
    assert exact <= nuqsgd_variance_bound(v, m._s(), chunk)


@pytest.mark.numerics
def test_alq_and_amq_unbiased_on_their_adapted_levels():
    v, chunk = _data(), 16
    alq = alq_adapt(v, exponential_levels(3), chunk, sweeps=4)
    amq = exponential_levels(3, amq_adapt(v, torch.tensor([0.5], dtype=torch.float64), 3, chunk, grid=19))
    for levels in (alq, amq):
        assert levels[0] == 0 and levels[-1] == 1 and bool((levels[1:] > levels[:-1]).all())
        q = _draws(v, levels, chunk, 3)
        exact = expected_variance(v, levels, chunk)
        _assert_unbiased_with_variance(q, v, exact)
        # every value's variance is at most a quarter of its interval squared
        assert exact <= (normalised(v, chunk)[1] * (levels.diff().max() ** 2) / 4).sum()


def _adapt_inputs():
    """Small buckets of several shapes of data (exact zeros, a chunk of one value, a heavy tail), with the bits,
    chunk and sweeps to adapt them at."""
    g = torch.Generator().manual_seed(23)
    normal = torch.randn(150, generator=g, dtype=torch.float64)
    normal[::9] = 0
    uniform = torch.rand(130, generator=g, dtype=torch.float64) - 0.5
    sparse = torch.randn(160, generator=g, dtype=torch.float64) * (torch.rand(160, generator=g, dtype=torch.float64) < 0.3)
    heavy = torch.log(torch.rand(121, generator=g, dtype=torch.float64)) * torch.sign(
        torch.randn(121, generator=g, dtype=torch.float64))
    return [(normal, 2, 40, 1), (normal, 3, 40, 3), (uniform, 4, 64, 2), (sparse, 3, 32, 2), (heavy, 4, 30, 3),
            (uniform, 3, 130, 4)]


@pytest.mark.structure
@pytest.mark.parametrize("case", range(6))
def test_adaptation_equals_the_papers_update_one_candidate_at_a_time(case):
    """ALQ's and AMQ's adaptation (each level's candidates, and AMQ's multipliers, as one tensor) equal the papers'
    update (Faghri et al. 2020, §3.1-3.2) written as plain loops over Python floats (``fxpar.testing.compress``): the
    same levels and multiplier, and their variance to float64 rounding."""
    flat, bits, chunk, sweeps = _adapt_inputs()[case]
    s = 2 ** (bits - 1) - 1
    r, w = (x.tolist() for x in normalised(flat, chunk))
    init = exponential_levels(s)
    got = alq_adapt(flat, init, chunk, sweeps)
    want = alq_reference(r, w, init.tolist(), sweeps)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    assert not torch.equal(got, init) or s == 1          # the update moved a level
    assert math.isclose(float(expected_variance(flat, got, chunk)), adaptive_variance(r, w, want), rel_tol=1e-12)
    for p0 in (0.5, 0.37):
        p = amq_adapt(flat, torch.tensor([p0], dtype=torch.float64), s, chunk, grid=19)
        want_p = amq_reference(r, w, p0, s, 19)
        torch.testing.assert_close(p, torch.tensor([want_p], dtype=torch.float64), rtol=1e-12, atol=0)
        levels = [0.0] + [want_p ** k for k in range(s - 1, -1, -1)]
        assert math.isclose(float(expected_variance(flat, exponential_levels(s, p), chunk)),
                            adaptive_variance(r, w, levels), rel_tol=1e-12)


@pytest.mark.structure
def test_amqs_traced_adaptation_does_not_grow_with_its_grid():
    """AMQ's candidates are one tensor: the traced adaptation has as many nodes for 99 candidates as for 3."""
    flat, p = torch.zeros(500, dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64)
    sizes = [len(make_fx(lambda f, q: amq_adapt(f, q, 3, 64, grid), tracing_mode="fake")(flat, p).graph.nodes)
             for grid in (3, 99)]
    assert sizes[0] == sizes[1], sizes


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["normal", "laplace", "sparse", "uniform"])
def test_adapted_levels_never_raise_the_variance_they_adapt_to(kind):
    g = torch.Generator().manual_seed(11)
    v = {"normal": lambda: torch.randn(4096, generator=g, dtype=torch.float64),
         "laplace": lambda: torch.log(torch.rand(4096, generator=g, dtype=torch.float64)) * torch.sign(
             torch.randn(4096, generator=g, dtype=torch.float64)),
         "sparse": lambda: torch.randn(4096, generator=g, dtype=torch.float64) * (
             torch.rand(4096, generator=g, dtype=torch.float64) < 0.05),
         "uniform": lambda: torch.rand(4096, generator=g, dtype=torch.float64) - 0.5}[kind]()
    for bits in (2, 3, 4):
        s = 2 ** (bits - 1) - 1
        init = exponential_levels(s)
        before = expected_variance(v, init, 512)
        after_one = expected_variance(v, alq_adapt(v, init, 512, sweeps=1), 512)
        after = expected_variance(v, alq_adapt(v, init, 512, sweeps=4), 512)
        assert after <= after_one <= before
        p = amq_adapt(v, torch.tensor([0.5], dtype=torch.float64), s, 512, grid=19)
        assert expected_variance(v, exponential_levels(s, p), 512) <= before
    if kind == "uniform":          # values spread evenly: adapting must move the levels and gain
        assert after < 0.9 * before


@pytest.mark.numerics
def test_qsgd_approaches_the_plain_sum():
    """Per value, |Q(v)_i - v_i| <= S_c / s (a level step; S_c the chunk's float32 scale), so the sum over ranks errs
    by at most sum_r S_rc / s; in mean square by sum_r min(n/s^2, sqrt(n)/s) ||v_r||^2 (Lemma 3.1)."""
    g = torch.Generator().manual_seed(5)
    vs = [torch.randn(256, generator=g, dtype=torch.float64) / 4 for _ in range(4)]
    errs = []
    for s in (8, 32, 127):
        u = [torch.rand(256, generator=g, dtype=torch.float64) for _ in vs]
        total = sum(quantize_dequantize(v, uniform_levels(s), ui, 64, QSGD(levels=s)._bits()) for v, ui in zip(vs, u))
        err = total - sum(vs)
        step = sum(torch.linalg.vector_norm(v.view(4, 64), dim=1).to(torch.float32).to(torch.float64) for v in vs) / s
        bound = step.repeat_interleave(64) * (1 + 2.0 ** -23)
        assert bool((err.abs() <= bound).all())
        errs.append(err.abs().max().item())
    assert errs[2] < errs[1] < errs[0]


@pytest.mark.numerics
def test_wangni_probabilities_are_algorithm_3():
    g = _data(200, seed=4) ** 3                      # heavy-tailed: some values saturate at p = 1
    for ratio in (0.05, 0.2, 0.5):
        p = wangni_probabilities(g, ratio, iters=4)
        assert p.sum() <= ratio * 200 * (1 + 1e-12) and p.sum() >= 0.99 * ratio * 200
        assert bool((p[g == 0] == 0).all()) and bool(((p > 0) & (p <= 1)).eq(g != 0).all())
        free = (p < 1) & (g != 0)
        lam = p[free] / g[free].abs()                # p_i = lambda |g_i| below saturation
        assert torch.allclose(lam, lam[0].expand_as(lam), rtol=1e-12, atol=0)
        assert bool((g[p == 1].abs() >= g[free].abs().max()).all())


@pytest.mark.numerics
def test_wangni_unbiased_and_never_over_capacity():
    g, ratio, n = _data(64, seed=2), 0.25, 4000
    p = wangni_probabilities(g, ratio, iters=2)
    k = capacity(64, ratio)
    u = torch.rand(n, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    q, counts = [], []
    for i in range(n):
        vals, idx = sparsify(g, p, u[i:i + 1], k)
        counts.append(int((vals != 0).sum()))
        q.append(densify(vals, idx, 64))
    q = torch.stack(q)
    exact = (g[p > 0] ** 2 * (1 / p[p > 0] - 1)).sum()          # Wangni et al. eq. 4
    _assert_unbiased_with_variance(q, g, exact)
    assert max(counts) <= k and abs(sum(counts) / n - p.sum().item()) <= 1.0
    # every kept value is g_i / p_i at its own index
    vals, idx = sparsify(g, p, u[:1], k)
    kept = vals != 0
    assert torch.equal(vals[kept], g[idx[kept].long()] / p[idx[kept].long()])


def _reference_probabilities(g, ratio, iters):
    """Algorithm 3 written with a select per masked value, as the paper states it."""
    a = g.abs()
    target = ratio * g.shape[0]
    l1 = a.sum()
    p = torch.where(l1 > 0, torch.clamp(target * a / torch.where(l1 > 0, l1, torch.ones_like(l1)), max=1.0),
                    torch.zeros_like(a))
    for _ in range(iters):
        active = p < 1
        mass = torch.where(active, p, torch.zeros_like(p)).sum()
        budget = target - (g.shape[0] - active.sum())
        c = torch.where(mass > 0, budget / torch.where(mass > 0, mass, torch.ones_like(mass)), torch.ones_like(mass))
        c = torch.clamp(c, min=1.0)
        p = torch.where(active, torch.clamp(c * p, max=1.0), p)
    return p


def _reference_sparsify(g, p, u, k):
    """Systematic sampling written with a select per masked value: only kept values and indices are scattered."""
    u = u.to(dtype=torch.float64)
    cum = torch.clamp(torch.cumsum(p.to(torch.float64), 0), max=float(k))
    hits = torch.floor(cum + u)
    keep = hits > torch.cat([torch.floor(u), hits[:-1]])
    slot = torch.where(keep, hits.to(torch.int64) - 1, torch.full_like(hits, k, dtype=torch.int64))
    safe_p = torch.where(keep, p, torch.ones_like(p))
    vals = g.new_zeros(k + 1).scatter(0, slot, torch.where(keep, g / safe_p, torch.zeros_like(g)))
    where = torch.arange(g.shape[0], dtype=torch.int64)
    idx = slot.new_zeros(k + 1).scatter(0, slot, torch.where(keep, where, torch.zeros_like(slot)))
    return vals[:k], idx[:k].to(torch.int32)


def _bits(t):
    """``t``'s bits as integers: equal bits, NaN against NaN and -0.0 against 0.0 included."""
    return t.view({torch.float64: torch.int64, torch.float32: torch.int32}.get(t.dtype, t.dtype))


@pytest.mark.numerics
def test_wangni_is_bitwise_the_select_per_value_form():
    """``wangni_probabilities`` and ``sparsify`` give the bits of the form with a select per masked value (which
    they avoid: arithmetic where it is equal), on random, heavy-tailed (saturated p), all-zero, signed-zero, tied,
    subnormal, inf and NaN buckets, both dtypes, ratios up to 1, and uniforms at 0 and just below 1."""
    gen = torch.Generator().manual_seed(11)
    n = 3000
    cases = {"normal": torch.randn(n, generator=gen, dtype=torch.float64),
             "heavy": torch.randn(n, generator=gen, dtype=torch.float64) ** 5,
             "zeros": torch.zeros(n, dtype=torch.float64),
             "signed zeros": torch.where(torch.rand(n, generator=gen) < 0.5, -0.0, 0.0).to(torch.float64),
             "ties": torch.randint(-2, 3, (n,), generator=gen).to(torch.float64),
             "one value": torch.zeros(n, dtype=torch.float64).index_fill(0, torch.tensor([17]), -3.0),
             "subnormal": torch.randn(n, generator=gen, dtype=torch.float64) * 1e-310,
             "inf": torch.randn(n, generator=gen, dtype=torch.float64).index_fill(0, torch.tensor([5, 900]),
                                                                                   -math.inf),
             "nan": torch.randn(n, generator=gen, dtype=torch.float64).index_fill(0, torch.tensor([1200]),
                                                                                   math.nan)}
    cases["one value"][40:60] = -0.0
    uniforms = [torch.zeros(1, dtype=torch.float64), torch.tensor([1 - 2.0 ** -53], dtype=torch.float64),
                torch.rand(1, generator=gen, dtype=torch.float64)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # as each rank runs
    try:
        _compare_wangni_forms(cases, uniforms, n)
    finally:
        torch.set_num_threads(threads)


def _compare_wangni_forms(cases, uniforms, n):
    checked = 0
    for name, g64 in cases.items():
        for g in (g64, g64.to(torch.float32)):
            for ratio in (0.01, 0.3, 1.0):
                for iters in (0, 3):
                    p = wangni_probabilities(g, ratio, iters)
                    ref = _reference_probabilities(g, ratio, iters)
                    assert p.dtype == ref.dtype and torch.equal(_bits(p), _bits(ref)), (name, g.dtype, ratio, iters)
                    k = capacity(n, ratio)
                    for u in uniforms:
                        got, want = sparsify(g, ref, u, k), _reference_sparsify(g, ref, u, k)
                        assert torch.equal(_bits(got[0]), _bits(want[0])), (name, g.dtype, ratio, iters, u)
                        assert torch.equal(got[1], want[1]), (name, g.dtype, ratio, iters, u)
                        checked += int(want[1].ne(0).sum())
    assert checked > 5000          # the cases keep values: the slots are compared, not only the zeros after them


def _reference_encode(flat, levels, u, chunk, bits):
    """:func:`encode` with the sign put on each level index by a select."""
    n, s = flat.shape[0], levels.shape[0] - 1
    v = quantize_module._chunks(flat, chunk)
    scale32 = quantize_module._scales(v)
    scale = scale32.to(flat.dtype).unsqueeze(1)
    r = torch.where(scale > 0, v.abs() / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(v))
    idx = level_indices(r.reshape(-1)[:n], levels.to(dtype=flat.dtype), u)
    return torch.cat([scale32.view(torch.uint8), pack_bits(s + torch.where(flat < 0, -idx, idx), bits)])


@pytest.mark.numerics
def test_encode_and_decode_sign_bitwise_as_a_select():
    """``encode`` signs each level index, and ``decode`` each level, as ``where(x < 0, -y, y)`` would, bit for bit
    (zeros, signed zeros, zero levels, an underflowed level, inf and NaN values included), for each quantizer's
    levels and both dtypes."""
    gen = torch.Generator().manual_seed(3)
    n, chunk, bits = 4096, 512, 4
    s = 2 ** (bits - 1) - 1
    for levels in (uniform_levels(s), exponential_levels(s), exponential_levels(s, 1e-300),
                   alq_adapt(torch.randn(n, generator=gen, dtype=torch.float64), exponential_levels(s), chunk, 2)):
        for dtype in (torch.float64, torch.float32):
            flat = torch.randn(n, generator=gen, dtype=dtype)
            flat[:chunk] = 0.0
            flat[chunk:chunk + 7] = -0.0
            flat[2 * chunk + 3], flat[3 * chunk + 5], flat[4 * chunk + 1] = -math.inf, math.nan, -math.nan
            u = torch.rand(n, generator=gen, dtype=dtype)
            buf = encode(flat, levels, u, chunk, bits)
            assert torch.equal(buf, _reference_encode(flat, levels, u, chunk, bits))
            m = -(-n // chunk)
            signed = unpack_bits(buf[4 * m:], bits, n).to(torch.int64) - s
            mag = levels.to(dtype)[signed.abs()]
            scale = buf[:4 * m].clone().view(torch.float32).to(dtype)
            want = (torch.where(signed < 0, -mag, mag).view(m, chunk) * scale.unsqueeze(1)).reshape(-1)
            assert bool((signed < 0).any()) and bool((mag == 0).any())
            assert torch.equal(_bits(decode(buf, levels, n, chunk, bits, dtype)), _bits(want))


# ---- on the ranks ---------------------------------------------------------------------------------------------------
def _bucket_math(method, infos, flats, states, draws, variant):
    """One bucket summed over the ranks by the method's math in one process: each rank's estimate from its own
    draws, added in rank order; the adapted levels (ALQ, AMQ) from that sum. Returns (sum, states per rank)."""
    numel = flats[0].shape[0]
    if isinstance(method, Wangni):
        total, k = torch.zeros(numel, dtype=flats[0].dtype), capacity(numel, method.ratio)
        for f, d in zip(flats, draws):
            total = densify(*sparsify(f, wangni_probabilities(f, method.ratio, method.iters), d[0], k), numel,
                            into=total)
        return total, states
    levels, bits = method._levels(states[0]), method._bits()
    parts = [quantize_dequantize(f, levels, d[0], method.bucket, bits) for f, d in zip(flats, draws)]
    if isinstance(method, NUQSGD):      # each rank's state: the Elias bits of its message, counted from its codes
        states = [{"elias_bits": torch.tensor(elias_bits_of_message(encode(f, levels, d[0], method.bucket, bits), numel,
                                                                    method.bucket, bits, method._s()))}
                  for f, d in zip(flats, draws)]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    if variant == "adapt" and isinstance(method, ALQ):
        states = [{"levels": alq_adapt(total, states[0]["levels"], method.bucket, method.sweeps)}] * len(flats)
    elif variant == "adapt":
        states = [{"multiplier": amq_adapt(total, states[0]["multiplier"], method._s(), method.bucket,
                                           method.grid)}] * len(flats)
    return total, states


def _reference(method, records_by_rank, numel):
    """The method's sum and state per step, in one process, from each rank's data and draws."""
    dp = len(records_by_rank)
    infos = [bucket_for(numel, "float64", dp, r) for r in range(dp)]
    states = [method.init_state(b, torch.Generator().manual_seed(0)) for b in infos]
    out = []
    for step in range(len(records_by_rank[0])):
        recs = [rr[step] for rr in records_by_rank]
        total, states = _bucket_math(method, infos, [r["flat"] for r in recs], states, [r["inputs"] for r in recs],
                                     recs[0]["variant"])
        out.append((total, [{k: v.clone() for k, v in st.items()} for st in states]))
    return out


def _check_on_ranks(method, records_by_rank, numel):
    dp = len(records_by_rank)
    ref = _reference(method, records_by_rank, numel)
    for step, (total, states) in enumerate(ref):
        for rr, state in zip(records_by_rank, states):
            rec = rr[step]
            assert torch.equal(rec["summed"], total), (step, (rec["summed"] - total).abs().max())
            assert rec["state"].keys() == state.keys() and all(torch.equal(rec["state"][k], state[k]) for k in state)
            assert rec["calls"] == [("all_gather", method.wire_bytes(bucket_for(numel, "float64", dp), rec["variant"]))]
        plain = sum(rr[step]["flat"] for rr in records_by_rank)
        assert not torch.equal(total, plain)          # compressed: not the plain sum
    return ref


@pytest.mark.numerics
@pytest.mark.parametrize("method", [m if not isinstance(m, (ALQ, AMQ)) else pytest.param(m, marks=pytest.mark.slow)
                                    for m in METHODS], ids=lambda m: type(m).__name__)
def test_traced_sum_on_two_ranks_equals_the_same_math(clusters, method):
    numel = 101
    records = clusters.get(2).run(sum_steps, [(method, numel, "float64", 3, True)] * 2)
    _check_on_ranks(method, records, numel)
    if isinstance(method, (ALQ, AMQ)):
        assert [r["variant"] for r in records[0]] == ["adapt", "fixed", "adapt"]
        key = "levels" if isinstance(method, ALQ) else "multiplier"
        init = method.init_state(bucket_for(numel, "float64", 2), torch.Generator())[key]
        assert not torch.equal(records[0][0]["state"][key], init)


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("method", [QSGD(levels=4, bucket=16), Wangni(ratio=0.05), NUQSGD(bits=3, bucket=64)],
                         ids=lambda m: type(m).__name__)
def test_eager_sum_on_four_ranks_equals_the_same_math(clusters, method):
    numel = 130
    records = clusters.get(4).run(sum_steps, [(method, numel, "float64", 2, False)] * 4)
    _check_on_ranks(method, records, numel)


@pytest.mark.numerics
def test_qsgd_many_levels_on_ranks_within_the_level_step(clusters):
    numel, method = 200, QSGD(levels=127, bucket=50)
    records = clusters.get(2).run(sum_steps, [(method, numel, "float64", 1, True)] * 2)
    flats = [rr[0]["flat"] for rr in records]
    step = sum(torch.linalg.vector_norm(f.view(4, 50), dim=1).to(torch.float32).to(torch.float64) for f in flats) / 127
    err = records[0][0]["summed"] - (flats[0] + flats[1])
    assert bool((err.abs() <= step.repeat_interleave(50) * (1 + 2.0 ** -23)).all())


# ---- in a program: fxpar.parallelize(...).run_local(...) -------------------------------------------------------------
SGD = (torch.optim.SGD, {"lr": 0.1})


def _model(layers=3):
    torch.manual_seed(0)
    return MLP(layers=layers).double()


def _batches(n, batch=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 16, dtype=torch.float64, generator=g),
             torch.randn(batch, 8, dtype=torch.float64, generator=g)) for _ in range(n)]


def _program(model, batches, **strategy):
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(strategy["dp"]), batches[0], loss_fn=F.mse_loss,
                             optimizer=SGD, strategy=fxpar.Strategy(**strategy))


PROGRAM_METHODS = [QSGD(levels=8, bucket=64), NUQSGD(bits=3, bucket=64), ALQ(bits=3, bucket=64, update_every=2),
                   AMQ(bits=3, bucket=64, update_every=2), Wangni(ratio=0.2)]


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("method", PROGRAM_METHODS, ids=lambda m: type(m).__name__)
def test_program_at_dp2_matches_the_methods_math(clusters, method):
    """Training at dp=2 equals the method's math in one process (same draws: the runtime's generator per rank) to
    1e-10; each bucket is one all-gather of ``wire_bytes`` per step, measured on each rank."""
    model, batches = _model(), _batches(4)
    prog = _program(model, batches, dp=2, bucket_cap_mb=0.004, grad_sync=method)
    infos = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    assert len(infos) >= 2
    wire = [method.wire_bytes(b, None) for b in infos]
    assert [r["collectives"] for r in prog.plan.section(method.name).stages[0]] == [[["all_gather", w]] for w in wire]
    res = prog.run_local(batches, cluster=clusters.get(2), measure_comm=True)
    losses, state = training_reference(model, batches, F.mse_loss, 0.1, method, infos, _bucket_math)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    got = res.state_dict()
    for k, v in state.items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-10, msg=k)
    for r in range(2):
        assert res.comm_calls[r] == [[("all_gather", w) for w in wire]] * len(batches)
    plain = _program(model, batches, dp=2, bucket_cap_mb=0.004).run_local(batches, cluster=clusters.get(2))
    assert max((got[k] - v).abs().max().item() for k, v in plain.state_dict().items()) > 1e-6


@pytest.mark.numerics
@pytest.mark.slow
def test_program_with_microbatches_matches_the_methods_math(clusters):
    """Under microbatches the bucket is summed once per step, after accumulation."""
    method, model, batches = ALQ(bits=3, bucket=64, update_every=1), _model(), _batches(3)
    prog = _program(model, batches, dp=2, microbatches=2, bucket_cap_mb=0.004, grad_sync=method)
    infos = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    res = prog.run_local(batches, cluster=clusters.get(2))
    losses, state = training_reference(model, batches, F.mse_loss, 0.1, method, infos, _bucket_math, microbatches=2)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for k, v in state.items():
        torch.testing.assert_close(res.state_dict()[k], v, rtol=1e-10, atol=1e-10, msg=k)


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("method", [ALQ(bits=3, bucket=64, update_every=2), AMQ(bits=3, bucket=64, update_every=2)],
                         ids=["alq", "amq"])
def test_adapted_levels_resume_bitwise(clusters, tmp_path, method):
    """3 steps, save, 3 more in a fresh program == 6 straight, bitwise: the adapted levels are in the checkpoint."""
    model, batches = _model(), _batches(6)
    straight = _program(model, batches, dp=2, grad_sync=method).run_local(batches, cluster=clusters.get(2))
    _program(model, batches, dp=2, grad_sync=method).run_local(batches[:3], cluster=clusters.get(2),
                                                               save_to=tmp_path / "ck")
    resumed = _program(model, batches, dp=2, grad_sync=method).run_local(batches[3:], cluster=clusters.get(2),
                                                                         resume_from=tmp_path / "ck")
    assert resumed.losses == straight.losses[3:]
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


@pytest.mark.structure
def test_names_work_as_grad_sync_strings():
    for name, cls in [("qsgd", QSGD), ("nuqsgd", NUQSGD), ("alq", ALQ), ("amq", AMQ), ("wangni", Wangni)]:
        assert C.registered_methods()[name] is cls and getattr(C, cls.__name__) is cls
        assert fxpar.Strategy(dp=2, grad_sync=name).grad_sync == name


@pytest.mark.numerics
@pytest.mark.slow
def test_nuqsgd_records_the_elias_bits_each_rank_sent(clusters):
    """Each rank records, per step and bucket, the Elias-coded bits (the paper's count, §4) of the codes it sent:
    equal, exactly, to the count taken from each rank's encoded message in a one-process reference with the same
    draws; below the fixed-width bits that travel (a gradient's values sit mostly at the low levels, whose codes are
    short); the training equals the reference to 1e-10."""
    method, model, batches = NUQSGD(bits=3, bucket=512), _model(), _batches(3)
    prog = _program(model, batches, dp=2, bucket_cap_mb=0.004, grad_sync=method)
    infos = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    assert len(infos) >= 2
    res = prog.run_local(batches, cluster=clusters.get(2))
    losses, state, elias = nuqsgd_reference(model, batches, F.mse_loss, 0.1, method, infos)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r in range(2):
        report = res.features[r]["nuqsgd"]
        assert sorted(report) == [(0, b.index) for b in infos]
        for b in infos:
            got = report[(0, b.index)]
            assert got["elias_bits"] == elias[(0, b.index)][r]
            assert len(got["elias_bits"]) == len(batches)
            assert got["packed_bits"] == 8 * method.wire_bytes(b, None)
            if b.numel >= 256:           # a chunk of a few values has large normalised values: long codes
                assert all(e < got["packed_bits"] for e in got["elias_bits"]), (b.numel, got)
    # the ranks drew differently, so they sent different messages
    assert res.features[0]["nuqsgd"] != res.features[1]["nuqsgd"]
    assert sum(b.numel >= 256 for b in infos) >= 2
    assert "RunResult.features[rank]['nuqsgd']" in prog.explain()


@pytest.mark.structure
def test_elias_bits_of_indices_is_the_omega_code_count():
    """The traced count (a table of each level index's bits) equals elias_bit_count's, which codes each value with
    packing.elias_omega_length, on a bucket with every level used."""
    g = torch.Generator().manual_seed(4)
    flat = torch.randn(1000, dtype=torch.float64, generator=g) * torch.logspace(-6, 0, 1000, dtype=torch.float64)
    flat[:100] = 0
    flat[7] = -3.0                      # a chunk of one value: its level is 1, the top index
    u = torch.rand(1000, dtype=torch.float64, generator=g)
    m = NUQSGD(bits=4, bucket=100)
    levels = m._levels({})
    _, idx = quantize_module.encode_with_indices(flat, levels, u, 100, 4)
    assert set(idx.tolist()) == set(range(8))
    assert int(quantize_module.elias_bits_of_indices(idx, 7, 10)) == elias_bit_count(flat, levels, u, 100)


@pytest.mark.structure
def test_step_records_are_kept_in_checkpoints_and_reported():
    """What NUQSGD records of each step travels in the rank's checkpoint and comes back in the report."""
    from fxpar.compress.runtime import CompressInfo, CompressState
    method = NUQSGD(bits=3, bucket=64)
    b = bucket_for(100, "float64", 2, 0)
    st = CompressState(CompressInfo("nuqsgd", method, (b,), (0, 1)), 0)
    key = (b.stage, b.index)
    for bits in (310, 295):
        st._done(key, b, {"elias_bits": torch.tensor(bits)})
    saved = st.save()
    again = CompressState(CompressInfo("nuqsgd", method, (b,), (0, 1)), 0)
    again.load(saved)
    assert again.records == st.records == {key: [310, 295]} and again.steps[key] == 2
    report = again.report()[key]
    assert report["elias_bits"] == [310, 295] and report["packed_bits"] == 8 * method.wire_bytes(b, None)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_nuqsgds_intervals_from_the_exponent_equal_the_search(dtype, bits):
    """NUQSGD reads each value's interval among its levels {0, 2^-(s-1), ..., 1} from the value's exponent
    (``halving_intervals``): bit for bit the interval the search over the levels finds, on normalised magnitudes
    of a bucket, on every level and its neighbours below and above, on 0, 1, the smallest subnormal and values far
    below the first level."""
    s = 2 ** (bits - 1) - 1
    levels = exponential_levels(s).to(dtype)
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(20_000, generator=gen, dtype=torch.float64).to(dtype)
    r = normalised(flat, 1024)[0].to(dtype)
    tiny = torch.finfo(dtype).smallest_normal
    inf = torch.full_like(levels, math.inf)
    edges = torch.cat([levels, torch.nextafter(levels, -inf).clamp(min=0), torch.nextafter(levels, inf).clamp(max=1),
                       torch.tensor([0.0, 1.0, tiny, tiny / 2 ** 10, 2.0 ** -(s + 3), 1e-30], dtype=dtype)])
    for x in (r, edges, torch.rand(50_000, generator=gen, dtype=dtype) ** 12):
        searched = (torch.searchsorted(levels, x, right=True) - 1).clamp(0, s - 1)
        assert torch.equal(halving_intervals(x, s), searched)
        u = torch.rand(x.shape, generator=gen, dtype=dtype)
        assert torch.equal(level_indices(x, levels, u, halving=True), level_indices(x, levels, u))


@pytest.mark.structure
def test_nuqsgds_sum_has_no_level_search():
    """NUQSGD's traced sum finds its intervals by elementwise ops (the exponent), with no ``searchsorted``: its
    cost is its bytes', which the estimate prices (a search over levels that split the values mispredicts a branch
    per comparison on CPU, which no per-class rate prices); QSGD, ALQ and AMQ still search their levels."""
    from fxpar.compress.feature import _sum_graph
    from fxpar.compress.method import BucketInfo
    b = BucketInfo(0, 0, 1, ("w",), ((4096,),), (0,), 4096, "float32", 2, 0)
    for m, searches in ((NUQSGD(bits=4), 0), (QSGD(levels=16), 1), (ALQ(bits=3), 1), (AMQ(bits=3), 1)):
        v = m.variant(b, 1 << 30, dict(m.init_state(b, torch.Generator().manual_seed(0))))
        gm = _sum_graph(m, b, v)
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        assert sum("searchsorted" in t for t in targets) == searches, (m, targets)
        assert ("aten.frexp.Tensor" in targets) == (searches == 0)


@pytest.mark.structure
def test_the_elias_count_sums_in_int32_unless_it_could_overflow():
    """NUQSGD's per-step Elias count sums the per-value bits in int32 (a sum CPU vectorises) where the bucket's most
    bits cannot reach 2^31, in int64 otherwise (traced on meta tensors: a bucket of 2^31 / 8 values at 4 bits, whose
    values take at most 8 bits, would reach it); the count is int64 either way."""
    most = max(quantize_module.elias_value_bits(7))
    assert most == 8
    for numel, dtype in ((4096, torch.int32), (2 ** 31 // most - 1, torch.int32), (2 ** 31 // most, torch.int64)):
        idx = torch.empty(numel, dtype=torch.int64, device="meta")
        gm = make_fx(lambda i: quantize_module.elias_bits_of_indices(i, 7, 4))(idx)
        sums = [n for n in gm.graph.nodes if n.op == "call_function" and "sum" in str(n.target)]
        assert len(sums) == 1 and sums[0].meta["val"].dtype == dtype
        assert gm(idx).dtype == torch.int64
