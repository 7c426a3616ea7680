"""Strategy(compile=True): every per-rank graph through torch._inductor (fxpar.features.compile).

Numerics: compiled runs against eager fxpar on the same program (float64 to 1e-10: inductor's C++ kernels sum
reductions in their own order, about 1e-12 apart here; float32 to rtol 1e-4), per graph kind. Structure: the ranks
issue the same collectives, in the same order with the same bytes, compiled and eager; inductor's code keeps the
issue-to-wait windows of the FX graph (the fused dp step; the code rank 0 ran for dp with microbatches, ZeRO-3 and
Megatron tp=2, by tests/test_compile_windows.py's check). ``compile="auto"``: the cost model's decision on a CPU
ClusterSpec and a GPU preset (meta models, nothing run), its Plan section through JSON, the fusion model on a small
graph, and one run where it compiles. Bad input: an option value that is not True/False/"auto", compile_steps
without "auto", no C++ compiler, a graph that does not compile. Compile time dominates: tiny models, cases that share
shapes so inductor's cache serves kernels across them, and all but one numerics case are ``slow``.
"""
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import cost_models
import fxpar
import fxpar.features.compile as comp
from cost_models import fusion
from cost_models.compute import OpCost, node_cost, node_time
from fxpar.collectives import C10D, is_wait
from fxpar.runtime.launch import local_threads
from fxpar.testing import GPT, MLP, gpt_loss, max_abs_diff, tiny_gpt
from test_compile_windows import check_windows

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2})


def _batches(steps=2, dtype=None, rows=4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 32, (rows, 8), generator=g), torch.randint(0, 32, (rows, 8), generator=g))
            for _ in range(steps)]


def _both(clusters, strategy: dict, opt=ADAMW, dtype=torch.float64, compile=True, rows=4, **run):
    """The same tiny GPT program eager and compiled (``compile``: True, or "auto" where it picks inductor) on batches
    of ``rows`` sequences; returns ``(eager result, compiled result, compiled program)``."""
    batches = _batches(rows=rows)
    out = []
    for flag in (False, compile):
        model = tiny_gpt(layers=1).to(dtype)
        n = strategy.get("dp", 1) * strategy.get("tp", 1) * strategy.get("pp", 1)
        prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(n), batches[0], loss_fn=gpt_loss, optimizer=opt,
                                 strategy=fxpar.Strategy(compile=flag, **strategy))
        out.append((prog, prog.run_local(batches, cluster=clusters.get(n), measure_comm=True, **run)))
    (_, eager), (prog, compiled) = out
    for rank, feats in compiled.features.items():       # every graph of every rank compiled
        assert feats["compile"] and all(g["compiled"] for g in feats["compile"].values()), (rank, feats["compile"])
    return eager, compiled, prog


def _close64(eager, compiled):
    for a, b in zip(eager.losses, compiled.losses):
        assert abs(a - b) <= 1e-10 * max(1.0, abs(a))
    assert max_abs_diff(compiled.state_dict(), eager.state_dict()) <= 1e-10
    assert compiled.comm_calls == eager.comm_calls        # same collectives, order and bytes on every rank


# ---- numerics and structure, per graph kind ----------------------------------------------------------------
@pytest.mark.numerics
def test_fused_step_dp2_float64_matches_eager_and_keeps_collective_windows(clusters):
    eager, compiled, prog = _both(clusters, {"dp": 2, "bucket_cap_mb": 0.004})
    _close64(eager, compiled)
    assert len(eager.comm_calls[0][0]) > 1                # several buckets: several windows to keep
    # inductor's code issues the buckets' all_reduces and waits them in the FX graph's order (each wait as late as
    # the pass placed it: inductor's peak-memory reordering would pull it up to its issue), with compute in between
    gm = prog.graphs(0)["step"]
    fx = ["I" if n.target is C10D.all_reduce_.default else "W" for n in gm.graph.nodes
          if n.op == "call_function" and (n.target is C10D.all_reduce_.default or is_wait(n))]
    code = compiled.features[0]["compile"]["step"]["code"].split("def call(")[1]
    got = re.findall(r"_c10d_functional\.(all_reduce_|wait_tensor)\.default|^ *(?:cpp_fused_\w+|extern_kernels\.\w+)\(",
                     code, flags=re.M)
    seq = ["I" if g == "all_reduce_" else "W" if g == "wait_tensor" else "c" for g in got]
    assert [x for x in seq if x != "c"] == fx and fx.index("W") > 1
    first_wait = seq.index("W")
    assert seq[:first_wait].count("c") > 0 and seq[seq.index("I"):first_wait].count("c") > 0   # overlap survives
    # every rank's kernels are made for the CPU threads the rank runs with (run_local's share of the cores): an
    # OpenMP region names no other count
    for feats in compiled.features.values():
        for g in feats["compile"].values():
            assert g["threads"] == local_threads(2)
            assert set(re.findall(r"omp parallel num_threads\((\d+)\)", g["code"])) <= {str(local_threads(2))}
    # AdamW's bias corrections (1 - beta1 ** step, 1 - beta2 ** step) are computed once a step, not in the loop of
    # every parameter
    assert compiled.features[0]["compile"]["step"]["code"].count("std::pow") == 2
    # the Program shows the same code without a run: compiled here from the graph's shapes, each collective naming
    # its Plan group where the rank's names its process group
    shown = prog.compiled_code(0, "step")
    ran = compiled.features[0]["compile"]["step"]["code"]
    named = re.compile(r"(_c10d_functional\.all_reduce_\.default\(.*, 'sum', )'([^']+)'\)$", flags=re.M)
    names = {m.group(2) for m in named.finditer(ran)}
    assert len(names) == 1 and {m.group(2) for m in named.finditer(shown)} == {"fxpar:dp"}
    # the first line names inductor's count of the graphs its process compiled so far ("# AOT ID: ['3_inference']"),
    # which differs between this process and the rank's where other tests compiled before
    aot = re.compile(r"\A# AOT ID: \['\d+_inference'\]\n")
    assert aot.match(shown) and aot.match(ran)
    assert aot.sub("", shown) == aot.sub("", named.sub(r"\1'fxpar:dp')", ran))
    assert prog.compiled_code(0) == {"step": shown}


@pytest.mark.numerics
@pytest.mark.slow
def test_auto_compiles_the_tiny_gpt_on_cpu_and_matches_eager(clusters):
    # the tiny GPT's step is its ops' dispatch: the model predicts about 0.2x compiled (the same graphs as the
    # compile=True case above, so inductor's cache serves them)
    eager, compiled, prog = _both(clusters, {"dp": 2, "bucket_cap_mb": 0.004}, compile="auto")
    sec = prog.plan.section("compile")
    assert sec.backend == "inductor" and sec.compiled_s < (1 - comp.AUTO_MARGIN) * sec.eager_s
    _close64(eager, compiled)
    again = fxpar.parallelize(tiny_gpt(layers=1).double(), fxpar.ClusterSpec.local(2), _batches()[0], loss_fn=gpt_loss,
                              optimizer=ADAMW, plan=fxpar.Plan.from_json(prog.plan.to_json()))
    assert again.plan.section("compile") == sec and again.graphs(0)["step"].code == prog.graphs(0)["step"].code


@pytest.mark.numerics
@pytest.mark.slow
def test_fused_step_dp2_float32_within_tolerance(clusters):
    eager, compiled, _ = _both(clusters, {"dp": 2}, opt=SGD_M, dtype=torch.float32)
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-5, atol=0)
    got, ref = compiled.state_dict(), eager.state_dict()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert compiled.comm_calls == eager.comm_calls


@pytest.mark.numerics
@pytest.mark.slow
def test_compressed_dp_step_compiles_around_its_bucket_sums_and_matches_eager(clusters):
    """PowerSGD's step calls its bucket sums as Python functions (``bucket_sum`` / ``bucket_sum_wait``): the stretches
    of the step between them compile, the sums run between compiled code, and the run is eager's: losses, weights and
    every collective (P and Q of each bucket, in order, with their bytes) alike."""
    from fxpar import compress as C
    method = C.PowerSGD(rank=1, start_iter=1, error_feedback=False, warm_start=False, min_compression_rate=0.5)
    eager, compiled, prog = _both(clusters, {"dp": 2, "bucket_cap_mb": 0.004, "grad_sync": method})
    _close64(eager, compiled)
    report = compiled.features[0]["compile"]
    assert report["step"]["compiled"] == "in parts" and "bucket_sum" in report["step"]["why"]
    parts = sorted(lb for lb in report if lb.startswith("step.part"))
    calls = sum(1 for n in prog.graphs(0)["step"].graph.nodes if comp._python_call(n))
    assert calls > 2 and len(parts) > 2 and all(report[lb]["compiled"] is True for lb in parts), report


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("strategy, rows, windows", [
    ({"dp": 2, "microbatches": 2}, 8, True),                       # F, B, REDUCE_GRAD, STEP
    ({"pp": 2, "microbatches": 2, "schedule": "1f1b"}, 4, False),  # a pipeline: SEND/RECV between compiled graphs
    ({"pp": 2, "microbatches": 2, "schedule": "zb1p"}, 4, False),  # I and W
    ({"dp": 2, "zero": 3}, 4, True),                               # gathers and reduce-scatters in the step
    ({"tp": 2, "sharding": "megatron"}, 4, True),                  # tensor parallelism's gathers and all-reduces
], ids=["dp2_microbatches", "pp2_1f1b", "pp2_zb1p", "zero3", "tp2"])
def test_graph_kinds_float64_match_eager(clusters, strategy, rows, windows):
    # dp with microbatches on 8 rows: each rank's microbatch has the 2 rows of the pipelines' microbatches and of the
    # fused dp step's batch, so inductor's cache already holds about half of its kernels (inductor writes the shapes
    # into each kernel's C++)
    eager, compiled, prog = _both(clusters, strategy, rows=rows)
    _close64(eager, compiled)
    # the code rank 0 ran keeps every collective window of its graphs (tests/test_compile_windows.py): ZeRO-3's gathers
    # in the step, the buckets' all-reduces in REDUCE_GRAD, tp's in the step; the pipelines issue theirs between graphs
    checked = check_windows(prog, lambda label: compiled.features[0]["compile"][label]["code"])
    assert checked or not windows, "no graph of rank 0 issues a collective"


# ---- bad input -------------------------------------------------------------------------------------------------
def _mlp_program(**strategy):
    torch.manual_seed(0)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    model = MLP().double()
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(1), (x, y), loss_fn=F.mse_loss, optimizer=SGD_M,
                             strategy=fxpar.Strategy(**strategy)), [(x, y)]


@pytest.mark.structure
@pytest.mark.parametrize("value", [1, "inductor", None])
def test_compile_takes_true_false_or_auto(value):
    with pytest.raises(fxpar.StrategyError, match=r"compile=.*True.*False.*'auto'"):
        fxpar.Strategy(dp=2, compile=value)


@pytest.mark.structure
@pytest.mark.parametrize("kw, says", [
    ({"compile": True, "compile_steps": 100}, r"compile_steps is what compile='auto' weighs.*pass compile='auto'"),
    ({"compile": "auto", "compile_steps": 0}, r"compile_steps=0.*positive int"),
    ({"compile": "auto", "compile_steps": 2.5}, r"compile_steps=2.5.*positive int"),
])
def test_compile_steps_needs_auto_and_a_positive_int(kw, says):
    with pytest.raises(fxpar.StrategyError, match=says):
        fxpar.Strategy(dp=2, **kw)


# ---- compile="auto": the cost model's decision ---------------------------------------------------------------
def _meta_gpt_program(cluster, n, **strategy):
    """A GPT on the meta device (nothing allocated, nothing run), AdamW, ``Strategy(dp=n, **strategy)``."""
    with torch.device("meta"):
        model = GPT(vocab=2048, d=256, layers=2, heads=4, max_seq=64)
    x = torch.randint(0, 2048, (8 * n, 64), device="meta")
    return fxpar.parallelize(model, cluster, (x, x), loss_fn=gpt_loss, optimizer=ADAMW,
                             strategy=fxpar.Strategy(dp=n, **strategy))


@pytest.mark.cost
def test_fusion_model_counts_kernels_and_bytes_of_a_small_graph():
    # x @ w (a library kernel), then add, relu (fused with the sum that reads them) and sum: eager 4 aten ops; compiled
    # 2 kernels, and the fused region reads mm's result once and writes the sum, not add's and relu's results
    def f(x, w, b):
        return torch.relu(x @ w + b).sum(1)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(64, 32), torch.randn(32, 128), torch.randn(128))
    device = fxpar.ClusterSpec.local(1).device
    fc = fusion.fused_compute(gm, device)
    assert (fc.ops, fc.extern, fc.kernels, len(fc.regions)) == (4, 1, 2, 1)
    kinds, regions = fusion.regions(gm)
    flops, nbytes, kernels = fusion._region_cost(regions[0], {n: node_cost(n) for n in gm.graph.nodes}, kinds)
    assert nbytes == 4 * (64 * 128 + 128 + 64) and kernels == 1          # mm's result and b in, the sum out
    eager = sum(node_time(node_cost(n), device) + device.op_overhead_s for n in gm.graph.nodes
                if n.op == "call_function")
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    fused = node_time(OpCost(flops, nbytes, "elementwise", "fused"), device) * fusion.CODE_FACTOR["cpu"] \
        + fusion.CALL_S["cpu"]
    assert fc.eager_s == pytest.approx(eager) and fc.compiled_s == pytest.approx(
        node_time(node_cost(mm), device) + device.op_overhead_s + fused)


@pytest.mark.cost
def test_auto_compiles_on_a_gpu_preset_and_not_on_this_cpu(monkeypatch):
    monkeypatch.setattr(comp, "compiler_missing", lambda: None)        # the decision, whatever this machine has
    # CPU: the benchmark GPT's matrix products are most of its step; the model predicts 0.96x, inside its error
    cpu = _meta_gpt_program(fxpar.ClusterSpec.local(2), 2, compile="auto")
    sec = cpu.plan.section("compile")
    assert sec.asked == "auto" and sec.backend == "eager" and "under the 10% gain" in sec.why
    assert 1 - comp.AUTO_MARGIN < sec.compiled_s / sec.eager_s < 1.0
    assert cpu.plan.optimizer["kernel"] == "fused"                      # eager keeps the fused CPU update
    assert "compile='auto': eager: the cost model predicts" in cpu.explain()
    assert "rank 0 step: predicted" in cpu.explain()                    # per graph, op by op and compiled
    assert "compiled graphs priced" not in str(cpu.estimate().notes)
    # the same model on H100s: each eager op launches a kernel (5 us) and moves its bytes; fused, fewer do both
    gpus = fxpar.ClusterSpec.preset("h100", nodes=1, gpus_per_node=8)
    gpu = _meta_gpt_program(gpus, 8, compile="auto")
    sec = gpu.plan.section("compile")
    assert sec.backend == "inductor" and sec.compiled_s < (1 - comp.AUTO_MARGIN) * sec.eager_s
    assert "compile_steps not given: the compile time is not weighed" in sec.why
    assert gpu.plan.optimizer["kernel"] == "foreach"                    # inductor generates the update
    lines = gpu.explain()
    assert "compile='auto': compiled by torch._inductor" in lines and "rank 0 compiles: step" in lines
    # estimate() prices the graph as compiled: its fused kernels' time, below the same graph op by op
    gm = gpu.graphs(0)["step"]
    est = gpu.estimate()
    eager_est = cost_models.estimate({r: [cost_models.Item(gm, "FULL")] for r in range(8)}, gpus)
    assert est.ranks[0].compute_time_s < eager_est.ranks[0].compute_time_s
    assert est.ranks[0].compute_time_s == pytest.approx(fusion.fused_compute(gm, gpus.device).compiled_s)
    assert any("compiled graphs priced" in n for n in est.notes)
    # the decision is in the Plan, typed, and survives JSON
    back = fxpar.Plan.from_json(gpu.plan.to_json())
    assert back.section("compile") == sec and back.to_json() == gpu.plan.to_json()
    # over a short run the compile time does not pay back: eager, and why
    short = _meta_gpt_program(gpus, 8, compile="auto", compile_steps=10).plan.section("compile")
    assert short.backend == "eager" and short.steps == 10 and "more than compile_steps=10" in short.why


@pytest.mark.structure
def test_auto_without_a_c_compiler_runs_eager_and_says_why(monkeypatch):
    monkeypatch.setattr(comp, "compiler_missing", lambda: "a C++ compiler (g++ is not on PATH)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # compile='auto' asked for nothing: no warning, a reason
        prog, _ = _mlp_program(compile="auto")
    sec = prog.plan.section("compile")
    assert (sec.backend, sec.asked) == ("eager", "auto") and "missing a C++ compiler" in sec.why
    assert "compile='auto': eager: inductor is not usable here: missing a C++ compiler" in prog.explain()


@pytest.mark.structure
def test_no_c_compiler_runs_eager_with_one_warning(monkeypatch):
    monkeypatch.setattr(comp, "compiler_missing", lambda: "a C++ compiler (g++ is not on PATH)")
    with pytest.warns(UserWarning, match=r"compile=True.*missing a C\+\+ compiler \(g\+\+ is not on PATH\).*eager"):
        prog, batches = _mlp_program(compile=True)
    assert "run eager: inductor is not usable here: missing a C++ compiler" in prog.explain()
    assert prog.compiled_code(0) == {"step": "# runs eager: inductor is not usable here: missing a C++ compiler (g++ "
                                             "is not on PATH)"}
    res = prog.run_local(batches)
    eager, _ = _mlp_program()
    assert res.losses == eager.run_local(batches).losses and not res.features


def _ident(x):
    return x.clone()


_LIB = torch.library.Library("fxpar_test_compile", "DEF")
_LIB.define("ident(Tensor x) -> Tensor")
_LIB.impl("ident", lambda x: x.clone(), "CPU")          # no fake kernel: inductor cannot trace it


class _Insert(fxpar.Pass):
    """Put ``target`` on the first input's path (a node inductor cannot compile)."""
    name = "insert_uncompilable"

    def __init__(self, target):
        self.target = target

    def run(self, gm, ctx):
        x = gm.graph.find_nodes(op="placeholder")[-2]          # input0 (target0 is last)
        with gm.graph.inserting_after(x):
            y = gm.graph.call_function(self.target, (x,))
        y.meta["val"] = x.meta["val"]
        x.replace_all_uses_with(y, delete_user_cb=lambda u: u is not y)
        gm.recompile()
        return fxpar.PassResult(gm, True)


@pytest.mark.structure
def test_python_function_in_a_graph_is_named_and_the_graph_compiles_around_it():
    prog, batches = _mlp_program(compile=True, passes=[_Insert(_ident)])
    text = prog.explain()
    assert "rank 0 compiles in parts: step," in text and "calls the Python function _ident" in text
    code = prog.compiled_code(0, "step")
    assert code.startswith("# node ") and "_ident" in code.splitlines()[0] and "# ---- part 1" in code
    assert "def call(" in code                          # the stretch after the call: inductor's code
    res = prog.run_local(batches)
    report = res.features[0]["compile"]
    assert report["step"]["compiled"] == "in parts" and "_ident" in report["step"]["why"]
    parts = [lb for lb in report if lb.startswith("step.part")]
    assert parts and all(report[lb]["compiled"] is True for lb in parts), report
    eager, _ = _mlp_program(passes=[_Insert(_ident)])
    for a, b in zip(res.losses, eager.run_local(batches).losses):
        assert abs(a - b) <= 1e-10 * max(1.0, abs(a))


@pytest.mark.structure
def test_a_bucket_no_collective_reduces_goes_to_inductor_as_one_cat():
    """A bucket that no in-place collective reduces (a compression method's bucket sum reads it, or a graph cut
    around Python calls returns it) reaches inductor as one cat of the flattened gradients, as a reduced bucket does
    (passes.functional_collectives): same values, a transposed gradient included. A buffer read before its last copy,
    or one whose copies cast, keeps its copies."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from passes.functional_collectives import fold_buckets

    def build(a, b):
        buf = torch.empty(a.numel() + b.numel(), dtype=a.dtype)
        buf[:a.numel()].view(a.shape).copy_(a)
        buf[a.numel():a.numel() + b.numel()].view(b.shape).copy_(b)
        return buf * 2

    def early(a, b):
        buf = torch.empty(a.numel() + b.numel(), dtype=a.dtype)
        buf[:a.numel()].view(a.shape).copy_(a)
        first = buf.sum()
        buf[a.numel():a.numel() + b.numel()].view(b.shape).copy_(b)
        return buf * first

    def wider(a, b):                        # bfloat16 gradients summed in a float32 bucket: copy_ casts
        buf = torch.empty(a.numel() + b.numel(), dtype=torch.float32)
        buf[:a.numel()].view(a.shape).copy_(a)
        buf[a.numel():a.numel() + b.numel()].view(b.shape).copy_(b)
        return buf * 2

    a, b = torch.randn(2, 3), torch.randn(3, 4).t()
    gm = make_fx(build)(a, b)
    assert fold_buckets(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.cat.default in targets
    assert torch.ops.aten.copy_.default not in targets and torch.ops.aten.empty.memory_format not in targets
    assert torch.equal(gm(a, b), build(a, b))
    for kept, args in ((early, (a, b)), (wider, (a.to(torch.bfloat16), b.to(torch.bfloat16)))):
        gm = make_fx(kept)(*args)
        assert fold_buckets(gm) == 0 and torch.ops.aten.copy_.default in [n.target for n in gm.graph.nodes]


@pytest.mark.structure
def test_a_graph_that_cannot_be_cut_around_its_calls_runs_eager_whole(monkeypatch):
    """Where cutting a graph around its Python calls fails, the rank runs the graph eager, with one warning that says
    so, as for a graph inductor fails on."""
    prog, batches = _mlp_program(passes=[_Insert(_ident)])
    gm = prog.graphs(0)["step"]

    def refuse(gm):
        raise RuntimeError("no cut for this graph")
    monkeypatch.setattr(comp, "around_calls", refuse)
    monkeypatch.setattr(comp, "_WARNED", set(), raising=False)
    state = comp.CompileState(comp.CompileInfo(eager={}), rank=0)
    cg = comp.CompiledGraph(gm, "step", "FULL", state)
    args = [torch.randn(n.meta["val"].shape, dtype=n.meta["val"].dtype) for n in gm.graph.find_nodes(op="placeholder")]
    with pytest.warns(RuntimeWarning, match=r"graph step .*runs eager: node .*_ident.*cutting the graph around its "
                                            r"calls failed \(no cut for this graph\)"):
        fn = state.compile(cg, tuple(args), 0)
    assert fn is gm and state.report()["step"]["compiled"] is False


@pytest.mark.structure
def test_graph_that_fails_to_compile_names_the_op_and_runs_eager():
    prog, batches = _mlp_program(compile=True, passes=[_Insert(torch.ops.fxpar_test_compile.ident.default)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = prog.run_local(batches)
    said = [str(w.message) for w in caught if "runs eager" in str(w.message)]
    assert len(said) == 1 and "graph step (kind FULL)" in said[0] and "fxpar_test_compile" in said[0], said
    shown = prog.compiled_code(0, "step")
    assert shown.startswith("# runs eager: op ") and "fxpar_test_compile.ident" in shown and "did not compile" in shown
    assert res.features[0]["compile"]["step"]["compiled"] is False
    eager, _ = _mlp_program(passes=[_Insert(torch.ops.fxpar_test_compile.ident.default)])
    assert res.losses == eager.run_local(batches).losses


@pytest.mark.structure
def test_compiled_code_needs_a_compiling_feature_and_a_graph_the_rank_runs():
    prog, _ = _mlp_program()
    with pytest.raises(fxpar.StrategyError, match=r"compiled_code: no feature of this program compiles.*compile=True"):
        prog.compiled_code(0)
    prog, _ = _mlp_program(compile=True)
    with pytest.raises(fxpar.StrategyError, match=r"rank 0 runs no graph 'stage0.F'; its graphs: step"):
        prog.compiled_code(0, "stage0.F")
