"""Sharding type, ``fxpar.shard`` annotations and propagation's errors."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar import meta as M
from fxpar.annotate import SHARD_OP, shard
from fxpar.capture import capture_training_step
from fxpar.collectives import collective_nodes
from fxpar.mesh import Mesh
from fxpar.optim import resolve_optimizer
from fxpar.sharding import P, R, Sharding, ShardingError
from passes.lower_sharding import lower_shardings
from passes.propagate_sharding import ShardingConflict, propagate_shardings

pytestmark = pytest.mark.structure

SGD = resolve_optimizer((torch.optim.SGD, {"lr": 0.1}))


def test_sharding_prints_round_trips_and_hashes():
    s = Sharding(("dp", None, "tp"))
    assert str(s) == "P('dp', None, 'tp')"
    p = Sharding((None, None), partial=("tp",))
    assert str(p) == "P(None, None, partial=('tp',))"
    for x in (s, p, Sharding.replicate(2)):
        assert Sharding.from_json(json.loads(json.dumps(x.to_json()))) == x
    assert Sharding.from_json(["dp", None, "tp"]) == s
    assert len({s, Sharding(("dp", None, "tp")), p}) == 2
    assert s.placement("dp") == 0 and s.placement("tp") == 2 and s.placement("pp") == R and p.placement("tp") == P
    assert Sharding.from_placements(3, {"dp": 0, "tp": 2}) == s and s.with_placement("tp", P) == \
        Sharding(("dp", None, None), ("tp",))
    assert s.local_shape((8, 16, 64), {"dp": 2, "tp": 4}) == (4, 16, 16)


def test_sharding_errors_name_the_tensor_and_the_fix():
    s = Sharding((None, "tp"))
    with pytest.raises(ShardingError, match=r"fc1.weight: dim 1 has size 30, which mesh axis 'tp' \(size 4\) does not divide"):
        s.local_shape((8, 30), {"tp": 4}, name="fc1.weight")
    with pytest.raises(ShardingError, match=r"names mesh axis \['tp'\], which the mesh does not have .*'dp'"):
        s.local_shape((8, 32), {"dp": 2}, name="x")
    with pytest.raises(ShardingError, match="3 dims.*2 entries"):
        s.local_shape((8, 32, 4), {"tp": 2}, name="x")
    with pytest.raises(ShardingError, match="same mesh axis"):
        Sharding(("tp", "tp"))


class Annotated(nn.Module):
    def __init__(self, spec=(None, "tp")):
        super().__init__()
        self.spec = spec
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(shard(F.gelu(self.fc1(x)), self.spec))


def test_shard_is_identity_with_identity_backward():
    torch.manual_seed(0)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    y = shard(x, ("tp", None))
    assert torch.equal(y, x)
    g = torch.randn(3, 5, dtype=torch.float64)
    y.backward(g)
    assert torch.equal(x.grad, g)
    with pytest.raises(ShardingError, match="x has 2 dims"):
        shard(x, ("tp",))


def test_annotation_survives_capture_and_propagates_back_to_the_weight():
    cap = capture_training_step(Annotated(), (torch.randn(4, 8), torch.randn(4, 4)), F.mse_loss, SGD)
    marks = [n for n in cap.gm.graph.nodes if n.target is SHARD_OP]
    assert len(marks) == 1 and M.get(marks[0], M.PHASE) == "forward" and M.get(marks[0], M.MODULE) == ""
    res = propagate_shardings(cap.gm, Mesh((("tp", 2),)))
    # the annotation on gelu's output flows back (GShard): fc1 column-parallel, its bias split; forward, fc2's
    # weight is decided by its matmul through the transpose: row-parallel, partial sums, one all_reduce
    assert str(res.sharding("fc1_weight")) == "P('tp', None)" and str(res.sharding("fc1_bias")) == "P('tp')"
    assert str(res.sharding("fc2_weight")) == "P(None, 'tp')"
    assert str(res.sharding("addmm_1")) == "P(None, None, partial=('tp',))"
    low = lower_shardings(cap.gm, res, Mesh((("tp", 2),)), 0)
    planned = [r[5] for r in res.redistributions if r[5] not in ("slice", "zero")]
    assert [M.get(n, M.COMM).kind for n in collective_nodes(low)] == planned == ["all_reduce"]
    assert not any(n.target is SHARD_OP for n in low.graph.nodes)
    assert "fxpar.shard(..., P(None, 'tp'))" in res.explain()


def test_unknown_mesh_axis_in_an_annotation_is_a_clear_error():
    cap = capture_training_step(Annotated((None, "mp")), (torch.randn(4, 8), torch.randn(4, 4)), F.mse_loss, SGD)
    with pytest.raises(ShardingError, match=r"fxpar.shard\(\.\.\., P\(None, 'mp'\)\).*names mesh axis \['mp'\].*'tp'"):
        propagate_shardings(cap.gm, {"tp": 2})


def test_layout_errors_name_the_parameter_and_the_pattern():
    cap = capture_training_step(Annotated((None, None)), (torch.randn(4, 8), torch.randn(4, 4)), F.mse_loss, SGD)
    with pytest.raises(ShardingError, match=r"parameter 'fc2.weight' \(layout 'fc2.\*': \(None, 'tp'\)\): dim 1 has size 16"):
        propagate_shardings(cap.gm, {"tp": 3}, layouts={"fc2.*": (None, "tp")})
    with pytest.raises(ShardingError, match="layout pattern 'blocks.*' matches no parameter"):
        propagate_shardings(cap.gm, {"tp": 2}, layouts={"blocks.*.fc1.weight": ("tp", None)})
    with pytest.raises(ShardingConflict, match="matches layouts 'fc1.weight'.*'fc1.\\*'"):
        propagate_shardings(cap.gm, {"tp": 2}, layouts={"fc1.weight": ("tp", None), "fc1.*": (None, "tp")})


class TwoWishes(nn.Module):
    """Two annotations downstream of one unannotated tensor ask it for different splits."""

    def __init__(self, resolve=False):
        super().__init__()
        self.resolve = resolve
        self.fc1 = nn.Linear(8, 16)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if self.resolve:
            h = shard(h, (None, "tp"))
        return shard(h, (None, "tp")).sum(1) + shard(h * 2, ("tp", None)).sum(1)


def test_conflict_names_both_annotations_and_the_node_where_they_meet():
    batch = (torch.randn(4, 8), torch.randn(4))
    cap = capture_training_step(TwoWishes(), batch, F.mse_loss, SGD)
    with pytest.raises(ShardingConflict, match=r"fxpar.shard\(\.\.\., P\('tp', None\)\) in <root> \(node add_1\) and "
                                               r"fxpar.shard\(\.\.\., P\(None, 'tp'\)\) in <root> \(node add\) meet at "
                                               r"node 'gelu' of shape \[4, 16\]: along mesh axis 'tp' one wants S\(0\), "
                                               r"the other S\(1\) -- annotate that node"):
        propagate_shardings(cap.gm, {"tp": 2})
    # annotating the node where they meet says which wins: no conflict, a redistribution for the other
    cap = capture_training_step(TwoWishes(resolve=True), batch, F.mse_loss, SGD)
    res = propagate_shardings(cap.gm, {"tp": 2})
    assert str(res.sharding("gelu")) == "P(None, 'tp')"
    into = [r for r in res.redistributions if r[1] == "mul"]          # h * 2, asked for as P('tp', None)
    assert [(r[2], r[3], r[5]) for r in into] == [(1, 0, "all_to_all")]


def test_a_layout_wins_over_a_wish_that_reaches_its_parameter():
    cap = capture_training_step(Annotated(), (torch.randn(4, 8), torch.randn(4, 4)), F.mse_loss, SGD)
    res = propagate_shardings(cap.gm, {"tp": 2}, layouts={"fc1.weight": (None, "tp")})
    assert str(res.sharding("fc1_weight")) == "P(None, 'tp')"
    assert res.sources["fc1_weight"] == "layout 'fc1.weight': (None, 'tp')"
    assert lower_shardings(cap.gm, res, Mesh((("tp", 2),)), 1) is not None


def test_dp_and_tp_axes_together():
    """A 2-D mesh: the batch annotated over dp, Megatron layouts over tp; each axis decided on its own."""
    class M2(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(shard(x, ("dp", None)))))
    cap = capture_training_step(M2(), (torch.randn(4, 8), torch.randn(4, 8)), F.mse_loss, SGD)
    mesh = Mesh((("dp", 2), ("tp", 2)))
    res = propagate_shardings(cap.gm, mesh, layouts={"fc1.weight": ("tp", None), "fc2.weight": (None, "tp")})
    assert str(res.sharding("addmm")) == "P('dp', 'tp')"
    low = lower_shardings(cap.gm, res, mesh, 3)
    kinds = {(M.get(n, M.COMM).kind, M.get(n, M.COMM).axis) for n in collective_nodes(low)}
    assert ("all_reduce", "tp") in kinds                        # the row-parallel partial sums
    assert all(M.get(n, M.COMM).ranks in ((2, 3), (1, 3)) for n in collective_nodes(low))
