"""Lower a sharded joint graph to one rank's local graph: collectives where layouts change, local sizes.

Input: a joint graph and a :class:`~passes.propagate_sharding.ShardingResult` (each node's output
sharding and the sharding each op needs its inputs in). Output: the graph one rank runs on its
local pieces. Where a producer's sharding differs from what a consumer needs, the change is
inserted (per mesh axis, reductions first): ``all_reduce`` (P -> R), ``reduce_scatter`` (P -> S),
``all_gather`` (S -> R), ``all_to_all`` (S(d) -> S(e)), a local slice (R -> S) or a local zero
(R -> P: rank 0 of the axis keeps the value, the others hold zeros); the last two read the rank's coordinate
at run time (``fxpar.local_ops``), so every rank of the mesh runs the same graph. A version made for one consumer
is reused by the next. A node whose chosen placements are a candidate its rule registered in
``passes.sharding.core.LOCAL_OPS`` runs as that local op instead (the vocabulary-parallel embedding:
``embedding(wte_weight, idx)`` -> ``fxpar.vocab_embedding(wte_weight, idx, 'fxpar:tp')``). Sizes in
``view``/``expand``/``slice_backward``/``convolution_backward`` … are rewritten to the local sizes,
and every node's local shape is checked with fake tensors against its sharding. Megatron's MLP
(column-parallel fc1, row-parallel fc2) on tp=2::

    before                                          after (rank 0)
    t = aten.t(fc1_weight)        # [16, 8]          t = aten.t(fc1_weight)                        # [8, 8]
    addmm = aten.addmm(b1, x, t)                      addmm = aten.addmm(b1, x, t)                  # [12, 8]
    view_1 = aten.view(addmm, [4, 3, 16])             view_1 = aten.view(addmm, [4, 3, 8])
    ...                                               ...
    addmm_1 = aten.addmm(b2, view_2, t_1)             addmm_1 = aten.addmm(b2, view_2, t_1)         # partial sums
    view_3 = aten.view(addmm_1, [4, 3, 8])            view_3 = aten.view(addmm_1, [4, 3, 8])
                                                      all_reduce = _c10d_functional.all_reduce(view_3, 'sum', 'fxpar:tp')
                                                      wait_tensor = _c10d_functional.wait_tensor(all_reduce)
    mse_loss = aten.mse_loss(view_3, target0)         mse_loss = aten.mse_loss(wait_tensor, target0)

Collectives name their group by mesh axis (``"fxpar:tp"``, bound per rank at run time) and carry
``fxpar_comm`` (kind, axis, ranks, bytes handed to it).
"""
from __future__ import annotations

import operator

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.node import map_arg

from fxpar import meta as M
from fxpar.annotate import is_shard_node
from fxpar.collectives import C10D, group_tag
from fxpar.errors import PassError
from fxpar.local_ops import axis_chunk, first_on_axis
from fxpar.mesh import Mesh
from fxpar.roles import Role
from fxpar.sharding import P, Sharding, redistribute_bytes, redistribute_steps

from .fake_values import refresh, single_fake_mode
from .sharding import OpInfo, tensor_leaves
from .sharding.core import local_lowering

__all__ = ["lower_shardings", "local_value", "global_value", "SIZE_ARGS"]

aten = torch.ops.aten
# op -> (arg position of a size, index of the output whose local shape it becomes; "int0": its dim 0 as an int)
SIZE_ARGS = {aten.view.default: (1, 0), aten._unsafe_view.default: (1, 0), aten.reshape.default: (1, 0),
             aten.expand.default: (1, 0), aten.slice_backward.default: (1, 0), aten.new_zeros.default: (1, 0),
             aten.new_ones.default: (1, 0), aten.new_empty.default: (1, 0), aten.new_full.default: (1, 0),
             aten.convolution_backward.default: (3, 2), aten.embedding_dense_backward.default: (2, "int0")}
_ORDER = {"all_reduce": 0, "reduce_scatter": 1, "all_gather": 2, "all_to_all": 3, "slice": 4, "zero": 5}


class _Lowering:
    def __init__(self, gm, res, mesh: Mesh, rank: int):
        self.gm, self.res, self.mesh, self.rank = gm, res, mesh, rank
        self.sizes = dict(mesh.axes)
        self.coords = mesh.coords(rank)
        self.g = torch.fx.Graph()
        self.env = {}
        self.versions = {}          # old node -> {Sharding: new node}
        self.from_canon = {}        # gradient node -> {Sharding: new node made from its parameter-laid-out value}
        self.expect = {}            # new node -> (Sharding, global shape, what)
        # a parameter's gradient, laid out as the parameter: what the optimizer and the outputs derive theirs from
        self.canon = {M.get(n, M.PARAM): res.out[n.name][0] for n in gm.graph.find_nodes(op="placeholder")
                      if M.get(n, M.ROLE) == Role.PARAM and res.out.get(n.name)}

    def _new(self, target, args, kwargs=None, like=None, expect=None, name=None):
        n = self.g.create_node("call_function", target, args, kwargs or {}, name=name)
        if like is not None:
            for k in (M.PHASE.name, M.MODULE.name):
                if k in like.meta:
                    n.meta[k] = like.meta[k]
            n.meta[M.PASS.name] = "lower_sharding"
        if expect is not None:
            self.expect[n] = expect
        return n

    # --- redistribution ----------------------------------------------------------------------------------
    def get(self, leaf, want: Sharding, consumer):
        vers = self.versions[leaf]
        canon = self.canon.get(M.get(leaf, M.GRAD_OF)) if M.get(consumer, M.PHASE) != "backward" else None
        if canon is not None and want != canon:
            # after backward a gradient is first laid out as its parameter (the value microbatches sum and data
            # parallelism reduces, passes.tensor_parallel), and every other layout is made from that one, never
            # from a layout backward made before it (which holds this rank's unreduced gradient)
            derived = self.from_canon.setdefault(leaf, {})
            if want in derived:
                return derived[want]
            base = self.get(leaf, canon, consumer)
            derived[want] = self._convert(leaf, {canon: base}, want, consumer, derived)
            return derived[want]
        if want in vers:
            return vers[want]
        return self._convert(leaf, vers, want, consumer, vers)

    def _convert(self, leaf, vers, want: Sharding, consumer, cache):
        """``leaf`` as ``want``, made from the cheapest of ``vers``; the layouts passed on the way go to ``cache``."""
        shape = tuple(leaf.meta["val"].shape)
        nbytes = leaf.meta["val"].numel() * leaf.meta["val"].element_size()

        def cost(s):
            return sum(redistribute_bytes(s.placement(a), want.placement(a), nbytes / (n if isinstance(
                s.placement(a), int) else 1), n) for a, n in self.sizes.items() if n > 1)
        cur_sh = min(vers, key=cost)
        cur = vers[cur_sh]
        steps = [(a, k, src, dst) for a in self.sizes if self.sizes[a] > 1
                 for k, src, dst in redistribute_steps(cur_sh.placement(a), want.placement(a))]
        for axis, kind, _, dst in sorted(steps, key=lambda s: _ORDER[s[1]]):
            nxt = cur_sh.with_placement(axis, dst)
            cur = self._step(kind, cur, cur_sh, nxt, axis, shape, consumer, leaf)
            cur_sh = nxt
            cache.setdefault(cur_sh, cur)
        return cur

    def _step(self, kind, x, src: Sharding, dst: Sharding, axis, shape, consumer, leaf):
        n, tag = self.sizes[axis], group_tag(axis)
        exp = (dst, shape, f"{leaf.name} as {dst} for {consumer.name}")
        mk = lambda t, a, e=None: self._new(t, a, like=consumer, expect=e)  # noqa: E731
        if kind == "zero":          # the axis's first rank keeps the value, the others hold zeros
            return mk(first_on_axis, (x, tag), exp)
        if kind == "slice":         # this rank's piece, its coordinate read at run time (one graph for all ranks)
            return mk(axis_chunk, (x, dst.placement(axis), n, tag), exp)
        if kind == "all_reduce":
            return self._wait(mk(C10D.all_reduce.default, (x, "sum", tag)), axis, x, exp, consumer)
        d = src.placement(axis) if kind in ("all_gather", "all_to_all") else dst.placement(axis)
        x0 = self._to_front(x, d, consumer)
        if kind == "all_gather":
            y = self._wait(mk(C10D.all_gather_into_tensor.default, (x0, n, tag)), axis, x0, None, consumer)
            return self._from_front(y, d, consumer, exp)
        if kind == "reduce_scatter":
            y = self._wait(mk(C10D.reduce_scatter_tensor.default, (x0, "sum", n, tag)), axis, x0, None, consumer)
            return self._from_front(y, d, consumer, exp)
        return self._all_to_all(x, src, dst, axis, shape, consumer, exp)

    def _all_to_all(self, x, src, dst, axis, shape, consumer, exp):
        """S(d) -> S(e): cut e into n blocks, block j to rank j; the blocks received are the d-pieces, in order."""
        n, d, e = self.sizes[axis], src.placement(axis), dst.placement(axis)
        loc = list(src.local_shape(shape, self.sizes))
        mk = lambda t, a, ex=None: self._new(t, a, like=consumer, expect=ex)  # noqa: E731
        split = loc[:e] + [n, loc[e] // n] + loc[e + 1:]
        v = mk(aten.view.default, (x, split))
        front = self._new(aten.clone.default, (mk(aten.movedim.int, (v, e, 0)),),
                          {"memory_format": torch.contiguous_format}, like=consumer)
        numel0 = [1] * n
        y = self._wait(mk(C10D.all_to_all_single.default, (front, numel0, numel0, group_tag(axis))), axis, front,
                       None, consumer, kind="all_to_all")
        # y: [n (source rank = d-block), *loc with e split]; put the block index next to d and merge
        rest = loc[:e] + [loc[e] // n] + loc[e + 1:]
        moved = mk(aten.movedim.int, (y, 0, d))
        out_shape = rest[:d] + [rest[d] * n] + rest[d + 1:]
        merged = self._new(aten.clone.default, (moved,), {"memory_format": torch.contiguous_format}, like=consumer)
        return mk(aten.view.default, (merged, out_shape), exp)

    def _to_front(self, x, d, consumer):
        if d == 0:
            return x
        m = self._new(aten.movedim.int, (x, d, 0), like=consumer)
        return self._new(aten.clone.default, (m,), {"memory_format": torch.contiguous_format}, like=consumer)

    def _from_front(self, y, d, consumer, exp):
        if d == 0:
            self.expect[y] = exp
            return y
        m = self._new(aten.movedim.int, (y, 0, d), like=consumer)
        return self._new(aten.clone.default, (m,), {"memory_format": torch.contiguous_format}, like=consumer, expect=exp)

    def _wait(self, coll, axis, x, exp, consumer, kind=None):
        kind = kind or {C10D.all_reduce.default: "all_reduce", C10D.all_gather_into_tensor.default: "all_gather",
                        C10D.reduce_scatter_tensor.default: "reduce_scatter"}[coll.target]
        coll.meta["_fxpar_comm_pending"] = (kind, axis, x)
        return self._new(C10D.wait_tensor.default, (coll,), like=consumer, expect=exp)

    # --- the walk ------------------------------------------------------------------------------------------
    def run(self) -> torch.fx.GraphModule:
        out_of = self.res.out
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                new = self.g.placeholder(node.name)
                new.meta.update({k: v for k, v in node.meta.items() if k.startswith("fxpar_")})
                self.expect[new] = (out_of[node.name][0], tuple(node.meta["val"].shape), node.name)
                self._bind(node, new)
            elif node.op == "output":
                self._output(node)
            elif is_shard_node(node):
                continue
            elif node.name in self.res.sources and self.res.sources[node.name].startswith("fxpar.shard"):
                x = node.args[0]
                self._bind(node, self.get(x, out_of[node.name][0], node), alias=True)
            else:
                self._op(node)
        # lazy, as the capture's: the Python code is generated when first read or run, not at each recompile()
        gm = _LazyGraphModule(torch.nn.Module(), self.g)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm

    def _output(self, node):
        """Outputs as they are, or as ``res.need`` says (updated state laid out as it came in)."""
        needs = iter(self.res.need.get(node.name, ()))
        has = node.name in self.res.need
        self.g.output(torch.fx.node.map_arg(node.args[0], lambda a: self.get(a, next(needs), node) if has
                                            else self.env[a]))

    def _bind(self, node, new, alias=False):
        self.env[node] = new
        outs = self.res.out.get(node.name, ())
        if len(outs) == 1:
            self.versions[node] = {outs[0]: new}
            val = node.meta.get("val")
            if not alias and node.op != "placeholder" and isinstance(val, torch.Tensor):   # not a list (_foreach_*)
                self.expect.setdefault(new, (outs[0], tuple(val.shape), node.name))

    def _op(self, node):
        if node.target is operator.getitem:
            new = self._new(operator.getitem, (self.env[node.args[0]], node.args[1]), like=node, name=node.name)
            new.meta.update({k: v for k, v in node.meta.items() if k.startswith("fxpar_") and k != M.PASS.name})
            self._bind(node, new)
            return
        needs = self.res.need[node.name]
        leaves = tensor_leaves(node)
        repl = {}
        for (path, leaf), want in zip(leaves, needs):
            repl[path] = self.get(leaf, want, node)
        args = [self._arg((i,), a, repl) for i, a in enumerate(node.args)]
        kwargs = {k: self._arg((k,), a, repl) for k, a in node.kwargs.items()}
        if node.target in SIZE_ARGS:
            pos, which = SIZE_ARGS[node.target]
            args[pos] = self._local_size(node, 0 if which == "int0" else which, args[pos], which == "int0")
        target, args, kwargs = self._local_op(node, needs, tuple(args), kwargs)
        if target is aten.view.default:     # a redistributed input is contiguous, not laid out as the op that made
            target = aten.reshape.default   # it (flash attention's output): view where it can, copy where not
        new = self._new(target, args, kwargs, like=node, name=node.name)
        new.meta.update({k: v for k, v in node.meta.items() if k.startswith("fxpar_") and k != M.PASS.name})
        self._bind(node, new)

    def _local_op(self, node, needs, args, kwargs):
        """The op itself, or the local computation its rule registered for the placements chosen along an axis
        (``passes.sharding.LOCAL_OPS``: the vocabulary-parallel embedding), reading that axis's coordinate."""
        outs = self.res.out[node.name]
        per_axis = {a: (tuple(s.placement(a) for s in needs), tuple(s.placement(a) for s in outs))
                    for a, n in self.sizes.items() if n > 1}
        hit = local_lowering(node.target, per_axis, f"node {node.name!r} ({M.get(node, M.MODULE) or '<root>'})")
        if hit is None:
            return node.target, args, kwargs
        axis, fn = hit
        return fn(args, kwargs, group_tag(axis))

    def _arg(self, path, a, repl):
        if path in repl:
            return repl[path]
        if isinstance(a, (list, tuple)):
            return type(a)(repl.get(path + (j,), self.env.get(b, b) if isinstance(b, torch.fx.Node) else b)
                           for j, b in enumerate(a))
        return self.env[a] if isinstance(a, torch.fx.Node) else a

    def _local_size(self, node, out_pos, size, as_int):
        """The size argument of ``node`` as the local shape of its output at flattened position ``out_pos``."""
        info = OpInfo.of(node)
        if size is None or out_pos not in info.out_pos:
            return size
        i = info.out_pos.index(out_pos)
        local = list(self.res.out[node.name][i].local_shape(info.out_shapes[i], self.sizes, name=node.name))
        return local[0] if as_int else local


def lower_shardings(gm: torch.fx.GraphModule, res, mesh, rank: int = 0, world=None) -> torch.fx.GraphModule:
    """The local graph of ``gm`` under the shardings ``res`` that every rank of ``mesh`` runs (each reads its
    coordinate at run time); every local shape checked. ``rank``: whose groups the collectives' ``fxpar_comm``
    names (the ranks of a stage share the graph, so its first rank stands for all), in ``world`` (the program's
    whole mesh, of which ``mesh``'s axes are part; default ``mesh``)."""
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(tuple(mesh.items()))
    low = _Lowering(gm, res, mesh, rank)
    out = low.run()
    _check_shapes(out, low)
    _stamp_comm(out, mesh if world is None else world, rank)
    return out


def _check_shapes(gm, low: _Lowering) -> None:
    # each local node's value: the joint node's it copies where its op, arguments and inputs' values are the joint
    # node's (a replicated op), recomputed on fake tensors where they differ (passes.fake_values)
    mode = single_fake_mode(low.gm)
    before = {}
    if mode is not None:
        for old, new in low.env.items():
            if (new.name == old.name or old.op == "placeholder") and new.op == old.op and new.graph is gm.graph \
                    and "val" in old.meta:
                get = lambda a: low.env.get(a, a)     # noqa: E731 - a node not carried over matches nothing
                before[new] = (old.target, map_arg(old.args, get), map_arg(old.kwargs, get), old.meta["val"])
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    # the joint graph's placeholder each local one stands for (fx may rename it: LayerNorm_weight -> layer_norm_weight)
    joint = {new: old for old, new in low.env.items() if old.op == "placeholder"}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            sh, shape, what = low.expect[n]
            val = joint[n].meta["val"]       # the local piece keeps the joint value's dtype and device (cuda, meta)
            with mode:
                n.meta["val"] = torch.empty(sh.local_shape(shape, low.sizes, name=what), dtype=val.dtype,
                                            device=val.device)
    refresh(gm, before)
    for n in gm.graph.nodes:
        if n in low.expect and n.op != "placeholder":
            sh, shape, what = low.expect[n]
            want = sh.local_shape(shape, low.sizes, name=what)
            got = tuple(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else None
            if got != want:
                raise PassError(f"lower_sharding: {what} ({M.get(n, M.MODULE) or '<root>'}) has local shape "
                                f"{list(got) if got else got} on rank {low.rank}, but its sharding {sh} of global shape "
                                f"{list(shape)} gives {list(want)}: the rule for {n.target} is wrong -- please report it")


def _stamp_comm(gm, mesh: Mesh, rank: int) -> None:
    for n in gm.graph.nodes:
        pend = n.meta.pop("_fxpar_comm_pending", None)
        if pend is None:
            continue
        kind, axis, x = pend
        v = x.meta["val"]
        M.set_meta(n, M.COMM, M.CommInfo(kind, axis, mesh.group(rank, axis), int(v.numel() * v.element_size())))


def local_value(t: torch.Tensor, sh: Sharding, mesh, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of the whole tensor ``t`` under ``sh`` (a partial sum: rank 0 of the axis holds t)."""
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(tuple(mesh.items()))
    c = mesh.coords(rank)
    for axis in sh.axes:
        pl, n = sh.placement(axis), mesh.axis_size(axis)
        if pl == P:
            t = t if c[axis] == 0 else torch.zeros_like(t)
        elif isinstance(pl, int):
            t = t.chunk(n, dim=pl)[c[axis]]
    return t.contiguous()


def global_value(pieces: list, sh: Sharding, mesh) -> torch.Tensor:
    """The whole tensor from every rank's piece under ``sh`` (``pieces`` in rank order)."""
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(tuple(mesh.items()))
    by = {r: p for r, p in enumerate(pieces)}
    for axis in sh.axes:
        pl = sh.placement(axis)
        merged = {}
        for r in by:
            grp = mesh.group(r, axis)
            if r != grp[0]:
                continue
            parts = [by[q] for q in grp]
            merged[r] = torch.cat(parts, dim=pl) if isinstance(pl, int) else torch.stack(parts).sum(0)
        by = merged
    return by[min(by)]
