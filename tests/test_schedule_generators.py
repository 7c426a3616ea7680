"""Golden action lists for small pipelines, structural validity for many, and the argument errors."""
import itertools

import pytest

from fxpar.schedule import (Action, ActionKind, Schedule, ScheduleError, ScheduleValidationError, ensure_reduce_grad,
                            find_problems, get_schedule, pipedream_2bw, single, validate)

pytestmark = pytest.mark.structure

K = ActionKind


def lists(s):
    return {r: " ".join(a.short() for a in acts) for r, acts in s.actions.items()}


def test_golden_1f1b_p2_m4():
    assert lists(get_schedule("1f1b", 2, 4)) == {
        0: "F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 F0.2 SF0.2>1 RB0.1<1 B0.1 F0.3 SF0.3>1 RB0.2<1 B0.2 "
           "RB0.3<1 B0.3 RG0 STEP0",
        1: "RF1.0<0 F1.0 B1.0 SB1.0>0 RF1.1<0 F1.1 B1.1 SB1.1>0 RF1.2<0 F1.2 B1.2 SB1.2>0 RF1.3<0 F1.3 B1.3 "
           "SB1.3>0 RG1 STEP1",
    }


def test_golden_gpipe_p2_m2():
    assert lists(get_schedule("gpipe", 2, 2)) == {
        0: "F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 RB0.1<1 B0.1 RG0 STEP0",
        1: "RF1.0<0 F1.0 RF1.1<0 F1.1 B1.0 SB1.0>0 B1.1 SB1.1>0 RG1 STEP1",
    }


def test_golden_interleaved_p2_m2_v2():
    s = get_schedule("interleaved", 2, 2, v=2)
    assert s.stage_to_rank == {0: (0,), 1: (1,), 2: (0,), 3: (1,)}
    assert lists(s) == {
        0: "F0.0 SF0.0>1 F0.1 SF0.1>1 RF2.0<1 F2.0 SF2.0>1 RF2.1<1 F2.1 SF2.1>1 RB2.0<1 B2.0 SB2.0>1 "
           "RB2.1<1 B2.1 SB2.1>1 RG2 RB0.0<1 B0.0 RB0.1<1 B0.1 RG0 STEP0 STEP2",
        1: "RF1.0<0 F1.0 SF1.0>0 RF1.1<0 F1.1 SF1.1>0 RF3.0<0 F3.0 B3.0 SB3.0>0 RF3.1<0 F3.1 B3.1 SB3.1>0 RG3 "
           "RB1.0<0 B1.0 SB1.0>0 RB1.1<0 B1.1 SB1.1>0 RG1 STEP1 STEP3",
    }


def test_golden_pipedream_p2_m3():
    assert lists(get_schedule("pipedream", 2, 3)) == {
        0: "F0.0@0 SF0.0>1 F0.1@0 SF0.1>1 RB0.0<1 B0.0@0 RG0 STEP0@1 F0.2@1 SF0.2>1 RB0.1<1 B0.1@0 RG0 STEP0@2 "
           "RB0.2<1 B0.2@1 RG0 STEP0@3",
        1: "RF1.0<0 F1.0@0 B1.0@0 SB1.0>0 RG1 STEP1@1 RF1.1<0 F1.1@1 B1.1@1 SB1.1>0 RG1 STEP1@2 RF1.2<0 F1.2@2 "
           "B1.2@2 SB1.2>0 RG1 STEP1@3",
    }


def test_golden_2bw_p2_m2():
    assert lists(get_schedule("2bw", 2, 2)) == {
        0: "F0.0@0 SF0.0>1 F0.1@0 SF0.1>1 RB0.0<1 B0.0@0 F0.2@0 SF0.2>1 RB0.1<1 B0.1@0 RG0 STEP0@1 F0.3@0 "
           "SF0.3>1 RB0.2<1 B0.2@0 RB0.3<1 B0.3@0 RG0 STEP0@2",
        1: "RF1.0<0 F1.0@0 B1.0@0 SB1.0>0 RF1.1<0 F1.1@0 B1.1@0 SB1.1>0 RG1 STEP1@1 RF1.2<0 F1.2@0 B1.2@0 "
           "SB1.2>0 RF1.3<0 F1.3@0 B1.3@0 SB1.3>0 RG1 STEP1@2",
    }


def test_golden_chimera_p2_m2():
    s = get_schedule("chimera", 2, 2)
    assert s.stage_to_rank == {0: (0, 1), 1: (0, 1)}
    assert lists(s) == {
        0: "F0.0 SF0.0>1 RF1.1<1 F1.1 B1.1 SB1.1>1 RB0.0<1 B0.0 RG0 RG1 STEP0 STEP1",
        1: "F0.1 SF0.1>0 RF1.0<0 F1.0 B1.0 SB1.0>0 RB0.1<0 B0.1 RG0 RG1 STEP0 STEP1",
    }


def test_2bw_versions_follow_the_paper():
    """Batch b computes with W(b-1) on every stage; STEP@(b+1) ends batch b (W(t+1) = W(t) - nu grad f(W(t-1)))."""
    p, m, nb = 4, 4, 4
    s = pipedream_2bw(p, m, n_batches=nb)
    for r, acts in s.actions.items():
        for a in acts:
            if a.kind in (K.F, K.B):
                assert a.version == max(a.microbatch // m - 1, 0)
        steps = [(j, a.version) for j, a in enumerate(acts) if a.kind == K.STEP]
        assert [v for _, v in steps] == list(range(1, nb + 1))
        for j, v in steps:   # RG, STEP@(b+1) right after batch b's last B (and its send)
            last_b = [a for a in acts[:j] if a.kind == K.B][-1]
            assert last_b.microbatch == v * m - 1
            assert [a.kind for a in acts[acts.index(last_b) + 1:j] if a.kind != K.SEND_B] == [K.REDUCE_GRAD]


def test_pipedream_forward_uses_newest_version():
    s = get_schedule("pipedream", 4, 10)
    for r, acts in s.actions.items():
        steps = 0
        for a in acts:
            if a.kind == K.STEP:
                steps += 1
            elif a.kind == K.F:
                assert a.version == steps


GRID = [(name, p, m, kw) for name, kw in [("gpipe", {}), ("1f1b", {}), ("pipedream", {})]
        for p, m in itertools.product([1, 2, 3, 4, 5], [1, 2, 3, 4, 7, 8]) if name != "1f1b" or m >= p]
GRID += [("interleaved", p, m, {"v": v}) for p in (1, 2, 3, 4) for m in (p, 2 * p, 3 * p) for v in (1, 2, 3)]
GRID += [("2bw", p, m, {"n_batches": n}) for p in (1, 2, 3, 4) for m in (max(p - 1, 1), p, 2 * p) for n in (1, 3)]
GRID += [("chimera", p, m, {}) for p in (2, 4, 6, 8) for m in (2, p, 2 * p, 3 * p)]
GRID += [("zb1p", p, m, {"in_flight": f}) for p in (1, 2, 3, 4, 5) for m in (p, p + 1, 2 * p, 8) for f in ("1f1b", "p")]
GRID += [("single", 1, m, {}) for m in (1, 2, 5)]


@pytest.mark.parametrize("name,p,m,kw", GRID)
def test_generated_schedules_are_valid(name, p, m, kw):
    s = get_schedule(name, p, m, **kw)
    assert find_problems(s) == []
    assert s.n_ranks == p


def test_validate_names_broken_rules():
    s = get_schedule("1f1b", 2, 2)
    s.actions[1] = [a for a in s.actions[1] if a.short() != "B1.1"]
    with pytest.raises(ScheduleValidationError) as e:
        validate(s)
    text = str(e.value)
    assert "B1.1 appears 0 times" in text
    assert "SB1.1>0" in text                           # the send of a B that no longer runs
    swapped = Schedule.parse("# schedule name=x ranks=2 stages=2 microbatches=2 placement=0:0,1:1\n"
                             "rank 0: F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 RB0.1<1 B0.1 STEP0\n"
                             "rank 1: RF1.1<0 RF1.0<0 F1.0 F1.1 B1.0 SB1.0>0 B1.1 SB1.1>0 STEP1")
    assert any("same order" in p for p in find_problems(swapped))


@pytest.mark.parametrize("name,p,m,kw,words", [
    ("1f1b", 4, 2, {}, ["m >= p", "60%", "m >= 4"]),
    ("interleaved", 4, 2, {"v": 2}, ["m >= p"]),
    ("interleaved", 4, 6, {"v": 2}, ["multiple of p=4", "m=4 or m=8"]),
    ("chimera", 3, 4, {}, ["even number of ranks", "p=2 or p=4"]),
    ("chimera", 4, 3, {}, ["even m"]),
    ("2bw", 4, 2, {}, ["m >= p-1"]),
    ("zb1p", 4, 3, {}, ["zb1p(p=4, m=3) needs m >= p", "m >= 4"]),
    ("zb1p", 2, 4, {"in_flight": "2"}, ["in_flight must be '1f1b'", "'p'"]),
    ("single", 2, 4, {}, ["needs p=1", "'1f1b'"]),
    ("gpip", 2, 2, {}, ["unknown", "'gpipe'"]),
    ("1f1b", 2, 4, {"v": 2}, ["no option"]),
])
def test_errors_say_what_to_change(name, p, m, kw, words):
    with pytest.raises(ScheduleError) as e:
        get_schedule(name, p, m, **kw)
    for w in words:
        assert w in str(e.value)


# ----- REDUCE_GRAD placement ---------------------------------------------------------------------------------

SYNC_GRID = [("gpipe", 4, 8, {}), ("1f1b", 4, 8, {}), ("1f1b", 3, 3, {}), ("interleaved", 4, 8, {"v": 2}),
             ("interleaved", 2, 4, {"v": 3}), ("chimera", 4, 8, {}), ("chimera", 6, 6, {}), ("zb1p", 4, 8, {}),
             ("zb1p", 3, 4, {"in_flight": "p"}), ("single", 1, 3, {})]


@pytest.mark.parametrize("name,p,m,kw", SYNC_GRID)
def test_synchronous_generators_reduce_each_held_stage_once_after_its_last_backward(name, p, m, kw):
    s = get_schedule(name, p, m, **kw)
    for r, acts in s.actions.items():
        held = s.rank_stages(r)
        rgs = [(j, a.stage) for j, a in enumerate(acts) if a.kind == K.REDUCE_GRAD]
        steps = [(j, a.stage) for j, a in enumerate(acts) if a.kind == K.STEP]
        assert sorted(st for _, st in rgs) == held                        # one RG per held stage
        assert [st for _, st in steps] == held                            # one STEP per held stage, at the end
        assert [a.kind for a in acts[-len(held):]] == [K.STEP] * len(held)
        assert max(j for j, _ in rgs) < min(j for j, _ in steps)          # every RG before the STEPs
        replicated = [st for _, st in rgs if len(s.stage_to_rank[st]) > 1]
        assert replicated == sorted(replicated)                           # replicas meet in the same order
        for j, st in rgs:
            last = max(k for k, a in enumerate(acts) if a.stage == st and a.kind in (K.B, K.W))
            between = acts[last + 1:j]
            # right after the last backward of st (and the send of its input gradient); only other RGs, or,
            # for a replicated stage held back to keep increasing order, work of the rank's other stages
            assert all(a.kind in (K.SEND_B, K.REDUCE_GRAD) for a in between) or (
                len(s.stage_to_rank[st]) > 1 and all(a.stage != st or a.kind == K.SEND_B for a in between))


def test_rg_right_after_last_backward_goldens():
    s = get_schedule("zb1p", 2, 2, in_flight="1f1b")
    assert lists(s)[1].endswith("I1.1 SB1.1>0 W1.1 RG1 STEP1")
    assert lists(s)[0].endswith("RB0.1<1 I0.1 W0.1 RG0 STEP0")
    il = lists(get_schedule("interleaved", 2, 2, v=2))
    assert "B2.1 SB2.1>1 RG2 RB0.0<1" in il[0]             # chunk 1 is reduced while chunk 0 still drains


@pytest.mark.parametrize("name,p,m,kw", [("pipedream", 3, 5, {}), ("2bw", 3, 3, {"n_batches": 3})])
def test_async_generators_put_rg_right_before_every_step(name, p, m, kw):
    s = get_schedule(name, p, m, **kw)
    for r, acts in s.actions.items():
        steps = [j for j, a in enumerate(acts) if a.kind == K.STEP]
        assert steps and all(acts[j - 1] == Action(r, K.REDUCE_GRAD, r) for j in steps)
        assert sum(a.kind == K.REDUCE_GRAD for a in acts) == len(steps)


def test_chimera_reduces_with_rg_and_has_no_sync():
    s = get_schedule("chimera", 4, 4)
    assert not hasattr(K, "SYNC") and "SYNC" not in s.format_lists()
    for r, acts in s.actions.items():
        assert [a.stage for a in acts if a.kind == K.REDUCE_GRAD] == s.rank_stages(r)


def test_single_is_the_one_stage_program():
    assert lists(single(1, 1)) == {0: "FULL0.0"}
    assert lists(get_schedule("single", 1, 1)) == {0: "FULL0.0"}
    assert lists(single(1, 3)) == {0: "F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 RG0 STEP0"}
    assert single(1, 3).stage_to_rank == {0: (0,)}
    validate(single(1, 1))


# ----- ensure_reduce_grad ------------------------------------------------------------------------------------

def test_ensure_reduce_grad_inserts_before_the_first_step():
    hand = Schedule.parse("# schedule name=hand ranks=2 stages=2 microbatches=1 placement=0:0,1:1\n"
                          "rank 0: F0.0 SF0.0>1 RB0.0<1 B0.0 STEP0\n"
                          "rank 1: RF1.0<0 F1.0 B1.0 SB1.0>0 STEP1")
    fixed = ensure_reduce_grad(hand)
    assert lists(fixed) == {0: "F0.0 SF0.0>1 RB0.0<1 B0.0 RG0 STEP0", 1: "RF1.0<0 F1.0 B1.0 SB1.0>0 RG1 STEP1"}
    assert lists(hand)[0].endswith("B0.0 STEP0")              # a copy: the input is unchanged
    assert find_problems(fixed) == []


def test_ensure_reduce_grad_orders_replicas_and_keeps_generated_schedules():
    hand = get_schedule("chimera", 4, 4)
    for r in hand.actions:
        hand.actions[r] = [a for a in hand.actions[r] if a.kind != K.REDUCE_GRAD]
    assert any("has no RG" in p for p in find_problems(hand))
    fixed = ensure_reduce_grad(hand)
    assert lists(fixed)[0].endswith("RG0 RG3 STEP0 STEP3") and lists(fixed)[1].endswith("RG1 RG2 STEP1 STEP2")
    assert find_problems(fixed) == []
    for name, kw in [("1f1b", {}), ("chimera", {}), ("pipedream", {}), ("zb1p", {})]:
        s = get_schedule(name, 4, 4, **kw)
        assert ensure_reduce_grad(s) == s
    assert ensure_reduce_grad(single(1, 1)) == single(1, 1)   # FULL carries its own reduction


def test_ensure_reduce_grad_leaves_stages_a_rank_does_not_hold():
    hand = Schedule.parse("# schedule name=hand ranks=1 stages=1 microbatches=1 placement=0:0\n"
                          "rank 0: F0.0 B0.0 RG0 STEP0")
    assert ensure_reduce_grad(hand) == hand


# ----- validate: split backward, FULL, RG ---------------------------------------------------------------------

HEAD2 = "# schedule name=hand ranks=2 stages=2 microbatches=1 placement=0:0,1:1\n"


def test_validate_accepts_split_backward_and_refuses_mixtures():
    ok = HEAD2 + "rank 0: F0.0 SF0.0>1 RB0.0<1 I0.0 W0.0 RG0 STEP0\nrank 1: RF1.0<0 F1.0 I1.0 SB1.0>0 W1.0 RG1 STEP1"
    assert find_problems(Schedule.parse(ok)) == []
    mixed = ok.replace("I1.0 SB1.0>0 W1.0", "B1.0 SB1.0>0 W1.0")
    assert any("stage 1 microbatch 0 mixes B1.0 with W1.0" in p for p in find_problems(Schedule.parse(mixed)))
    mixed = ok.replace("I1.0 SB1.0>0 W1.0", "B1.0 SB1.0>0 I1.0")
    assert any("stage 1 microbatch 0 mixes B1.0 with I1.0" in p for p in find_problems(Schedule.parse(mixed)))
    no_w = ok.replace(" W0.0", "")
    assert any("has I0.0 but no W0.0" in p and "add W0.0 after I0.0 on rank 0" in p
               for p in find_problems(Schedule.parse(no_w)))
    w_first = ok.replace("I0.0 W0.0", "W0.0 I0.0")
    assert any("W0.0 (rank 0 step 3) comes before its I0.0" in p for p in find_problems(Schedule.parse(w_first)))
    late_rg = ok.replace("I0.0 W0.0 RG0", "I0.0 RG0 W0.0")
    assert any("come after RG0" in p for p in find_problems(Schedule.parse(late_rg)))


def test_validate_full():
    one = "# schedule name=hand ranks=1 stages=1 microbatches=1 placement=0:0\nrank 0: FULL0.0"
    assert find_problems(Schedule.parse(one)) == []
    both = find_problems(Schedule.parse(one + " F0.0 B0.0"))
    assert any("FULL0.0 already runs its forward and backward; remove F0.0 B0.0" in p for p in both)
    twice = find_problems(Schedule.parse(one + " STEP0"))
    assert any("2 unversioned STEPs (a FULL counts as one)" in p for p in twice)
    pipe = HEAD2 + "rank 0: FULL0.0\nrank 1: FULL1.0"
    assert any("has 2 stages" in p for p in find_problems(Schedule.parse(pipe)))


def test_validate_rg_placement_rules():
    s = get_schedule("chimera", 2, 2)
    s.actions[1] = [a for a in s.actions[1] if a.short() != "RG1"]
    text = "\n".join(find_problems(s))
    assert "RG1 appears {0: 1, 1: 0} times" in text and "STEP1 of replicated stage 1 has no RG1" in text
    s = get_schedule("chimera", 2, 2)
    s.actions[1] = [a for a in s.actions[1] if a.kind != K.REDUCE_GRAD]
    s.actions[1][-2:-2] = [Action(1, K.REDUCE_GRAD, 1), Action(1, K.REDUCE_GRAD, 0)]
    assert any("ranks 0 and 1 run their shared RGs in different orders ([0, 1] vs [1, 0])" in p
               for p in find_problems(s))
    s = get_schedule("1f1b", 2, 2)
    s.actions[1].insert(0, Action(1, K.REDUCE_GRAD, 0))
    assert any("RG0 runs stage 0, which lives on ranks (0,), not rank 1" in p for p in find_problems(s))
