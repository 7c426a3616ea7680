"""No silent wrong answers: where a program cannot train like one process on the global batch, the plan says so
(docs/semantics.md §6-§8), and options nothing would use are refused.

* BatchNorm under microbatches and dp: the plan note states per-piece statistics and the running-statistic
  updates per step, and those numbers are what a single-process loop over the same pieces computes.
* A batch-wide statistic in forward (``x - x.mean(0)``, a ``.item()`` of a batch mean): a plan note naming the
  node and the module; none for the test models and Hugging Face decoders, whose reductions are over features.
* Python-level randomness at capture: a warning naming the model.
* Options given without the option or feature that uses them: refused (or, for data-parallel settings with no
  rank to share with, a warning).
* An untraced optimizer's state in ``RunResult.optimizer_state``: whole, under the model's keys, as one process's.
* ``offload`` to the CPU without the ZeRO stage that moves it: refused; the parameter offloads that run equal one
  process."""
from __future__ import annotations

import copy
import random
import time
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.batch_semantics import batch_norm_nodes, batch_reductions
from fxpar.errors import StrategyError
from fxpar.feature import Feature, Option, register_feature, unregister_feature
from fxpar.testing import (CNN, MLP, BNConvNet, EncoderModel, SkipMLP, gpt_loss, max_abs_diff, reference_training,
                           tiny_gpt, token_batches)

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
SGD = (torch.optim.SGD, {"lr": 0.1})


def _program(model, batch, loss_fn, **strategy):
    st = fxpar.Strategy(**strategy)
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(st.size), batch, loss_fn, SGD, strategy=st)


def _notes(prog, word):
    return [n for n in prog.plan.notes if n.startswith(word)]


# ---- BatchNorm: statistics of each piece, running statistics once per microbatch ------------------------------
def _pieces_reference(model, batches, loss_fn, optimizer, dp, m):
    """One process looping over the step's pieces: rank r's rows in m microbatches, each normalised with its own
    statistics and updating the running statistics; the gradient the mean over the dp*m pieces; the running
    statistics kept those of rank 0's pieces."""
    mdl = copy.deepcopy(model)
    cls, kw = optimizer
    opt = cls(mdl.parameters(), **kw)
    for x, y in batches:
        n = x.shape[0] // dp
        rows = n // m
        opt.zero_grad()
        for r in reversed(range(dp)):           # rank 0 last: its running statistics are the ones kept
            base = {k: v.clone() for k, v in mdl.named_buffers()}
            for j in range(m):
                sl = slice(r * n + j * rows, r * n + (j + 1) * rows)
                (loss_fn(mdl(x[sl]), y[sl]) / (dp * m)).backward()
            if r:
                with torch.no_grad():
                    for k, v in mdl.named_buffers():
                        v.copy_(base[k])
        opt.step()
    return mdl.state_dict()


@pytest.mark.numerics
@pytest.mark.parametrize("dp,m", [(1, 2), (2, 1), (2, 2)])
def test_batch_norm_note_states_what_each_piece_computes(clusters, dp, m):
    torch.manual_seed(0)
    model = BNConvNet().double()
    batches = [(torch.randn(8, 3, 8, 8, dtype=torch.float64), torch.randint(0, 10, (8,))) for _ in range(3)]
    st = fxpar.Strategy(dp=dp, microbatches=m)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(dp), batches[0], F.cross_entropy, SGD_M, strategy=st)
    [note] = _notes(prog, "BatchNorm")
    pieces, rows = dp * m, 8 // (dp * m)
    assert f"each of the {pieces} pieces of the step (dp={dp} shard(s) x {m} microbatch(es), {rows} row(s) each)" \
        in note and "'bn'" in note and "global batch of 8 rows" in note
    assert f"updated {m} time(s) per step" in note and f"num_batches_tracked +{m} per step" in note
    assert ("rank 0's" in note) == (dp > 1)
    assert "note: BatchNorm" in prog.explain()
    res = prog.run_local(batches, cluster=clusters.get(dp) if dp > 1 else None)
    state = res.state_dict()
    assert max_abs_diff(state, _pieces_reference(model, batches, F.cross_entropy, SGD_M, dp, m)) < 1e-12
    assert state["bn.num_batches_tracked"].item() == len(batches) * m


@pytest.mark.structure
def test_no_batch_norm_note_without_batch_norm_or_with_one_piece():
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    assert not _notes(_program(CNN(), (x, y), F.cross_entropy, dp=2, microbatches=2), "BatchNorm")
    assert not _notes(_program(BNConvNet(), (x, y), F.cross_entropy), "BatchNorm")
    eval_bn = BNConvNet()
    eval_bn.bn.eval()               # running statistics used, not batch statistics: rows are independent
    prog = _program(eval_bn, (x, y), F.cross_entropy, dp=2)
    assert not batch_norm_nodes(prog.stages[0].captured.gm) and not _notes(prog, "BatchNorm")


class _InstanceNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=True), nn.Linear(256, 10)

    def forward(self, x):
        return self.fc(self.norm(self.conv(x)).flatten(1))


@pytest.mark.structure
def test_instance_norm_is_per_row_and_gets_no_note():
    prog = _program(_InstanceNormNet(), (torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))), F.cross_entropy, dp=2)
    assert not _notes(prog, "BatchNorm")


# ---- batch-wide statistics -----------------------------------------------------------------------------------
class _Centred(nn.Module):
    """Centres a hidden layer over the batch: a statistic of the rows each piece sees."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h - h.mean(0))


class _Scaled(nn.Module):
    """Divides by a Python number read off the batch (``.item()``)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(x)
        return h / h.abs().mean().item()


def _sums_loss(out, target):
    """Reduces over the batch only to make the loss (its sums meet nothing with the batch's rows)."""
    return (out.sum(0) - target.sum(0)).pow(2).sum()


def _batch(rows=8):
    return torch.randn(rows, 4), torch.randn(rows, 2)


@pytest.mark.structure
@pytest.mark.parametrize("model,node", [(_Centred, "mean"), (_Scaled, "mean")])
def test_batch_wide_statistic_is_noted_under_dp(model, node):
    prog = _program(model(), _batch(), F.mse_loss, dp=2)
    [note] = _notes(prog, "batch-wide statistic")
    assert f"node {node} (mean over dim 0, top level)" in note and f"{model.__name__}'s forward" in note
    assert "each of the 2 pieces" in note and "4 row(s) each" in note
    assert not _notes(_program(model(), _batch(), F.mse_loss), "batch-wide statistic")     # one piece: exact


class _Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _Centred()

    def forward(self, x):
        return self.body(x)


@pytest.mark.structure
def test_batch_wide_statistic_names_the_module():
    [note] = _notes(_program(_Wrapped(), _batch(), F.mse_loss, microbatches=2), "batch-wide statistic")
    assert "module 'body'" in note


@pytest.mark.structure
def test_batch_reductions_that_only_make_the_loss_are_not_noted():
    prog = _program(MLP(4, 8, 2), _batch(), _sums_loss, dp=2)
    assert not _notes(prog, "batch-wide statistic")


_TEST_MODELS = {
    "mlp": lambda: (MLP(), (torch.randn(8, 16), torch.randn(8, 8)), F.mse_loss),
    "cnn": lambda: (CNN(), (torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))), F.cross_entropy),
    "bn": lambda: (BNConvNet(), (torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))), F.cross_entropy),
    "gpt": lambda: (tiny_gpt(), token_batches(1)[0], gpt_loss),
    "encoder": lambda: (EncoderModel(), (torch.randn(4, 6, 32), torch.randint(0, 5, (4,))), F.cross_entropy),
    "skip": lambda: (SkipMLP(), (torch.randn(4, 16), torch.randn(4, 4)), F.mse_loss),
}


@pytest.mark.structure
@pytest.mark.parametrize("name", sorted(_TEST_MODELS))
@pytest.mark.parametrize("dp", [2, 4])          # dp=4 on a batch of 4: one row a piece
def test_no_batch_wide_note_for_the_test_models(name, dp):
    model, batch, loss_fn = _TEST_MODELS[name]()
    prog = _program(model, batch, loss_fn, dp=dp)
    assert not batch_reductions(prog.stages[0].captured.gm, prog.stages[0].captured.signature)
    assert not _notes(prog, "batch-wide statistic")


@pytest.mark.slow
@pytest.mark.structure
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5"])
def test_no_batch_wide_note_for_hugging_face_models(name):
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    from fxpar.testing.hf import hf_batches, hf_example
    model, _, loss_fn = hf_example(name, n_layers=2)
    prog = _program(model, hf_batches(name, 1, batch=4)[0], loss_fn, dp=2, microbatches=2)
    assert not _notes(prog, "batch-wide statistic") and not _notes(prog, "BatchNorm")


# ---- Python randomness at capture ----------------------------------------------------------------------------
class _Coin(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(x)
        return 2 * h if random.random() < 0.5 else h


class _NumpyScale(_Coin):
    def forward(self, x):
        import numpy as np
        return self.inp(x) * float(np.random.rand())


@pytest.mark.structure
@pytest.mark.parametrize("model,source", [(_Coin, "random"), (_NumpyScale, "numpy.random")])
def test_python_randomness_at_capture_warns(model, source):
    if source == "numpy.random":
        pytest.importorskip("numpy")
    with pytest.warns(UserWarning, match=rf"{model.__name__}'s training step drew from {source} while fxpar "
                                         r"captured it.*replayed at every step.*torch\.rand"):
        _program(model(), _batch(), F.mse_loss)


@pytest.mark.structure
def test_no_randomness_warning_for_a_plain_model():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _program(MLP(4, 8, 2), _batch(), F.mse_loss)


# ---- options nothing would use -------------------------------------------------------------------------------
@pytest.mark.structure
@pytest.mark.parametrize("kw,match", [
    (dict(sharding={"inp.weight": ("tp", None)}), r"sharding=\{'inp.weight'.*with tp=1.*set tp > 1"),
    (dict(sharding="megatron"), r"sharding='megatron'\) with tp=1.*drop sharding"),
    (dict(memory_budget_gb=1.0), r"memory_budget_gb=1.0, recompute='none'.*Set recompute='auto'"),
    (dict(memory_budget_gb=1.0, recompute="full"), r"recompute='full'.*Set recompute='auto' or drop memory_budget_gb"),
    (dict(offload_dir="unused-dir"), r"offload_dir='unused-dir', offload_to='cpu'.*add offload_to='disk'"),
])
def test_options_without_the_setting_that_uses_them_are_refused(kw, match):
    with pytest.raises(StrategyError, match=match):
        fxpar.Strategy(**kw)


@pytest.mark.structure
def test_annotations_mode_on_a_model_without_annotations_is_refused():
    with pytest.raises(StrategyError, match=r"sharding='annotations'\): _Centred has no fxpar.shard annotation.*"
                                            r"sharding='megatron'"):
        _program(_Centred(), _batch(), F.mse_loss, tp=2, sharding="annotations")


@pytest.mark.structure
def test_data_parallel_settings_without_a_rank_to_share_with_warn():
    with pytest.warns(UserWarning, match=r"bucket_cap_mb=5.*\(dp=1, pp=1\).*do nothing"):
        _program(_Centred(), _batch(), F.mse_loss, bucket_cap_mb=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _program(MLP(4, 8, 2), _batch(), F.mse_loss, dp=2, bucket_cap_mb=5)


class _Switch(Feature):
    name = "test_switch"
    doc = "a feature turned on by dp > 1 only"
    options = {"switch_level": Option(0, "a level, used with dp > 1")}
    enabled_by = ("dp",)

    def enabled(self, strategy) -> bool:
        return strategy.dp > 1


@pytest.mark.structure
def test_a_feature_left_off_refuses_its_options():
    register_feature(_Switch)
    try:
        with pytest.raises(StrategyError, match=r"switch_level=3\): option\(s\) of feature 'test_switch', which this "
                                                r"Strategy leaves off \(dp turns it on\)"):
            fxpar.Strategy(switch_level=3)
        fxpar.Strategy(dp=2, switch_level=3)
    finally:
        unregister_feature("test_switch")


# ---- batch-wide statistics in every form: products over the batch, nonlinear reductions, .item() ------------
class _BatchMix(nn.Module):
    """``inp`` -> a statistic of the batch mixed back into every row -> ``out``; the statistic is the class's
    ``mix``, run inside the submodule ``stat`` so that the note's module is the user's."""

    class _Stat(nn.Module):
        def __init__(self, mix):
            super().__init__()
            self.mix = mix

        def forward(self, h):
            return self.mix(h)

    def __init__(self, mix):
        super().__init__()
        self.inp, self.stat, self.out = nn.Linear(4, 8), self._Stat(mix), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.stat(self.inp(x)))


BATCH_WIDE = {                                  # form -> (statistic, the op the note names, how it reduces)
    "x.T @ x": (lambda h: h @ (h.T @ h), "mm", "contracting the batch dimension"),
    "torch.mm(x.t(), x)": (lambda h: torch.mm(h, torch.mm(h.t(), h)), "mm", "contracting the batch dimension"),
    "einsum bi,bj->ij": (lambda h: h @ torch.einsum("bi,bj->ij", h, h), "bmm", "contracting the batch dimension"),
    "var(0)": (lambda h: h / h.var(0), "var", "over dim 0"),
    "std(0)": (lambda h: h / h.std(0), "std", "over dim 0"),
    "max(0)": (lambda h: h - h.max(0).values, "max", "over dim 0"),
    "logsumexp(0)": (lambda h: h - h.logsumexp(0), "logsumexp", "over dim 0"),
    "normalize(dim=0)": (lambda h: F.normalize(h, dim=0), "linalg_vector_norm", "over dim 0"),
    "x.T.sum(1)": (lambda h: h - h.T.sum(1), "sum", "over the batch dimension"),
    ".item() of max(0)": (lambda h: h / h.abs().max(0).values.sum().item(), "max", "over dim 0"),
}


@pytest.mark.structure
@pytest.mark.parametrize("form", sorted(BATCH_WIDE))
def test_every_form_of_batch_wide_statistic_is_noted(form):
    mix, op, how = BATCH_WIDE[form]
    prog = _program(_BatchMix(mix), _batch(), F.mse_loss, dp=2)
    cap = prog.stages[0].captured
    found = batch_reductions(cap.gm, cap.signature)
    assert found and all(m == "stat" for _, m in found), found
    [note] = _notes(prog, "batch-wide statistic")
    assert f"({op} {how}, module 'stat')" in note, note
    assert "_BatchMix's forward" in note and "each of the 2 pieces" in note


@pytest.mark.structure
def test_a_product_over_features_or_a_transposed_weight_is_not_a_batch_statistic():
    """``h @ W.T`` and attention within each row (``q @ k.T`` per row) contract the features, and backward's weight
    gradient (``grad.T @ x``) contracts the batch outside forward: none is noted."""
    model = _BatchMix(None)
    model.stat.w = nn.Parameter(torch.randn(8, 8))
    def per_row(h):                                     # a linear layer, and attention within each row
        a = h.view(-1, 2, 4)
        return h @ model.stat.w.T + ((a @ a.transpose(1, 2)).softmax(-1) @ a).reshape(h.shape)
    model.stat.mix = per_row
    prog = _program(model, _batch(), F.mse_loss, dp=2)
    cap = prog.stages[0].captured
    assert not batch_reductions(cap.gm, cap.signature) and not _notes(prog, "batch-wide statistic")


@pytest.mark.structure
def test_torch_cov_is_refused_at_capture_not_run_silently():
    """``torch.cov`` decides on a tensor's value inside torch (fake tensors cannot answer it): capture refuses
    the model rather than training per shard."""
    with pytest.raises(fxpar.errors.CaptureError, match=r"_BatchMix.*control flow that depends on tensor values"):
        _program(_BatchMix(lambda h: h @ torch.cov(h.T)), _batch(), F.mse_loss, dp=2)


# ---- Python state a forward changes: frozen at capture ---------------------------------------------------------
class _Counted(nn.Module):
    """Takes another branch every second call: decided once, at capture."""

    def __init__(self):
        super().__init__()
        self.inp, self.calls = nn.Linear(4, 2), 0

    def forward(self, x):
        self.calls += 1
        return self.inp(x) * 2 if self.calls % 2 else self.inp(x)


class _Toggled(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.gate = nn.Linear(4, 2), _Gate()

    def forward(self, x):
        return self.gate(self.inp(x))


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.flip = False

    def forward(self, h):
        self.flip = not self.flip
        return h.relu() if self.flip else h


class _Stamped(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 2)

    def forward(self, x):
        self.seen_at = time.time()
        return self.inp(x) * (1.0 if self.seen_at > 0 else 0.0)


@pytest.mark.structure
@pytest.mark.parametrize("model,match", [
    (_Counted, r"module '\(top level\)' attribute 'calls': 0 -> 1"),
    (_Toggled, r"module 'gate' attribute 'flip': False -> True"),
    (_Stamped, r"module '\(top level\)' attribute 'seen_at': \(unset\) -> \d"),
])
def test_python_state_changed_by_forward_warns(model, match):
    with pytest.warns(UserWarning, match=rf"{model.__name__}'s forward changed Python attributes of its modules while "
                                         rf"fxpar captured it \({match}.*replayed at every step.*Make the decision a "
                                         r"tensor op.*keep the state outside forward") as rec:
        _program(model(), _batch(), F.mse_loss)
    assert sum("changed Python attributes" in str(w.message) for w in rec) == 1


@pytest.mark.structure
def test_python_state_warning_once_when_capture_runs_again_for_an_unused_parameter():
    model = _Counted()
    model.spare = nn.Linear(2, 2)                   # never called: capture runs a second time with it frozen
    with pytest.warns(UserWarning, match="attribute 'calls': 0 -> 1") as rec:
        _program(model, _batch(), F.mse_loss)
    assert sum("changed Python attributes" in str(w.message) for w in rec) == 1


@pytest.mark.structure
@pytest.mark.parametrize("name", sorted(_TEST_MODELS))
def test_no_python_state_warning_for_the_test_models(name):
    model, batch, loss_fn = _TEST_MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _program(model, batch, loss_fn)


@pytest.mark.slow
@pytest.mark.structure
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5"])
def test_no_python_state_warning_for_hugging_face_models(name):
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    from fxpar.testing.hf import hf_batches, hf_example
    model, _, loss_fn = hf_example(name, n_layers=2)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _program(model, hf_batches(name, 1, batch=4)[0], loss_fn)
    assert not [w for w in rec if "changed Python attributes" in str(w.message)]


# ---------------------------------------------------------------- an untraced optimizer's state, whole

def _eager_optimizer_state(model, batches, loss_fn, optimizer) -> dict:
    """One process's torch optimizer state after training on ``batches``, as ``<state>:<key>``."""
    m = copy.deepcopy(model)
    names = {id(p): k for k, p in m.named_parameters()}
    opt = optimizer[0](m.parameters(), **optimizer[1])
    for b in batches:
        opt.zero_grad()
        loss_fn(m(*b[:-1]), b[-1]).backward()
        opt.step()
    return {f"{name}:{names[id(p)]}": v for p, st in opt.state.items() for name, v in st.items()}


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [dict(tp=2, sharding="megatron"), dict(pp=2, microbatches=2)],
                         ids=["tp2", "pp2"])
@pytest.mark.parametrize("optimizer", [(torch.optim.Adagrad, {"lr": 0.05}),
                                       (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.9})],
                         ids=["Adagrad", "RMSprop"])
def test_an_untraced_optimizers_state_is_whole_under_the_models_keys(clusters, strategy, optimizer):
    """RunResult.optimizer_state of an eager optimizer: every parameter's state, whole (a split parameter's gathered
    over tp, every pipeline stage's), equal to one process's torch optimizer state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).double()
    batches = [(torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)) for _ in range(3)]
    st = fxpar.Strategy(**strategy)
    prog = fxpar.parallelize(model, st.size, batches[0], F.mse_loss, optimizer, strategy=st)
    if "tp" in strategy:
        assert prog.plan.section("tensor_parallel").stages[0]["params"]["0.weight"] == ["tp", None]
    got = prog.run_local(batches, cluster=clusters.get(2)).optimizer_state
    want = _eager_optimizer_state(model, batches, F.mse_loss, optimizer)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k, v in want.items():
        assert got[k].shape == v.shape, (k, got[k].shape, v.shape)
        assert (got[k].double() - v.double()).abs().max().item() < 1e-10, k


# ---------------------------------------------------------------- offload: only what a mechanism moves

@pytest.mark.structure
@pytest.mark.parametrize("kw, refused", [
    (dict(dp=2, offload=("optimizer",)), r"offload=\('optimizer',\), zero=0\).*Set zero=1, 2 or 3"),
    (dict(dp=2, offload=("params",)), r"offload=\('params',\), zero=0\).*Set zero=3"),
    (dict(dp=2, zero=1, offload=("params",)), r"offload=\('params',\), zero=1\).*Set zero=3"),
    (dict(dp=2, zero=2, offload=("params", "optimizer")), r"offload=\('params', 'optimizer'\), zero=2\).*Set zero=3"),
    (dict(dp=2, zero=1, offload=("optimizer",)), None),
    (dict(dp=2, zero=3, offload=("params",)), None),
    (dict(dp=2, zero=3, offload=("params", "optimizer")), None),
    (dict(dp=2, offload=("params", "optimizer"), offload_to="disk"), None),
    (dict(dp=2, zero=2, offload=("params",), offload_to="disk"), None),
])
def test_offload_to_the_cpu_without_the_zero_stage_that_moves_it_is_refused(kw, refused, tmp_path):
    """``offload_to='cpu'`` is carried out by ZeRO's chunks (the zero_offload pass); where no stage moves what
    ``offload`` names, the option would do nothing: refused, naming ``offload`` and ``zero``. The combinations that
    run are proven by tests/test_zero_offload.py, tests/test_zero_infinity.py and the sweep."""
    if kw.get("offload_to") == "disk":
        kw = dict(kw, offload_dir=tmp_path)
    if refused is None:
        st = fxpar.Strategy(**kw)
        prog = _program(MLP().double(), (torch.randn(8, 16, dtype=torch.float64),
                                         torch.randn(8, 8, dtype=torch.float64)), F.mse_loss, **kw)
        assert prog.plan.section("zero_offload").what == list(st.offload)
        return
    with pytest.raises(StrategyError, match=refused):
        fxpar.Strategy(**kw)


@pytest.mark.numerics
@pytest.mark.parametrize("kw", [dict(zero=3, offload=("params",)), dict(zero=2, offload=("params",), offload_to="disk")],
                         ids=["zero3-params-cpu", "zero2-params-disk"])
def test_parameter_offload_that_runs_trains_like_one_process(clusters, kw, tmp_path):
    """The parameter offloads no other test runs: ZeRO-3's chunks on the host, and whole parameters in files under
    ZeRO-2: losses and parameters equal one process's to 1e-10."""
    if kw.get("offload_to") == "disk":
        kw = dict(kw, offload_dir=tmp_path)
    torch.manual_seed(0)
    model = MLP().double()
    batches = [(torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)) for _ in range(3)]
    adamw = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
    ref_losses, ref_state = reference_training(model, batches, F.mse_loss, adamw)
    st = fxpar.Strategy(dp=2, **kw)
    prog = fxpar.parallelize(model, 2, batches[0], F.mse_loss, adamw, strategy=st)
    res = prog.run_local(batches, cluster=clusters.get(2))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
    if kw.get("offload_to") == "disk":
        assert res.state_bytes[0]["on_disk"] == sum(p.numel() * 8 for p in model.parameters())
    else:
        assert prog.stages[0].joint.meta["fxpar_zero_offload"]["to_device"] > 0    # each gather copies a chunk over


# ---------------------------------------------------------------- a Python decision that changes between captures
_CALLS = [0]


class _Alternating(nn.Module):
    """Branches on a global counter forward increments: no module attribute changes, no random state."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        _CALLS[0] += 1
        h = self.fc(x)
        return torch.tanh(h) if _CALLS[0] % 2 else h


def _capture_warnings(model, check: bool, **strategy) -> list:
    batch = (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fxpar.parallelize(model.double(), fxpar.ClusterSpec.local(strategy.get("dp", 1)), batch, F.mse_loss,
                          check_capture=check, strategy=fxpar.Strategy(**strategy))
    return [str(w.message) for w in rec if "two captures" in str(w.message)]


@pytest.mark.structure
def test_check_capture_names_where_two_captures_differ():
    """A branch on a global counter is decided at capture (not seen by the attribute check); capturing twice shows
    it: the warning names the model, the node where the graphs part and what to do. Without the option, nothing."""
    assert _capture_warnings(_Alternating(), check=False) == []
    (msg,) = _capture_warnings(_Alternating(), check=True, dp=2)
    assert "_Alternating: two captures of the training step differ: node" in msg
    assert "aten.tanh" in msg and "make the decision a tensor op" in msg


@pytest.mark.structure
def test_check_capture_is_quiet_on_models_that_decide_nothing_in_python():
    """Dropout and BatchNorm are graph ops: the two captures of the sweep's model are the same graph."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.Linear(8, 4))
    assert _capture_warnings(model, check=True, dp=2) == []
