"""Golden action lists for small pipelines, structural validity for many, and the argument errors."""
import itertools

import pytest

from fxpar.schedule import (ActionKind, ScheduleError, ScheduleValidationError, find_problems, get_schedule,
                            pipedream_2bw, validate, Schedule)

K = ActionKind


def lists(s):
    return {r: " ".join(a.short() for a in acts) for r, acts in s.actions.items()}


def test_golden_1f1b_p2_m4():
    assert lists(get_schedule("1f1b", 2, 4)) == {
        0: "F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 F0.2 SF0.2>1 RB0.1<1 B0.1 F0.3 SF0.3>1 RB0.2<1 B0.2 "
           "RB0.3<1 B0.3 STEP0",
        1: "RF1.0<0 F1.0 B1.0 SB1.0>0 RF1.1<0 F1.1 B1.1 SB1.1>0 RF1.2<0 F1.2 B1.2 SB1.2>0 RF1.3<0 F1.3 B1.3 "
           "SB1.3>0 STEP1",
    }


def test_golden_gpipe_p2_m2():
    assert lists(get_schedule("gpipe", 2, 2)) == {
        0: "F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 RB0.1<1 B0.1 STEP0",
        1: "RF1.0<0 F1.0 RF1.1<0 F1.1 B1.0 SB1.0>0 B1.1 SB1.1>0 STEP1",
    }


def test_golden_interleaved_p2_m2_v2():
    s = get_schedule("interleaved", 2, 2, v=2)
    assert s.stage_to_rank == {0: (0,), 1: (1,), 2: (0,), 3: (1,)}
    assert lists(s) == {
        0: "F0.0 SF0.0>1 F0.1 SF0.1>1 RF2.0<1 F2.0 SF2.0>1 RF2.1<1 F2.1 SF2.1>1 RB2.0<1 B2.0 SB2.0>1 "
           "RB2.1<1 B2.1 SB2.1>1 RB0.0<1 B0.0 RB0.1<1 B0.1 STEP0 STEP2",
        1: "RF1.0<0 F1.0 SF1.0>0 RF1.1<0 F1.1 SF1.1>0 RF3.0<0 F3.0 B3.0 SB3.0>0 RF3.1<0 F3.1 B3.1 SB3.1>0 "
           "RB1.0<0 B1.0 SB1.0>0 RB1.1<0 B1.1 SB1.1>0 STEP1 STEP3",
    }


def test_golden_pipedream_p2_m3():
    assert lists(get_schedule("pipedream", 2, 3)) == {
        0: "F0.0@0 SF0.0>1 F0.1@0 SF0.1>1 RB0.0<1 B0.0@0 STEP0@1 F0.2@1 SF0.2>1 RB0.1<1 B0.1@0 STEP0@2 "
           "RB0.2<1 B0.2@1 STEP0@3",
        1: "RF1.0<0 F1.0@0 B1.0@0 SB1.0>0 STEP1@1 RF1.1<0 F1.1@1 B1.1@1 SB1.1>0 STEP1@2 RF1.2<0 F1.2@2 B1.2@2 "
           "SB1.2>0 STEP1@3",
    }


def test_golden_2bw_p2_m2():
    assert lists(get_schedule("2bw", 2, 2)) == {
        0: "F0.0@0 SF0.0>1 F0.1@0 SF0.1>1 RB0.0<1 B0.0@0 F0.2@0 SF0.2>1 RB0.1<1 B0.1@0 STEP0@1 F0.3@0 SF0.3>1 "
           "RB0.2<1 B0.2@0 RB0.3<1 B0.3@0 STEP0@2",
        1: "RF1.0<0 F1.0@0 B1.0@0 SB1.0>0 RF1.1<0 F1.1@0 B1.1@0 SB1.1>0 STEP1@1 RF1.2<0 F1.2@0 B1.2@0 SB1.2>0 "
           "RF1.3<0 F1.3@0 B1.3@0 SB1.3>0 STEP1@2",
    }


def test_golden_chimera_p2_m2():
    s = get_schedule("chimera", 2, 2)
    assert s.stage_to_rank == {0: (0, 1), 1: (0, 1)}
    assert lists(s) == {
        0: "F0.0 SF0.0>1 RF1.1<1 F1.1 B1.1 SB1.1>1 RB0.0<1 B0.0 SYNC0 SYNC1 STEP0 STEP1",
        1: "F0.1 SF0.1>0 RF1.0<0 F1.0 B1.0 SB1.0>0 RB0.1<0 B0.1 SYNC0 SYNC1 STEP0 STEP1",
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
        for j, v in steps:   # STEP@(b+1) right after batch b's last B (and its send)
            last_b = [a for a in acts[:j] if a.kind == K.B][-1]
            assert last_b.microbatch == v * m - 1
            assert all(a.kind in (K.SEND_B,) for a in acts[acts.index(last_b) + 1:j])


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
    ("gpip", 2, 2, {}, ["unknown", "'gpipe'"]),
    ("1f1b", 2, 4, {"v": 2}, ["no option"]),
])
def test_errors_say_what_to_change(name, p, m, kw, words):
    with pytest.raises(ScheduleError) as e:
        get_schedule(name, p, m, **kw)
    for w in words:
        assert w in str(e.value)
