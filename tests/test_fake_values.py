"""Fake values kept valid through a pass (passes/fake_values.py): recomputed where an edit can change them, equal to
a propagation over the whole graph, and every other node's value kept as it was."""
from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxpar.capture import capture_training_step
from fxpar.optim import resolve_optimizer
from fxpar.pass_manager import PassContext
from fxpar.testing import gpt_loss, tiny_gpt
from passes.fake_values import NodeFailed, record, refresh
from passes.precision import CastToCompute

A = torch.ops.aten
pytestmark = pytest.mark.structure


def _captured():
    torch.manual_seed(0)
    x = torch.randint(0, 32, (4, 8))
    return capture_training_step(tiny_gpt(), (x, x), loss_fn=gpt_loss,
                                 optimizer=resolve_optimizer((torch.optim.AdamW, {"lr": 1e-3}))).gm


def _meta(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.dtype, v.device, v.storage_offset(), v.requires_grad)
    if isinstance(v, (list, tuple)):
        return tuple(_meta(x) for x in v)
    return v


def _whole(gm) -> dict:
    """Every node's value from a propagation over the whole graph (a copy), as metadata."""
    gm = copy.deepcopy(gm)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(n.meta["val"]) if isinstance(n.meta.get("val"), torch.Tensor) else n.meta.get("val")
             for n in gm.graph.find_nodes(op="placeholder")]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    return {n.name: _meta(n.meta.get("val")) for n in gm.graph.nodes}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_precision_pass_leaves_the_values_a_whole_propagation_gives(dtype):
    gm = _captured()
    optimizer_vals = {n: n.meta["val"] for n in gm.graph.nodes if n.meta.get("fxpar_phase") == "optimizer"}
    CastToCompute(dtype, scale=dtype == torch.float16).run(gm, PassContext())
    got = {n.name: _meta(n.meta.get("val")) for n in gm.graph.nodes}
    assert got == _whole(gm)
    assert any(v[2] == dtype for v in got.values() if isinstance(v, tuple) and len(v) == 6)
    # the update reads the master-dtype gradients, as before the pass: its values were kept, not recomputed
    kept = [n for n, v in optimizer_vals.items() if n.graph is gm.graph and n.meta["val"] is v]
    assert len(kept) == len(optimizer_vals) > 0


def test_an_edit_is_recomputed_to_where_its_change_stops():
    gm = _captured()
    g = gm.graph
    before = record(gm)
    vals = {n: n.meta.get("val") for n in g.nodes}
    mm = next(n for n in g.nodes if n.target is A.mm.default)
    users = list(mm.users)
    with g.inserting_after(mm):
        c = g.call_function(A.clone.default, (mm,))
    for u in users:
        u.replace_input_with(mm, c)
    refresh(gm, before)
    assert {n.name: _meta(n.meta.get("val")) for n in g.nodes} == _whole(gm)
    # the clone is new; its users read a value alike to the one they read before: theirs are kept, except views
    # of it, whose values must alias the clone's storage now (the memory model keys storages)
    redone = [n for n in g.nodes if n.op != "output" and n.meta.get("val") is not vals.get(n)]
    cs = c.meta["val"].untyped_storage()._cdata
    assert redone[0] is c and len(redone) > 1
    assert all(n.meta["val"].untyped_storage()._cdata == cs for n in redone)
    assert all(n.meta["val"].untyped_storage()._cdata != cs for n in g.nodes
               if n not in redone and isinstance(n.meta.get("val"), torch.Tensor))
    refresh(gm, record(gm))                            # nothing edited: every value kept
    assert all(n.meta.get("val") is v for n, v in {n: n.meta.get("val") for n in g.nodes}.items())


def test_an_op_that_fails_on_the_new_values_is_named():
    gm = _captured()
    before = record(gm)
    mm = next(n for n in gm.graph.nodes if n.target is A.mm.default)
    with gm.graph.inserting_before(mm):
        t = gm.graph.call_function(A.t.default, (mm.args[1],))
    mm.replace_input_with(mm.args[1], t)
    with pytest.raises(NodeFailed, match="reduction dim") as e:
        refresh(gm, before)
    assert e.value.node is mm
