"""Typed contracts: roles and graph kinds are enums that stand in for their strings, the pass context has named
fields, and a rank's payload carries its run settings as one dataclass. Structure only: no ranks."""
import json
import pickle

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import meta as M
from fxpar.host import HostSettings
from fxpar.pass_manager import PassContext
from fxpar.roles import GraphKind, Role
from fxpar.runtime import RunSettings
from fxpar.runtime.state import RankExtra
from fxpar.testing import MLP

pytestmark = pytest.mark.structure


@pytest.mark.parametrize("enum", [Role, GraphKind])
def test_a_member_stands_in_for_its_string(enum):
    for m in enum:
        v = m.value
        assert m == v and v == m and hash(m) == hash(v)
        assert {v: 1}[m] == 1 and {m: 1}[v] == 1 and m in {v} and v in {m}
        assert str(m) == v and f"{m}" == v and repr(m) == repr(v) and repr([(m, "k")]) == repr([(v, "k")])
        assert pickle.loads(pickle.dumps(m)) is m and enum(json.loads(json.dumps(m))) is m


def test_pass_context_has_named_fields_and_a_scratch_space():
    ctx = PassContext()
    assert ctx.kinds == (GraphKind.FULL,) and ctx.split is None and ctx.scratch == {}
    assert not hasattr(ctx, "store")


def _program(**strategy):
    torch.manual_seed(0)
    return fxpar.parallelize(MLP().double(), fxpar.ClusterSpec.local(2),
                             (torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)),
                             loss_fn=F.mse_loss, strategy=fxpar.Strategy(**strategy))


def test_capture_and_the_split_write_members():
    prog = _program(pp=2, schedule="1f1b", microbatches=2)
    for st in prog.stages:
        assert all(type(k) is GraphKind for k in st.graphs)
        for kind, sg in st.graphs.items():
            assert type(sg.kind) is GraphKind and sg.kind == kind
            assert all(type(r) is Role for r, _ in sg.inputs + sg.outputs), (kind, sg.inputs, sg.outputs)
            assert all(type(M.get(n, M.ROLE)) is Role for n in sg.gm.graph.find_nodes(op="placeholder"))
    assert list(prog.stages[0].graphs) == [GraphKind.F, GraphKind.B, GraphKind.REDUCE_GRAD, GraphKind.STEP]
    assert set(prog.stages[0].graphs) == {"F", "B", "REDUCE_GRAD", "STEP"}       # a string finds the same graph


def test_payload_settings_are_typed_and_picklable(tmp_path):
    prog = _program(dp=2)
    p = prog.payload(1, measure_comm=True, seed=7, save_to=tmp_path / "ck")
    s = p.settings
    assert isinstance(s, RunSettings) and not hasattr(p, "extra")
    assert (s.rng_seed, s.measure_comm, s.measure_memory, s.save_to, s.resume_from) == (7, True, False,
                                                                                       str(tmp_path / "ck"), None)
    assert s.n_inputs == prog.n_inputs and s.host == HostSettings() and not s.asynchronous
    back = pickle.loads(pickle.dumps(p.settings))
    assert back == s
    assert RunSettings().rng_seed is None and RunSettings().host.host_memory_reuse is True


def test_rank_extra_round_trips_as_a_plain_dict():
    e = RankExtra(rng={"cpu": torch.get_rng_state()}, step=3, lr=[0.1], optim=None, scheduler={"last_epoch": 3},
                  features={"compression": {"residual": 1}})
    d = e.to_dict()
    assert type(d) is dict and list(d) == ["rng", "step", "lr", "optim", "scheduler", "features"]
    back = RankExtra.from_dict(d)
    assert (back.step, back.lr, back.scheduler, back.features) == (3, [0.1], {"last_epoch": 3},
                                                                   {"compression": {"residual": 1}})
    older = {k: v for k, v in d.items() if k not in ("features", "scheduler")}   # written before those fields
    assert RankExtra.from_dict(older).features == {} and RankExtra.from_dict(older).scheduler is None
    assert RankExtra.from_dict({**d, "features": None}).features == {}
