"""In-place collectives made functional, for a compiler that accepts only functional ops (inductor).

``passes.bucket`` reduces each gradient bucket in place: a fresh flat buffer, each gradient ``copy_``-ed into its
slot, ``all_reduce_`` on the buffer, the gradients views of the waited result. Eager PyTorch runs that with no
extra copy. ``torch._inductor`` refuses ``_c10d_functional.all_reduce_`` (functionalization does not take a custom
op whose output aliases its input), so under ``Strategy(compile=True)`` each rank's graphs pass through
:func:`functional_collectives` before ``compile_fx``: every ``all_reduce_`` becomes the functional ``all_reduce``
with the same arguments, at the same place, waited by the same ``wait_tensor``; a bucket made of an ``empty``
buffer and one ``copy_`` per slot becomes one ``cat`` of the flattened gradients (inductor writes each gradient
straight into its slot of the concatenation: one pass over the gradients, as before). The gradients stay views
of the waited result. Before / after, for a bucket {fc.weight, fc.bias}::

    empty = aten.empty([4160])
    slice_1 = aten.slice(empty, 0, 0, 4096); view_3 = aten.view(slice_1, [64, 64]); copy_ = aten.copy_(view_3, mm_5)
    slice_2 = aten.slice(empty, 0, 4096, 4160); view_4 = aten.view(slice_2, [64]); copy__1 = aten.copy_(view_4, sum_1)
    all_reduce_ = c10d.all_reduce_(empty, 'sum', '0')
    ...                                                       # the rest of backward overlaps
    wait_tensor = c10d.wait_tensor(all_reduce_)
    slice_3 = aten.slice(wait_tensor, 0, 0, 4096); view_5 = aten.view(slice_3, [64, 64])

    view_a = aten.view(mm_5, [-1]); view_b = aten.view(sum_1, [-1]); cat = aten.cat([view_a, view_b])
    all_reduce = c10d.all_reduce(cat, 'sum', '0')
    ...
    wait_tensor = c10d.wait_tensor(all_reduce)
    slice_3 = aten.slice(wait_tensor, 0, 0, 4096); view_5 = aten.view(slice_3, [64, 64])

The number, order and place of the collectives and of their waits do not change, nor what they carry. A buffer
of another shape (not made by ``empty`` alone, or read elsewhere before its reduction) keeps its copies and is
reduced functionally: readers after the wait read the waited result. The runtime's gather for gloo
(``fxpar::all_gather_into_tensor``) is functional already and stays.
"""
from __future__ import annotations

import torch
import torch.fx

from fxpar.collectives import C10D
from fxpar.pass_manager import Pass, PassContext, PassResult

__all__ = ["FunctionalCollectives", "functional_collectives", "fold_buckets", "IN_PLACE"]

aten = torch.ops.aten

# in-place functional collective -> its functional twin (same arguments, a fresh result)
IN_PLACE = {C10D.all_reduce_.default: C10D.all_reduce.default}


def _slots(buf: torch.fx.Node, coll: torch.fx.Node, pos: dict) -> list | None:
    """``[(offset, numel, copy_ node, source)]`` in offset order where ``buf`` is a flat ``empty`` that nothing but
    its slots' ``copy_`` writes or reads before ``coll`` and the slots tile it end to end; else None."""
    if buf.op != "call_function" or buf.target is not aten.empty.memory_format:
        return None
    val = buf.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 1:
        return None
    out = []
    for sl in buf.users:
        if sl is coll or pos[sl] > pos[coll]:
            continue
        if sl.target is not aten.slice.Tensor or tuple(sl.args[1:2]) != (0,) or len(sl.users) != 1:
            return None
        (view,) = sl.users
        if view.target is not aten.view.default or len(view.users) != 1:
            return None
        (cp,) = view.users
        if cp.target is not aten.copy_.default or cp.args[0] is not view or cp.users or pos[cp] > pos[coll]:
            return None
        lo, hi = sl.args[2], sl.args[3]
        src = cp.args[1]
        sval = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        if not isinstance(sval, torch.Tensor) or sval.dtype != val.dtype:
            return None               # a copy_ that casts (or of an unknown dtype): a cat would not
        out.append((lo, hi - lo, cp, src))
    out.sort(key=lambda s: s[0])
    at = 0
    for lo, n, _, _ in out:
        if lo != at:
            return None
        at += n
    return out if out and at == val.numel() else None


def _fold(g: torch.fx.Graph, buf: torch.fx.Node, coll: torch.fx.Node, slots: list) -> torch.fx.Node:
    """One ``cat`` of the flattened sources in place of ``buf`` and its copies, inserted just before ``coll``."""
    parts = []
    with g.inserting_before(coll):
        for _, n, _, src in slots:
            flat = g.call_function(aten.reshape.default, (src, [-1]))
            flat.meta["val"] = src.meta["val"].reshape(-1) if "val" in src.meta else None
            parts.append(flat)
        cat = g.call_function(aten.cat.default, (parts,))
    cat.meta.update({k: v for k, v in buf.meta.items() if k != "val"})
    cat.meta["val"] = buf.meta["val"].new_empty(buf.meta["val"].shape) if "val" in buf.meta else None
    for _, _, cp, _ in slots:
        view = cp.args[0]
        sl = view.args[0]
        g.erase_node(cp)
        g.erase_node(view)
        g.erase_node(sl)
    return cat


def _slot_head(u: torch.fx.Node) -> bool:
    """Whether ``u`` (a user of a bucket buffer) is a slot: ``slice`` -> ``view`` -> ``copy_`` into the view."""
    if u.target is not aten.slice.Tensor or len(u.users) != 1:
        return False
    (view,) = u.users
    if view.target is not aten.view.default or len(view.users) != 1:
        return False
    (cp,) = view.users
    return cp.target is aten.copy_.default and cp.args[0] is view


def fold_buckets(gm: torch.fx.GraphModule) -> int:
    """Every bucket buffer of ``gm`` that no in-place collective reduces -- one a compression method's bucket sum
    reads, or one a graph cut around Python calls returns -- made one ``cat`` of its flattened sources where it is
    first read, as :func:`functional_collectives` makes a reduced one (functionalised, the copies are a chain of
    ``slice_scatter`` ops over the whole buffer, which inductor fuses into one loop that tests every slot at every
    element: 31 ms against 2 ms for a 6.3M-element bucket of 20 gradients). Returns how many changed."""
    g = gm.graph
    changed = 0
    for buf in [n for n in g.nodes if n.op == "call_function" and n.target is aten.empty.memory_format]:
        pos = {n: i for i, n in enumerate(g.nodes)}
        readers = [u for u in buf.users if not _slot_head(u)]
        if not readers:
            continue
        first = min(readers, key=pos.__getitem__)
        slots = _slots(buf, first, pos)
        if slots is None:
            continue
        buf.replace_all_uses_with(_fold(g, buf, first, slots))
        g.erase_node(buf)
        changed += 1
    if changed:
        g.lint()
        gm.recompile()
    return changed


def functional_collectives(gm: torch.fx.GraphModule) -> int:
    """Make every in-place collective of ``gm`` functional (see the module's docstring), and fold the bucket buffers
    no collective reduces (:func:`fold_buckets`); returns how many changed."""
    g = gm.graph
    changed = 0
    for coll in [n for n in g.nodes if n.op == "call_function" and n.target in IN_PLACE]:
        pos = {n: i for i, n in enumerate(g.nodes)}
        buf = coll.args[0]
        slots = _slots(buf, coll, pos)
        src = _fold(g, buf, coll, slots) if slots is not None else buf
        with g.inserting_before(coll):
            new = g.call_function(IN_PLACE[coll.target], (src, *coll.args[1:]), dict(coll.kwargs))
        new.meta.update(coll.meta)
        waits = [u for u in coll.users if u.target is C10D.wait_tensor.default]
        coll.replace_all_uses_with(new)
        g.erase_node(coll)
        if slots is not None and not buf.users:
            g.erase_node(buf)
        elif waits:            # a later reader of the buffer sees the reduced values: it reads the first wait
            first = min(waits, key=pos.__getitem__)
            for u in list(buf.users):
                if u is not new and pos.get(u, -1) > pos[first]:
                    u.replace_input_with(buf, first)
        changed += 1
    if changed:
        g.lint()
        gm.recompile()
    return changed + fold_buckets(gm)


class FunctionalCollectives(Pass):
    """The pass form of :func:`functional_collectives`, for a pass list of one's own."""
    name = "functional_collectives"

    def run(self, gm, ctx: PassContext) -> PassResult:
        return PassResult(gm, functional_collectives(gm) > 0)
