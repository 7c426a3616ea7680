"""A rank lets go of what it sent once the receiver is known to have it (``fxpar.schedule.sends.send_releases``), so
the messages it holds do not grow with the window: an asynchronous run over many batches holds as many as one over
two. Every release is safe (the receiver's RECV happened before the RECV after which the sender waits, through
messages alone: the wait cannot block), at p = 2 and p = 4; and the numerics are those of the papers' references."""
from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.schedule import (chimera, gpipe, interleaved, one_f_one_b, pipedream, pipedream_2bw, pipelined_bp,
                            pipemare, zb1p)
from fxpar.schedule.ir import RECVS, SENDS
from fxpar.schedule.sends import message_key, send_releases
from fxpar.testing import SkipNet, class_batches, max_abs_diff
from fxpar.testing.async_reference import delayed_pipeline_reference, pipedream_reference

CE = torch.nn.functional.cross_entropy
SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})

SCHEDULES = {
    "pipedream": pipedream, "pipelined_bp": pipelined_bp, "pipemare": pipemare,
    "2bw": lambda p, m: pipedream_2bw(p, 4, n_batches=m // 4), "1f1b": one_f_one_b, "gpipe": gpipe,
}


def _most_held(schedule) -> dict:
    """rank -> the most messages it holds at once, and how many it still holds at the end of the window."""
    releases = send_releases(schedule.actions)
    out = {}
    for r, acts in schedule.actions.items():
        held, most = set(), 0
        for j, a in enumerate(acts):
            if a.kind in SENDS:
                held.add(j)
                most = max(most, len(held))
            held -= set(releases[r].get(j, ()))
        out[r] = (most, len(held))
    return out


def _happens_before(schedule) -> set:
    """Every pair ``((rank, index), (rank, index))`` ordered by program order and messages alone (a plain
    reachability closure, independent of the vector clocks ``send_releases`` keeps)."""
    recv_at = {message_key(a, r): (r, j) for r, acts in schedule.actions.items()
               for j, a in enumerate(acts) if a.kind in RECVS}
    succ = {}
    for r, acts in schedule.actions.items():
        for j, a in enumerate(acts):
            nxt = [(r, j + 1)] if j + 1 < len(acts) else []
            if a.kind in SENDS:
                nxt.append(recv_at[message_key(a, r)])
            succ[(r, j)] = nxt
    closure = set()
    for start in succ:
        stack, seen = list(succ[start]), set()
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(succ[n])
        closure |= {(start, n) for n in seen}
    return closure


@pytest.mark.structure
@pytest.mark.parametrize("name", [n for n in SCHEDULES if n != "gpipe"])   # GPipe: every forward before a backward
@pytest.mark.parametrize("p", [2, 4])
def test_messages_held_do_not_grow_with_the_window(name, p):
    """The most messages a rank holds at once is the same over 8 microbatches and over 32 (a window four times as
    long), at most 2p: released as the schedule goes, not at its end."""
    short, long = _most_held(SCHEDULES[name](p, 8)), _most_held(SCHEDULES[name](p, 32))
    assert {r: m for r, (m, _) in short.items()} == {r: m for r, (m, _) in long.items()}, (short, long)
    assert max(m for m, _ in long.values()) <= 2 * p, long


SYNCHRONOUS_MORE = {"interleaved": interleaved, "zb1p": zb1p, "chimera": chimera}   # several stages a rank, split B


@pytest.mark.structure
@pytest.mark.parametrize("name", list(SCHEDULES) + list(SYNCHRONOUS_MORE))
@pytest.mark.parametrize("p", [2, 4])
def test_every_release_waits_on_a_message_already_received(name, p):
    """A send is waited right after a RECV only if its receiver's RECV happened before that RECV (through program
    order and messages): then the data is there and the wait returns without the receiver doing anything more."""
    sched = {**SCHEDULES, **SYNCHRONOUS_MORE}[name](p, 8)
    before = _happens_before(sched)
    recv_at = {message_key(a, r): (r, j) for r, acts in sched.actions.items()
               for j, a in enumerate(acts) if a.kind in RECVS}
    released = 0
    for r, rel in send_releases(sched.actions).items():
        for j, sends in rel.items():
            assert sched.actions[r][j].kind in RECVS
            for k in sends:
                a = sched.actions[r][k]
                assert a.kind in SENDS and k < j
                assert (recv_at[message_key(a, r)], (r, j)) in before, (r, a.short(), sched.actions[r][j].short())
                released += 1
    assert released > 0


def _program(model, batch, **strategy):
    strategy = fxpar.Strategy(**strategy)
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(strategy.size), batch, CE, SGD_M, strategy=strategy)


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("pp,schedule,options", [
    (2, "pipedream", {}),
    (4, "pipelined_bp", {"correction": "sc+lwp"}),
], ids=["pipedream-pp2", "pipelined_bp-pp4"])
def test_a_long_run_holds_what_a_short_one_holds(clusters, pp, schedule, options):
    """One run_local over 2 batches and one over 6 (a window three times as long): each rank holds as many sent
    messages at once, and as many bytes beyond its state and batch (the measured peak less what it held at the
    start), in both; the long run still computes the paper's math to 1e-10."""
    model, m = SkipNet().double(), 4
    held = {}
    for n in (2, 6):
        batches = class_batches(n)
        prog = _program(model, batches[0], pp=pp, schedule=schedule, microbatches=m, **options)
        res = prog.run_local(batches, cluster=clusters.get(pp), measure_memory=True)
        held[n] = {r: (res.comm[r]["held_sends"], res.peak_memory_bytes[r] - res.held_memory_bytes[r])
                   for r in range(pp)}
    assert held[2] == held[6], held
    assert all(sends <= 2 * pp for sends, _ in held[6].values()), held
    keys = [sp.param_keys for sp in prog.stages]
    if schedule == "pipedream":
        ref_losses, ref_state = pipedream_reference(model, keys, batches, CE, SGD_M, m)
    else:
        ref_losses, ref_state = delayed_pipeline_reference(model, keys, batches, CE, SGD_M, m, **options)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
