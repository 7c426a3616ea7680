"""Every built-in gradient-compression method, no ranks: a string names its defaults (``grad_sync="powersgd"``), its
options travel in the Plan's typed section through JSON, and ``explain()`` gives per bucket the bytes an all-reduce
would send and the bytes the method sends, as its Plan section counts them; ``estimate()`` prices the bytes those
collectives send."""
import functools
import re

import pytest
import torch
import torch.nn.functional as F

import fxpar
import fxpar.compress as C
from fxpar.testing import MLP
from fxpar.testing.compress import mlp_batches

# a parallelize per method (1-3 s each): the full suite runs them, the quick loop does not
pytestmark = [pytest.mark.structure, pytest.mark.slow]

# every method registered with fxpar.compress but DDPHook, which wraps a user's hook and has no defaults to name
NAMES = ["topk", "randomk", "wangni", "qsgd", "nuqsgd", "alq", "amq", "powersgd", "accordion", "bytegrad", "qadam",
         "decentralized", "fp16", "bf16"]


def _program(grad_sync):
    """The 2-layer MLP at dp=2 in several buckets, SGD (QAdam: its own optimizer, which it needs)."""
    torch.manual_seed(0)
    model, batches = MLP(layers=2).double(), mlp_batches(1)
    qadam = grad_sync == "qadam" or isinstance(grad_sync, C.QAdam)
    optimizer = (C.QAdamOptimizer, {"lr": 1e-3}) if qadam else (torch.optim.SGD, {"lr": 0.1})
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=F.mse_loss, optimizer=optimizer,
                             strategy=fxpar.Strategy(dp=2, bucket_cap_mb=0.004, grad_sync=grad_sync))


@functools.lru_cache(maxsize=None)
def _by_name(name: str):
    return _program(name)


def test_the_list_is_every_method_but_ddp_hook():
    assert sorted(NAMES + ["ddp_hook"]) == sorted(C.registered_methods())


@pytest.mark.filterwarnings("ignore:.*worth compressing:UserWarning")
@pytest.mark.parametrize("name", NAMES)
def test_a_string_is_the_defaults_and_the_section_round_trips(name):
    cls = C.registered_methods()[name]
    assert fxpar.Strategy(dp=2, grad_sync=name).grad_sync == name
    by_name, by_instance = _by_name(name), _program(cls())
    sec = by_name.plan.section(name)
    assert isinstance(sec, C.CompressSection)
    assert sec.method == cls().to_dict() == by_instance.plan.section(name).method
    assert sec.stages == by_instance.plan.section(name).stages
    again = fxpar.Plan.from_json(by_name.plan.to_json())
    assert again == by_name.plan and isinstance(again.section(name), C.CompressSection)
    assert again.section(name).method == sec.method


@pytest.mark.filterwarnings("ignore:.*worth compressing:UserWarning")
@pytest.mark.parametrize("name", NAMES)
def test_explain_gives_each_buckets_bytes_before_and_after(name):
    prog = _by_name(name)
    rows = prog.plan.section(name).stages[0]
    assert len(rows) >= 2
    text = prog.explain()
    for row in rows:
        m = re.search(rf"stage 0 bucket {row['bucket']}: (\d+) values \(float64\), (\d+) bytes all-reduced plainly "
                      rf"-> wire_bytes=(\d+)", text)
        assert m, (name, row["bucket"])
        assert int(m.group(1)) == row["numel"]
        assert int(m.group(2)) == row["plain_bytes"] == 8 * row["numel"]
        assert int(m.group(3)) == row["wire_bytes"]
    total_plain = sum(r["plain_bytes"] for r in rows)
    assert f"instead of {total_plain}" in text, text.splitlines()[:4]


# bytes each rank sends in a collective of a buffer of S bytes over N ranks (cost_models/comm.py's table: ring
# all-reduce, ring all-gather of a shard, pairwise all-to-all)
_SENT = {"all_reduce": lambda S, N: 2 * (N - 1) / N * S, "all_gather": lambda S, N: (N - 1) * S,
         "all_to_all": lambda S, N: (N - 1) / N * S}


@pytest.mark.filterwarnings("ignore:.*worth compressing:UserWarning")
@pytest.mark.parametrize("name", NAMES)
def test_the_estimate_sends_each_methods_collectives(name):
    """``estimate()``'s bytes per rank are what the method's collectives send, as the plan lists them per bucket
    (the steady state): at dp=2 the bucket's wire bytes, but for an all-to-all (ByteGrad, QAdam) the half that
    leaves the rank; ``program.collectives`` lists the same collectives in the same order."""
    prog = _by_name(name)
    rows = prog.plan.section(name).stages[0]
    # a traced sum lists its collectives; an eager one (Decentralized) declares them
    calls = [(k, n) for row in rows for k, n in (row["collectives"] or row["declared"])]
    sent = sum(_SENT[kind](nbytes, 2) for kind, nbytes in calls)
    assert prog.estimate().ranks[0].comm_bytes == pytest.approx(sent, rel=1e-12)
    # program.collectives: one entry per bucket sum, its collectives in order in ``parts`` where it issues several
    listed = [p for c in prog.collectives(0) for p in (c.parts or ((c.kind, c.nbytes),))]
    assert listed == calls
