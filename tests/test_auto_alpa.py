"""The automatic planner against Alpa's GPT benchmark (Zheng et al., OSDI'22, "Alpa: Automating Inter- and
Intra-Operator Parallelism for Distributed Deep Learning", Section 8.1): GPT-3-style models (sequence 1,024,
vocabulary 51,200, fp16 with fp32 master weights, every layer rematerialized) on AWS p3.16xlarge machines
(``ClusterSpec.preset("p3.16xlarge")``: 8 V100-16GB with NVLink, 25 Gbps between machines).

Throughput is per GPU as Alpa computes it (``compute_gpt_tflops`` in the alpa-projects/alpa repository's
``alpa/util.py``, with ``checkpoint_activations=True`` as its GPT benchmark passes for rematerialized runs):
F = 96 B s l h^2 (1 + s / 6h) + 6 B s h V FLOPs per iteration, over (GPUs x step seconds).

The published figures:

- ``MEASURED``: the one GPT point with a step time in writing, the quick performance test of Alpa's benchmark README
  (``benchmark/alpa/README.md``, "Expected output on AWS p3.16 (07/27/2022)"): GPT-2.6B, global batch 32, dp = op =
  pp = 2, 4 microbatches, remat, 2.454 s, 37.16 TFLOPS; the suite that defines it (``paper_manual_gpt_suite.py``,
  ``test_gpt_suite[8]``) notes "Ours: 37 TFLOPS. Megatron: 38 TFLOPS." for the same case.
- ``FIGURE7``: Figure 7(a) of the paper (weak scaling, global batch 1,024; the models of its Table 4), read off the
  plot (``docs/benchmark/bench-paper.png`` in the same repository: 99 pixels per PFLOPS, so +-0.01 PFLOPS, which is
  +-2.5 TFLOPS per GPU at 4 GPUs and +-0.16 at 64), and Alpa's own plan for each point on p3.16xlarge
  (``benchmark/alpa/suite_auto_gpt.py``, ``perf_test_suite``: its microbatches, stages and meshes) where its
  stages are alike (8 GPUs: stages of 2, 2 and 4 GPUs, which a dp x tp x pp mesh cannot express).
"""
from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.cluster import PRESETS
from fxpar.testing import GPT, gpt_loss

ADAMW = (torch.optim.AdamW, {"lr": 1e-4})
V, S = 51200, 1024
# GPT specs (Alpa's gpt_specs): hidden, layers, heads
SPECS = {"350M": (1024, 24, 16), "1.3B": (2048, 24, 32), "2.6B": (2560, 32, 32), "6.7B": (4096, 32, 32),
         "15B": (5120, 48, 40), "39B": (8192, 48, 64)}
# GPUs, model, global batch, Alpa's TFLOPS per GPU, Megatron-LM's, Alpa's (dp, tp, pp, microbatches) or None
MEASURED = (8, "2.6B", 32, 37.16, 38.0, (2, 2, 2, 4))
MEASURED_STEP_S = 2.454
# Figure 7(a): the 1-GPU bars sit under the linear-scaling box's edge, whose 64-GPU top (3.05 PFLOPS) is 64 x the
# 1-GPU throughput; at 4 GPUs every bar ends at the box's edge (0.215 PFLOPS); at 8 Megatron-LM's ends under it
FIGURE7 = [(1, "350M", 1024, 47.7, 47.7, (1, 1, 1, 512)), (4, "1.3B", 1024, 53.8, 53.8, (2, 1, 2, 128)),
           (8, "2.6B", 1024, 61.1, 46.9, None), (16, "6.7B", 1024, 59.5, 55.7, (2, 4, 2, 64)),
           (32, "15B", 1024, 59.7, 58.1, (2, 4, 4, 128)), (64, "39B", 1024, 56.9, 57.9, (1, 4, 16, 1024))]


def alpa_flops(point) -> float:
    """FLOPs of one iteration as Alpa counts them (rematerialization included)."""
    _, name, B, *_ = point
    h, l, _ = SPECS[name]
    return 96 * B * S * l * h * h * (1 + S / (6 * h)) + 6 * B * S * h * V


def tflops(point, step_s: float) -> float:
    """TFLOPS per GPU of ``point`` at ``step_s`` seconds a step, Alpa's way."""
    return alpa_flops(point) / (point[0] * step_s * 1e12)


def setup(point):
    """(meta model, example batch, p3.16xlarge cluster, the pins both systems share) of one point: fp16, every
    block recomputed, no offload."""
    n, name, B, *_ = point
    h, l, heads = SPECS[name]
    with torch.device("meta"):
        model = GPT(vocab=V, d=h, layers=l, heads=heads, max_seq=S)
        x = torch.randint(0, V, (B, S))
    cluster = fxpar.ClusterSpec.preset("p3.16xlarge", nodes=max(1, n // 8), gpus_per_node=min(n, 8))
    return model, x, cluster, dict(precision="fp16", recompute="full", offload=())


def config_pins(point) -> dict:
    """Alpa's plan of ``point`` as ``Strategy.auto`` pins (its mesh, microbatches, 1F1B); the ZeRO stage and the
    bucket size are left to the search (Alpa shards the optimizer update over dp: ``prefer_reduce_scatter``)."""
    dp, tp, pp, m = point[5]
    pins = dict(dp=dp, tp=tp, pp=pp, microbatches=m)
    if tp > 1:
        pins["sharding"] = "megatron"
    if pp > 1:
        pins["schedule"] = "1f1b"
    return pins


@pytest.mark.structure
def test_the_presets_carry_their_cited_figures():
    for name in ("v100-16gb", "v100-32gb", "p3.16xlarge"):
        d = PRESETS[name]["device"]
        assert (d.peak_flops, d.efficiency) == (125e12, {"matmul": 83 / 125})       # Markidis et al. 2018: 83 TFLOPS
    p3 = fxpar.ClusterSpec.preset("p3.16xlarge", nodes=2)
    assert p3.device.memory_bytes == 16 * 2**30 and p3.devices_per_node == 8 and p3.backend == "nccl"
    assert p3.intra_node.bandwidth == 150e9                     # NVLink 2.0: 300 GB/s both ways
    assert p3.inter_node.bandwidth * 8 * 8 == 25e9              # 25 Gbps per machine, an eighth per GPU
    assert alpa_flops(MEASURED) / (8 * MEASURED_STEP_S * 1e12) == pytest.approx(37.16, abs=0.005)   # Alpa's formula


@pytest.mark.cost
def test_the_measured_point_predicted_within_20_percent():
    """GPT-2.6B, batch 32, dp = tp = pp = 2 on one p3.16xlarge: fxpar's cheap cost of that configuration against
    the README's 2.454 s (37.16 TFLOPS) and Megatron-LM's 38 TFLOPS. Its predicted peak, 14.6 GiB, is over the
    default 90% of 16 GiB (fxpar's ZeRO does not compose with tp, where Alpa shards the update over dp and measured
    8.7 GB): margin=1.0 lets it be priced, and it must still fit the device."""
    model, x, cl, pins = setup(MEASURED)
    got = fxpar.auto_plan(model, cl, (x, x), gpt_loss, ADAMW, prune=False,
                          strategy=fxpar.Strategy.auto(**pins, **config_pins(MEASURED), zero=0, margin=1.0))
    c = got[0]
    assert c.peak_bytes <= cl.device.memory_bytes
    assert 0.8 <= c.step_s / MEASURED_STEP_S <= 1.2, (c.step_s, c.time)
    assert 0.8 <= tflops(MEASURED, c.step_s) / MEASURED[4] <= 1.2


@pytest.mark.cost
def test_auto_on_the_measured_point_is_no_slower_and_fits():
    model, x, cl, pins = setup(MEASURED)
    hand = fxpar.auto_plan(model, cl, (x, x), gpt_loss, ADAMW, prune=False,
                           strategy=fxpar.Strategy.auto(**pins, **config_pins(MEASURED), zero=0, margin=1.0))[0]
    found = fxpar.auto_plan(model, cl, (x, x), gpt_loss, ADAMW, strategy=fxpar.Strategy.auto(**pins))
    assert found[0].step_s <= hand.step_s, (str(found[0]), found[0].step_s, hand.step_s)
    assert all(c.peak_bytes <= found.search.budget_bytes for c in found)
