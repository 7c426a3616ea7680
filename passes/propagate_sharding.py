"""Sharding propagation (GShard): from a few fixed shardings, decide every node's, through the joint graph.

Fixed (``passes/sharding/layouts.py``): ``fxpar.shard`` annotations in the forward
(:mod:`fxpar.annotate`) and Mesh-TensorFlow-style layouts, glob patterns over parameter keys
(``{"blocks.*.mlp.fc1.weight": ("tp", None)}``; a parameter's optimizer state takes its layout).
Then, per mesh axis (Lepikhin et al., GShard, ICLR'21, §3.5; placements per axis as DTensor's):

1. *backward*: from each annotation, its placement flows to the producers of the annotated value
   through forward ops whose rule admits one input placement for it (``mm`` with a column-split
   output wants its weight column-split), stopping at a node with its own annotation or layout
   (that one wins). Two annotations whose wishes meet at an unannotated node and differ is a
   :class:`ShardingConflict` naming both and the node: annotate that node to say which wins.
2. *forward*, in graph order (forward, backward, optimizer): each op takes the candidate of its rule
   (``passes.sharding``) that costs the fewest bytes to redistribute its inputs into, then the fewest
   changes, then matches a preference, then comes first (all-replicated first); ``_Axis._charge``
   says how bytes are counted. An unfixed parameter or input takes the placement its first
   consumer's choice wants, through the views in between (the bias of a column-parallel Linear is
   split with its weight; ``t(fc2.weight)`` is decided by its matmul); optimizer state follows its
   parameter. With ``signature=``, every updated parameter and state leaves laid out as it came in.

The result says, per node, the sharding of each tensor output and the sharding each tensor input
must be in (``passes.lower_sharding`` inserts the collective where they differ), lists the ops
without a rule (run replicated), and explains itself. Nothing in the graph is changed.

    >>> res = propagate_shardings(cap.gm, Mesh((("tp", 2),)), layouts={"fc1.weight": ("tp", None),
    ...                                                                  "fc2.weight": (None, "tp")})
    >>> print(res.explain())                          # Megatron's MLP: nothing else was said
    shardings over mesh {'tp': 2}:
      fc1_weight                   P('tp', None)   [layout 'fc1.weight': ('tp', None)]
      fc1_bias                     P('tp')
      addmm                        P(None, 'tp')
      gelu                         P(None, None, 'tp')
      addmm_1                      P(None, None, partial=('tp',))
      ...
    redistributions: 2, 768 bytes per rank
      zero            fc2_bias -> addmm_1: R -> P over 'tp', 0 B
      all_reduce      view_3 -> mse_loss: P -> R over 'tp', 768 B
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from fxpar import meta as M
from fxpar.annotate import annotated_value, is_shard_node
from fxpar.roles import Role
from fxpar.sharding import P, R, Sharding, axis_sizes, fmt_placement, redistribute_bytes, redistribute_steps

from .sharding import OpInfo, groups_of, has_rule, tensor_leaves
from .sharding.layouts import ShardingConflict, describe, fixed_shardings

__all__ = ["propagate_shardings", "ShardingResult", "ShardingConflict", "placement_fits"]


@dataclass
class ShardingResult:
    mesh: dict                                   # axis -> size
    out: dict = field(default_factory=dict)      # node name -> tuple of Sharding, one per tensor output
    need: dict = field(default_factory=dict)     # node name -> tuple of Sharding, one per tensor input
    no_rule: list = field(default_factory=list)  # [(node name, op, module)] ops run replicated for want of a rule
    sources: dict = field(default_factory=dict)  # node name -> the annotation or layout that fixed it
    redistributions: list = field(default_factory=list)  # [(node, input, src, dst, axis, kind, bytes per rank)]

    def sharding(self, node) -> Sharding:
        name = node if isinstance(node, str) else node.name
        return self.out[name][0]

    def to_plan(self) -> dict:
        """``{node name: [sharding json per output]}``: each node's output shardings, as JSON."""
        return {k: [s.to_json() for s in v] for k, v in self.out.items()}

    def to_json(self) -> dict:
        """What lowering reads of this result, as JSON (the Plan's ``tensor_parallel`` section keeps it per stage):
        ``{"out": {node: [sharding per output]}, "need": {node: [sharding per input]}}``, with ``"annotated"``
        (node -> the ``fxpar.shard`` annotation that fixed it) and ``"no_rule"`` (``[[node, op, module]]``)
        where there are any. :meth:`from_json` reads it back."""
        dump = lambda d: {k: [s.to_json() for s in v] for k, v in d.items()}      # noqa: E731
        out = {"out": dump(self.out), "need": dump(self.need)}
        annotated = {k: v for k, v in self.sources.items() if v.startswith("fxpar.shard")}
        if annotated:
            out["annotated"] = annotated
        if self.no_rule:
            out["no_rule"] = [list(r) for r in self.no_rule]
        return out

    @classmethod
    def from_json(cls, data: dict, mesh) -> "ShardingResult":
        """A result back from :meth:`to_json` over ``mesh`` (a ``fxpar.Mesh`` or ``{axis: size}``)."""
        load = lambda v: tuple(Sharding.from_json(x) for x in v)     # noqa: E731
        return cls(dict(axis_sizes(mesh)), out={k: load(v) for k, v in data["out"].items()},
                   need={k: load(v) for k, v in data["need"].items()}, sources=dict(data.get("annotated", {})),
                   no_rule=[tuple(r) for r in data.get("no_rule", [])])

    def comm_bytes(self) -> float:
        return sum(r[-1] for r in self.redistributions)

    def explain(self, limit: int = 60) -> str:
        lines = [f"shardings over mesh {self.mesh}:"]
        shown = 0
        for name, outs in self.out.items():
            if all(s.is_replicated for s in outs) or shown >= limit:
                continue
            shown += 1
            src = f"   [{self.sources[name]}]" if name in self.sources else ""
            lines.append(f"  {name:<28} {', '.join(map(str, outs))}{src}")
        lines.append(f"redistributions: {len(self.redistributions)}, {self.comm_bytes():.0f} bytes per rank")
        for node, inp, a, b, axis, kind, nb in self.redistributions:
            lines.append(f"  {kind:<15} {inp} -> {node}: {fmt_placement(a)} -> {fmt_placement(b)} over {axis!r}, "
                         f"{nb:.0f} B")
        if self.no_rule:
            lines.append(f"ops without a sharding rule, run replicated ({len(self.no_rule)}):")
            lines += [f"  {n} ({op}) in {mod or '<root>'}" for n, op, mod in self.no_rule]
        return "\n".join(lines)


# --- one axis --------------------------------------------------------------------------------------------

def _val(node):
    return node.meta.get("val")


def _fits(info: OpInfo, g, cand, n: int, taken_in: tuple, taken_out: tuple) -> bool:
    """Every split divides its dim, no dim is split by another axis already, partial sums only on floats."""
    for j, pl in zip(g.ins, cand[0]):
        if not placement_fits(info.in_shapes[j], pl, n, taken_in[j] if taken_in else (), _is_float_in(info, j)):
            return False
    for o, pl in zip(g.outs, cand[1]):
        if not placement_fits(info.out_shapes[o], pl, n, taken_out[o] if taken_out else (), True):
            return False
    return True


def _is_float_in(info, j) -> bool:
    path = info.paths[j]                      # (arg position or keyword,) or (..., index in a list argument)
    a = info.node.kwargs[path[0]] if isinstance(path[0], str) else info.node.args[path[0]]
    node = a[path[1]] if len(path) > 1 else a
    return node.meta["val"].dtype.is_floating_point


def placement_fits(shape, pl, n, taken, is_float) -> bool:
    """Whether placement ``pl`` (a dim split ``n`` ways, or partial ``P``) suits a tensor of ``shape``: the dim
    exists, divides by ``n`` and is not in ``taken``; a partial sum only for a floating-point tensor."""
    if pl == P:
        return is_float
    if isinstance(pl, int):
        return pl < len(shape) and shape[pl] % n == 0 and shape[pl] >= n and pl not in taken
    return True


aten = torch.ops.aten
_VIEWS = {aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
          aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.clone.default,
          aten.detach.default, aten.alias.default, aten._to_copy.default}


def _nbytes(node, pl, n) -> float:
    v = _val(node)
    b = v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
    return b / n if isinstance(pl, int) else b


class _Axis:
    """Propagation along one mesh axis."""

    def __init__(self, gm, axis: str, n: int, fixed: dict, taken: dict, preferred=frozenset(), infos=None):
        self.gm, self.axis, self.n = gm, axis, n
        self.infos = {} if infos is None else infos     # node -> its OpInfo, made once per propagation
        self.preferred = preferred
        self.fixed = {node: (sh.placement(axis), src) for node, (sh, src) in fixed.items()}
        self.taken = taken                  # node -> (per input: dims split by earlier axes, per output: ...)
        self.place, self.need, self.pref = {}, {}, {}
        self.redist = []                    # (node, input, src, dst, axis, kind, bytes per rank)
        self.avail = {}                     # node -> placements a consumer already had it redistributed to
        self.free = {}                      # view of a not-yet-placed parameter -> its input
        self._anchor = {}                   # node -> whether it is a layout-fixed parameter or a view of one
        params = {M.get(n, M.PARAM): n for n in gm.graph.nodes if n.op == "placeholder" and M.get(n, M.ROLE) == Role.PARAM}
        self.state_of = {n: params[M.get(n, M.PARAM).split(":", 1)[-1]] for n in gm.graph.nodes
                         if n.op == "placeholder" and M.get(n, M.ROLE) == Role.OPT_STATE
                         and M.get(n, M.PARAM).split(":", 1)[-1] in params}   # optimizer state -> its parameter

    def _info(self, node) -> OpInfo:
        info = self.infos.get(node)
        if info is None:
            info = self.infos[node] = OpInfo.of(node)
        return info

    # 1. backward: annotations' placements flow to their producers
    def backward(self):
        for node, (pl, src) in self.fixed.items():
            self.pref[node] = (pl, src)
        for node in reversed(list(self.gm.graph.nodes)):
            if node not in self.pref or node.op != "call_function" or self.pref[node][0] == R:
                continue
            pl, src = self.pref[node]
            if node in self.fixed and self.fixed[node][1].startswith("fxpar.shard"):
                self._push(node.args[0], pl, src)
                continue
            if M.get(node, M.PHASE) != "forward" or not has_rule(node.target):
                continue
            info = self._info(node)
            groups = groups_of(info)
            if len(groups) != 1 or len(info.out_shapes) != 1:
                continue
            g = groups[0]
            ok = [c for c in g.cands if c[1] == (pl,) and _fits(info, g, c, self.n, None, None)]
            leaves = tensor_leaves(node)
            for j in g.ins:
                options = {c[0][g.ins.index(j)] for c in ok}
                if len(options) == 1 and next(iter(options)) != R:
                    self._push(leaves[j][1], next(iter(options)), src)

    def _push(self, node, pl, src):
        """``src`` would like ``node`` laid out as ``pl``. A node with its own annotation or layout keeps it (the
        consumer gets a redistribution); two wishes for one unannotated node must agree."""
        if node in self.fixed:
            return
        mine = self.pref.get(node)
        if mine is not None and mine[0] != pl:
            raise ShardingConflict(f"{mine[1]} and {src} meet at {describe(node)}: along mesh axis {self.axis!r} one "
                                   f"wants {fmt_placement(mine[0])}, the other {fmt_placement(pl)} -- annotate that "
                                   "node to say which wins, or change one of them")
        if mine is None:
            self.pref[node] = (pl, src)

    # 2. forward, in graph order
    def forward(self):
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                if node in self.pref:
                    self._set(node, (self.pref[node][0],))
            elif node.op == "call_function":
                self._decide(node)
        for node in list(self.free):                # views no consumer decided: whole
            if node in self.free:
                self._assign(node, R)

    def _placed(self, leaf):
        """The leaf's placement, R if none yet (not ``or R``: a split along dim 0 is the int 0)."""
        p = self._in_place(leaf)
        return R if p is None else p

    def _in_place(self, leaf):
        p = self.place.get(leaf)
        if p is None and leaf in self.state_of and self.state_of[leaf] in self.place:
            p = self.place[self.state_of[leaf]]            # optimizer state is laid out as its parameter
            self._set(leaf, p)
        return None if p is None else p[0]

    def _decide(self, node):
        if node.target is operator.getitem:
            src, idx = node.args
            info = self._info(src)
            self._set(node, (self.place[src][info.out_pos.index(idx)],) if isinstance(_val(node), torch.Tensor) else ())
            self.need[node] = ()
            return
        if node in self.fixed and self.fixed[node][1].startswith("fxpar.shard"):
            pl, x = self.fixed[node][0], node.args[0]       # the annotated value: x laid out as asked
            if self._in_place(x) is None:
                self._assign(x, pl)
            if pl not in self.avail[x]:
                self._record(node, x, pl)
            self._use(x, pl)
            self._set(node, (pl,))
            self.need[node] = (pl, self._placed(node.args[1]))
            return
        if is_shard_node(node):
            val = annotated_value(node)
            pl = self.fixed[val][0] if val in self.fixed else R
            self._set(node, (pl,))
            self.need[node] = (self._placed(node.args[0]),)
            return
        info = self._info(node)
        leaves = [n for _, n in tensor_leaves(node)]
        cur = [self._in_place(x) for x in leaves]
        if node.target in _VIEWS and len(leaves) == 1 and cur[0] is None and len(info.out_shapes) == 1:
            self.free[node] = leaves[0]             # a view of a free parameter: its consumer decides both
            return
        t_in, t_out = self.taken.get(node, (None, None))
        out, need = [R] * len(info.out_shapes), list(cur)
        want = self.pref.get(node, (None,))[0]
        for g in groups_of(info):
            scored = []
            for i, c in enumerate(g.cands):
                if not _fits(info, g, c, self.n, t_in, t_out):
                    continue
                # a weight laid out by a layout is computed with where it lies (Megatron, Mesh-TF): candidates that
                # move it (gather it, or split it otherwise) come last, whatever the bytes
                moves = any(cur[j] is not None and pl != cur[j] and not (cur[j] == R and pl != P)
                            and self._anchored(leaves[j]) for j, pl in zip(g.ins, c[0]))
                nbytes, changes = 0.0, 0
                for j, pl in zip(g.ins, c[0]):
                    if cur[j] is not None and pl not in self.avail.get(leaves[j], ()):
                        nbytes += min(self._charge(leaves[j], a, pl) for a in self.avail[leaves[j]])
                        changes += 1
                # partial sums made here must be reduced later: charge that now (else they spread)
                nbytes += sum(redistribute_bytes(P, R, info.out_nbytes[o], self.n) for o, pl in zip(g.outs, c[1])
                              if pl == P)
                match = -sum(1 for pl in c[1] if want is not None and pl == want)
                # a preferred node (``prefer``) takes its wish where it costs no bytes, even through a local slice
                scored.append(((moves, nbytes, match, changes, i) if node in self.preferred
                               else (moves, nbytes, changes, match, i), c))
            _, best = min(scored, key=lambda t: t[0])
            for j, pl in zip(g.ins, best[0]):
                need[j] = pl
                if self._in_place(leaves[j]) is None:                    # free: take what is asked
                    self._assign(leaves[j], pl)
                if pl not in self.avail[leaves[j]]:
                    self._record(node, leaves[j], pl)
                self._use(leaves[j], pl)
            for o, pl in zip(g.outs, best[1]):
                out[o] = pl
        self._set(node, tuple(out))
        self.need[node] = tuple(R if x is None else x for x in need)

    def _anchored(self, n) -> bool:
        """``n`` is a parameter (or optimizer state) a layout fixed, or a view of one."""
        r = self._anchor.get(n)
        if r is None:
            if n.op == "placeholder":
                r = n in self.fixed and self.fixed[n][1].startswith("layout")
            else:
                r = n.op == "call_function" and n.target in _VIEWS and isinstance(n.args[0], torch.fx.Node) \
                    and self._anchored(n.args[0])
            self._anchor[n] = r
        return r

    def _assign(self, leaf, pl):
        """Place a free parameter (never as a partial sum: it holds data) or a view chain of one: back through the
        view's rule to the parameter; a placement the view cannot give leaves the chain whole."""
        want = R if pl == P else pl
        if leaf not in self.free:
            self._set(leaf, (want,))
            return
        src = self.free.pop(leaf)
        info = self._info(leaf)
        g = groups_of(info)[0]
        t_in, t_out = self.taken.get(leaf, (None, None))
        opts = [c for c in g.cands if c[1] == (want,) and _fits(info, g, c, self.n, t_in, t_out)]
        in_pl = opts[0][0][0] if opts else R
        self._assign(src, in_pl)
        self._use(src, in_pl)
        self._set(leaf, (want if opts else R,))
        self.need[leaf] = (in_pl,)

    def outputs(self, signature, whole_io=False):
        """The output node needs each updated state laid out as the placeholder it replaces (``whole_io``: each
        gradient as its parameter, the rest whole)."""
        out = self.gm.graph.output_node()
        leaves = [a for a in torch.utils._pytree.tree_flatten(out.args[0])[0] if isinstance(a, torch.fx.Node)]
        ph = {k: n for k, n in zip(signature.inputs, [n for n in self.gm.graph.nodes if n.op == "placeholder"])}
        need = []
        for (role, key), leaf in zip(signature.outputs, leaves):
            have = self._placed(leaf)
            src = ph.get((role[4:], key)) if role.startswith("new_") else ph.get((Role.PARAM, key)) if role == Role.GRAD \
                else None
            want = self._placed(src) if src is not None else R if whole_io else have
            if want not in self.avail.get(leaf, {have}):
                self._record(out, leaf, want)
            need.append(want)
        self.need[out] = tuple(need)

    def _set(self, node, pls):
        self.place[node] = pls
        if len(pls) == 1:
            self.avail[node] = {pls[0]}

    def _charge(self, leaf, a, pl) -> float:
        """Bytes charged for choosing ``a -> pl`` (a heuristic for the greedy choice; the bytes recorded and
        inserted are the real ones):

        * splits come from annotations and layouts, not from communication: a partial sum made split
          (reduce_scatter) or a split moved to another dim (all_to_all) is charged as made whole (all_reduce,
          all_gather) unless a preference asks for that split, so ties go to the replicated candidate
          (Megatron's all_reduce, not a sequence or batch split nobody asked for);
        * a replicated value made a partial sum (free: zeros on the other ranks) is charged the all_reduce its
          partial sums will need, so partial sums do not spread through the residual stream;
        * a parameter or its optimizer state keeps its layout across steps: moving it means moving its update
          back, so it is charged the round trip + 1 and the update follows the stored layout."""
        nb = _nbytes(leaf, a, self.n)
        if isinstance(pl, int) and a != R and self.pref.get(leaf, (None,))[0] != pl:
            cost = redistribute_bytes(a, R, nb, self.n)
        elif a == R and pl == P:
            cost = redistribute_bytes(P, R, nb, self.n)
        else:
            cost = redistribute_bytes(a, pl, nb, self.n)
        if leaf.op == "placeholder" and M.get(leaf, M.ROLE) in (Role.PARAM, Role.OPT_STATE):
            cost += redistribute_bytes(pl, a, _nbytes(leaf, pl, self.n), self.n) + 1
        return cost

    def _record(self, node, leaf, pl):
        nb = {a: redistribute_bytes(a, pl, _nbytes(leaf, a, self.n), self.n) for a in sorted(self.avail[leaf], key=str)}
        src = min(nb, key=nb.get)
        self.redist.append((node.name, leaf.name, src, pl, self.axis, _kind(src, pl), nb[src]))

    def _use(self, leaf, pl):
        """A consumer gets ``leaf`` as ``pl``: later consumers find that version there (the lowering reuses it);
        a replicated version also gives every split and the partial-sum form locally."""
        got = self.avail.setdefault(leaf, set())
        got.add(pl)


# --- the pass --------------------------------------------------------------------------------------------

def propagate_shardings(gm: torch.fx.GraphModule, mesh, layouts: dict | None = None,
                        aliases: dict | None = None, signature=None, whole_io: bool = False,
                        prefer: dict | None = None) -> ShardingResult:
    """Decide every node's sharding over ``mesh`` (a ``fxpar.Mesh`` or ``{axis: size}``) from the graph's
    ``fxpar.shard`` annotations and ``layouts`` (glob over parameter keys -> spec); ``aliases``: tied keys
    (``CapturedStep.aliases``), so a layout may name either key of a tied parameter; ``signature``
    (``CapturedStep.signature``): each ``new_param`` / ``new_opt_state`` / ``new_buffer`` output is made to
    leave laid out as its input came in (the next step reads it), with a redistribution where it is not;
    ``whole_io`` (with ``signature``; what the runtime needs): every input but parameters and optimizer state
    comes in whole, every gradient output leaves laid out as its parameter, every other output leaves whole.
    ``prefer``: ``{node name: (Sharding, why)}``, a wish like an annotation's that flows to the node's producers
    and breaks ties in its own choice (a dropout mask drawn split where its consumer is split)."""
    sizes = axis_sizes(mesh)
    fixed = fixed_shardings(gm, sizes, layouts or {}, aliases or {})
    if prefer:
        fixed.update({n: prefer[n.name] for n in gm.graph.nodes if n.name in prefer and n not in fixed})
    if whole_io and signature is not None:
        for node, (role, _) in zip(gm.graph.find_nodes(op="placeholder"), signature.inputs):
            if role not in (Role.PARAM, Role.OPT_STATE) and isinstance(_val(node), torch.Tensor) and node not in fixed:
                fixed[node] = (Sharding((None,) * _val(node).dim()), f"graph input {node.name} ({role}), fed whole")
    res = ShardingResult(dict(sizes), sources={n.name: src for n, (_, src) in fixed.items()})
    axes = [a for a, s in sizes.items() if s > 1]
    per_axis = []
    taken: dict = {}
    infos: dict = {}
    for axis in axes:
        ax = _Axis(gm, axis, sizes[axis], fixed, taken, {n for n in fixed if n.name in (prefer or {})}, infos)
        ax.backward()
        ax.forward()
        if signature is not None:
            ax.outputs(signature, whole_io)
        per_axis.append(ax)
        _take(taken, ax)
    _collect(gm, res, per_axis, infos)
    res.redistributions = [r for ax in per_axis for r in ax.redist]
    return res


def _take(taken: dict, ax: _Axis) -> None:
    """Record the dims ``ax`` split, per node input and output: a later axis may not split them again."""
    def merge(prev, pls):
        split = [{pl} if isinstance(pl, int) else set() for pl in pls]
        return tuple(a | b for a, b in zip(prev, split)) if prev else tuple(split)
    for node, need in ax.need.items():
        ti, to = taken.get(node, (None, None))
        taken[node] = (merge(ti, need), merge(to, ax.place.get(node, ())))


def _collect(gm, res: ShardingResult, per_axis: list, infos: dict) -> None:
    out = gm.graph.output_node()
    if per_axis and out in per_axis[0].need:
        leaves = [a for a in torch.utils._pytree.tree_flatten(out.args[0])[0] if isinstance(a, torch.fx.Node)]
        res.need[out.name] = tuple(Sharding.from_placements(len(_val(x).shape), {ax.axis: ax.need[out][j]
                                   for ax in per_axis}) for j, x in enumerate(leaves))
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        info = infos.get(node) or OpInfo.of(node) if node.op == "call_function" else None
        flat = info.out_shapes if info is not None else [tuple(_val(node).shape)] \
            if isinstance(_val(node), torch.Tensor) else []
        outs = []
        for o, shape in enumerate(flat):
            outs.append(Sharding.from_placements(len(shape), {ax.axis: ax.place.get(node, (R,) * len(flat))[o]
                                                              for ax in per_axis}))
        res.out[node.name] = tuple(outs)
        if node.op != "call_function":
            continue
        leaves = tensor_leaves(node) if node.target is not operator.getitem else []
        needs = []
        for j, (_, src) in enumerate(leaves):
            nd = len(_val(src).shape)
            needs.append(Sharding.from_placements(nd, {ax.axis: ax.need[node][j] for ax in per_axis}))
        res.need[node.name] = tuple(needs)
        if node.target is not operator.getitem and not is_shard_node(node) and not has_rule(node.target):
            res.no_rule.append((node.name, str(node.target), M.get(node, M.MODULE) or ""))


def _kind(a, b) -> str:
    return "+".join(k for k, _, _ in redistribute_steps(a, b))
