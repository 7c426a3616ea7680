"""Measure what a rank actually does at run time, to check cost-model predictions against.

``CommCounter`` is a TorchDispatchMode that records every functional collective the graph runs
(its kind and the bytes handed to it): the measured side of "bytes sent per rank per step".

``MemoryTracker`` is the live tensor-storage measuring of :mod:`cost_models.tracker` (the bytes of every storage
alive on the rank, and their peak: the measured side of "peak memory per rank",
``Estimate.ranks[r].peak_memory_bytes``), re-exported here for the executor::

    with MemoryTracker(held=[*params, *opt_state, *buffers], inputs=microbatches) as mem:
        step()
    mem.peak_bytes
"""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from cost_models.tracker import MemoryTracker
from fxpar.collectives import gloo_all_gather_into_tensor

__all__ = ["CommCounter", "MemoryTracker"]

_KINDS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "broadcast": "broadcast",
    "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


class CommCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list = []        # (kind, bytes handed to the collective)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "_c10d_functional" or func is gloo_all_gather_into_tensor:
            name = func._schema.name.split("::")[-1]
            kind = _KINDS.get(name.rstrip("_"))        # in-place variants (all_reduce_) count alike
            if kind is not None:
                t = args[0]
                tensors = t if isinstance(t, (list, tuple)) else [t]
                self.calls.append((kind, sum(x.numel() * x.element_size() for x in tensors)))
        return func(*args, **kwargs)

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.calls)
