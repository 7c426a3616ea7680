"""Tensor parallelism: ``Strategy(tp=, sharding=...)`` through fxpar.parallelize.

Numerics: tp ranks (and dp x tp, tp x pp, dp x tp x pp) reproduce single-process training of the same model on
the same global batch (float64, 1e-10) for every sharding mode: Tofu's search (``auto``), the Megatron preset,
Mesh-TensorFlow layouts and GShard annotations; on the tied GPT, an MLP and a CNN with its conv channels split.
Structure: Megatron's collectives on a GPT with separate q/k/v projections (2 all-reduces of b·s·h per layer
forward, 2 backward; Narayanan et al. SC'21), one graph for every tp rank, explain()'s bytes equal what the
ranks handed to their collectives, Tofu's plan no dearer than Megatron's, a handed-back Plan reused.
Bad input: each error names the tensor, module or setting and what to change.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.testing import (CNN, MLP, MegatronBlock, gpt_loss, max_abs_diff, reference_training, regression_batches,
                           tiny_gpt, token_batches)

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
TOL = 1e-10
# a link fast enough that Tofu's cost model splits the tiny test models (on loopback figures it keeps them whole)
FAST = {"intra_node": fxpar.LinkSpec(100e9, 1e-9)}


class SplitQKVLM(nn.Module):
    def __init__(self, vocab=32, d=16, layers=2, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MegatronBlock(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class AnnotatedMLP(nn.Module):
    """No layout: one GShard annotation on the hidden activation decides the rest."""

    def __init__(self, d=16, hidden=32, out=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, out)

    def forward(self, x):
        return self.fc2(fxpar.shard(torch.tanh(self.fc1(x)), (None, "tp")))


def _cnn_batches(n, batch=8):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(batch, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(n)]


MODELS = {
    "gpt": lambda: (tiny_gpt(), token_batches(3, batch=8), gpt_loss, ADAMW),
    "gpt4": lambda: (tiny_gpt(heads=4), token_batches(3, batch=8), gpt_loss, ADAMW),
    "mlp": lambda: (MLP().double(), regression_batches(3), F.mse_loss, SGD_M),
    "cnn": lambda: (CNN().double(), _cnn_batches(3), F.cross_entropy, SGD_M),
    "annotated": lambda: (AnnotatedMLP().double(), regression_batches(3), F.mse_loss, ADAMW),
    "splitqkv": lambda: (SplitQKVLM().double(), token_batches(3, batch=4), gpt_loss, ADAMW),
}
LAYOUTS = {"gpt": {"blocks.*.fc.weight": ("tp", None), "blocks.*.fc.bias": ("tp",), "blocks.*.fc2.weight": (None, "tp")},
           "gpt4": {"blocks.*.fc.weight": ("tp", None), "blocks.*.fc2.weight": (None, "tp")},
           "cnn": {"conv1.weight": ("tp", None, None, None), "conv1.bias": ("tp",)},
           "annotated": {}}


# Programs built and runs checked in this module, by their configuration: tests that build the same program (the
# same model, sharding, mesh and cluster) share one build, and tests that check the same run against one process
# share that check and its result. Only reads follow; a test run alone builds and checks for itself.
_BUILT: dict = {}
_RUNS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _shared_builds():
    yield
    _BUILT.clear()
    _RUNS.clear()


def _key(name, mode, cluster_kw, strategy) -> str:
    return repr((name, mode, sorted((cluster_kw or {}).items()), sorted(strategy.items())))


def _build(name, mode, cluster_kw=None, **strategy):
    """(model, batches, loss_fn, opt, program) for MODELS[name] under ``sharding=mode`` and ``strategy``."""
    key = _key(name, mode, cluster_kw, strategy)
    if key not in _BUILT:
        model, batches, loss_fn, opt = MODELS[name]()
        sharding = LAYOUTS[name] if mode == "layouts" else mode
        st = fxpar.Strategy(sharding=sharding, **strategy)
        prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(st.size, **(cluster_kw or {})), batches[0], loss_fn,
                                 opt, strategy=st)
        _BUILT[key] = (model, batches, loss_fn, opt, prog)
    return _BUILT[key]


def _run(clusters, name, mode, cluster_kw=None, **strategy):
    key = _key(name, mode, cluster_kw, strategy)
    if key in _RUNS:                                 # this very run was checked below already
        return _RUNS[key]
    model, batches, loss_fn, opt, prog = _build(name, mode, cluster_kw, **strategy)
    ref_losses, ref_state = reference_training(model, batches, loss_fn, opt)
    res = prog.run_local(batches, cluster=clusters.get(prog.world_size), measure_comm=True)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL, (res.losses, ref_losses)
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    split = [k for st_ in prog.plan.section("tensor_parallel").stages for k, v in st_["params"].items() if any(v)]
    assert split, "nothing was split: the test would prove nothing"
    _RUNS[key] = prog, res
    return prog, res


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("name,mode,tp", [
    ("gpt", "megatron", 2), ("gpt4", "megatron", 4), ("gpt", "auto", 2), ("gpt", "auto", 4), ("gpt", "layouts", 2),
    ("gpt4", "layouts", 4), ("mlp", "megatron", 2), ("mlp", "megatron", 4), ("mlp", "auto", 4), ("cnn", "layouts", 2), ("cnn", "layouts", 4),
    ("annotated", "annotations", 2)])
def test_tp_equals_single_process(clusters, name, mode, tp):
    prog, _ = _run(clusters, name, mode, FAST if mode == "auto" else None, tp=tp)
    if name == "cnn":            # conv1's output channels are split: its forward and backward run on pieces
        assert prog.plan.section("tensor_parallel").stages[0]["params"]["conv1.weight"] == ["tp", None, None, None]


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["megatron", "auto", "layouts", "annotations"])
@pytest.mark.parametrize("mesh", ["dp2xtp2", "tp2xpp2"])
def test_tp_composes_with_dp_and_pp(clusters, mode, mesh):
    name = "annotated" if mode == "annotations" else "gpt"
    kw = dict(dp=2, tp=2) if mesh == "dp2xtp2" else dict(tp=2, pp=2, microbatches=2, schedule="1f1b")
    if name == "annotated" and mesh == "tp2xpp2":
        kw["split_points"] = ["fc2"]
    prog, _ = _run(clusters, name, mode, FAST if mode == "auto" else None, **kw)
    assert prog.plan.tp == 2 and prog.world_size == 4


@pytest.mark.slow
@pytest.mark.numerics
def test_dp_tp_pp_on_8_ranks(clusters):
    prog, _ = _run(clusters, "gpt", "megatron", dp=2, tp=2, pp=2, microbatches=2, schedule="1f1b")
    assert prog.plan.mesh_axes == [["pp", 2], ["dp", 2], ["tp", 2]]


@pytest.mark.structure
def test_megatron_structure_on_a_gpt_with_separate_qkv():
    """2 all_reduces of b·s·h elements per layer in forward and 2 in backward, and nothing else over tp."""
    import fxpar.meta as M
    model, batches, loss_fn, opt = MODELS["splitqkv"]()
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn, opt,
                             strategy=fxpar.Strategy(tp=2, sharding="megatron"))
    b, s = batches[0][0].shape
    h, layers = 16, 2
    gm = prog.graphs(0)["step"]
    comm = [(M.get(n, M.PHASE), n.meta[M.COMM.name]) for n in gm.graph.nodes if M.COMM.name in n.meta]
    fwd = [c for ph, c in comm if ph == "forward"]
    bwd = [c for ph, c in comm if ph == "backward"]
    assert [c.kind for c in fwd] == ["all_reduce"] * 2 * layers
    assert [c.kind for c in bwd] == ["all_reduce"] * 2 * layers
    assert {c.nbytes for c in fwd + bwd} == {b * s * h * 8}
    assert len(comm) == 4 * layers
    split = prog.plan.section("tensor_parallel").stages[0]["megatron"]
    assert split["blocks.0.q.weight"] == ["tp", None] and split["blocks.0.o.weight"] == [None, "tp"]
    assert split["blocks.1.fc1.weight"] == ["tp", None] and split["blocks.1.fc2.weight"] == [None, "tp"]


@pytest.mark.slow
@pytest.mark.numerics
def test_one_graph_for_every_tp_rank_and_explain_bytes_are_what_ranks_sent(clusters):
    prog, res = _run(clusters, "gpt", "megatron", dp=2, tp=2)
    codes = {prog.graphs(r)["step"].code for r in range(4)}
    assert len(codes) == 1                           # slices and zeros read the rank's coordinate at run time
    code = codes.pop()
    assert "fxpar.axis_chunk" in code and "'fxpar:tp'" in code
    planned = [(c.kind, c.nbytes) for c in prog.collectives(0)]
    for r in range(4):
        for step in res.comm_calls[r]:
            assert step == planned                   # kinds, bytes and order of what each rank handed over
    text = prog.explain()
    assert "tensor parallelism on rank 0, per module" in text and "blocks.0.fc: split weight ('tp', None)" in text
    shown = prog.shardings(3)
    assert str(shown.get("blocks_0_fc_weight")) == "P('tp', None)" and "blocks.0.fc" in str(shown)


@pytest.mark.slow
@pytest.mark.numerics
def test_auto_is_no_dearer_than_megatron_and_a_handed_back_plan_is_reused(clusters):
    model, batches, loss_fn, opt, prog = _build("gpt", "auto", FAST, tp=2)      # Strategy(tp=2): auto is the default
    spec = fxpar.ClusterSpec.local(2, **FAST)
    assert prog.strategy == fxpar.Strategy(tp=2)
    notes = [n for n in prog.stages[0].notes if n.startswith("tofu: its plan")]
    assert notes and ("cheaper than Megatron" in notes[0] or "as cheap as Megatron" in notes[0]), prog.stages[0].notes
    plan = fxpar.Plan.from_json(prog.plan.to_json())
    assert plan.section("tensor_parallel").stages[0]["auto"]["out"]          # Tofu's per-node choice, readable and editable
    again = fxpar.parallelize(model, spec, batches[0], loss_fn, opt, strategy=fxpar.Strategy(tp=2), plan=plan)
    assert again.graphs(0)["step"].code == prog.graphs(0)["step"].code
    assert not any(n.startswith("tofu over") for n in again.stages[0].notes)     # no second search



@pytest.mark.structure
def test_a_handed_back_plan_is_lowered_without_searching_again(monkeypatch):
    """Tofu's choice is made when the Plan is made (the feature's plan_stage) and kept in it; a Plan handed back
    through JSON is lowered to the same graphs with the search never called."""
    import passes.tofu
    model, batches, loss_fn, opt = MODELS["mlp"]()
    spec, st = fxpar.ClusterSpec.local(2, **FAST), fxpar.Strategy(tp=2)
    prog = fxpar.parallelize(model, spec, batches[0], loss_fn, opt, strategy=st)
    entry = prog.plan.section("tensor_parallel").stages[0]
    assert any(any(v) for v in entry["params"].values()), entry["params"]
    text = prog.plan.to_json()

    def no_search(*args, **kwargs):
        raise AssertionError("tofu_search called")
    monkeypatch.setattr(passes.tofu, "tofu_search", no_search)
    again = fxpar.parallelize(model, spec, batches[0], loss_fn, opt, strategy=st, plan=fxpar.Plan.from_json(text))
    assert again.graphs(0)["step"].code == prog.graphs(0)["step"].code
    assert again.plan.section("tensor_parallel").stages[0]["params"] == entry["params"]
    assert [(c.kind, c.nbytes) for c in again.collectives(0)] == [(c.kind, c.nbytes) for c in prog.collectives(0)]
    with pytest.raises(AssertionError, match="tofu_search called"):      # without a Plan, the planning searches
        fxpar.parallelize(model, spec, batches[0], loss_fn, opt, strategy=st)

def _bad(model, example, loss_fn, **strategy):
    st = fxpar.Strategy(**strategy)
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(st.size), example, loss_fn, SGD_M, strategy=st)


class Annot(nn.Module):
    """``fc1``'s output annotated twice, through tanh and through sigmoid: with two specs they meet at fc1."""

    def __init__(self, spec_a, spec_b=None):
        super().__init__()
        self.fc1, self.out = nn.Linear(16, 32), nn.Linear(32, 8)
        self.spec_a, self.spec_b = spec_a, spec_b

    def forward(self, x):
        h = self.fc1(x)
        a = fxpar.shard(torch.tanh(h), self.spec_a)
        b = torch.sigmoid(h) if self.spec_b is None else fxpar.shard(torch.sigmoid(h), self.spec_b)
        return self.out(a + b)


@pytest.mark.structure
def test_bad_inputs_name_the_tensor_and_the_fix():
    x, y = regression_batches(1)[0]
    with pytest.raises(fxpar.errors.PassError, match=r"parameter 'layers.0.weight'.*does not divide|"
                                                     r"layers.0.weight.*tp=3"):
        _bad(MLP(hidden=32).double(), (x, y), F.mse_loss, tp=3, sharding={"layers.0.weight": ("tp", None)})
    with pytest.raises(fxpar.errors.PassError, match=r"unknown|'zz'"):
        _bad(Annot((None, "zz")).double(), (x, y), F.mse_loss, tp=2, sharding="annotations")
    with pytest.raises(fxpar.errors.PassError, match=r"fxpar.shard.*and fxpar.shard.*meet at node 'addmm'"):
        _bad(Annot((None, "tp"), ("tp", None)).double(), (x, y), F.mse_loss, tp=2, sharding="annotations")
    ids, tgt = token_batches(1, batch=4)[0]
    with pytest.raises(fxpar.errors.PassError, match=r"attention in 'blocks.0' has 2 heads, which tp=4 does not divide"):
        _bad(tiny_gpt(heads=2), (ids, tgt), gpt_loss, tp=4, sharding="megatron")
    with pytest.raises(fxpar.StrategyError, match=r"mesh axis 'dp' is not a tensor-parallel axis"):
        fxpar.Strategy(tp=2, sharding={"fc.weight": ("dp", None)})
    with pytest.raises(fxpar.StrategyError, match=r"feature 'tensor_parallel' \(tp=2\) conflicts with feature 'zero' "
                                                  r"\(zero=1\): they do not compose; drop one of them"):
        fxpar.Strategy(dp=2, tp=2, zero=1)


class Flipped(nn.Module):
    """``torch.flip`` has no sharding rule: it runs whole, and the result is still exact."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.flip(torch.tanh(self.fc1(x)), [1]))


@pytest.mark.numerics
def test_an_op_without_a_rule_runs_whole_and_explain_names_it(clusters):
    MODELS["flipped"] = lambda: (Flipped().double(), regression_batches(3), F.mse_loss, SGD_M)
    LAYOUTS["flipped"] = {"fc1.weight": ("tp", None), "fc1.bias": ("tp",)}
    prog, _ = _run(clusters, "flipped", "layouts", tp=2)
    text = prog.explain()
    assert "ops without a sharding rule, run whole: flip" in text, text
    assert "all_gather" in text                      # fc1's split output is gathered for the flip


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("mesh", [dict(dp=2, tp=2), dict(tp=2, pp=2, microbatches=2, schedule="1f1b")])
def test_measured_peak_memory_is_the_predicted_one(clusters, mesh):
    """Each rank's measured peak (dispatch-level tracker) against ``estimate()``'s, on the local graphs it runs."""
    model, batches, loss_fn, opt, prog = _build("gpt", "megatron", **mesh)
    st = prog.strategy
    est = prog.estimate()
    res = prog.run_local(batches[:2], cluster=clusters.get(st.size), measure_memory=True)
    for r in range(st.size):
        ratio = res.peak_memory_bytes[r] / est.ranks[r].peak_memory_bytes
        assert 0.9 <= ratio <= 1.1, (r, res.peak_memory_bytes[r], est.ranks[r].peak_memory_bytes)
