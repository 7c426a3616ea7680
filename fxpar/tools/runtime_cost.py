"""What ``ClusterSpec.calibrate()`` runs: the machine's figures (:func:`fxpar.tools.calibrate.calibrate`, spawned
gloo ranks) and fxpar's runtime's own cost per graph it calls (:func:`action_overhead_s`, a one-rank program that
``parallelize`` builds and an :class:`~fxpar.runtime.executor.Executor` runs in this process), which becomes
``DeviceSpec.action_overhead_s``.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from fxpar.api import parallelize
from fxpar.cluster import ClusterSpec
from fxpar.runtime.executor import Executor
from fxpar.tools.calibrate import calibrate
from fxpar.tools.probes import op_overhead

__all__ = ["action_overhead_s", "calibrate_cluster"]


def action_overhead_s(threads: int = 1, steps: int = 600) -> float:
    """Seconds fxpar's runtime costs per graph it calls, beyond the graph itself: the median ``Executor.step``
    of a one-rank program whose step is one graph (a 4x2 linear layer, MSE, SGD), less the median time inside
    that graph -- cutting the batch, assembling the arguments, reading the results, the step's bookkeeping.
    ``ClusterSpec.calibrate`` divides it by one tiny op's cost measured alike (:func:`fxpar.tools.probes.op_overhead`)
    and multiplies by the per-op cost it measured with every rank running, so that it slows as dispatch does where
    ranks share cores (``DeviceSpec.action_overhead_s``). About 15 ops (50 µs) on a 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, g = torch.nn.Linear(4, 2), torch.Generator().manual_seed(0)
        batch = (torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))
        # host_memory_reuse=False: this Executor runs in the caller's process, whose allocator is not ours to set
        prog = parallelize(model, ClusterSpec.local(1, host_memory_reuse=False), batch, loss_fn=F.mse_loss,
                           optimizer=(torch.optim.SGD, {"lr": 1e-3}))
        ex, inside = Executor(prog.payload(0, n_batches=steps)), []
        for parts in ex.p.graphs.values():
            for sg in parts.values():
                def timed(*args, _gm=sg.gm):
                    t = time.perf_counter()
                    out = _gm(*args)
                    inside.append(time.perf_counter() - t)
                    return out
                sg.gm = timed
        b = prog._prepare(batch, "batch")
        for _ in range(steps):
            ex.step(b)
        half = steps // 2                       # the second half: warm
        return max(0.0, statistics.median(ex.step_times[half:]) - statistics.median(inside[half:]))
    finally:
        torch.set_num_threads(before)


def calibrate_cluster(world_size: int = 2, **kwargs):
    """Measure this machine (collective bandwidth/latency by size, op throughput:
    :func:`fxpar.tools.calibrate.calibrate`, whose arguments it takes), and fxpar's runtime's own cost per
    graph it calls (``device.action_overhead_s``: :func:`action_overhead_s` over one tiny op's cost in the same
    process, times the per-op cost the ranks measured, so that it scales as the ops do where ranks share cores).
    What ``ClusterSpec.calibrate`` returns."""
    out = calibrate(world_size=world_size, **kwargs)
    spec, raw = out if kwargs.get("return_measurements") else (out, {})
    threads = kwargs.get("threads") or max(1, (os.cpu_count() or 1) // world_size)
    ops = action_overhead_s(threads=threads) / op_overhead()
    raw["action_overhead_ops"] = ops
    spec = replace(spec, device=replace(spec.device, action_overhead_s=ops * spec.device.op_overhead_s))
    return (spec, raw) if kwargs.get("return_measurements") else spec
