"""Measure peak live tensor bytes of real execution with a ``TorchDispatchMode``.

The reference the liveness model (:func:`cost_models.memory.liveness`) is checked against::

    with PeakMemoryTracker(initial=[*params, x]) as tr:
        gm(*params, x)
    tr.peak_bytes           # max over ops of the bytes of distinct storages alive

Every tensor an op returns is recorded by its storage (``untyped_storage()._cdata``, so views
share one entry) with a :class:`torch.multiprocessing.reductions.StorageWeakRef`; a storage
counts until its last reference dies. Storages that existed before the mode was entered count
only if passed as ``initial``. The approach is that of PyTorch's own
``torch/distributed/_tools/mem_tracker.py`` (weak references to untyped storages from a
dispatch mode), reduced to one number.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PeakMemoryTracker"]


class PeakMemoryTracker(TorchDispatchMode):
    """Peak bytes of distinct live tensor storages while the mode is active.

    ``peak_bytes`` is sampled after every op, with the op's inputs and outputs both alive, which
    is the moment the liveness model calls "while node i runs".
    """

    def __init__(self, initial=()):
        super().__init__()
        self._live: dict = {}          # storage cdata -> (StorageWeakRef, nbytes)
        self.peak_bytes = 0
        self.current_bytes = 0
        self.ops = 0
        for t in tree_leaves(list(initial)):
            if isinstance(t, torch.Tensor):
                self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key not in self._live:
            self._live[key] = (StorageWeakRef(st), st.nbytes())

    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            del self._live[k]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()                  # drop dead entries first: a new storage may reuse an address
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.ops += 1
        self.current_bytes = sum(nb for _, nb in self._live.values())
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out
