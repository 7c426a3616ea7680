"""Gradient bucketing (PyTorch DDP, Li et al. VLDB 2020): fuse per-gradient all_reduces.

The planner cuts the gradients, in the order backward produces them, into buckets of at most
``bucket_cap_bytes`` (``plan.section("data_parallel").buckets``). For each bucket this pass flattens the gradients into
one buffer right after the last of them is produced, issues one in-place all_reduce there (so
it overlaps with the rest of backward), and places the wait as late as possible: just before
the first use of any of the bucket's gradients. The gradients are then views of the reduced
buffer. Like DDP, this makes one pass over the gradients: each is ``copy_``-ed into its slot of
a fresh flat buffer (whatever its layout; ``reshape`` + ``cat`` would copy a transposed weight
gradient twice). The division by dp was folded into backward's seed by ``data_parallel``; a
graph without that seed gets an in-place ``div_`` of the bucket. Before / after, for a bucket
{fc.weight, fc.bias}::

    mm_5 = aten.mm(...)                              # grad fc.weight
    all_reduce = c10d.all_reduce(mm_5, 'sum', 'fxpar:dp'); wait = c10d.wait_tensor(all_reduce)
    view_2 = aten.view(sum_1, [64])                  # grad fc.bias
    all_reduce_1 = ...; wait_1 = ...

    mm_5 = aten.mm(...)
    view_2 = aten.view(sum_1, [64])
    empty = aten.empty([4160], dtype=torch.float32)
    slice_1 = aten.slice(empty, 0, 0, 4096); view_3 = aten.view(slice_1, [64, 64]); copy_ = aten.copy_(view_3, mm_5)
    slice_2 = aten.slice(empty, 0, 4096, 4160); view_4 = aten.view(slice_2, [64]); copy__1 = aten.copy_(view_4, view_2)
    all_reduce_ = c10d.all_reduce_(empty, 'sum', 'fxpar:dp')  # bucket 0, issued here, in place
    ...                                                       # rest of backward overlaps
    wait_tensor = c10d.wait_tensor(all_reduce_)               # just before the optimizer needs it
    slice_3 = aten.slice(wait_tensor, 0, 0, 4096); view_5 = aten.view(slice_3, [64, 64])   # fc.weight
    slice_4 = aten.slice(wait_tensor, 0, 4096, 4160); view_6 = aten.view(slice_4, [64])     # fc.bias
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fxpar import meta as M
from fxpar.collectives import insert_all_reduce
from fxpar.pass_manager import Pass, PassContext, PassResult

from .graph_utils import grad_sync_chains
from fxpar.zero_layout import zero_keys

__all__ = ["BucketGradients"]

aten = torch.ops.aten


def _meta(node, val, src, **extra):
    node.meta["val"] = val
    node.meta[M.PHASE.name] = "backward"
    node.meta[M.MODULE.name] = M.get(src, M.MODULE, "")
    for k, v in extra.items():
        node.meta[k] = v


class _Slots:
    """The fake values of a bucket's flat buffer and of its slots. A slot's value is a view of the buffer's meta
    tensor wrapped as a fake tensor of the buffer's mode: what slicing the buffer's fake tensor gives (the same
    layout, over the same storage), without a trip through fake-tensor dispatch per gradient. Values that are not
    fake tensors are sliced as they are."""

    def __init__(self, like, total: int):
        if isinstance(like, FakeTensor):
            self.meta = torch.empty([total], dtype=like.dtype, device="meta")
            self.mode, self.device = like.fake_mode, like.device
            self.val = FakeTensor(self.mode, self.meta, self.device)
        else:
            self.meta, self.val = None, like.new_empty([total])

    def slot(self, off: int, n: int, shape=None):
        if self.meta is None:
            v = self.val[off:off + n]
            return v if shape is None else v.view(shape)
        v = self.meta[off:off + n]
        return FakeTensor(self.mode, v if shape is None else v.view(shape), self.device)


class BucketGradients(Pass):
    name = "bucket"
    requires = ("data_parallel",)

    def run(self, gm, ctx: PassContext) -> PassResult:
        section = ctx.plan.section("data_parallel")
        buckets = section.buckets[ctx.stage] if section is not None and section.buckets else []
        groups = ctx.plan.grad_groups[ctx.stage] if ctx.plan.grad_groups else {}
        sharded = set(zero_keys(ctx.plan, ctx.stage))        # passes.zero reduce-scatters these buckets instead
        buckets = [b for b in buckets if not sharded.intersection(b)]
        dp = ctx.mesh.axis_size("dp")
        if not buckets:
            return PassResult(gm, False)
        g = gm.graph
        chains = grad_sync_chains(gm)
        missing = [k for b in buckets for k in b if k not in chains]
        if missing:
            raise ValueError(f"plan.section('data_parallel').buckets names {missing}, which have no synchronised "
                             "gradient in this graph; "
                             f"bucket only trainable parameters ({sorted(chains)[:5]}...)")
        order = {n: i for i, n in enumerate(g.nodes)}
        sizes = []
        for b_idx, keys in enumerate(buckets):
            names = {groups.get(k) for k in keys}
            if len(names) != 1 or None in names:
                raise ValueError(f"plan.section('data_parallel').buckets[{ctx.stage}][{b_idx}] = {keys} mixes gradient "
                                 "groups "
                                 f"{sorted(map(str, names))}: a bucket is one collective over one group; split it")
            axis = names.pop()
            ranks = ctx.plan.group_of(axis, ctx.rank)
            parts = [chains[k] for k in keys]
            raws = [p[0] for p in parts]
            last = max(raws, key=order.__getitem__)
            first_use = min((u for p in parts for u in p[3].users), key=order.__getitem__)
            # one pass over the gradients, as DDP's copy into its bucket: each gradient is copied
            # into its slot of a fresh flat buffer, whatever its layout (a transposed weight
            # gradient would otherwise be copied twice: made contiguous, then concatenated)
            vals = [r.meta["val"] for r in raws]
            dtypes = {v.dtype for v in vals}
            if len(dtypes) > 1:
                raise ValueError(f"plan.section('data_parallel').buckets[{ctx.stage}][{b_idx}] mixes gradient dtypes "
                                 f"({sorted(map(str, dtypes))}: {keys}); "
                                 "a bucket is one flat buffer: split it so that each holds one dtype")
            total = sum(v.numel() for v in vals)
            with g.inserting_after(last):
                buf = g.call_function(aten.empty.memory_format, ([total],),
                                      {"dtype": vals[0].dtype, "device": vals[0].device})
            slots = _Slots(vals[0], total)
            _meta(buf, slots.val, last, **{M.REDUCE_GRAD.name: "issue"})
            off, cursor = 0, buf
            for r, val in zip(raws, vals):
                n = val.numel()
                with g.inserting_after(cursor):
                    sl = g.call_function(aten.slice.Tensor, (buf, 0, off, off + n))
                with g.inserting_after(sl):
                    slot = g.call_function(aten.view.default, (sl, list(val.shape)))
                with g.inserting_after(slot):
                    cursor = g.call_function(aten.copy_.default, (slot, r))
                sl_val = slots.slot(off, n)
                slot_val = slots.slot(off, n, val.shape)
                issue = {M.REDUCE_GRAD.name: "issue"}
                _meta(sl, sl_val, r, **issue)
                _meta(slot, slot_val, r, **issue)
                _meta(cursor, slot_val, r, **issue)
                off += n
            # the flat buffer is ours alone: reduce it in place (the functional all_reduce would copy it)
            ar, w = insert_all_reduce(g, buf, axis, ranks, after=cursor, wait_before=first_use, in_place=True)
            M.set_meta(ar, M.BUCKET, b_idx)
            M.set_meta(ar, M.REDUCE_GRAD, "issue")
            M.set_meta(w, M.REDUCE_GRAD, "wait")
            sizes.append(M.get(ar, M.COMM).nbytes)
            if all(p[3] is p[2] for p in parts):       # backward already divided by dp
                div = w
            else:
                with g.inserting_after(w):
                    div = g.call_function(aten.div_.Tensor, (w, dp))
                _meta(div, buf.meta["val"], last, **{M.REDUCE_GRAD.name: "wait"})
            off, anchor = 0, div
            for key, (raw, old_ar, old_w, avg) in zip(keys, parts):
                shape = list(raw.meta["val"].shape)
                numel = raw.meta["val"].numel()
                with g.inserting_after(anchor):
                    sl = g.call_function(aten.slice.Tensor, (div, 0, off, off + numel))
                with g.inserting_after(sl):
                    v = g.call_function(aten.view.default, (sl, shape))
                dv = div.meta.get("val")           # the buffer's value (insert_all_reduce and the div_ keep it)
                _meta(sl, slots.slot(off, numel) if dv is slots.val else dv[off:off + numel], raw,
                      **{M.REDUCE_GRAD.name: "wait"})
                M.copy_meta(avg, v)          # v replaces the averaged gradient: keep what stays true, record it
                _meta(v, raw.meta["val"], raw, **{M.GRAD_OF.name: key, M.REDUCE_GRAD.name: "wait"})
                avg.replace_all_uses_with(v)
                for dead in dict.fromkeys((avg, old_w, old_ar)):
                    g.erase_node(dead)
                off += numel
                anchor = v
        ctx.notes.append(f"bucket: {len(buckets)} bucket(s) of sizes {sizes} bytes replace per-gradient all_reduces")
        return PassResult(gm, True, {"buckets": len(buckets), "bytes": sizes})
