"""Accordion's bytes measured on the ranks, and where ``explain()`` sends the reader for its switch log.

MLP at dp=2 in one bucket, ``threshold=1e9`` (no layer is critical after the first comparison), ``interval=2``:
steps 0-1 are one plain all-reduce (start_iter 2), steps 2-3 PowerSGD at the high rank, and from step 4, where
every layer switches low, PowerSGD at the low rank. Each step's collectives, measured on every rank, add up to
those methods' bytes; ``explain()``, made before any run, names ``RunResult.features[rank]['accordion']`` for
every bucket, which a run fills (``tests/test_compress_accordion.py::test_run_local_switches_and_resumes``)."""
import re

import pytest

from fxpar.compress.accordion import Accordion
from fxpar.compress.feature import bucket_infos as plan_buckets
from fxpar.compress.powersgd import PowerSGD

from test_compress_powersgd import model_and_data, program


def _methods():
    low = PowerSGD(rank=1, start_iter=2, min_compression_rate=1.0)
    high = PowerSGD(rank=2, start_iter=2, min_compression_rate=1.0)
    return Accordion(low=low, high=high, threshold=1e9, interval=2), low, high


@pytest.mark.structure
@pytest.mark.filterwarnings("ignore:.*worth compressing:UserWarning")
def test_explain_names_where_the_switch_log_is_for_every_bucket():
    model, batches, loss_fn = model_and_data("mlp", 1)
    acc, _, _ = _methods()
    prog = program(model, batches, loss_fn, acc, bucket_cap_mb=0.004)
    infos = plan_buckets(prog.plan, 0, prog.stages[0].captured)
    text = prog.explain()
    assert len(infos) >= 2
    for b in infos:
        assert re.search(rf"bucket {b.index}: every 2 steps each tensor goes to rank 2 .*; the switches made: "
                         r"RunResult\.features\[rank\]\['accordion'\]", text), b.index


@pytest.mark.numerics
@pytest.mark.slow
def test_measured_bytes_follow_the_switch(clusters):
    model, batches, loss_fn = model_and_data("mlp", 7)
    acc, low, high = _methods()
    prog = program(model, batches, loss_fn, acc)
    (b,) = plan_buckets(prog.plan, 0, prog.stages[0].captured)
    res = prog.run_local(batches, cluster=clusters.get(2), measure_comm=True)
    plain, hi, lo = b.numel * 8, high.wire_bytes(b, "compressed"), low.wire_bytes(b, "compressed")
    assert lo < hi < plain
    want = [plain, plain, hi, hi, lo, lo, lo]
    for r in range(2):
        got = [sum(n for _, n in step) for step in res.comm_calls[r]]
        assert got == want, (r, got, want)
        assert all(kind == "all_reduce" for step in res.comm_calls[r] for kind, _ in step)
    switched = [row for rep in res.features[0]["accordion"].values() for row in rep["log"]]
    assert switched and {s for s, _, _ in switched} == {4}
