"""Operator partitioning, graph level: Megatron's tensor parallelism from layouts alone.

Layouts (Mesh-TensorFlow style) split the column-parallel weights (q, k, v, fc1) by rows and the
row-parallel ones (o, fc2) by columns; propagation (GShard) decides every other node of the joint
step -- forward, backward and the traced optimizer -- and lowering inserts the collectives. Proof:

* structure: one all_reduce forward per MLP; the attention + MLP block has 2 all_reduces forward and
  2 backward, each of b·s·h elements (Narayanan et al., SC'21, §2.3 / Shoeybi et al. 2019, Fig. 3),
  and nothing else; the bytes each carries equal the propagation's closed form.
* numerics: the lowered per-rank graphs on 2 gloo ranks reproduce the unsharded joint step (loss,
  every new parameter and gradient) in float64 to 1e-10.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar import meta as M
from fxpar.capture import capture_training_step
from fxpar.collectives import collective_nodes
from fxpar.mesh import Mesh
from fxpar.testing.models import MegatronBlock as Block
from fxpar.optim import resolve_optimizer
from fxpar.sharding import collective_bytes
from fxpar.testing import CNN, GPT, gpt_loss
from passes.lower_sharding import global_value, local_value, lower_shardings
from passes.propagate_sharding import propagate_shardings

TP = Mesh((("tp", 2),))
B, S, H = 2, 4, 16


class MLPBlock(nn.Module):
    def __init__(self, d=H):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MegatronBlock(Block):
    """An input projection (so the block's input needs a gradient), then pre-LN attention + MLP."""

    def __init__(self, d=H, heads=4):
        super().__init__(d, heads, in_proj=True)


class AnnotatedMLP(nn.Module):
    """No layout: one GShard annotation on the hidden activation decides the rest."""

    def __init__(self, d=H):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(fxpar.shard(F.gelu(self.fc1(x)), (None, None, "tp")))


class Redistributions(nn.Module):
    """Annotations that force layout changes: rows -> hidden (all_to_all), rows -> the loss (all_gather),
    a replicated value cut (slice); with fc2 row-parallel (a layout) its partial sums -> rows (reduce_scatter)."""

    def __init__(self, d=H):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Linear(d, d)

    def forward(self, x):
        h = fxpar.shard(x, ("tp", None, None))
        h = fxpar.shard(torch.tanh(self.fc1(h)), (None, None, "tp"))
        y = fxpar.shard(self.fc2(h), ("tp", None, None))
        return self.fc3(y)


MLP_LAYOUT = {"fc1.weight": ("tp", None), "fc2.weight": (None, "tp")}
BLOCK_LAYOUT = {**MLP_LAYOUT, "q.weight": ("tp", None), "k.weight": ("tp", None), "v.weight": ("tp", None),
                "o.weight": (None, "tp")}
SGD = (torch.optim.SGD, {"lr": 0.1})


def _capture(model, opt=SGD, batch=None, loss=F.mse_loss):
    torch.manual_seed(0)
    model = model.double()
    batch = batch or (torch.randn(B, S, H, dtype=torch.float64), torch.randn(B, S, H, dtype=torch.float64))
    return model, batch, capture_training_step(model, batch, loss, resolve_optimizer(opt))


def _collectives(gm, phase=None):
    return [n for n in collective_nodes(gm) if phase is None or M.get(n, M.PHASE) == phase]


@pytest.mark.structure
def test_megatron_mlp_one_all_reduce_forward():
    _, _, cap = _capture(MLPBlock())
    res = propagate_shardings(cap.gm, TP, layouts=MLP_LAYOUT)
    assert str(res.sharding("fc1_bias")) == "P('tp')"                 # the bias follows its column split
    assert str(res.sharding("addmm_1")) == "P(None, None, partial=('tp',))"   # row-parallel: partial sums
    for rank in range(2):
        low = lower_shardings(cap.gm, res, TP, rank)
        fwd = _collectives(low, "forward")
        assert [M.get(n, M.COMM).kind for n in _collectives(low)] == ["all_reduce"]
        assert len(fwd) == 1 and M.get(fwd[0], M.COMM).nbytes == B * S * H * 8
        assert M.get(fwd[0], M.COMM).ranks == (0, 1)


@pytest.mark.structure
def test_megatron_block_two_all_reduces_forward_two_backward():
    _, _, cap = _capture(MegatronBlock())
    res = propagate_shardings(cap.gm, TP, layouts=BLOCK_LAYOUT)
    low = lower_shardings(cap.gm, res, TP, 1)
    comm = [M.get(n, M.COMM) for n in _collectives(low)]
    assert [c.kind for c in comm] == ["all_reduce"] * 4
    assert [M.get(n, M.PHASE) for n in _collectives(low)] == ["forward", "forward", "backward", "backward"]
    assert all(c.nbytes == B * S * H * 8 for c in comm)               # b·s·h elements each
    # heads split: q, k, v are column-parallel, attention runs on each rank's heads
    sdpa = next(n for n in cap.gm.graph.nodes if "flash_attention" in str(n.target) and M.get(n, M.PHASE) == "forward")
    assert str(res.out[sdpa.name][0]) == "P(None, 'tp', None, None)"
    # the propagation's closed form = the bytes the inserted collectives carry
    planned = [r for r in res.redistributions if r[5] not in ("zero", "slice")]     # local: no collective
    assert sorted(r[-1] for r in planned) == sorted(collective_bytes(c.kind, c.nbytes, 2) for c in comm)
    assert [r[5] for r in planned] == ["all_reduce"] * 4
    # the two row-parallel biases (o, fc2) are added once: rank 0 keeps them, the other rank adds zeros
    assert sorted(r[1] for r in res.redistributions if r[5] == "zero") == ["fc2_bias", "o_bias"]


def _run_rank(packed, inputs, axis_ranks):
    from fxpar.runtime.executor import bind_groups, group
    from fxpar.portable import unpack_graph_module
    gm = unpack_graph_module(packed)
    bind_groups(gm, {a: group(tuple(rs), a).group_name for a, rs in axis_ranks.items()})
    return [o.detach() for o in gm(*inputs)]


def _full_inputs(model, batch, cap):
    params = dict(model.named_parameters())
    by_role = {"param": lambda k: params[k].detach().clone(),
               "opt_state": lambda k: torch.zeros_like(params[k.split(":", 1)[1]]),
               "lr": lambda k: torch.tensor(0.1, dtype=torch.float64), "step": lambda k: torch.tensor(1.0, dtype=torch.float64),
               "input": lambda k: batch[0], "target": lambda k: batch[1]}
    return [by_role[r](k) for r, k in cap.signature.inputs]


ADAMW = (torch.optim.AdamW, {"lr": 1e-2})
GPT_LAYOUT = {"blocks.*.qkv.weight": ("tp", None), "blocks.*.proj.weight": (None, "tp"),
              "blocks.*.fc.weight": ("tp", None), "blocks.*.fc2.weight": (None, "tp")}
CNN_LAYOUT = {"conv1.weight": ("tp", None, None, None), "conv2.weight": (None, "tp", None, None)}


def _gpt():
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 8))
    return GPT(), (x, torch.randint(0, 64, (2, 8))), gpt_loss


def _cnn():
    return CNN(), (torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.randint(0, 10, (2,))), F.cross_entropy


def _redistributions():
    x = torch.randn(4, S, H, dtype=torch.float64)             # a batch of 4: rows split 4 ways at tp=4
    return Redistributions(), (x, torch.randn(4, S, H, dtype=torch.float64)), F.mse_loss


CASES = {   # name: (model builder -> (model, batch, loss) or a module class, layouts, optimizer, tp)
    "mlp-sgd-tp2": (MLPBlock, MLP_LAYOUT, SGD, 2),
    "block-adamw-tp2": (MegatronBlock, BLOCK_LAYOUT, ADAMW, 2),
    "block-adamw-tp4": (MegatronBlock, BLOCK_LAYOUT, ADAMW, 4),
    "annotated-mlp-tp2": (AnnotatedMLP, {}, SGD, 2),
    # the tied GPT: qkv is one Linear split into q, k, v along the split dim, so propagation gathers it there
    "tied-gpt-adamw-tp2": (_gpt, GPT_LAYOUT, ADAMW, 2),
    "cnn-channels-sgd-tp2": (_cnn, CNN_LAYOUT, SGD, 2),                  # conv1 out-, conv2 in-channels split
    "redistributions-sgd-tp2": (_redistributions, {}, SGD, 2),
    "redistributions-adamw-tp4": (_redistributions, {}, ADAMW, 4),
    "redistributions-rowparallel-sgd-tp2": (_redistributions, {"fc2.weight": (None, "tp")}, SGD, 2),
}


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("case", list(CASES))
def test_lowered_graphs_on_n_ranks_equal_unsharded_step(clusters, case):
    from fxpar.portable import pack_graph_module
    build, layout, opt, n = CASES[case]
    mesh = Mesh((("tp", n),))
    if isinstance(build, type):
        model, batch, cap = _capture(build(), opt)
    else:
        model, batch, loss = build()
        model, batch, cap = _capture(model, opt, batch, loss)
    res = propagate_shardings(cap.gm, mesh, layouts=layout, signature=cap.signature)
    full = _full_inputs(model, batch, cap)
    ref = cap.gm(*full)
    placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    args = []
    for rank in range(n):
        low = lower_shardings(cap.gm, res, mesh, rank)
        planned = [r for r in res.redistributions if r[5] not in ("zero", "slice")]
        made = [M.get(c, M.COMM) for c in collective_nodes(low)]
        assert sorted(c.kind for c in made) == sorted(r[5] for r in planned)
        assert sorted(collective_bytes(c.kind, c.nbytes, n) for c in made) == sorted(r[-1] for r in planned)
        local = [local_value(t, res.sharding(p), mesh, rank) for t, p in zip(full, placeholders)]
        args.append((pack_graph_module(low), local, {"tp": tuple(range(n))}))
    outs = clusters.get(n).run(_run_rank, args)
    out_nodes = list(cap.gm.graph.output_node().args[0])
    assert len(out_nodes) == len(ref) > 3
    out_sh = res.need["output"]                          # how each output leaves the graph
    for i, (node, want) in enumerate(zip(out_nodes, ref)):
        got = global_value([outs[r][i] for r in range(n)], out_sh[i], mesh)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-10, (cap.signature.outputs[i], res.sharding(node))
    # each updated parameter and optimizer state comes out laid out as it came in (the next step reads it)
    sig_out = dict(zip(cap.signature.outputs, out_nodes))
    for (role, key), p in zip(cap.signature.inputs, placeholders):
        if role in ("param", "opt_state"):
            assert out_sh[out_nodes.index(sig_out[("new_" + role, key)])] == res.sharding(p), (role, key)
    # the parameters really are split: each rank holds 1/n of what the layout (or annotation) splits
    for i, p in enumerate(placeholders):
        sh = res.sharding(p)
        if M.get(p, M.ROLE) == "param" and not sh.is_replicated:
            assert args[0][1][i].numel() * n == full[i].numel()
    assert any(not res.sharding(p).is_replicated for p in placeholders if M.get(p, M.ROLE) == "param")
    if case.startswith("redistributions"):
        kinds = {r[5] for r in res.redistributions}
        want = {"reduce_scatter", "zero", "all_gather"} if "rowparallel" in case else {"slice", "all_to_all", "all_gather"}
        assert want <= kinds, kinds
    if case.startswith("cnn"):          # conv1 runs split over its output channels, its backward too
        assert str(res.sharding("convolution")) == "P(None, 'tp', None, None)"
        assert str(res.out["convolution_backward_1"][0]) == "P('tp', None, None, None)"
