"""ByteScheduler as a graph pass: priority, partitions, credit, cross-iteration overlap.

Numerics: N gloo ranks with cross-iteration overlap (each bucket's wait and update in the next step) equal
single-process training in float64 to 1e-10; under dp x pp too (priority, partitions, credit in REDUCE_GRAD, and
each stage's STEP moved into its first forward of the next step, F_UPDATE). Structure: pieces are issued in
priority order, the bytes in flight (measured on the ranks) never exceed the credit and cross the step boundary,
the next step's first forward op on a layer depends only on that layer's carried waits, a resumed run equals an
uninterrupted one.
"""
from __future__ import annotations

import heapq

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fxpar
from fxpar.errors import StrategyError
from fxpar.runtime.executor import train
from fxpar.testing import (MLP, gpt_loss, max_abs_diff, reference_training, regression_batches, tiny_gpt,
                           token_pairs)
from fxpar.testing.resume import assert_resume_is_exact

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
SMALL = dict(partition_mb=0.004, credit_mb=0.008)     # pieces of <= 4 KiB (8 KiB weights cut in rows), 8 KiB in flight
C10D = torch.ops._c10d_functional


def _batches(kind, n=3, batch=8):
    return regression_batches(n, batch, seed=3) if kind == "mlp" else token_pairs(n, batch)


MODELS = {"gpt": (lambda: tiny_gpt(seed=None), gpt_loss), "mlp": (lambda: MLP().double(), F.mse_loss)}


# (model, batches, loss_fn, program) by everything that makes them: tests that build the same program share one
# build (each test starts from the same seed, so the model a test would make is this one). Only reads follow.
_BUILT: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _shared_builds():
    yield
    _BUILT.clear()
    _PP.clear()


def _program(kind, opt, strategy, n=3, cluster=None, **kw):
    key = repr((kind, opt, strategy, n, cluster, sorted(kw.items())))
    if key not in _BUILT:
        make, loss_fn = MODELS[kind]
        model, batches = make(), _batches(kind, n)
        prog = fxpar.parallelize(model, cluster or fxpar.ClusterSpec.local(strategy.size), batches[0],
                                 loss_fn=loss_fn, optimizer=opt, strategy=strategy, **kw)
        _BUILT[key] = model, batches, loss_fn, prog
    return _BUILT[key]


_PP: dict = {}


def _pp_program(opt, m=2):
    """dp=2 x pp=2 (1F1B) on the tied GPT with small pieces, built once per (optimizer, microbatches) for this file."""
    key = (opt[0], m)
    if key not in _PP:
        _PP[key] = _program("gpt", opt, fxpar.Strategy(dp=2, pp=2, microbatches=m, comm_schedule="bytescheduler",
                                                       **SMALL))
    return _PP[key]


def _assert_matches(res, model, batches, loss_fn, opt, **kw):
    ref_losses, ref_state = reference_training(model, batches, loss_fn, opt, **kw)
    assert len(res.losses) == len(batches)
    for a, b in zip(res.losses, ref_losses):
        assert abs(a - b) <= 1e-10 * max(1.0, abs(b))
    assert max_abs_diff(res.state_dict(), ref_state) <= 1e-10


# ---- numerics ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("opt", [SGD_M, ADAMW], ids=["sgd_momentum", "adamw"])
@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_cross_iteration_matches_single_process(clusters, kind, opt, dp):
    model, batches, loss_fn, prog = _program(kind, opt, fxpar.Strategy(dp=dp, comm_schedule="bytescheduler", **SMALL))
    cs = prog.plan.section("bytescheduler")
    assert cs.cross_iteration and set(prog.stages[0].graphs) == {"FULL", "FIRST", "DRAIN"}
    assert any(r0 is not None for _, r0, _ in cs.stages[0]["pieces"])       # some gradient is cut in rows
    _assert_matches(prog.run_local(batches, cluster=clusters.get(dp)), model, batches, loss_fn, opt)


@pytest.mark.slow
@pytest.mark.numerics
def test_cross_iteration_only_where_the_cost_model_says_it_pays(clusters):
    """Where an overlapped transfer costs the compute more than a waited one (full CPU cores: ``comm_cpu_per_byte``)
    and the link is fast, the planner keeps every wait in its own step -- cross-iteration overlap predicted no better
    -- and says why; the program is then the in-step issue plan, updated in place, equal to single process.
    ``Strategy(cross_iteration=True)`` keeps the overlap, ``False`` drops it whatever the cost model says."""
    from dataclasses import replace
    base = fxpar.ClusterSpec.local(2)
    busy = replace(base, device=replace(base.device, comm_cpu_per_byte=2e-9))        # 2 ms of compute per MiB moved
    model, batches, loss_fn, prog = _program("gpt", ADAMW, fxpar.Strategy(dp=2, comm_schedule="bytescheduler"),
                                             cluster=busy)
    cs, entry = prog.plan.section("bytescheduler"), prog.plan.section("bytescheduler").stages[0]
    assert not cs.cross_iteration and "cost model predicts" in cs.why_not_cross_iteration
    assert entry["predicted_step_s"] <= 1.02 * entry["cross_iteration_predicted_step_s"]
    assert set(prog.stages[0].graphs) == {"FULL"} and "reinplace_optimizer" in [h.pass_name for h in prog.history(0)]
    assert any("no cross-iteration overlap: the cost model predicts" in n for n in prog.plan.notes)
    _assert_matches(prog.run_local(batches, cluster=clusters.get(2)), model, batches, loss_fn, ADAMW)
    forced = _program("gpt", ADAMW, fxpar.Strategy(dp=2, comm_schedule="bytescheduler", cross_iteration=True),
                      cluster=busy)[3]
    assert forced.plan.section("bytescheduler").cross_iteration and "DRAIN" in forced.stages[0].graphs
    assert "cross_iteration=True" in forced.explain().splitlines()[0]                 # the user's setting, shown
    off = _program("gpt", ADAMW, fxpar.Strategy(dp=2, comm_schedule="bytescheduler", cross_iteration=False))[3]
    assert not off.plan.section("bytescheduler").cross_iteration and set(off.stages[0].graphs) == {"FULL"}
    assert off.plan.section("bytescheduler").why_not_cross_iteration == "Strategy(cross_iteration=False)"


@pytest.mark.slow
@pytest.mark.numerics
def test_cross_iteration_with_lr_scheduler(clusters):
    """The deferred update uses its own step's learning rate and count, not the next step's."""
    sched = (torch.optim.lr_scheduler.StepLR, {"step_size": 1, "gamma": 0.5})
    model, batches, loss_fn, prog = _program("gpt", ADAMW, fxpar.Strategy(dp=2, comm_schedule="bytescheduler", **SMALL),
                                             lr_scheduler=sched)
    _assert_matches(prog.run_local(batches, cluster=clusters.get(2)), model, batches, loss_fn, ADAMW,
                    lr_scheduler=sched)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("opt,m", [(SGD_M, 2), (ADAMW, 4)], ids=["sgd_momentum-m2", "adamw-m4"])
def test_dp2_pp2_matches_single_process(clusters, opt, m):
    """dp=2 x pp=2, 1F1B, the tied GPT (embedding and LM head share a weight across the stages, summed over all four
    ranks): priority, partitions and credit in each stage's REDUCE_GRAD, and cross-iteration overlap: each stage's
    STEP runs inside its first forward of the next step (F_UPDATE), the last step's in the drain."""
    model, batches, loss_fn, prog = _pp_program(opt, m)
    cs = prog.plan.section("bytescheduler")
    assert cs.cross_iteration and not cs.why_not_cross_iteration and prog.plan.tied and prog.plan.schedule == "1f1b"
    assert all(set(prog.stages[s].graphs) == {"F", "B", "REDUCE_GRAD", "STEP", "F_UPDATE"} for s in range(2))
    assert all(len(e["pieces"]) > len(prog.plan.section("data_parallel").buckets[s]) for s, e in enumerate(cs.stages))   # cut in rows
    _assert_matches(prog.run_local(batches, cluster=clusters.get(4)), model, batches, loss_fn, opt)


@pytest.mark.slow
@pytest.mark.numerics
def test_microbatches_without_a_pipeline(clusters):
    """One stage, two microbatches (graphs F, B, REDUCE_GRAD, STEP): the same move of STEP into the next first F."""
    model, batches, loss_fn, prog = _program("gpt", SGD_M, fxpar.Strategy(dp=2, microbatches=2,
                                                                          comm_schedule="bytescheduler", **SMALL))
    assert prog.plan.section("bytescheduler").cross_iteration and "F_UPDATE" in prog.stages[0].graphs
    _assert_matches(prog.run_local(batches, cluster=clusters.get(2)), model, batches, loss_fn, SGD_M)


@pytest.mark.slow
@pytest.mark.numerics
def test_resume_under_dp_x_pp_is_exact(clusters, tmp_path):
    model, _, loss_fn, prog = _pp_program(ADAMW, 4)
    batches = _batches("gpt", 4)
    lc = clusters.get(4)
    whole, _, _ = assert_resume_is_exact(prog, batches, 2, lc, tmp_path / "ck")       # drains before it saves
    _assert_matches(whole, model, batches, loss_fn, ADAMW)


@pytest.mark.numerics
def test_tuned_partition_and_credit_are_recorded(clusters):
    model, batches, loss_fn, prog = _program("gpt", ADAMW, fxpar.Strategy(dp=2, comm_schedule="bytescheduler"))
    entry = prog.plan.section("bytescheduler").stages[0]
    assert entry["tuned"] == {"partition": "cost model", "credit": "cost model", "tried": entry["tuned"]["tried"]}
    best = min(t[2] for t in entry["tuned"]["tried"])       # the chosen setting: within 2% of the best predicted,
    assert entry["predicted_step_s"] <= 1.02 * best          # the largest partition, then credit, among those
    near = [(p, c) for p, c, t in entry["tuned"]["tried"] if t <= 1.02 * best]
    assert (entry["partition_bytes"], entry["credit_bytes"]) == max(near)
    assert entry["credit_bytes"] >= max(b for _, _, b in _piece_bytes(prog))
    again = fxpar.Plan.from_json(prog.plan.to_json())
    assert again.section("bytescheduler") == prog.plan.section("bytescheduler")
    _assert_matches(prog.run_local(batches, cluster=clusters.get(2)), model, batches, loss_fn, ADAMW)


@pytest.mark.numerics
def test_batchnorm_and_a_handed_back_plan(clusters):
    """BatchNorm buffers (broadcast from dp-rank 0 after each step, as DDP) come out exactly as FIFO's; a Plan handed
    back (its JSON) rebuilds the same graphs and trains the same."""
    from fxpar.testing import BNConvNet
    model = BNConvNet().double()
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g))
               for _ in range(3)]
    lc = clusters.get(2)
    st = fxpar.Strategy(dp=2, comm_schedule="bytescheduler", **SMALL)
    prog = fxpar.parallelize(model, 2, batches[0], F.cross_entropy, SGD_M, strategy=st)
    fifo = fxpar.parallelize(model, 2, batches[0], F.cross_entropy, SGD_M, strategy=fxpar.Strategy(dp=2))
    again = fxpar.parallelize(model, 2, batches[0], F.cross_entropy, SGD_M, strategy=st,
                              plan=fxpar.Plan.from_json(prog.plan.to_json()))
    assert again.plan.section("bytescheduler") == prog.plan.section("bytescheduler")
    assert again.plan.section("data_parallel").buckets == prog.plan.section("data_parallel").buckets
    assert again.stages[0].graphs["FULL"].gm.code == prog.stages[0].graphs["FULL"].gm.code
    ours, theirs, back = (p.run_local(batches, cluster=lc) for p in (prog, fifo, again))
    assert ours.losses == theirs.losses == back.losses
    assert max_abs_diff(ours.state_dict(), theirs.state_dict()) <= 1e-12
    assert max_abs_diff(ours.state_dict(), back.state_dict()) == 0.0


@pytest.mark.numerics
def test_untraced_optimizer_falls_back_and_says_so(clusters):
    opt = (torch.optim.RMSprop, {"lr": 1e-2})
    model, batches, loss_fn, prog = _program("mlp", opt, fxpar.Strategy(dp=2, comm_schedule="bytescheduler", **SMALL))
    cs = prog.plan.section("bytescheduler")
    assert not cs.cross_iteration and "RMSprop" in cs.why_not_cross_iteration
    assert "DRAIN" not in prog.stages[0].graphs
    _assert_matches(prog.run_local(batches, cluster=clusters.get(2)), model, batches, loss_fn, opt)


@pytest.mark.slow
@pytest.mark.numerics
def test_resume_with_cross_iteration_is_exact(clusters, tmp_path):
    model, batches, loss_fn, prog = _program("gpt", ADAMW, fxpar.Strategy(dp=2, comm_schedule="bytescheduler", **SMALL),
                                             n=4)
    lc = clusters.get(2)
    whole, _, _ = assert_resume_is_exact(prog, batches, 2, lc, tmp_path / "ck")
    _assert_matches(whole, model, batches, loss_fn, ADAMW)


# ---- structure --------------------------------------------------------------------------------------
def _piece_bytes(prog, stage=0):
    return [(p, b, n) for p, (b, _, n) in enumerate(_sim_pieces(prog, stage))]


def _sim_pieces(prog, stage=0):
    """(bucket, first row or None, bytes) per piece id, from the Plan's pieces and the parameters' shapes."""
    entry = prog.plan.section("bytescheduler").stages[stage]
    cap = prog.stages[stage].captured
    out = []
    for b, r0, r1 in entry["pieces"]:
        keys = prog.plan.section("data_parallel").buckets[stage][b]
        size = sum(torch.Size(cap.param_shapes[k]).numel() * 8 for k in keys)
        if r0 is not None:
            size = size * (r1 - r0) // cap.param_shapes[keys[0]][0]
        out.append((b, r0, size))
    return out


@pytest.mark.structure
def test_issue_order_follows_priority():
    _, _, _, prog = _program("gpt", ADAMW, fxpar.Strategy(dp=2, comm_schedule="bytescheduler", **SMALL))
    entry = prog.plan.section("bytescheduler").stages[0]
    prio = {b: i for i, b in enumerate(entry["priority"])}
    pieces = entry["pieces"]
    # priority = the order the forward first uses each bucket's parameters: wte (embedding) first
    assert "wte.weight" in prog.plan.section("data_parallel").buckets[0][entry["priority"][0]]
    queue, issued = [], []
    for kind, b, ops in entry["events"]:
        if kind == "ready":
            for p, piece in enumerate(pieces):
                if piece[0] == b:
                    heapq.heappush(queue, (prio[b], p))
        for op, p in ops:
            if op != "issue":
                continue
            if kind == "ready":       # a piece goes only if no queued piece has a higher priority
                assert (prio[pieces[p][0]], p) == queue[0], (kind, b, p, queue[:3])
            queue.remove(next(e for e in queue if e[1] == p))
            heapq.heapify(queue)
            issued.append(p)
    assert sorted(issued) == list(range(len(pieces)))
    # the graphs issue the pieces in exactly that order: FIRST the backward's, DRAIN the rest
    def order(gm):
        return [int(n.args[0].name.split("piece")[1]) if n.args[0].op == "placeholder" else None
                for n in gm.graph.nodes if n.target is C10D.all_reduce_.default]
    drain = [p for p in order(prog.stages[0].graphs["DRAIN"].gm)]
    n_first = len(order(prog.stages[0].graphs["FIRST"].gm))
    assert drain == issued[n_first:]
    sizes = [n.args[0].meta["val"].numel() * 8 for n in prog.stages[0].graphs["FIRST"].gm.graph.nodes
             if n.target is C10D.all_reduce_.default]
    assert sizes == [_sim_pieces(prog)[p][2] for p in issued[:n_first]]


class _InFlight(TorchDispatchMode):
    """On a rank: bytes of gradient pieces issued (all_reduce_) and not yet waited (wait_tensor), at every op."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.issued = {}, 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is C10D.all_reduce_.default:
            n = args[0].numel() * args[0].element_size()
            self.live[args[0].data_ptr()] = n
            self.now += n
            self.peak = max(self.peak, self.now)
            self.issued.append(n)
        elif func is C10D.wait_tensor.default:
            self.now -= self.live.pop(args[0].data_ptr(), 0)
        return out


def _measured_train(payload, batches):
    with _InFlight() as m:
        out = train(payload, batches)
    return {"peak": m.peak, "issued": m.issued, "losses": out["loss_sums"]}


@pytest.mark.slow
@pytest.mark.numerics
def test_inflight_bytes_never_exceed_credit(clusters):
    _, batches, _, prog = _program("gpt", ADAMW, fxpar.Strategy(dp=2, comm_schedule="bytescheduler", **SMALL))
    entry = prog.plan.section("bytescheduler").stages[0]
    got = clusters.get(2).run(_measured_train, [(prog.payload(r, len(batches)), batches) for r in range(2)])
    n = len(entry["pieces"])
    for r in got:
        assert 0 < r["peak"] <= entry["credit_bytes"]
        assert r["peak"] == entry["peak_inflight_bytes"]         # the plan's simulation, step for step
        assert len(r["issued"]) == n * len(batches)              # every piece once per step, drain included
    assert entry["credit_bytes"] == int(0.008 * 2**20)


def _measured_steps(payload, batches):
    from fxpar.runtime.executor import Executor
    ex = Executor(payload)
    with _InFlight() as m:
        carried = []
        for b in batches:
            ex.step(b)
            carried.append(m.now)         # in flight across the step boundary
        ex.drain()
    return {"peak": m.peak, "issued": m.issued, "carried": carried, "drained": m.now}


@pytest.mark.slow
@pytest.mark.numerics
def test_inflight_bytes_under_dp_x_pp(clusters):
    """dp=2 x pp=2: each stage keeps the plan's credit, measured on all four ranks; the pieces REDUCE_GRAD issues and
    the plan waits at a need event are still in flight when the step ends (cross-iteration), none after the drain."""
    _, batches, _, prog = _pp_program(SGD_M)
    got = clusters.get(4).run(_measured_steps, [(prog.payload(r, len(batches)), batches) for r in range(4)])
    for rank, r in enumerate(got):
        (stage,) = prog.plan.rank_stages(rank)
        entry = prog.plan.section("bytescheduler").stages[stage]
        assert 0 < r["peak"] <= entry["credit_bytes"]
        assert r["peak"] == entry["peak_inflight_bytes"]
        assert len(r["issued"]) == len(entry["pieces"]) * len(batches)
        at = {(op, p): kind for kind, _, ops in entry["events"] for op, p in ops}
        size = [n for _, _, n in _sim_pieces(prog, stage)]
        crossing = sum(size[p] for p in range(len(size)) if at[("issue", p)] == "ready" and at[("wait", p)] == "need")
        assert crossing > 0 and r["carried"] == [crossing] * len(batches) and r["drained"] == 0


@pytest.mark.structure
def test_first_forward_op_of_a_layer_depends_only_on_its_wait():
    _, _, _, prog = _program("mlp", SGD_M, fxpar.Strategy(dp=2, comm_schedule="bytescheduler", **SMALL))
    entry = prog.plan.section("bytescheduler").stages[0]
    joint = prog.stages[0].joint       # after the passes, before the update is made in place for the run
    g = joint.graph
    phs = dict(zip(g.find_nodes(op="placeholder"), joint.meta["fxpar_signature"].inputs))
    bucket_of_piece = {f"piece{p}": b for p, (b, _, _) in enumerate(entry["pieces"])}
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    waits = [n for n in nodes if n.target is C10D.wait_tensor.default]

    def ancestors(n):
        seen, stack = set(), [n]
        while stack:
            x = stack.pop()
            if x not in seen:
                seen.add(x)
                stack.extend(x.all_input_nodes)
        return seen

    def carried_bucket(w):
        roots = [a for a in ancestors(w) if phs.get(a, ("",))[0] == "carry"]
        return {bucket_of_piece[phs[a][1]] for a in roots}

    checked = 0
    for k, keys in enumerate(prog.plan.section("data_parallel").buckets[0]):
        params = {a for a, (r, key) in phs.items() if r == "param" and key in keys}
        mm = [n for n in nodes if n.op == "call_function" and n.target in (torch.ops.aten.t.default,
                                                                            torch.ops.aten.addmm.default,
                                                                            torch.ops.aten.mm.default)
              and n.meta.get("fxpar_phase") == "forward" and ancestors(n) & params]
        if not mm:
            continue
        first = min(mm, key=pos.get)
        anc = ancestors(first)
        mine = [w for w in waits if w in anc]
        roots = {bucket_of_piece[phs[a][1]] for a in anc if phs.get(a, ("",))[0] == "carry"}
        assert k in roots, (k, first.name)                       # it reads the updated parameter of its bucket
        assert all(carried_bucket(w) <= roots for w in mine)
        others = [w for w in waits if carried_bucket(w) and carried_bucket(w).isdisjoint(roots)]
        later = [w for w in others if pos[w] > pos[first]]
        assert all(w not in anc for w in others)                 # ... and on no other bucket's wait
        checked += 1
        if k == entry["priority"][0]:                            # the first layer runs before the last one's waits
            assert later, "every other bucket's wait comes before the first layer: no overlap"
    assert checked >= 2
    # the graph the ranks run (update in place): the same order
    sg = prog.stages[0].graphs["FULL"]
    run_nodes = list(sg.gm.graph.nodes)
    run_phs = dict(zip(sg.gm.graph.find_nodes(op="placeholder"), sg.inputs))
    first_keys = prog.plan.section("data_parallel").buckets[0][entry["priority"][0]]
    first_use = next(i for i, n in enumerate(run_nodes) if n.op == "call_function"
                     and n.meta.get("fxpar_phase") == "forward"
                     and any(run_phs.get(a, ("", ""))[1] in first_keys for a in n.all_input_nodes))
    mine = {f"piece{p}" for p, (b, _, _) in enumerate(entry["pieces"]) if b == entry["priority"][0]}
    carried = {i: {run_phs[a][1] for a in _chain(n) if run_phs.get(a, ("",))[0] == "carry"}
               for i, n in enumerate(run_nodes) if n.target is C10D.wait_tensor.default}
    carried = {i: ps for i, ps in carried.items() if ps}
    assert all(i < first_use for i, ps in carried.items() if ps & mine)     # its own waits come first
    assert any(i > first_use for i in carried)       # others' waits come after it: the reduction overlaps forward


@pytest.mark.structure
def test_pipeline_first_forward_op_of_a_layer_depends_only_on_its_wait():
    """dp=2 x pp=2: in each stage's F_UPDATE (its first forward of step t+1; the update runs in place, as without
    overlap) a bucket's update reads that bucket's step-t pieces and no other bucket's wait, and runs before the first
    forward op on its parameters (so that op reads the new weights and, through them, only its own bucket's wait; its
    other input, the activation, comes from the earlier layers, as it must); the plan's need ops come in its order;
    the first bucket's waits come before its first forward op and another bucket's after it (overlap)."""
    _, _, _, prog = _pp_program(SGD_M)
    for s in range(2):
        entry, buckets = prog.plan.section("bytescheduler").stages[s], prog.plan.section("data_parallel").buckets[s]
        graphs = prog.stages[s].graphs
        fu = graphs["F_UPDATE"]
        rg_out = dict(zip([rk[1] for rk in graphs["REDUCE_GRAD"].outputs],
                          graphs["REDUCE_GRAD"].gm.graph.find_nodes(op="output")[0].args[0]))
        nodes = list(fu.gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        phs = dict(zip(fu.gm.graph.find_nodes(op="placeholder"), fu.inputs))
        param = {key: n for n, (r, key) in phs.items() if r == "param"}

        def rg_bucket(ph):       # a pending input: the bucket of the all_reduce_ REDUCE_GRAD issued it with, if any
            found = [n.meta["fxpar_bucket"] for n in _chain(rg_out[phs[ph][1]]) if n.target is C10D.all_reduce_.default]
            return found[0] if found else None

        def bucket_of(n):        # a wait's piece: issued here (all_reduce_) or in REDUCE_GRAD (a pending input)
            a = n.args[0]
            return a.meta["fxpar_bucket"] if a.target is C10D.all_reduce_.default else rg_bucket(a)

        waits = [n for n in nodes if n.target is C10D.wait_tensor.default]
        assert all(bucket_of(w) is not None for w in waits)
        first_at = {}
        for b, keys in enumerate(buckets):
            users = [u for k in keys for u in param[k].users]
            update = [u for u in users if u.meta.get("fxpar_phase") == "optimizer"]
            fwd = [u for u in users if u.meta.get("fxpar_phase") == "forward"]
            writes = {k for u in update for k in keys if u.target._schema.name.startswith("aten::_foreach_")
                      and u.target._schema.name.endswith("_") and param[k] in u.args[0]}
            assert writes == set(keys)                                 # every weight updated in place
            if not fwd:
                continue
            first = min(fwd, key=pos.get)
            first_at[b] = pos[first]
            assert max(pos[u] for u in update) < pos[first]            # the forward reads the updated weights
            anc = set().union(*(_chain(u) for u in update))
            assert {bucket_of(w) for w in waits if w in anc} <= {b}
            pending = {rg_bucket(a) for a in anc if phs.get(a, ("",))[0] == "pending"}
            assert b in pending | {bucket_of(w) for w in waits if w in anc}, (s, b)   # it does read its own pieces
            assert all(pos[w] < pos[first] for w in waits if bucket_of(w) == b)
        assert len(first_at) >= 3
        kinds = ["issue" if n.target is C10D.all_reduce_.default else "wait" for n in nodes
                 if n.target in (C10D.all_reduce_.default, C10D.wait_tensor.default)]
        assert kinds == [op for kind, _, ops in entry["events"] if kind == "need" for op, _ in ops]
        # the tied weight's pieces, which the other stage waits on too, are issued in their own step (REDUCE_GRAD)
        tied = {b for b, keys in enumerate(buckets) if set(keys) & set(prog.plan.tied)}
        assert tied and all(kind == "ready" for kind, _, ops in entry["events"] for op, p in ops
                            if op == "issue" and entry["pieces"][p][0] in tied)
        top = entry["priority"][0]
        assert any(pos[w] > first_at[top] for w in waits if bucket_of(w) != top), s


def _chain(n):
    out, stack = set(), [n]
    while stack:
        x = stack.pop()
        if x not in out:
            out.add(x)
            stack.extend(x.all_input_nodes)
    return out


# ---- bad input --------------------------------------------------------------------------------------
@pytest.mark.structure
def test_credit_below_the_largest_piece_is_refused():
    # pieces of 2 KiB at most, but a row of blocks.*.fc2.weight (16 x 64 float64) is 512 bytes: indivisible
    with pytest.raises(StrategyError, match=r"credit_mb=.*largest piece, 512 bytes: the gradient "
                                            r"'blocks\.\d\.fc2\.weight' \(shape \(16, 64\)\).*indivisible"):
        _program("gpt", ADAMW, fxpar.Strategy(dp=2, comm_schedule="bytescheduler", partition_mb=0.0005, credit_mb=0.0001))
    with pytest.raises(StrategyError, match=r"bucket of \d+ gradients.*raise credit_mb to at least"):
        _program("gpt", ADAMW, fxpar.Strategy(dp=2, comm_schedule="bytescheduler", partition_mb=1, credit_mb=0.001))


@pytest.mark.structure
def test_bad_settings_are_refused():
    with pytest.raises(StrategyError, match="not yet composed"):
        fxpar.Strategy(dp=2, zero=1, comm_schedule="bytescheduler")
    with pytest.raises(StrategyError, match="comm_schedule='bytescheduler'"):
        fxpar.Strategy(dp=2, credit_mb=1.0)
    with pytest.raises(StrategyError, match="positive number of MiB"):
        fxpar.Strategy(dp=2, comm_schedule="bytescheduler", partition_mb=0)
    with pytest.raises(StrategyError, match="choose one of"):
        fxpar.Strategy(dp=2, comm_schedule="lifo")
    with pytest.raises(StrategyError, match=r"cross_iteration=True\) is a ByteScheduler setting"):
        fxpar.Strategy(dp=2, cross_iteration=True)
    with pytest.raises(StrategyError, match="True, False, or None"):
        fxpar.Strategy(dp=2, comm_schedule="bytescheduler", cross_iteration="yes")
    with pytest.raises(StrategyError, match="delayed update carries"):
        fxpar.Strategy(dp=2, delayed_update=True, cross_iteration=False)
    with pytest.raises(StrategyError, match="drop one of them"):
        fxpar.Strategy(dp=2, comm_schedule="bytescheduler", grad_order="priority", cross_iteration=False)


# ---- the simulation the plan comes from (cost_models/comm_tuning.py) ----------------------------------
@pytest.mark.structure
def test_simulated_plan_keeps_its_invariants():
    import random

    from cost_models.comm_tuning import BucketTiming, simulate
    for seed in range(100):
        r = random.Random(seed)
        n = r.randint(1, 8)
        bts = [BucketTiming(b * 0.01, r.random() * 0.05, [r.randint(1, 5) * 1000 for _ in range(r.randint(1, 4))],
                            eager=r.random() < 0.3) for b in range(n)]
        for i, b in enumerate(sorted(range(n), key=lambda b: bts[b].need_s)):
            bts[b].priority = i
        credit = max(x for bt in bts for x in bt.pieces) * r.randint(1, 4)
        early = seed % 4 == 1                     # cross-iteration with early updates (a fused step)
        res = simulate(bts, 0.05, 0.1, lambda x: 1e-4 + x / 1e6, credit, cross=bool(seed % 2), t_opt=0.01, early=early)
        used, issued, waited, updated = 0, set(), set(), []
        for kind, b, ops in res.events:
            for op, p in ops:
                if op == "update":                # a bucket is updated once, after all of its pieces are waited
                    assert early and p not in updated
                    assert {q for q, (pb, _, _) in enumerate(res.pieces) if pb == p} <= waited
                    updated.append(p)
                elif op == "issue":
                    assert p not in issued
                    issued.add(p)
                    used += res.pieces[p][2]
                    assert used <= credit
                else:
                    assert p in issued and p not in waited
                    waited.add(p)
                    used -= res.pieces[p][2]
            if kind == "need":      # every piece of the bucket is waited by its need event (and it is updated)
                assert {p for p, (pb, _, _) in enumerate(res.pieces) if pb == b} <= waited
                assert not early or b in updated
            elif kind == "ready" and bts[b].eager:      # ... and an eager bucket's are all issued at its ready event
                assert {p for p, (pb, _, _) in enumerate(res.pieces) if pb == b} <= issued
        assert issued == waited == set(range(len(res.pieces)))
        assert sorted(updated) == (list(range(n)) if early else [])
        assert [k for k, _, _ in res.events].count("start") == (1 if early else 0)


@pytest.mark.structure
def test_issue_cost_is_paid_per_piece_and_steers_the_partition():
    """``DeviceSpec.collective_issue_s`` (the rank's CPU per collective issued): the simulated step pays it once per
    piece, and when it is dear the tuner cuts fewer pieces (here the same step otherwise)."""
    from cost_models.comm_tuning import BucketTiming, plan_stage, simulate
    bts = [BucketTiming(0.0, 0.0, [1000, 1000, 1000])]
    comm = lambda x: 1e-6 * x / 1000        # noqa: E731
    base = simulate(bts, 0.05, 0.1, comm, 3000, cross=False)
    assert simulate(bts, 0.05, 0.1, comm, 3000, cross=False, issue_s=2e-3).step_s == pytest.approx(base.step_s + 6e-3)
    shapes = {"wte": (4096, 64), "fc": (4096, 64), "ln": (64,)}          # float64: 2 MiB each
    tm = {"t_fwd": 0.03, "t_bwd": 0.02, "t_opt": 0.0, "ready": {"fc": 0.012, "ln": 0.015, "wte": 0.02},
          "need": {"wte": 0.0, "ln": 0.004, "fc": 0.025}}

    def plan(issue_s):
        return plan_stage(dict(tm, issue_s=issue_s), lambda part: [["fc"], ["ln"], ["wte"]], shapes.get, lambda k: 8,
                          lambda n: 1e-5 + n / 1e8, True, [["fc", "ln", "wte"]])[0]
    free, dear = plan(0.0), plan(5e-3)
    assert len(dear["pieces"]) < len(free["pieces"])      # free issues: wte cut so its first rows go first
    n = len(dear["pieces"])
    bare = plan_stage(tm, lambda part: [["fc"], ["ln"], ["wte"]], shapes.get, lambda k: 8, lambda n: 1e-5 + n / 1e8, True,
                      [["fc", "ln", "wte"]], dear["partition_bytes"], dear["credit_bytes"])[0]["predicted_step_s"]
    # the same plan pays each piece's CPU where the rank computes; where it waits for the piece the wait hides it
    assert bare - 1e-12 <= dear["predicted_step_s"] <= bare + n * 5e-3 + 1e-12


@pytest.mark.structure
def test_a_pieces_cpu_runs_beside_its_transfer():
    """``cpu_per_byte`` (what moving a byte takes from a rank's compute on full cores): on the compute lane from the
    issue, beside the transfer. A piece the rank waits for at once costs max(its CPU, its transfer); one that
    overlaps compute costs its CPU."""
    from cost_models.comm_tuning import BucketTiming, simulate
    comm = lambda x: x / 1e8        # noqa: E731   10 ms per MB
    one = [BucketTiming(0.1, 0.0, [10**6])]           # made at the end of backward, waited at once (FIFO)
    for cpb in (0.5e-8, 2e-8):                        # CPU 5 ms (under the 10 ms transfer) or 20 ms (over it)
        got = simulate(one, 0.05, 0.1, comm, 10**6, False, cpu_per_byte=cpb).step_s
        assert got == pytest.approx(0.15 + max(cpb * 10**6, 0.01))
    early = [BucketTiming(0.0, 0.04, [10**6])]        # made first in backward, on the wire while backward runs
    got = simulate(early, 0.05, 0.1, comm, 10**6, False, cpu_per_byte=0.5e-8).step_s
    assert got == pytest.approx(0.15 + 0.005)


@pytest.mark.structure
def test_tied_gradient_is_cut_alike_on_every_stage():
    """A bucket on a group several stages share (a tied weight) is cut only at the partition asked for, never at one
    tuned per stage (each stage must make the same collectives), and under cross-iteration issued in its own step."""
    from cost_models.comm_tuning import plan_stage
    shapes = {"wte": (4096, 64), "fc": (4096, 64), "ln": (64,)}          # float64: 2 MiB each
    tm = {"t_fwd": 0.03, "t_bwd": 0.02, "t_opt": 0.0, "ready": {"fc": 0.012, "ln": 0.015, "wte": 0.02},
          "need": {"wte": 0.0, "ln": 0.004, "fc": 0.025}}

    def plan(partition, tied):
        return plan_stage(tm, lambda part: [["fc"], ["ln"], ["wte"]], shapes.get, lambda k: 8, lambda n: 1e-5 + n / 1e8,
                          True, [["fc", "ln", "wte"]], partition, None, shared=lambda keys: tied and keys == ["wte"])[0]

    def cuts(entry, b):
        return [p[1:] for p in entry["pieces"] if p[0] == b]
    alone = plan(None, False)          # untied, the tuned partition (1 MiB here) cuts it
    assert alone["tuned"]["partition"] == "cost model" and len(cuts(alone, 2)) > 1
    tuned = plan(None, True)
    assert cuts(tuned, 2) == [[None, None]]
    given = plan(2**20, True)
    assert cuts(given, 2) == [[0, 2048], [2048, 4096]]
    for entry in (tuned, given):
        issued_at = {p: kind for kind, _, ops in entry["events"] for op, p in ops if op == "issue"}
        assert all(issued_at[p] == "ready" for p, piece in enumerate(entry["pieces"]) if piece[0] == 2)


@pytest.mark.structure
def test_early_update_runs_while_the_first_bucket_is_on_the_wire():
    """Cross-iteration with early updates (a fused step): the bucket that landed during backward (a, needed late)
    is updated at the next step's start, inside the time the rank would wait for the first-needed bucket (b, made
    last in backward), so its share of the optimizer is hidden: the step is shorter by exactly that share."""
    from cost_models.comm_tuning import BucketTiming, simulate
    comm = lambda x: 0.02            # noqa: E731   each piece 20 ms on the link
    a, b = BucketTiming(0.0, 0.04, [1000], priority=1), BucketTiming(0.1, 0.0, [1000], priority=0)
    late = simulate([a, b], 0.05, 0.1, comm, 2000, True, t_opt=0.02)
    early = simulate([a, b], 0.05, 0.1, comm, 2000, True, t_opt=0.02, early=True)
    # b leaves at the end of backward (0.15) and lands at 0.17: 20 ms of stall; a's update (10 ms) fills half of it
    assert late.step_s == pytest.approx(0.05 + 0.1 + 0.02 + 0.02)
    assert early.step_s == pytest.approx(0.05 + 0.1 + 0.02 + 0.01)
    start = next(ops for kind, _, ops in early.events if kind == "start")
    assert ("update", 0) in start and all(op != "update" for kind, _, ops in late.events for op, _ in ops)


@pytest.mark.structure
def test_early_updates_in_the_graph():
    """The plan's early updates are where the graph runs them: a bucket updated at ``start`` has its whole update
    before the first forward op of the steady step (FULL), and one updated inside another's need event comes before
    that event's first forward op; the updates write the parameters in place."""
    _, _, _, prog = _program("gpt", ADAMW, fxpar.Strategy(dp=2, comm_schedule="bytescheduler", **SMALL))
    entry = prog.plan.section("bytescheduler").stages[0]
    buckets = prog.plan.section("data_parallel").buckets[0]
    at_start = [p for kind, _, ops in entry["events"] if kind == "start" for op, p in ops if op == "update"]
    assert at_start, "the tiny plan updates some bucket early"
    sg = prog.stages[0].graphs["FULL"]
    nodes = list(sg.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    phs = dict(zip(sg.gm.graph.find_nodes(op="placeholder"), sg.inputs))
    first_fwd = min(pos[n] for n in nodes if n.op == "call_function" and n.meta.get("fxpar_phase") == "forward")
    param = {key: n for n, (r, key) in phs.items() if r == "param"}
    for b in at_start:
        writes = [u for k in buckets[b] for u in param[k].users if u.meta.get("fxpar_phase") == "optimizer"]
        assert writes and max(pos[u] for u in writes) < first_fwd, b


@pytest.mark.structure
def test_cross_iteration_update_runs_in_place_as_fifo_does():
    """The steady step's optimizer, cut per bucket and moved into the next forward, runs in place wherever the FIFO
    program's does: moving nodes leaves dead views (a ``detach`` nobody reads) behind at the end of the graph, which
    must not count as a later read (they kept AdamW's ``_foreach_div`` on the sqrt out of place: a fresh
    buffer a bucket a step)."""
    def out_of_place(strategy):       # AdamW as list ops (fused=False): the default fuses each bucket's chain whole
        _, _, _, prog = _program("gpt", (torch.optim.AdamW, {**ADAMW[1], "fused": False}), strategy)
        gm = prog.stages[0].graphs["FULL"].gm
        return {str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "_foreach_" in str(n.target)
                and not str(n.target).split(".")[-2].endswith("_")}
    fifo = out_of_place(fxpar.Strategy(dp=2))
    bs = out_of_place(fxpar.Strategy(dp=2, comm_schedule="bytescheduler", **SMALL))
    assert fifo and bs <= fifo and "aten._foreach_div.Tensor" not in bs, (bs, fifo)


@pytest.mark.structure
def test_simulated_step_time_closed_forms():
    from cost_models.comm_tuning import BucketTiming, simulate
    comm = lambda x: 1e-3 + x / 1e8       # noqa: E731   alpha + bytes / beta
    one = [BucketTiming(0.1, 0.0, [10**6])]                 # one bucket, ready at the end of backward
    # FIFO at the optimizer: forward + backward + the whole transfer + the update
    assert abs(simulate(one, 0.05, 0.1, comm, 10**6, False, 0.01).step_s - (0.16 + comm(10**6))) < 1e-12
    # cross-iteration: the next forward first uses it need_s in, so that much of the transfer is hidden
    for need_s in (0.005, 0.02):
        got = simulate([BucketTiming(0.1, need_s, [10**6])], 0.05, 0.1, comm, 10**6, True, 0.01).step_s
        assert abs(got - (0.16 + max(0.0, comm(10**6) - need_s))) < 1e-12
