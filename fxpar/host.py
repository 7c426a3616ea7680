"""This process on its host: the scheduling of the communication threads torch.distributed starts, and what
the C allocator does with memory a step frees.

Both sides use them: ``fxpar.tools.calibrate`` measures with them, and fxpar's runtime applies them
(``ClusterSpec.comm_priority``, ``ClusterSpec.host_memory_reuse``)."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

__all__ = ["COMM_THREAD_NAMES", "HostSettings", "raise_comm_threads", "reuse_freed_memory"]


@dataclass(frozen=True)
class HostSettings:
    """The ClusterSpec's settings every rank's process applies to itself (workers and a feature's extra ranks)."""
    comm_priority: bool = False          # ClusterSpec.comm_priority: raise the gloo threads (:func:`raise_comm_threads`)
    host_memory_reuse: bool = True       # ClusterSpec.host_memory_reuse: :func:`reuse_freed_memory` before the first step


# gloo's threads: its TCP transport's event loop (one per device) and ProcessGroupGloo's workers (2 per group)
COMM_THREAD_NAMES = ("gloo_tcp_loop", "pt_gloo_runloop")


def raise_comm_threads(priority: int = 1) -> int | None:
    """Put this process's gloo communication threads (:data:`COMM_THREAD_NAMES`, as Linux names them) under
    ``SCHED_FIFO`` at ``priority``, so that a message's arrival preempts the rank's compute (or another rank's)
    at once instead of waiting for the running thread's time slice: where ranks and their threads outnumber the
    cores, that wait is what a small collective costs (``ClusterSpec.comm_priority``). Call it after the
    process groups exist and have run a collective (each group starts threads of its own, which name themselves
    when they start); threads already raised are left alone. Returns how many it raised now, or None where the
    OS does not allow it (not Linux, or neither root nor ``CAP_SYS_NICE``). The threads block between messages,
    so they take the CPU only for the work they do -- but only when *all* of them are raised: gloo's threads
    yield to each other while they wait for one another, and a raised thread that waits on one left at normal
    priority spins at real-time priority until the kernel's RT throttling (50 ms a second) lets the other run."""
    task = "/proc/self/task"
    if not hasattr(os, "sched_setscheduler") or not os.path.isdir(task):
        return None
    n = 0
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/comm") as f:
                name = f.read().strip()
            if name not in COMM_THREAD_NAMES or os.sched_getscheduler(int(tid)) == os.SCHED_FIFO:
                continue
            os.sched_setscheduler(int(tid), os.SCHED_FIFO, os.sched_param(priority))
        except PermissionError:
            return None
        except (OSError, ValueError):          # a thread that ended while we looked
            continue
        n += 1
    return n


# glibc's mallopt(3) parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_REUSE_BYTES = 1 << 30        # blocks up to 1 GiB from the heap; glibc builds that cap M_MMAP_THRESHOLD get 32 MiB


@functools.lru_cache(maxsize=None)
def _glibc_mallopt():
    """glibc's ``mallopt``, or None where the C library is another (found once: ``find_library`` runs ldconfig)."""
    import ctypes
    import ctypes.util
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    if not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):      # glibc's thresholds; musl has other rules
        return None
    return mallopt


def reuse_freed_memory(limit: int = _REUSE_BYTES) -> bool:
    """Keep the memory a training step frees for the next step (``ClusterSpec.host_memory_reuse``).

    torch's CPU tensors come from the C library's ``malloc``. glibc serves a large block (above its mmap threshold,
    at most 32 MiB by its own adjustment) with a fresh ``mmap``, and gives the top of its heap back to the OS once
    more than its trim threshold (twice that) is free. A step that frees a few buffers of tens of MiB -- a large
    embedding's dense gradient, its bucket, the optimizer's temporary -- can then take their pages again as page
    faults in every next step (how often depends on the heap's history): on this project's 2-core machine a [200000, 32] table's step (three such
    buffers) took 45 ms with glibc's defaults and 33 ms with this (torch DDP, which frees one, 29 ms). This sets both
    thresholds to ``limit`` (``mallopt(M_MMAP_THRESHOLD)``, ``mallopt(M_TRIM_THRESHOLD)``): blocks up to ``limit``
    come from the heap and the heap is not trimmed, so the process keeps its peak of freed memory (as CUDA's
    caching allocator does) instead of faulting it in again. Process-wide; call it before the step's first
    allocation. Returns False where the C library is not glibc (nothing is changed)."""
    import ctypes
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    limit = int(min(limit, 2**31 - 1))
    if not mallopt(_M_MMAP_THRESHOLD, limit) and not mallopt(_M_MMAP_THRESHOLD, min(limit, 32 << 20)):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, limit))
