"""A model on another device than the host: what fxpar makes of its tensors' device.

On this machine (no GPU) the ``meta`` device stands in for a model moved to CUDA before ``parallelize``: capture,
the pipeline split and the sharding passes must keep the model's device on every value they make. The CUDA run
itself is ``benchmarks/gpu_check.py`` (figures in docs/benchmarks.md). Ranks that share one GPU over gloo stage
each collective through the host (``fxpar.collectives.stage_through_host``): its ops are checked here on a
one-rank gloo group, where the staged op must give what the functional op gives.
"""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxpar
import fxpar.compress as C
import fxpar.sync as S
from fxpar.testing import GPT, gpt_loss

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.structure

# Every strategy the support matrix lists as working, as (world size, Strategy options, ClusterSpec changes). The
# asynchronous pipelines refuse a weight tied across stages (support matrix), so they plan the untied GPT; BytePS's CPU
# servers cannot join an NCCL group (ClusterSpec refuses it), so it plans on gloo.
STRATEGIES = {
    "dp": (2, dict(dp=2), {}),
    "grad_accumulation": (1, dict(microbatches=2), {}),
    "gpipe": (2, dict(pp=2, schedule="gpipe", microbatches=2), {}),
    "1f1b": (2, dict(pp=2, schedule="1f1b", microbatches=2), {}),
    "interleaved": (2, dict(pp=2, schedule="interleaved", microbatches=2), {}),
    "dp_zb1p": (4, dict(dp=2, pp=2, schedule="zb1p", microbatches=2), {}),
    "chimera": (2, dict(pp=2, schedule="chimera", microbatches=2), {}),
    "pipedream": (2, dict(pp=2, schedule="pipedream", microbatches=2), {}),
    "2bw": (2, dict(pp=2, schedule="2bw", microbatches=2), {}),
    "pipelined_bp": (2, dict(pp=2, schedule="pipelined_bp", microbatches=2), {}),
    "pipemare": (2, dict(pp=2, schedule="pipemare", microbatches=2), {}),
    "megatron": (2, dict(tp=2, sharding="megatron"), {}),
    "tofu": (2, dict(tp=2), {}),
    "zero1": (2, dict(dp=2, zero=1), {}),
    "zero2": (2, dict(dp=2, zero=2), {}),
    "zero3": (2, dict(dp=2, zero=3), {}),
    "zero_offload": (2, dict(dp=2, zero=2, offload=("optimizer",)), {}),
    "zero3_offload": (2, dict(dp=2, zero=3, offload=("params", "optimizer")), {}),
    "delayed_update": (2, dict(dp=2, delayed_update=True), {}),
    "recompute_full": (1, dict(recompute="full"), {}),
    "recompute_selective": (1, dict(recompute="selective"), {}),
    "offload_activations": (1, dict(offload_activations=True), {}),
    "bytescheduler": (2, dict(dp=2, comm_schedule="bytescheduler"), {}),
    "bytescheduler_cross_iteration": (2, dict(dp=2, comm_schedule="bytescheduler", cross_iteration=True), {}),
    "herring": (4, dict(dp=4, grad_sync="herring"), dict(nodes=2)),
    "byteps": (2, dict(dp=2, grad_sync="byteps"), dict(cpu_servers=1, backend="gloo")),
    "parallax": (2, dict(dp=2, grad_sync="parallax"), {}),
    "topk": (2, dict(dp=2, grad_sync=C.TopK(ratio=0.1)), {}),
    "powersgd": (2, dict(dp=2, grad_sync=C.PowerSGD(rank=1)), {}),
    "fp16_buckets": (2, dict(dp=2, grad_sync="fp16"), {}),
    "local_sgd": (2, dict(dp=2, sync=S.LocalSGD(period=2)), {}),
    "bf16": (2, dict(dp=2, precision="bf16"), {}),
    "bf16_megatron": (2, dict(tp=2, sharding="megatron", precision="bf16"), {}),
    "bf16_1f1b": (2, dict(pp=2, schedule="1f1b", microbatches=2, precision="bf16"), {}),
    "fp16": (2, dict(dp=2, precision="fp16"), {}),
}
_UNTIED = ("pipedream", "2bw", "pipelined_bp", "pipemare")
_HOST_COPIES = ("zero3_offload", "zero_offload")     # ZeRO-Offload's graphs read host copies by design


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_model_on_another_device_is_planned_under_every_strategy(name):
    """A model built on ``meta``: the stage examples of the pipeline split and the local pieces the sharding
    lowering checks keep the model's device (they were made on the host, and tracing mixed two devices); every
    strategy plans and estimates."""
    world, strategy, changes = STRATEGIES[name]
    nodes = changes.get("nodes", 1)
    with torch.device("meta"):
        model = GPT(tie_weights=name not in _UNTIED)
    x = torch.randint(0, 64, (8, 16), device="meta")
    cluster = fxpar.ClusterSpec.preset("h100-80gb", nodes=nodes, gpus_per_node=world // nodes)
    cluster = dataclasses.replace(cluster, **{k: v for k, v in changes.items() if k != "nodes"})
    program = fxpar.parallelize(model, cluster, (x, x), loss_fn=gpt_loss, optimizer=(torch.optim.AdamW, {"lr": 1e-3}),
                                strategy=fxpar.Strategy(**strategy))
    peaks = [r.peak_memory_bytes for r in program.estimate().ranks]
    assert len(peaks) == world and all(p > 0 for p in peaks)
    for r in range(world):          # every value a rank's graphs read lives on the model's device, or is a host scalar
        for name_, gm in program.graphs(r).items():
            for n in gm.graph.find_nodes(op="placeholder"):
                v = n.meta.get("val")
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    assert v.device.type == "meta" or name in _HOST_COPIES, (name, r, name_, n.name, v.device)


def test_presets_carry_the_datasheet_figures():
    """The anchors' hardware: A100 40/80 GB, H100 SXM and PCIe, H200, V100; NVLink inside a node, one InfiniBand
    NIC per GPU across nodes (fxpar/cluster.py cites the datasheets); short names reach the SXM parts."""
    h200 = fxpar.ClusterSpec.preset("h200", nodes=2)
    assert (h200.device.memory_bytes, h200.device.peak_flops, h200.device.mem_bandwidth) == (141 * 2**30, 989e12, 4.8e12)
    assert h200.world_size == 16 and h200.link(0, 1).bandwidth == 450e9 and h200.link(0, 8).bandwidth == 50e9
    assert fxpar.ClusterSpec.preset("a100") == fxpar.ClusterSpec.preset("a100-80gb")
    assert fxpar.ClusterSpec.preset("a100-40gb").device.memory_bytes == 40 * 2**30
    assert fxpar.ClusterSpec.preset("h100").device.name == "H100-SXM5-80GB"
    assert fxpar.ClusterSpec.preset("h100-pcie").intra_node.bandwidth < fxpar.ClusterSpec.preset("h100").intra_node.bandwidth
    v100 = fxpar.ClusterSpec.preset("v100", nodes=2)
    assert (v100.device.peak_flops, v100.intra_node.bandwidth, v100.inter_node.bandwidth) == (125e12, 150e9, 12.5e9)
    with pytest.raises(fxpar.ClusterSpecError, match="h200"):
        fxpar.ClusterSpec.preset("b300")

STAGED = r'''
import torch, torch.distributed as dist, torch.fx
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from fxpar.collectives import (C10D, _host_staged, gloo_all_gather_into_tensor, gloo_group, insert_all_reduce,
                               stage_through_host)
from fxpar.runtime.groups import bind_groups
g = dist.group.WORLD.group_name
assert gloo_group(g)
x = torch.arange(6.0)

def plain(op, *args):
    return C10D.wait_tensor.default(op(*args))

for op, args in [(C10D.all_reduce.default, ("sum", g)), (C10D.all_gather_into_tensor.default, (1, g)),
                 (C10D.reduce_scatter_tensor.default, ("sum", 1, g)), (gloo_all_gather_into_tensor, (1, g)),
                 (C10D.broadcast.default, (0, g))]:
    got = _host_staged(op)(x, *args)
    assert torch.equal(got, plain(op, x.clone(), *args)), op
y = x.clone()
assert _host_staged(C10D.all_reduce_.default)(y, "sum", g) is y and torch.equal(y, x)   # in place: its own input
outs = _host_staged(C10D.all_reduce_coalesced.default)([x, 2 * x], "sum", g)
assert isinstance(outs, list) and torch.equal(outs[1], 2 * x)

graph = torch.fx.Graph()
a = graph.placeholder("a")
ar, w = insert_all_reduce(graph, a, "dp", (0,))
graph.output(graph.call_function(torch.ops.aten.mul.Tensor, (w, 2)))
gm = bind_groups(torch.fx.GraphModule({}, graph), {"dp": g})
before = gm(x)
assert stage_through_host(gm) == 1
targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
assert targets[0].__name__ == "host_staged_all_reduce" and targets[1] is C10D.wait_tensor.default, targets
assert torch.equal(gm(x), before) and torch.equal(before, 2 * x)
dist.destroy_process_group()
print("STAGED OK")
'''


def test_collectives_staged_through_the_host_give_what_the_functional_ops_give():
    """Each staged op (host copy, the functional op, waited, copied back) equals the functional op, the in-place one
    writes its own input, and the rewrite of a bound graph replaces the collective and keeps its wait."""
    out = subprocess.run([sys.executable, "-c", STAGED], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "STAGED OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("offload", [("optimizer",), ("params", "optimizer")])
def test_offloaded_state_is_not_counted_as_device_memory(offload):
    """ZeRO-3 + offload on a device: the optimizer state and the parameter chunks (the host masters the update
    writes) live in host memory, so the estimate's device peak holds neither; the activations are the same as
    without offload."""
    def program(off):
        with torch.device("meta"):
            model = GPT(vocab=256, d=64, layers=2, heads=4, max_seq=32)
        x = torch.randint(0, 256, (8, 32), device="meta")
        return fxpar.parallelize(model, fxpar.ClusterSpec.preset("h100-80gb", gpus_per_node=2), (x, x),
                                 loss_fn=gpt_loss, optimizer=(torch.optim.AdamW, {"lr": 1e-3}),
                                 strategy=fxpar.Strategy(dp=2, zero=3, offload=off))
    kept, moved = program(()).estimate().ranks[0], program(offload).estimate().ranks[0]
    assert kept.memory_breakdown["opt_state"] > 0 and kept.memory_breakdown["param"] > 0
    assert moved.memory_breakdown["opt_state"] == 0 and moved.memory_breakdown["param"] == 0
    assert moved.memory_breakdown["activation"] == kept.memory_breakdown["activation"]
    assert moved.peak_memory_bytes < kept.peak_memory_bytes
