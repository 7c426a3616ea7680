"""BAGUA's ByteGrad: min-max uint8 per chunk, scatter-reduce-gather.

One quantisation errs by at most ``(hi - lo) / 510`` per value (``lo``, ``hi``: the chunk's float32 min and max,
rounded outward), plus float64 rounding of at most 4 ulp of ``max(|lo|, |hi|)``; the sum over ``dp`` ranks errs by
at most the senders' steps plus the summed chunk's, ``sum_r (hi_rc - lo_rc) / 510 + (hi_c - lo_c) / 510``. On a gloo
group at dp=2 and dp=4, every rank's sum equals the same math in one process exactly; the collectives are one
all-to-all of ``dp (8 + m)`` bytes and one all-gather of ``8 + m``, ``wire_bytes`` in all. In a program
(``parallelize(...).run_local``) at dp=2 and dp=4, training equals the same math in one process.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fxpar

from fxpar.collectives import C10D
from fxpar.compress.bytegrad import ByteGrad, chunk_size, dequantize_rows, quantize_rows
from fxpar.compress.feature import bucket_infos
from fxpar.compress.method import Comm
from fxpar.testing import MLP
from fxpar.testing.compress_ranks import bucket_for, sum_steps, training_reference
from fxpar.testing.compress import bytegrad_reference

EPS = torch.finfo(torch.float64).eps


def _ranges(x):
    """Per row, the float32 (lo, hi) that travel, read back from the packed rows."""
    head = quantize_rows(x)[:, :8].contiguous().view(torch.float32).to(torch.float64)
    return head[:, 0], head[:, 1]


def _bound(x):
    lo, hi = _ranges(x)
    return ((hi - lo) / 510 + 4 * EPS * torch.maximum(lo.abs(), hi.abs())).unsqueeze(1)


@pytest.mark.numerics
def test_one_quantisation_errs_at_most_range_over_510():
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([[1e-6], [1.0], [1e3], [1.0], [1.0], [5.0]], dtype=torch.float64)
    x = torch.randn(6, 1000, generator=g, dtype=torch.float64) * scales
    x[3] = 0.125                                     # a constant row: exact
    x[4] = x[4].abs() + 10                           # all positive, far from 0
    packed = quantize_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 8 + 1000)
    lo, hi = _ranges(x)
    assert bool((lo <= x.amin(1)).all() and (hi >= x.amax(1)).all())
    err = (dequantize_rows(packed, torch.float64) - x).abs()
    assert bool((err <= _bound(x)).all())
    assert torch.equal(err[3], torch.zeros(1000, dtype=torch.float64))
    # the bound is attained within a code step: somewhere the error exceeds 90% of half a step
    assert bool(((err / ((hi - lo) / 510).unsqueeze(1).clamp(min=1e-300))[[0, 1, 2, 4, 5]].amax(1) > 0.9).all())
    assert bool((packed[[0, 1, 2, 4, 5], 8:].amin(1) == 0).all() and (packed[[0, 1, 2, 4, 5], 8:].amax(1) == 255).all())


def _error_bound(flats, total):
    dp, n = len(flats), flats[0].shape[0]
    m = chunk_size(n, dp)
    pad = lambda t: torch.cat([t, t.new_zeros(m * dp - n)]).view(dp, m)   # noqa: E731
    bound = sum(_bound(pad(f)) for f in flats) + _bound(pad(total))
    return bound.expand(dp, m).reshape(-1)[:n]


@pytest.mark.numerics
@pytest.mark.parametrize("dp,numel,traced", [(2, 1001, True), pytest.param(4, 1001, True, marks=pytest.mark.slow),
                                              (4, 3, False)])
def test_sum_on_ranks_equals_the_same_math(clusters, dp, numel, traced):
    method = ByteGrad()
    records = clusters.get(dp).run(sum_steps, [(method, numel, "float64", 2, traced)] * dp)
    m = chunk_size(numel, dp)
    for step in range(2):
        flats = [rr[step]["flat"] for rr in records]
        total = bytegrad_reference(flats)
        for rr in records:
            assert torch.equal(rr[step]["summed"], total)
            assert rr[step]["calls"] == [("all_to_all", dp * (8 + m)), ("all_gather", 8 + m)]
            assert sum(b for _, b in rr[step]["calls"]) == method.wire_bytes(bucket_for(numel, "float64", dp), None)
        plain = sum(flats)
        assert bool(((total - plain).abs() <= _error_bound(flats, total)).all())
        assert not torch.equal(total, plain)


@pytest.mark.structure
def test_traced_sum_is_an_all_to_all_then_an_all_gather():
    b = bucket_for(1000, "float32", 4, 2)
    gm = make_fx(lambda f: ByteGrad().sum(f, {}, [], b, Comm(4, 2), None), tracing_mode="fake")(
        torch.zeros(1000, dtype=torch.float32))
    colls = [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
             and n.target.namespace == "_c10d_functional" and n.target is not C10D.wait_tensor.default]
    assert [n.target for n in colls] == [C10D.all_to_all_single.default, C10D.all_gather_into_tensor.default]
    assert [n.args[0].meta["val"].numel() for n in colls] == [4 * (8 + 250), 8 + 250]
    assert all(n.args[0].meta["val"].dtype == torch.uint8 for n in colls)
    assert ByteGrad().wire_bytes(b, None) == 5 * 258 and ByteGrad().describe(b, None)


def _bucket_math(method, infos, flats, states, draws, variant):
    return bytegrad_reference(flats), states


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("dp", [2, 4])
def test_program_matches_the_same_math(clusters, dp):
    torch.manual_seed(0)
    model = MLP(layers=3).double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, dtype=torch.float64, generator=g),
                torch.randn(8, 8, dtype=torch.float64, generator=g)) for _ in range(3)]
    method = ByteGrad()
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(dp), batches[0], loss_fn=F.mse_loss,
                             optimizer=(torch.optim.SGD, {"lr": 0.1}),
                             strategy=fxpar.Strategy(dp=dp, bucket_cap_mb=0.004, grad_sync=method))
    infos = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    assert len(infos) >= 2
    calls = [[("all_to_all", dp * (8 + chunk_size(b.numel, dp))), ("all_gather", 8 + chunk_size(b.numel, dp))]
             for b in infos]
    assert [r["collectives"] for r in prog.plan.section("bytegrad").stages[0]] == [list(map(list, c)) for c in calls]
    assert [sum(x for _, x in c) for c in calls] == [method.wire_bytes(b, None) for b in infos]
    res = prog.run_local(batches, cluster=clusters.get(dp), measure_comm=True)
    losses, state = training_reference(model, batches, F.mse_loss, 0.1, method, infos, _bucket_math)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for k, v in state.items():
        torch.testing.assert_close(res.state_dict()[k], v, rtol=1e-10, atol=1e-10, msg=k)
    for r in range(dp):
        assert res.comm_calls[r] == [[c for bucket in calls for c in bucket]] * len(batches)
