"""Every compression method's bytes: ``estimate()``'s communication bytes per rank and step, the Plan section's
``wire_bytes``, ``explain()``'s and the bytes measured on the ranks all equal the method's formula, written here from
the papers' message layouts (and torch's ``_should_compress`` for PowerSGD), not read from the methods' own code."""
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

import fxpar
import fxpar.compress as C
from cost_models.comm import collective_cost
from fxpar.compress.feature import bucket_infos
from fxpar.testing import MLP
from fxpar.testing.compress import mlp_batches, mlp_program

ES = 8      # float64


def _numel(shape):
    return math.prod(int(s) for s in shape)


def _quant(bits, chunk):
    # one all-gather: a float32 norm per chunk, then every value's code packed in `bits` bits
    return lambda b, dp: [("all_gather", 4 * -(-b.numel // chunk) + -(-b.numel * bits // 8))]


def _pairs(k_of):
    return lambda b, dp: [("all_gather", k_of(b.numel) * (4 + ES))]          # int32 index + float64 value


def _bytegrad(b, dp):
    m = -(-b.numel // dp)
    # all-to-all of dp chunks (a float32 min and max, then uint8 codes), all-gather of this rank's summed chunk
    return [("all_to_all", dp * (8 + m)), ("all_gather", 8 + m)]


def _powersgd(rank, rate=2.0):
    """torch's powerSGD_hook: one all-reduce of the tensors not worth compressing (1-D ones, and those
    ``_should_compress`` turns down), then P and Q of the others all-reduced."""
    def f(b, dp):
        whole = p = q = 0
        for shape in b.shapes:
            n = _numel(shape)
            rows, cols = (int(shape[0]), n // int(shape[0])) if len(shape) > 1 else (0, 0)
            if len(shape) > 1 and _should_compress(rows, cols, rank, rate)[0]:
                p, q = p + rows * rank * ES, q + cols * rank * ES
            else:
                whole += n * ES
        return [("all_reduce", x) for x in (whole, p, q) if x]
    return f


def _plain(b, dp):
    return [("all_reduce", b.numel * ES)]


FORMULAS = {
    "qsgd": (C.QSGD(levels=16, bucket=256), _quant(math.ceil(math.log2(33)), 256)),
    "nuqsgd": (C.NUQSGD(bits=4, bucket=256), _quant(4, 256)),
    "alq": (C.ALQ(bits=3, bucket=128), _quant(3, 128)),
    "amq": (C.AMQ(bits=5, bucket=1024), _quant(5, 1024)),
    "wangni": (C.Wangni(ratio=0.05), _pairs(lambda n: max(1, math.ceil(0.05 * n)))),
    "topk": (C.TopK(ratio=0.05), _pairs(lambda n: max(1, min(n, round(0.05 * n))))),
    "randomk": (C.RandomK(ratio=0.2), _pairs(lambda n: max(1, min(n, round(0.2 * n))))),
    "bytegrad": (C.ByteGrad(), _bytegrad),
    "qadam": (C.QAdam(warmup_steps=2), _bytegrad),
    "fp16": (C.FP16(), lambda b, dp: [("all_reduce", 2 * b.numel)]),
    "bf16": (C.BF16(), lambda b, dp: [("all_reduce", 2 * b.numel)]),
    "powersgd": (C.PowerSGD(rank=2, start_iter=2), _powersgd(2)),
    "accordion": (C.Accordion(low=C.PowerSGD(rank=1, start_iter=2), high=C.PowerSGD(rank=2, start_iter=2)),
                  _powersgd(2)),          # every layer starts at the high rank
    "decentralized_all": (C.Decentralized(peers="all"), _plain),
    "decentralized_ring": (C.Decentralized(peers="ring"), lambda b, dp: [("all_to_all", 2 * b.numel * ES)]),
    "decentralized_shift_one": (C.Decentralized(peers="shift_one"), lambda b, dp: [("all_to_all", b.numel * ES)]),
    # after each update the weights' change as one row of uint8 codes with its float32 min and max, to both neighbours
    "decentralized_low": (C.Decentralized(peers="ring", low_precision=True),
                          lambda b, dp: [("all_to_all", 2 * (8 + b.numel))]),
    "ddp_hook": (C.DDPHook(default_hooks.allreduce_hook, None), _plain),
}
# what the first steps send where they differ (QAdam's warm-up, PowerSGD's and Accordion's steps before start_iter)
FIRST = {"qadam": _plain, "powersgd": _plain, "accordion": _plain}
RING_ONLY = ("decentralized_ring", "decentralized_low")      # a ring's two neighbours need dp >= 3


def _total(calls):
    return sum(n for _, n in calls)


def _program(method, dp, batches):
    torch.manual_seed(0)
    model = MLP(layers=3).double()
    if isinstance(method, C.QAdam):
        return fxpar.parallelize(model, fxpar.ClusterSpec.local(dp), batches[0], loss_fn=F.mse_loss,
                                 optimizer=(C.QAdamOptimizer, {"lr": 1e-3}),
                                 strategy=fxpar.Strategy(dp=dp, bucket_cap_mb=0.004, grad_sync=method))
    return mlp_program(model, batches, dp=dp, bucket_cap_mb=0.004, grad_sync=method)


@pytest.mark.structure
def test_every_registered_method_has_a_formula_here():
    covered = {m.name for m, _ in FORMULAS.values()}
    assert covered == set(C.registered_methods())


@pytest.mark.structure
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*worth compressing:UserWarning")
@pytest.mark.parametrize("case,dp", [(c, dp) for c in sorted(FORMULAS) for dp in (2, 4)
                                     if not (dp == 2 and c in RING_ONLY)])      # a ring of 2 is refused
def test_section_explain_and_estimate_follow_the_formula(case, dp):
    """The Plan section's collectives and wire_bytes, explain()'s and the collectives estimate() costs are the
    formula's, bucket by bucket; estimate()'s comm_bytes (bytes each rank puts on the wire under the collective's
    algorithm: a ring all-reduce 2(p-1)/p of what it is handed, an all-gather (p-1)x, an all-to-all (p-1)/p) is
    the cost model's figure for exactly those collectives."""
    method, formula = FORMULAS[case]
    prog = _program(method, dp, mlp_batches(1, 8))
    infos = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    rows = prog.plan.section(method.name).stages[0]
    assert len(infos) >= 2
    want = [formula(b, dp) for b in infos]
    assert [[tuple(c) for c in (r.get("declared") or r["collectives"])] for r in rows] == want
    assert [r["wire_bytes"] for r in rows] == [_total(w) for w in want]
    text = prog.explain()
    assert [int(x) for x in re.findall(r"-> wire_bytes=(\d+)", text)] == [_total(w) for w in want]
    assert f"{sum(_total(w) for w in want)} bytes per rank and step on the wire" in text
    est = prog.estimate()
    for r in range(dp):
        costed = prog.collectives(r)
        assert [(c.parts or ((c.kind, c.nbytes),)) for c in costed] == [tuple(w) for w in want], (case, r)
        sent = sum(collective_cost(k, n, costed[0].ranks, prog.cluster).wire_bytes for w in want for k, n in w)
        assert est.ranks[r].comm_bytes == pytest.approx(sent, rel=1e-12), (case, r)
        if dp == 2 and all(k in ("all_reduce", "all_gather") for w in want for k, _ in w):
            assert est.ranks[r].comm_bytes == sum(_total(w) for w in want)     # 2(p-1)/p = p-1 = 1 at p=2
    first = [r.get("first_step") for r in rows]
    if case in FIRST:
        assert [[tuple(c) for c in f["collectives"]] for f in first] == [FIRST[case](b, dp) for b in infos]
    else:      # ALQ and AMQ adapt their levels at step 0: another graph, the same bytes
        assert all(f is None or f["wire_bytes"] == r["wire_bytes"] for f, r in zip(first, rows))


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*worth compressing:UserWarning")
@pytest.mark.parametrize("case", ["qsgd", "nuqsgd", "alq", "amq", "wangni", "bytegrad", "qadam", "powersgd",
                                  "decentralized_all"])
def test_measured_bytes_equal_the_formula(clusters, case):
    """Two steps at dp=2 (three for the methods whose first steps send otherwise: a warm-up, a start_iter of 2):
    each rank's collectives, measured, hand over the formula's bytes per bucket, the first steps' where they
    differ."""
    method, formula = FORMULAS[case]
    dp = 2
    batches = mlp_batches(3 if case in FIRST else 2, 8)
    prog = _program(method, dp, batches)
    infos = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    res = prog.run_local(batches, cluster=clusters.get(dp), measure_comm=True)
    first = FIRST.get(case)
    for r in range(dp):
        for step, calls in enumerate(res.comm_calls[r]):
            f = first if first is not None and step < 2 else formula
            assert calls == [c for b in infos for c in f(b, dp)], (case, r, step)
