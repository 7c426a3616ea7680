"""The quantizers (QSGD, NUQSGD, ALQ, AMQ, Wangni) and ByteGrad on every stage's REDUCE_GRAD at dp=2 x pp=2 with
two microbatches: training equals the method's math in one process over the per-stage buckets to 1e-10. Each (stage,
dp rank) draws from its own generator as a rank's runtime does; each stage's buckets are summed once per step, after
accumulation; each rank's collectives per step are its stage's buckets' formula bytes."""
import pytest
import torch
import torch.nn.functional as F

import fxpar
import fxpar.compress as C
from fxpar.compress.feature import bucket_infos
from fxpar.compress.quantize import alq_adapt, amq_adapt, quantize_dequantize
from fxpar.compress.wangni import capacity, densify, sparsify, wangni_probabilities
from fxpar.testing import MLP
from fxpar.testing.compress_ranks import training_reference
from fxpar.testing.compress import bytegrad_reference

pytestmark = [pytest.mark.numerics, pytest.mark.slow]

LR = 0.1
LAYOUT = dict(dp=2, pp=2, microbatches=2)


def _bucket_math(method, infos, flats, states, draws, variant):
    """One bucket summed over the ranks in one process: each rank's estimate from its own draws, added in rank
    order; ALQ's and AMQ's levels adapted to that sum on an adapting step."""
    numel = flats[0].shape[0]
    if isinstance(method, C.ByteGrad):
        return bytegrad_reference(flats), states
    if isinstance(method, C.Wangni):
        total, k = torch.zeros(numel, dtype=flats[0].dtype), capacity(numel, method.ratio)
        for f, d in zip(flats, draws):
            total = densify(*sparsify(f, wangni_probabilities(f, method.ratio, method.iters), d[0], k), numel,
                            into=total)
        return total, states
    levels, bits = method._levels(states[0]), method._bits()
    total = None
    for f, d in zip(flats, draws):
        part = quantize_dequantize(f, levels, d[0], method.bucket, bits)
        total = part if total is None else total + part
    if variant == "adapt" and isinstance(method, C.ALQ):
        states = [{"levels": alq_adapt(total, states[0]["levels"], method.bucket, method.sweeps)}] * len(flats)
    elif variant == "adapt":
        states = [{"multiplier": amq_adapt(total, states[0]["multiplier"], method._s(), method.bucket,
                                           method.grid)}] * len(flats)
    return total, states


def _model():
    torch.manual_seed(0)
    return MLP(layers=3).double()


def _batches(n, batch=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 16, dtype=torch.float64, generator=g),
             torch.randn(batch, 8, dtype=torch.float64, generator=g)) for _ in range(n)]


def _program(model, batches, **strategy):
    world = strategy["dp"] * strategy.get("pp", 1)
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(world), batches[0], loss_fn=F.mse_loss,
                             optimizer=(torch.optim.SGD, {"lr": LR}), strategy=fxpar.Strategy(**strategy))


METHODS = [C.QSGD(levels=8, bucket=64), C.NUQSGD(bits=3, bucket=64), C.ALQ(bits=3, bucket=64, update_every=2),
           C.AMQ(bits=3, bucket=64, update_every=2), C.Wangni(ratio=0.2), C.ByteGrad()]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: type(m).__name__)
def test_every_stage_matches_the_methods_math(clusters, method):
    model, batches = _model(), _batches(4)
    prog = _program(model, batches, bucket_cap_mb=0.004, grad_sync=method, **LAYOUT)
    assert prog.world_size == 4
    stages = [bucket_infos(prog.plan, s, prog.stages[s].captured) for s in range(2)]
    assert all(len(s) >= 1 for s in stages) and sum(len(s) for s in stages) >= 3
    infos = [b for s in stages for b in s]
    assert {b.stage for b in infos} == {0, 1}
    res = prog.run_local(batches, cluster=clusters.get(4), measure_comm=True)
    losses, state = training_reference(model, batches, F.mse_loss, LR, method, infos, _bucket_math,
                                       microbatches=LAYOUT["microbatches"])
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    got = res.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-10, msg=k)
    # each rank sums its own stage's buckets, once per step: the section's collectives, in bucket order
    for rank in range(4):
        (s,) = prog.plan.rank_stages(rank)
        want = [tuple(c) for row in prog.plan.section(method.name).stages[s] for c in row["collectives"]]
        assert want and all(
            [c for c in calls if c[0] in ("all_gather", "all_to_all")] == want for calls in res.comm_calls[rank]), \
            (rank, res.comm_calls[rank])
    # compressed: not synchronous SGD
    plain = _program(model, batches, bucket_cap_mb=0.004, **LAYOUT).run_local(batches, cluster=clusters.get(4))
    assert max((got[k] - v).abs().max().item() for k, v in plain.state_dict().items()) > 1e-6
