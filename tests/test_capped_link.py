"""benchmarks/netns_link.py: the capped-link harness.

The command construction and clean-up logic are pure functions, tested without root. One short real check
(two ranks in the two namespaces exchange a tensor over gloo; the namespaces are gone afterwards) runs
only as root with a working ``ip netns``."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import netns_link as nl  # noqa: E402

ALL_RATES = [None, "2gbit", "1gbit", "500mbit", 123_000_000]


@pytest.mark.structure
def test_names_unique_per_pid_and_short():
    a, b = nl.make_names(4242), nl.make_names(4243)
    assert a.ns_a != a.ns_b and a.dev_a != a.dev_b
    assert set(a.namespaces).isdisjoint(b.namespaces) and {a.dev_a, a.dev_b}.isdisjoint({b.dev_a, b.dev_b})
    big = nl.make_names(4_194_304)                   # the largest Linux PID
    assert max(len(big.dev_a), len(big.dev_b)) <= 15 # IFNAMSIZ - 1
    assert "lo" not in (a.dev_a, a.dev_b)
    assert a.addr_a.startswith("127.") and a.addr_b.startswith("127.") and a.addr_a != a.addr_b
    assert nl.make_names().ns_a == f"fxcap{os.getpid()}a"


@pytest.mark.structure
@pytest.mark.parametrize("text,bps", [(None, None), ("none", None), ("0", None), (0, None), ("2gbit", 2 * 10**9),
                                      ("1gbit", 10**9), ("500mbit", 500 * 10**6), ("1.5g", 15 * 10**8),
                                      (250_000_000, 250_000_000), ("64kbit", 64_000)])
def test_parse_rate(text, bps):
    assert nl.parse_rate(text) == bps


@pytest.mark.structure
@pytest.mark.parametrize("bad", ["fast", "1tb", "-5mbit", -3])
def test_parse_rate_refuses(bad):
    with pytest.raises(ValueError):
        nl.parse_rate(bad)


@pytest.mark.structure
def test_format_rate_round_trips():
    for r in ("2gbit", "1gbit", "500mbit", "64kbit", "1500bit"):
        assert nl.format_rate(nl.parse_rate(r)) == r
    assert nl.format_rate(None) == "none"


@pytest.mark.structure
def test_setup_commands():
    n = nl.make_names(77)
    cmds = nl.setup_commands(n)
    assert cmds[:2] == [["ip", "netns", "add", n.ns_a], ["ip", "netns", "add", n.ns_b]]
    # the veth pair is born with its ends inside the two namespaces, never in the default one
    assert cmds[2] == ["ip", "link", "add", n.dev_a, "netns", n.ns_a, "type", "veth", "peer", "name", n.dev_b,
                       "netns", n.ns_b]
    for ns, dev, addr in ((n.ns_a, n.dev_a, n.addr_a), (n.ns_b, n.dev_b, n.addr_b)):
        assert ["ip", "-n", ns, "link", "set", "lo", "up"] in cmds          # the namespace's own lo
        assert ["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev] in cmds
        assert ["ip", "-n", ns, "link", "set", dev, "up"] in cmds
        sysctl = [c for c in cmds if c[:4] == ["ip", "netns", "exec", ns]]
        assert len(sysctl) == 1 and "net.ipv4.conf.all.route_localnet=1" in sysctl[0]
        assert f"net.ipv4.conf.{dev}.route_localnet=1" in sysctl[0]
    nl.check_commands(cmds, n)


@pytest.mark.structure
def test_rate_commands_tbf_each_direction():
    n = nl.make_names(77)
    cmds = nl.rate_commands(n, "1gbit")
    assert cmds == [
        ["tc", "-n", n.ns_a, "qdisc", "replace", "dev", n.dev_a, "root", "tbf", "rate", "1gbit", "burst", "125000",
         "latency", "50ms"],
        ["tc", "-n", n.ns_b, "qdisc", "replace", "dev", n.dev_b, "root", "tbf", "rate", "1gbit", "burst", "125000",
         "latency", "50ms"]]
    assert nl.rate_commands(n, None) == [["tc", "-n", n.ns_a, "qdisc", "del", "dev", n.dev_a, "root"],
                                         ["tc", "-n", n.ns_b, "qdisc", "del", "dev", n.dev_b, "root"]]
    assert nl.tbf_burst_bytes(10**6) == 64 * 1024        # never below one GSO packet
    assert nl.tbf_burst_bytes(2 * 10**9) == 250_000      # 1 ms of traffic


@pytest.mark.structure
def test_teardown_commands():
    n = nl.make_names(77)
    assert nl.teardown_commands(n) == [["ip", "netns", "del", n.ns_a], ["ip", "netns", "del", n.ns_b]]


@pytest.mark.structure
def test_no_command_touches_the_default_namespace():
    n = nl.make_names(77)
    cmds = nl.setup_commands(n) + nl.teardown_commands(n)
    for r in ALL_RATES:
        cmds += nl.rate_commands(n, r)
    nl.check_commands(cmds, n)
    for c in cmds:
        if "lo" in c:                                      # only ever a namespace's own lo
            assert c[:3] in (["ip", "-n", n.ns_a], ["ip", "-n", n.ns_b]), c
        if c[0] == "tc":
            assert c[1:3] in (["-n", n.ns_a], ["-n", n.ns_b]), c
    for bad in (["tc", "qdisc", "add", "dev", "lo", "root", "tbf"], ["ip", "link", "set", "lo", "down"],
                ["tc", "-n", "someoneelse", "qdisc", "del", "dev", "eth0", "root"],
                ["ip", "netns", "del", "fxcap1a"], ["ip", "link", "add", n.dev_a, "type", "veth", "peer", "name", "x"]):
        with pytest.raises(RuntimeError, match="refusing"):
            nl.check_commands([bad], n)


@pytest.mark.structure
def test_leftover_namespaces():
    me = os.getpid()
    listing = (f"fxcap111a (id: 3)\nfxcap111b\nfxcap222a (id: 5)\nfxcap{me}a\nfxcap{me}b\n"
               "other-ns\nfxcapXa\nfxcap333\n")
    alive = {111: False, 222: True, me: True}.get
    assert nl.leftover_namespaces(listing, alive=lambda p: alive(p, False)) == ["fxcap111a", "fxcap111b"]
    # this process's own namespaces are never leftovers, even if "dead"
    assert f"fxcap{me}a" not in nl.leftover_namespaces(listing, alive=lambda p: False)
    assert nl.leftover_namespaces("") == []


@pytest.mark.structure
def test_without_root_it_says_what_is_missing_and_runs_uncapped(monkeypatch):
    monkeypatch.setattr(nl, "preflight", lambda: "root (test)")
    link = nl.CappedLink()
    with pytest.warns(RuntimeWarning, match="UNCAPPED.*root"):
        link.up()
    assert not link.active and link.addr("a") == "127.0.0.1" == link.addr("b")
    link.set_rate("1gbit")                       # a no-op, remembered
    assert link.rate == 10**9
    link.down()


@pytest.mark.structure
def test_preflight_reports_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in nl.preflight()


def _can_build_link() -> bool:
    return os.geteuid() == 0 and nl.preflight() is None


def _exchange(n):
    import torch
    import torch.distributed as dist
    t = torch.full((n,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return float(t[0]), os.environ.get("GLOO_SOCKET_IFNAME")


def _fail_on_rank1():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    return 0


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.skipif(not _can_build_link(), reason="needs root and a working `ip netns` (a capped link is built)")
def test_real_link_exchange_and_cleanup():
    lo_before = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
    link = nl.CappedLink()
    with link, nl.NetnsCluster(2, link, timeout_s=60) as cl:
        assert link.active and link.exists()
        link.set_rate("500mbit")
        assert "tbf" in link.qdiscs() and "500Mbit" in link.qdiscs()
        out = cl.run(_exchange, [(1000,), (1000,)])
        assert out == [(3.0, link.names.dev_a), (3.0, link.names.dev_b)]     # each rank on its own veth
        with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*on purpose"):
            cl.run(_fail_on_rank1, [(), ()])
    assert not link.exists()
    assert not any(os.path.exists(f"/var/run/netns/{ns}") for ns in link.names.namespaces)
    assert subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout == lo_before


@pytest.mark.serial
@pytest.mark.numerics
@pytest.mark.skipif(not _can_build_link(), reason="needs root and a working `ip netns`")
def test_real_cleanup_of_a_dead_runs_leftovers():
    dead = subprocess.Popen(["true"])
    dead.wait()                                            # its PID names a run that is gone
    name = f"fxcap{dead.pid}a"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in nl.cleanup_leftovers(verbose=False)
        assert not os.path.exists(f"/var/run/netns/{name}")
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.cost
def test_at_cap_charges_the_caps_measured_overlap_cost():
    """``at_cap``: a spec that charges an overlapped transfer's CPU (the ranks fill the cores) takes the figure measured
    through the veth at that cap; one that charges none (spare cores), or no figure, stays as it is."""
    from dataclasses import replace

    import fxpar
    spec = fxpar.ClusterSpec.local(2)
    full = replace(spec, device=replace(spec.device, comm_cpu_per_byte=1e-9))
    raw = {"overlap_cpu": {"per_byte_s": 2.5e-9}, "comm_cpu": {"per_byte_s": 0.8e-9}}
    assert nl.at_cap(full, raw).device.comm_cpu_per_byte == 2.5e-9
    assert nl.at_cap(full, {"comm_cpu": {"per_byte_s": 0.8e-9}}).device.comm_cpu_per_byte == 0.8e-9   # older figures
    assert nl.at_cap(spec, raw) == spec and nl.at_cap(full, None) == full
    four = replace(full, devices_per_node=4)         # 4 ranks share the cores: measured by 2, not theirs
    assert nl.at_cap(four, raw) == four and nl.at_cap(replace(full, cpu_servers=1), raw).device.comm_cpu_per_byte == 1e-9
