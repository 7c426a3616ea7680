"""This process on its host: the scheduling of the communication threads torch.distributed starts.

Both sides use it: ``cost_models.calibrate`` measures with it, and fxpar's runtime applies it
(``ClusterSpec.comm_priority``)."""
from __future__ import annotations

import os

__all__ = ["COMM_THREAD_NAMES", "raise_comm_threads"]

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
