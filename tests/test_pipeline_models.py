"""Stage cutting on the pipeline tests' small models (fxpar.testing.pipeline_models): structure tests that need no
ranks."""
from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.capture import trace_forward
from fxpar.roles import GraphKind, Role
from fxpar.testing import SkipNet, TinyGPT, class_batches, flat_gpt_loss, tiny_gpt_batches
from passes.split_stages import cut_candidates, split_stages

pytestmark = pytest.mark.structure

SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


def _gpt_trace(batch=2):
    torch.manual_seed(0)
    return trace_forward(TinyGPT().double(), tiny_gpt_batches(1, batch=batch)[0], flat_gpt_loss)


def test_cut_candidates_are_blocks_in_order():
    ft = _gpt_trace()
    assert cut_candidates(ft.gm, ft.roles, ft.module_types) == \
        ["wpe", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "head"]


def test_user_split_points_assign_modules_and_tie_the_embedding():
    ft = _gpt_trace()
    split = split_stages(ft.gm, ft.roles, 4, ["blocks.1", "blocks.2", "ln_f"], ft.module_types)
    mods = [{m.split(".")[0] + ("." + m.split(".")[1] if m.startswith("blocks") else "") for m in st.modules}
            for st in split.stages]
    assert mods == [{"wte", "blocks.0"}, {"blocks.1"}, {"blocks.2", "blocks.3"}, {"ln_f", "head"}]
    # the LM head is tied to wte: both the first and the last stage hold it, nothing else is shared
    assert split.shared_params == {"wte.weight": [0, 3]}
    # each boundary is one tensor (the residual stream), the last stage returns the loss
    assert [len([1 for r, _ in st.inputs if r == "act"]) for st in split.stages] == [0, 1, 1, 1]
    assert split.stages[-1].outputs == [("loss", "loss")]
    # every activation node lands in exactly one stage; replicated nodes (t(weight), arange) are recomputed
    owned = [n for st in split.stages for n in st.nodes]
    assert len(owned) == len(set(owned))
    assert any("arange" in n for n in split.stages[0].replicated)


def test_skip_connection_is_forwarded_through_middle_stages():
    torch.manual_seed(0)
    ft = trace_forward(SkipNet().double(), class_batches(1)[0], torch.nn.functional.cross_entropy)
    split = split_stages(ft.gm, ft.roles, 4, ["layers.1", "layers.2", "layers.3"], ft.module_types)
    h = split.stages[0].outputs[0][1]          # the output of `inp`, added back at the end
    for st in split.stages[1:]:
        assert ("act", h) in st.inputs          # it reaches every later stage ...
    for st in split.stages[1:-1]:
        assert ("act", h) in st.outputs         # ... passing through the middle ones unchanged
    assert [len(st.outputs) for st in split.stages] == [2, 2, 2, 1]


def test_balanced_cut_splits_the_blocks_evenly():
    ft = _gpt_trace()
    split = split_stages(ft.gm, ft.roles, 2, None, ft.module_types)
    assert split.cuts == ["blocks.2"]
    f0, f1 = (st.flops for st in split.stages)
    assert 0.7 < f0 / f1 < 1.3


def test_too_many_stages_names_the_candidates():
    torch.manual_seed(0)
    ft = trace_forward(SkipNet(layers=2).double(), class_batches(1)[0], torch.nn.functional.cross_entropy)
    with pytest.raises(fxpar.StrategyError, match=r"only 3 place\(s\) to cut, before \['layers.0', 'layers.1', 'out'\]"):
        split_stages(ft.gm, ft.roles, 5, None, ft.module_types)
    with pytest.raises(fxpar.StrategyError, match="not a module the forward runs"):
        split_stages(ft.gm, ft.roles, 2, ["layers.7"], ft.module_types)


def _build(model, batch, loss_fn, **strategy):
    strategy = fxpar.Strategy(**strategy)
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(strategy.size), batch, loss_fn, SGD, strategy=strategy)


def test_1f1b_with_fewer_microbatches_than_stages_states_the_bubble():
    torch.manual_seed(0)
    with pytest.raises(fxpar.StrategyError, match=r"m >= p.*50%.*\(p-1\)/\(v\*m\+p-1\)"):
        _build(SkipNet().double(), class_batches(1)[0], torch.nn.functional.cross_entropy,
               pp=2, schedule="1f1b", microbatches=1)


def test_batch_not_divisible_by_microbatches_times_dp():
    torch.manual_seed(0)
    # one batch check for every strategy now (fxpar.planner.check_batch), which names the tensor and its shape
    with pytest.raises(fxpar.StrategyError, match=r"example_inputs\[0\] has batch 8.*which dp=2 x microbatches=3 = 6 "
                                                  r"does not divide"):
        _build(SkipNet().double(), class_batches(1, batch=8)[0], torch.nn.functional.cross_entropy,
               pp=2, dp=2, schedule="gpipe", microbatches=3)


@pytest.mark.slow
def test_program_graphs_schedule_and_sends():
    torch.manual_seed(0)
    prog = _build(TinyGPT().double(), tiny_gpt_batches(1)[0], flat_gpt_loss, pp=2, dp=2, schedule="1f1b", microbatches=4)
    assert prog.world_size == 4
    # the graphs split_graphs cut out of each stage's joint graph (were stage{s}.forward/.backward/.step)
    assert set(prog.graphs(0)) == {"stage0.F", "stage0.B", "stage0.REDUCE_GRAD", "stage0.STEP"}
    assert set(prog.graphs(3)) == {"stage1.F", "stage1.B", "stage1.REDUCE_GRAD", "stage1.STEP"}
    # rank 1 is pipeline rank 0 of the second replica: its peer is global rank 3
    assert str(prog.schedule(1)).startswith("rank 1: F0.0 SF0.0>3 F0.1 SF0.1>3 RB0.0<3 B0.0")
    kinds = [a.kind.value for a in prog.schedule(0)]
    assert kinds.count("SF") == 4 and kinds.count("RB") == 4 and kinds.count("STEP") == 1
    assert kinds[-2:] == ["RG", "STEP"]          # the stage's gradient collectives (REDUCE_GRAD), then its step
    text = prog.explain()
    assert "bubble 0.200" in text and "wte.weight" in text


@pytest.mark.slow
def test_stage_graphs_compose_to_autograd_gradients():
    """Run stage forwards then backwards in one process: the gradients equal torch.autograd's.

    The graphs are the F and B graphs split_graphs cut from each stage's joint graph; each input and output
    carries its (role, key), which is all that wires them together (as in the runtime)."""
    torch.manual_seed(0)
    model = TinyGPT().double()
    x, y = tiny_gpt_batches(1, batch=2)[0]
    prog = _build(model, (x, y), flat_gpt_loss, pp=2, schedule="gpipe", microbatches=1)
    params = dict(model.named_parameters())
    batch = {"input": [x], "target": [y]}
    acts, saved, measured, loss = {}, [], [], None
    for st in prog.stages:
        f = st.graphs["F"]
        args = [params[k] if r == "param" else batch[r][int(k)] if r in batch else acts[k] for r, k in f.inputs]
        res = f.gm(*[a.detach() for a in args])
        sv = {k: v for (r, k), v in zip(f.outputs, res) if r == "saved"}
        saved.append(sv)
        # the activation bytes of one microbatch are the saved tensors that are not weights (or views of them)
        weight_storages = {params[k].untyped_storage().data_ptr() for k in st.param_keys}
        act = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in sv.values()
               if t.untyped_storage().data_ptr() not in weight_storages}
        measured.append(sum(act.values()))
        acts = {k: v for (r, k), v in zip(f.outputs, res) if r == "act"}
        loss = next((v for (r, _), v in zip(f.outputs, res) if r == "loss"), loss)
    grads, tangents = {}, {}
    for st, sv in reversed(list(zip(prog.stages, saved))):
        b = st.graphs["B"]
        res = b.gm(*[sv[k] if r == "saved" else tangents[k] for r, k in b.inputs])
        tangents = {}
        for (r, k), g in zip(b.outputs, res):
            if r == "grad":                     # the tied wte.weight gets one from each stage: summed
                grads[k] = grads.get(k, 0) + g
            elif r == "act_grad":
                tangents[k] = g
    ref = flat_gpt_loss(model(x), y)
    ref.backward()
    assert measured == [st.saved_bytes for st in prog.stages]
    assert abs(float(loss) - float(ref.detach())) < 1e-12
    assert set(grads) == set(params) - {"head.weight"}     # the alias of wte.weight: one parameter
    for k, g in grads.items():
        torch.testing.assert_close(g, params[k].grad, rtol=0, atol=1e-12)


def test_buffers_written_in_forward_leave_the_forward_of_the_stage_that_reads_them():
    """BatchNorm's running statistics and step count: the stage whose forward runs the BatchNorm writes them (its F
    graph returns their new values, microbatch by microbatch); no other stage's graphs read them."""
    from fxpar.testing.models import BNConvNet
    prog = _build(BNConvNet().double(), (torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 10, (4,))),
                  torch.nn.functional.cross_entropy, pp=2, schedule="gpipe", microbatches=2)
    keys = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    written = [{k for r, k in st.graphs[GraphKind.F].outputs if r == Role.NEW_BUFFER} for st in prog.stages]
    read = [{k for sg in st.graphs.values() for r, k in sg.inputs if r == Role.BUFFER} for st in prog.stages]
    assert sorted(map(len, written)) == [0, 3] and keys in written
    owner = written.index(keys)
    assert read[owner] >= keys and not read[1 - owner] & keys


@pytest.mark.slow
def test_history_and_collectives_of_a_pipeline_rank():
    """history(rank): each pass's graph per held stage, ending in the graphs the rank runs;
    collectives(rank): its sends/recvs in schedule order, then the dp and tied-weight all-reduces of REDUCE_GRAD."""
    torch.manual_seed(0)
    prog = _build(TinyGPT().double(), tiny_gpt_batches(1, batch=16)[0], flat_gpt_loss, pp=2, dp=2, schedule="1f1b",
                  microbatches=4)
    hist = prog.history(0)
    # one pass list on each stage's joint graph (as for dp), then one entry per graph split_graphs cut out
    # (was: trace_forward, split_stages, differentiate_stage:forward/:backward, trace_step)
    assert [h.pass_name for h in hist] == ["capture", "data_parallel", "bucket", "sync_buffers", "reinplace_optimizer",
                                           "split_graphs", "split_graphs:F", "split_graphs:B",
                                           "split_graphs:REDUCE_GRAD", "split_graphs:STEP"]
    assert all(h.info["stage"] == 0 for h in hist)
    by_name = {h.pass_name: h for h in hist}
    for kind in ("F", "B", "REDUCE_GRAD", "STEP"):
        assert by_name[f"split_graphs:{kind}"].code == prog.graphs(0)[f"stage0.{kind}"].code
    assert {h.info["stage"] for h in prog.history(3)} == {1}
    comms = prog.collectives(1)                  # pipeline rank 0 of the second replica; its peer is rank 3
    act = 2 * 8 * 16 * 8                          # a microbatch of 2 x 8 tokens x d=16, float64
    assert [(c.kind, c.ranks, c.nbytes) for c in comms[:4]] == \
        [("send", (1, 3), act), ("send", (1, 3), act), ("recv", (3, 1), act), ("send", (1, 3), act)]
    assert sum(c.kind == "send" for c in comms) == 4 and sum(c.kind == "recv" for c in comms) == 4
    # Gradient sync is the bucket pass's collectives in REDUCE_GRAD, one per bucket of stage 0, in the plan's
    # order. The tied wte gradient is summed once, over every rank holding a stage that uses it (both stages x
    # both replicas), and the dp buckets leave it out.
    nbytes = lambda k: prog._params[k].numel() * 8   # noqa: E731
    stage0 = sum(nbytes(k) for k in prog.stages[0].param_keys)
    wte = 32 * 16 * 8
    assert all(c.kind == "all_reduce" for c in comms[8:])
    assert [c.nbytes for c in comms[8:]] == [sum(nbytes(k) for k in b) for b in prog.plan.section("data_parallel").buckets[0]]
    assert [(c.axis, c.ranks) for c in comms[8:] if c.axis != "dp"] == [("tied.wte.weight", (0, 1, 2, 3))]
    assert sum(c.nbytes for c in comms[8:] if c.axis == "tied.wte.weight") == wte
    assert {c.ranks for c in comms[8:] if c.axis == "dp"} == {(0, 1)}
    assert sum(c.nbytes for c in comms[8:] if c.axis == "dp") == stage0 - wte
