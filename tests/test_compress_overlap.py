"""Compressed bucket sums overlapped with backward, and ByteScheduler on the compressed pieces.

A traced method's sum is begun where the bucket's all-reduce was issued (in backward, as each bucket is made) and
waited where the update reads it (``fxpar/compress/feature.py``); the rank runs it as compute phases with the
collectives between (``fxpar/compress/phases.py``), in the order ``fxpar/compress/inflight.py`` decides: FIFO, the
synchronous sum's collective order, or ByteScheduler's priority, pieces and credit. The numbers stay the
synchronous sum's: the compression tests (test_compress_*.py, against torch's hooks and the methods' references)
run on this road unchanged, and here ByteScheduler's runs equal FIFO's bit for bit at dp=2."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fxpar
from fxpar import compress as C
from fxpar import meta as M
from fxpar.compress.feature import bucket_infos
from fxpar.compress.inflight import InFlight, Running
from fxpar.compress.phases import piece_bytes, split_phases
from fxpar.compress.powersgd import p_size, q_size, uncompressed_size
from fxpar.compress.runtime import bucket_sum, bucket_sum_wait, generator_for, trace_sum
from fxpar.testing import MLP
from fxpar.testing.compress import mlp_batches, mlp_program

STRUCTURE, NUMERICS = pytest.mark.structure, pytest.mark.numerics
PSGD = C.PowerSGD(rank=1, start_iter=2, min_compression_rate=0.5)


def _model():
    torch.manual_seed(0)
    return MLP(layers=3).double()


def _program(method=PSGD, batches=None, **kw):
    batches = batches or mlp_batches(1)
    return mlp_program(_model(), batches, dp=2, bucket_cap_mb=0.004, grad_sync=method, **kw)


def _phased(method, b, step):
    """``method``'s sum of bucket ``b`` at ``step``, traced and cut into phases, with its inputs by name."""
    gen = generator_for(method)
    state = dict(method.init_state(b, gen))
    v = method.variant(b, step, state)
    inputs = list(method.host_inputs(b, step, state, v, gen))
    names = sorted(state)
    flat = torch.randn(b.numel, dtype=torch.float64, generator=torch.Generator().manual_seed(b.index))
    ph = split_phases(trace_sum(method, b, v, flat, state, inputs, names))
    return ph, dict(zip(ph.inputs, [flat, *[state[k] for k in names], *inputs]))


# ---- where the graph begins and waits each sum ------------------------------------------------------------------
@STRUCTURE
def test_each_sum_begins_in_backward_as_its_bucket_is_made_and_is_waited_after():
    prog = _program()
    (gm,) = prog.graphs(0).values()
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    begins = [n for n in nodes if n.target is bucket_sum]
    waits = [n for n in nodes if n.target is bucket_sum_wait]
    rows = prog.plan.section("powersgd").stages[0]
    assert len(rows) >= 4 and len(begins) == len(waits) == len(rows)
    assert [n.args[3] for n in begins] == list(range(len(rows)))           # in the order backward makes the buckets
    assert all(n.kwargs == {"overlapped": True} for n in begins)
    after, stack = set(), list(begins)           # what reads a sum (its wait, the views of the summed gradients)
    while stack:
        n = stack.pop()
        if n not in after:
            after.add(n)
            stack.extend(n.users)
    backward = [n for n in nodes if M.get(n, M.PHASE) == "backward" and n.op == "call_function" and n not in after]
    end = max(pos[n] for n in backward)
    assert all(pos[n] < end for n in begins[:-1])      # issued before backward's end (the last: once it is made)
    for n in begins:                  # ... each right after its bucket's last gradient is copied in
        assert n.prev.target is torch.ops.aten.copy_.default and n.prev.args[0].args[0].args[0] is n.args[0]
    mms = [pos[n] for n in backward if n.target is torch.ops.aten.mm.default]
    assert sum(pos[begins[0]] < p < pos[begins[-1]] for p in mms) >= 2     # backward goes on between them
    for b, w in enumerate(waits):                                          # waited after backward, in bucket order
        assert pos[w] > max(end, pos[begins[-1]]) and w.args[3] == b
        assert w.args[0].target is torch.ops._c10d_functional.wait_tensor.default and w.args[0].args[0] is begins[b]
    # the estimate sees each sum as a collective in flight from its begin to its wait
    assert [(c.kind, c.nbytes) for c in prog.collectives(0)] == [("all_reduce", r["wire_bytes"]) for r in rows]


@STRUCTURE
def test_under_microbatches_the_sums_stay_in_reduce_grad():
    """Compressed once per step, after accumulation: begun and waited in REDUCE_GRAD, every begin before every wait."""
    graphs = _program(microbatches=2).graphs(0)
    for kind, gm in graphs.items():
        nodes = list(gm.graph.nodes)
        begins = [i for i, n in enumerate(nodes) if n.target is bucket_sum]
        waits = [i for i, n in enumerate(nodes) if n.target is bucket_sum_wait]
        if kind == "stage0.REDUCE_GRAD":
            assert len(begins) == len(waits) >= 4 and max(begins) < min(waits)
        else:
            assert not begins and not waits, kind


@STRUCTURE
def test_eager_methods_sum_at_once():
    """A DDP comm hook (or any eager method) runs as Python where the all-reduce was: one call, no wait."""
    code = next(iter(_program(C.DDPHook(_allreduce_hook)).graphs(0).values())).code
    assert "overlapped" not in code and "bucket_sum_wait" not in code


def _allreduce_hook(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    return allreduce_hook(state, bucket)


# ---- phases ------------------------------------------------------------------------------------------------------
@STRUCTURE
def test_a_sum_is_cut_into_phases_at_its_collectives():
    psgd = C.PowerSGD(rank=1, start_iter=2)          # biases sent whole, matrices compressed
    prog = mlp_program(_model(), mlp_batches(1), dp=2, grad_sync=psgd)          # one bucket: the whole model
    (b,) = bucket_infos(prog.plan, 0, prog.stages[0].captured, dp_rank=0)
    assert uncompressed_size(psgd.layout(b)) and p_size(psgd.layout(b))
    lay = psgd.layout(b)
    ph, _ = _phased(psgd, b, step=5)
    # P (and the tensors sent whole) leave after the first phase, Q after the second, the third decompresses
    assert [[(c.kind, c.nbytes) for c in cs] for cs in ph.issues] == [
        [("all_reduce", 8 * uncompressed_size(lay)), ("all_reduce", 8 * p_size(lay))],
        [("all_reduce", 8 * q_size(lay))], []]
    assert sum(c.nbytes for c in ph.collectives) == psgd.wire_bytes(b, "compressed")
    assert ph.needs[0] == () and ph.issues[0][1].name in ph.needs[1]
    ph0, _ = _phased(psgd, b, step=0)                       # before start_iter: one all-reduce, then nothing
    assert [[c.kind for c in cs] for cs in ph0.issues] == [["all_reduce"], []]
    top, _ = _phased(C.TopK(ratio=0.1), b, step=0)
    assert [[c.kind for c in cs] for cs in top.issues] == [["all_gather"], []]
    bg, _ = _phased(C.ByteGrad(), b, step=0)
    assert [[c.kind for c in cs] for cs in bg.issues] == [["all_to_all"], ["all_gather"], []]


@STRUCTURE
@pytest.mark.parametrize("method", [PSGD, C.TopK(ratio=0.1), C.ByteGrad()], ids=["powersgd", "topk", "bytegrad"])
def test_the_phases_compute_what_the_traced_sum_computes(method):
    """One rank's view (a collective returns what it is given): the phases with the collectives between them, run
    by InFlight, give the traced graph's outputs bit for bit -- cut or not in pieces."""
    prog = _program(method)
    b = _one_rank(bucket_infos(prog.plan, 0, prog.stages[0].captured, dp_rank=0))[0]
    for step in (0, 2):                       # PowerSGD: a plain all-reduce, then its first compressed step
        ph, env = _phased(method, b, step)
        gen = generator_for(method)
        state = dict(method.init_state(b, gen))
        v = method.variant(b, step, state)
        inputs = list(method.host_inputs(b, step, state, v, gen))
        gm = trace_sum(method, b, v, env[ph.inputs[0]], state, inputs, sorted(state))
        for n in gm.graph.nodes:               # its collectives: one rank's
            if n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional" \
                    and n.target is not torch.ops._c10d_functional.wait_tensor.default:
                n.target = _one_rank_collective
        gm.recompile()
        want = gm(*[env[n] for n in ph.inputs])
        for sched in (None, {"priority": {(0, 0): 0}, "partition_bytes": 64, "credit_bytes": 128}):
            flight = InFlight(_echo, **_settings(sched))
            run = Running((0, 0), 0, ph, dict(env))
            flight.ready(run)
            flight.drain()
            assert all(torch.equal(a, w) for a, w in zip(run.result, want))


@STRUCTURE
@pytest.mark.parametrize("sched", [None, {"priority": {(0, 0): 0}, "partition_bytes": 64, "credit_bytes": 128}],
                         ids=["fifo", "bytescheduler"])
def test_a_finished_sum_lets_go_of_its_pieces_without_the_cycle_collector(sched):
    """What a sum sent and received is freed once the sum ends and its result is taken, by reference counting alone:
    no reference cycle between a sum and its pieces keeps the bucket's sends and results until Python's cycle
    collector runs (on a 26M-parameter GPT that was about 100 MB a step, faulted in afresh by the next steps)."""
    import gc
    import weakref
    ph, env = _runs(PSGD, step=5, n_buckets=1)[1][0]
    sent = []

    def issue(coll, t):
        sent.append(weakref.ref(t))
        return t.clone()
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        flight = InFlight(issue, **_settings(sched))
        run = Running((0, 0), 0, ph, dict(env))
        flight.ready(run)
        flight.drain()
        assert run.result is not None and len(sent) >= 2           # PowerSGD's P and Q at least
        del run, flight, env
        assert [r() for r in sent] == [None] * len(sent)
    finally:
        if was:
            gc.enable()


def _echo(coll, t):
    """A collective of a one-rank group: it returns what it is given."""
    return t.clone()


def _one_rank_collective(t, *args):
    return t.clone()


def _one_rank(infos):
    """The buckets as a one-rank group sums them (a collective returns its input: ``_echo``)."""
    return [dataclasses.replace(b, dp=1, dp_rank=0) for b in infos]


def _settings(sched):
    if not sched:
        return {}
    return {"priority": sched["priority"], "partition": sched["partition_bytes"], "credit": sched["credit_bytes"]}


# ---- the order the rank issues and waits ------------------------------------------------------------------------------
def _runs(method, step, n_buckets=None):
    prog = _program(method)
    infos = _one_rank(bucket_infos(prog.plan, 0, prog.stages[0].captured, dp_rank=0))[:n_buckets]
    return infos, [_phased(method, b, step) for b in infos]


@STRUCTURE
def test_fifo_issues_each_bucket_at_its_ready_event_in_the_synchronous_order():
    infos, phased = _runs(PSGD, step=5)
    flight = InFlight(_echo)
    marks, runs = [], []
    for b, (ph, env) in zip(infos, phased):
        runs.append(Running((0, b.index), b.index, ph, env))
        flight.ready(runs[-1])
        marks.append(len(flight.log))
    flight.drain()
    issued = [(key[1], name) for op, key, name, _, _ in flight.log if op == "issue"]
    # the synchronous sum's order: bucket by bucket, each bucket's collectives in the traced order
    assert issued == [(b.index, c.name) for b, (ph, _) in zip(infos, phased) for c in ph.collectives]
    for i, b in enumerate(infos):                         # bucket i's first collectives leave at its ready event
        at = [j for j, e in enumerate(flight.log) if e[0] == "issue" and e[1] == (0, b.index)]
        assert (marks[i - 1] if i else 0) <= at[0] < marks[i]
    # P is waited (and Q issued) at the next bucket's ready event, in backward; Q where the update needs the sum
    ph = phased[0][0]
    p_name, q_name = ph.issues[0][-1].name, ph.issues[1][0].name
    waits = {(e[1][1], e[2]): j for j, e in enumerate(flight.log) if e[0] == "wait"}
    assert marks[0] <= waits[(0, p_name)] < marks[1] and waits[(0, q_name)] >= marks[-1]
    assert all(r.result is not None for r in runs)


@STRUCTURE
def test_bytescheduler_cuts_pieces_queues_by_priority_and_keeps_the_credit():
    infos, phased = _runs(C.TopK(ratio=0.5), step=0, n_buckets=3)
    sizes = [ph.collectives[0].nbytes for ph, _ in phased]
    part = 200
    credit = 2 * part
    prio = {(0, b.index): len(infos) - b.index for b in infos}          # the last bucket made (first layers) first
    flight = InFlight(_echo, prio, part, credit)
    marks = []
    for b, (ph, env) in zip(infos, phased):
        flight.ready(Running((0, b.index), prio[(0, b.index)], ph, env))
        marks.append(len(flight.log))
    flight.drain()
    issues = [e for e in flight.log if e[0] == "issue"]
    for b, n in zip(infos, sizes):                    # pieces of whole rows (bytes here) of at most `part`
        mine = [e[4] for e in issues if e[1] == (0, b.index)]
        assert mine == piece_bytes(phased[b.index][0].collectives[0], part) and sum(mine) == n
        assert len(mine) == math.ceil(n / part) and max(mine) <= part
    used = peak = 0                                    # never more than the credit in flight
    for op, _, _, _, nb in flight.log:
        used += nb if op == "issue" else -nb
        peak = max(peak, used)
    assert used == 0 and peak <= credit
    # at bucket 1's ready event the credit is full: the oldest piece is waited, and bucket 1's first piece goes
    # before bucket 0's queued ones (bucket 1 holds earlier layers)
    ev1 = flight.log[marks[0]:marks[1]]
    assert ev1[0][0] == "wait" and ev1[0][1] == (0, 0)
    first_issue = next(e for e in ev1 if e[0] == "issue")
    assert first_issue[1] == (0, 1)
    assert any(e[0] == "issue" and e[1] == (0, 0) for e in flight.log[marks[1]:])    # bucket 0 still queued


# ---- ByteScheduler on the compressed pieces: the plan ----------------------------------------------------------------
@STRUCTURE
def test_the_plan_shows_priority_pieces_and_credit():
    prog = _program(PSGD, comm_schedule="bytescheduler", partition_mb=200 / 2**20, credit_mb=1000 / 2**20)
    sec = prog.plan.section("powersgd")
    assert sec.schedule["partition_bytes"] == 200 and sec.schedule["credit_bytes"] == 1000
    rows = sec.stages[0]
    keys = list(prog.stages[0].captured.param_shapes)
    first = [min(keys.index(k) for k in r["keys"]) for r in rows]
    assert sec.schedule["priority"] == [sorted(range(len(rows)), key=first.__getitem__)]
    assert sec.schedule["priority"][0][0] == len(rows) - 1          # the first layer's bucket, made last, goes first
    for r in rows:
        assert sum(n for _, n in r["pieces"]) == r["wire_bytes"] and all(n <= 200 for _, n in r["pieces"])
        assert len(r["pieces"]) == sum(math.ceil(n / 200) for _, n in r["collectives"])
    info = prog.collectives(0)
    assert [list(map(list, c.parts)) or [[c.kind, c.nbytes]] for c in info] == [r["pieces"] for r in rows]
    bs = prog.plan.section("bytescheduler")
    assert bs.bucket_sums == "powersgd" and not bs.cross_iteration and all(not e["pieces"] for e in bs.stages)
    assert not any(n.target is torch.ops._c10d_functional.all_reduce_.default
                   for gm in prog.graphs(0).values() for n in gm.graph.nodes)
    text = prog.explain()
    assert "ByteScheduler on the compressed pieces" in text
    again = fxpar.Plan.from_json(prog.plan.to_json())
    assert again.section("powersgd").schedule == sec.schedule


@STRUCTURE
def test_what_bytescheduler_cannot_do_with_compression_is_refused():
    with pytest.raises(fxpar.StrategyError, match=r"comm_schedule='bytescheduler'.*eager.*comm_schedule='fifo'"):
        fxpar.Strategy(dp=4, grad_sync=C.Decentralized(peers="ring"), comm_schedule="bytescheduler")
    with pytest.raises(fxpar.StrategyError, match=r"finishes in its step.*drop cross_iteration=True"):
        fxpar.Strategy(dp=2, grad_sync=PSGD, comm_schedule="bytescheduler", cross_iteration=True)
    with pytest.raises(fxpar.StrategyError, match=r"grad_order='priority'.*drop grad_order"):
        fxpar.Strategy(dp=2, grad_sync="topk", comm_schedule="bytescheduler", grad_order="priority")


# ---- the numbers do not change ------------------------------------------------------------------------------------------
@NUMERICS
@pytest.mark.parametrize("method", [PSGD, C.TopK(ratio=0.5)], ids=["powersgd", "topk"])
def test_bytescheduler_changes_no_number(clusters, method):
    """dp=2, three steps (PowerSGD: one plain, two compressed): ByteScheduler's pieces, priority and credit give FIFO's
    losses and parameters bit for bit, and each rank hands its collectives the plan's pieces, each step."""
    batches = mlp_batches(3)
    fifo = _program(method, batches).run_local(batches, cluster=clusters.get(2))
    prog = _program(method, batches, comm_schedule="bytescheduler", partition_mb=200 / 2**20, credit_mb=400 / 2**20)
    res = prog.run_local(batches, cluster=clusters.get(2), measure_comm=True)
    assert res.losses == fifo.losses
    ref = fifo.state_dict()
    for k, v in res.state_dict().items():
        assert torch.equal(v, ref[k]), k
    rows = prog.plan.section(method.name).stages[0]
    steady = sorted(tuple(p) for r in rows for p in r["pieces"])
    for r in range(2):
        calls = res.comm_calls[r]
        assert sorted(calls[-1]) == steady                     # the compressed steps: the plan's pieces
        assert all(n <= 200 for _, n in calls[-1])
    if method is PSGD:                                         # the first step: each bucket all-reduced, in pieces
        plain = sum(b.numel * 8 for b in bucket_infos(prog.plan, 0, prog.stages[0].captured))
        assert sum(n for _, n in res.comm_calls[0][0]) == plain and max(n for _, n in res.comm_calls[0][0]) <= 200
