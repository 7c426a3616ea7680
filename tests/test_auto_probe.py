"""Depth probes of the automatic planner (``fxpar/auto/probe.py``): a one-stage program's full estimate composed
from builds of the model cut to 1 and 2 blocks, against the build of the whole model; ``parallelize(strategy="auto")``
probing its one-stage finalists returns what ``parallelize(strategy=<its pick>)`` builds."""
from __future__ import annotations

import re

import pytest
import torch

import fxpar
from fxpar.auto.probe import PROBE_DEPTHS, PROBE_MIN_BLOCKS, extrapolate, probe_depths, truncated
from fxpar.auto.search import CHEAP_FLOOR, PROBE_MARGIN, finalists
from fxpar.auto.space import Candidate
from fxpar.testing import GPT, gpt_loss, tiny_gpt, token_batches

ADAMW = (torch.optim.AdamW, {"lr": 1e-4})
S = fxpar.Strategy
A100X8 = fxpar.ClusterSpec.preset("a100-80gb", gpus_per_node=8)


def _meta_gpt(layers: int = 6, d: int = 256):
    with torch.device("meta"):
        model = GPT(vocab=1024, d=d, layers=layers, heads=4, max_seq=128)
    return model, torch.randint(0, 1024, (16, 128), device="meta")


def _figures(model, x, strategy) -> dict:
    est = fxpar.parallelize(model, A100X8, (x, x), gpt_loss, ADAMW, strategy=strategy).estimate()
    return {"step_s": est.step_time_s, "peak_bytes": max(r.peak_memory_bytes for r in est.ranks),
            "comm_bytes": max(r.comm_bytes for r in est.ranks)}


@pytest.mark.structure
def test_a_cut_model_shares_the_first_blocks_and_leaves_the_model_whole():
    model = tiny_gpt(layers=3)
    cut = truncated(model, "blocks", 1)
    assert len(model.blocks) == 3 and len(cut.blocks) == 1 and cut.blocks[0] is model.blocks[0]
    whole = dict(model.named_parameters())
    kept = dict(cut.named_parameters())
    assert list(kept) == [k for k in whole if not k.startswith(("blocks.1.", "blocks.2."))]
    assert all(kept[k] is whole[k] for k in kept)
    x = token_batches(1)[0][0]
    assert cut(x).shape == model(x).shape
    one, pipe = Candidate(8, 1, 1), Candidate(4, 1, 2, schedule="1f1b")
    assert probe_depths(one, PROBE_MIN_BLOCKS) == PROBE_DEPTHS
    assert probe_depths(pipe, 12) is None and probe_depths(one, PROBE_MIN_BLOCKS - 1) is None


# (strategy, largest relative error of the composed step, of the composed peak) on a 6-block GPT (d=256) at 8 A100s
COMPOSED = [
    (S(dp=8), 1e-12, 1e-12),
    (S(dp=8, zero=2, bucket_cap_mb=1), 1e-12, 1e-12),
    (S(dp=8, zero=3, precision="bf16"), 0.003, 1e-12),
    (S(dp=8, microbatches=2, recompute="selective", zero=2), 1e-12, 1e-12),
    (S(dp=8, recompute="full"), 1e-12, 1e-12),
    (S(dp=2, tp=4, sharding="megatron"), 1e-12, 1e-12),
    (S(dp=4, tp=2, sharding="megatron", precision="bf16"), 1e-12, 0.02),     # bf16 copies' peak
    (S(dp=4, tp=2, sharding="auto"), 0.003, 1e-12),                         # Tofu's split changes with the depth
    (S(dp=8, zero=1, bucket_cap_mb=5), 0.017, 0.038),                       # 5 MiB buckets across block boundaries
]


@pytest.mark.slow
@pytest.mark.cost
@pytest.mark.parametrize("strategy,step_err,peak_err", COMPOSED, ids=[str(c[0]) for c in COMPOSED])
def test_the_composed_estimate_is_the_whole_models(strategy, step_err, peak_err):
    """E(6) composed from the builds at 1 and 2 blocks against the 6-block build: step, peak and bytes sent. The
    errors here are the ones ``PROBE_MARGIN`` covers."""
    model, x = _meta_gpt()
    whole = _figures(model, x, strategy)
    a, b = (_figures(truncated(model, "blocks", k), x, strategy) for k in PROBE_DEPTHS)
    got = extrapolate(a, b, *PROBE_DEPTHS, 6)
    err = {k: abs(got[k] / whole[k] - 1) for k in whole}
    assert err["step_s"] <= step_err and err["peak_bytes"] <= peak_err and err["comm_bytes"] <= 1e-12, err
    assert max(step_err, peak_err) < PROBE_MARGIN


def _printout(prog) -> tuple:
    plan = re.sub(r"searched in [0-9.e+-]+ s", "searched in T s", prog.plan.to_json())
    est = prog.estimate()
    return (plan, [{k: g.code for k, g in prog.graphs(r).items()} for r in range(prog.cluster.world_size)],
            est.step_time_s, [(r.peak_memory_bytes, r.comm_bytes) for r in est.ranks])


@pytest.mark.slow
@pytest.mark.cost
def test_auto_probes_the_one_stage_finalists_and_returns_the_picks_own_build():
    """On a 6-block GPT at 8 A100s: the cheap cost's first finalist is built, the other one-stage finalists are
    probed (their composed figures are the whole build's, within the margin), a finalist too far behind by the cheap
    cost is not built; the program returned is what ``parallelize(strategy=<the pick>)`` builds (plan JSON, every
    rank's graphs, the estimate), and the pick is the best whole build among the finalists that were built or
    probed."""
    model, x = _meta_gpt()
    prog = fxpar.parallelize(model, A100X8, (x, x), gpt_loss, ADAMW, strategy="auto")
    found = prog.auto_search
    first, _ = finalists(found)
    probed = [c for c in found.built if "probe" in c.full]
    assert probed and all(c.pp == 1 for c in probed) and first[0] in found.built and "probe" not in first[0].full
    assert set(map(id, found.built)) | set(map(id, found.skipped)) == set(map(id, first))
    alone = fxpar.parallelize(model, A100X8, (x, x), gpt_loss, ADAMW, strategy=found.chosen.strategy())
    assert _printout(prog) == _printout(alone)
    for c in probed:
        whole = _figures(model, x, c.strategy())
        assert c.full["step_s"] == pytest.approx(whole["step_s"], rel=PROBE_MARGIN)
        assert found.chosen.full["step_s"] <= whole["step_s"] * (1 + 1e-12)      # the pick is the best whole build
    for c in found.skipped:
        assert c.step_s * CHEAP_FLOOR > found.chosen.full["step_s"]
    assert "probed" in prog.explain()
