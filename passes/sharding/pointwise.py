"""Rules for elementwise ops (with broadcasting), ``*_like`` and factory ops, and the optimizer's ``_foreach_*``.

Elementwise: every output dim d of size > 1 may be split if each input splits the dim aligned with
it (from the right, as broadcasting aligns), or holds it replicated where it broadcasts (size 1 or
absent). Partial sums pass through an op that is linear in those inputs: ``add(P, P) -> P``,
``mul(P, R) -> P``, ``gelu_backward(P grad, R x) -> P``, ``neg(P) -> P``.
"""
from __future__ import annotations

import torch

from .core import P, R, Group, OpInfo, rule

aten = torch.ops.aten
__all__ = ["elementwise", "LINEAR"]


def elementwise(info: OpInfo, linear=(), keys=None) -> list:
    """Candidates of an elementwise op: one per splittable output dim, plus one per entry of ``linear`` (a set
    of input keys that may be partial sums, the others replicated, giving a partial-sum output)."""
    keys = keys if keys is not None else list(info.paths)
    out = info.out
    k = len(out)
    cands = []
    for d in range(k):
        if out[d] <= 1:
            continue
        ins = {}
        for p in keys:
            shp = info.shape(p)
            dj = d - (k - len(shp))
            ins[p] = dj if dj >= 0 and shp[dj] == out[d] else R
        cands.append(info.cand(ins, d))
    for partial in linear:
        pk = {(x if isinstance(x, tuple) else (x,)) for x in partial}
        if not pk <= set(keys):       # a Python number in a linear slot: x + 1 is not linear in x
            continue
        cands.append(info.cand({p: (P if p in pk else R) for p in keys}, P))
    return cands


# op -> the sets of inputs over which it is linear (each set may be partial sums together)
LINEAR = {
    aten.add.Tensor: [{0, 1}], aten.sub.Tensor: [{0, 1}], aten.mul.Tensor: [{0}, {1}], aten.div.Tensor: [{0}],
    aten.neg.default: [{0}], aten.mul.Scalar: [{0}], aten.div.Scalar: [{0}], aten.clone.default: [{0}],
    aten._to_copy.default: [{0}], aten.detach.default: [{0}], aten.alias.default: [{0}],
    aten.lift_fresh_copy.default: [{0}], aten.where.self: [{1, 2}],
    aten.gelu_backward.default: [{0}], aten.tanh_backward.default: [{0}], aten.threshold_backward.default: [{0}],
    aten.mse_loss_backward.default: [{0}], aten.copy.default: [{1}],
}

_POINTWISE = [
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
    aten.div.Scalar, aten.rsub.Scalar, aten.neg.default, aten.abs.default, aten.pow.Tensor_Scalar, aten.pow.Scalar,
    aten.pow.Tensor_Tensor, aten.sqrt.default, aten.rsqrt.default, aten.exp.default, aten.log.default,
    aten.cos.default, aten.sin.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default,
    aten.relu.default, aten.gelu.default, aten.gelu_backward.default, aten.tanh_backward.default,
    aten.threshold_backward.default, aten.sigmoid_backward.default, aten.silu_backward.default,
    aten.minimum.default, aten.maximum.default, aten.where.self, aten.masked_fill.Scalar, aten.eq.Scalar,
    aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor, aten.ge.Scalar, aten.ge.Tensor, aten.gt.Scalar,
    aten.gt.Tensor, aten.lt.Scalar, aten.lt.Tensor, aten.le.Scalar, aten.le.Tensor, aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor, aten.bitwise_not.default, aten.logical_not.default, aten.clone.default,
    aten._to_copy.default, aten.detach.default, aten.alias.default, aten.lift_fresh_copy.default,
    aten.copy.default, aten.fill.Tensor,
]


@rule(*_POINTWISE)
def _pointwise(info: OpInfo) -> list:
    return elementwise(info, LINEAR.get(info.node.target, ()))


@rule(aten.mse_loss_backward.default)
def _mse_backward(info: OpInfo) -> list:
    """Elementwise, except that reduction="mean" divides by the element count: a split would divide by the
    local count, so then only the partial-sum (linear in grad) candidate remains."""
    cands = elementwise(info, LINEAR[aten.mse_loss_backward.default])
    return cands if info.arg(3, "reduction", 1) != 1 else [c for c in cands if c[1] == (P,)]


_LIKE = [aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
         aten.fill.Scalar]


@rule(*_LIKE)
def _like(info: OpInfo) -> list:
    """The values do not depend on the input: it may be laid out any way, the output follows its splits."""
    k = len(info.out)
    return [info.cand({0: d}, d) for d in range(k) if info.out[d] > 1] + [info.cand({0: P}, R)]


@rule(aten.bernoulli.p)
def _bernoulli(info: OpInfo) -> list:
    """Dropout's mask, ``bernoulli(x, p)``: ``x`` gives only the shape, so the mask may be drawn split like ``x``.
    A split mask is drawn from each rank's own stream (``passes.tensor_parallel``, ``fxpar.rank_bernoulli``),
    a whole one from the stream the tp ranks share."""
    return elementwise(info)


_NEW = [aten.new_ones.default, aten.new_zeros.default, aten.new_empty.default, aten.new_full.default]


@rule(*_NEW)
def _new(info: OpInfo) -> list:
    """``x.new_ones(size)``: x gives only dtype and device; the output (of the size given) is replicated."""
    k = len(info.in_shapes[0])
    return [info.cand({0: d}, R) for d in range(k)] + [info.cand({0: P}, R)]


_FACTORY = [aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default, aten.ones.default,
            aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default]


@rule(*_FACTORY)
def _factory(info: OpInfo) -> list:
    """No tensor input: made whole on every rank (a consumer that wants it split takes a local slice)."""
    return [info.cand({}, R)]


_FOREACH = [aten._foreach_add.Scalar, aten._foreach_add.List, aten._foreach_add.Tensor, aten._foreach_addcmul.Scalar,
            aten._foreach_addcdiv.Scalar, aten._foreach_div.List, aten._foreach_div.Tensor, aten._foreach_div.Scalar,
            aten._foreach_lerp.Scalar, aten._foreach_mul.Scalar, aten._foreach_mul.Tensor, aten._foreach_mul.List,
            aten._foreach_sqrt.default, aten._foreach_sub.List, aten._foreach_sub.Scalar, aten._foreach_neg.default,
            aten._foreach_maximum.List, aten._foreach_reciprocal.default]


@rule(*_FOREACH)
def _foreach(info: OpInfo) -> list:
    """One group per list element i: element i of every list input and every non-list tensor input (a scalar
    such as the step size, replicated) -> output i, elementwise. No partial sums (the update is not linear)."""
    n_out = len(info.out_shapes)
    groups = []
    shared = [j for j, p in enumerate(info.paths) if len(p) == 1]
    for i in range(n_out):
        ins = tuple(j for j, p in enumerate(info.paths) if len(p) == 2 and p[1] == i) + tuple(shared)
        shape = info.out_shapes[i]
        cands = []
        for d in range(len(shape)):
            if shape[d] > 1:
                cands.append((tuple(d if info.in_shapes[j] == shape else R for j in ins), (d,)))
        groups.append(Group(ins, (i,), tuple(cands)))
    return groups
