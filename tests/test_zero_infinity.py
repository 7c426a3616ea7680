"""ZeRO-Infinity (issue 10 part 5): parameters and optimizer state in memory-mapped files under ``offload_dir``,
and memory-centric tiling (``fxpar.nn.TiledLinear``)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.nn import TiledLinear, tile_linears
from fxpar.testing import MLP, max_abs_diff, reference_training
from fxpar.zero import chunk

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
TOL = 1e-10


def _batches(n, d_in=16, d_out=8, batch=8):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(batch, d_in, generator=g, dtype=torch.float64),
             torch.randn(batch, d_out, generator=g, dtype=torch.float64)) for _ in range(n)]


@pytest.mark.parametrize("extra", [dict(), dict(microbatches=2)], ids=["fused", "accumulated"])
def test_zero3_state_on_disk_matches_single_process(clusters, tmp_path, extra):
    torch.manual_seed(0)
    model, batches = MLP().double(), _batches(3)
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


def test_offload_without_zero_and_resume(clusters, tmp_path):
    """Whole parameters and optimizer state on disk (zero=0); a checkpoint resumes into the files bitwise."""
    torch.manual_seed(0)
    model, batches = MLP().double(), _batches(4)
    strat = fxpar.Strategy(dp=2, offload=("params", "optimizer"), offload_to="disk", offload_dir=tmp_path / "o")
    prog = fxpar.parallelize(model, 2, batches[0], F.mse_loss, ADAMW, strategy=strat)
    whole = prog.run_local(batches, cluster=clusters.get(2))
    first = prog.run_local(batches[:2], cluster=clusters.get(2), save_to=tmp_path / "c")
    rest = prog.run_local(batches[2:], cluster=clusters.get(2), resume_from=tmp_path / "c")
    assert first.losses + rest.losses == whole.losses
    assert max_abs_diff(rest.state_dict(), whole.state_dict()) == 0


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


def test_tiled_model_under_zero3_gathers_one_tile_at_a_time(clusters):
    torch.manual_seed(0)
    model = MLP().double()
    replaced = tile_linears(model, max_params=256)          # 32x16, 32x32 (and 8x32) weights -> tiles of <= 256
    assert replaced == ["layers.0", "layers.1"]
    batches = _batches(3)
    prog = fxpar.parallelize(model, 2, batches[0], F.mse_loss, ADAMW, strategy=fxpar.Strategy(dp=2, zero=3))
    res = prog.run_local(batches, cluster=clusters.get(2))
    ref_losses, ref_state = reference_training(model, batches, F.mse_loss, ADAMW)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL
    gm = prog.graphs(0)["step"]
    gathered = [x.args[0].meta["val"].numel() * 2 for x in gm.graph.nodes
                if x.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    assert max(gathered) <= 256                               # never more than one tile's weights in one gather
