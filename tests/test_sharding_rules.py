"""The sharding-rule table on the joint steps of every test model.

* coverage: every op of the captured training step (forward, backward, traced optimizer) of the tied
  GPT, the MLP, the CNN and Hugging Face GPT-2, Llama, BERT and T5 has a rule, or is in the documented
  replicate list (``passes.sharding.REPLICATE``); propagation with no annotation lists no op.
* exactness: for every node of the GPT, MLP and CNN steps (float64, real values) and every candidate
  its rule offers on 2 ranks, running the op on each rank's local pieces and reassembling the outputs
  (concatenate splits, sum partial sums, replicated outputs equal on both ranks) gives the op's whole
  output to 1e-10 -- the rule never claims a layout the op does not produce.
  A candidate registered in ``passes.sharding.core.LOCAL_OPS`` (Megatron's vocabulary-parallel embedding
  and its backward) runs as its local computation, each rank's coordinate along the axis being its index.
* closed forms: redistribution bytes per rank are the ring figures.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from fxpar.capture import capture_training_step
from fxpar.optim import resolve_optimizer
from fxpar.sharding import P, R, collective_bytes, redistribute_bytes
from fxpar.testing import CNN, GPT, MLP, gpt_loss
from passes.lower_sharding import SIZE_ARGS
from passes.propagate_sharding import propagate_shardings
from passes.sharding import REPLICATE, OpInfo, groups_of, has_rule, tensor_leaves
from passes.sharding.core import LOCAL_OPS

pytestmark = pytest.mark.structure

ADAMW = resolve_optimizer((torch.optim.AdamW, {"lr": 1e-2}))


def _native(name):
    torch.manual_seed(0)
    if name == "gpt":
        x = torch.randint(0, 64, (2, 8))
        return GPT().double(), (x, x), gpt_loss
    if name == "mlp":
        return MLP().double(), (torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)), F.mse_loss
    if name == "moe":     # GShard's gating (argmax, cumsum, one-hots by eq) with tokens dropped, dispatch/combine bmm
        return _MoENet().double(), (torch.randn(2, 8, 8, dtype=torch.float64),) * 2, _moe_loss
    return CNN().double(), (torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.randint(0, 10, (2,))), F.cross_entropy


class _MoENet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from fxpar.nn import MoE
        self.moe = MoE(8, 16, 4, 4, capacity_factor=0.5, axis=None)     # its aten ops, no annotations

    def forward(self, x):
        y, aux = self.moe(x)
        return x + y, aux


def _moe_loss(out, target):
    return F.mse_loss(out[0], target) + 0.01 * out[1]


def _ops(cap):
    return [n for n in cap.gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "mlp", "cnn", "moe", "gpt2", "llama", "bert", "t5"])
def test_every_op_of_every_test_model_has_a_rule(name):
    if name in ("gpt", "mlp", "cnn", "moe"):
        model, batch, loss = _native(name)
    else:
        tf = pytest.importorskip("transformers")
        tf.logging.set_verbosity_error()
        from fxpar.testing.hf import hf_example
        model, batch, loss = hf_example(name)
    cap = capture_training_step(model, batch, loss, ADAMW)
    missing = sorted({str(n.target) for n in _ops(cap) if not has_rule(n.target)})
    assert missing == []
    assert any(str(n.target).startswith("aten._foreach") for n in _ops(cap))
    for n in _ops(cap):                              # every rule runs on its node and offers all-replicated first
        for g in groups_of(OpInfo.of(n)):
            assert g.cands[0] == ((R,) * len(g.ins), (R,) * len(g.outs))
    assert propagate_shardings(cap.gm, {"tp": 2}).no_rule == []
    assert all(REPLICATE[op] for op in REPLICATE)   # each replicate-only op says why


def _values(cap, model, batch):
    params = dict(model.named_parameters())
    by_role = {"param": lambda k: params[k].detach(), "buffer": lambda k: dict(model.named_buffers())[k],
               "opt_state": lambda k: torch.rand_like(params[k.split(":", 1)[1]]),
               "lr": lambda k: torch.tensor(1e-2, dtype=torch.float64), "step": lambda k: torch.tensor(1.0, dtype=torch.float64),
               "input": lambda k: batch[int(k)], "target": lambda k: batch[1 + int(k)]}
    env = {}

    class Rec(torch.fx.Interpreter):
        def run_node(self, n):
            env[n] = super().run_node(n)
            return env[n]
    Rec(cap.gm).run(*[by_role[r](k) for r, k in cap.signature.inputs])
    return env


def _pieces(t, pl, n, g):
    """Every rank's piece of ``t`` under ``pl``: a partial sum is split into random summands."""
    if pl == R:
        return [t] * n
    if pl == P:
        noise = [torch.randn(t.shape, dtype=t.dtype, generator=g) for _ in range(n - 1)]
        return [t - sum(noise)] + noise
    return [c.contiguous() for c in t.chunk(n, dim=pl)]     # a rank holds its piece as its own tensor


def _sub(args, repl):
    """``args`` (a tuple, or a dict of keyword args) with the tensors at the paths of ``repl`` replaced."""
    items = args.items() if isinstance(args, dict) else enumerate(args)
    out = {k: repl.get((k,), a) if not isinstance(a, (list, tuple)) else
           type(a)(repl.get((k, j), x) for j, x in enumerate(a)) for k, a in items}
    return out if isinstance(args, dict) else tuple(out.values())


def _local_args(node, env):
    args = torch.fx.node.map_arg(node.args, lambda a: env[a])
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: env[a])
    return args, kwargs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "mlp", "cnn", "moe"])
def test_every_candidate_is_exact_on_two_ranks(name):
    model, batch, loss = _native(name)
    cap = capture_training_step(model, batch, loss, ADAMW)
    env = _values(cap, model, batch)
    n, g, checked = 2, torch.Generator().manual_seed(0), 0
    for node in _ops(cap):
        info = OpInfo.of(node)
        args, kwargs = _local_args(node, env)
        leaves = tensor_leaves(node)
        full_out = [v for v in tree_flatten(env[node])[0] if isinstance(v, torch.Tensor)]
        for grp in groups_of(info):
            for ins, outs in grp.cands:
                pls = {grp.ins[j]: pl for j, pl in enumerate(ins)}
                if not _divides(info, grp, ins, outs, n):
                    continue
                per_rank = []
                pieces = {j: _pieces(env[leaves[j][1]], pls.get(j, R), n, g) for j in range(len(leaves))}
                for r in range(n):
                    repl = {leaves[j][0]: pieces[j][r] for j in range(len(leaves))}
                    a = list(_sub(args, repl))
                    if node.target in SIZE_ARGS and a[SIZE_ARGS[node.target][0]] is not None:
                        pos, which = SIZE_ARGS[node.target]
                        oi = info.out_pos.index(0 if which == "int0" else which)
                        sh = list(info.out_shapes[oi])
                        pl = outs[grp.outs.index(oi)] if oi in grp.outs else R
                        if isinstance(pl, int):
                            sh[pl] //= n
                        a[pos] = sh[0] if which == "int0" else sh
                    res = _run_on_rank(node, (ins, outs), a, _sub(kwargs, repl), r)
                    per_rank.append([v for v in tree_flatten(res)[0] if isinstance(v, torch.Tensor)])
                for o, pl in zip(grp.outs, outs):
                    got = [per_rank[r][o] for r in range(n)]
                    whole = torch.cat(got, dim=pl) if isinstance(pl, int) else sum(got) if pl == P else got[0]
                    if pl == R:
                        assert torch.equal(got[0], got[1]) or (got[0] - got[1]).abs().max() <= 1e-10, node.format_node()
                    diff = (whole.double() - full_out[o].double()).abs().max().item() if whole.numel() else 0.0
                    assert whole.shape == full_out[o].shape and diff <= 1e-10, (node.format_node(), ins, outs, diff)
                    checked += 1
    assert checked > 200
    assert name != "gpt" or {"embedding", "embedding_dense_backward"} <= {op for op, _ in _LOCAL_RUNS}   # vocab split


def _divides(info, grp, ins, outs, n):
    for j, pl in zip(grp.ins, ins):
        if isinstance(pl, int) and info.in_shapes[j][pl] % n:
            return False
    for o, pl in zip(grp.outs, outs):
        if isinstance(pl, int) and info.out_shapes[o][pl] % n:
            return False
    leaves = tensor_leaves(info.node)
    return all(not (pl == P and not leaves[j][1].meta["val"].dtype.is_floating_point) for j, pl in zip(grp.ins, ins))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_redistribution_bytes_are_ring_closed_forms(n):
    L = 4096.0
    assert redistribute_bytes(P, R, L, n) == 2 * (n - 1) / n * L                 # all_reduce
    assert redistribute_bytes(P, 0, L, n) == (n - 1) / n * L                     # reduce_scatter
    assert redistribute_bytes(1, R, L, n) == (n - 1) * L                         # all_gather of a local L
    assert redistribute_bytes(0, 1, L, n) == (n - 1) / n * L                     # all_to_all
    assert redistribute_bytes(R, 0, L, n) == 0 and redistribute_bytes(R, P, L, n) == 0
    assert redistribute_bytes(0, P, L, n) == collective_bytes("all_gather", L, n)
    assert redistribute_bytes(0, 0, L, n) == 0


# --- candidates exact only as another local computation (the vocabulary-parallel embedding) ---

_LOCAL_RUNS = []


def _run_on_rank(node, cand, args, kwargs, rank):
    """The op on one rank's pieces; for a candidate in ``LOCAL_OPS``, the local computation registered for it, with
    the rank's coordinate along the axis (read from the group at run time) being ``rank``."""
    fn = LOCAL_OPS.get((node.target, cand))
    if fn is None:
        return node.target(*args, **kwargs)
    from unittest import mock
    _LOCAL_RUNS.append((node.target.__name__.split(".")[0], cand))
    target, args, kwargs = fn(tuple(args), kwargs, "fxpar-test-axis")
    with mock.patch("fxpar.local_ops.axis_index", lambda group: rank):
        return target(*args, **kwargs)
