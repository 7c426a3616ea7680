"""Measure the bytes of live tensor storages while code runs, with a ``TorchDispatchMode``: the measured side of
"peak memory" that the liveness model (:func:`cost_models.memory.liveness`) and ``Estimate.ranks[r].peak_memory_bytes``
are checked against, and what fxpar's runtime reports as a rank's measured peak (``run_local(measure_memory=True)``).
On CUDA the same figure is ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()`` (which also
counts the caching allocator's rounding to 512-byte blocks and kernels' workspaces); on CPU there is no allocator
statistic, so we count storages at the dispatcher::

    with MemoryTracker(held=[*params, *opt_state, *buffers], inputs=microbatches) as mem:
        step()
    mem.peak_bytes        # most bytes of distinct storages alive at once, state included

    with PeakMemoryTracker(initial=[*params, x]) as tr:      # the same, with what existed before named ``initial``
        gm(*params, x)
    tr.peak_bytes

* every tensor an op returns is recorded by its storage, once however many views share it, with
  its whole ``nbytes`` (a view keeps its base alive); a ``weakref.finalize`` on the storage takes
  the bytes off the moment its last reference dies, so ``current_bytes`` is exact between ops;
* ``held``: persistent state that exists before the code runs (parameters, optimizer state, buffers) and
  counts from the start, each storage whole; storages that existed before and are not named do not count;
* ``inputs``: the rank's part of the batch, counted by its own elements (a microbatch is a slice of
  the global batch every process was handed; a rank on a GPU would hold only its slice);
* the peak is sampled after every op: its inputs and outputs are both alive then, the moment the
  liveness model calls "while node i runs".

What a dispatch mode cannot see: scratch memory a kernel allocates and frees inside one op, and
tensors that exist but are neither declared nor touched while it runs (say, a copy of the weights
some other object keeps). The approach is that of PyTorch's
``torch/distributed/_tools/mem_tracker.py`` (weak references to untyped storages from a dispatch mode).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["MemoryTracker", "PeakMemoryTracker"]


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


class PeakMemoryTracker(MemoryTracker):
    """A :class:`MemoryTracker` whose storages alive at the start are ``initial`` (each whole): the reference a
    graph's liveness model is checked against. ``peak_bytes`` is sampled after every op, with the op's inputs and
    outputs both alive."""

    def __init__(self, initial=()):
        super().__init__(held=initial)
