"""A bandwidth-capped link between ranks on this one machine, for benchmarks.

The harness creates two network namespaces of its own (``fxcap<pid>a`` and ``fxcap<pid>b``), joins them with
a veth pair that carries loopback-range addresses (127.77.0.1 in A, 127.77.0.2 in B; ``route_localnet=1`` on
``all`` and the veth inside each namespace; each namespace's own ``lo`` up), and caps each direction with a
``tbf`` qdisc on the veth end that sends it. Every rank enters its namespace with ``setns()`` *before*
``init_process_group``; ranks ``r < N/2`` live in A, the others in B, and gloo talks over the veth
(``GLOO_SOCKET_IFNAME`` = the rank's veth, rendezvous at rank 0's veth address). So the ranks of A talk to
each other over A's own loopback, uncapped, and everything between A and B crosses the capped link: with 2
ranks (one per side) all of their traffic does.

    from netns_link import CappedLink, NetnsCluster
    with CappedLink() as link, NetnsCluster(2, link) as cl:
        link.set_rate("1gbit")                 # or "2gbit", "500mbit", None (uncapped veth)
        outs = cl.run(fn, [args_rank0, args_rank1])

    python benchmarks/netns_link.py --cleanup      # remove namespaces left by earlier runs that died

What it does not do:

- **No latency.** This kernel has no ``netem`` (sch_netem), so only a bandwidth cap is possible; the
  round-trip time stays that of a veth (tens of microseconds). A real cluster's link adds latency too.
- **Never the machine's own ``lo`` or any device of the default namespace.** Every ``ip``/``tc`` command
  it builds is ``ip netns add/del <its namespace>`` or names one of its namespaces with ``-n``
  (:func:`check_commands`). The veth pair is created directly inside the two namespaces.
- **Without root or without ``ip netns``** it says what is missing and runs *uncapped*: the ranks then
  use 127.0.0.1 in the default namespace, and :attr:`CappedLink.active` is False (benchmarks print it).

Clean-up: :meth:`CappedLink.down` runs from ``with`` / ``try``-``finally``, from ``atexit`` and from a
SIGTERM/SIGHUP handler (which turns the signal into ``SystemExit`` so ``finally`` blocks run). The
:class:`NetnsCluster` stops its ranks first (a failing rank's traceback is raised in the parent), so a
namespace never outlives its run; ``--cleanup`` removes those of earlier runs whose process is gone.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta

__all__ = ["CappedLink", "NetnsCluster", "LinkNames", "make_names", "parse_rate", "format_rate",
           "setup_commands", "rate_commands", "teardown_commands", "check_commands", "leftover_namespaces",
           "preflight", "cleanup_leftovers", "enter_namespace", "tbf_burst_bytes", "calibrate_link", "at_cap"]

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"
PREFIX = "fxcap"                      # namespaces: fxcap<pid>a / fxcap<pid>b; veths: fxc<pid>a / fxc<pid>b
ADDR_A, ADDR_B, PREFIX_LEN = "127.77.0.1", "127.77.0.2", 30
TBF_LATENCY = "50ms"                  # the most a packet may wait in the tbf queue before it is dropped

_NAME_RE = re.compile(rf"^{PREFIX}(\d+)[ab]$")


# ---- pure functions: names, rates, the commands (tested without root) ----------------------------------
@dataclass(frozen=True)
class LinkNames:
    ns_a: str
    ns_b: str
    dev_a: str
    dev_b: str
    addr_a: str = ADDR_A
    addr_b: str = ADDR_B

    @property
    def namespaces(self) -> tuple:
        return (self.ns_a, self.ns_b)


def make_names(pid: int | None = None) -> LinkNames:
    """Names unique to one run (the parent's PID); device names stay within Linux's 15 characters."""
    pid = os.getpid() if pid is None else int(pid)
    if pid < 0 or pid > 10**10:
        raise ValueError(f"pid {pid} out of range")
    return LinkNames(f"{PREFIX}{pid}a", f"{PREFIX}{pid}b", f"fxc{pid}a", f"fxc{pid}b")


_UNITS = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_rate(rate) -> int | None:
    """Bits per second, or None for no cap. Accepts None, "none", "uncapped", 0, an int (bit/s), or
    "<number><unit>" with unit bit, kbit, mbit, gbit (k/m/g for short), e.g. "2gbit", "500mbit", "1.5g"."""
    if rate is None:
        return None
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        if rate < 0:
            raise ValueError(f"negative rate {rate}")
        return int(rate) or None
    s = str(rate).strip().lower()
    if s in ("", "none", "uncapped", "nocap", "no", "0"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", s)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot read rate {rate!r}: use e.g. '2gbit', '500mbit', '1g', or None for no cap")
    bps = int(float(m.group(1)) * _UNITS[m.group(2)])
    if bps <= 0:
        return None
    return bps


def format_rate(bps: int | None) -> str:
    if bps is None:
        return "none"
    for unit, f in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps % f == 0:
            return f"{bps // f}{unit}"
    return f"{bps}bit"


def tbf_burst_bytes(bps: int) -> int:
    """tbf's bucket: 1 ms of traffic at the rate, at least 64 KiB (one GSO super-packet from the veth). A message up
    to the bucket's size leaves an idle link at the veth's own speed, so the bucket is as small as keeps the rate:
    with 1 ms the veth measures 1.92 / 0.94 / 0.47 Gbit/s at 2 / 1 / 0.5 Gbit/s (1.94 / 0.96 / 0.48 with a 4 ms
    bucket, which lets Parallax's 0.4 MiB of pairs per step cross at 500 Mbit/s in 2 ms instead of 7;
    with 64 KiB at every rate, 1.46 / 0.71 Gbit/s at 2 / 1)."""
    return max(bps // 8 // 1000, 64 * 1024)


def setup_commands(n: LinkNames) -> list:
    """The commands that build the link (none of them names a device of the default namespace)."""
    cmds = [["ip", "netns", "add", n.ns_a], ["ip", "netns", "add", n.ns_b],
            # the pair is created with each end already inside its namespace
            ["ip", "link", "add", n.dev_a, "netns", n.ns_a, "type", "veth", "peer", "name", n.dev_b,
             "netns", n.ns_b]]
    for ns, dev, addr in ((n.ns_a, n.dev_a, n.addr_a), (n.ns_b, n.dev_b, n.addr_b)):
        cmds += [["ip", "-n", ns, "link", "set", "lo", "up"],
                 ["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=1",
                  f"net.ipv4.conf.{dev}.route_localnet=1"],
                 ["ip", "-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", dev],
                 ["ip", "-n", ns, "link", "set", dev, "up"]]
    return cmds


def rate_commands(n: LinkNames, rate) -> list:
    """Commands that set both directions to ``rate`` (a tbf root qdisc on each veth end), or, for no cap,
    remove those qdiscs (``del`` of an absent qdisc fails harmlessly; :meth:`CappedLink.set_rate` ignores it)."""
    bps = parse_rate(rate)
    out = []
    for ns, dev in ((n.ns_a, n.dev_a), (n.ns_b, n.dev_b)):
        if bps is None:
            out.append(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])
        else:
            out.append(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", format_rate(bps),
                        "burst", str(tbf_burst_bytes(bps)), "latency", TBF_LATENCY])
    return out


def teardown_commands(n: LinkNames) -> list:
    """Deleting a namespace deletes its veth end, and with it the pair and the qdiscs."""
    return [["ip", "netns", "del", n.ns_a], ["ip", "netns", "del", n.ns_b]]


def check_commands(cmds: list, n: LinkNames) -> None:
    """Refuse any command that could touch the default namespace: every ``ip``/``tc`` command must be
    ``ip netns add|del|exec`` of one of this link's namespaces, ``ip -n <ns>``/``tc -n <ns>``, or the
    ``ip link add`` that creates the pair with both ends placed inside the namespaces."""
    ours = set(n.namespaces)
    for c in cmds:
        ok = False
        if c[:2] == ["ip", "netns"] and len(c) >= 4 and c[2] in ("add", "del", "exec") and c[3] in ours:
            ok = True
        elif c[0] in ("ip", "tc") and len(c) >= 3 and c[1] == "-n" and c[2] in ours:
            ok = True
        elif (c[:3] == ["ip", "link", "add"] and c[3] == n.dev_a and c[4:6] == ["netns", n.ns_a]
              and "peer" in c and c[-2:] == ["netns", n.ns_b]):
            ok = True
        if not ok:
            raise RuntimeError(f"netns_link: refusing a command outside this link's namespaces: {' '.join(c)}")


def leftover_namespaces(netns_list: str, alive=None) -> list:
    """Namespaces of earlier runs in ``ip netns list`` output whose creating process is gone
    (``alive(pid) -> bool``; default: the PID exists). Never this process's own."""
    alive = alive or _pid_alive
    out = []
    for line in netns_list.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) != os.getpid() and not alive(int(m.group(1))):
            out.append(name)
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- running the commands -------------------------------------------------------------------------------
def preflight() -> str | None:
    """None when a capped link can be built here, else what is missing (in words)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces, veth and tc need CAP_NET_ADMIN; run as root)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the '{tool}' command (iproute2)")
    if not missing:
        try:
            r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
            if r.returncode != 0:
                missing.append(f"a working 'ip netns' ({r.stderr.strip() or 'exit ' + str(r.returncode)})")
        except (OSError, subprocess.TimeoutExpired) as e:
            missing.append(f"a working 'ip netns' ({e})")
    if not hasattr(os, "setns"):
        try:
            ctypes.CDLL(None, use_errno=True).setns
        except AttributeError:
            missing.append("setns() (neither os.setns nor libc's)")
    return "; ".join(missing) or None


def _run(cmd: list, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"netns_link: `{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def cleanup_leftovers(verbose: bool = True) -> list:
    """Remove namespaces that earlier runs of this harness left (their process is gone)."""
    r = _run(["ip", "netns", "list"], check=False)
    names = leftover_namespaces(r.stdout)
    for name in names:
        m = _NAME_RE.match(name)
        cmd = ["ip", "netns", "del", name]
        check_commands([cmd], LinkNames(f"{PREFIX}{m.group(1)}a", f"{PREFIX}{m.group(1)}b", "", ""))
        _run(cmd, check=False)
        if verbose:
            print(f"netns_link: removed leftover namespace {name}")
    if verbose and not names:
        print("netns_link: no leftovers")
    return names


def enter_namespace(ns: str) -> None:
    """Move the calling thread (call it first, in a rank's main thread) into namespace ``ns``."""
    fd = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
    try:
        if hasattr(os, "setns"):                       # Python >= 3.12
            os.setns(fd, CLONE_NEWNET)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"setns({ns}): {os.strerror(e)}")
    finally:
        os.close(fd)


_LIVE: list = []                 # links up in this process, for atexit and the signal handler


def _cleanup_all() -> None:
    for link in list(_LIVE):
        link.down()


def _on_signal(signum, frame):
    _cleanup_all()
    raise SystemExit(128 + signum)


class CappedLink:
    """Two namespaces joined by a veth pair, each direction capped by tbf. ``active`` is False (and every
    method a no-op) where :func:`preflight` finds something missing; the reason is in ``missing``."""

    def __init__(self, rate=None, pid: int | None = None, verbose: bool = True):
        self.names = make_names(pid)
        self.verbose = verbose
        self.missing = preflight()
        self.active = False
        self.rate = None
        self._initial = rate

    # the addresses a rank uses
    def addr(self, side: str) -> str:
        if not self.active:
            return "127.0.0.1"
        return self.names.addr_a if side == "a" else self.names.addr_b

    def up(self) -> "CappedLink":
        if self.active:
            return self
        if self.missing:
            msg = f"netns_link: no capped link, running UNCAPPED on 127.0.0.1: missing {self.missing}"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            if self.verbose:
                print(msg, file=sys.stderr)
            return self
        cmds = setup_commands(self.names)
        check_commands(cmds, self.names)
        _LIVE.append(self)
        if len(_LIVE) == 1:
            atexit.register(_cleanup_all)
            for sig in (signal.SIGTERM, signal.SIGHUP):
                try:
                    if signal.getsignal(sig) in (signal.SIG_DFL, None):
                        signal.signal(sig, _on_signal)
                except ValueError:                     # not the main thread
                    pass
        self.active = True
        try:
            for c in cmds:
                _run(c)
            if self._initial is not None:
                self.set_rate(self._initial)
        except BaseException:
            self.down()
            raise
        return self

    def set_rate(self, rate) -> None:
        """Cap both directions at ``rate`` ("2gbit", "500mbit", bits/s, or None: no cap)."""
        bps = parse_rate(rate)
        if not self.active:
            self.rate = bps
            return
        cmds = rate_commands(self.names, bps)
        check_commands(cmds, self.names)
        for c in cmds:
            _run(c, check=bps is not None)
        self.rate = bps

    def qdiscs(self) -> str:
        """``tc qdisc show`` of both veth ends (what is in force now)."""
        if not self.active:
            return ""
        return "".join(_run(["tc", "-n", ns, "qdisc", "show", "dev", dev], check=False).stdout
                       for ns, dev in ((self.names.ns_a, self.names.dev_a), (self.names.ns_b, self.names.dev_b)))

    def down(self) -> None:
        """Remove both namespaces (and with them the veth pair and its qdiscs). Idempotent."""
        if self in _LIVE:
            _LIVE.remove(self)
        if not self.active:
            return
        self.active = False
        cmds = teardown_commands(self.names)
        check_commands(cmds, self.names)
        for c in cmds:
            _run(c, check=False)

    def exists(self) -> bool:
        return any(os.path.exists(os.path.join(NETNS_DIR, ns)) for ns in self.names.namespaces)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()
        return False


# ---- ranks in the namespaces ----------------------------------------------------------------------------
def _worker(rank: int, world: int, ns: str | None, ifname: str | None, master: str, port: int, conn,
            threads: int, timeout_s: float, pin: bool = False, comm_priority: bool = False) -> None:
    try:
        if pin:                                          # its own cores (fxpar.tools.calibrate.rank_cores)
            from fxpar.tools.calibrate import pin_rank
            pin_rank(rank, world)
        if ns is not None:
            enter_namespace(ns)                          # before any socket exists
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        import torch
        import torch.distributed as dist
        import torch._higher_order_ops.triton_kernel_wrap  # noqa: F401 - unpickling a GraphModule needs it
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        if comm_priority:                                # every rank's, torch DDP's too (the world group's threads)
            from fxpar.host import raise_comm_threads
            dist.barrier()                               # its threads up and named
            if raise_comm_threads() is None:
                raise RuntimeError("NetnsCluster(comm_priority=True): this process may not put gloo's threads under "
                                   "SCHED_FIFO (needs root or CAP_SYS_NICE)")
        from fxpar.runtime.launch import serve
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("err", traceback.format_exc()))
        return
    serve(conn)                                      # fxpar's rank loop: run what the parent sends


class NetnsCluster:
    """``world`` gloo ranks, the first half in namespace A and the rest in B of ``link`` (or all on 127.0.0.1
    of the default namespace when the link is not active). ``run(fn, per_rank_args)`` calls ``fn(*args)`` on
    every rank and returns the results in rank order; a rank that raises or dies stops every rank and
    raises RuntimeError with its traceback. ``pin``: each rank pinned to its own cores
    (``fxpar.tools.calibrate.rank_cores``; on 2 cores an unpinned step of a few ms moves by 2x from run to run,
    a pinned one by 5%), torch DDP's ranks and fxpar's alike; plan such runs on ``ClusterSpec.calibrate(pin=True)``.
    ``comm_priority``: every rank's gloo threads under SCHED_FIFO (``fxpar.host.raise_comm_threads``),
    torch DDP's and fxpar's alike (fxpar's later groups: ``ClusterSpec(comm_priority=True)``)."""

    def __init__(self, world: int, link: CappedLink, timeout_s: float = 600.0, threads: int | None = None,
                 pin: bool = False, comm_priority: bool = False):
        import torch.multiprocessing as mp
        if world < 2:
            raise ValueError("a capped link needs at least 2 ranks (one on each side)")
        self.world, self.link, self.timeout_s = world, link, timeout_s
        threads = threads or max(1, (os.cpu_count() or 1) // world)
        if link.active:
            port = 29500 + os.getpid() % 20000          # fresh namespaces: nothing else listens there
        else:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        master = link.addr("a")
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        try:
            for r in range(world):
                side = "a" if r < world // 2 else "b"
                ns = (link.names.ns_a if side == "a" else link.names.ns_b) if link.active else None
                dev = (link.names.dev_a if side == "a" else link.names.dev_b) if link.active else None
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker, args=(r, world, ns, dev, master, port, child, threads, timeout_s, pin,
                                                           comm_priority),
                                daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self._collect("starting the ranks", timeout_s=120.0)
        except BaseException:
            self.close()
            raise

    def _collect(self, what: str, timeout_s: float | None = None) -> list:
        from multiprocessing import connection
        import time
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        out = [None] * self.world
        left = set(range(self.world))
        while left:
            ready = connection.wait([self.conns[r] for r in left], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close()
                raise RuntimeError(f"netns_link: ranks {sorted(left)} did not finish {what} in time")
            for c in ready:
                r = self.conns.index(c)
                try:
                    kind, val = c.recv()
                except (EOFError, OSError):
                    self.procs[r].join(timeout=5)
                    code = self.procs[r].exitcode          # before close(), which forgets the processes
                    self.close()
                    raise RuntimeError(f"netns_link: rank {r} died while {what} (exit code {code})") from None
                if kind == "err":
                    self.close()
                    raise RuntimeError(f"netns_link: rank {r} failed while {what}:\n{val}")
                out[r] = val
                left.discard(r)
        return out

    def run(self, fn, per_rank_args: list) -> list:
        if len(per_rank_args) != self.world:
            raise ValueError(f"{len(per_rank_args)} argument tuples for {self.world} ranks")
        for c, a in zip(self.conns, per_rank_args):
            c.send((fn, tuple(a)))
        return self._collect(f"running {getattr(fn, '__name__', fn)}")

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def calibrate_link(rates, threads: int | None = None, sizes=None, reps: int = 5, in_step_seconds: float = 1.0,
                   pin: bool = False, comm_priority: bool = False, raw: dict | None = None) -> dict:
    """``{bps: LinkSpec}``: the veth measured at each rate (None: uncapped) by 2 ranks, one in each namespace,
    with ``fxpar.tools.probes.measure_link`` and ``link_spec`` -- the same figures ``ClusterSpec.calibrate()``
    takes on ``lo`` (the bandwidth from a fit over all_reduce sizes, α from small collectives back to back), so
    a benchmark predicts each cap with what the ranks will cross, not the loopback. A tbf cap adds no latency
    (and this kernel has no netem), so α is one figure: the median of the rates' measurements (on 2 cores one
    measurement moves by ±25%). ``{}`` when the harness cannot build the link (it says what is missing). ``raw``: a
    dict that receives each rate's figures (``measure_link``'s, rank 0's), for :func:`at_cap`."""
    import statistics
    from dataclasses import replace
    from fxpar.tools.calibrate import link_spec
    from fxpar.tools.probes import SIZES as _SIZES, measure_link
    out = {}
    with CappedLink(verbose=False) as link:
        if not link.active:
            return out
        with NetnsCluster(2, link, threads=threads, pin=pin, comm_priority=comm_priority) as cl:
            for bps in rates:
                link.set_rate(bps)
                got = cl.run(measure_link, [(tuple(sizes or _SIZES), reps, in_step_seconds)] * 2)[0]
                out[bps] = link_spec(got, 2)
                if raw is not None:
                    raw[bps] = got
    alpha = statistics.median(v.latency for v in out.values())
    return {bps: replace(v, latency=alpha) for bps, v in out.items()}


def at_cap(spec, raw: dict | None, ranks: int = 2):
    """``spec`` with what a transfer takes from the compute it overlaps (``DeviceSpec.comm_cpu_per_byte``) as
    measured through the veth at one cap (``raw``: that rate's figures from :func:`calibrate_link`, by ``ranks``
    processes): the kernel's tbf/veth path costs more CPU per byte at a low rate (on 2 cores 1.5-1.8 ms per MiB
    uncapped, 2-3 at 1 Gbit/s). Unchanged where ``spec`` charges none (the cores are not full), nothing was measured,
    or ``spec`` runs another number of processes (its workers and CPU servers) on these cores than measured it:
    what a byte costs each rank's compute depends on how many share the cores (``spec`` keeps its own calibration)."""
    from dataclasses import replace
    from fxpar.tools.calibrate import overlap_per_byte
    if not raw or not spec.device.comm_cpu_per_byte or spec.world_size + spec.cpu_servers != ranks:
        return spec
    return replace(spec, device=replace(spec.device, comm_cpu_per_byte=overlap_per_byte(raw)))


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cleanup", action="store_true", help="remove namespaces left by earlier runs and exit")
    ap.add_argument("--check", action="store_true", help="say whether a capped link can be built here")
    args = ap.parse_args(argv)
    if args.cleanup:
        missing = preflight()
        if missing:
            print(f"netns_link: cannot clean up: missing {missing}")
            return 1
        cleanup_leftovers()
        return 0
    missing = preflight()
    print("capped link available" if missing is None else f"capped link NOT available: missing {missing}")
    return 0 if missing is None else 1


if __name__ == "__main__":
    sys.exit(main())
