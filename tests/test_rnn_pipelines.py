"""Recurrent models under every pipeline schedule, and the check that keeps in-place ops from crossing a split.

A stage graph that held the in-place ops of the recurrent cells' decompositions (``sigmoid_``, ``tanh_``,
``add_``) would give ``nn.GRU`` wrong gradients (per-gradient relative error ~1, even on one stage): once the
joint graph is cut into forward and backward graphs, a backward reads tensors a forward changed after saving
them. Capture runs under functionalization, so no graph holds an in-place op from the model; here GRU, LSTM and RNN stacks train under gpipe, 1f1b,
interleaved, zb1p and chimera (pp=2) and with gradient accumulation (pp=1, microbatches=2), equal to
single-process training to 1e-10 (they meet ~1e-15), and no per-microbatch graph holds an in-place op.

``passes.split_graphs.check_no_read_after_inplace_write`` refuses a split that would let a graph read a
tensor after an in-place op changed it; the last tests build such graphs by hand.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn

import fxpar
from fxpar import meta as M
from fxpar.capture import StepSignature
from fxpar.errors import PassError
from fxpar.testing.reference import max_abs_diff, reference_training
from passes.split_graphs import check_no_read_after_inplace_write, split_graphs

CE = nn.functional.cross_entropy
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
TOL = 1e-10
CELLS = ("GRU", "LSTM", "RNN")
D, SEQ, CLASSES, BATCH = 4, 3, 3, 8
aten = torch.ops.aten


class RecurrentBlock(nn.Module):
    """One recurrent layer (batch_first) and a Linear on its outputs."""

    def __init__(self, cell: str, d: int):
        super().__init__()
        self.rnn = getattr(nn, cell)(d, d, batch_first=True)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.proj(y)


class RecurrentStack(nn.Module):
    """``layers`` recurrent blocks in a ModuleList (the pipeline's cut candidates: ``blocks.1`` ...
    ``head``), then a Linear on the last time step."""

    def __init__(self, cell: str, layers: int = 3, d: int = D):
        super().__init__()
        self.blocks = nn.ModuleList(RecurrentBlock(cell, d) for _ in range(layers))
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x[:, -1])


class BareRecurrentStack(nn.Module):
    """Recurrent layers back to back (``nn.GRU`` into ``nn.GRU``), then a Linear on the last time step."""

    def __init__(self, cell: str, layers: int = 2, d: int = D):
        super().__init__()
        self.rnns = nn.ModuleList(getattr(nn, cell)(d, d, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x):
        for rnn in self.rnns:
            x, _ = rnn(x)
        return self.head(x[:, -1])


def _batches(n=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, SEQ, D, generator=g, dtype=torch.float64),
             torch.randint(0, CLASSES, (BATCH,), generator=g)) for _ in range(n)]


class _Case:
    def __init__(self, cell: str):
        torch.manual_seed(0)
        self.model = RecurrentStack(cell).double()
        self.batches = _batches()
        self.ref_losses, self.ref_state = reference_training(self.model, self.batches, CE, ADAMW)


@pytest.fixture(scope="module")
def cases():
    made = {}

    def get(cell: str) -> _Case:
        if cell not in made:
            made[cell] = _Case(cell)
        return made[cell]
    return get


def _writes(gm: torch.fx.GraphModule) -> list:
    """Nodes with an argument their schema marks as written (``Tensor(a!)``)."""
    return [n.name for n in gm.graph.nodes
            if any(a.alias_info is not None and a.alias_info.is_write
                   for a in getattr(getattr(n.target, "_schema", None), "arguments", ()))]


# two-stage schedules cut between the first and second recurrent block, so a recurrent layer's gradient
# crosses the cut; interleaved (two stages per rank) needs three cuts: the planner's, among blocks.1, blocks.2
# and head, the three places a stack of three blocks can be cut
STRATEGIES = {
    "gpipe": dict(pp=2, schedule="gpipe", microbatches=4, split_points=["blocks.1"]),
    "1f1b": dict(pp=2, schedule="1f1b", microbatches=4, split_points=["blocks.1"]),
    "interleaved": dict(pp=2, schedule="interleaved", microbatches=4),
    "zb1p": dict(pp=2, schedule="zb1p", microbatches=4, split_points=["blocks.1"]),
    "chimera": dict(pp=2, schedule="chimera", microbatches=4, split_points=["blocks.1"]),
    "accumulate": dict(microbatches=2),
}


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("sid", list(STRATEGIES))
@pytest.mark.parametrize("cell", CELLS)
def test_recurrent_stack_matches_single_process(clusters, cases, cell, sid):
    case = cases(cell)
    st = fxpar.Strategy(**STRATEGIES[sid])
    prog = fxpar.parallelize(case.model, st.size, case.batches[0], CE, ADAMW, strategy=st)
    res = prog.run_local(case.batches, cluster=clusters.get(st.size) if st.size > 1 else None)
    assert max(abs(a - b) for a, b in zip(res.losses, case.ref_losses)) < TOL, (res.losses, case.ref_losses)
    assert max_abs_diff(res.state_dict(), case.ref_state) < TOL

    if sid == "interleaved":
        assert prog.plan.n_stages == 4 and prog.plan.cuts == ["blocks.1", "blocks.2", "head"]
    elif st.pp > 1:
        assert prog.plan.cuts == ["blocks.1"]
    # the proof that the old bug class is gone: no per-microbatch graph writes in place
    kinds = set()
    for stage in prog.stages:
        for kind, sg in stage.graphs.items():
            kinds.add(kind)
            if kind in ("F", "B", "I", "W"):
                assert _writes(sg.gm) == [], (kind, _writes(sg.gm))
    assert {"F", "I", "W"} <= kinds if sid == "zb1p" else {"F", "B"} <= kinds


# A cut between two bare recurrent layers: the activation crossing it is a transposed, non-contiguous
# tensor in the whole-model trace, but it travels (and is captured) contiguous. Stage graphs therefore run
# their views as reshapes (fxpar/capture.py ``_StageRunner``) and the runtime hands every received or
# locally passed activation over contiguous. The planner itself picks such cuts (GRU, LSTM: rnns.3).
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("cell", CELLS)
def test_cut_between_bare_recurrent_layers(clusters, cell):
    torch.manual_seed(0)
    model, batches = BareRecurrentStack(cell).double(), _batches()
    ref_losses, ref_state = reference_training(model, batches, CE, ADAMW)
    prog = fxpar.parallelize(model, 2, batches[0], CE, ADAMW,
                             strategy=fxpar.Strategy(pp=2, microbatches=4, split_points=["rnns.1"]))
    res = prog.run_local(batches, cluster=clusters.get(2))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL


# ---- check_no_read_after_inplace_write on hand-made joint graphs ------------------------------------------
class _Joint:
    """A joint stage graph built node by node, each node tagged as capture and the passes tag theirs."""

    def __init__(self, inputs: list):
        self.g = torch.fx.Graph()
        self.inputs = inputs
        self.ph = {}
        for role, key in inputs:
            self.ph[key] = self.g.placeholder(key if role == "param" else f"{role}{key}")

    def op(self, name: str, target, *args, phase: str | None = None, reduce_grad: str | None = None,
           grad_of: str | None = None):
        n = self.g.call_function(target, args)
        n._rename(name)
        if phase:
            M.set_meta(n, M.PHASE, phase)
        if reduce_grad:
            M.set_meta(n, M.REDUCE_GRAD, reduce_grad)
        if grad_of:
            M.set_meta(n, M.GRAD_OF, grad_of)
        return n

    def gm(self, outputs: list) -> torch.fx.GraphModule:
        self.g.output(tuple(n for n, _ in outputs))
        gm = torch.fx.GraphModule(torch.nn.Module(), self.g)
        gm.meta["fxpar_signature"] = StepSignature(list(self.inputs), [rk for _, rk in outputs])
        return gm


def _linear_stage(mutate_saved: bool):
    """``loss = sum(sigmoid(x @ w))``; its backward reads ``x``'s product ``h``. With ``mutate_saved`` the
    forward computes the sigmoid in place on ``h`` after ``h`` was saved for the backward."""
    j = _Joint([("param", "w"), ("input", "0")])
    h = j.op("h", aten.mm.default, j.ph["0"], j.ph["w"], phase="forward")
    s = j.op("s", aten.sigmoid_.default if mutate_saved else aten.sigmoid.default, h, phase="forward")
    loss = j.op("loss", aten.sum.default, s, phase="forward")
    # backward of sum(sigmoid(h)) wrt w: x^T (sigmoid'(h)); sigmoid_backward reads the output s
    ds = j.op("ds", aten.sigmoid_backward.default, j.op("ones", aten.ones_like.default, s, phase="backward"), s,
              phase="backward")
    hx = j.op("uses_h", aten.mul.Tensor, ds, h, phase="backward")      # a backward that reads h itself
    gw = j.op("grad_w", aten.mm.default, j.op("xt", aten.t.default, j.ph["0"], phase="backward"), hx,
              phase="backward", grad_of="w")
    return j.gm([(loss, ("loss", "loss")), (gw, ("grad", "w"))])


@pytest.mark.structure
def test_forward_that_mutates_a_saved_tensor_is_refused_by_name():
    parts = split_graphs(_linear_stage(mutate_saved=False), ("F", "B"))      # the functional form splits
    assert set(parts) == {"F", "B"} and ("saved", "h") in parts["B"].inputs
    with pytest.raises(PassError) as info:
        split_graphs(_linear_stage(mutate_saved=True), ("F", "B"))
    msg = str(info.value)
    assert "node s (aten.sigmoid_.default)" in msg          # the node
    assert "in the F graph writes in place into h" in msg    # the writer's graph and the mutated tensor
    assert "('saved', 'h')" in msg and "the B graph reads" in msg   # how, and the reader's graph
    assert "out of place" in msg                             # what to do


@pytest.mark.structure
def test_zero_bubble_split_with_a_mutated_saved_tensor_is_refused():
    with pytest.raises(PassError, match=r"node s \(aten.sigmoid_.default\) in the F graph writes in place into h"):
        split_graphs(_linear_stage(mutate_saved=True), ("F", "I", "W"))


@pytest.mark.structure
def test_forward_writing_a_parameter_is_refused():
    j = _Joint([("param", "w"), ("input", "0")])
    upd = j.op("scale_w", aten.mul_.Tensor, j.ph["w"], 2.0, phase="forward")
    h = j.op("h", aten.mm.default, j.ph["0"], upd, phase="forward")
    loss = j.op("loss", aten.sum.default, h, phase="forward")
    gw = j.op("grad_w", aten.mm.default, j.op("xt", aten.t.default, j.ph["0"], phase="backward"),
              j.op("ones", aten.ones_like.default, h, phase="backward"), phase="backward", grad_of="w")
    with pytest.raises(PassError, match=r"node scale_w \(aten.mul_.Tensor\) in the F graph writes in place into w, "
                                        r"which is its input \('param', 'w'\).*every other microbatch"):
        split_graphs(j.gm([(loss, ("loss", "loss")), (gw, ("grad", "w"))]), ("F", "B"))


def _bucketed_stage(reduce_in_place_on_grad: bool = False, step_reads_bucket_by_old_name: bool = False):
    """A one-parameter stage with the bucket pass's pattern: REDUCE_GRAD copies the gradient into a fresh
    bucket and all-reduces it in place; STEP waits on the result and updates ``w``."""
    j = _Joint([("param", "w"), ("input", "0")])
    h = j.op("h", aten.mm.default, j.ph["0"], j.ph["w"], phase="forward")
    loss = j.op("loss", aten.sum.default, h, phase="forward")
    gw = j.op("grad_w", aten.mm.default, j.op("xt", aten.t.default, j.ph["0"], phase="backward"),
              j.op("ones", aten.ones_like.default, h, phase="backward"), phase="backward", grad_of="w")
    c10d = torch.ops._c10d_functional
    if reduce_in_place_on_grad:     # all_reduce_ the gradient itself, and STEP reads the gradient too
        red = j.op("all_reduce_", c10d.all_reduce_.default, gw, "sum", "fxpar:dp", reduce_grad="issue")
        waited = j.op("wait", c10d.wait_tensor.default, red, reduce_grad="wait")
        upd = j.op("upd", aten.add.Tensor, waited, gw, phase="optimizer")
    else:
        bucket = j.op("bucket", aten.empty.memory_format, [4], reduce_grad="issue")
        slot = j.op("slot", aten.view.default, bucket, [2, 2], reduce_grad="issue")
        j.op("copy_", aten.copy_.default, slot, gw, reduce_grad="issue")
        red = j.op("all_reduce_", c10d.all_reduce_.default, bucket, "sum", "fxpar:dp", reduce_grad="issue")
        src = bucket if step_reads_bucket_by_old_name else red
        waited = j.op("wait", c10d.wait_tensor.default, src, reduce_grad="wait")
        upd = j.op("upd", aten.view.default, waited, [2, 2], phase="optimizer")
    new_w = j.op("new_w", aten.sub.Tensor, j.ph["w"], upd, phase="optimizer")
    return j.gm([(loss, ("loss", "loss")), (new_w, ("new_param", "w")), (gw, ("grad", "w"))])


KINDS = ("F", "B", "REDUCE_GRAD", "STEP")


@pytest.mark.structure
def test_bucket_written_in_reduce_grad_and_read_in_step_is_allowed():
    parts = split_graphs(_bucketed_stage(), KINDS)
    assert _writes(parts["REDUCE_GRAD"].gm) == ["copy_", "all_reduce_"]
    assert ("pending", "all_reduce_") in parts["STEP"].inputs
    check_no_read_after_inplace_write(parts)                  # and directly: nothing to refuse


@pytest.mark.structure
def test_step_reading_the_bucket_by_its_name_before_the_reduction_is_refused():
    with pytest.raises(PassError, match=r"node copy_ \(aten.copy_.default\) in the REDUCE_GRAD graph writes in "
                                        r"place into slot \(a view of bucket\), which REDUCE_GRAD exports as "
                                        r"\('pending', 'bucket'\) \(bucket, made before this write\) and the STEP "
                                        r"graph reads"):
        split_graphs(_bucketed_stage(step_reads_bucket_by_old_name=True), KINDS)


@pytest.mark.structure
def test_reduce_grad_reducing_a_gradient_step_also_reads_is_refused():
    with pytest.raises(PassError, match=r"node all_reduce_ .* in the REDUCE_GRAD graph writes in place into "
                                        r"grad_grad_w, which is its input \('grad', 'w'\); the STEP graph, run "
                                        r"later in the step, reads that input too"):
        split_graphs(_bucketed_stage(reduce_in_place_on_grad=True), KINDS)


@pytest.mark.structure
def test_write_to_a_constant_is_refused():
    j = _Joint([("param", "w"), ("input", "0")])
    const = j.g.get_attr("scale")
    bumped = j.op("bump", aten.add_.Tensor, const, 1.0, phase="forward")
    h = j.op("h", aten.mul.Tensor, j.op("mm", aten.mm.default, j.ph["0"], j.ph["w"], phase="forward"), bumped,
             phase="forward")
    loss = j.op("loss", aten.sum.default, h, phase="forward")
    gw = j.op("grad_w", aten.mm.default, j.op("xt", aten.t.default, j.ph["0"], phase="backward"),
              j.op("ones", aten.ones_like.default, h, phase="backward"), phase="backward", grad_of="w")
    root = torch.nn.Module()
    root.register_buffer("scale", torch.ones(()))
    j.g.output((loss, gw))
    gm = torch.fx.GraphModule(root, j.g)
    gm.meta["fxpar_signature"] = StepSignature(list(j.inputs), [("loss", "loss"), ("grad", "w")])
    with pytest.raises(PassError, match=r"node bump .* writes in place into scale, which is the constant 'scale'"):
        split_graphs(gm, ("F", "B"))
