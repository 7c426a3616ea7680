"""Tofu's search: exact per level, at least as good as Megatron, and it lowers and runs.

* exactness: the DP (variable elimination) equals brute force -- every combination of every node's
  legal layouts -- on random problems and on a 2-layer MLP's graph, under the same cost model; its
  predicted cost equals ``plan_cost`` recomputed from the shardings it returns;
* quality: on the test GPT's joint step (AdamW) at G = 2 and G = 4 its cost is at most that of
  Megatron's layouts (propagated and costed by the same ``plan_cost``), and the test says which;
* the result lowers (``lower_shardings``), the collectives inserted are those it planned, and on 2
  gloo ranks the lowered step equals the unsharded step in float64 to 1e-10;
* repeated blocks searched once (``blocks="reuse"``, Tofu §5): block elimination equals brute force on
  chains of identical blocks, with and without reuse; on the GPT (2 and 4 layers, G = 2 and 4) it finds
  the same optimum as the flat DP -- the same per-level optima, the same shardings -- while eliminating
  one block per distinct local problem (2 of 2, 3 of 4); blocks follow data flow, not stale labels.
"""
from __future__ import annotations

import itertools
import operator
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar import meta as M
from fxpar.capture import capture_training_step, trace_forward
from fxpar.collectives import C10D, collective_nodes
from fxpar.mesh import Mesh
from fxpar.optim import resolve_optimizer
from fxpar.sharding import ShardingError, collective_bytes
from fxpar.testing import GPT, gpt_loss
from passes.lower_sharding import global_value, local_value, lower_shardings
from passes.propagate_sharding import propagate_shardings
from passes.sharding.search import Problem
from passes.tofu import TofuCost, _Graph, _Level, plan_cost, tofu_search
from passes.tofu_blocks import assign_blocks, block_of

ADAMW = (torch.optim.AdamW, {"lr": 1e-2})
GPT_MEGATRON = {"blocks.*.qkv.weight": ("tp", None), "blocks.*.proj.weight": (None, "tp"),
                "blocks.*.fc.weight": ("tp", None), "blocks.*.fc2.weight": (None, "tp")}


def _brute(p: Problem):
    """Every combination of labels at once (numpy broadcasting): the minimum and one argmin."""
    total = np.zeros(p.sizes)
    k = len(p.sizes)
    for v, u in enumerate(p.unaries):
        shape = [1] * k
        shape[v] = len(u)
        total = total + u.reshape(shape)
    for (u, v), t in p.pairs.items():
        shape = [1] * k
        shape[u], shape[v] = t.shape
        total = total + t.reshape(shape)
    best = np.unravel_index(int(np.argmin(total)), total.shape)
    return float(total[best]), [int(i) for i in best]


@pytest.mark.structure
@pytest.mark.parametrize("seed", range(6))
def test_elimination_equals_brute_force_on_random_graphs(seed):
    rng = np.random.default_rng(seed)
    p = Problem()
    vs = [p.var(int(rng.integers(1, 4))) for _ in range(9)]
    for v in vs:
        p.unary(v, rng.random(p.sizes[v]))
    for u, v in itertools.combinations(vs, 2):           # a dense-ish graph with cycles
        if rng.random() < 0.4:
            p.pair(u, v, rng.random((p.sizes[u], p.sizes[v])))
    cost, labels = p.solve()
    want, _ = _brute(p)
    assert abs(cost - want) <= 1e-12 and abs(p.cost(labels) - want) <= 1e-12


class MLP2(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.structure
@pytest.mark.parametrize("cost", [TofuCost(), TofuCost(flops_per_s=1e9, mem_s_per_byte=0.0)])
def test_mlp_level_equals_brute_force_over_every_layout(cost):
    torch.manual_seed(0)
    tr = trace_forward(MLP2().double(), (torch.randn(4, 8), torch.randn(4, 8)), F.mse_loss)
    g = _Graph(tr.gm, None)
    lvl = _Level(g, "tp", [], cost, {})
    lvl.build()
    n_combos = int(np.prod(lvl.p.sizes))
    assert n_combos > 100_000                                  # every legal layout of every node, enumerated
    want, _ = _brute(lvl.p)
    got, labels = lvl.p.solve()
    assert abs(got - want) <= 1e-9 * want and abs(lvl.p.cost(labels) - want) <= 1e-9 * want
    res = tofu_search(tr.gm, 2, cost)
    assert abs(res.predicted - want) <= 1e-9 * want           # plan_cost from the returned shardings agrees
    assert abs(sum(plan_cost(tr.gm, res.sharding, cost).values()) - want) <= 1e-9 * want


def _gpt_step():
    torch.manual_seed(0)
    model = GPT().double()
    batch = (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    return model, batch, capture_training_step(model, batch, gpt_loss, resolve_optimizer(ADAMW))


@pytest.fixture(scope="module")
def gpt():
    return _gpt_step()


@pytest.mark.structure
@pytest.mark.parametrize("g", [2, 4])
def test_gpt_search_is_megatron_or_cheaper(gpt, g):
    _, _, cap = gpt
    cost = TofuCost()
    res = tofu_search(cap.gm, g, cost, signature=cap.signature)
    meg = propagate_shardings(cap.gm, {"tp": g}, layouts=GPT_MEGATRON, signature=cap.signature)
    meg_cost = sum(plan_cost(cap.gm, meg, cost, cap.signature).values())
    assert res.predicted <= meg_cost * (1 + 1e-12)
    # which: at G=2 and G=4 the search is strictly cheaper than Megatron by this model -- it keeps qkv and fc
    # column-parallel and fc2 row-parallel, as Megatron does, but also splits the embeddings over the hidden dim
    # (Megatron's layouts replicate them; memory is priced) and gathers proj instead of reducing its output
    assert res.predicted < meg_cost, (res.predicted, meg_cost)
    assert abs(sum(plan_cost(cap.gm, res.sharding, cost, cap.signature).values()) - res.predicted) <= 1e-9 * meg_cost
    assert res.levels == (["tp"] if g == 2 else ["tp0", "tp1"])
    assert any(not s[0].is_replicated for k, s in res.sharding.out.items() if k.startswith("blocks_"))
    plan = res.to_plan()
    assert plan["mesh"] == {a: 2 for a in res.levels} and len(plan["shardings"]) == len(res.sharding.out)


@pytest.mark.structure
def test_bad_device_count_names_the_fix(gpt):
    with pytest.raises(ShardingError, match="power of two"):
        tofu_search(gpt[2].gm, 6)


def _full_inputs(model, batch, cap):
    params = dict(model.named_parameters())
    by_role = {"param": lambda k: params[k].detach().clone(),
               "opt_state": lambda k: torch.zeros_like(params[k.split(":", 1)[1]]),
               "lr": lambda k: torch.tensor(1e-2, dtype=torch.float64),
               "step": lambda k: torch.tensor(1.0, dtype=torch.float64),
               "input": lambda k: batch[0], "target": lambda k: batch[1]}
    return [by_role[r](k) for r, k in cap.signature.inputs]


def _run_rank(packed, inputs, axis_ranks):
    from fxpar.runtime.executor import bind_groups, group
    from fxpar.portable import unpack_graph_module
    gm = unpack_graph_module(packed)
    bind_groups(gm, {a: group(tuple(rs), a).group_name for a, rs in axis_ranks.items()})
    return [o.detach() for o in gm(*inputs)]


@pytest.mark.slow
@pytest.mark.numerics
def test_gpt_search_lowers_and_equals_unsharded_step_on_2_ranks(clusters, gpt):
    from fxpar.portable import pack_graph_module
    model, batch, cap = gpt
    res = tofu_search(cap.gm, 2, signature=cap.signature).sharding
    mesh = Mesh((("tp", 2),))
    full = _full_inputs(model, batch, cap)
    ref = cap.gm(*full)
    placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    planned = [r for r in res.redistributions if r[5] not in ("zero", "slice")]
    assert planned                                            # the search's plan communicates
    args = []
    for rank in range(2):
        low = lower_shardings(cap.gm, res, mesh, rank)
        made = [M.get(c, M.COMM) for c in collective_nodes(low)]
        assert sorted(c.kind for c in made) == sorted(r[5] for r in planned)
        assert sorted(collective_bytes(c.kind, c.nbytes, 2) for c in made) == sorted(r[-1] for r in planned)
        for c in collective_nodes(low):      # one collective in flight at a time (gloo hazard, passes/zero.py)
            assert c.next.target is C10D.wait_tensor.default and c.next.args[0] is c, c.name
        local = [local_value(t, res.sharding(p), mesh, rank) for t, p in zip(full, placeholders)]
        args.append((pack_graph_module(low), local, {"tp": (0, 1)}))
    outs = clusters.get(2).run(_run_rank, args)
    out_sh = res.need["output"]
    assert len(ref) == len(out_sh) > 3
    for i, want in enumerate(ref):
        got = global_value([outs[r][i] for r in range(2)], out_sh[i], mesh)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-10, cap.signature.outputs[i]
    split = [p for p in placeholders if M.get(p, M.ROLE) == "param" and not res.sharding(p).is_replicated]
    assert split                                              # some parameters really are split
    for p in split:
        i = placeholders.index(p)
        assert args[0][1][i].numel() * 2 == full[i].numel()


# --- repeated blocks searched once (Tofu §5) -------------------------------------------------------------------
def _chain(seed, n_blocks=4, ties=False, odd=None):
    """``n_blocks`` copies of one 4-variable block (a triangle and a tail), each linked to the next; a free 3-label
    head before the first; a one-label variable touching every block (folded into unaries); block ``odd`` gets
    its own costs. Integer costs (``ties``) make many optima."""
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return rng.integers(0, 3, shape).astype(float) if ties else rng.random(shape)
    sizes = [2, 3, 2, 2]
    unaries = [draw(k) for k in sizes]
    inner = {(0, 1): draw(2, 3), (1, 2): draw(3, 2), (0, 2): draw(2, 2), (2, 3): draw(2, 2)}
    link, tie, p = draw(2, 2), draw(1, 3), Problem()
    head = p.var(3)
    p.unary(head, draw(3))
    one, blocks, prev = p.var(1), [], None
    for b in range(n_blocks):
        vs = [p.var(k) for k in sizes]
        for v, u in zip(vs, unaries):
            p.unary(v, draw(len(u)) if b == odd else u)
        for (i, j), t in inner.items():
            p.pair(vs[i], vs[j], t)
        p.pair(head, vs[0], draw(3, 2)) if prev is None else p.pair(prev, vs[0], link)
        p.pair(one, vs[1], tie)
        prev = vs[3]
        blocks.append(vs)
    return p, blocks


@pytest.mark.structure
@pytest.mark.parametrize("seed,ties", [(s, t) for s in range(3) for t in (False, True)])
def test_block_elimination_equals_brute_force_with_and_without_reuse(seed, ties):
    for odd, distinct in ((None, 3), (1, 4)):
        p, blocks = _chain(seed, ties=ties, odd=odd)
        want, _ = _brute(p)                                  # 3 * 24^4 * 1 combinations
        got = {}
        for reuse in (True, False):
            cost, labels = p.solve(blocks, reuse)
            assert abs(cost - want) <= 1e-12 and abs(p.cost(labels) - want) <= 1e-12
            got[reuse] = (labels, dict(p.stats))
        assert got[True][0] == got[False][0]                 # reuse maps the very same solution onto each copy
        # distinct local problems: the first block (linked to the free head), the middle two (blocks on both
        # sides), the last (nothing after it); a middle block with its own costs is one more
        assert got[True][1] == {"blocks": 4, "solved": distinct, "wide": 0}
        assert got[False][1] == {"blocks": 4, "solved": 4, "wide": 0}


@pytest.mark.structure
def test_block_too_wide_is_left_to_the_flat_pass(monkeypatch):
    import passes.sharding.search as search
    p, blocks = _chain(0)
    want, _ = _brute(p)
    # kept label combinations: the first block 3 x 2 (the free head, its link onwards), the middle ones 2 x 2,
    # the last 2: over 4, the first is left to the flat pass
    monkeypatch.setattr(search, "WIDEST", 4)
    cost, labels = p.solve(blocks)
    assert abs(cost - want) <= 1e-12 and abs(p.cost(labels) - want) <= 1e-12
    assert p.stats == {"blocks": 3, "solved": 2, "wide": 1}


@pytest.fixture(scope="module")
def gpt4():
    torch.manual_seed(0)
    model = GPT(layers=4).double()
    batch = (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    return model, batch, capture_training_step(model, batch, gpt_loss, resolve_optimizer(ADAMW))


@pytest.mark.slow
@pytest.mark.structure
@pytest.mark.parametrize("layers,distinct", [(2, 2), (4, 3)])
@pytest.mark.parametrize("g", [2, 4])
@pytest.mark.parametrize("whole_io", [False, True])
def test_block_reuse_finds_the_flat_optimum_on_gpt(request, layers, distinct, g, whole_io):
    cap = request.getfixturevalue("gpt" if layers == 2 else "gpt4")[2]
    found = {m: tofu_search(cap.gm, g, signature=cap.signature, whole_io=whole_io, blocks=m)
             for m in ("flat", "each", "reuse")}
    flat = found["flat"]
    for mode in ("each", "reuse"):
        r = found[mode]
        assert len(r.optima) == len(flat.optima) == len(r.levels)
        for a, b in zip(r.optima, flat.optima):               # every level's DP reaches the flat optimum
            assert abs(a - b) <= 1e-12 * abs(b)
        assert r.sharding.out == flat.sharding.out and r.sharding.need == flat.sharding.need   # and the same plan
        assert r.predicted == flat.predicted
    # reuse happens: every layer is a block, one elimination per distinct local problem per level -- the first
    # block (after the embeddings), the last (before the head), and at 4 layers the two middle ones, equal
    assert [b["blocks"] for b in found["reuse"].blocks] == [layers] * len(flat.levels)
    assert [b["solved"] for b in found["reuse"].blocks] == [distinct] * len(flat.levels)
    assert [b["solved"] for b in found["each"].blocks] == [layers] * len(flat.levels)
    assert flat.blocks == [{}] * len(flat.levels)
    assert f"{distinct} of {layers} blocks eliminated" in found["reuse"].explain()


def _params_read(g, n, gi):
    """The parameter keys an optimizer node (a ``_foreach`` op's group ``gi``) reads: directly, or through earlier
    optimizer nodes and ``_foreach`` groups."""
    keys = set()
    ins = g.groups[n][gi].ins if "_foreach" in str(n.target) else range(len(g.leaves[n]))
    for x in (g.leaves[n][j] for j in ins):
        if x.op == "placeholder" and M.get(x, M.ROLE) in ("param", "opt_state"):
            keys.add(M.get(x, M.PARAM).split(":", 1)[-1])
        elif x.target is operator.getitem and "_foreach" in str(x.args[0].target):
            keys |= _params_read(g, x.args[0], g.where(x.args[0])[x.args[1]][0])
        elif x.op == "call_function" and M.get(x, M.PHASE) == "optimizer":
            keys |= _params_read(g, x, 0)
    return keys


@pytest.mark.structure
def test_blocks_follow_data_flow_not_stale_labels(gpt4):
    cap = gpt4[2]
    g = _Graph(cap.gm, cap.signature)
    lvl = _Level(g, "tp", [], TofuCost(), {})
    lvl.build()
    owner = assign_blocks(lvl.vars, lvl.p.sizes, lvl.p.pairs)
    per = Counter(owner.values())
    assert sorted(per) == [("blocks", i) for i in range(4)] and len(set(per.values())) == 1
    stale = 0
    for (n, gi), b in owner.items():
        phase = M.get(n, M.PHASE)
        if n.op == "placeholder":                         # parameters and optimizer state by their key
            assert block_of(M.get(n, M.PARAM).split(":", 1)[-1]) == b, n.name
        elif phase == "optimizer":                        # _foreach groups (module '') by their parameter
            keys = _params_read(g, n, gi)
            assert keys and {block_of(k) for k in keys} == {b}, (n.name, gi, keys)
        elif phase == "forward":
            assert block_of(M.get(n, M.MODULE)) == b, n.name
        else:                                             # backward: by the forward values and weights it reads
            assert phase == "backward"
            read = [block_of(M.get(x, M.MODULE) or "") for x in n.all_input_nodes if M.get(x, M.PHASE) == "forward"]
            assert all(r in (b, None) for r in read), (n.name, read, b)
            stale += block_of(M.get(n, M.MODULE) or "") != b
    assert stale > 0           # some backward nodes' fxpar_module names another block; data flow overrides it


@pytest.mark.structure
def test_bad_blocks_mode_names_the_choices(gpt):
    with pytest.raises(ValueError, match="reuse"):
        tofu_search(gpt[2].gm, 2, blocks="once")
