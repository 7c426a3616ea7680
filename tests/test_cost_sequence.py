"""cost_models.estimate on per-rank sequences (F, B, SEND, RECV, REDUCE_GRAD, STEP ...):
makespans, bubbles and memory against hand counts and the pipeline closed forms."""
import json
import time

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from cost_models import DeadlockError, Item, estimate
from fxpar.cluster import ClusterSpec, DeviceSpec, LinkSpec
from fxpar.meta import CommInfo

pytestmark = pytest.mark.cost

N = 64
MM = 1e-3                                   # one 64x64 matmul: 2*64**3 FLOPs at 2*64**3*1e3 FLOP/s
ADD = N * N / (2 * N**3 * 1e3)              # one FLOP per element of a 64x64 add, same peak
S = N * N * 4                               # bytes of one 64x64 float32 tensor
AR = 1.5e-3                                 # all_reduce of S bytes on 2 ranks with the default link
_fake = FakeTensorMode()
aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def _cluster(world=2, bandwidth=S / AR, latency=0.0):
    dev = DeviceSpec("cuda", "toy", 2**30, 2 * N**3 * 1e3, 1e18)
    link = LinkSpec(bandwidth, latency)
    return ClusterSpec(device=dev, nodes=1, devices_per_node=world, intra_node=link, inter_node=link,
                       backend="nccl")


def _node(g, target, args, name=None):
    n = g.create_node("call_function", target, args, name=name)
    with _fake:
        n.meta["val"] = torch.empty(N, N)
    return n


def _ph(g, name, role=None):
    n = g.placeholder(name)
    with _fake:
        n.meta["val"] = torch.empty(N, N)
    if role:
        n.meta["fxpar_role"], n.meta["fxpar_param"] = role, name
    return n


def _mms(k):
    """k chained 64x64 matmuls: k ms."""
    g = torch.fx.Graph()
    x = last = _ph(g, "x")
    for _ in range(k):
        last = _node(g, aten.mm.default, (last, x))
    g.output(last)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _issue(group, name="all_reduce", nbytes=S, mm=1):
    """REDUCE_GRAD-like: ``mm`` matmuls, then an all_reduce returned unwaited."""
    g = torch.fx.Graph()
    x = last = _ph(g, "x")
    for _ in range(mm):
        last = _node(g, aten.mm.default, (last, x))
    ar = _node(g, c10d.all_reduce.default, (last, "sum", "g"), name=name)
    ar.meta["fxpar_comm"] = CommInfo("all_reduce", "dp", tuple(group), nbytes)
    g.output((ar,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _step(pending="all_reduce"):
    """STEP-like: waits on the placeholder ``pending``, then one add."""
    g = torch.fx.Graph()
    x, p = _ph(g, "x"), _ph(g, pending)
    w = _node(g, c10d.wait_tensor.default, (p,))
    g.output(_node(g, aten.add.Tensor, (x, w)))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def send(src, dst, nbytes=S):
    return CommInfo("send", "pp", (src, dst), nbytes)


def recv(src, dst, nbytes=S):
    return CommInfo("recv", "pp", (src, dst), nbytes)


def one_f_one_b(stage, p, m, F, B, rank=lambda s: s):
    """1F1B (PipeDream-flush) actions of ``stage``: warmup forwards, then F/B pairs, then backwards."""
    prev, nxt = (rank(stage - 1) if stage else None), (rank(stage + 1) if stage < p - 1 else None)
    me = rank(stage)

    def fwd(i):
        return ([recv(prev, me)] if prev is not None else []) + [(f"F{stage}.{i}", F)] + \
               ([send(me, nxt)] if nxt is not None else [])

    def bwd(i):
        return ([recv(nxt, me)] if nxt is not None else []) + [(f"B{stage}.{i}", B)] + \
               ([send(me, prev)] if prev is not None else [])

    warm = min(p - 1 - stage, m)
    seq = [a for i in range(warm) for a in fwd(i)]
    for i in range(m - warm):
        seq += fwd(warm + i) + bwd(i)
    return seq + [a for i in range(m - warm, m) for a in bwd(i)]


# (1) ---------------------------------------------------------------------------------------------
def test_gpipe_two_ranks_makespan_is_the_hand_count():
    alpha, beta = 0.2e-3, S / 0.5e-3
    P = alpha + S / beta                                     # α-β cost of one activation/gradient message
    F, B = _mms(1), _mms(2)                                  # F 1 ms, B 2 ms, on both stages
    seqs = {0: [("F0.0", F), send(0, 1), ("F0.1", F), send(0, 1),
                recv(1, 0), ("B0.1", B), recv(1, 0), ("B0.0", B)],
            1: [("R1.0", recv(0, 1)), ("F1.0", F), recv(0, 1), ("F1.1", F),
                ("B1.1", B), send(1, 0), ("B1.0", B), send(1, 0)]}
    est = estimate(seqs, _cluster(bandwidth=beta, latency=alpha))
    # rank 1: a0 lands at 1+P, F [1+P, 2+P]; a1 is received from 2+P to 2+2P; F, B, B to 7+2P.
    # rank 0: g1 lands at 5+3P, B to 7+3P; g0 is received from 7+3P (its recv is posted then), B to 9+4P.
    assert est.step_time_s == pytest.approx(9 * MM + 4 * P)
    r0, r1 = est.ranks
    assert r0.compute_time_s == r1.compute_time_s == pytest.approx(6 * MM)
    assert r0.comm_bytes == r1.comm_bytes == 2 * S           # sends count their bytes, recvs do not
    assert r0.comm_time_s == pytest.approx(4 * P)
    assert r0.exposed_comm_s == pytest.approx(3 * P)         # only send a0 hides (under F0.1)
    assert r1.end_time_s == pytest.approx(7 * MM + 4 * P)    # its last send ends when rank 0 receives it
    assert est.idle_fraction == pytest.approx(1 - 12 * MM / (2 * (9 * MM + 4 * P)))
    assert r1.idle_fraction == pytest.approx(1 - 6 * MM / (9 * MM + 4 * P))
    assert est.actions(1)[:2] == [("R1.0", pytest.approx(MM), pytest.approx(MM + P)),
                                  ("F1.0", pytest.approx(MM + P), pytest.approx(2 * MM + P))]
    assert "idle fraction (pipeline bubble)" in str(est)


# (2) ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_one_f_one_b_bubble_matches_closed_form(p, m):
    F, B = _mms(1), _mms(1)                                  # F = B per stage, comm negligible
    est = estimate({s: one_f_one_b(s, p, m, F, B) for s in range(p)}, _cluster(p, bandwidth=1e30))
    assert est.step_time_s == pytest.approx((m + p - 1) * 2 * MM)
    assert est.idle_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert all(r.compute_time_s == pytest.approx(2 * m * MM) for r in est.ranks)


# (3) ---------------------------------------------------------------------------------------------
def test_send_recv_mismatch_raises_deadlock_naming_the_ranks():
    F = _mms(1)
    cl = _cluster()
    with pytest.raises(DeadlockError, match=r"rank 1 waits on recv #0 .*group \(0, 1\)\); ranks not yet issued: \[0\]"):
        estimate({0: [F], 1: [recv(0, 1), F]}, cl)                      # nobody sends
    with pytest.raises(DeadlockError, match=r"rank 0's send #1 .*never completes; ranks not yet issued: \[1\]"):
        estimate({0: [F, send(0, 1), send(0, 1)], 1: [recv(0, 1), F]}, cl)   # the second send is never received
    # each waits to receive before it sends: a real deadlock, both named
    with pytest.raises(DeadlockError, match=r"(?s)rank 0 waits on recv.*rank 1 waits on recv"):
        estimate({0: [recv(1, 0), send(0, 1)], 1: [recv(0, 1), send(1, 0)]}, cl)
    with pytest.raises(ValueError, match=r"rank 1, item 0: send with ranks=\(0, 1\).*src must be this rank \(1\)"):
        estimate({0: [F], 1: [send(0, 1)]}, cl)
    with pytest.raises(ValueError, match="all_reduce CommInfo cannot stand alone"):
        estimate({0: [CommInfo("all_reduce", "dp", (0, 1), S)], 1: [F]}, cl)


# (4) ---------------------------------------------------------------------------------------------
def test_single_graph_form_is_unchanged_and_equals_a_one_item_sequence():
    g = torch.fx.Graph()
    x = _ph(g, "x")
    mm = _node(g, aten.mm.default, (x, x))
    ar = _node(g, c10d.all_reduce.default, (mm, "sum", "g"))
    ar.meta["fxpar_comm"] = CommInfo("all_reduce", "dp", (0, 1), S)
    mm2 = _node(g, aten.mm.default, (mm, x))
    w = _node(g, c10d.wait_tensor.default, (ar,))
    g.output(_node(g, aten.add.Tensor, (mm2, w)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    old = estimate({0: gm, 1: gm}, _cluster())
    new = estimate({0: [gm], 1: [gm]}, _cluster())
    assert old.symmetric and new.symmetric
    assert old.step_time_s == pytest.approx(MM + max(MM, AR) + ADD) == new.step_time_s
    for a, b in zip(old.ranks, new.ranks):
        assert (a.compute_time_s, a.comm_time_s, a.comm_bytes, a.overlap_s, a.end_time_s) == \
               (b.compute_time_s, b.comm_time_s, b.comm_bytes, b.overlap_s, b.end_time_s)
        assert a.peak_memory_bytes == b.peak_memory_bytes == 4 * S          # x, mm, mm2 + all_reduce, add
    assert "idle fraction" not in str(old) and "idle fraction" not in str(new)   # one item per rank


# (5) ---------------------------------------------------------------------------------------------
def test_collective_issued_in_one_graph_is_waited_in_a_later_one():
    cl, grp = _cluster(), (0, 1)
    rg, x, step = _issue(grp), _mms(1), _step()
    # RG: mm [0, 1], all_reduce issued at 1 runs [1, 2.5] beside X [1, 2]; STEP waits to 2.5, then adds
    est = estimate({r: [("RG", rg), ("X", x), ("STEP", step)] for r in grp}, cl)
    assert est.symmetric
    assert est.step_time_s == pytest.approx(MM + AR + ADD)
    assert est.ranks[0].overlap_s == pytest.approx(MM)
    # nobody waits: it completes by the end of the step
    assert estimate({r: [rg, x] for r in grp}, cl).step_time_s == pytest.approx(MM + AR)
    # an explicit wait on the RG item blocks X until the all_reduce is done
    est = estimate({r: [("RG", rg), ("wait", "RG"), ("X", x)] for r in grp}, cl)
    assert est.step_time_s == pytest.approx(MM + AR + MM)
    # two in flight (1.5 ms, then 3 ms on the same lane): a placeholder named like the second one
    # waits for it; a placeholder that names neither waits for the oldest
    rg_a, rg_b = _issue(grp, "ar_a"), _issue(grp, "ar_b", nbytes=2 * S)
    end_b, end_a = MM + AR + 2 * AR, MM + AR
    named = estimate({r: [rg_a, rg_b, _step("ar_b")] for r in grp}, cl)
    assert named.step_time_s == pytest.approx(end_b + ADD)
    fifo = estimate({r: [rg_a, rg_b, _step("other")] for r in grp}, cl)
    assert fifo.actions(0)[-1][1] == pytest.approx(max(2 * MM, end_a))          # STEP starts after ar_a
    assert fifo.step_time_s == pytest.approx(end_b)                              # ar_b still ends the step
    with pytest.raises(ValueError, match=r"\('wait', 'RX'\) names no earlier item"):
        estimate({r: [("RG", rg), ("wait", "RX")] for r in grp}, cl)


# memory ------------------------------------------------------------------------------------------
def _stage_graph():
    """F or B of a one-matmul stage: reads an input and the weight w, returns one S-byte tensor."""
    g = torch.fx.Graph()
    x, w = _ph(g, "x"), _ph(g, "w", role="param")
    g.output(_node(g, aten.mm.default, (x, w)))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_sequence_memory_holds_saved_activations_until_their_backward():
    F, B = _stage_graph(), _stage_graph()          # each: w (persistent) + x + out = 3S at its peak
    m = 4
    gpipe = [Item(F, f"F0.{i}", keep=f"B0.{i}") for i in range(m)] + [Item(B, f"B0.{i}") for i in reversed(range(m))]
    fwd = [Item(F, f"F0.{i}", keep=f"B0.{i}") for i in range(m)]
    bwd = [Item(B, f"B0.{i}") for i in range(m)]
    ofob = [fwd[0], fwd[1], bwd[0], fwd[2], bwd[1], fwd[3], bwd[2], bwd[3]]      # 1F1B, stage 0 of 2
    cl = _cluster(1)
    est_g, est_1 = estimate({0: gpipe}, cl), estimate({0: ofob}, cl)
    # w once (F and B share it by fxpar_param) + one graph's own 2S + the outputs held for later backwards
    assert est_g.ranks[0].peak_memory_bytes == S + 2 * S + (m - 1) * S
    assert est_1.ranks[0].peak_memory_bytes == S + 2 * S + 1 * S
    assert est_g.ranks[0].memory_breakdown["carried"] == (m - 1) * S
    assert est_g.ranks[0].memory_breakdown["param"] == S
    # default: outputs are read by the next graph and add nothing; "end" holds them to the end
    assert estimate({0: [F, F, B]}, cl).ranks[0].peak_memory_bytes == 3 * S
    assert estimate({0: [Item(F, keep="end"), F, B]}, cl).ranks[0].peak_memory_bytes == 4 * S
    assert estimate({0: [Item(F, keep={0: "end"}), F, B]}, cl).ranks[0].peak_memory_bytes == 4 * S
    with pytest.raises(ValueError, match="keep='B9' on item 0 .*names no later item"):
        estimate({0: [Item(F, "F", keep="B9"), B]}, cl)


# speed and timeline ------------------------------------------------------------------------------
@pytest.mark.serial
def test_eight_ranks_sixteen_microbatches_four_stages_is_fast():
    p, dp, m = 4, 2, 16
    F, B = _mms(1), _mms(1)
    seqs = {}
    for s in range(p):
        for d in range(dp):
            grp = tuple(s * dp + i for i in range(dp))
            seqs[s * dp + d] = one_f_one_b(s, p, m, F, B, rank=lambda t, d=d: t * dp + d) + \
                [("RG", _issue(grp, mm=0)), ("STEP", _step())]
    t0 = time.perf_counter()
    est = estimate(seqs, _cluster(p * dp, bandwidth=1e30))
    took = time.perf_counter() - t0
    assert took < 1.0, f"estimate took {took:.3f} s"
    assert est.step_time_s == pytest.approx((m + p - 1) * 2 * MM + ADD)
    assert est.program_classes == p                       # the two dp ranks of a stage run alike
    assert est.idle_fraction == pytest.approx(1 - (2 * m * MM + ADD) / ((m + p - 1) * 2 * MM + ADD))


def test_timeline_names_the_actions(tmp_path):
    F, B = _mms(1), _mms(1)
    est = estimate({s: one_f_one_b(s, 2, 2, F, B) for s in range(2)}, _cluster(bandwidth=1e30))
    spans = [e for e in json.load(open(est.timeline(str(tmp_path / "t.json"))))["traceEvents"] if e["ph"] == "X"]
    actions = {e["name"] for e in spans if e.get("cat") == "action"}
    assert {"F0.0", "F0.1", "B0.0", "B0.1", "F1.0", "B1.1"} <= actions
    assert any(e["name"].startswith("send[pp]") and e["tid"] == 1 for e in spans)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)


# late receives ------------------------------------------------------------------------------------
def test_late_receive_costs_the_calibrated_overhead_only_when_the_sender_computes():
    """``DeviceSpec.late_recv_s = L``: rank 0 computes A (1 ms) and sends; rank 1 computes X (2 ms),
    then receives, then computes Y (1 ms). The receive is posted at 2 ms, after the send (1 ms):
    if rank 0 is then computing C, the message takes P + L, else P; posted before the send, P."""
    from dataclasses import replace
    alpha, beta, L = 0.2e-3, S / 0.5e-3, 0.7e-3
    P = alpha + S / beta
    cl = _cluster(bandwidth=beta, latency=alpha)
    late = replace(cl, device=replace(cl.device, late_recv_s=L))
    A, X, C = _mms(1), _mms(2), _mms(3)
    rank1 = [("X", X), ("r", recv(0, 1)), ("Y", A)]
    busy = {0: [("A", A), send(0, 1), ("C", C)], 1: rank1}
    est = estimate(busy, late)
    assert dict((lab, (lo, hi)) for lab, lo, hi in est.actions(1))["Y"] == \
        (pytest.approx(2 * MM + P + L), pytest.approx(3 * MM + P + L))
    assert est.step_time_s == pytest.approx(max(4 * MM, 3 * MM + P + L))
    assert estimate(busy, cl).step_time_s == pytest.approx(4 * MM)              # L = 0: P only
    idle = {0: [("A", A), send(0, 1), recv(1, 0)], 1: rank1 + [send(1, 0)]}   # rank 0 waits, not computes
    assert estimate(idle, late).step_time_s == pytest.approx(3 * MM + 2 * P)
    early = {0: busy[0], 1: [("r", recv(0, 1)), ("Y", A)]}                      # posted before the send
    assert estimate(early, late).step_time_s == pytest.approx(4 * MM)
    assert dict((lab, (lo, hi)) for lab, lo, hi in estimate(early, late).actions(1))["Y"][0] == \
        pytest.approx(MM + P)


def test_idle_fraction_where_counts_only_the_chosen_graphs_as_work():
    """An optimizer STEP after a 1F1B pipeline: the executor's bubble counts it as idle."""
    p, m = 2, 4
    F, B, STEP = _mms(1), _mms(1), _mms(3)
    seqs = {s: one_f_one_b(s, p, m, F, B) + [(f"STEP{s}", STEP)] for s in range(p)}
    est = estimate(seqs, _cluster(p, bandwidth=1e30))
    T = (m + p - 1) * 2 * MM + 3 * MM
    assert est.step_time_s == pytest.approx(T)
    assert est.idle_fraction == pytest.approx(1 - (2 * m + 3) * MM / T)
    work = est.idle_fraction_where(lambda label: not label.startswith("STEP"))
    assert work == pytest.approx(1 - 2 * m * MM / T)
    assert est.work_time_s(0, lambda label: label.startswith("STEP")) == pytest.approx(3 * MM)
