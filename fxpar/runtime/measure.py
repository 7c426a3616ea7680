"""Measure what a rank actually does at run time, to check cost-model predictions against.

``CommCounter`` is a TorchDispatchMode that records every functional collective the graph runs
(its kind and the bytes handed to it): the measured side of "bytes sent per rank per step".

``MemoryTracker`` is a TorchDispatchMode that keeps the bytes of every tensor storage alive on the
rank and their peak: the measured side of "peak memory per rank" (``Estimate.ranks[r].peak_memory_bytes``).
On CUDA the same figure is ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``
(which also counts the caching allocator's rounding to 512-byte blocks and kernels' workspaces);
on CPU there is no allocator statistic, so we count storages at the dispatcher::

    with MemoryTracker(held=[*params, *opt_state, *buffers], inputs=microbatches) as mem:
        step()
    mem.peak_bytes        # most bytes of distinct storages alive at once, state included

* every tensor an op returns is recorded by its storage, once however many views share it, with
  its whole ``nbytes`` (a view keeps its base alive); a ``weakref.finalize`` on the storage takes
  the bytes off the moment its last reference dies, so ``current_bytes`` is exact between ops;
* ``held``: the rank's persistent state, which exists before the step (parameters, optimizer
  state, buffers) and counts from the start, each storage whole;
* ``inputs``: the rank's part of the batch, counted by its own elements (a microbatch is a slice of
  the global batch every process was handed; a rank on a GPU would hold only its slice);
* the peak is sampled after every op: its inputs and outputs are both alive then, the moment the
  liveness model calls "while node i runs" (``cost_models.memory.liveness``).

What a dispatch mode cannot see: scratch memory a kernel allocates and frees inside one op, and
tensors that exist but are neither declared nor touched during the step (say, a copy of the weights
some other object keeps). The approach is that of PyTorch's
``torch/distributed/_tools/mem_tracker.py`` (weak references to untyped storages from a dispatch mode).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from ..collectives import gloo_all_gather_into_tensor

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


class MemoryTracker(TorchDispatchMode):
    """Live tensor-storage bytes while the mode is active, and their peak (see the module docstring).

    ``peak_bytes``: the most bytes alive at once; ``held_bytes``: what ``held`` and ``inputs`` counted at the
    start; ``current_bytes``: alive now. After the mode exits the figures stay as they were at the exit.
    """

    def __init__(self, held=(), inputs=()):
        super().__init__()
        self._live: dict = {}            # storage key -> (bytes, weakref.finalize)
        self.current_bytes = 0
        self.peak_bytes = 0
        self.ops = 0
        for t in tree_leaves(list(held)):
            if isinstance(t, torch.Tensor):
                self.record(t)
        sliced: dict = {}
        for t in tree_leaves(list(inputs)):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                got = sliced.setdefault(st._cdata, [t, 0])
                got[1] = min(got[1] + t.numel() * t.element_size(), st.nbytes())
        for t, nbytes in sliced.values():
            self.record(t, nbytes)
        self.held_bytes = self.current_bytes

    def record(self, t: torch.Tensor, nbytes: int | None = None) -> None:
        """Count ``t``'s storage (``nbytes``, default its whole size) until its last reference dies; a storage
        already counted is left as it is. A wrapper subclass (a DTensor) counts the tensors it wraps."""
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self.record(inner)
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live:
            return
        nbytes = int(st.nbytes()) if nbytes is None else int(nbytes)
        self._live[key] = (nbytes, weakref.finalize(st, self._free, key))
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _free(self, key) -> None:
        nbytes, _ = self._live.pop(key)
        self.current_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.record(t)
        self.ops += 1
        return out

    def __exit__(self, *exc):
        for _, fin in self._live.values():      # the figures stop here; storages outlive the tracker
            fin.detach()
        self._live.clear()
        return super().__exit__(*exc)
