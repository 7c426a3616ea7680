"""Synchronisation methods with tensor parallelism inside each replica: ``Strategy(dp=2, tp=2, sharding="megatron",
sync=...)``.

Each tp rank averages its own shards over its dp group (the dp ranks at its tp coordinate), the outer optimizer's
state per shard; a replica's tp ranks average after the same step's update. Averaging and the outer steps are
elementwise, so tp changes only the rounding of the forward and backward: dp=2 x tp=2 equals the same method at dp=2
without tp to 1e-10 in the losses and in every replica's parameters, gathered from its tp ranks' pieces, over seven
steps (the warm-up's gradient all-reduce, then three averagings: the warm-up boundary and two whole periods;
SlowMo over two microbatches; DiLoCo under Mesh-TensorFlow layouts, the others under the Megatron preset). The
averaging all-reduces each rank's shard bytes once per averaging, over its dp group; ``estimate()`` counts the shard
bytes over the period in place of the gradient bucket's all-reduce, ``explain()`` and ``program.schedule`` say the
same bytes. A checkpoint in the middle of a window resumes every rank's pieces, its outer state included, bitwise.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import fxpar
from fxpar import sync as S
from fxpar.feature import get_feature
from fxpar.testing import gpt_loss, tiny_gpt
from fxpar.testing.batches import token_batches

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
NESTEROV = (torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})
STEPS = 7

METHODS = {
    "LocalSGD": S.LocalSGD(period=2, warmup_steps=1),
    "LocalSGD-hierarchical": S.LocalSGD(warmup_steps=1, hierarchical={2: 1, 3: 2}),
    "DiLoCo": S.DiLoCo(period=2, warmup_steps=1, outer=NESTEROV),
    "DiLoCo-streaming": S.DiLoCo(period=4, warmup_steps=1, fragments=2, delay=1, outer=NESTEROV),
    "SlowMo": S.SlowMo(period=2, warmup_steps=1, slow_lr=1.0, slow_momentum=0.5),
    "AsyncAveraging-every-steps": S.AsyncAveraging(every_steps=2, warmup_steps=1),
    # the Euclidean map with full mixing, replica 0 taking both microbatches every round, replica 1 its first
    "DABMD-euclidean": S.DABMD(round_time_s=None, fixed_microbatches=(2, 1)),
}


# Mesh-TensorFlow layouts (the rest propagated: fc's bias and fc2 split with them), the embedding split by width
LAYOUTS = {"blocks.*.fc.weight": ("tp", None), "wte.weight": (None, "tp")}


def _program(method, tp: int, n: int = 1, dp: int = 2, sharding="megatron", **strategy):
    batches = token_batches(max(n, 1))
    extra = dict(tp=tp, sharding=sharding) if tp > 1 else {}
    return fxpar.parallelize(tiny_gpt(), fxpar.ClusterSpec.local(dp * tp), batches[0], loss_fn=gpt_loss,
                             optimizer=SGD_M, strategy=fxpar.Strategy(dp=dp, sync=method, **extra, **strategy))


def _layouts(prog) -> dict:
    """``{key: [mesh axis or None per dim]}``: how the tp mode split each parameter."""
    return prog.plan.section("tensor_parallel").stages[0]["params"]


def _gathered(res, layouts: dict, dp: int, tp: int) -> list:
    """Per dp replica, its parameters whole: the pieces its tp ranks hold (rank = dp index * tp + tp index), joined
    along each split dim; the copies tp keeps whole must be the same bits on every tp rank of the replica."""
    out = []
    for d in range(dp):
        pieces = [res.features[d * tp + i]["sync"]["replica"] for i in range(tp)]
        whole = {}
        for k, v in pieces[0].items():
            dims = layouts[k]
            split = [i for i, a in enumerate(dims) if a is not None]
            if not split:
                assert all(torch.equal(v, p[k]) for p in pieces[1:]), (d, k)
                whole[k] = v
                continue
            (dim,) = split
            whole[k] = torch.cat([p[k] for p in pieces], dim=dim)
        out.append(whole)
    return out


def _shard_bytes(prog) -> int:
    """Formula: a split parameter's numel / tp, a whole one's numel, 8 bytes each (float64)."""
    tp, cap = prog.plan.tp, prog.stages[0].captured
    return sum(int(torch.Size(cap.param_shapes[k]).numel()) // (tp if any(dims) else 1) * 8
               for k, dims in _layouts(prog).items())


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(METHODS))
def test_dp2_tp2_equals_dp2(clusters, name):
    method = METHODS[name]
    batches = token_batches(STEPS)
    # SlowMo: the gradients accumulated over two microbatches; DABMD: a replica takes them microbatch by microbatch
    extra = {"microbatches": 2} if name in ("SlowMo", "DABMD-euclidean") else {}
    plain = _program(method, 1, **extra).run_local(batches, cluster=clusters.get(2))
    prog = _program(method, 2, sharding=LAYOUTS if name == "DiLoCo" else "megatron", **extra)
    res = prog.run_local(batches, cluster=clusters.get(4), measure_comm=True)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(plain.losses), rtol=1e-10, atol=1e-10)
    want = [plain.features[d]["sync"]["replica"] for d in range(2)]
    for d, got in enumerate(_gathered(res, _layouts(prog), 2, 2)):
        assert sorted(got) == sorted(want[d])
        for k in got:
            torch.testing.assert_close(got[k], want[d][k], rtol=1e-10, atol=1e-10, msg=f"{name} replica {d} {k}")
    averaged = plain.features[0]["sync"]["averaged_steps"]
    assert res.features[3]["sync"]["averaged_steps"] == averaged == method.averaging_steps(STEPS)
    assert len(averaged) >= 3
    # state_dict(): the replicas' average, whole
    sd, want_sd = res.state_dict(), plain.state_dict()
    for k in want_sd:
        torch.testing.assert_close(sd[k], want_sd[k], rtol=1e-10, atol=1e-10)
    # every rank's averaging: one all-reduce of its own pieces (the shard), over its dp group
    shard = _shard_bytes(prog)
    for r in range(4):
        held = sum(v.numel() * v.element_size() for v in res.features[r]["sync"]["replica"].values())
        assert held == shard < sum(v.numel() * 8 for v in want[0].values())
        assert prog.payload(r).features["sync"][1].dp_ranks == (r % 2, r % 2 + 2)
    if name == "LocalSGD":          # steps: 0 warm-up; averagings after 1, 3, 5; 2, 4, 6 local
        for r in range(4):
            calls = res.comm_calls[r]
            local = Counter(calls[2])
            assert Counter(calls[4]) == Counter(calls[6]) == local
            assert Counter(calls[0]) - local == Counter({("all_reduce", shard): 1})    # the gradient bucket
            for t in (1, 3, 5):
                assert Counter(calls[t]) - local == Counter({("all_reduce", shard): 1}), (r, t)
                assert calls[t][-1] == ("all_reduce", shard)                         # after the update
                assert res.comm_groups[r][t][-1] == (r % 2, r % 2 + 2)              # over the rank's dp group
            for t in range(STEPS):                # tp's all-reduces inside a step: over the replica's tp pair
                tp_pair = (r - r % 2, r - r % 2 + 1)
                assert set(res.comm_groups[r][t]) <= {tp_pair, (r % 2, r % 2 + 2)}
                assert tp_pair in res.comm_groups[r][t] and len(res.comm_groups[r][t]) == len(calls[t])


@pytest.mark.numerics
def test_dabmd_budget_tp_ranks_of_a_replica_take_the_same_microbatches(clusters):
    """DABMD under a time budget at dp=2 x tp=2, the first tp rank of replica 1 four times as slow: each rank's clock
    decides, and the replica's tp ranks max-reduce their stop flag over their group, so every round they take the
    same microbatches (unequal counts would pair one rank's tp collectives with another microbatch's) and the run
    ends. ``estimate()`` prices a replica at its slowest tp rank's count."""
    batches = token_batches(3)
    method = S.DABMD(round_time_s=0.01)
    prog = fxpar.parallelize(tiny_gpt(), fxpar.ClusterSpec.local(4, slowdown={2: 4.0}), batches[0], loss_fn=gpt_loss,
                             optimizer=(torch.optim.SGD, {"lr": 0.1}),
                             strategy=fxpar.Strategy(dp=2, tp=2, sharding="megatron", microbatches=4, sync=method))
    assert prog.plan.groups["sync_replica"] == [[0, 1], [2, 3]]
    res = prog.run_local(batches, cluster=clusters.get(4))
    taken = [res.features[r]["sync"]["microbatches_taken"] for r in range(4)]
    assert len(taken[0]) == 3 and taken[0] == taken[1] and taken[2] == taken[3], taken
    assert all(1 <= k <= 4 for row in taken for k in row)
    # by the cost model, rank 2 admits one microbatch within 10 ms and rank 3 all four: replica 1 is priced at one
    note = prog.estimate().notes[-1]
    assert note.startswith("DABMD, a budget of 10 ms per round: ranks 0, 1: 4 of 4 microbatch(es)"), note
    assert "rank 2: 1 of 4 microbatch(es)" in note and "rank 3: 1 of 4 microbatch(es)" in note, note


@pytest.mark.numerics
def test_checkpoint_in_a_window_resumes_every_tp_rank_bitwise(clusters, tmp_path):
    """DiLoCo (outer Nesterov state per shard), H=3, W=1: averagings after steps 1 and 4; saved after step 2, three
    more steps equal six straight, bitwise, on every rank's pieces."""
    method = S.DiLoCo(period=3, warmup_steps=1, outer=NESTEROV)
    batches = token_batches(6)
    prog = _program(method, 2)
    straight = prog.run_local(batches, cluster=clusters.get(4))
    prog.run_local(batches[:3], cluster=clusters.get(4), save_to=tmp_path / "ck")
    resumed = prog.run_local(batches[3:], cluster=clusters.get(4), resume_from=tmp_path / "ck")
    assert resumed.losses == straight.losses[3:]
    assert resumed.features[0]["sync"]["averaged_steps"] == straight.features[0]["sync"]["averaged_steps"] == [1, 4]
    for r in range(4):
        a, b = straight.features[r]["sync"]["replica"], resumed.features[r]["sync"]["replica"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), r
    sa, sb = straight.state_dict(), resumed.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.structure
def test_estimate_explain_and_schedule_count_the_shard_per_period():
    """LocalSGD(period=4, warmup_steps=2) at dp=2 x tp=2: the dp collective of every rank is over its dp group, the
    shard's bytes over 4 steps; estimate() differs from plain dp x tp by exactly that in place of the gradient
    bucket's all-reduce; explain() and the schedule's window name the shard bytes; hierarchical groups are cut from
    each tp coordinate's dp group."""
    method = S.LocalSGD(period=4, warmup_steps=2)
    prog = _program(method, 2)
    plain = _program(None, 2)
    shard = _shard_bytes(prog)
    (row,) = prog.plan.section("sync").stages[0]
    assert row["window_bytes"] == row["plain_bytes"] == shard and row["wire_bytes"] == shard // 4
    for r in range(4):
        (c,) = [c for c in prog.collectives(r) if c.axis == "dp"]
        (p,) = [c for c in plain.collectives(r) if c.axis == "dp"]
        assert (c.kind, c.nbytes) == ("all_reduce", shard // 4) and (p.kind, p.nbytes) == ("all_reduce", shard)
        assert sorted(prog.plan.group_of("dp", r)) == [r % 2, r % 2 + 2]
        got, base = prog.estimate().ranks[r].comm_bytes, plain.estimate().ranks[r].comm_bytes
        assert got - base == shard // 4 - shard, (r, got, base)
    text = prog.explain()
    assert f"its parameters, {shard} bytes, all-reduced once per averaging ({shard // 4} bytes per step" in text
    assert "each tp rank averages its own shards over its dp group" in text
    window = get_feature("sync").window(prog.plan.section("sync"), prog, 3)
    assert f"  step 2: AVERAGE0 ({shard} bytes)" in window and f"{shard} bytes per rank per window" in window[0]
    # hierarchical Local SGD at dp=4 x tp=2: pairs of consecutive dp replicas at each tp coordinate
    hier = _program(S.LocalSGD(warmup_steps=1, hierarchical={2: 2, 4: 4}), 2, dp=4)
    assert [g for name, g in hier.plan.all_groups() if name == "sync_2"] == [(0, 2), (4, 6), (1, 3), (5, 7)]
