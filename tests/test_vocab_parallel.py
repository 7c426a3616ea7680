"""Megatron's vocabulary-parallel embedding under a tied LM head (Shoeybi et al. 2019, §3).

The tied GPT's ``wte.weight`` (also ``head.weight``) split over the vocabulary: each rank holds V/tp rows,
looks up the indices it holds (``fxpar.vocab_embedding``: a partial sum, one all_reduce of b·s·h
elements in forward), and the LM head reads the same rows, so its logits come out split over the
vocabulary (gathered for the loss). Proof:

* the local ops equal the whole op: the pieces' lookups sum to ``aten.embedding``, their gradients
  concatenate to ``aten.embedding_dense_backward`` (with ``padding_idx`` and ``scale_grad_by_freq``);
* through ``fxpar.parallelize``, with layouts and with ``sharding="megatron"``, at tp=2, tp=4 and
  dp=2 x tp=2: losses and final state equal single-process training (float64, 1e-10); each rank
  holds V/tp rows of the weight and its optimizer state; the head's local logits are [b·s, V/tp];
  the collectives, in number, order and bytes;
* the backward's vocabulary split (``fxpar.vocab_embedding_backward``: each rank scatters only its
  rows) on 4 ranks, from a Plan handed back with Tofu's choice under its default cost model.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fxpar
from fxpar import meta as M
from fxpar.capture import capture_training_step
from fxpar.collectives import collective_nodes
from fxpar.local_ops import vocab_embedding, vocab_embedding_backward
from fxpar.optim import resolve_optimizer
from fxpar.testing import GPT, gpt_loss, token_batches
from fxpar.testing.reference import max_abs_diff, reference_training

aten = torch.ops.aten
V, D, LAYERS, B, S = 256, 32, 1, 4, 8          # b·s·h = 1024 elements; V·h = 8192: the split weight is the big one
ADAMW = (torch.optim.AdamW, {"lr": 1e-2})
LAYOUT = {"wte.weight": ("tp", None)}


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = GPT(vocab=V, d=D, layers=LAYERS).double()
    batches = token_batches(2, batch=B, seq=S, vocab=V)
    return model, batches, reference_training(model, batches, gpt_loss, ADAMW)


def _at(coord):
    """Run a local op as the rank at ``coord`` along its axis (no process group needed)."""
    return mock.patch("fxpar.local_ops.axis_index", lambda group: coord)


@pytest.mark.structure
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("pad,scale", [(-1, False), (3, False), (5, True)])
def test_local_ops_equal_the_whole_op(n, pad, scale):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(8, 5, dtype=torch.float64, generator=g)
    idx = torch.tensor([[0, 3, 3, 7], [5, 1, 3, 0], [6, 6, 2, 5]])     # repeats, the padding index, every piece
    grad = torch.randn(3, 4, 5, dtype=torch.float64, generator=g)
    looked, grads = [], []
    for c in range(n):
        with _at(c):
            looked.append(vocab_embedding(w.chunk(n)[c].contiguous(), idx, "fxpar:tp"))
            grads.append(vocab_embedding_backward(grad, idx, 8 // n, pad, scale, "fxpar:tp"))
    assert all(p.abs().sum() > 0 for p in looked)                        # each rank holds some of the indices
    assert (sum(looked) - torch.nn.functional.embedding(idx, w)).abs().max() == 0     # exact: the others add zeros
    whole = aten.embedding_dense_backward(grad, idx, 8, pad, scale)
    assert (torch.cat(grads) - whole).abs().max() <= 1e-12
    mode = FakeTensorMode()
    fw, fi, fg = (mode.from_tensor(t) for t in (w.chunk(n)[0].contiguous(), idx, grad))
    with mode:                                                         # the fake rules give the local shapes
        assert vocab_embedding(fw, fi, "fxpar:tp").shape == (3, 4, 5)
        assert vocab_embedding_backward(fg, fi, 8 // n, pad, scale, "fxpar:tp").shape == (8 // n, 5)


def _comms(gm, phase=None):
    return [(M.get(c, M.COMM).kind, M.get(c, M.COMM).nbytes) for c in collective_nodes(gm)
            if phase is None or M.get(c, M.PHASE) == phase]


def _check_split(gm, tp, dp):
    """wte.weight and its AdamW state hold V/tp rows; the lookup is the vocabulary-parallel one and feeds exactly
    one collective, an all_reduce of b·s·h in forward; the tied head reads the split: logits [b·s, V/tp]."""
    b = B // dp
    ph = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    for name in ("wte_weight", "exp_avg_wte_weight", "exp_avg_sq_wte_weight"):
        assert tuple(ph[name].meta["val"].shape) == (V // tp, D), name
    look = gm.graph.find_nodes(op="call_function", target=vocab_embedding)
    assert len(look) == 1 and look[0].args[0] is ph["wte_weight"]
    assert not gm.graph.find_nodes(op="call_function", target=aten.embedding.default)
    (ar,) = [u for u in look[0].users if u in collective_nodes(gm)]
    info = M.get(ar, M.COMM)
    assert (info.kind, info.nbytes, M.get(ar, M.PHASE)) == ("all_reduce", b * S * D * 8, "forward")
    head = [u for t in ph["wte_weight"].users if t.target is aten.t.default for u in t.users
            if u.target is aten.mm.default and M.get(u, M.PHASE) == "forward"]
    assert [tuple(h.meta["val"].shape) for h in head] == [(b * S, V // tp)]


def _run(setup, clusters, **strategy):
    model, batches, (ref_losses, ref_state) = setup
    st = fxpar.Strategy(**strategy)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(st.size), batches[0], gpt_loss, ADAMW, strategy=st)
    res = prog.run_local(batches, cluster=clusters.get(st.size))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10, (res.losses, ref_losses)
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
    assert prog.plan.section("tensor_parallel").stages[0]["params"]["wte.weight"] == ["tp", None]
    return prog, st


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [dict(tp=2), dict(tp=4), dict(dp=2, tp=2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_layout_splits_the_vocabulary(setup, clusters, strategy):
    """Only wte.weight laid out: the blocks run whole, so the step's collectives are the lookup's all_reduce, the
    logits' all_gather (V/tp columns per rank) and the head's input gradient all_reduce -- then dp's gradient sync."""
    prog, st = _run(setup, clusters, sharding=LAYOUT, **strategy)
    b = B // st.dp
    for rank in range(st.size):
        gm = prog.graphs(rank)["step"]
        _check_split(gm, st.tp, st.dp)
        assert _comms(gm, "forward") == [("all_reduce", b * S * D * 8), ("all_gather", b * S * V // st.tp * 8)]
        tp_back = [c for c in _comms(gm, "backward") if c[1] == b * S * D * 8]
        assert tp_back == [("all_reduce", b * S * D * 8)]
        assert len(_comms(gm)) == 3 + (st.dp > 1)          # dp: one bucket of gradients, the only other collective


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [dict(tp=2), dict(tp=4), dict(dp=2, tp=2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_megatron_preset_splits_the_tied_vocabulary(setup, clusters, strategy):
    """The preset splits the tied embedding + head over the vocabulary with the blocks' Linear pairs: forward
    has 2 all_reduces of b·s·h per layer and the lookup's one; backward 2 per layer and the head's one."""
    prog, st = _run(setup, clusters, sharding="megatron", **strategy)
    assert prog.plan.section("tensor_parallel").stages[0]["megatron"]["wte.weight"] == ["tp", None]
    bsh = B // st.dp * S * D * 8
    for rank in range(st.size):
        gm = prog.graphs(rank)["step"]
        _check_split(gm, st.tp, st.dp)
        for phase in ("forward", "backward"):
            assert _comms(gm, phase).count(("all_reduce", bsh)) == 2 * LAYERS + 1, phase


@pytest.mark.structure
def test_megatron_leaves_a_vocabulary_tp_does_not_divide_whole():
    """V = 250 over tp=4: Megatron would pad the vocabulary; the preset keeps the embedding whole (still correct)."""
    torch.manual_seed(0)
    model = GPT(vocab=250, d=D, layers=LAYERS).double()
    batch = token_batches(1, batch=B, seq=S, vocab=250)[0]
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(4), batch, gpt_loss, ADAMW,
                             strategy=fxpar.Strategy(tp=4, sharding="megatron"))
    stage = prog.plan.section("tensor_parallel").stages[0]
    assert "wte.weight" not in stage["megatron"] and stage["params"]["wte.weight"] == [None, None]
    assert not prog.graphs(0)["step"].graph.find_nodes(op="call_function", target=vocab_embedding)


@pytest.mark.slow
@pytest.mark.numerics
def test_handed_back_plan_runs_the_vocabulary_backward_on_4_ranks(setup, clusters):
    """Tofu's choice under its default costs splits wte.weight over the vocabulary on one level and over h on the
    other; handed back in the Plan, both local ops run (the backward scatters only each rank's rows) and training
    equals one process."""
    from passes.tofu import TofuCost, tofu_search
    model, batches, (ref_losses, ref_state) = setup
    st = fxpar.Strategy(tp=4, sharding="auto")
    plan = fxpar.parallelize(model, fxpar.ClusterSpec.local(4), batches[0], gpt_loss, ADAMW, strategy=st).plan
    cap = capture_training_step(model, batches[0], gpt_loss, resolve_optimizer(ADAMW))
    found = tofu_search(cap.gm, 4, TofuCost(), signature=cap.signature, whole_io=True).sharding
    vocab_axis = found.sharding("wte_weight").dims[0]
    assert vocab_axis is not None, found.sharding("wte_weight")
    plan.section("tensor_parallel").stages[0]["auto"] = {k: {n: [s.to_json() for s in v] for n, v in d.items()}
                                                        for k, d in (("out", found.out), ("need", found.need))}
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(4), batches[0], gpt_loss, ADAMW, strategy=st, plan=plan)
    gm = prog.graphs(0)["step"]
    (bwd,) = gm.graph.find_nodes(op="call_function", target=vocab_embedding_backward)
    assert bwd.args[2] == V // 2 and bwd.args[-1] == f"fxpar:{vocab_axis}"       # its rows, its axis
    assert tuple(bwd.meta["val"].shape) == (V // 2, D // 2)                      # h split on the other level
    assert len(gm.graph.find_nodes(op="call_function", target=vocab_embedding)) == 1
    res = prog.run_local(batches, cluster=clusters.get(4))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10


class _TiedBatchNormNet(torch.nn.Module):
    """A tied embedding/head with a BatchNorm between: the preset leaves the Linears whole, so backward computes the
    tied weight's gradient whole and the update runs on it whole (the solver's choice), chunked after."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.fc2(torch.tanh(self.bn(self.fc1(self.emb(ids))))))


@pytest.mark.structure
def test_the_update_reads_the_summed_gradient_when_it_runs_on_another_layout():
    """dp=2 x tp=2: whatever layout the update's ops run in, every gradient they read is made from the data-parallel
    sum (a view of the bucket after its all_reduce), never from the rank's own unreduced gradient."""
    torch.manual_seed(0)
    model = _TiedBatchNormNet().double()
    batch = (torch.randint(0, 16, (16,)), torch.randint(0, 16, (16,)))
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(4), batch, torch.nn.functional.cross_entropy,
                             (torch.optim.SGD, {"lr": 0.1}), strategy=fxpar.Strategy(dp=2, tp=2, sharding="megatron"))
    gm = prog.graphs(0)["step"]
    synced = [n for n in collective_nodes(gm) if n.target == torch.ops._c10d_functional.all_reduce_.default]
    assert len(synced) == 1
    after = set()
    for n in gm.graph.nodes:
        if n in synced or any(a in after for a in n.all_input_nodes):
            after.add(n)
    update = [n for n in gm.graph.nodes if M.get(n, M.PHASE) == "optimizer"]
    assert update
    read = {a for n in update for a in n.all_input_nodes if M.get(a, M.PHASE) == "backward"}
    assert read and read <= after, sorted(a.name for a in read - after)
