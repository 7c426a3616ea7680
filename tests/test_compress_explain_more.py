"""``explain()`` per tensor: every method that compresses a flat bucket (the quantizers, the sparsifiers, ByteGrad,
FP16/BF16, QAdam, Decentralized) names each gradient, its shape, what is sent of it, and its share of the bucket's
bytes before and after; the shares add up to the bucket's exact bytes; repeated layers collapse and a long bucket is
capped. NUQSGD also gives the Elias-coded bit count the paper counts, estimated for the bucket's size."""
import re

import pytest
import torch
import torch.nn.functional as F

import fxpar
import fxpar.compress as C
from fxpar.compress.describe import MAX_LINES, shares, tensor_lines
from fxpar.compress.feature import STEADY_STEP
from fxpar.compress.method import BucketInfo
from fxpar.compress.quantize import ELIAS_SAMPLE_CHUNKS, elias_bit_count, exponential_levels
from fxpar.testing import MLP
from fxpar.testing.compress import mlp_batches

pytestmark = pytest.mark.structure

METHODS = [C.QSGD(), C.NUQSGD(), C.ALQ(), C.AMQ(), C.Wangni(), C.TopK(), C.RandomK(), C.ByteGrad(), C.FP16(),
           C.BF16(), C.QAdam(), C.Decentralized(peers="ring"), C.Decentralized(peers="ring", low_precision=True)]


def _bucket(keys_shapes, dp=2, dtype="float64"):
    keys = tuple(k for k, _ in keys_shapes)
    shapes = tuple(tuple(s) for _, s in keys_shapes)
    offsets, off = [], 0
    for s in shapes:
        offsets.append(off)
        n = 1
        for x in s:
            n *= x
        off += n
    return BucketInfo(stage=0, index=0, count=1, keys=keys, shapes=shapes, offsets=tuple(offsets), numel=off,
                      dtype=dtype, dp=dp, dp_rank=0)


def _rows(lines):
    """``{name: (shape, before, after)}`` from the per-tensor lines."""
    out = {}
    for line in lines:
        m = re.match(r"\s+(\S+(?: x\d+)?) \[([\d, ]*)\]: .+; (\d+) B -> (\d+) B", line)
        if m:
            out[m.group(1)] = (m.group(2), int(m.group(3)), int(m.group(4)))
    return out


def _variant(m, b):
    state = m.init_state(b, torch.Generator().manual_seed(0))
    return m.variant(b, STEADY_STEP, state)


@pytest.mark.filterwarnings("ignore:.*worth compressing:UserWarning")
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.summary()[:40])
def test_each_tensor_has_its_name_shape_and_a_share_of_the_exact_bytes(method):
    b = _bucket([("encoder.weight", (24, 16)), ("encoder.bias", (24,)), ("head.weight", (5, 24))])
    v = _variant(method, b)
    lines = method.describe(b, v)
    rows = _rows(lines)
    assert set(rows) == set(b.keys), lines
    assert rows["encoder.weight"][0] == "24, 16" and rows["encoder.bias"][0] == "24"
    assert rows["head.weight"][0] == "5, 24"
    for key, shape in zip(b.keys, b.shapes):
        n = 1
        for x in shape:
            n *= x
        assert rows[key][1] == 8 * n                    # its bytes in a float64 all-reduce
    wire = method.wire_bytes(b, v)
    assert sum(r[2] for r in rows.values()) == wire     # the shares are a split of the bucket's exact bytes
    head = next(x for x in lines if "per tensor:" in x)
    assert f"{wire} B" in head and "in proportion to its values" in head


def test_narrow_dtypes_share_is_each_tensors_exact_bytes():
    b = _bucket([("a.weight", (7, 3)), ("a.bias", (7,))], dtype="float32")
    for m, size in ((C.FP16(), 2), (C.BF16(), 2)):
        rows = _rows(m.describe(b, None))
        assert rows["a.weight"][1:] == (21 * 4, 21 * size) and rows["a.bias"][1:] == (7 * 4, 7 * size)


def test_what_is_sent_is_said():
    b = _bucket([("w", (4096,))])
    said = {C.NUQSGD(bits=4): "4-bit code", C.QSGD(levels=7): "4-bit code", C.TopK(ratio=0.01): "top 1% of",
            C.RandomK(ratio=0.01): "random 1% of", C.ByteGrad(): "uint8 code", C.FP16(): "float16"}
    for m, phrase in said.items():
        text = "\n".join(m.describe(b, _variant(m, b)))
        assert phrase in text, (m, text)
    assert "int32 indices" in "\n".join(C.TopK(ratio=0.01).describe(b, None))
    assert "float32 norm per 1024-value chunk" in "\n".join(C.NUQSGD().describe(b, None))


def test_shares_add_up_and_follow_the_sizes():
    assert shares(10, [1, 1, 1]) == [4, 3, 3]
    assert shares(0, [5, 6]) == [0, 0]
    assert shares(7, [0, 0]) == [0, 0]
    for total, sizes in ((226, [8, 256, 32]), (12345, [1] * 37 + [1000]), (1001, [3, 300, 30, 7000])):
        got = shares(total, sizes)
        assert sum(got) == total
        assert all(abs(g - total * s / sum(sizes)) < 1 for g, s in zip(got, sizes))


def test_a_150_tensor_bucket_collapses_repeated_layers_and_is_capped():
    keys = [("embed.weight", (50, 8))]
    for i in range(37):
        keys += [(f"layers.{i}.attn.weight", (8, 8)), (f"layers.{i}.attn.bias", (8,)),
                 (f"layers.{i}.mlp.fc.weight", (8, 8)), (f"layers.{i}.mlp.fc.bias", (8,))]
    keys += [("norm.weight", (8,))]
    b = _bucket(keys)
    assert len(b.keys) == 150
    m = C.QSGD()
    lines = m.describe(b, None)
    assert len(lines) <= 2 + MAX_LINES
    rows = _rows(lines)
    assert rows["layers.*.attn.weight x37"] == ("8, 8", 37 * 64 * 8, rows["layers.*.attn.weight x37"][2])
    assert sum(r[2] for r in rows.values()) == m.wire_bytes(b, None)
    # more distinct tensors than lines: the rest in one line, their bytes included
    many = _bucket([(f"t{i}_{'x' * i}", (i + 1,)) for i in range(20)])
    lines = tensor_lines(many, "as is", 1000, "as is")
    assert len(lines) == 1 + MAX_LINES + 1
    tail = re.search(r"\.\.\. and (\d+) more tensors: (\d+) B -> (\d+) B", lines[-1])
    assert tail and int(tail.group(1)) == 20 - MAX_LINES
    assert sum(r[2] for r in _rows(lines).values()) + int(tail.group(3)) == 1000
    assert sum(r[1] for r in _rows(lines).values()) + int(tail.group(2)) == 8 * many.numel


def test_nuqsgd_elias_estimate_is_the_count_on_its_stated_draw():
    m = C.NUQSGD(bits=4, bucket=128)
    n = 3000
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(n, generator=gen, dtype=torch.float64)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    assert m.expected_elias_bits(n) == elias_bit_count(g, exponential_levels(7), u, 128) == m.elias_bits(g, u)
    # past the sample: the per-value rate of ELIAS_SAMPLE_CHUNKS chunks, scaled; near the exact count on a draw
    big = (ELIAS_SAMPLE_CHUNKS * 4 + 3) * 128 + 17
    est = m.expected_elias_bits(big)
    gen = torch.Generator().manual_seed(1)
    exact = m.elias_bits(torch.randn(big, generator=gen, dtype=torch.float64),
                         torch.rand(big, generator=gen, dtype=torch.float64))
    assert abs(est - exact) < 0.01 * exact
    b = _bucket([("w", (n,))])
    text = "\n".join(m.describe(b, None))
    assert f"about {m.expected_elias_bits(n)} bits" in text and "Elias" in text
    assert f"{8 * m.wire_bytes(b, None)} bits sent" in text


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nuqsgd", "topk", "bytegrad", "decentralized"])
def test_program_explain_names_every_parameter_once_per_bucket(name):
    torch.manual_seed(0)
    model, batches = MLP(layers=2).double(), mlp_batches(1)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=F.mse_loss,
                             optimizer=(torch.optim.SGD, {"lr": 0.1}),
                             strategy=fxpar.Strategy(dp=2, bucket_cap_mb=0.004, grad_sync=name))
    text = prog.explain()
    rows = prog.plan.section(name).stages[0]
    named = dict(model.named_parameters())
    for row in rows:
        block = text.split(f"stage 0 bucket {row['bucket']}:")[1].split("stage 0 bucket")[0]
        got = _rows(block.splitlines())
        assert set(got) == set(row["keys"]), block
        assert sum(r[2] for r in got.values()) == row["wire_bytes"]
        for k in row["keys"]:
            assert got[k][0] == ", ".join(str(x) for x in named[k].shape)
    if name == "nuqsgd":
        assert text.count("Elias-coded") == len(rows)
