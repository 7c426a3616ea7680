"""TopK and RandomK (fxpar/compress/sparse.py): their reduction to synchronous SGD at ratio 1, error feedback's
bookkeeping, and their math against a single-process reference (fxpar.testing.compress) at dp=2, dp=2 x pp=2 and
with microbatches."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.testing.compress import mlp_batches, mlp_program
from fxpar.compress.method import BucketInfo, Comm
from fxpar.compress.sparse import RandomK, TopK
from fxpar.testing import MLP
from fxpar.testing.compress import sparse_reference

SGD = (torch.optim.SGD, {"lr": 0.1})
TOL = 1e-10


def _model(layers=3):
    torch.manual_seed(0)
    return MLP(layers=layers).double()


def _batches(n, batch=8):
    return mlp_batches(n, batch)


def _program(model, batches, **strategy):
    return mlp_program(model, batches, **strategy)


@pytest.mark.numerics
@pytest.mark.parametrize("method", [TopK(ratio=1.0), TopK(ratio=1.0, error_feedback=False),
                                    RandomK(ratio=1.0), RandomK(ratio=1.0, error_feedback=True)],
                         ids=["topk", "topk-no-ef", "randomk", "randomk-ef"])
def test_ratio_1_is_plain_data_parallelism_bitwise(clusters, method):
    model, batches = _model(), _batches(3)
    plain = _program(model, batches, dp=2, bucket_cap_mb=0.004).run_local(batches, cluster=clusters.get(2))
    res = _program(model, batches, dp=2, bucket_cap_mb=0.004, grad_sync=method).run_local(batches,
                                                                                         cluster=clusters.get(2))
    assert res.losses == plain.losses
    for k, v in plain.state_dict().items():
        assert torch.equal(res.state_dict()[k], v), k


class _One(Comm):
    """The dp group of one rank: a collective hands back what it was given."""

    def __init__(self):
        super().__init__(1, 0)

    def all_gather(self, t):
        return t.clone()


@pytest.mark.structure
@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5])
def test_error_feedback_keeps_what_was_not_sent_bitwise(ratio):
    """Each step: what TopK sent (decoded) + the new residual == the bucket + the old residual, bit for bit."""
    m = TopK(ratio=ratio)
    b = BucketInfo(0, 0, 1, ("w",), ((300,),), (0,), 300, "float64", 1, 0)
    state = m.init_state(b, torch.Generator())
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        flat = torch.randn(300, dtype=torch.float64, generator=g)
        sent, new = m.sum(flat, state, [], b, _One(), None)
        assert torch.equal(sent + new["residual"], flat + state["residual"])
        assert int((sent != 0).sum()) == max(1, round(ratio * 300))       # k pairs sent
        assert torch.equal(new["residual"][sent != 0], torch.zeros(int((sent != 0).sum()), dtype=torch.float64))
        state = new


@pytest.mark.structure
def test_randomk_is_unbiased_and_each_rank_draws_its_own():
    """The draws of one step differ between ranks; scaled by n/k the estimate's mean over many steps is the
    gradient (each coordinate kept with probability k/n: the Monte-Carlo mean within 5 standard errors)."""
    n, k, steps = 50, 5, 4000
    m = RandomK(ratio=k / n)
    flat = torch.linspace(-1, 1, n, dtype=torch.float64)
    b0 = BucketInfo(0, 0, 1, ("w",), ((n,),), (0,), n, "float64", 2, 0)
    b1 = BucketInfo(0, 0, 1, ("w",), ((n,),), (0,), n, "float64", 2, 1)
    g0, g1 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    i0, i1 = m.host_inputs(b0, 0, {}, None, g0)[0], m.host_inputs(b1, 0, {}, None, g1)[0]
    assert not torch.equal(i0, i1) and torch.equal(g0.get_state(), g1.get_state())   # own draws, one stream
    one = BucketInfo(0, 0, 1, ("w",), ((n,),), (0,), n, "float64", 1, 0)
    gen = torch.Generator().manual_seed(0)
    total = torch.zeros(n, dtype=torch.float64)
    for s in range(steps):
        est, _ = m.sum(flat, {}, m.host_inputs(one, s, {}, None, gen), one, _One(), None)
        total += est
    var = flat ** 2 * (n / k - 1)                      # of one draw's coordinate: p (n/k)^2 x^2 - x^2
    assert ((total / steps - flat).abs() <= 5 * (var / steps).sqrt() + 1e-12).all()


def _buckets(prog):
    sec = prog.plan.section("data_parallel")
    return [list(map(list, stage)) for stage in sec.buckets]


@pytest.mark.numerics
@pytest.mark.parametrize("method", [TopK(ratio=0.1), TopK(ratio=0.05, error_feedback=False),
                                    RandomK(ratio=0.3), RandomK(ratio=0.2, error_feedback=True, seed=7)],
                         ids=["topk", "topk-no-ef", "randomk", "randomk-ef"])
@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, microbatches=2),
                                    pytest.param(dict(dp=2, pp=2, microbatches=2), marks=pytest.mark.slow)],
                         ids=["dp2", "dp2-mb2", "dp2xpp2"])
def test_matches_the_methods_math(clusters, method, layout):
    model, batches = _model(), _batches(4)
    prog = _program(model, batches, bucket_cap_mb=0.004, grad_sync=method, **layout)
    buckets = _buckets(prog)
    assert sum(len(s) for s in buckets) >= 2
    res = prog.run_local(batches, cluster=clusters.get(prog.world_size))
    kind = "topk" if isinstance(method, TopK) else "randomk"
    losses, state = sparse_reference(model, batches, F.mse_loss, 0.1, 2, buckets, kind, method.ratio,
                                     method.error_feedback, unbiased=getattr(method, "unbiased", True),
                                     seed=getattr(method, "seed", 0), microbatches=layout.get("microbatches", 1))
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=TOL, atol=TOL)
    got = res.state_dict()
    for k, v in state.items():
        torch.testing.assert_close(got[k], v, rtol=TOL, atol=TOL, msg=k)
    # compression changed the math: not synchronous SGD
    plain = _program(model, batches, bucket_cap_mb=0.004, **layout).run_local(batches,
                                                                               cluster=clusters.get(prog.world_size))
    assert max((got[k] - v).abs().max().item() for k, v in plain.state_dict().items()) > 1e-6
