"""Local launch: N worker processes on this machine, a gloo group on 127.0.0.1.

A :class:`LocalCluster` keeps its workers (and their process group) alive between runs, so
several programs can run on one group without paying process start-up again::

    with fxpar.LocalCluster(4) as lc:
        program_a.run_local(batches, cluster=lc)
        program_b.run_local(batches, cluster=lc)

If any rank raises or dies (killed, out of memory), every worker is stopped within ``grace_s`` seconds and
the caller gets :class:`~fxpar.errors.RankFailedError` naming that rank, the step it was in (each rank notes
its step in memory the parent reads, :func:`note_step`) and its traceback: a failure never hangs. A rank
that died is named before the ranks whose collectives failed because of it. A run that does not finish in
``timeout_s`` stops the same way and names the ranks still busy.
"""
from __future__ import annotations

import ast
import atexit
import gc
import os
import pickle
import signal
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing import connection

import torch.multiprocessing as mp

from ..errors import ClusterSpecError, InputError, RankFailedError

__all__ = ["LocalCluster", "find_free_port", "init_from_env", "shutdown_env_group", "serve", "send", "check_main_guard",
           "check_local_capacity", "note_step", "RANK_BASE_BYTES"]

# Memory of one spawned rank before any model state: the interpreter, torch and a gloo group. Measured
# here as the rise of the machine's used memory per rank (PSS of a rank: about 190 MB; 64 ranks took
# 14.5 GB, 226 MB each); rounded up.
RANK_BASE_BYTES = 240 * 2**20


# Where each rank of a LocalCluster is, in memory shared with the parent (one slot per rank): set in a rank
# by _worker; None in a process LocalCluster did not start (torchrun, the parent itself).
_PROGRESS = None
# slot values besides a step index: between runs; after the last step; before the first; an asynchronous window
_IDLE, _AFTER, _BEFORE, _WINDOW = -1, -2, -3, -4


def note_step(step: int | str) -> None:
    """Note in the parent-visible slot of this rank that it runs step ``step`` (0-based, the index of the global
    batch), or ``"before"`` its first step (building its executor, loading a checkpoint), ``"after"`` its last
    (saving, gathering state) or ``"window"`` (an asynchronous schedule's one window over every batch). The parent names it when the rank fails or dies. One store; nothing in a process
    a LocalCluster did not start."""
    if _PROGRESS is not None:
        slots, rank = _PROGRESS
        slots[rank] = {"before": _BEFORE, "after": _AFTER, "window": _WINDOW}.get(step, step)


def _where(value: int) -> str:
    if value >= 0:
        return f" at step {value} (batches[{value}])"
    return {_AFTER: " after its last step", _BEFORE: " before its first step",
            _WINDOW: " in its asynchronous window over every batch"}.get(value, "")


def _exit_text(code) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _guard_blocks(source: str) -> list:
    """(first, last) line of every top-level ``if __name__ == "__main__":`` block."""
    out = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.ops) != 1:
            continue
        sides = [node.test.left, node.test.comparators[0]]
        names = [x.id for x in sides if isinstance(x, ast.Name)]
        consts = [x.value for x in sides if isinstance(x, ast.Constant)]
        if names == ["__name__"] and consts == ["__main__"] and isinstance(node.test.ops[0], ast.Eq):
            out.append((node.lineno, node.end_lineno))
    return out


def check_main_guard(what: str) -> None:
    """Refuse, before any process starts, a call from a script's top level outside ``if __name__ ==
    "__main__":``. Worker processes start in fresh interpreters (:func:`start_context`), which re-import the
    script in every rank: unguarded, each rank would run the script again and die while starting (Python's hint about it
    lands in the ranks' stderr; the caller would see only "rank 0 closed its pipe")."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None:              # interactive, -c, notebooks: nothing is re-imported
        return
    if not os.path.exists(path):
        raise InputError(f"{what} starts its ranks as new processes, which re-import your script in every "
                         f"rank, but the script comes from {path!r}, which a new process cannot read again. Save it to "
                         "a file and run `python your_script.py`, with the training code under "
                         "`if __name__ == \"__main__\":`.")
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:                              # not called while the script's top level runs
        return
    try:
        with open(path) as f:
            blocks = _guard_blocks(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    line = frame.f_lineno
    if any(a <= line <= b for a, b in blocks):
        return
    raise InputError(
        f"{what} is called at line {line} of {path}, at the script's top level outside "
        "`if __name__ == \"__main__\":`. fxpar starts its ranks as new processes, which re-import the script "
        "in every rank, so each rank would run that line again instead of training. Put the code that trains "
        f"(from line {line}) under `if __name__ == \"__main__\":` (e.g. in a main() called from there); keep "
        "imports, classes and functions at the top level.")


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_local_capacity(world_size: int, state_bytes: int = 0, what: str | None = None) -> None:
    """Before spawning ``world_size`` ranks here: refuse if their estimated memory (``RANK_BASE_BYTES`` for
    the interpreter, torch and gloo, plus ``state_bytes`` of model and optimizer state per rank) exceeds the
    memory this machine has available; warn when the ranks outnumber the CPU cores."""
    what = what or f"fxpar.LocalCluster({world_size})"
    per_rank = RANK_BASE_BYTES + int(state_bytes)
    avail = _available_memory_bytes()
    if avail is not None and world_size * per_rank > 0.9 * avail:
        fit = max(1, int(0.9 * avail // per_rank))
        raise ClusterSpecError(
            f"{what}: {world_size} local ranks need about {world_size * per_rank / 2**30:.1f} GiB here (each "
            f"~{RANK_BASE_BYTES / 2**20:.0f} MiB for Python, torch and gloo + {state_bytes / 2**20:.1f} MiB of model "
            f"and optimizer state), but this machine has {avail / 2**30:.1f} GiB available. Use at most {fit} ranks "
            f"(ClusterSpec.local({fit}) with a Strategy of that size), free memory, or run under torchrun on "
            "several machines.")
    cores = os.cpu_count() or 1
    if world_size > 2 * cores:
        warnings.warn(
            f"{what}: {world_size} ranks share {cores} CPU core(s) here; every rank imports torch (about a second "
            f"of CPU each) and steps run {world_size / cores:.0f}x oversubscribed, so starting alone may take "
            f"~{world_size * 1.5 / cores:.0f} s. Use fewer ranks to try a plan (program.explain() and "
            "program.estimate() need none), or a machine with more cores.", UserWarning, stacklevel=3)


def find_free_port() -> int:
    """A TCP port the OS says is free now (bound to port 0 on 127.0.0.1, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(backend: str = "gloo", timeout_s: float = 300.0) -> None:
    """The torchrun path: ``env://`` rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
        # A process that leaves with its group alive can abort in the C++ destructor
        # ("terminate called without an active exception") while a peer is still talking to it:
        # meet the others, then tear the group down, before the interpreter exits.
        atexit.register(shutdown_env_group)


def shutdown_env_group(wait_s: float = 60.0) -> None:
    """Meet the other ranks (at most ``wait_s`` seconds), then destroy the default group. Idempotent.

    A process leaving because of an unhandled exception does not wait: it must exit at once, so
    that the launcher sees the failure and stops the other ranks."""
    import sys
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    failing = getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
    try:
        if not failing:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=wait_s))
            else:
                dist.barrier()
    except Exception:  # noqa: BLE001 - a peer that is gone: leave anyway
        pass
    finally:
        dist.destroy_process_group()


def send(conn, obj) -> None:
    """Send ``obj`` over a rank's pipe as one plain pickle: tensors travel by value inside it. (``conn.send`` would
    move each tensor's storage to shared memory and pass a file descriptor per storage, each over a connection of its
    own with an authentication handshake: milliseconds per tensor, and the sender's tensors left in shared memory,
    where a rank's in-place update would reach them.) The other side reads it with ``pickle.loads(conn.recv_bytes())``,
    which also reads what ``conn.send`` sent."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def serve(conn) -> None:
    """A rank's loop once its process group is up: run each ``(fn, args)`` the parent sends, answer
    ``("ok", result)`` or ``("err", traceback)``; ``None`` or a closed pipe ends it and leaves the group.
    Used by :class:`LocalCluster` and by other spawners (``benchmarks/netns_link.py``)."""
    import torch.distributed as dist
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        except BaseException:  # noqa: BLE001 - a payload that does not unpickle here
            send(conn, ("err", "while receiving the work for this rank:\n" + traceback.format_exc()))
            continue
        if msg is None:
            break
        fn, args = msg
        try:
            send(conn, ("ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - reported to the parent, which stops everyone
            send(conn, ("err", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


# What a rank imports before it can take work: loaded once in the forkserver, so each rank is a fork of a process
# that has them (about a second of CPU a rank instead of the seconds an import of torch takes). torch._dynamo is
# there because every torch.optim optimizer's constructor imports it (torch._disable_dynamo): about a second of CPU
# in each rank's first optimizer otherwise, once per forkserver instead. The executor, the features, the compression
# and synchronisation methods and the passes are what unpickling a rank's payload imports (about 0.3-0.6 s of CPU a
# rank otherwise, more without bytecode caches).
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch._higher_order_ops.triton_kernel_wrap",
            "fxpar.runtime.launch", "fxpar.runtime.executor", "fxpar.features", "fxpar.compress", "fxpar.sync",
            "passes")


def start_context():
    """The multiprocessing context ranks start in: ``forkserver`` with torch and this module preloaded where the
    platform has it, else ``spawn``. Both run each rank in a process that did not inherit the caller's Python
    state: the script is re-imported as ``__mp_main__`` (hence :func:`check_main_guard`) and the rank gets the
    caller's environment as it is at the start (``_worker`` applies it; the forkserver's own is that of its first
    use)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def local_threads(world_size: int) -> int:
    """The CPU threads each of ``world_size`` ranks of a :class:`LocalCluster` runs with: this machine's cores shared."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _worker(rank: int, world: int, port: int, conn, backend: str, threads: int, timeout_s: float,
            progress=None, environ: dict | None = None) -> None:
    global _PROGRESS
    # what the rank inherits from the forkserver (torch, fxpar: about 300,000 objects) lives as long as the rank: out
    # of the collector's reach (an O(1) move to its permanent generation), a full collection no longer walks it and
    # copies every page it lies on (0.18 s and ~77 MB of copied pages each on this machine)
    gc.freeze()
    if environ is not None:                  # the caller's environment now, not the forkserver's at its start
        os.environ.clear()
        os.environ.update(environ)
    import torch.distributed as dist
    import torch._higher_order_ops.triton_kernel_wrap  # noqa: F401 - unpickling a GraphModule needs it loaded
    torch.set_num_threads(threads)
    if progress is not None:
        _PROGRESS = (progress, rank)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        conn.send(("ready", None))
    except Exception:  # noqa: BLE001 - reported to the parent
        conn.send(("err", traceback.format_exc()))
        return
    serve(conn)
    # The work is done and the group left: skip the interpreter's finalization, which for a process that has
    # imported torch takes seconds (a spawned process otherwise exits through sys.exit); the parent waits on it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class LocalCluster:
    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = 600.0, grace_s: float = 2.0):
        self.world_size = world_size
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.alive = False
        self.procs, self.conns = [], []
        if not isinstance(world_size, int) or world_size < 1:
            raise InputError(f"LocalCluster(world_size={world_size!r}): world_size must be a positive int, the "
                             "number of ranks to start on this machine.")
        check_main_guard(f"fxpar.LocalCluster({world_size})")
        check_local_capacity(world_size)
        ctx = start_context()
        port = find_free_port()
        threads = local_threads(world_size)
        self.conns, self.procs = [], []
        self.progress = ctx.Array("q", [_IDLE] * world_size, lock=False)     # each rank's step (note_step)
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world_size, port, child, backend, threads, timeout_s,
                                                  self.progress, dict(os.environ)),
                            daemon=True, name=f"fxpar-rank{r}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.alive = True
        self._collect(["ready"] * world_size, what="starting the process group")

    def run(self, fn, per_rank_args: list, timeout_s: float | None = None) -> list:
        """Call ``fn(*per_rank_args[r])`` on every rank r; return the results in rank order."""
        if not self.alive:
            raise RuntimeError("this LocalCluster was stopped after a failure; create a new one")
        self.progress[:] = [_IDLE] * self.world_size
        for conn, args in zip(self.conns, per_rank_args):
            send(conn, (fn, tuple(args)))
        return self._collect(None, what=getattr(fn, "__name__", "run"), timeout_s=timeout_s)

    def _collect(self, expect, what: str, timeout_s: float | None = None) -> list:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        results = [None] * self.world_size
        pending = set(range(self.world_size))
        by_conn = {c: r for r, c in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                where = {r: _where(self.progress[r]) for r in sorted(pending)}
                self.close(force=True)
                raise RankFailedError(min(pending), f"timed out after {timeout_s or self.timeout_s:.0f}s while "
                                      f"{what}; ranks still busy: {sorted(pending)} ("
                                      + ", ".join(f"rank {r}{w}" for r, w in where.items() if w)
                                      + ("; " if any(where.values()) else "")
                                      + "a deadlock, or a rank much slower than the others)")
            ready = connection.wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                                    timeout=left)
            for obj in ready:
                if obj in by_conn:
                    r = by_conn[obj]
                    if r not in pending:
                        continue
                    try:
                        kind, value = pickle.loads(obj.recv_bytes())
                    except EOFError:             # the pipe closes as the process dies: report the death
                        self._fail({r: None}, what)
                    if kind == "err":
                        self._fail({r: value}, what)
                    results[r] = value
                    pending.discard(r)
                elif obj in by_sentinel and by_sentinel[obj] in pending:
                    r = by_sentinel[obj]
                    if not self.conns[r].poll():
                        self._fail({r: None}, what)
        return results

    def _fail(self, failed: dict, what: str) -> None:
        """Stop everyone and raise for the rank that failed first. ``failed``: rank -> its traceback, or None for
        a rank that died without one. The others get a moment to report theirs; a rank that died is named
        before ranks that raised, whose collectives usually failed because a peer was gone."""
        where = {r: _where(self.progress[r]) for r in range(self.world_size)}
        deadline = time.monotonic() + min(self.grace_s, 0.5)
        while time.monotonic() < deadline:
            for r, p in enumerate(self.procs):
                if r in failed:
                    continue
                if self.conns[r].poll():
                    try:
                        kind, value = pickle.loads(self.conns[r].recv_bytes())
                    except (EOFError, OSError):
                        kind, value = "err", None
                    if kind == "err":
                        failed[r] = value
                elif p.exitcode is not None:
                    failed[r] = None
            if any(v is None for v in failed.values()):
                break
            time.sleep(0.02)
        for r in failed:
            if failed[r] is None:
                self.procs[r].join(timeout=1.0)
        codes = {r: self.procs[r].exitcode for r in failed}
        self.close(force=True)
        dead = sorted(r for r, v in failed.items() if v is None)
        root = dead[0] if dead else next(iter(failed))
        if failed[root] is None:
            text = (f"rank {root} {_exit_text(codes[root])}{where[root]} while {what}, without a traceback (a "
                    "signal such as SIGKILL from the OOM killer or a user, or os._exit); the other ranks were stopped.")
        else:
            text = f"rank {root} raised{where[root]} while {what}:\n{failed[root]}"
        others = [r for r in failed if r != root]
        if others:
            text += "\nAlso reported: " + "; ".join(
                f"rank {r}{where[r]}: " + (_exit_text(codes[r]) if failed[r] is None else
                                            (failed[r].strip().splitlines() or [""])[-1][:300]) for r in others)
        raise RankFailedError(root, text)

    def close(self, force: bool = False) -> None:
        if not self.procs:
            return
        if not force and self.alive:
            for c in self.conns:
                try:
                    c.send(None)
                except (OSError, BrokenPipeError):
                    pass
            self._join_all(self.grace_s)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        self._join_all(self.grace_s)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        self.alive = False
        self.procs, self.conns = [], []

    def _join_all(self, seconds: float) -> None:
        """Wait until every rank has exited, or ``seconds`` have passed (one deadline for all of them)."""
        deadline = time.monotonic() + seconds
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close(force=True)
        except Exception:  # noqa: BLE001
            pass
