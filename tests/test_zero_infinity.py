"""ZeRO-Infinity: parameters and optimizer state in memory-mapped files under ``offload_dir``,
and memory-centric tiling (``fxpar.nn.TiledLinear``)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.nn import TiledLinear, tile_linears
from fxpar.testing import MLP, max_abs_diff, reference_training, regression_batches
from fxpar.testing.resume import assert_resume_is_exact
from fxpar.zero_layout import chunk

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
TOL = 1e-10


@pytest.mark.numerics
@pytest.mark.parametrize("extra", [dict(), dict(microbatches=2)], ids=["fused", "accumulated"])
def test_zero3_state_on_disk_matches_single_process(clusters, tmp_path, extra):
    torch.manual_seed(0)
    model, batches = MLP().double(), regression_batches(3)
    strat = fxpar.Strategy(dp=2, zero=3, offload=("params", "optimizer"), offload_to="disk", offload_dir=tmp_path,
                           **extra)
    prog = fxpar.parallelize(model, 2, batches[0], F.mse_loss, ADAMW, strategy=strat)
    res = prog.run_local(batches, cluster=clusters.get(2))
    ref_losses, ref_state = reference_training(model, batches, F.mse_loss, ADAMW)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    # every rank's chunks of parameters and both Adam moments are on disk: 3Ψb/N bytes (b = 8, float64)
    psi = sum(p.numel() for p in model.parameters())
    for r in range(2):
        assert res.state_bytes[r]["on_disk"] == 3 * psi * 8 // 2
        files = sorted(os.listdir(tmp_path / f"rank{r}"))
        assert len(files) == 3 * len(list(model.parameters()))
        # the files hold the live values: rank r's chunk of each trained parameter
        for k, v in res.state_dict().items():
            c = chunk(v, 2, r)
            on_disk = torch.from_file(str(tmp_path / f"rank{r}" / f"param.{k}.bin"), size=c.numel(), dtype=c.dtype)
            assert torch.equal(on_disk, c), k


@pytest.mark.numerics
def test_offload_without_zero_and_resume(clusters, tmp_path):
    """Whole parameters and optimizer state on disk (zero=0); a checkpoint resumes into the files bitwise."""
    torch.manual_seed(0)
    model, batches = MLP().double(), regression_batches(4)
    strat = fxpar.Strategy(dp=2, offload=("params", "optimizer"), offload_to="disk", offload_dir=tmp_path / "o")
    prog = fxpar.parallelize(model, 2, batches[0], F.mse_loss, ADAMW, strategy=strat)
    assert_resume_is_exact(prog, batches, 2, clusters.get(2), tmp_path / "c")


@pytest.mark.structure
def test_offload_dir_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(fxpar.StrategyError, match="cannot write there"):
        fxpar.Strategy(dp=2, zero=3, offload=("params",), offload_to="disk", offload_dir=blocker / "sub")
    with pytest.raises(fxpar.StrategyError, match="needs offload_dir"):
        fxpar.Strategy(dp=2, offload=("params",), offload_to="disk")
    with pytest.raises(fxpar.StrategyError, match="unknown"):
        fxpar.Strategy(dp=2, offload=("weights",))


# ---- memory-centric tiling ---------------------------------------------------------------------------
@pytest.mark.structure
def test_tiled_linear_equals_linear_output_and_every_gradient():
    torch.manual_seed(0)
    lin = torch.nn.Linear(12, 10).double()
    tiled = TiledLinear.from_linear(lin, tiles=3)
    assert [t.out_features for t in tiled.tiles] == [4, 4, 2]
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = lin(x), tiled(x2)
    assert torch.equal(y, y2)
    gy = torch.randn_like(y)
    y.backward(gy)
    y2.backward(gy)
    assert torch.allclose(x.grad, x2.grad, rtol=0, atol=1e-12)
    assert torch.equal(lin.weight.grad, torch.cat([t.weight.grad for t in tiled.tiles]))
    assert torch.equal(lin.bias.grad, torch.cat([t.bias.grad for t in tiled.tiles]))


@pytest.mark.slow
@pytest.mark.numerics
def test_tiled_model_under_zero3_gathers_one_tile_at_a_time(clusters):
    torch.manual_seed(0)
    model = MLP().double()
    replaced = tile_linears(model, max_params=256)          # 32x16, 32x32 (and 8x32) weights -> tiles of <= 256
    assert replaced == ["layers.0", "layers.1"]
    batches = regression_batches(3)
    prog = fxpar.parallelize(model, 2, batches[0], F.mse_loss, ADAMW, strategy=fxpar.Strategy(dp=2, zero=3))
    res = prog.run_local(batches, cluster=clusters.get(2))
    ref_losses, ref_state = reference_training(model, batches, F.mse_loss, ADAMW)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    gm = prog.graphs(0)["step"]
    gathered = [x.args[0].meta["val"].numel() * 2 for x in gm.graph.nodes
                if x.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    assert max(gathered) <= 256                               # never more than one tile's weights in one gather


# ---- per-layer read-ahead from disk (fxpar::prefetch, inserted by passes/zero_offload.py) ---------------
PREFETCH = torch.ops.fxpar.prefetch.default
_PLUMBING = {torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.t.default,
             torch.ops._c10d_functional.wait_tensor.default}


def _first_compute(node, pos):
    """The first node that computes with ``node``'s value (past the slices, views and transposes of a gather)."""
    seen, stack, best = set(), list(node.users), None
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.target in _PLUMBING:
            stack.extend(u.users)
        elif best is None or pos[u] < pos[best]:
            best = u
    return best


@pytest.mark.numerics
def test_prefetch_reads_the_next_layer_while_this_one_gathers_and_computes(clusters, tmp_path):
    """Stage 3, parameters and optimizer state on disk: in forward and in backward, the read-ahead of the next
    gathered parameter's file comes after this parameter's gather starts and before this layer computes with it;
    each optimizer-state file is read ahead once, after its bucket's reduce-scatter starts and before the update.
    The run equals single-process training, and each rank advised the kernel of exactly the bytes the graph names
    per step (posix_fadvise WILLNEED on the files' ranges)."""
    torch.manual_seed(0)
    model, batches = MLP().double(), regression_batches(3)
    strat = fxpar.Strategy(dp=2, zero=3, offload=("params", "optimizer"), offload_to="disk", offload_dir=tmp_path)
    prog = fxpar.parallelize(model, 2, batches[0], F.mse_loss, ADAMW, strategy=strat)
    sg = prog.stages[0].graphs["FULL"]
    g = sg.gm.graph
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    role = dict(zip(g.find_nodes(op="placeholder"), sg.inputs))
    pre = [n for n in nodes if n.target is PREFETCH]
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    for phase in ("forward", "backward"):
        ags = [n for n in nodes if n.target is gather and n.meta.get("fxpar_phase") == phase]
        assert len(ags) == (len(list(model.parameters())) if phase == "forward" else 2)   # backward: 2 weights
        for ag, nxt in zip(ags, ags[1:]):
            src = nxt.args[0].args[0]                     # the gather reads _to_copy(chunk placeholder)
            (p,) = [q for q in pre if q.args[0] is src and pos[ag] < pos[q] < pos[nxt]]
            assert pos[p] < pos[_first_compute(next(iter(ag.users)), pos)]
    rs = [n for n in nodes if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default]
    states = [ph for ph, (r, _) in role.items() if r == "opt_state"]
    for ph in states:
        (p,) = [q for q in pre if q.args[0] is ph]
        reads = [u for u in ph.users if u.target is not PREFETCH]
        assert max(pos[r] for r in rs) < pos[p] < min(pos[u] for u in reads)
    res = prog.run_local(batches, cluster=clusters.get(2))
    ref_losses, ref_state = reference_training(model, batches, F.mse_loss, ADAMW)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    per_step = sum(q.args[0].meta["val"].numel() * 8 for q in pre)
    assert all(res.state_bytes[r]["prefetched"] == len(batches) * per_step for r in range(2))


@pytest.mark.structure
def test_prefetch_goes_where_its_graph_reads_the_files(tmp_path):
    """Microbatches (UNSHARD, F, B, REDUCE_GRAD, STEP): the parameters' read-ahead runs in UNSHARD, which gathers
    them once per step; the optimizer state's at the top of STEP, the only graph given the state."""
    torch.manual_seed(0)
    strat = fxpar.Strategy(dp=2, zero=3, offload=("params", "optimizer"), offload_to="disk", offload_dir=tmp_path,
                           microbatches=2)
    prog = fxpar.parallelize(MLP().double(), 2, regression_batches(1, batch=16)[0], F.mse_loss, ADAMW, strategy=strat)
    graphs = prog.stages[0].graphs
    count = {k: [n for n in sg.gm.graph.nodes if n.target is PREFETCH] for k, sg in graphs.items()}
    n_params = len(list(MLP().parameters()))
    assert len(count["UNSHARD"]) == n_params - 1 and not count["F"] and not count["B"]
    step = list(graphs["STEP"].gm.graph.nodes)
    first_update = min(i for i, n in enumerate(step) if "_foreach_" in str(n.target) or "_fused_adam" in str(n.target))
    assert max(i for i, n in enumerate(step) if n.target is PREFETCH) < first_update
    assert len(count["STEP"]) == 3 * n_params          # each parameter's chunk and its two Adam moments


@pytest.mark.structure
def test_prefetch_op_advises_the_range_of_a_tracked_file(tmp_path):
    from fxpar import prefetch as P
    path = str(tmp_path / "w.bin")
    f = torch.from_file(path, shared=True, size=64, dtype=torch.float64)
    P.reset()
    try:
        P.track(f, path)
        PREFETCH(f[8:24])                               # a chunk of the file: its own range
        PREFETCH(torch.zeros(4))                        # not on disk: nothing to do
        assert P.STATS == {"calls": 2, "advised": 1 if P.ADVICE is not None else 0,
                           "bytes": 16 * 8 if P.ADVICE is not None else 0}
    finally:
        P.reset()
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.call_function(PREFETCH, (x,))
    g.output(x)
    g.eliminate_dead_code()
    assert any(n.target is PREFETCH for n in g.nodes)   # no output, yet kept
