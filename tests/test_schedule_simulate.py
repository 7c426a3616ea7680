"""The simulator against closed forms from the papers, memory bounds, and deadlock reports.

Closed forms checked (uniform per-stage times, free communication):
* GPipe and 1F1B: bubble fraction idle/(idle+busy) = (p-1)/(m+p-1) for any F and B times
  (Huang et al. NeurIPS'19; Narayanan et al. SC'21 Sec. 2.2.1).
* Interleaved 1F1B with v chunks per rank: t_bubble/t_ideal = (p-1)/(v*m), i.e. a bubble fraction of
  (p-1)/(v*m+p-1) (Narayanan et al. SC'21 Sec. 2.2.2), here with chunk F=1, B=2.
* Chimera: bubble ratio (p-2)/(2m+p-2) (Li & Hoefler SC'21, D=p, N=m), counted -- as in the paper --
  in slots where F and B take equal time.
"""
import pytest

from fxpar.schedule import (Schedule, ScheduleDeadlockError, ScheduleValidationError, get_schedule,
                            simulate)

pytestmark = pytest.mark.cost


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 7), (8, 16)])
@pytest.mark.parametrize("f,b", [(1, 2), (1, 1), (2, 3)])
def test_gpipe_1f1b_bubble_closed_form(name, p, m, f, b):
    r = simulate(get_schedule(name, p, m), F=f, B=b)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert r.makespan == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 4, 2), (3, 9, 4), (4, 16, 2)])
def test_interleaved_bubble_shrinks_by_v(p, m, v):
    r = simulate(get_schedule("interleaved", p, m, v=v), F=1, B=2)
    busy = m * v * 3
    idle = r.makespan - busy
    assert idle / busy == pytest.approx((p - 1) / (v * m))          # Narayanan et al. SC'21
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p,m", [(4, 4), (6, 6), (8, 8), (4, 8), (8, 16), (2, 2)])
def test_chimera_bubble_matches_paper(p, m):
    r = simulate(get_schedule("chimera", p, m), F=1, B=1)
    assert r.bubble_fraction == pytest.approx((p - 2) / (2 * m + p - 2))
    # and it beats 1F1B on the same p, m
    assert r.bubble_fraction < (p - 1) / (m + p - 1) or p == 2


def test_chimera_with_backward_twice_forward_is_worse_than_the_paper_count():
    r = simulate(get_schedule("chimera", 4, 4), F=1, B=2)
    assert r.makespan == 16 and r.bubble_fraction == pytest.approx(0.25)


def test_chimera_activations_are_balanced():
    r = simulate(get_schedule("chimera", 8, 8), F=1, B=1)
    per_rank = r.peak_activations_per_rank
    assert max(per_rank.values()) <= 8 and min(per_rank.values()) >= 4
    one = simulate(get_schedule("1f1b", 8, 8)).peak_activations_per_rank
    assert max(per_rank.values()) - min(per_rank.values()) < max(one.values()) - min(one.values())


def test_reduce_grad_is_a_collective_over_the_holders():
    base = simulate(get_schedule("chimera", 4, 4), F=1, B=1)
    slow = simulate(get_schedule("chimera", 4, 4), F=1, B=1, reduce=1.5)
    assert slow.makespan == base.makespan + 3.0          # two RGs per rank after its last backward
    ends = {r: [e for b, e, a in tl if a.kind.value == "RG"] for r, tl in slow.timelines.items()}
    assert ends[0] == ends[3] and ends[1] == ends[2]     # replicas (s, p-1-s) leave each all-reduce together
    last_b = {r: max(e for b, e, a in tl if a.is_compute) for r, tl in slow.timelines.items()}
    assert ends[0][-1] == max(last_b[0], last_b[3]) + 3.0


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (5, 12)])
def test_activation_peaks_1f1b_vs_gpipe(p, m):
    one = simulate(get_schedule("1f1b", p, m))
    assert one.peak_activations == {s: p - s for s in range(p)}     # stage 0 holds at most p
    gp = simulate(get_schedule("gpipe", p, m))
    assert gp.peak_activations == {s: m for s in range(p)}


@pytest.mark.parametrize("p,m", [(2, 5), (4, 8), (4, 20), (6, 13)])
def test_pipedream_stage_s_holds_at_most_p_minus_s_versions(p, m):
    r = simulate(get_schedule("pipedream", p, m))
    for s in range(p):
        assert r.peak_versions[s] <= p - s
    assert r.peak_versions[0] == min(p, m)     # the bound is reached once the pipeline is full


@pytest.mark.parametrize("p,m,nb", [(2, 2, 4), (4, 4, 4), (4, 3, 5), (4, 8, 3), (6, 6, 3)])
def test_2bw_never_more_than_two_versions(p, m, nb):
    r = simulate(get_schedule("2bw", p, m, n_batches=nb))
    assert max(r.peak_versions.values()) <= 2
    assert r.peak_versions[0] == 2


def test_synchronous_schedules_hold_one_version():
    for name, kw in [("gpipe", {}), ("1f1b", {}), ("interleaved", {"v": 2}), ("chimera", {})]:
        assert set(simulate(get_schedule(name, 4, 8, **kw)).peak_versions.values()) == {1}


def test_per_stage_durations_and_comm():
    r = simulate(get_schedule("gpipe", 2, 2), F={0: 1, 1: 2}, B={0: 2, 1: 4})
    assert r.makespan == 15                              # F1 3+2, B1 9+4, B0.1 after B1.1 at 13 -> 15
    r = simulate(get_schedule("1f1b", 2, 2), comm=0.5)
    assert r.makespan == pytest.approx(3 * (2 + 1) + 2 * 0.5)   # m+p-1 slots of F+B, plus a hop each way
    times = {str(a): (b, e) for b, e, a in r.timelines[1]}
    assert times["1:RF1.0<0"] == (0.0, 1.5) and times["1:F1.0"] == (1.5, 2.5)   # a RECV spans its wait


HAND = """# schedule name=hand ranks=2 stages=2 microbatches=1 placement=0:0,1:1
rank 0: F0.0 RB0.0<1 SF0.0>1 B0.0 STEP0
rank 1: RF1.0<0 F1.0 B1.0 SB1.0>0 STEP1"""


def test_deadlock_names_step_ranks_and_actions():
    with pytest.raises(ScheduleDeadlockError) as e:
        simulate(Schedule.parse(HAND))
    err = e.value
    assert err.step == 0 and set(err.stuck) == {0, 1}
    assert err.stuck[0][0] == 1 and err.stuck[0][1].short() == "RB0.0<1"
    assert err.stuck[1][0] == 0 and err.stuck[1][1].short() == "RF1.0<0"
    msg = str(err)
    assert "rank 0 waits at step 1 on RB0.0<1 but rank 1 sends it (SB1.0>0) only at step 3" in msg
    assert "rank 1 waits at step 0 on RF1.0<0 but rank 0 sends it (SF0.0>1) only at step 2" in msg


def test_deadlock_on_a_message_never_sent():
    text = HAND.replace(" SB1.0>0", "").replace("RB0.0<1 SF0.0>1", "SF0.0>1 RB0.0<1")
    with pytest.raises(ScheduleDeadlockError, match=r"rank 0 waits at step 2 on RB0.0<1 but rank 1 never sends it"):
        simulate(Schedule.parse(text))


def test_deadlock_on_a_reduce_grad_the_other_replica_skips():
    s = get_schedule("chimera", 2, 2)
    s.actions[1] = [a for a in s.actions[1] if a.short() != "RG1"]
    with pytest.raises(ScheduleDeadlockError, match="rank 0 waits at step 9 on RG1 for the other holders of stage 1: "
                                                    "rank 1 has finished"):
        simulate(s)


def test_blocking_sends_deadlock_1f1b_but_not_gpipe():
    """1F1B needs asynchronous (or batched) sends; the simulator shows where rendezvous sends hang."""
    with pytest.raises(ScheduleDeadlockError, match="a blocking send"):
        simulate(get_schedule("1f1b", 2, 4), blocking_sends=True)
    assert simulate(get_schedule("gpipe", 2, 4), blocking_sends=True).makespan == 15


def test_using_a_version_before_it_exists_is_reported():
    s = get_schedule("pipedream", 2, 3)
    s.actions[0] = [a if a.short() != "F0.2@1" else type(a)(0, a.kind, 0, 2, None, 2) for a in s.actions[0]]
    with pytest.raises(ScheduleValidationError, match="uses version 2 of stage 0"):
        simulate(s)


def test_compute_grid_shows_the_1f1b_shape():
    grid = simulate(get_schedule("1f1b", 2, 2)).compute_grid().splitlines()
    assert grid[0].split() == ["rank0:", "F0.0", "F0.1", ".", ".", "B0.0", "B0.0", ".", "B0.1", "B0.1"]
    assert grid[1].split() == ["rank1:", ".", "F1.0", "B1.0", "B1.0", "F1.1", "B1.1", "B1.1", ".", "."]
