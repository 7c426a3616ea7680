"""Strategy(compile=True): every per-rank graph through torch._inductor (fxpar.features.compile).

Numerics: compiled runs against eager fxpar on the same program (float64 to 1e-10: inductor's C++ kernels sum
reductions in their own order, about 1e-12 apart here; float32 to rtol 1e-4), per graph kind. Structure: the ranks
issue the same collectives, in the same order with the same bytes, compiled and eager; inductor's code keeps the
issue-to-wait windows of the FX graph. Bad input: an option value that is not True/False, no C++ compiler, a graph
that does not compile. Compile time dominates: tiny models, and all but one numerics case are ``slow``.
"""
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import fxpar
import fxpar.features.compile as comp
from fxpar.collectives import C10D, is_wait
from fxpar.runtime.launch import local_threads
from fxpar.testing import MLP, gpt_loss, max_abs_diff, tiny_gpt

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2})


def _batches(steps=2, dtype=None):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g))
            for _ in range(steps)]


def _both(clusters, strategy: dict, opt=ADAMW, dtype=torch.float64, **run):
    """The same tiny GPT program eager and compiled; returns ``(eager result, compiled result, compiled program)``."""
    batches = _batches()
    out = []
    for flag in (False, True):
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
    assert shown == named.sub(r"\1'fxpar:dp')", ran)
    assert prog.compiled_code(0) == {"step": shown}


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
@pytest.mark.parametrize("strategy", [
    {"dp": 2, "microbatches": 2},                       # F, B, REDUCE_GRAD, STEP
    {"pp": 2, "microbatches": 2, "schedule": "1f1b"},   # a pipeline: SEND/RECV between compiled graphs
    {"pp": 2, "microbatches": 2, "schedule": "zb1p"},  # I and W
    {"dp": 2, "zero": 3},                               # gathers and reduce-scatters in the step
    {"tp": 2},                                          # tensor parallelism's all-reduces
], ids=["dp2_microbatches", "pp2_1f1b", "pp2_zb1p", "zero3", "tp2"])
def test_graph_kinds_float64_match_eager(clusters, strategy):
    eager, compiled, _ = _both(clusters, strategy)
    _close64(eager, compiled)


# ---- bad input -------------------------------------------------------------------------------------------------
def _mlp_program(**strategy):
    torch.manual_seed(0)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    model = MLP().double()
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(1), (x, y), loss_fn=F.mse_loss, optimizer=SGD_M,
                             strategy=fxpar.Strategy(**strategy)), [(x, y)]


@pytest.mark.structure
@pytest.mark.parametrize("value", ["auto", 1, "inductor"])
def test_compile_takes_true_or_false(value):
    with pytest.raises(fxpar.StrategyError, match=r"compile=.*True.*False"):
        fxpar.Strategy(dp=2, compile=value)


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
def test_python_function_in_a_graph_is_named_and_runs_eager():
    prog, batches = _mlp_program(compile=True, passes=[_Insert(_ident)])
    text = prog.explain()
    assert "rank 0 runs eager: step (node" in text and "calls the Python function _ident" in text
    assert prog.compiled_code(0, "step").startswith("# runs eager: node ") and "_ident" in prog.compiled_code(0, "step")
    with pytest.warns(RuntimeWarning, match=r"graph step \(kind FULL\) runs eager: .*_ident"):
        res = prog.run_local(batches)
    assert res.features[0]["compile"]["step"]["compiled"] is False
    eager, _ = _mlp_program(passes=[_Insert(_ident)])
    assert res.losses == eager.run_local(batches).losses


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
