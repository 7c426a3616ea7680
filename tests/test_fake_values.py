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


def _storage_classes(gm) -> dict:
    """Each node's value, as the first node whose value shares its storage (views alias what they view)."""
    first, out = {}, {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            out[n.name] = first.setdefault(v.untyped_storage()._cdata, n.name)
    return out


def test_the_repeated_blocks_values_are_made_from_the_first_ones_with_the_whole_propagations_storages(monkeypatch):
    import passes.fake_values as FV
    made = []
    make = FV._Memo._make
    monkeypatch.setattr(FV._Memo, "_make", lambda self, entry, args: made.append(entry[2]) or make(self, entry, args))
    gm = _captured()
    CastToCompute(torch.bfloat16).run(gm, PassContext())
    assert {n.name: _meta(n.meta.get("val")) for n in gm.graph.nodes} == _whole(gm)
    whole = copy.deepcopy(gm)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(whole, mode).propagate_dont_convert_inputs(
        *[mode.from_tensor(n.meta["val"]) for n in whole.graph.find_nodes(op="placeholder")])
    assert _storage_classes(gm) == _storage_classes(whole)
    assert True in made and False in made          # views and new tensors both made from an earlier alike call


def test_a_foreach_op_runs_once_per_kind_of_element_and_gives_the_ops_values():
    from passes.fake_values import _NO_VAL, _run_foreach
    mode = FakeTensorMode()
    with mode:
        xs = [torch.empty(s, dtype=torch.float32) for s in [(4, 3), (3,), (4, 3), (3,), (4, 3), (2, 2)]]
        ys = [torch.empty_like(x) for x in xs]
        for op, args in [(A._foreach_mul.Scalar, (xs, 2.0)), (A._foreach_add.List, (xs, ys)),
                         (A._foreach_sqrt.default, (xs,)), (A._foreach_addcmul.Scalar, (xs, ys, ys, 0.5))]:
            got, want = _run_foreach(op, args, {}, mode), op(*args)
            assert got is not _NO_VAL and _meta(got) == _meta(want)
            ins = {t.untyped_storage()._cdata for t in xs + ys}
            assert len({t.untyped_storage()._cdata for t in got} | ins) == len(got) + len(ins)   # all new storages
        assert _run_foreach(A._foreach_add_.List, (xs, ys), {}, mode) is _NO_VAL    # in place: run as it is
