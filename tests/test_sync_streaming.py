"""Streaming DiLoCo (``S.DiLoCo(period=H, fragments=F, delay=tau, mix=alpha)``; Douillard et al. 2025): the
parameter tensors cut into F fragments, fragment p averaged and stepped by the outer optimizer after the steps t
with ``(t - W - p H / F) % H == 0``, its result merged ``tau`` steps later as ``alpha x + (1 - alpha) outer``.

Against a one-process reference of the paper's fragment math (``fxpar.testing.sync.streaming_diloco_reference``),
every rank's parameters and the losses to 1e-10 in float64; with F=1 that reference is DiLoCo's Algorithm 1 (the
fxpar DiLoCo run). A checkpoint taken while a fragment is in flight resumes every replica bitwise.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import sync as S
from fxpar.sync.feature import method_of
from fxpar.sync.method import fragment_keys
from fxpar.testing import MLP
from fxpar.testing.compress import mlp_batches
from fxpar.testing.resume import assert_resume_is_exact
from fxpar.testing.sync import nesterov_outer, streaming_diloco_reference

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.01})
NESTEROV = (torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})


def _model():
    torch.manual_seed(0)
    return MLP(layers=2).double()


def _program(model, batches, method, optimizer=SGD_M, dp=2):
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(dp), batches[0], loss_fn=F.mse_loss, optimizer=optimizer,
                             strategy=fxpar.Strategy(dp=dp, sync=method))


def _replicas(res, dp) -> list:
    return [res.features[r]["sync"]["replica"] for r in range(dp)]


def _assert_replicas_equal(a, b, dp: int = 2) -> None:
    """Every replica's parameters bitwise equal in two runs (``assert_resume_is_exact`` checks rank 0's)."""
    for r, (x, y) in enumerate(zip(_replicas(a, dp), _replicas(b, dp))):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), r


def _close(got: dict, want: dict, msg=""):
    assert got and sorted(k for k in want if k in got) == sorted(got)
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-10, atol=1e-10, msg=f"{msg} {k}")


@pytest.mark.numerics
@pytest.mark.parametrize("fragments,warmup,delay,mix,optimizer", [
    (2, 0, 0, 0.0, SGD_M), (4, 1, 0, 0.0, ADAMW), (2, 0, 1, 0.5, SGD_M)],
    ids=["F2", "F4-warmup-AdamW", "F2-delay1-mix0.5"])
def test_streaming_equals_the_papers_fragments(clusters, fragments, warmup, delay, mix, optimizer):
    """dp=2, H=4, 9 steps, outer Nesterov SGD: every replica and the losses equal the one-process reference; the
    ranks record each fragment's start and merge on the steps the schedule says."""
    model, batches = _model(), mlp_batches(9)
    method = S.DiLoCo(period=4, warmup_steps=warmup, outer=NESTEROV, fragments=fragments, delay=delay, mix=mix)
    res = _program(model, batches, method, optimizer).run_local(batches, cluster=clusters.get(2))
    losses, reps = streaming_diloco_reference(model, batches, F.mse_loss, optimizer, 2, 4, fragments,
                                              nesterov_outer(0.7, 0.9), warmup, delay, mix)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r, got in enumerate(_replicas(res, 2)):
        _close(got, reps[r], f"replica {r}")
    started = [(t, f) for t in range(9) for f in range(fragments) if method.fragment_averages(f, t)]
    log = res.features[0]["sync"]["fragment_log"]
    assert [(t, f) for t, f, _ in log] == [(t, f) for t, f in started if t + delay < 9]
    assert all(m == t + delay for t, _, m in log)
    assert res.features[0]["sync"]["fragments"][0] == fragment_keys([k for k, _ in model.named_parameters()],
                                                                    fragments)


@pytest.mark.numerics
def test_one_fragment_reference_is_diloco(clusters):
    """The reference with F=1 (its fragment the whole model) equals fxpar's DiLoCo, every replica to 1e-10; and
    F=2 differs from it (the fragments are stepped apart)."""
    model, batches = _model(), mlp_batches(6)
    res = _program(model, batches, S.DiLoCo(period=2, outer=NESTEROV)).run_local(batches, cluster=clusters.get(2))
    losses, reps = streaming_diloco_reference(model, batches, F.mse_loss, SGD_M, 2, 2, 1, nesterov_outer(0.7, 0.9))
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r, got in enumerate(_replicas(res, 2)):
        _close(got, reps[r], f"replica {r}")
    _, two = streaming_diloco_reference(model, batches, F.mse_loss, SGD_M, 2, 2, 2, nesterov_outer(0.7, 0.9))
    assert max((two[0][k] - reps[0][k]).abs().max().item() for k in reps[0]) > 1e-6
    assert S.DiLoCo(period=2, outer=NESTEROV, fragments=1) == S.DiLoCo(period=2, outer=NESTEROV)


@pytest.mark.numerics
def test_checkpoint_with_a_fragment_in_flight_resumes_bitwise(clusters, tmp_path):
    """H=4, F=2, delay 1: fragment 0 starts after step 4 and merges after step 5; saved after step 4 (in flight, its
    all-reduce waited for and saved), 3 more == 8 straight, bitwise, per replica."""
    model, batches = _model(), mlp_batches(8)
    method = S.DiLoCo(period=4, outer=NESTEROV, fragments=2, delay=1, mix=0.5)
    straight, _, resumed = assert_resume_is_exact(_program(model, batches, method), batches, 5,
                                                  clusters.get(2), tmp_path / "ck")
    _assert_replicas_equal(straight, resumed)


@pytest.mark.structure
def test_plan_round_trip_schedule_and_bytes():
    """The fragments travel in the Plan; program.schedule(rank) lists each fragment's AVERAGE (its bytes) and OUTER
    on their steps over one window; estimate() counts the window's bytes spread over its H steps."""
    model, batches = _model(), mlp_batches(1)
    method = S.DiLoCo(period=4, outer=NESTEROV, fragments=2, delay=1, mix=0.5)
    prog = _program(model, batches, method)
    assert method_of(fxpar.Plan.from_json(prog.plan.to_json()).section("sync")) == method
    assert "fragments" not in S.DiLoCo(period=4).to_dict()
    frags = fragment_keys([k for k, _ in model.named_parameters()], 2)
    size = [sum(dict(model.named_parameters())[k].numel() * 8 for k in ks) for ks in frags]
    lines = str(prog.schedule(0)).splitlines()
    assert lines[0] == "rank 0: FULL0.0"
    assert lines[2:] == [f"  step 0: AVERAGE0.0 ({size[0]} bytes)", "  step 1: OUTER0.0",
                         f"  step 2: AVERAGE0.1 ({size[1]} bytes)", "  step 3: OUTER0.1"]
    assert f"{sum(size)} bytes per rank per window" in lines[1] and f"at most {max(size)} on one step" in lines[1]
    assert prog.estimate().ranks[0].comm_bytes == sum(size) // 4
    assert "one fragment of 2 at a time" in prog.explain()


@pytest.mark.structure
def test_schedule_lists_each_methods_averaging_actions():
    """program.schedule(rank) after the step's actions: the warm-up on one line, then per step of one window what
    the method adds -- Local SGD's AVERAGE, SlowMo's AVERAGE and OUTER, hierarchical Local SGD's groups;
    estimate() counts the window's bytes over its steps (hierarchical: two averagings per window of 4, as Local
    SGD's one per 2)."""
    model, batches = _model(), mlp_batches(1)
    p = sum(t.numel() * 8 for t in model.parameters())
    local = _program(model, batches, S.LocalSGD(period=3, warmup_steps=2), dp=4)
    assert str(local.schedule(3)).splitlines()[2:] == [
        "  steps 0..1 (warm-up): the step's gradient all-reduce, as plain data parallelism",
        f"  step 2: AVERAGE0 ({p} bytes)", "  step 3: -", "  step 4: -"]
    slow = _program(model, batches, S.SlowMo(period=2), dp=4)
    assert str(slow.schedule(0)).splitlines()[2:] == [f"  step 0: AVERAGE0 ({p} bytes) OUTER0", "  step 1: -"]
    tiers = _program(model, batches, S.LocalSGD(hierarchical={2: 2, 4: 4}), dp=4)
    lines = str(tiers.schedule(1)).splitlines()
    assert lines[2:] == [f"  step 0: AVERAGE0 ({p} bytes)", "  step 1: -",
                         f"  step 2: AVERAGE0 ({p} bytes within groups of 2)", "  step 3: -"]
    assert f"{2 * p} bytes per rank per window ({p // 2} per step on average" in lines[1]
    every_other = _program(model, batches, S.LocalSGD(period=2), dp=4)     # one averaging per 2 steps: the same
    assert tiers.estimate().ranks[0].comm_bytes == every_other.estimate().ranks[0].comm_bytes


# ---- the paper's strided fragments and 4-bit pseudo-gradients -----------------------------------------------------

def _blocks_model():
    torch.manual_seed(0)
    return MLP(layers=3).double()         # blocks layers.0, layers.1, layers.2, out


@pytest.mark.numerics
@pytest.mark.parametrize("dp,fragments,pattern,quantize,delay,mix,warmup,optimizer", [
    (2, 2, "strided", None, 0, 0.0, 0, SGD_M),
    (2, 2, "strided", "e3m0", 1, 0.5, 1, ADAMW),
    (4, 4, "strided", "e3m0", 0, 0.0, 0, SGD_M),
    (2, 2, "sequential", "e3m0", 0, 0.0, 0, SGD_M)],
    ids=["dp2-strided", "dp2-strided-e3m0-delay1-AdamW", "dp4-strided-e3m0", "dp2-sequential-e3m0"])
def test_strided_and_quantized_equal_the_papers_math(clusters, dp, fragments, pattern, quantize, delay, mix, warmup,
                                                     optimizer):
    """H=4, 7 steps, outer Nesterov SGD: every replica and the losses equal the one-process reference (its own
    strided cut and its own E3M0 rounding by search over the grid) to 1e-10; the strided fragments hold the blocks
    dealt round-robin; the quantized run differs from the unquantized reference (the rounding is applied)."""
    model, batches = _blocks_model(), mlp_batches(7, batch=8)
    method = S.DiLoCo(period=4, warmup_steps=warmup, outer=NESTEROV, fragments=fragments, delay=delay, mix=mix,
                      pattern=pattern, quantize=quantize)
    res = _program(model, batches, method, optimizer, dp=dp).run_local(batches, cluster=clusters.get(dp))
    args = (model, batches, F.mse_loss, optimizer, dp, 4, fragments)
    losses, reps = streaming_diloco_reference(*args, nesterov_outer(0.7, 0.9), warmup, delay, mix, pattern, quantize)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    for r, got in enumerate(_replicas(res, dp)):
        _close(got, reps[r], f"replica {r}")
    held = res.features[0]["sync"]["fragments"][0]
    if pattern == "strided":
        blocks = [["layers.0.weight", "layers.0.bias"], ["layers.1.weight", "layers.1.bias"],
                  ["layers.2.weight", "layers.2.bias"], ["out.weight", "out.bias"]]
        assert held == [[k for b in blocks[f::fragments] for k in b] for f in range(fragments)]
    if quantize:
        _, plain = streaming_diloco_reference(*args, nesterov_outer(0.7, 0.9), warmup, delay, mix, pattern)
        assert max((plain[0][k] - reps[0][k]).abs().max().item() for k in reps[0]) > 1e-6


@pytest.mark.numerics
def test_e3m0_grid_on_hand_picked_numbers():
    """The 4-bit grid (scale = the largest magnitude, 8 here: 0, 0.125, 0.25, ..., 8; nearest, a tie upward: -6 to
    -8, 3 to 4, 0.0625 to 0.125) on numbers whose codes are known by hand, fxpar's quantizer and the reference's
    search alike; the wire buffer round-trips."""
    from fxpar.sync import quantize as Q
    from fxpar.testing.sync import e3m0_reference
    x = torch.tensor([8.0, -6.0, 5.9, 3.0, 2.9, -1.0, 0.18, 0.0625, 0.06, 0.0, -0.1], dtype=torch.float64)
    want = torch.tensor([8.0, -8.0, 4.0, 4.0, 2.0, -1.0, 0.125, 0.125, 0.0, 0.0, -0.125], dtype=torch.float32)
    codes, scale = Q.quantize(x)
    assert scale.item() == 8.0 and scale.dtype == torch.float32
    assert codes.tolist() == [7, 15, 6, 6, 5, 12, 1, 1, 0, 0, 9]
    assert torch.equal(Q.dequantize(codes, scale), want)
    assert torch.equal(e3m0_reference(x), want)
    y = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(Q.dequantize(*Q.quantize(y)), e3m0_reference(y))
    buf = Q.encode([x, y])
    assert buf.dtype == torch.uint8 and buf.numel() == Q.wire_bytes(11) + Q.wire_bytes(35) == 4 + 6 + 4 + 18
    a, b = Q.decode(buf, [x.shape, y.shape])
    assert torch.equal(a, want) and torch.equal(b, e3m0_reference(y))
    assert torch.equal(Q.dequantize(*Q.quantize(torch.zeros(3))), torch.zeros(3))


@pytest.mark.numerics
def test_checkpoint_with_a_quantized_fragment_in_flight_resumes_bitwise(clusters, tmp_path):
    """Strided, E3M0, delay 1: fragment 0's gathered buffers saved after step 4 while in flight; 3 more steps
    resumed == 8 straight, bitwise, per replica."""
    model, batches = _blocks_model(), mlp_batches(8)
    method = S.DiLoCo(period=4, outer=NESTEROV, fragments=2, delay=1, mix=0.5, pattern="strided", quantize="e3m0")
    straight, _, resumed = assert_resume_is_exact(_program(model, batches, method), batches, 5,
                                                  clusters.get(2), tmp_path / "ck")
    _assert_replicas_equal(straight, resumed)


@pytest.mark.structure
def test_quantized_plan_prices_the_gathered_bytes():
    """The Plan carries pattern and quantize; each fragment's AVERAGE on the schedule and the estimate count the
    4-bit bytes (per tensor a float32 scale and its codes two to a byte), all-gathered; explain names both byte
    counts and which blocks each strided fragment holds."""
    from fxpar.sync.quantize import wire_bytes
    model, batches = _blocks_model(), mlp_batches(1)
    method = S.DiLoCo(period=4, outer=NESTEROV, fragments=2, pattern="strided", quantize="e3m0")
    prog = _program(model, batches, method)
    assert method_of(fxpar.Plan.from_json(prog.plan.to_json()).section("sync")) == method
    assert {"pattern", "quantize"}.isdisjoint(S.DiLoCo(period=4).to_dict())
    params = dict(model.named_parameters())
    frags = method.fragment_keys(list(params))
    sent = [sum(wire_bytes(params[k].numel()) for k in ks) for ks in frags]
    plain = [sum(params[k].numel() * 8 for k in ks) for ks in frags]
    lines = str(prog.schedule(0)).splitlines()
    assert lines[2:] == [f"  step 0: AVERAGE0.0 ({sent[0]} bytes all-gathered in E3M0, {plain[0]} unquantized) "
                         "OUTER0.0", "  step 1: -", f"  step 2: AVERAGE0.1 ({sent[1]} bytes all-gathered in E3M0, "
                         f"{plain[1]} unquantized) OUTER0.1", "  step 3: -"]
    assert prog.estimate().ranks[0].comm_bytes == sum(sent) // 4
    rows = prog.plan.section("sync").stages[0]
    assert sum(r["window_bytes"] for r in rows) == sum(sent) and sum(r["plain_bytes"] for r in rows) == sum(plain)
    assert all(r["declared"][0][0] == "all_gather" for r in rows)
    text = prog.explain()
    assert f"{sum(sent)} bytes per rank per window of 4 step(s)" in text and f"{sum(plain)} unquantized" in text
    assert "fragment 0 (strided): blocks layers.0, layers.2" in text
    assert "fragment 1 (strided): blocks layers.1, out" in text
