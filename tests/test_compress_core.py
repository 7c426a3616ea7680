"""The compression road (fxpar/compress): the Feature every method rides on, its Plan section, pass, rank runtime,
checkpoints and bytes, shown with FP16 / BF16 against torch's DDP comm hooks, and TopK / RandomK's bytes."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

import fxpar
from cost_models.comm import collective_cost, comm_info_cost
from fxpar.testing.compress import mlp_batches, mlp_program
from fxpar import compress as C
from fxpar import meta as M
from fxpar.compress.feature import STEADY_STEP, bucket_infos
from fxpar.compress.method import BucketInfo
from fxpar.compress.runtime import generator_for, kept_sum
from fxpar.collectives import C10D
from fxpar.testing import MLP
from fxpar.testing.compress import ddp_hook_worker

SGD = (torch.optim.SGD, {"lr": 0.1})


def _model(layers=2):
    torch.manual_seed(0)
    return MLP(layers=layers).double()


def _batches(n, batch=8):
    return mlp_batches(n, batch)


def _program(model, batches, **strategy):
    return mlp_program(model, batches, **strategy)


# ---- against torch's own DDP comm hooks ------------------------------------------------------------------------
@pytest.mark.numerics
@pytest.mark.parametrize("method,hook", [(C.FP16(), "fp16_compress_hook"), (C.BF16(), "bf16_compress_hook")],
                         ids=["fp16", "bf16"])
def test_narrow_dtype_equals_ddp_with_torchs_hook(clusters, method, hook):
    """The MLP in one DDP bucket, dp=2: fxpar's buckets cast, all-reduced and cast back as torch's hook does them."""
    model, batches = _model(), _batches(4)
    prog = _program(model, batches, dp=2, grad_sync=method)
    res = prog.run_local(batches, cluster=clusters.get(2))
    ddp = clusters.get(2).run(ddp_hook_worker, [(model, batches, F.mse_loss, SGD, hook)] * 2)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ddp[0]["losses"]), rtol=1e-10, atol=1e-10)
    state = res.state_dict()
    for k, v in ddp[0]["state"].items():
        torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-10, msg=k)
    # the narrow dtype changed the math: not plain data parallelism
    plain = _program(model, batches, dp=2).run_local(batches, cluster=clusters.get(2)).state_dict()
    assert max((state[k] - plain[k]).abs().max().item() for k in plain) > 1e-8


# ---- an eager method: sum runs as Python each step, its dist.* calls counted ------------------------------------
@dataclass(frozen=True)
class EagerSum(C.Method):
    """Plain all-reduce through torch.distributed, run eagerly (as a DDP comm hook runs)."""
    name: ClassVar[str] = "eager_sum_test"
    eager: ClassVar[bool] = True

    def sum(self, flat, state, inputs, bucket, comm, variant):
        assert isinstance(comm, C.EagerComm) and comm.size == 2 and comm.rank == bucket.dp_rank
        return comm.all_reduce(flat), state

    def wire_bytes(self, bucket, variant):
        return bucket.numel * bucket.element_size


@pytest.fixture
def eager_method():
    C.register_method(EagerSum)
    yield EagerSum
    C.unregister_method(EagerSum.name)


@pytest.mark.numerics
def test_an_eager_method_runs_on_the_ranks_group_and_is_counted(clusters, eager_method):
    model, batches = _model(layers=3), _batches(2)
    plain = _program(model, batches, dp=2, bucket_cap_mb=0.004)
    prog = _program(model, batches, dp=2, bucket_cap_mb=0.004, grad_sync=eager_method())
    rows = prog.plan.section("eager_sum_test").stages[0]
    assert len(rows) >= 2 and all(r["collectives"] == [] for r in rows)      # not traced: known when it runs
    want = [("all_reduce", r["wire_bytes"]) for r in rows]
    assert [(c.kind, c.nbytes) for c in prog.collectives(0)] == want
    assert want == [(c.kind, c.nbytes) for c in plain.collectives(0)]
    res = prog.run_local(batches, cluster=clusters.get(2), measure_comm=True)
    assert res.comm_calls[0] == res.comm_calls[1] == [want] * len(batches)     # dist.all_reduce: c10d ops, counted
    ref = plain.run_local(batches, cluster=clusters.get(2))
    assert res.losses == ref.losses
    for k, v in ref.state_dict().items():
        assert torch.equal(res.state_dict()[k], v), k


# ---- bytes: measured == wire_bytes == the section == estimate == explain() ----------------------------------------
@pytest.mark.numerics
@pytest.mark.parametrize("method,kind", [(C.FP16(), "all_reduce"), (C.TopK(ratio=0.05), "all_gather"),
                                         (C.RandomK(ratio=0.2, error_feedback=True), "all_gather")],
                         ids=["fp16", "topk", "randomk"])
def test_collectives_and_bytes_per_bucket(clusters, method, kind):
    model, batches = _model(layers=3), _batches(2)
    prog = _program(model, batches, dp=2, bucket_cap_mb=0.004, grad_sync=method)
    sec = prog.plan.section(method.name)
    rows = sec.stages[0]
    assert len(rows) >= 2                                          # several buckets, one call each
    infos = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    wire = [method.wire_bytes(b, None) for b in infos]
    assert [r["wire_bytes"] for r in rows] == wire
    assert [r["collectives"] for r in rows] == [[[kind, w]] for w in wire]     # one collective per bucket, traced
    assert [(c.kind, c.nbytes) for c in prog.collectives(0)] == [(kind, w) for w in wire]
    text = prog.explain()
    assert [int(x) for x in re.findall(r"wire_bytes=(\d+)", text)] == wire
    assert prog.estimate().ranks[0].comm_bytes == pytest.approx(sum(wire))
    res = prog.run_local(batches, cluster=clusters.get(2), measure_comm=True)
    for r in range(2):                         # measured on each rank, each step: the bucket sums' collectives alone
        assert res.comm_calls[r] == [[(kind, w) for w in wire]] * len(batches)


@pytest.mark.structure
def test_wire_bytes_formulas():
    model, batches = _model(), _batches(1)
    prog = _program(model, batches, dp=2, grad_sync="topk")
    (b,) = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    assert b.numel == sum(p.numel() for p in model.parameters()) and b.dtype == "float64"
    k = max(1, round(0.01 * b.numel))
    assert C.TopK().wire_bytes(b, None) == k * (4 + 8)            # int32 index + float64 value per pair
    assert C.RandomK(ratio=1.0).wire_bytes(b, None) == b.numel * 12
    assert C.FP16().wire_bytes(b, None) == C.BF16().wire_bytes(b, None) == 2 * b.numel


# ---- the Strategy, the Plan section, explain(), estimate ------------------------------------------------------------
@pytest.mark.structure
def test_strategy_prints_and_plan_round_trips():
    s = fxpar.Strategy(dp=2, grad_sync=C.TopK(ratio=0.1))
    assert str(s) == "Strategy(dp=2, tp=1, pp=1, grad_sync=TopK(ratio=0.1, error_feedback=True))"
    assert repr(s) == "Strategy(dp=2, grad_sync=TopK(ratio=0.1, error_feedback=True))"
    assert s == fxpar.Strategy(dp=2, grad_sync=C.TopK(ratio=0.1)) != fxpar.Strategy(dp=2, grad_sync="topk")
    model, batches = _model(), _batches(1)
    prog = _program(model, batches, dp=2, grad_sync=C.TopK(ratio=0.1))
    sec = prog.plan.section("topk")
    assert sec.method == {"method": "topk", "ratio": 0.1, "error_feedback": True}
    assert "topk: gradient buckets compressed by 'topk' (ratio=0.1, error_feedback=True)" in str(prog.plan)
    # the plan says, for the run at hand, that training differs from one process on purpose
    assert ("grad_sync: TopK(ratio=0.1, error_feedback=True) -- each update uses this method's estimate of the dp sum"
            in "\n".join(prog.plan.notes)) and "note: grad_sync: TopK(" in prog.explain()
    plan = fxpar.Plan.from_json(prog.plan.to_json())
    assert plan == prog.plan and isinstance(plan.section("topk"), C.CompressSection)
    # a handed-back Plan's section is the method that runs: its options win over the Strategy's
    plan.section("topk").method["ratio"] = 0.5
    again = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=F.mse_loss, optimizer=SGD,
                              strategy=fxpar.Strategy(dp=2, grad_sync=C.TopK(ratio=0.1)), plan=plan)
    n = sec.stages[0][0]["numel"]
    assert again.plan.section("topk").stages[0][0]["wire_bytes"] == round(0.5 * n) * 12
    # a string is the method's defaults
    assert _program(model, batches, dp=2, grad_sync="topk").plan.section("topk").method["ratio"] == 0.01


@pytest.mark.structure
def test_explain_and_state_bytes():
    model, batches = _model(), _batches(1)
    prog = _program(model, batches, dp=2, grad_sync=C.TopK(ratio=0.1))
    text = prog.explain()
    assert "Aji & Heafield, EMNLP 2017" in text and "int32 index + float64 value pairs, one all-gather" in text
    numel = sum(p.numel() for p in model.parameters())
    assert prog.estimate().ranks[0].memory_breakdown["feature topk"] == 8 * numel       # the float64 residuals
    no_ef = _program(model, batches, dp=2, grad_sync=C.TopK(ratio=0.1, error_feedback=False))
    assert "feature topk" not in no_ef.estimate().ranks[0].memory_breakdown
    graph = prog.graphs(0)
    code = next(iter(graph.values())).code
    assert "bucket_sum" in code and "all_reduce_" not in code


# ---- checkpoints ----------------------------------------------------------------------------------------------------
@pytest.mark.numerics
@pytest.mark.parametrize("method", [C.TopK(ratio=0.1), C.RandomK(ratio=0.3, error_feedback=True)],
                         ids=["topk", "randomk"])
def test_checkpoint_resumes_bitwise(clusters, tmp_path, method):
    """3 steps, save, a fresh program loads and trains 3 more == 6 steps straight, bitwise: the residuals, the step
    counters and the generator are in the checkpoint."""
    model, batches = _model(), _batches(6)
    straight = _program(model, batches, dp=2, grad_sync=method).run_local(batches, cluster=clusters.get(2))
    _program(model, batches, dp=2, grad_sync=method).run_local(batches[:3], cluster=clusters.get(2),
                                                               save_to=tmp_path / "ck")
    resumed = _program(model, batches, dp=2, grad_sync=method).run_local(batches[3:], cluster=clusters.get(2),
                                                                         resume_from=tmp_path / "ck")
    assert resumed.losses == straight.losses[3:]
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    # without the method's state the rest of the run is another one: the checkpoint's state matters
    restart = _program(model, batches, dp=2, grad_sync=method).run_local(batches[3:], cluster=clusters.get(2))
    assert restart.losses != straight.losses[3:]


# ---- bad input ------------------------------------------------------------------------------------------------------
@pytest.mark.structure
@pytest.mark.parametrize("cls", [C.TopK, C.RandomK])
@pytest.mark.parametrize("ratio", [0, 1.5, -0.1, True])
def test_ratio_outside_0_1_is_refused(cls, ratio):
    with pytest.raises(fxpar.StrategyError, match=rf"{cls.__name__}\(ratio={ratio!r}\).*\(0, 1\]"):
        fxpar.Strategy(dp=2, grad_sync=cls(ratio=ratio))


@pytest.mark.structure
def test_conflicts_name_both_features():
    with pytest.raises(fxpar.StrategyError, match=r"feature 'topk' \(grad_sync=TopK.*conflicts with feature 'zero' "
                                                  r"\(zero=1"):
        fxpar.Strategy(dp=2, zero=1, grad_sync=C.TopK())
    with pytest.raises(fxpar.StrategyError, match=r"feature 'fp16' \(grad_sync='fp16'\) conflicts with feature "
                                                  r"'tensor_parallel'"):
        fxpar.Strategy(dp=2, tp=2, grad_sync="fp16")


@pytest.mark.structure
def test_dp_1_and_unknown_methods_are_refused():
    with pytest.raises(fxpar.StrategyError, match=r"grad_sync=TopK.*needs dp >= 2 \(dp=1\)"):
        fxpar.Strategy(dp=1, grad_sync=C.TopK())

    class Unregistered(C.Method):
        name = "unregistered"
    with pytest.raises(fxpar.StrategyError, match=r"grad_sync=.*'topk'"):
        fxpar.Strategy(dp=2, grad_sync=Unregistered())
    with pytest.raises(fxpar.StrategyError, match=r"unknown option\(s\) \['rank'\]"):
        C.TopK.from_dict({"method": "topk", "rank": 2})
    with pytest.raises(TypeError, match="subclass of fxpar.compress.Method"):
        C.register_method(int)


@pytest.mark.structure
def test_the_sum_runs_where_the_all_reduce_was_issued():
    """Fused one-stage step: in backward's place in the one graph. Microbatches: in REDUCE_GRAD (once per step,
    after accumulation), the step reading its result."""
    model, batches = _model(), _batches(1)
    call = "fxpar_compress_runtime_bucket_sum("
    whole = _program(model, batches, dp=2, grad_sync="topk").graphs(0)
    assert len(whole) == 1 and next(iter(whole.values())).code.count(call) == 1
    split = _program(model, batches, dp=2, microbatches=2, grad_sync="topk").graphs(0)
    assert [k for k, g in split.items() if call in g.code] == ["stage0.REDUCE_GRAD"]
    assert split["stage0.REDUCE_GRAD"].code.count(call) == 1


@pytest.mark.structure
@pytest.mark.slow
def test_a_weight_tied_across_stages_keeps_its_all_reduce():
    """dp=2 x pp=2 on a GPT whose embedding and head are tied across the stages: the buckets summed over dp are
    compressed, the tied weight's bucket (summed over the two stages' ranks) keeps its plain all-reduce."""
    from fxpar.testing import TinyGPT, flat_gpt_loss, tiny_gpt_batches
    torch.manual_seed(0)
    model, batches = TinyGPT().double(), tiny_gpt_batches(1)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(4), batches[0], loss_fn=flat_gpt_loss, optimizer=SGD,
                             strategy=fxpar.Strategy(dp=2, pp=2, microbatches=2, grad_sync="topk"))
    sec = prog.plan.section("topk")
    dp_sec = prog.plan.section("data_parallel")
    for s in range(2):
        assert len(sec.stages[s]) >= 1
        tied = [i for i in range(len(dp_sec.buckets[s])) if i not in [r["bucket"] for r in sec.stages[s]]]
        assert tied and all("wte.weight" in dp_sec.buckets[s][i] or "head.weight" in dp_sec.buckets[s][i]
                            for i in tied)
        kinds = [c.kind for c in prog.collectives(2 * s)]
        assert kinds.count("all_gather") == len(sec.stages[s]) and kinds.count("all_reduce") == len(tied)


@pytest.mark.structure
def test_the_estimate_counts_the_methods_compute():
    """The cost models see the compress / decompress work of each bucket's traced sum (its aten ops, flops and
    bytes, on the call that replaced the all-reduce) beside its wire bytes."""
    model, batches = _model(), _batches(1)
    prog = _program(model, batches, dp=2, grad_sync=C.TopK(ratio=0.1))
    row = prog.plan.section("topk").stages[0][0]
    ops, flops, nbytes = row["compute"]
    assert ops > 3 and flops > 0 and nbytes >= 8 * row["numel"]        # topk reads the whole float64 bucket at least
    calls = [n for gm in prog.graphs(0).values() for n in gm.graph.nodes if M.get(n, M.INNER_COMPUTE) is not None]
    classes = tuple(tuple(c) for c in row["compute_classes"])
    assert [M.get(n, M.INNER_COMPUTE) for n in calls] == [(ops, flops, nbytes, 1, classes)]
    assert sum(f for _, f, _ in classes) == flops and sum(b for _, _, b in classes) == nbytes
    dev = prog.cluster.device
    plain = _program(model, batches, dp=2).estimate().ranks[0].compute_time_s
    assert prog.estimate().ranks[0].compute_time_s - plain >= ops * dev.op_overhead_s


@pytest.mark.structure
def test_the_estimate_prices_powersgds_narrow_matmuls_at_their_own_efficiency():
    """PowerSGD's P = M Q and Q = M^T P have as many columns as the rank: class "matmul_narrow" in the row's
    compute_classes (2 n m r FLOPs each per n x m matrix, beside the orthogonalisation's small products; the
    estimate P Q^T is a plain matmul where m > 16), and estimate() prices them at efficiency["matmul_narrow"] where
    the device has one (CPU kernels run them far below a square matmul's rate), as a matmul where it has none; the
    other classes are priced as before, so the compute time moves by the narrow matmuls' time alone."""
    from dataclasses import replace
    from cost_models.compute import OpCost, node_time
    model, batches = _model(), _batches(1)
    method = C.PowerSGD(rank=1, start_iter=2, min_compression_rate=0.5)

    def prog(cluster):
        return fxpar.parallelize(model, cluster, batches[0], loss_fn=F.mse_loss,
                                 optimizer=(torch.optim.SGD, {"lr": 0.1}), strategy=fxpar.Strategy(dp=2, grad_sync=method))
    base = fxpar.ClusterSpec.local(2)
    slow = replace(base, device=replace(base.device, efficiency={**(base.device.efficiency or {}),
                                                                 "matmul_narrow": 0.01}))
    plain, narrow = prog(base), prog(slow)
    rows = narrow.plan.section("powersgd").stages[0]
    mats = [s for r in rows for s in (tuple(x) for x in bucket_infos(narrow.plan, 0, narrow.stages[0].captured)[
        rows.index(r)].shapes) if len(s) == 2]
    classes = [dict((k, (f, b)) for k, f, b in r["compute_classes"]) for r in rows]
    assert sum(c["matmul_narrow"][0] for c in classes if "matmul_narrow" in c) >= sum(2 * 2 * n * m for n, m in mats)
    assert sum(c["matmul"][0] for c in classes if "matmul" in c) == sum(2 * n * m for n, m in mats if m > 16)
    extra = sum(node_time(OpCost(*c["matmul_narrow"], "matmul_narrow", ""), slow.device)
                - node_time(OpCost(*c["matmul_narrow"], "matmul", ""), base.device) for c in classes
                if "matmul_narrow" in c)
    assert extra > 0
    got = narrow.estimate().ranks[0].compute_time_s - plain.estimate().ranks[0].compute_time_s
    assert got == pytest.approx(extra, rel=1e-9)


def _log2_ceil(x):
    return max(1, (int(x) - 1).bit_length())


@pytest.mark.structure
@pytest.mark.parametrize("method", [C.TopK(ratio=0.1), C.RandomK(ratio=0.1), C.QSGD(levels=4), C.ALQ(bits=3)],
                         ids=["topk", "randomk", "qsgd", "alq"])
def test_the_estimate_prices_selection_search_and_draws_at_their_own_efficiency(method):
    """A sum's element-by-element ops are classes of their own in the row's compute_classes: TopK's selection
    (``topk``: ``n log2 k``), a quantizer's level search (``search``: ``n log2(levels + 1)``) and look-ups
    (``gather``), and the draws the method makes on the host at each sum's begin (``Method.host_inputs``, costed as
    they run: RandomK's ``dp`` permutations of the bucket, ``randperm``; a quantizer's uniforms, ``random``, one
    per value). estimate() prices each at the device's efficiency for the class, so the compute time moves by those
    classes' time alone."""
    from dataclasses import replace
    from cost_models.compute import SELECTION_CLASSES, OpCost, node_time
    model, batches = _model(), _batches(1)

    def prog(cluster):
        return fxpar.parallelize(model, cluster, batches[0], loss_fn=F.mse_loss,
                                 optimizer=(torch.optim.SGD, {"lr": 0.1}), strategy=fxpar.Strategy(dp=2, grad_sync=method))
    base = fxpar.ClusterSpec.local(2)
    slow = replace(base, device=replace(base.device, efficiency={**(base.device.efficiency or {}),
                                                                 **{c: 1e-4 for c in SELECTION_CLASSES}}))
    plain, priced = prog(base), prog(slow)
    rows = priced.plan.section(method.name).stages[0]
    classes = [dict((k, (f, b)) for k, f, b in r["compute_classes"]) for r in rows]
    for r, c in zip(rows, classes):
        n = r["numel"]
        if isinstance(method, C.TopK):
            assert c["topk"][0] == n * _log2_ceil(round(0.1 * n))
        elif isinstance(method, C.RandomK):
            assert c["randperm"][0] == 2 * n and "topk" not in c          # dp = 2 draws of the whole bucket
        else:
            s = method._s()
            # a uniform per value, and the dp seeds of the ranks' generators (quantize.rank_generator)
            assert c["random"][0] == n + 2 and c["search"][0] == n * _log2_ceil(s + 2)
            assert c["gather"][0] >= n                                        # the levels of the codes decoded
    extra = sum(node_time(OpCost(*c[k], k, ""), slow.device) - node_time(OpCost(*c[k], k, ""), base.device)
                for c in classes for k in SELECTION_CLASSES if k in c)
    assert extra > 0
    got = priced.estimate().ranks[0].compute_time_s - plain.estimate().ranks[0].compute_time_s
    assert got == pytest.approx(extra, rel=1e-9)


@pytest.mark.structure
@pytest.mark.parametrize("method", [C.PowerSGD(rank=1, start_iter=2, min_compression_rate=0.5), C.ByteGrad(),
                                    C.TopK(ratio=0.1)], ids=["powersgd", "bytegrad", "topk"])
def test_the_estimate_costs_each_collective_of_a_bucket_sum(method):
    """A bucket sum that issues k collectives (PowerSGD: P and Q all-reduced, the whole tensors a third where the
    bucket holds some; ByteGrad: an all-to-all and an all-gather) pays k latency terms, each collective at its own algorithm's factor: the
    estimate's communication time is the sum of cost_models' formula per collective of the traced sums."""
    model, batches = _model(layers=3), _batches(1)
    prog = _program(model, batches, dp=2, bucket_cap_mb=0.004, grad_sync=method)
    rows = prog.plan.section(method.name).stages[0]
    infos = prog.collectives(0)
    assert len(rows) >= 2 and len(infos) == len(rows)            # the bucket sums are the step's only collectives
    cluster = prog.cluster
    want = 0.0
    for info, row in zip(infos, rows):
        per = [collective_cost(kind, nbytes, info.ranks, cluster) for kind, nbytes in row["collectives"]]
        assert sum(n for _, n in row["collectives"]) == row["wire_bytes"] == info.nbytes
        assert comm_info_cost(info, cluster).time_s == pytest.approx(sum(c.time_s for c in per), rel=1e-12)
        want += sum(c.time_s for c in per)
        if len(per) > 1:    # one collective of all the bytes would pay one latency: less than the k collectives
            assert len(info.parts) == len(per)
            one = collective_cost(row["collectives"][0][0], info.nbytes, info.ranks, cluster).time_s
            assert sum(c.time_s for c in per) > one
    assert max(len(r["collectives"]) for r in rows) == {"powersgd": 2, "bytegrad": 2, "topk": 1}[method.name]
    assert prog.estimate().ranks[0].comm_time_s == pytest.approx(want, rel=1e-12)


@pytest.mark.structure
def test_an_eager_method_declares_its_collectives_to_the_estimate(eager_method):
    """An eager method's sum is not traced: the cost models count what it declares (Method.collectives; the default
    is one all-reduce of wire_bytes)."""
    model, batches = _model(), _batches(1)
    prog = _program(model, batches, dp=2, grad_sync=eager_method())
    (row,) = prog.plan.section(eager_method.name).stages[0]
    assert row["collectives"] == [] and row["declared"] == [["all_reduce", row["wire_bytes"]]]
    (info,) = prog.collectives(0)
    assert (info.kind, info.nbytes, info.parts) == ("all_reduce", row["wire_bytes"], ())

    C.register_method(DeclaredSum)        # a subclass with a name of its own: its feature alone is enabled
    try:
        prog2 = _program(model, batches, dp=2, grad_sync=DeclaredSum())
        (info2,) = prog2.collectives(0)
        half = row["wire_bytes"] // 2
        assert info2.parts == (("reduce_scatter", 2 * half), ("all_gather", half))
        cl = prog2.cluster
        assert prog2.estimate().ranks[0].comm_time_s == pytest.approx(
            sum(collective_cost(k, n, info2.ranks, cl).time_s for k, n in info2.parts), rel=1e-12)
    finally:
        C.unregister_method(DeclaredSum.name)


@dataclass(frozen=True)
class DeclaredSum(EagerSum):
    """An eager method that declares its collectives: a reduce-scatter, then an all-gather of the half."""
    name: ClassVar[str] = "declared_sum_test"

    def collectives(self, bucket, variant):
        half = self.wire_bytes(bucket, variant) // 2
        return [("reduce_scatter", 2 * half), ("all_gather", half)]


@pytest.mark.structure
def test_a_traced_sum_is_kept_per_method_options_bucket_and_variant():
    """A bucket's sum is traced once per process for its method's options, the bucket and the variant: planning the
    same bucket again reuses the graph; other options or another bucket trace their own."""
    b = BucketInfo(stage=0, index=0, count=1, keys=("w",), shapes=((8, 8),), offsets=(0,), numel=64, dtype="float64",
                   dp=2)

    def traced(m, b):
        state = dict(m.init_state(b, generator_for(m)))
        v = m.variant(b, STEADY_STEP, state)
        inputs = list(m.host_inputs(b, 0, state, v, generator_for(m)))
        return kept_sum(m, b, v, torch.zeros(b.numel, dtype=torch.float64), state, inputs, sorted(state))

    g = traced(C.TopK(ratio=0.25), b)
    assert traced(C.TopK(ratio=0.25), b) is g
    other = traced(C.TopK(ratio=0.5), b)
    wider = traced(C.TopK(ratio=0.25), dataclasses.replace(b, shapes=((8, 16),), numel=128))

    def gathered(gm):           # the values each collective of the sum hands over
        return [n.args[0].meta["val"].numel() for n in gm.graph.nodes
                if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"
                and n.target is not C10D.wait_tensor.default]
    assert gathered(other) == [2 * x for x in gathered(g)] == gathered(wider)
