"""Random numbers under tensor parallelism (docs/semantics.md, "Random numbers under tensor parallelism").

A dropout mask on a whole tensor is drawn alike by every tp rank of a replica (the stream the tp group shares); a
mask on a split tensor is drawn piece by piece, each tp rank from its own stream (Megatron-LM's RNG tracker,
Shoeybi et al. 2019). Numerics: tp=2 with dropout (embedding, attention output, MLP hidden and output) under the
Megatron preset, Mesh-TensorFlow layouts and Tofu's search equals one process that draws its masks the same way
(``fxpar.testing.tp_streams_reference``), the two tp ranks report the same losses, and a resume with dropout under
tp is bitwise. Structure: the seeds of the two streams, the split mask drawn by ``fxpar.rank_bernoulli``, the plan
note, a split random op that cannot draw from the rank's stream refused.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx

import fxpar
from fxpar import local_ops
from fxpar.errors import PassError
from fxpar.runtime.groups import seed_rank
from fxpar.testing import gpt_loss, max_abs_diff, reference_training, tiny_gpt, token_batches, tp_streams_reference
from fxpar.testing.resume import assert_resume_is_exact
from passes.tensor_parallel import draw_from_streams

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
LAYOUTS = {"blocks.*.fc.weight": ("tp", None), "blocks.*.fc.bias": ("tp",), "blocks.*.fc2.weight": (None, "tp")}
FAST = {"intra_node": fxpar.LinkSpec(100e9, 1e-9)}     # Tofu splits the tiny model on a fast link


def _program(sharding, **strategy):
    model = tiny_gpt(dropout=0.1, block_dropout=0.1)
    batches = token_batches(3, batch=8)
    st = fxpar.Strategy(tp=2, sharding=sharding, **strategy)
    cluster = fxpar.ClusterSpec.local(st.size, **(FAST if sharding == "auto" else {}))
    return model, batches, fxpar.parallelize(model, cluster, batches[0], gpt_loss, ADAMW, strategy=st)


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("mode, dp", [("megatron", 1), ("layouts", 1), ("auto", 1), ("megatron", 2), ("layouts", 2)],
                         ids=["megatron", "layouts", "auto", "megatron-dp2", "layouts-dp2"])
def test_dropout_under_tp_equals_one_process_drawing_the_same_way(clusters, mode, dp):
    model, batches, prog = _program(LAYOUTS if mode == "layouts" else mode, dp=dp)
    sec = prog.plan.section("tensor_parallel")
    drawn = sec.stages[0]["random"]
    streams = {d["stream"] for d in drawn}
    assert len(drawn) == 7 and "rank" in streams, drawn           # 1 embedding + 3 per block; some split
    if mode != "auto":                 # the embedding's and the MLP output's masks are on whole tensors
        assert "shared" in streams
    res = prog.run_local(batches, cluster=clusters.get(2 * dp))
    ref_losses, ref_state = tp_streams_reference(model, batches, gpt_loss, ADAMW, drawn, sec.axes, dp=dp)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-12, (res.losses, ref_losses)
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
    for d in range(dp):                                              # each replica: one loss over its tp ranks
        assert res.per_rank_losses[2 * d] == res.per_rank_losses[2 * d + 1]
    # the split masks are drawn differently from one process's with the same seed: the reference is not vacuous
    torch.manual_seed(0)
    plain, _ = reference_training(model, batches, gpt_loss, ADAMW)
    assert max(abs(a - b) for a, b in zip(plain, ref_losses)) > 1e-6
    if dp > 1:   # replica 1 (ranks 2, 3) draws from streams seeded by its first rank, 2: not replica 0's
        rows = [tuple(t[4:] for t in batches[0])]
        own, _ = tp_streams_reference(model, rows, gpt_loss, ADAMW, drawn, sec.axes, seed=2)
        other, _ = tp_streams_reference(model, rows, gpt_loss, ADAMW, drawn, sec.axes, seed=0)
        assert abs(res.per_rank_losses[2][0] - own[0]) < 1e-12
        assert abs(res.per_rank_losses[2][0] - other[0]) > 1e-6


@pytest.mark.numerics
@pytest.mark.slow
def test_resume_with_dropout_under_tp_is_bitwise(clusters, tmp_path):
    model, _, prog = _program("megatron")
    batches = token_batches(4, batch=8)
    lc = clusters.get(2)
    assert_resume_is_exact(prog, batches, 2, lc, tmp_path / "ck")


@pytest.mark.structure
@pytest.mark.slow
def test_split_masks_draw_from_the_rank_stream_and_the_plan_says_so():
    _, _, prog = _program("megatron")
    drawn = prog.plan.section("tensor_parallel").stages[0]["random"]
    split = [d["node"] for d in drawn if d["stream"] == "rank"]
    assert split and all(d["module"].startswith("blocks.") for d in drawn if d["stream"] == "rank")
    joint = prog.stages[0].joint.graph
    ops = {n.name: n.target for n in joint.nodes}
    assert all(ops[name] is local_ops.rank_bernoulli for name in split)
    assert all(ops[d["node"]] is torch.ops.aten.bernoulli.p for d in drawn if d["stream"] == "shared")
    note = next(n for n in prog.plan.notes if "random op" in n)
    assert "draws the same mask" in note and "its own stream" in note and "tp_streams_reference" in note
    assert any("random op" in line for line in prog.explain().splitlines())


@pytest.mark.structure
def test_the_two_streams_seeds():
    with torch.random.fork_rng(devices=[]):
        saved = local_ops.rank_stream_state()
        seed_rank(5, rank=3, tp_index=1)            # dp replica 1 of tp=2: its tp group starts at rank 2
        assert torch.initial_seed() == 5 + 2
        assert local_ops.rank_stream_state()["seed"] == local_ops.RANK_STREAM_OFFSET + 5 + 3
        seed_rank(5, rank=3)                        # no tensor parallelism: seed + rank, as torch DDP scripts do
        assert torch.initial_seed() == 5 + 3
        x = torch.full((64,), 0.5, dtype=torch.float64)
        a = local_ops.rank_bernoulli(x, 0.5)
        st = local_ops.rank_stream_state()
        b = local_ops.rank_bernoulli(x, 0.5)
        local_ops.set_rank_stream_state(st)         # a checkpoint restores the rank stream
        assert torch.equal(local_ops.rank_bernoulli(x, 0.5), b) and not torch.equal(a, b)
        local_ops.set_rank_stream_state(saved)


@pytest.mark.structure
def test_a_split_random_op_without_a_rank_stream_is_refused():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(torch.ops.aten.rand_like.default, (x,))
    g.output(r)
    gm = torch.fx.GraphModule({}, g)
    drawn = [{"node": r.name, "op": "aten.rand_like.default", "module": "blocks.0.noise", "shape": [4, 8],
              "dims": [None, "tp"], "stream": "rank"}]
    with pytest.raises(PassError, match=r"rand_like.*blocks\.0\.noise.*split over tp.*dropout to 0"):
        draw_from_streams(gm, drawn, 0)
