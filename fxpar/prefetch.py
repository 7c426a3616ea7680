"""``fxpar::prefetch``: ask the kernel to read a disk-resident tensor ahead of its use (ZeRO-Infinity).

ZeRO-Infinity (Rajbhandari et al., SC'21, §6.2 "overlap-centric design") keeps parameters and optimizer state
on NVMe and hides the read of the next layer's parameters behind the current layer's compute. In fxpar a
disk-resident tensor is a memory-mapped file (``fxpar.features.zero_offload``: ``offload_to="disk"``); without a
prefetch its pages come in on first touch, synchronously, inside the op that reads them. The pass
``passes.zero_offload`` inserts::

    ag = all_gather_into_tensor(_to_copy(w0_chunk), 2, 'fxpar:dp')     # layer 0's gather
    prefetch = fxpar.prefetch(w1_chunk)                                # layer 1's file, read ahead
    w0 = view(slice(wait_tensor(ag), ...)); mm = mm(x, t(w0))          # layer 0 computes meanwhile

The op returns nothing and changes nothing a graph can see (registered as side-effectful, so dead-code
elimination keeps it). At run time it finds the file backing its argument (the runtime registers each
offloaded tensor with :func:`track`) and calls ``posix_fadvise(fd, offset, length, POSIX_FADV_WILLNEED)``:
the kernel starts reading that range into the page cache and returns, so the later touch of the mapping is a
page-cache hit. A tensor not backed by a tracked file (an offload to ``"cpu"``, a test run without the
runtime) is left alone.
"""
from __future__ import annotations

import os

import torch

__all__ = ["prefetch", "track", "reset", "STATS", "ADVICE"]

_LIB = torch.library.Library("fxpar", "FRAGMENT")
_LIB.define("prefetch(Tensor x) -> ()")

# the advice given: WILLNEED where the platform has posix_fadvise (Linux), else nothing (reads stay on first touch)
ADVICE = getattr(os, "POSIX_FADV_WILLNEED", None)

_FILES: dict = {}     # data_ptr of a tracked tensor -> (file descriptor, bytes, path)
STATS = {"calls": 0, "advised": 0, "bytes": 0}      # this process, since the last reset()


def track(t: torch.Tensor, path: str) -> None:
    """Register ``t`` (a tensor memory-mapped from ``path``, offset 0) so a prefetch of it or a view of it can find
    its file."""
    fd = os.open(path, os.O_RDONLY)
    _FILES[t.data_ptr()] = (fd, t.numel() * t.element_size(), path)


def reset() -> None:
    """Forget every tracked file (closing them) and zero the counters: a new executor offloads afresh."""
    for fd, _, _ in _FILES.values():
        os.close(fd)
    _FILES.clear()
    STATS.update(calls=0, advised=0, bytes=0)


def _find(x: torch.Tensor):
    """``(fd, offset, length)`` of the file range holding ``x``'s elements, or None."""
    ptr = x.data_ptr()
    length = x.numel() * x.element_size()
    hit = _FILES.get(ptr)
    if hit is not None:
        return hit[0], 0, min(length, hit[1])
    for base, (fd, size, _) in _FILES.items():          # a view into a tracked tensor (a chunk of it)
        if base <= ptr < base + size:
            return fd, ptr - base, min(length, base + size - ptr)
    return None


def _prefetch(x: torch.Tensor) -> None:
    STATS["calls"] += 1
    where = _find(x) if ADVICE is not None else None
    if where is None:
        return
    fd, off, length = where
    os.posix_fadvise(fd, off, length, ADVICE)
    STATS["advised"] += 1
    STATS["bytes"] += length


_LIB.impl("prefetch", _prefetch, "CompositeExplicitAutograd")
torch.library.register_fake("fxpar::prefetch", lambda x: None, lib=_LIB)

prefetch = torch.ops.fxpar.prefetch.default
torch.fx.node.has_side_effect(prefetch)        # no output, yet not dead code
