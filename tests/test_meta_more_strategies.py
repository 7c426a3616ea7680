"""A model built on ``meta`` plans and estimates under the strategies that
``tests/test_device_placement.py::test_a_model_on_another_device_is_planned_under_every_strategy`` does not list:
the other gradient-compression methods, the other synchronisation methods, HetPipe, Wavelet and ``compile=True``.

As there, ``meta`` stands in for a model moved to CUDA before ``parallelize``: every value a rank's graphs read must
keep the model's device (or be a host scalar), and ``estimate()`` gives every rank a peak. Nothing runs.
"""
import dataclasses

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import fxpar
import fxpar.compress as C
import fxpar.sync as S
from fxpar.testing import GPT, gpt_loss

# 1-6 s each (a parallelize of the GPT per strategy): the full suite runs them, the quick loop does not
pytestmark = [pytest.mark.structure, pytest.mark.slow]

# (world size, Strategy options, ClusterSpec changes); "servers": CPU parameter-server ranks on gloo (they cannot
# join an NCCL group), "hetero": a heterogeneous cluster of the preset's device and a half-speed copy of it.
STRATEGIES = {
    "randomk": (2, dict(dp=2, grad_sync=C.RandomK(ratio=0.1)), {}),
    "wangni": (2, dict(dp=2, grad_sync=C.Wangni(ratio=0.1)), {}),
    "qsgd": (2, dict(dp=2, grad_sync=C.QSGD(levels=16, bucket=64)), {}),
    "nuqsgd": (2, dict(dp=2, grad_sync=C.NUQSGD(bits=4, bucket=64)), {}),
    "alq": (2, dict(dp=2, grad_sync=C.ALQ(bits=3, bucket=64)), {}),
    "amq": (2, dict(dp=2, grad_sync=C.AMQ(bits=3, bucket=64)), {}),
    "accordion": (2, dict(dp=2, grad_sync=C.Accordion(low=C.PowerSGD(rank=1), high=C.PowerSGD(rank=2))), {}),
    "bytegrad": (2, dict(dp=2, grad_sync=C.ByteGrad()), {}),
    "qadam": (2, dict(dp=2, grad_sync=C.QAdam(warmup_steps=2)), dict(optimizer="qadam")),
    "decentralized": (4, dict(dp=4, grad_sync=C.Decentralized(peers="ring")), {}),
    "ddp_hook": (2, dict(dp=2, grad_sync=C.DDPHook(default_hooks.fp16_compress_hook)), {}),
    "bf16_buckets": (2, dict(dp=2, grad_sync="bf16"), {}),
    "diloco": (2, dict(dp=2, sync=S.DiLoCo(period=2, outer=(torch.optim.SGD, {"lr": 0.7, "momentum": 0.9,
                                                                                "nesterov": True}))), {}),
    "slowmo": (2, dict(dp=2, sync=S.SlowMo(period=2, slow_lr=1.0, slow_momentum=0.5)), {}),
    "local_sgd_hierarchical": (4, dict(dp=4, sync=S.LocalSGD(hierarchical={2: 2, 4: 4})), {}),
    "async_averaging": (2, dict(dp=2, sync=S.AsyncAveraging(every_steps=2)), {}),
    "dabmd": (2, dict(dp=2, microbatches=2, sync=S.DABMD(round_time_s=0.5)), {}),
    "ssp": (2, dict(dp=2, sync=S.SSP(staleness=2)), dict(servers=1)),
    "dssp": (2, dict(dp=2, sync=S.DSSP(low=1, high=4)), dict(servers=1)),
    "hetpipe": (4, dict(dp=2, pp=2, microbatches=2, schedule="hetpipe", staleness=1), dict(servers=2, hetero=True)),
    "wavelet": (2, dict(dp=2, microbatches=2, schedule="wavelet"), {}),
    "wavelet_pp2": (2, dict(pp=2, microbatches=2, schedule="wavelet"), {}),
    "compile": (2, dict(dp=2, compile=True), {}),
    "compile_auto": (2, dict(dp=2, compile="auto"), {}),
}
_UNTIED = ("hetpipe",)          # weights tied across stages are refused there (support matrix)


def _cluster(world: int, changes: dict):
    cluster = fxpar.ClusterSpec.preset("h100-80gb", gpus_per_node=world)
    if not changes.get("servers"):
        return cluster
    if changes.get("hetero"):
        device = cluster.device
        slow = dataclasses.replace(device, name=device.name + "-half", peak_flops=device.peak_flops / 2)
        return fxpar.ClusterSpec.heterogeneous([device, device, slow, slow], cpu_servers=changes["servers"],
                                               backend="gloo")
    return dataclasses.replace(cluster, cpu_servers=changes["servers"], backend="gloo")


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_meta_model_plans_and_estimates(name):
    world, strategy, changes = STRATEGIES[name]
    with torch.device("meta"):
        model = GPT(tie_weights=name not in _UNTIED)
    x = torch.randint(0, 64, (8, 16), device="meta")
    optimizer = ((C.QAdamOptimizer, {"lr": 1e-3}) if changes.get("optimizer") == "qadam"
                 else (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}))
    program = fxpar.parallelize(model, _cluster(world, changes), (x, x), loss_fn=gpt_loss, optimizer=optimizer,
                                strategy=fxpar.Strategy(**strategy))
    peaks = [r.peak_memory_bytes for r in program.estimate().ranks]
    assert len(peaks) == world and all(p > 0 for p in peaks), peaks
    for r in range(world):          # every value a rank's graphs read lives on the model's device, or is a host scalar
        for label, gm in program.graphs(r).items():
            for n in gm.graph.find_nodes(op="placeholder"):
                v = n.meta.get("val")
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    assert v.device.type == "meta", (name, r, label, n.name, v.device)
