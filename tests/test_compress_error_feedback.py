"""RandomK (fxpar/compress/sparse.py), beside TopK's checks in ``tests/test_compress_sparse.py``.

Error feedback's bookkeeping: each step, what the rank sent (decoded) plus its new residual equals its bucket plus
its old residual. Biased (``unbiased=False``: the drawn values sent as they are) bit for bit; unbiased (the drawn
values scaled by n/k, the residual there ``p - (n/k) p``) to one rounding of each drawn value, ``(p - s) + s`` being
``p`` only to rounding. Variance: the unbiased operator's, by Monte Carlo."""
import pytest
import torch

from fxpar.compress.method import BucketInfo, Comm
from fxpar.compress.sparse import RandomK


class _One(Comm):
    """The dp group of one rank: a collective hands back what it was given."""

    def __init__(self):
        super().__init__(1, 0)

    def all_gather(self, t):
        return t.clone()


@pytest.mark.structure
@pytest.mark.parametrize("unbiased", [False, True], ids=["biased", "unbiased"])
@pytest.mark.parametrize("ratio", [0.05, 0.3])
def test_randomk_sent_plus_residual_is_the_bucket_plus_the_old_residual(ratio, unbiased):
    n = 300
    m = RandomK(ratio=ratio, unbiased=unbiased, error_feedback=True, seed=3)
    b = BucketInfo(0, 0, 1, ("w",), ((n,),), (0,), n, "float64", 1, 0)
    gen = torch.Generator().manual_seed(0)
    state = m.init_state(b, gen)
    g = torch.Generator().manual_seed(3)
    k = max(1, round(ratio * n))
    for step in range(6):
        flat = torch.randn(n, dtype=torch.float64, generator=g)
        inputs = m.host_inputs(b, step, state, None, gen)
        sent, new = m.sum(flat, state, inputs, b, _One(), None)
        want = flat + state["residual"]
        drawn = inputs[0].long()
        assert drawn.numel() == k and int((sent != 0).sum()) <= k
        kept = torch.ones(n, dtype=torch.bool)
        kept[drawn] = False
        # where nothing was drawn, nothing was sent and the residual is the whole value, bitwise
        assert torch.equal(sent[kept], torch.zeros(int(kept.sum()), dtype=torch.float64))
        assert torch.equal(new["residual"][kept], want[kept])
        if unbiased:
            assert torch.equal(sent[drawn], want[drawn] * (n / k))
            err = (sent + new["residual"] - want).abs()
            assert bool((err <= 2 * torch.finfo(torch.float64).eps * sent.abs()).all()), err.max()
        else:
            assert torch.equal(sent + new["residual"], want)
            assert torch.equal(new["residual"][drawn], torch.zeros(k, dtype=torch.float64))
        state = new


@pytest.mark.numerics
@pytest.mark.parametrize("k", [1, 5, 25])
def test_randomk_variance_is_the_papers(k):
    """Unbiased rand-k (each value kept with probability k/n, scaled by n/k): E||C(x) - x||^2 = (n/k - 1) ||x||^2
    (Stich, Cordonnier & Jaggi, NeurIPS 2018, the rand-k operator's variance), no more: the Monte-Carlo mean of the
    squared error over 4000 draws within 5 standard errors of it; each draw keeps exactly k values."""
    n, draws = 50, 4000
    m = RandomK(ratio=k / n, unbiased=True, seed=5)
    b = BucketInfo(0, 0, 1, ("w",), ((n,),), (0,), n, "float64", 1, 0)
    x = torch.linspace(-1, 1, n, dtype=torch.float64) + 0.1
    gen = torch.Generator().manual_seed(5)
    sq = []
    for step in range(draws):
        est, _ = m.sum(x, {}, m.host_inputs(b, step, {}, None, gen), b, _One(), None)
        assert int((est != 0).sum()) == k
        sq.append(float(((est - x) ** 2).sum()))
    sq = torch.tensor(sq, dtype=torch.float64)
    bound = (n / k - 1) * float((x ** 2).sum())
    assert abs(float(sq.mean()) - bound) <= 5 * float(sq.std()) / draws ** 0.5 + 1e-12, (float(sq.mean()), bound)
