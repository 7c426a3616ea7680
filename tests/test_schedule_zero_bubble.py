"""ZB-H1 (``zb1p``) and the split backward I/W in the IR, validator and dry run.

Figures (dry run, F = I = W = 1 for zb1p, F = 1 and B = 2 for 1F1B; makespan and bubble fraction):

    p, m    1f1b          zb1p (default, p-s in flight)   zb1p in_flight="p" (paper's ZB-H1)
    2, 4    15  0.200     14  0.143                       13  0.077
    2, 8    27  0.111     26  0.077                       25  0.040
    4, 4    21  0.429     18  0.333                       15  0.200
    4, 8    33  0.273     30  0.200                       27  0.111

Closed forms, idle time per rank (with W no larger than F or I): 1F1B (p-1)(F+I+W); zb1p default
(p-1)(F+I); the paper's ZB-H1 (p-1)(F+I-W) (Qi et al. ICLR'24, Table 2, their T_B being our I).
"""
import pytest

from fxpar.schedule import (Action, ActionKind, Schedule, ScheduleDeadlockError, find_problems, get_schedule,
                            simulate, single, validate, zb1p)

pytestmark = pytest.mark.structure

K = ActionKind
FIGURES = {  # (p, m): (1f1b makespan, bubble), (zb1p makespan, bubble), (paper order makespan, bubble)
    (2, 4): ((15, 0.2), (14, 1 / 7), (13, 1 / 13)),
    (2, 8): ((27, 1 / 9), (26, 1 / 13), (25, 1 / 25)),
    (4, 4): ((21, 3 / 7), (18, 1 / 3), (15, 1 / 5)),
    (4, 8): ((33, 3 / 11), (30, 1 / 5), (27, 1 / 9)),
}


@pytest.mark.parametrize("p,m", sorted(FIGURES))
def test_zb1p_validates_runs_and_beats_1f1b(p, m):
    s = zb1p(p, m, in_flight="1f1b")
    validate(s)
    r = simulate(s, F=1, I=1, W=1)
    one = simulate(get_schedule("1f1b", p, m), F=1, B=2)
    (om, ob), (zm, zb), (pm, pb) = FIGURES[(p, m)]
    assert (one.makespan, r.makespan) == (om, zm)
    assert one.bubble_fraction == pytest.approx(ob) and r.bubble_fraction == pytest.approx(zb)
    assert r.bubble_fraction < one.bubble_fraction
    paper = simulate(zb1p(p, m, in_flight="p"), F=1, I=1, W=1)
    assert paper.makespan == pm and paper.bubble_fraction == pytest.approx(pb)
    assert paper.bubble_fraction < r.bubble_fraction


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8), (3, 7), (5, 12)])
def test_zb1p_holds_no_more_activations_than_1f1b(p, m):
    r = simulate(zb1p(p, m, in_flight="1f1b"), F=1, I=1, W=1)
    assert all(r.peak_activations[s] <= p - s for s in range(p))
    assert r.peak_activations == simulate(get_schedule("1f1b", p, m)).peak_activations
    paper = simulate(zb1p(p, m, in_flight="p"), F=1, I=1, W=1)
    assert paper.peak_activations == {s: p for s in range(p)}                # 1F1B's peak, on every stage
    assert max(paper.peak_activations_per_rank.values()) == max(r.peak_activations_per_rank.values())


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 7), (8, 16)])
@pytest.mark.parametrize("f,i,w", [(1, 1, 1), (1, 1, 0.5), (1, 1.5, 0.5), (2, 1, 1), (1, 2, 1)])
def test_zb1p_idle_time_closed_forms(p, m, f, i, w):
    idle = simulate(zb1p(p, m, in_flight="1f1b"), F=f, I=i, W=w).makespan - m * (f + i + w)
    assert idle == pytest.approx((p - 1) * (f + i))
    idle = simulate(zb1p(p, m, in_flight="p"), F=f, I=i, W=w).makespan - m * (f + i + w)
    assert idle == pytest.approx((p - 1) * (f + i - w))                       # Qi et al., Table 2
    one = simulate(get_schedule("1f1b", p, m), F=f, B=i + w).makespan - m * (f + i + w)
    assert one == pytest.approx((p - 1) * (f + i + w))


def test_zb1p_order_follows_the_paper():
    """Paper order: stage s warms up with p-1-s F, then s (F, I) pairs, then (F, I, W) triples."""
    p, m = 4, 8
    s = zb1p(p, m, in_flight="p")
    for r in range(p):
        comp = [a.short() for a in s.actions[r] if a.is_compute]
        w = p - 1 - r
        assert comp[:w] == [f"F{r}.{x}" for x in range(w)]
        assert comp[w:w + 2 * r] == [f"{k}{r}.{x}" for x0 in range(r) for k, x in (("F", w + x0), ("I", x0))]
        x = p - 1                       # first steady triple: F_(p-1), I_r, W_0
        assert comp[w + 2 * r:w + 2 * r + 3] == [f"F{r}.{x}", f"I{r}.{x - w}", f"W{r}.0"]
    assert s.meta == {} and Schedule.parse(str(s)) == s


def test_zb1p_ends_with_rg_then_step_and_needs_m_at_least_p():
    s = zb1p(3, 5, in_flight="1f1b")
    for r, acts in s.actions.items():
        assert [a.short() for a in acts[-2:]] == [f"RG{r}", f"STEP{r}"]
        assert acts[-3].kind == K.W
        assert not any(a.kind == K.B for a in acts)
    with pytest.raises(Exception, match=r"zb1p\(p=4, m=2\) needs m >= p"):
        zb1p(4, 2)


def test_zb1p_with_comm_and_reduce_costs():
    r = simulate(zb1p(4, 8), F=1, I=1, W=1, comm=0.25, reduce=0.5, step=0.1)
    one = simulate(get_schedule("1f1b", 4, 8), F=1, B=2, comm=0.25, reduce=0.5, step=0.1)
    assert r.bubble_fraction < one.bubble_fraction


# ----- dry-run semantics of I, W, FULL, UNSHARD, RESHARD ------------------------------------------------------

HEAD2 = "# schedule name=hand ranks=2 stages=2 microbatches=1 placement=0:0,1:1\n"
SPLIT = HEAD2 + ("rank 0: F0.0 SF0.0>1 RB0.0<1 I0.0 W0.0 RG0 STEP0\n"
                 "rank 1: RF1.0<0 F1.0 I1.0 SB1.0>0 W1.0 RG1 STEP1")


def test_input_gradient_is_sent_after_i_before_w():
    r = simulate(Schedule.parse(SPLIT), F=1, I=1, W=3)
    t = {str(a): (b, e) for tl in r.timelines.values() for b, e, a in tl}
    assert t["1:I1.0"] == (2.0, 3.0) and t["1:SB1.0>0"] == (3.0, 3.0) and t["1:W1.0"] == (3.0, 6.0)
    assert t["0:I0.0"] == (3.0, 4.0)                # stage 0 does not wait for stage 1's W
    assert r.makespan == 7.0 and r.busy == {0: 5.0, 1: 5.0}


def test_split_durations_default_to_half_a_backward():
    s = Schedule.parse(SPLIT)
    assert simulate(s, F=1, B=4).makespan == simulate(s, F=1, I=2, W=2).makespan == 8.0   # F F I I W W (rank 0)
    assert simulate(s, F={0: 1, 1: 1}, B={0: 2, 1: 6}).busy == {0: 3.0, 1: 7.0}


def test_w_waits_for_its_i():
    text = SPLIT.replace("I0.0 W0.0", "W0.0 I0.0")
    with pytest.raises(ScheduleDeadlockError, match=r"rank 0 waits at step 3 on W0.0 but its input-gradient half "
                                                    r"I0.0 comes later, at step 4 of rank 0"):
        simulate(Schedule.parse(text))


def test_i_waits_for_the_output_gradient():
    text = SPLIT.replace("RB0.0<1 ", "")
    with pytest.raises(ScheduleDeadlockError, match=r"rank 0 waits at step 2 on I0.0 for the gradients from stage 1 "
                                                    r"microbatch 0, which rank 0 neither computes nor receives"):
        simulate(Schedule.parse(text))


def test_full_is_compute_and_a_step():
    r = simulate(single(1, 1), F=1, B=2)
    assert r.makespan == 3.0 and r.busy == {0: 3.0} and r.bubble_fraction == 0.0
    assert r.peak_activations == {0: 1} and r.peak_versions == {0: 1}    # version 1 replaces 0 as FULL ends
    assert r.timelines[0][0][2] == Action(0, K.FULL, 0, 0)
    assert simulate(single(1, 1), full=5).makespan == 5.0
    acc = simulate(single(1, 4), F=1, B=2, reduce=0.5, step=0.25)
    assert acc.makespan == 12.75 and acc.peak_activations == {0: 1}


def test_unshard_and_reshard_are_free_local_actions():
    text = ("# schedule name=hand ranks=1 stages=1 microbatches=1 placement=0:0\n"
            "rank 0: UNSHARD0 F0.0 B0.0 RESHARD0 RG0 STEP0")
    s = Schedule.parse(text)
    assert find_problems(s) == []
    r = simulate(s, F=1, B=2)
    assert r.makespan == 3.0 and [e - b for b, e, a in r.timelines[0] if a.kind in (K.UNSHARD, K.RESHARD)] == [0, 0]
    bad = Schedule.parse(text.replace("UNSHARD0", "UNSHARD1"))
    assert any("UNSHARD1 names stage 1, but there are 1" in p for p in find_problems(bad))


def test_registry_names():
    assert get_schedule("zb1p", 2, 2) == zb1p(2, 2)
    assert get_schedule("ZB-H1", 2, 2) == zb1p(2, 2)
    assert get_schedule("single", 1, 2).actions[0][-1] == Action(0, K.STEP, 0)


def test_full_creates_the_next_version():
    text = ("# schedule name=hand ranks=1 stages=1 microbatches=2 placement=0:0\n"
            "rank 0: FULL0.0 F0.1@1 B0.1@1 RG0 STEP0@2")
    r = simulate(Schedule.parse(text))
    assert r.makespan == 6.0
    with pytest.raises(Exception, match="uses version 2 of stage 0"):
        simulate(Schedule.parse(text.replace("F0.1@1 B0.1@1", "F0.1@2 B0.1@2")))


def test_module_docstring_example_is_what_zb1p_prints():
    import fxpar.schedule.zero_bubble as zb
    shown = [ln.strip() for ln in zb.__doc__.splitlines() if ln.strip().startswith("rank ")]
    assert shown == zb1p(2, 3).format_lists().splitlines()[1:]
