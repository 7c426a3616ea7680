"""Finalists estimated side by side: forked processes return the figures of the finalists past the first (a probe's
two cut builds, or a whole build's estimate) while this process builds the first one.

A forked process starts as a copy of this one (the model, the search, the shared captures made so far), so what it
builds is what this process would build; only the figures come back (plain numbers, through a pipe), never a
program. :func:`fxpar.auto.search.choose` then takes its decisions in the same order, with the same rules, as it
does without workers, reading a finalist's figures from its worker instead of computing them; a finalist whose
figures came from a worker and that is chosen is built here, so the program returned is this process's build::

    pool = Forked(2)
    pool.submit("tp", lambda: [probe(c) for c in tp_finalists])    # runs in a forked copy of this process
    pool.start()
    prog = build(first)                                              # meanwhile, here
    figures = pool.result("tp")        # ("ok", value) | ("error", "TypeName: message") | None (the process died)
    pool.close()

Where ``fork`` is not a start method (Windows; macOS defaults away from it), on one CPU, inside a daemonic process
(which may not have children), or once this process has initialised CUDA (a forked child cannot use it), there are no
workers and every finalist is estimated here. A worker's error is not taken as the finalist's: the finalist is
estimated here again, so a failure of the fork itself cannot change the pick.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import time
from multiprocessing.connection import wait

import torch

__all__ = ["worker_count", "Forked"]


def worker_count(asked: int | None) -> int:
    """How many worker processes to use: ``asked`` (``Strategy.auto(workers=...)``), or for None one per CPU this
    process may run on, none while those CPUs are busy (a load average over the last minute of at least their
    number: a worker then runs beside other work and adds the CPU of its copied pages, it saves no time); 0 where
    workers cannot be forked here."""
    if asked == 0 or "fork" not in multiprocessing.get_all_start_methods() or multiprocessing.current_process().daemon:
        return 0
    if torch.cuda.is_initialized():         # a forked child cannot use CUDA again: its builds would fail there
        return 0
    if asked is not None:
        return asked
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus if cpus > 1 and _load() < cpus else 0


def _load() -> float:
    """The machine's load average over the last minute (0 where the OS does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def _child(conn, fn) -> None:
    try:
        out = ("ok", fn())
    except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
        out = ("error", f"{type(e).__name__}: {e}")
    try:
        conn.send(out)
    finally:
        conn.close()


class Forked:
    """Tasks run in forked processes, at most ``n`` at once, in the order submitted."""

    def __init__(self, n: int):
        self.n = max(1, n)
        self.ctx = multiprocessing.get_context("fork")
        self.queued: list = []          # (key, fn) not started
        self.running: dict = {}         # connection -> (key, process)
        self.done: dict = {}            # key -> result
        self.started = 0

    def submit(self, key, fn) -> None:
        self.queued.append((key, fn))

    def start(self) -> None:
        """Start queued tasks while fewer than ``n`` run."""
        while self.queued and len(self.running) < self.n:
            key, fn = self.queued.pop(0)
            recv, send = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(target=_child, args=(send, fn), daemon=True)
            # the objects made so far go to the collector's permanent generation for the fork (Python's gc.freeze
            # docs): the child's collections do not walk them and copy every page they lie on (about 0.4 s of CPU
            # a worker on GPT-2 small); the parent collects them again after
            gc.freeze()
            try:
                proc.start()
            finally:
                gc.unfreeze()
            send.close()
            self.running[recv] = (key, proc)
            self.started += 1

    def result(self, key, timeout_s: float | None = None):
        """The task ``key``'s result: ``("ok", value)``, ``("error", text)``, or None if its process ended without
        one, or gave none within ``timeout_s`` seconds of this call (it is ended then: a forked copy of a process
        whose threads held a lock can hang; the caller computes the task itself)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while key not in self.done:
            if not self.running:
                self.start()
                if not self.running:
                    raise KeyError(key)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(self.running), left)
            if not ready and deadline is not None and time.monotonic() >= deadline:
                for conn, (k, proc) in list(self.running.items()):
                    if k == key:
                        proc.terminate()
                        proc.join()
                        conn.close()
                        del self.running[conn]
                self.done[key] = None
                break
            for conn in ready:
                k, proc = self.running.pop(conn)
                try:
                    self.done[k] = conn.recv()
                except (EOFError, OSError):
                    self.done[k] = None
                conn.close()
                proc.join()
            self.start()
        return self.done[key]

    def close(self) -> None:
        """End what still runs (a result no longer needed) and forget the queue."""
        self.queued.clear()
        for conn, (_, proc) in list(self.running.items()):
            proc.terminate()
            proc.join()
            conn.close()
        self.running.clear()
