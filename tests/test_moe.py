"""GShard's mixture of experts : ``fxpar.nn.MoE``, experts sharded over a mesh axis.

* single device, float64, to 1e-10 -- output, l_aux and every gradient:
  - without dropping, the layer equals a per-token loop (each token to its top-2 experts, gate-weighted);
  - with dropping, it equals a loop of GShard's per-group capacity rule (Lepikhin et al., ICLR'21,
    Algorithm 1: places filled in token order, every first choice before any second choice; l_aux from
    line 13), and tokens really are dropped.
* structure: with the expert dim split over "tp" (2 and 4 ranks), the lowered step has exactly 4 all_to_alls,
  in order forward dispatch, forward combine, backward (combine's gradient), backward (dispatch's gradient),
  each handing E·G·C·M/n elements to the collective (GShard §3); every inserted collective is one propagation
  planned, with the planned bytes.
* numerics: the lowered per-rank graphs of the whole joint step (forward, backward, AdamW) on 2 and 4 gloo
  ranks equal the unsharded step on every output (loss, new parameters, optimizer state) to 1e-10, with and
  without dropping; the expert weights are really split (1/n per rank).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
import fxpar.nn
from fxpar import meta as M
from fxpar.capture import capture_training_step
from fxpar.collectives import collective_nodes
from fxpar.mesh import Mesh
from fxpar.moe import expert_capacity, top2_gating
from fxpar.optim import resolve_optimizer
from fxpar.sharding import ShardingError, collective_bytes
from passes.lower_sharding import global_value, local_value, lower_shardings
from passes.propagate_sharding import propagate_shardings

D, H, E, S = 8, 16, 4, 4          # model dim, expert hidden dim, experts, tokens per group
B, T = 2, 8                       # batch: B·T = 16 tokens = 4 groups of S


class MoENet(nn.Module):
    """Linear -> tanh -> MoE (residual) -> Linear; returns (output, l_aux) for the loss to add."""

    def __init__(self, capacity_factor=None, experts=E):
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, D)
        self.moe = fxpar.nn.MoE(D, H, experts, S, capacity_factor=capacity_factor)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        y, aux = self.moe(h)
        return self.out(h + y), aux


def moe_loss(out, target):
    """GShard's l = l_task + k·l_aux (k = 0.01), from the model's outputs alone."""
    y, aux = out
    return F.mse_loss(y, target) + 0.01 * aux


# --- single-device references -------------------------------------------------------------------------

def _expert(moe, e, x):
    return moe.activation(x @ moe.wi[e]) @ moe.wo[e]


def _top2(gates_s):
    g, e = torch.topk(gates_s, 2)
    return (e[0].item(), g[0] / (g[0] + g[1])), (e[1].item(), g[1] / (g[0] + g[1]))


def per_token_reference(moe, x):
    """No capacity: every token goes to its two best experts, weighted by their renormalised gates."""
    xs = x.reshape(-1, moe.dim)
    gates = torch.softmax(xs @ moe.wg, -1)
    y = [sum(w * _expert(moe, e, xs[t]) for e, w in _top2(gates[t])) for t in range(xs.shape[0])]
    return torch.stack(y).view(x.shape)


def gshard_reference(moe, x):
    """Algorithm 1 of GShard per group, as written: counters c_e, first choices in token order then second
    choices, a token dropped at an expert whose count reached C; l_aux = 1/E Σ_e (c_e/S) m_e, averaged over
    groups. Returns (y, l_aux, number of dropped (token, expert) assignments)."""
    xs = x.reshape(-1, moe.group_size, moe.dim)
    n_e, C = moe.experts, moe.capacity
    ys, auxes, dropped = [], [], 0
    for grp in xs:
        gates = torch.softmax(grp @ moe.wg, -1)
        choices = [_top2(gates[s]) for s in range(len(grp))]
        out = [torch.zeros(moe.dim, dtype=x.dtype) for _ in grp]
        count = [0] * n_e
        for k in (0, 1):                                    # k=0: first choices (lines 4-12), k=1: second (14-23)
            for s, ch in enumerate(choices):
                e, w = ch[k]
                if count[e] < C:
                    out[s] = out[s] + w * _expert(moe, e, grp[s])
                else:
                    dropped += 1
                count[e] += 1
            if k == 0:                                      # line 13, on the first choices' counts
                m = gates.mean(0)
                auxes.append(sum(count[e] / len(grp) * m[e] for e in range(n_e)) / n_e)
        ys.append(torch.stack(out))
    return torch.stack(ys).view(x.shape), torch.stack(auxes).mean(), dropped


def _grads(moe, x, fn):
    x = x.detach().clone().requires_grad_(True)
    y, aux = fn(moe, x)
    r = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(1))
    ((y * r).sum() + 3.0 * aux).backward()
    grads = [x.grad] + [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    return y.detach(), aux.detach(), grads


def _layer(capacity_factor):
    torch.manual_seed(0)
    return fxpar.nn.MoE(D, H, E, S, capacity_factor=capacity_factor).double(), \
        torch.randn(B, T, D, dtype=torch.float64)


@pytest.mark.structure
def test_capacity_is_gshards_rule():
    assert expert_capacity(8, 4, 1.0) == 4                    # 2S/E
    assert expert_capacity(8, 4, 0.5) == 2 and expert_capacity(8, 4, 0.3) == 2     # rounded up
    assert expert_capacity(8, 4, None) == 8 and expert_capacity(8, 4, 10.0) == 8    # never above S


@pytest.mark.structure
def test_no_dropping_equals_per_token_loop():
    moe, x = _layer(None)
    y, aux, grads = _grads(moe, x, lambda m, v: m(v))

    def ref(m, v):
        _, aux_ref, dropped = gshard_reference(m, v)
        assert dropped == 0
        return per_token_reference(m, v), aux_ref
    y_ref, aux_ref, grads_ref = _grads(moe, x, ref)
    assert (y - y_ref).abs().max() <= 1e-10 and (aux - aux_ref).abs() <= 1e-10
    assert all((g - gr).abs().max() <= 1e-10 for g, gr in zip(grads, grads_ref))
    assert all(g.abs().sum() > 0 for g in grads)             # x, wg (through gates and l_aux), wi, wo


@pytest.mark.structure
def test_dropping_equals_gshard_capacity_loop():
    moe, x = _layer(0.5)                                     # C = 1 place per expert per group of 4
    assert moe.capacity == 1
    y, aux, grads = _grads(moe, x, lambda m, v: m(v))
    _, _, dropped = gshard_reference(moe, x)
    assert dropped >= 16                                     # 32 assignments, 16 places: at least half dropped
    y_ref, aux_ref, grads_ref = _grads(moe, x, lambda m, v: gshard_reference(m, v)[:2])
    assert (y - y_ref).abs().max() <= 1e-10 and (aux - aux_ref).abs() <= 1e-10
    assert all((g - gr).abs().max() <= 1e-10 for g, gr in zip(grads, grads_ref))
    y_free, _, _ = _grads(moe, x, lambda m, v: (per_token_reference(m, v), aux))
    assert (y - y_free).abs().max() > 1e-3                   # dropping changed the output


@pytest.mark.structure
def test_first_choices_fill_before_second_choices():
    """Two tokens, two experts, one place each: both first choices get their places and both second choices
    are dropped (token-by-token filling would give token 0's second choice the place of token 1's first)."""
    gates = torch.tensor([[[0.7, 0.3], [0.4, 0.6]]], dtype=torch.float64)
    combine, dispatch, aux = top2_gating(gates, capacity=1)
    want = torch.zeros(1, 2, 2, 1, dtype=torch.float64)
    want[0, 0, 0, 0] = want[0, 1, 1, 0] = 1
    assert torch.equal(dispatch, want)
    assert torch.allclose(combine[0, :, :, 0], torch.tensor([[0.7, 0.0], [0.0, 0.6]], dtype=torch.float64))
    assert abs(aux.item() - (0.5 * 0.55 + 0.5 * 0.45) / 2) <= 1e-15     # 1/E Σ_e (c_e/S) m_e


@pytest.mark.structure
def test_bad_group_size_names_the_layer_and_fix():
    moe = fxpar.nn.MoE(D, H, E, 5)
    with pytest.raises(ValueError, match=r"group_size=5.*16 tokens.*dividing 16"):
        moe(torch.randn(2, 8, D))


# --- sharded over the expert axis -------------------------------------------------------------------

ADAMW = (torch.optim.AdamW, {"lr": 1e-2})


def _capture(capacity_factor, experts=E):
    torch.manual_seed(0)
    model = MoENet(capacity_factor, experts).double()
    batch = (torch.randn(B, T, D, dtype=torch.float64), torch.randn(B, T, D, dtype=torch.float64))
    return model, batch, capture_training_step(model, batch, moe_loss, resolve_optimizer(ADAMW))


def _all_to_alls(low):
    return [(M.get(c, M.PHASE), M.get(c, M.COMM)) for c in collective_nodes(low)
            if M.get(c, M.COMM).kind == "all_to_all"]


@pytest.mark.structure
@pytest.mark.parametrize("n,cf", [(2, None), (4, None), (4, 0.5)])
def test_four_all_to_alls_of_the_closed_form(n, cf):
    model, _, cap = _capture(cf)
    mesh = Mesh((("tp", n),))
    res = propagate_shardings(cap.gm, mesh, signature=cap.signature)
    assert res.no_rule == []
    G, C = B * T // S, model.moe.capacity
    for rank in (0, n - 1):
        low = lower_shardings(cap.gm, res, mesh, rank)
        a2a = _all_to_alls(low)
        assert [ph for ph, _ in a2a] == ["forward", "forward", "backward", "backward"]
        assert all(c.nbytes == E * G * C * D * 8 // n and c.ranks == tuple(range(n)) for _, c in a2a)
        planned = [r for r in res.redistributions if r[5] not in ("zero", "slice")]
        made = [M.get(c, M.COMM) for c in collective_nodes(low)]
        assert sorted(c.kind for c in made) == sorted(r[5] for r in planned)
        assert sorted(collective_bytes(c.kind, c.nbytes, n) for c in made) == sorted(r[-1] for r in planned)
    # the expert weights and their AdamW state split on E; the gate weight replicated (GShard's replicate(wg))
    for p in ("moe_wi", "moe_wo", "exp_avg_moe_wi", "exp_avg_sq_moe_wo"):
        assert str(res.sharding(p)) == "P('tp', None, None)", p
    assert res.sharding("moe_wg").is_replicated
    # dispatch: G split -> E split; combine: E split -> G split (the annotated values, in graph order)
    moves = [r for r in res.redistributions if r[5] == "all_to_all"]
    assert [(r[2], r[3]) for r in moves] == [(1, 0)] * 4
    assert [r[-1] for r in moves] == [(n - 1) / n * E * G * C * D * 8 / n] * 4    # bytes each rank sends (ring)


@pytest.mark.structure
def test_experts_not_divisible_by_the_axis_names_the_annotation():
    _, _, cap = _capture(None, experts=3)
    with pytest.raises(ShardingError, match=r"fxpar\.shard.*in moe.*tp"):
        propagate_shardings(cap.gm, Mesh((("tp", 2),)), signature=cap.signature)


def _run_rank(packed, inputs, axis_ranks):
    from fxpar.runtime.executor import bind_groups, group
    from fxpar.portable import unpack_graph_module
    gm = unpack_graph_module(packed)
    bind_groups(gm, {a: group(tuple(rs), a).group_name for a, rs in axis_ranks.items()})
    return [o.detach() for o in gm(*inputs)]


def _full_inputs(model, batch, cap):
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(2)
    by_role = {"param": lambda k: params[k].detach().clone(),
               "opt_state": lambda k: torch.rand(params[k.split(":", 1)[1]].shape, dtype=torch.float64, generator=g),
               "lr": lambda k: torch.tensor(1e-2, dtype=torch.float64),
               "step": lambda k: torch.tensor(3.0, dtype=torch.float64),
               "input": lambda k: batch[0], "target": lambda k: batch[1]}
    return [by_role[r](k) for r, k in cap.signature.inputs]


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("n,cf", [(2, None), (2, 0.5), (4, None), (4, 0.5)])
def test_experts_on_n_ranks_equal_unsharded_step(clusters, n, cf):
    from fxpar.portable import pack_graph_module
    model, batch, cap = _capture(cf)
    mesh = Mesh((("tp", n),))
    res = propagate_shardings(cap.gm, mesh, signature=cap.signature)
    full = _full_inputs(model, batch, cap)
    ref = cap.gm(*full)
    placeholders = [p for p in cap.gm.graph.nodes if p.op == "placeholder"]
    args = []
    for rank in range(n):
        low = lower_shardings(cap.gm, res, mesh, rank)
        local = [local_value(t, res.sharding(p), mesh, rank) for t, p in zip(full, placeholders)]
        args.append((pack_graph_module(low), local, {"tp": tuple(range(n))}))
    outs = clusters.get(n).run(_run_rank, args)
    out_sh = res.need["output"]
    assert len(ref) == len(cap.signature.outputs) > 10
    for i, want in enumerate(ref):
        got = global_value([outs[r][i] for r in range(n)], out_sh[i], mesh)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-10, cap.signature.outputs[i]
    for i, p in enumerate(placeholders):                     # each rank holds 1/n of every expert weight
        if M.get(p, M.PARAM) in ("moe.wi", "moe.wo"):
            assert args[0][1][i].shape[0] * n == full[i].shape[0] == E
    # the step did train the experts: their new values differ from the old
    sig = cap.signature.outputs
    new_wi = ref[sig.index(("new_param", "moe.wi"))]
    assert (new_wi - model.moe.wi).abs().max() > 1e-4


# --- through fxpar.parallelize ------------------------------------------------------------------------

def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randn(4, T, D, dtype=torch.float64, generator=g) for _ in range(2)) for _ in range(n)]


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [dict(dp=2), dict(tp=2, sharding="annotations"),
                                      dict(tp=4, sharding="annotations"), dict(dp=2, tp=2, sharding="annotations"),
                                      dict(tp=2, pp=2, microbatches=2, sharding="annotations")])
def test_parallelize_trains_like_one_process(clusters, strategy):
    """The annotated layer under parallelize, tokens dropped (C = 1), AdamW, 3 steps: losses and final state equal
    single-process training to 1e-10; l_aux reaches the loss through a plain loss_fn. Without a tp axis the
    annotations are the identity (no all_to_all); with one, each rank's program holds the 4 all_to_alls."""
    from fxpar.testing.reference import max_abs_diff, reference_training
    torch.manual_seed(0)
    model, batches = MoENet(0.5).double(), _batches()
    st = fxpar.Strategy(**strategy)
    ref_losses, ref_state = reference_training(model, batches, moe_loss, ADAMW)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(st.size), batches[0], moe_loss, ADAMW, strategy=st)
    res = prog.run_local(batches, cluster=clusters.get(st.size))
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10, (res.losses, ref_losses)
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
    kinds = [M.get(c, M.COMM).kind for gm in prog.graphs(0).values() for c in collective_nodes(gm)]
    assert kinds.count("all_to_all") == (4 if st.tp > 1 else 0), kinds
