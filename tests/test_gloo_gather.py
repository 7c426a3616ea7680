"""The runtime's all-gather under gloo (fxpar.collectives.lower_for_backend).

torch 2.13's functional ``all_gather_into_tensor`` reaches gloo as ``allgather_into_tensor_coalesced``, which
corrupted the heap about once in 10-20 thousand steps of two ranks over a veth pair when another collective of the
group was in flight (``benchmarks/gloo_gather_stress.py`` reproduces it). On a gloo
group the executor runs each gather in flight beside another collective as ``fxpar::all_gather_into_tensor`` (``dist.all_gather_single`` with
``async_op=True``, its work registered for the graph's ``wait_tensor``). Here: the op equals the functional one, with
and without a collective in flight; the executor's graphs hold it where a gather overlaps another collective and
nowhere else; the overlap is read from the graph; the comm counter counts it; a graph whose groups are not bound is
left alone. Numerics of
every program with gathers (Parallax, ZeRO-3, Herring, Tofu) go through it in their own tests.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.collectives import (C10D, gathers_beside_collectives, gloo_all_gather_into_tensor, group_tag,
                               in_flight_across_graphs, lower_for_backend)
from fxpar.testing import Bag, bag_batches     # a large table Parallax routes sparse, a small one, a head

FUNCTIONAL = C10D.all_gather_into_tensor.default


def _gather_both_ways(shape):
    """On a rank: the functional gather and fxpar's, alone and with an all-reduce in flight; the counter's view."""
    import torch.distributed as dist

    from fxpar.runtime.measure import CommCounter
    rank, n, name = dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) + 100 * rank
    ref = C10D.wait_tensor.default(FUNCTIONAL(x, n, name))
    alone = C10D.wait_tensor.default(gloo_all_gather_into_tensor(x, n, name))
    busy = torch.full((7,), float(rank + 1))
    ar = C10D.all_reduce.default(busy, "sum", name)                        # in flight during the gather
    beside = C10D.wait_tensor.default(gloo_all_gather_into_tensor(x.t(), n, name))   # a non-contiguous input too
    summed = C10D.wait_tensor.default(ar)
    with CommCounter() as counter:
        C10D.wait_tensor.default(gloo_all_gather_into_tensor(x, n, name))
    return ref, alone, beside, summed, counter.calls


@pytest.mark.numerics
def test_gloo_gather_equals_the_functional_gather(clusters):
    out = clusters.get(2).run(_gather_both_ways, [((3, 4),)] * 2)
    x = [torch.arange(12, dtype=torch.float64).reshape(3, 4) + 100 * r for r in range(2)]
    for ref, alone, beside, summed, calls in out:
        assert torch.equal(ref, torch.cat(x)) and ref.shape == (6, 4)
        assert torch.equal(alone, ref)
        assert torch.equal(beside, torch.cat([t.t() for t in x]))
        assert torch.equal(summed, torch.full((7,), 3.0))
        assert calls == [("all_gather", 12 * 8)]


def _executor_gathers(payload):
    from fxpar.runtime.executor import Executor
    ex = Executor(payload)
    count = {"functional": 0, "gloo": 0}
    for parts in ex.p.graphs.values():
        for sg in parts.values():
            for n in sg.gm.graph.nodes:
                if n.target is FUNCTIONAL:
                    count["functional"] += 1
                elif n.target is gloo_all_gather_into_tensor:
                    count["gloo"] += 1
    return count


@pytest.mark.numerics
def test_executor_lowers_the_gathers_that_run_beside_another_collective(clusters):
    """Parallax's pairs are gathered while the dense rest's all-reduce is in flight: lowered on every rank. ZeRO-3's
    parameter gathers run one at a time (one collective in flight per graph): they keep the functional op."""
    batch = bag_batches(1)[0]
    for strat, lowered in ((fxpar.Strategy(dp=2, grad_sync="parallax"), True), (fxpar.Strategy(dp=2, zero=3), False)):
        prog = fxpar.parallelize(Bag(), 2, batch, F.cross_entropy, (torch.optim.SGD, {"lr": 0.1}), strategy=strat)
        planned = sum(1 for gm in prog.graphs(0).values() for n in gm.graph.nodes if n.target is FUNCTIONAL)
        assert planned > 0, strat
        got = clusters.get(2).run(_executor_gathers, [(prog.payload(r),) for r in range(2)])
        want = {"functional": 0, "gloo": planned} if lowered else {"functional": planned, "gloo": 0}
        assert got == [want] * 2, (strat, got)
        # the program's own graphs (what program.graphs() shows) keep the functional op
        assert sum(1 for gm in prog.graphs(0).values() for n in gm.graph.nodes if n.target is FUNCTIONAL) == planned


def _graph(ops):
    """A graph of ``ops``: ("issue", name, kind) starts a collective on the running value, ("wait", name) waits it,
    ("wait_input",) waits a placeholder (a collective an earlier graph issued)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    pending = g.placeholder("pending")
    made = {}
    for op in ops:
        if op[0] == "issue":
            kind = {"gather": (FUNCTIONAL, (x, 2, "0")), "reduce": (C10D.all_reduce.default, (x, "sum", "0"))}[op[2]]
            made[op[1]] = g.call_function(*kind)
        elif op[0] == "wait":
            g.call_function(C10D.wait_tensor.default, (made[op[1]],))
        else:
            g.call_function(C10D.wait_tensor.default, (pending,))
    g.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), g), made


@pytest.mark.structure
def test_which_gathers_run_beside_another_collective():
    """Spans in graph order: a gather overlapping an all-reduce either way is found; one alone is not; one after a
    placeholder's wait is alone, one before it is not; a collective left in flight marks the rank's graphs."""
    gm, m = _graph([("issue", "ar", "reduce"), ("issue", "ag", "gather"), ("wait", "ag"), ("wait", "ar")])
    assert gathers_beside_collectives(gm) == [m["ag"]] and not in_flight_across_graphs([gm])
    gm, m = _graph([("issue", "ag", "gather"), ("issue", "ar", "reduce"), ("wait", "ar"), ("wait", "ag")])
    assert gathers_beside_collectives(gm) == [m["ag"]]
    gm, m = _graph([("issue", "ar", "reduce"), ("wait", "ar"), ("issue", "ag", "gather"), ("wait", "ag")])
    assert gathers_beside_collectives(gm) == [] and gathers_beside_collectives(gm, anywhere=True) == [m["ag"]]
    gm, m = _graph([("wait_input",), ("issue", "ag", "gather"), ("wait", "ag")])
    assert gathers_beside_collectives(gm) == [] and in_flight_across_graphs([gm])
    gm, m = _graph([("issue", "ag", "gather"), ("wait_input",), ("wait", "ag")])
    assert gathers_beside_collectives(gm) == [m["ag"]]
    gm, m = _graph([("issue", "ar", "reduce"), ("issue", "ag", "gather"), ("wait", "ag")])    # ar left in flight
    assert gathers_beside_collectives(gm) == [m["ag"]] and in_flight_across_graphs([gm])


@pytest.mark.structure
def test_unbound_groups_are_left_alone():
    """Before bind_groups a gather names a mesh axis, not a process group: nothing to lower (and no group needed)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    ag = g.call_function(FUNCTIONAL, (x, 2, group_tag("dp")))
    g.output(g.call_function(C10D.wait_tensor.default, (ag,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert lower_for_backend(gm) == 0
    assert ag.target is FUNCTIONAL


def _runner_keeps_program_graphs(strat_kwargs):
    """On a rank of an initialised group: runner() binds and lowers its own copies of the graphs."""
    batch = bag_batches(1)[0]
    prog = fxpar.parallelize(Bag(), 2, batch, F.cross_entropy, (torch.optim.SGD, {"lr": 0.1}),
                             strategy=fxpar.Strategy(**strat_kwargs))
    before = [(n.target, n.args) for gm in prog.graphs(0).values() for n in gm.graph.nodes]
    runner = prog.runner()
    runner.step(batch)
    mine = [n.target for parts in runner.executor.p.graphs.values() for sg in parts.values() for n in sg.gm.graph.nodes]
    after = [(n.target, n.args) for gm in prog.graphs(0).values() for n in gm.graph.nodes]
    return before == after, mine.count(gloo_all_gather_into_tensor), mine.count(FUNCTIONAL)


@pytest.mark.numerics
def test_runner_binds_copies_not_the_programs_graphs(clusters):
    """Under torchrun the program and the executor share a process: program.graphs() still shows the planned
    graphs (group tags, the functional gather) after runner() bound and lowered the rank's copies."""
    got = clusters.get(2).run(_runner_keeps_program_graphs, [({"dp": 2, "grad_sync": "parallax"},)] * 2)
    assert got == [(True, 1, 0)] * 2, got
