"""Accordion (Agarwal et al., MLSys 2021, Algorithm 1) over PowerSGD: the per-layer switch on the host, its log, and
its sums on real gloo ranks (float64): with every layer always critical (threshold 0) it is PowerSGD at the high
rank, bit for bit; with none critical every layer drops to the low rank after the first comparison."""
import json

import pytest
import torch
import torch.distributed as dist

from fxpar.compress.accordion import Accordion
from fxpar.compress.method import Comm
from fxpar.compress.powersgd import PowerSGD
from fxpar.errors import StrategyError

from test_compress_powersgd import bucket_infos, local_grads, model_and_data, program

NUMERICS, STRUCTURE = pytest.mark.numerics, pytest.mark.structure


def _steps(method, infos, steps, comm):
    gen = torch.Generator().manual_seed(0)
    states = [method.init_state(b, gen) for b in infos]
    outs, variants, drawn = [], [], []
    for step in range(steps):
        row = []
        for b in infos:
            v = method.variant(b, step, states[b.index])
            ins = method.host_inputs(b, step, states[b.index], v, gen)
            rng = states[b.index]["rng"]
            s, states[b.index] = method.sum(local_grads(b, step, comm.rank) / comm.size, states[b.index], ins, b,
                                            comm, v)
            row.append(s)
            variants.append(v)
            drawn.append(not torch.equal(rng, states[b.index]["rng"]))   # the seed generator moved: Qs drawn afresh
        outs.append(row)
    return outs, states, variants, drawn


def _always_critical_is_high(kind, steps):
    world, rank = dist.get_world_size(), dist.get_rank()
    comm = Comm(world, rank, group=dist.group.WORLD.group_name)
    infos = bucket_infos(kind, 2, world, rank)
    high = PowerSGD(rank=2, start_iter=2, min_compression_rate=1.0)
    acc = Accordion(low=PowerSGD(rank=1, start_iter=2, min_compression_rate=1.0), high=high, threshold=0.0,
                    interval=2)
    a, states, variants, _ = _steps(acc, infos, steps, comm)
    p, _, _, _ = _steps(high, infos, steps, comm)
    same = all(torch.equal(x, y) for ra, rp in zip(a, p) for x, y in zip(ra, rp))
    logs = [acc.switch_log(b, s) for b, s in zip(infos, states)]
    return same, logs, sorted({v[2] for v in variants})


@NUMERICS
@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_always_critical_equals_powersgd_at_the_high_rank(clusters, kind):
    for same, logs, boundaries in clusters.get(2).run(_always_critical_is_high, [(kind, 7)] * 2):
        assert same
        assert logs == [[], []]
        assert boundaries == [False, True]          # decisions were taken (at steps 2, 4, 6), and kept every layer high


def _never_critical_goes_low(steps):
    world, rank = dist.get_world_size(), dist.get_rank()
    comm = Comm(world, rank, group=dist.group.WORLD.group_name)
    infos = bucket_infos("mlp", 1, world, rank)
    acc = Accordion(low=PowerSGD(rank=1, start_iter=2, min_compression_rate=1.0),
                    high=PowerSGD(rank=2, start_iter=2, min_compression_rate=1.0), threshold=1e9, interval=2)
    outs, states, variants, drawn = _steps(acc, infos, steps, comm)
    b = infos[0]
    return (acc.switch_log(b, states[0]), [acc.wire_bytes(b, v) for v in variants],
            [v[0] for v in variants], drawn, float(outs[-1][0].abs().max()), b.keys)


@NUMERICS
def test_never_critical_drops_every_layer_to_the_low_rank(clusters):
    """threshold 1e9: no change is large enough. Steps 0-1 plain all-reduce; 2-3 high (critical at start); step 2
    ends the first interval (nothing to compare yet); step 4 compares two intervals: every tensor goes low, the step
    starts the Qs afresh at the new ranks, and the bytes drop."""
    res = clusters.get(2).run(_never_critical_goes_low, [(7,)] * 2)
    assert res[0][0] == res[1][0]                   # every rank took the same decisions
    log, wire, phases, drawn, size, keys = res[0]
    # every tensor is logged going low (a vector is sent whole at either rank: its switch changes no bytes)
    assert log == [(4, k, "low") for k in keys]
    assert phases == ["allreduce"] * 2 + ["compressed"] * 5
    # the Qs are drawn afresh at the first compressed step and at the switch, and warm-started between
    assert drawn == [False, False, True, False, True, False, False]
    assert wire[4] < wire[3] and wire[4] == wire[6]
    assert 0 < size < float("inf")


# ---- the host's decision, no ranks ----

def _state_with(acc_method, info, prev, cur_scale):
    st = acc_method.init_state(info, torch.Generator())
    st["prev_norm"] = torch.tensor(prev, dtype=torch.float64)
    acc = torch.zeros(info.numel, dtype=torch.float64)
    for v, c in zip(info.views(acc), cur_scale):
        v.fill_(c)
    st["acc"] = acc
    return st


@STRUCTURE
def test_decision_is_algorithm_1():
    """|old - new| / old >= threshold: critical (high); below: low; no previous interval: as it is."""
    info = bucket_infos("mlp", 1, 2, 0)[0]
    m = Accordion(threshold=0.5, interval=5)
    norms = [float(torch.tensor(1.0).repeat(int(torch.Size(s).numel())).norm()) for s in info.shapes]
    # tensor i: the previous norm makes the relative change 0.6, 0.4, 0.55, none, 0.1, 0.9
    changes = [0.6, 0.4, 0.55, None, 0.1, 0.9]
    prev = [-1.0 if c is None else n / (1 - c) for n, c in zip(norms, changes)]
    st = _state_with(m, info, prev, [1.0] * len(norms))
    phase, settings, boundary = m.variant(info, 10, st)
    assert boundary and settings == (True, False, True, True, False, True)
    assert m.variant(info, 11, st)[2] is False and m.variant(info, 11, st)[1] == (True,) * 6
    ins = m.host_inputs(info, 10, st, (phase, settings, boundary), torch.Generator())
    assert torch.allclose(ins[0], torch.tensor(norms, dtype=torch.float64))
    assert ins[1].tolist() == [1, 0, 1, 1, 0, 1]
    assert int(ins[3][0]) == 2 and ins[2][:2].tolist() == [[10, 1, 0], [10, 4, 0]]


@STRUCTURE
def test_options_round_trip_and_refusals():
    m = Accordion(low=PowerSGD(rank=1, start_iter=4), high=PowerSGD(rank=4, start_iter=4), threshold=0.3,
                  interval=7)
    assert Accordion.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    for bad, words in [(dict(low=PowerSGD(rank=1, start_iter=3)), "start_iter"),
                       (dict(low=PowerSGD(rank=3)), "swap them"),
                       (dict(threshold=-0.1), "threshold"),
                       (dict(interval=0), "interval"),
                       (dict(high=2), "PowerSGD"),
                       (dict(low=PowerSGD(rank=0)), "rank")]:
        with pytest.raises(StrategyError, match=words):
            Accordion(**bad).check(2)


# ---- end to end ----

@NUMERICS
@pytest.mark.slow
def test_run_local_always_critical_equals_powersgd_high(clusters):
    model, batches, loss_fn = model_and_data("gpt", 6)
    high = PowerSGD(rank=2, start_iter=2)
    acc = Accordion(low=PowerSGD(rank=1, start_iter=2), high=high, threshold=0.0, interval=2)
    a = program(model, batches, loss_fn, acc).run_local(batches, cluster=clusters.get(2))
    p = program(model, batches, loss_fn, high).run_local(batches, cluster=clusters.get(2))
    assert a.losses == p.losses
    pa = a.state_dict()
    for k, v in p.state_dict().items():
        assert torch.equal(v, pa[k]), k


@NUMERICS
@pytest.mark.slow
def test_run_local_switches_and_resumes(clusters, tmp_path):
    """threshold 1e9 on the MLP: every matrix drops to rank 1 at step 4; checkpointed after step 5 (the settings,
    norms, log and accumulation in the state), resumed, the rest equals the straight run bitwise."""
    model, batches, loss_fn = model_and_data("mlp", 8)
    acc = Accordion(low=PowerSGD(rank=1, start_iter=2), high=PowerSGD(rank=2, start_iter=2), threshold=1e9,
                    interval=2)
    lc = clusters.get(2)
    straight = program(model, batches, loss_fn, acc).run_local(batches, cluster=lc)
    high = program(model, batches, loss_fn, acc.high).run_local(batches, cluster=lc)
    assert straight.losses[:5] == high.losses[:5] and straight.losses[5:] != high.losses[5:]
    # the switch log reaches the result: every rank made the same switches, each tensor to "low" at step 4 (the
    # decision is per tensor; a vector is sent whole at either setting)
    logs = {r: straight.features[r]["accordion"] for r in range(2)}
    assert logs[0] == logs[1] and logs[0]
    switched = [row for rep in logs[0].values() for row in rep["log"]]
    assert sum(rep["count"] for rep in logs[0].values()) == len(switched) > 0
    assert {k for _, k, _ in switched} == set(model.state_dict()) and {(s, to) for s, _, to in switched} == {(4, "low")}
    program(model, batches, loss_fn, acc).run_local(batches[:5], cluster=lc, save_to=tmp_path / "ck")
    resumed = program(model, batches, loss_fn, acc).run_local(batches[5:], cluster=lc, resume_from=tmp_path / "ck")
    assert resumed.losses == straight.losses[5:]
