"""Measure what a rank actually does at run time, to check cost-model predictions against.

``CommCounter`` is a TorchDispatchMode that records every collective the rank runs (its kind and the bytes handed
to it): the graphs' functional collectives and the ``torch.distributed`` calls made on the host while it counts
(``c10d`` ops: a DDP comm hook's ``dist.all_reduce``) -- the measured side of "bytes sent per rank per step".

``MemoryTracker`` is the live tensor-storage measuring of :mod:`cost_models.tracker` (the bytes of every storage
alive on the rank, and their peak: the measured side of "peak memory per rank",
``Estimate.ranks[r].peak_memory_bytes``), re-exported here for the executor::

    with MemoryTracker(held=[*params, *opt_state, *buffers], inputs=microbatches) as mem:
        step()
    mem.peak_bytes
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from cost_models.tracker import MemoryTracker
from fxpar.collectives import gloo_all_gather_into_tensor

__all__ = ["CommCounter", "MemoryTracker"]

_KINDS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "broadcast": "broadcast",
    "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


# torch.distributed's own ops (``c10d::*``, what ``dist.all_reduce`` and friends dispatch): kind, and the position of
# the tensor(s) handed to the collective among the op's arguments
_C10D = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0), "broadcast_": ("broadcast", 0),
    "allgather_": ("all_gather", 1), "_allgather_base_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if hasattr(t, "element_size") else 0


def _group_ranks(func, args, kwargs) -> tuple:
    """The global ranks of the process group a collective op runs over (its ``group_name`` or ``process_group``
    argument), in the group's order; ``()`` where the op names none this can resolve."""
    for i, a in enumerate(func._schema.arguments):
        if a.name in ("group_name", "process_group"):
            g = kwargs.get(a.name, args[i] if i < len(args) else None)
            try:
                if isinstance(g, str):
                    from torch.distributed.distributed_c10d import _resolve_process_group
                    g = _resolve_process_group(g)
                elif isinstance(g, torch.ScriptObject):         # c10d's ops carry the group boxed
                    g = dist.ProcessGroup.unbox(g)
                return tuple(dist.get_process_group_ranks(g))
            except Exception:              # noqa: BLE001 -- a group this process cannot name: recorded as unknown
                return ()
    return ()


class CommCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list = []        # (kind, bytes handed to the collective)
        self.groups: list = []       # per call: the global ranks of its process group

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "_c10d_functional" or func is gloo_all_gather_into_tensor:
            name = func._schema.name.split("::")[-1]
            kind = _KINDS.get(name.rstrip("_"))        # in-place variants (all_reduce_) count alike
            if kind is not None:
                t = args[0]
                tensors = t if isinstance(t, (list, tuple)) else [t]
                self.calls.append((kind, sum(x.numel() * x.element_size() for x in tensors)))
                self.groups.append(_group_ranks(func, args, kwargs))
        elif func.namespace == "c10d":
            kind, at = _C10D.get(func._schema.name.split("::")[-1], (None, 0))
            if kind is not None:
                self.calls.append((kind, _nbytes(args[at])))
                self.groups.append(_group_ranks(func, args, kwargs))
        return func(*args, **kwargs)

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.calls)
