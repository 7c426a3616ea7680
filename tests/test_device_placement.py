"""A model on another device than the host: what fxpar makes of its tensors' device.

On this machine (no GPU) the ``meta`` device stands in for a model moved to CUDA before ``parallelize``: capture,
the pipeline split and the sharding passes must keep the model's device on every value they make. The CUDA run
itself is ``benchmarks/gpu_check.py`` (figures in docs/benchmarks.md). Ranks that share one GPU over gloo stage
each collective through the host (``fxpar.collectives.stage_through_host``): its ops are checked here on a
one-rank gloo group, where the staged op must give what the functional op gives.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.testing import GPT, gpt_loss

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.structure

STRATEGIES = {
    "1f1b": (2, dict(pp=2, schedule="1f1b", microbatches=2)),
    "megatron": (2, dict(tp=2, sharding="megatron")),
    "tofu": (2, dict(tp=2)),
    "zero3_offload": (2, dict(dp=2, zero=3, offload=("params", "optimizer"))),
    "dp_zb1p": (4, dict(dp=2, pp=2, schedule="zb1p", microbatches=2)),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_model_on_another_device_is_planned_under_every_strategy(name):
    """A model built on ``meta``: the stage examples of the pipeline split and the local pieces the sharding
    lowering checks keep the model's device (they were made on the host, and tracing mixed two devices)."""
    world, strategy = STRATEGIES[name]
    with torch.device("meta"):
        model = GPT()
    x = torch.randint(0, 64, (8, 16), device="meta")
    program = fxpar.parallelize(model, fxpar.ClusterSpec.preset("h100-80gb", gpus_per_node=world), (x, x),
                                loss_fn=gpt_loss, optimizer=(torch.optim.AdamW, {"lr": 1e-3}),
                                strategy=fxpar.Strategy(**strategy))
    peaks = [r.peak_memory_bytes for r in program.estimate().ranks]
    assert len(peaks) == world and all(p > 0 for p in peaks)
    for r in range(world):          # every value a rank's graphs read lives on the model's device, or is a host scalar
        for name_, gm in program.graphs(r).items():
            for n in gm.graph.find_nodes(op="placeholder"):
                v = n.meta.get("val")
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    assert v.device.type == "meta" or name in ("zero3_offload",), (name, r, name_, n.name, v.device)

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
