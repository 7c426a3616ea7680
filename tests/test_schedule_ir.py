"""The schedule IR's text form: every action and every generated schedule prints and parses back."""
import pytest

from fxpar.schedule import (Action, ActionKind, Schedule, ScheduleParseError, chimera, get_schedule,
                            parse_action)

pytestmark = pytest.mark.structure

K = ActionKind

ACTIONS = [
    Action(0, K.F, 0, 3), Action(1, K.B, 1, 2), Action(2, K.W, 4, 0), Action(0, K.F, 0, 5, version=2),
    Action(1, K.B, 1, 2, version=4), Action(0, K.SEND_F, 0, 3, 1), Action(1, K.RECV_F, 1, 3, 0),
    Action(1, K.SEND_B, 1, 2, 0), Action(0, K.RECV_B, 0, 2, 1), Action(3, K.REDUCE_GRAD, 0), Action(0, K.STEP, 0),
    Action(0, K.STEP, 2, version=7), Action(12, K.F, 10, 11, version=13),
    Action(1, K.I, 1, 2), Action(1, K.I, 1, 2, version=3), Action(1, K.W, 1, 2, version=3), Action(0, K.FULL, 0, 0),
    Action(2, K.UNSHARD, 1), Action(2, K.RESHARD, 1), Action(4, K.REDUCE_GRAD, 11),
]

ALL = [("gpipe", 4, 8, {}), ("1f1b", 4, 8, {}), ("interleaved", 4, 8, {"v": 2}), ("pipedream", 4, 8, {}),
       ("2bw", 4, 4, {"n_batches": 3}), ("chimera", 4, 8, {}), ("1f1b", 1, 3, {}), ("chimera", 2, 2, {}),
       ("zb1p", 4, 8, {}), ("zb1p", 3, 5, {"in_flight": "p"}), ("single", 1, 1, {}), ("single", 1, 4, {})]


@pytest.mark.parametrize("a", ACTIONS, ids=str)
def test_action_round_trip(a):
    assert parse_action(str(a)) == a
    assert parse_action(a.short(), rank=a.rank) == a


def test_compact_text_examples():
    assert Action(0, K.F, 0, 3).short() == "F0.3"
    assert Action(0, K.SEND_F, 0, 3, 1).short() == "SF0.3>1"
    assert Action(1, K.RECV_F, 1, 3, 0).short() == "RF1.3<0"
    assert Action(0, K.STEP, 0).short() == "STEP0"
    assert Action(0, K.REDUCE_GRAD, 0).short() == "RG0"
    assert Action(0, K.I, 1, 2).short() == "I1.2"
    assert Action(0, K.W, 1, 2, version=4).short() == "W1.2@4"
    assert Action(0, K.FULL, 0, 0).short() == "FULL0.0"
    assert Action(0, K.UNSHARD, 1).short() == "UNSHARD1"
    assert Action(0, K.RESHARD, 1).short() == "RESHARD1"
    assert Action(0, K.B, 1, 2, version=4).short() == "B1.2@4"
    assert str(Action(2, K.F, 0, 3)) == "2:F0.3"


@pytest.mark.parametrize("text", ["X0.1", "F0", "SF0.1", "RF1.3>0", "F0.1>2", "RG0.1", "RG0@1", "SF0.1>1@2",
                                  "F-1.0", "", "SYNC0", "I0", "W1", "FULL0", "FULL0.0@1", "UNSHARD0.1",
                                  "RESHARD0@2", "I0.1>1", "RG0>1"])
def test_bad_action_text_raises(text):
    with pytest.raises(ScheduleParseError):
        parse_action(text, rank=0)


def test_action_needs_rank_and_consistent_rank():
    with pytest.raises(ScheduleParseError, match="names no rank"):
        parse_action("F0.1")
    with pytest.raises(ScheduleParseError, match="sits in rank 1"):
        parse_action("0:F0.1", rank=1)


def test_sync_is_gone():
    assert not hasattr(K, "SYNC")
    with pytest.raises(ScheduleParseError):
        parse_action("SYNC0", rank=0)


def test_action_field_rules():
    with pytest.raises(ValueError):
        Action(0, K.STEP, 0, 1)          # STEP takes no microbatch
    for kind in (K.REDUCE_GRAD, K.UNSHARD, K.RESHARD):
        with pytest.raises(ValueError, match="whole stage"):
            Action(0, kind, 0, 1)
    with pytest.raises(ValueError, match="needs a microbatch"):
        Action(0, K.I, 0)
    with pytest.raises(ValueError, match="carries no weight version"):
        Action(0, K.FULL, 0, 0, version=1)
    with pytest.raises(ValueError, match="carries no weight version"):
        Action(0, K.REDUCE_GRAD, 0, version=1)
    with pytest.raises(ValueError):
        Action(0, K.SEND_F, 0, 1)        # a send needs a peer
    with pytest.raises(ValueError):
        Action(0, K.SEND_F, 0, 1, 1, version=1)


@pytest.mark.parametrize("name,p,m,kw", ALL)
def test_schedule_round_trip(name, p, m, kw):
    s = get_schedule(name, p, m, **kw)
    assert Schedule.parse(str(s)) == s
    assert Schedule.parse(s.format_lists()) == s
    for r, acts in s.actions.items():
        assert [parse_action(str(a)) for a in acts] == acts


def test_grid_layout():
    text = str(get_schedule("1f1b", 2, 2)).splitlines()
    assert text[0] == "# schedule name=1f1b ranks=2 stages=2 microbatches=2 placement=0:0,1:1"
    assert text[1].split() == ["step", "rank0", "rank1"]
    assert text[2].split() == ["0", "F0.0", "RF1.0<0"]
    assert text[-1].split() == [str(len(text) - 3), "STEP0", "STEP1"]


def test_grid_pads_short_ranks_and_parses_back():
    s = Schedule.parse("# schedule name=x ranks=2 stages=1 microbatches=1 placement=0:0\n"
                       "rank 0: F0.0 B0.0 STEP0\nrank 1:")
    assert s.actions[1] == []
    assert Schedule.parse(str(s)) == s
    assert str(s).splitlines()[3].split() == ["1", "B0.0", "."]


def test_placement_with_replicas_round_trips():
    s = chimera(4, 4)
    assert s.stage_to_rank == {0: (0, 3), 1: (1, 2), 2: (1, 2), 3: (0, 3)}
    assert "placement=0:0/3,1:1/2,2:1/2,3:0/3" in s.header()
    assert Schedule.parse(str(s)).stage_to_rank == s.stage_to_rank


def test_parse_rejects_missing_header():
    with pytest.raises(ScheduleParseError, match="header"):
        Schedule.parse("rank 0: F0.0")


def test_docstring_examples_parse_and_print_back():
    """Every example action in the grammar of fxpar.schedule.ir reads back to the same text."""
    import re

    import fxpar.schedule.ir as ir
    examples = re.findall(r"^    (\d+:)?([A-Z]+\d+(?:\.\d+)?(?:[<>]\d+)?(?:@\d+)?)\s", ir.__doc__, re.M)
    kinds = set()
    for prefix, body in examples:
        a = parse_action(prefix + body if prefix else body, rank=None if prefix else 0)
        assert a.short() == body
        kinds.add(a.kind)
    assert kinds == set(K)                       # the docstring shows every kind


def test_grid_round_trip_with_reserved_and_split_kinds():
    text = ("# schedule name=hand ranks=2 stages=2 microbatches=1 placement=0:0,1:1\n"
            "rank 0: UNSHARD0 F0.0 SF0.0>1 RB0.0<1 I0.0 W0.0 RESHARD0 RG0 STEP0\n"
            "rank 1: UNSHARD1 RF1.0<0 F1.0 I1.0 SB1.0>0 W1.0 RESHARD1 RG1 STEP1")
    s = Schedule.parse(text)
    assert s.format_lists() == text
    assert Schedule.parse(str(s)) == s
