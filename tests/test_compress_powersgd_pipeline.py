"""PowerSGD on every stage's REDUCE_GRAD: dp=2 x pp=2 with 2 microbatches, on the tied GPT (its embedding and head
on both stages). At ``min_compression_rate=0`` and a rank at least every matrix's smaller side, every gradient of
every stage is compressed at full rank, so the run is plain dp x pp to 1e-8 (``P Q^T`` rounds; see
``tests/test_compress_powersgd.py::test_full_rank_equals_plain_dp``); at rank 1 it is not. Both stages' buckets are
summed by PowerSGD, as measured on the ranks: one plain all-reduce before start_iter, then its P and Q all-reduces."""
import pytest
import torch

import fxpar
from fxpar.compress.powersgd import PowerSGD
from fxpar.testing import gpt_loss, tiny_gpt, token_batches

SGD = (torch.optim.SGD, {"lr": 0.1})


def _program(model, batches, method=None):
    strategy = dict(dp=2, pp=2, microbatches=2)
    if method is not None:
        strategy["grad_sync"] = method
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(4), batches[0], loss_fn=gpt_loss, optimizer=SGD,
                             strategy=fxpar.Strategy(**strategy))


@pytest.mark.numerics
@pytest.mark.slow
def test_full_rank_on_both_stages_is_plain_dp_x_pp(clusters):
    model, batches = tiny_gpt(), token_batches(4)
    big = max(min(p.shape[0], p.numel() // p.shape[0]) for p in model.parameters() if p.dim())
    method = PowerSGD(rank=big, start_iter=2, min_compression_rate=0.0)
    prog = _program(model, batches, method)
    rows = prog.plan.section("powersgd").stages
    assert len(rows) == 2 and all(rows)                       # both stages' buckets are PowerSGD's
    res = prog.run_local(batches, cluster=clusters.get(4), measure_comm=True)
    plain = _program(model, batches).run_local(batches, cluster=clusters.get(4))
    assert max(abs(a - b) for a, b in zip(res.losses, plain.losses)) < 1e-8
    got, want = res.state_dict(), plain.state_dict()
    worst = max(float((got[k] - v).abs().max()) for k, v in want.items())
    assert 0 < worst < 1e-8, worst                            # not bitwise: the products round
    low = _program(model, batches, PowerSGD(rank=1, start_iter=2)).run_local(batches, cluster=clusters.get(4))
    assert max(float((low.state_dict()[k] - v).abs().max()) for k, v in want.items()) > 1e-6
    # measured on every rank, each step: its stage's PowerSGD collectives as the plan lists them (a plain all-reduce
    # before start_iter, then P and Q), beside the plain all-reduce of the weight tied across the stages
    tied = ("all_reduce", model.wte.weight.numel() * 8)
    for r in range(4):
        (row,) = rows[r // 2]                                 # ranks 0, 1 hold stage 0; ranks 2, 3 stage 1
        for step, calls in enumerate(res.comm_calls[r]):
            calls = list(calls)
            calls.remove(tied)
            want = row["first_step"]["collectives"] if step < 2 else row["collectives"]
            assert calls == [tuple(c) for c in want], (r, step, calls, want)
