"""The sharding-rule table: per aten op, the legal input/output placements along one mesh axis.

A rule reads an :class:`OpInfo` (the node, the shapes of its tensor inputs and outputs) and returns
candidates ``(input placements, output placements)`` along one mesh axis, each placement ``R``
(replicated), ``P`` (partial sum) or an int (split along that dim), as DTensor's op strategies do
(``torch/distributed/tensor/_ops/``; read, not copied). Every candidate is exact: running the op on
each rank's local pieces gives the output placement named, with no communication inside the op.
What a candidate costs is the redistribution of its inputs (``fxpar.sharding.redistribute_bytes``).

Ops whose outputs are independent per element of a list (``_foreach_*``) return one :class:`Group`
per element, so propagation chooses per parameter. Every group also offers all-replicated
(gather the inputs, compute whole), which is always correct; an op without a rule gets only that,
and propagation lists it (``ShardingResult.no_rule``). Ops in :data:`REPLICATE` have a rule that
is all-replicated on purpose, with the reason written next to them.

A few candidates are exact only for a local computation other than the op itself, one that reads the
rank's coordinate along the axis (Megatron's vocabulary-parallel embedding: weight split over the
vocabulary, each rank looks up the rows it holds). :data:`LOCAL_OPS` maps ``(op, candidate)`` to the
function that rewrites the node into that computation (a ``fxpar.local_ops`` op), and the lowering
(``passes.lower_sharding``) applies it where the chosen placements along an axis are that candidate.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from fxpar.sharding import P, R

__all__ = ["OpInfo", "Group", "RULES", "REPLICATE", "rule", "replicate_only", "groups_of", "has_rule", "R", "P",
           "tensor_leaves", "LOCAL_OPS", "local_op", "local_lowering"]

RULES: dict = {}          # aten overload -> fn(OpInfo) -> list of candidates | list of Group
REPLICATE: dict = {}      # aten overload -> why it runs replicated
LOCAL_OPS: dict = {}      # (aten overload, candidate) -> fn(args, kwargs, group) -> (target, args, kwargs)


def _val_shape(v):
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def tensor_leaves(node: torch.fx.Node) -> list:
    """``[(path, input node)]`` for every tensor-valued input of ``node``: path ``(i,)`` for positional arg i,
    ``(i, j)`` for element j of a list arg, ``(name,)`` / ``(name, j)`` for keyword args."""
    out = []
    items = list(enumerate(node.args)) + list(node.kwargs.items())
    for key, a in items:
        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            out.append(((key,), a))
        elif isinstance(a, (list, tuple)):
            for j, b in enumerate(a):
                if isinstance(b, torch.fx.Node) and isinstance(b.meta.get("val"), torch.Tensor):
                    out.append(((key, j), b))
    return out


@dataclass
class OpInfo:
    node: torch.fx.Node
    paths: list = field(default_factory=list)       # per tensor input: its path
    in_shapes: list = field(default_factory=list)   # per tensor input: global shape
    out_pos: list = field(default_factory=list)     # per tensor output: its position in the flattened value
    out_shapes: list = field(default_factory=list)  # per tensor output: global shape
    out_nbytes: list = field(default_factory=list)  # per tensor output: bytes of the whole tensor

    @classmethod
    def of(cls, node: torch.fx.Node) -> "OpInfo":
        leaves = tensor_leaves(node)
        flat, _ = tree_flatten(node.meta.get("val"))
        pos = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        return cls(node, [p for p, _ in leaves], [_val_shape(n.meta["val"]) for _, n in leaves], pos,
                   [_val_shape(flat[i]) for i in pos], [flat[i].numel() * flat[i].element_size() for i in pos])

    def arg(self, pos: int, name: str | None = None, default=None):
        """Argument ``pos`` (or keyword ``name``) of the node."""
        if name is not None and name in self.node.kwargs:
            return self.node.kwargs[name]
        return self.node.args[pos] if len(self.node.args) > pos else default

    def shape(self, key):
        """Global shape of the input at ``key`` (an int or a path); None if that input is not a tensor."""
        path = key if isinstance(key, tuple) else (key,)
        return self.in_shapes[self.paths.index(path)] if path in self.paths else None

    @property
    def out(self):
        return self.out_shapes[0]

    def cand(self, ins: dict, outs) -> tuple:
        """A candidate from ``{arg key or path: placement}`` (keys for absent optional tensors are ignored) and
        the output placements per flattened output position (a single placement for one output)."""
        norm = {(k if isinstance(k, tuple) else (k,)): v for k, v in ins.items()}
        missing = [p for p in self.paths if p not in norm]
        if missing:
            raise KeyError(f"rule for {self.node.target} gives no placement for input {missing}")
        if isinstance(outs, (tuple, list)):
            outs = tuple(outs[i] for i in self.out_pos)
        else:
            outs = tuple(outs for _ in self.out_pos)
        return tuple(norm[p] for p in self.paths), outs


@dataclass(frozen=True)
class Group:
    """Inputs (indices into ``OpInfo.paths``) and outputs (indices into ``OpInfo.out_shapes``) whose placements
    are chosen together, with the legal combinations."""
    ins: tuple
    outs: tuple
    cands: tuple


def rule(*ops):
    def deco(fn):
        for op in ops:
            RULES[op] = fn
        return fn
    return deco


def replicate_only(why: str, *ops) -> None:
    for op in ops:
        REPLICATE[op] = why
        RULES[op] = _all_replicated


def _all_replicated(info: OpInfo) -> list:
    return [info.cand({p: R for p in info.paths}, R)]


def has_rule(target) -> bool:
    return target in RULES


def groups_of(info: OpInfo) -> list:
    """The rule's groups for ``info``'s node, each with the all-replicated candidate first (the default)."""
    fn = RULES.get(info.node.target, _all_replicated)
    res = fn(info)
    if not res or not isinstance(res[0], Group):
        res = [Group(tuple(range(len(info.paths))), tuple(range(len(info.out_shapes))), tuple(res))]
    out = []
    for g in res:
        allr = ((R,) * len(g.ins), (R,) * len(g.outs))
        cands = [allr] + [c for c in dict.fromkeys(g.cands) if c != allr]
        out.append(Group(g.ins, g.outs, tuple(cands)))
    return out


def local_op(op, candidate):
    """Register how a node of ``op`` runs under ``candidate`` (``(input placements, output placements)`` along one
    axis): ``fn(args, kwargs, group) -> (target, args, kwargs)``, ``group`` the axis's group tag."""
    def deco(fn):
        LOCAL_OPS[(op, candidate)] = fn
        return fn
    return deco


def local_lowering(target, per_axis: dict, what: str = ""):
    """The registered local computation for a node (``what``, for errors) of ``target`` whose placements along each
    mesh axis are ``per_axis`` (``{axis: candidate}``): ``(axis, fn)``, or None where the op itself is exact."""
    hits = [(axis, LOCAL_OPS[(target, c)]) for axis, c in per_axis.items() if (target, c) in LOCAL_OPS]
    if len(hits) > 1:
        raise NotImplementedError(f"{what} ({target}) needs a local computation along mesh axes "
                                  f"{[a for a, _ in hits]}; only one is supported -- lay it out split over one of them")
    return hits[0] if hits else None
