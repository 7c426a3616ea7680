"""Rules for views, reshapes, slicing, concatenation, reductions and softmax.

A split dim moves with the dim it is (transpose, permute, unsqueeze). ``view``/``reshape`` groups
input and output dims whose sizes multiply to the same product; in each group the split may only be
on the first dim of size > 1, and moves to the first such output dim (a contiguous block of the
flattened group: ``[B, T, C] -> [B, T, H, D]`` keeps a split of C as a split of H; a split of D in
``[B, T, H, D] -> [B, T, C]`` is not legal and the tensor is gathered first). Slicing, selecting,
splitting and concatenating along a dim need that dim whole. A sum over a split dim gives partial
sums; a mean over it or a softmax along it needs the dim whole.
"""
from __future__ import annotations

import torch

from .core import P, R, OpInfo, rule

aten = torch.ops.aten
__all__ = ["view_dim_map"]


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _moves(info: OpInfo, mapping: dict, linear: bool = True) -> list:
    """Candidates for a one-input op whose input dim i becomes output dim mapping[i] (a view)."""
    cands = [info.cand({0: i}, o) for i, o in mapping.items()]
    return cands + ([info.cand({0: P}, P)] if linear else [])


@rule(aten.t.default)
def _t(info):
    n = len(info.in_shapes[0])
    return _moves(info, {0: 1, 1: 0} if n == 2 else {i: i for i in range(n)})


@rule(aten.transpose.int)
def _transpose(info):
    n = len(info.in_shapes[0])
    a, b = _norm(info.arg(1), n), _norm(info.arg(2), n)
    perm = list(range(n))
    perm[a], perm[b] = perm[b], perm[a]
    return _moves(info, {perm[o]: o for o in range(n)})


@rule(aten.permute.default)
def _permute(info):
    n = len(info.in_shapes[0])
    dims = [_norm(d, n) for d in info.arg(1)]
    return _moves(info, {dims[o]: o for o in range(n)})


@rule(aten.unsqueeze.default)
def _unsqueeze(info):
    n = len(info.in_shapes[0])
    d = _norm(info.arg(1), n + 1)
    return _moves(info, {i: (i if i < d else i + 1) for i in range(n)})


@rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(info):
    shape = info.in_shapes[0]
    dims = info.arg(1, default=None)
    dims = [dims] if isinstance(dims, int) else list(range(len(shape))) if dims is None else list(dims)
    gone = {_norm(d, len(shape)) for d in dims if shape[_norm(d, len(shape))] == 1}
    keep = [i for i in range(len(shape)) if i not in gone]
    return _moves(info, {i: o for o, i in enumerate(keep)})


@rule(aten.expand.default)
def _expand(info):
    i_shape, o_shape = info.in_shapes[0], info.out
    off = len(o_shape) - len(i_shape)
    return _moves(info, {i: i + off for i in range(len(i_shape)) if i_shape[i] == o_shape[i + off]})


def view_dim_map(in_shape, out_shape) -> dict:
    """``{input dim: output dim}`` for the dims a reshape may keep split (see the module docstring)."""
    a = [(d, s) for d, s in enumerate(in_shape) if s != 1]
    b = [(d, s) for d, s in enumerate(out_shape) if s != 1]
    i = j = 0
    out = {}
    while i < len(a) and j < len(b):
        first_in, first_out = a[i][0], b[j][0]
        pa, pb = a[i][1], b[j][1]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i][1], i + 1
            elif pb < pa and j < len(b):
                pb, j = pb * b[j][1], j + 1
            else:
                return out
        out[first_in] = first_out
    return out


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(info):
    return _moves(info, view_dim_map(info.in_shapes[0], info.out))


def _along(info: OpInfo, dim: int, keys, shift_out=None, linear=True) -> list:
    """Every tensor in ``keys`` split along the same dim d != ``dim``; outputs split along d (or shift_out(d))."""
    n = len(info.in_shapes[0])
    cands = []
    for d in range(n):
        if d == dim:
            continue
        od = shift_out(d) if shift_out else d
        cands.append(info.cand({k: d for k in keys}, od))
    if linear:
        cands.append(info.cand({k: P for k in keys}, P))
    return cands


@rule(aten.split.Tensor, aten.split_with_sizes.default)
def _split(info):
    return _along(info, _norm(info.arg(2, "dim", 0), len(info.in_shapes[0])), [0])


@rule(aten.slice.Tensor)
def _slice(info):
    return _along(info, _norm(info.arg(1, "dim", 0), len(info.in_shapes[0])), [0])


@rule(aten.select.int)
def _select(info):
    dim = _norm(info.arg(1), len(info.in_shapes[0]))
    return _along(info, dim, [0], shift_out=lambda d: d - (d > dim))


@rule(aten.cat.default)
def _cat(info):
    n = len(info.out)
    dim = _norm(info.arg(1, "dim", 0), n)
    keys = [p for p in info.paths]
    cands = [info.cand({k: d for k in keys}, d) for d in range(n) if d != dim]
    return cands + [info.cand({k: P for k in keys}, P)]


@rule(aten.slice_backward.default)
def _slice_backward(info):
    return _along(info, _norm(info.arg(2), len(info.in_shapes[0])), [0])


@rule(aten.slice_scatter.default)
def _slice_scatter(info):
    return _along(info, _norm(info.arg(2, "dim", 0), len(info.in_shapes[0])), [0, 1])


@rule(aten.select_scatter.default)
def _select_scatter(info):
    n = len(info.in_shapes[0])
    dim = _norm(info.arg(2), n)
    cands = [info.cand({0: d, 1: d - (d > dim)}, d) for d in range(n) if d != dim]
    return cands + [info.cand({0: P, 1: P}, P)]


@rule(aten.gather.default)
def _gather(info):
    n = len(info.in_shapes[0])
    dim = _norm(info.arg(1), n)
    x, idx = info.in_shapes
    return [info.cand({0: d, 2: d}, d) for d in range(n) if d != dim and x[d] == idx[d]]


def _reduced(info: OpInfo, pos: int = 1):
    n = len(info.in_shapes[0])
    dims = info.arg(pos, "dim", None)
    dims = list(range(n)) if dims in (None, []) else [dims] if isinstance(dims, int) else list(dims)
    return n, {_norm(d, n) for d in dims}


def _keep_map(n, red, keepdim):
    return {d: (d if keepdim else d - sum(1 for r in red if r < d)) for d in range(n) if d not in red}


@rule(aten.sum.dim_IntList, aten.sum.default)
def _sum(info):
    n, red = _reduced(info) if info.node.target is aten.sum.dim_IntList else (len(info.in_shapes[0]),
                                                                            set(range(len(info.in_shapes[0]))))
    keep = _keep_map(n, red, bool(info.arg(2, "keepdim", False)))
    cands = [info.cand({0: d}, o) for d, o in keep.items()]
    return cands + [info.cand({0: d}, P) for d in red] + [info.cand({0: P}, P)]


@rule(aten.mean.dim)
def _mean(info):
    n, red = _reduced(info)
    keep = _keep_map(n, red, bool(info.arg(2, "keepdim", False)))
    return [info.cand({0: d}, o) for d, o in keep.items()] + [info.cand({0: P}, P)]


@rule(aten.cumsum.default)
def _cumsum(info):
    return _along(info, _norm(info.arg(1), len(info.in_shapes[0])), [0])


@rule(aten._log_softmax.default, aten._softmax.default, aten._safe_softmax.default)
def _softmax(info):
    return _along(info, _norm(info.arg(1), len(info.in_shapes[0])), [0], linear=False)


@rule(aten._log_softmax_backward_data.default, aten._softmax_backward_data.default)
def _softmax_backward(info):
    """Linear in the incoming gradient: (P grad, R output) -> P."""
    dim = _norm(info.arg(2), len(info.in_shapes[0]))
    return _along(info, dim, [0, 1], linear=False) + [info.cand({0: P, 1: R}, P)]


@rule(aten.argmax.default, aten.argmin.default)
def _argmax(info):
    """Indices along ``dim`` (MoE gating's top choice): every other dim may be split, the output split alike (each
    rank's rows). No partial sums (an index is not a sum); without ``dim`` (a flat index) it runs whole."""
    dim = info.arg(1, "dim", None)
    if dim is None:
        return []
    n = len(info.in_shapes[0])
    keep = _keep_map(n, {_norm(dim, n)}, bool(info.arg(2, "keepdim", False)))
    return [info.cand({0: d}, o) for d, o in keep.items()]
