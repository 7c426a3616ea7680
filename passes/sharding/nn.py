"""Rules for matmuls, embedding, layer norm, attention, convolution, pooling and losses (forward and backward).

Matmul ``[m, k] @ [k, n]`` (Megatron's column and row splits, Shoeybi et al. 2019):
``S(0) @ R -> S(0)`` (rows), ``R @ S(1) -> S(1)`` (column-parallel), ``S(1) @ S(0) -> P`` (row-parallel:
partial sums over the split k), and linear in each side: ``P @ R -> P``, ``R @ P -> P``.
``addmm(bias, a, b)`` adds the bias once, so a partial-sum output takes a partial-sum bias (a
replicated bias becomes one by staying on one rank: ``redistribute R -> P`` is free).
"""
from __future__ import annotations

import torch

from fxpar.local_ops import vocab_embedding, vocab_embedding_backward

from .core import P, R, local_op, replicate_only, rule

aten = torch.ops.aten
__all__ = []


@rule(aten.mm.default)
def _mm(info):
    return [info.cand({0: 0, 1: R}, 0), info.cand({0: R, 1: 1}, 1), info.cand({0: 1, 1: 0}, P),
            info.cand({0: P, 1: R}, P), info.cand({0: R, 1: P}, P)]


@rule(aten.addmm.default)
def _addmm(info):
    bias = info.shape(0)

    def b(out_dim):                           # the bias's placement for an output split along out_dim
        off = 2 - len(bias)
        bd = out_dim - off
        return bd if bd >= 0 and bias[bd] == info.out[out_dim] else R
    return [info.cand({0: b(0), 1: 0, 2: R}, 0), info.cand({0: b(1), 1: R, 2: 1}, 1),
            info.cand({0: P, 1: 1, 2: 0}, P), info.cand({0: P, 1: P, 2: R}, P), info.cand({0: P, 1: R, 2: P}, P)]


@rule(aten.bmm.default)
def _bmm(info):
    return [info.cand({0: 0, 1: 0}, 0), info.cand({0: 1, 1: R}, 1), info.cand({0: R, 1: 2}, 2),
            info.cand({0: 2, 1: 1}, P), info.cand({0: P, 1: R}, P), info.cand({0: R, 1: P}, P)]


# Megatron's vocabulary-parallel embedding (Shoeybi et al. 2019, §3): the weight split over the vocabulary
# (dim 0), the indices whole. Each rank looks up the rows it holds (index - its offset, zero rows outside its
# range), so the output is a partial sum; the weight's gradient is split like the weight, each rank scattering
# only its rows. Both are local computations other than the op (``fxpar.local_ops``), registered below.
_VOCAB = ((0, R), (P,))
_VOCAB_BACKWARD = ((R, R), (0,))


@rule(aten.embedding.default)
def _embedding(info):
    """weight [V, D], indices [...] -> [..., D]: split D (weight dim 1), or split the indices; linear in the
    weight; the vocabulary split (weight dim 0) gives partial sums, looked up by ``fxpar.vocab_embedding``."""
    k = len(info.out)
    idx = info.shape(1)
    return [info.cand({0: 1, 1: R}, k - 1), info.cand({0: P, 1: R}, P), info.cand({0: 0, 1: R}, P)] + \
        [info.cand({0: R, 1: d}, d) for d in range(len(idx))]


@rule(aten.embedding_dense_backward.default)
def _embedding_backward(info):
    """grad [..., D], indices [...] -> [V, D]: D split stays split; split indices give partial sums; whole grad and
    indices give the vocabulary split (``fxpar.vocab_embedding_backward``: each rank its rows)."""
    g = info.shape(0)
    return [info.cand({0: len(g) - 1, 1: R}, 1), info.cand({0: P, 1: R}, P), info.cand({0: R, 1: R}, 0)] + \
        [info.cand({0: d, 1: d}, P) for d in range(len(g) - 1)]


def _argv(args, kwargs, names, defaults):
    """The op's arguments by name, from positional ``args`` and ``kwargs``."""
    return [args[i] if i < len(args) else kwargs.get(n, d) for i, (n, d) in enumerate(zip(names, defaults))]


@local_op(aten.embedding.default, _VOCAB)
def _lower_vocab_embedding(args, kwargs, group):
    weight, indices = _argv(args, kwargs, ("weight", "indices"), (None, None))
    return vocab_embedding, (weight, indices, group), {}


@local_op(aten.embedding_dense_backward.default, _VOCAB_BACKWARD)
def _lower_vocab_embedding_backward(args, kwargs, group):
    """``num_weights`` is already this rank's row count (the lowering rewrites it to the local size)."""
    grad, indices, rows, pad, scale = _argv(args, kwargs, ("grad_output", "indices", "num_weights", "padding_idx",
                                                           "scale_grad_by_freq"), (None, None, None, -1, False))
    return vocab_embedding_backward, (grad, indices, rows, pad, scale, group), {}


@rule(aten.native_layer_norm.default)
def _layer_norm(info):
    """x [..., *normalized] -> (out, mean, rstd): the leading dims may be split; weight and bias whole."""
    lead = len(info.shape(0)) - len(info.arg(1))
    return [info.cand({0: d, 2: R, 3: R}, (d, d, d)) for d in range(lead)]


@rule(aten.native_layer_norm_backward.default)
def _layer_norm_backward(info):
    """(grad, x, mean, rstd, w, b) -> (dx, dw, db): a split leading dim gives dx split and dw, db partial sums
    (the sums over the rows each rank holds; DTensor had no such rule, pytorch#128699); linear in grad."""
    lead = len(info.shape(0)) - len(info.arg(2))
    cands = [info.cand({0: d, 1: d, 3: d, 4: d, 5: R, 6: R}, (d, P, P)) for d in range(lead)]
    return cands + [info.cand({0: P, 1: R, 3: R, 4: R, 5: R, 6: R}, (P, P, P))]


def _mask(info, d, q_ndim=4):
    m = info.shape("attn_mask")
    if m is None:
        return R
    md = d - (q_ndim - len(m))
    return md if md >= 0 and m[md] == info.shape(0)[d] else R


@rule(aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_efficient_attention.default)
def _sdpa(info):
    """q, k, v [B, H, T, D] -> (out, logsumexp): split the batch or the heads (Megatron's attention split),
    the mask split alike where it is not broadcast."""
    return [info.cand({0: d, 1: d, 2: d, "attn_mask": _mask(info, d), "attn_bias": _mask(info, d)}, d)
            for d in (0, 1)]


@rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_backward(info):
    return [info.cand({0: d, 1: d, 2: d, 3: d, 4: d, 5: d, "attn_mask": _mask(info, d)}, d) for d in (0, 1)]


def _groups(info, pos):
    return int(info.arg(pos, default=1))


@rule(aten.convolution.default)
def _conv(info):
    """x [N, C, ...], w [O, C/g, ...], bias [O]: split N (data), O (output channels: w and bias split, out
    split along dim 1) or C (input channels: x dim 1 and w dim 1, partial sums; the bias then partial)."""
    cands = [info.cand({0: 0, 1: R, 2: R}, 0)]
    if _groups(info, 8) == 1:
        cands += [info.cand({0: R, 1: 0, 2: 0}, 1), info.cand({0: 1, 1: 1, 2: P}, P)]
    return cands + [info.cand({0: P, 1: R, 2: P}, P)]


@rule(aten.convolution_backward.default)
def _conv_backward(info):
    """(grad [N, O, ...], x, w) -> (dx, dw, db) for each forward split above (PiPPy#744 asked for it)."""
    cands = [info.cand({0: 0, 1: 0, 2: R}, (0, P, P))]
    if _groups(info, 9) == 1:
        cands += [info.cand({0: 1, 1: R, 2: 0}, (P, 0, 0)), info.cand({0: R, 1: 1, 2: 1}, (1, 1, R))]
    return cands + [info.cand({0: P, 1: R, 2: R}, (P, P, P))]


@rule(aten.max_pool2d_with_indices.default)
def _max_pool(info):
    return [info.cand({0: d}, (d, d)) for d in (0, 1)]


@rule(aten.max_pool2d_with_indices_backward.default)
def _max_pool_backward(info):
    return [info.cand({0: d, 1: d, 7: d}, d) for d in (0, 1)] + [info.cand({0: P, 1: R, 7: R}, P)]


@rule(aten.nll_loss_backward.default)
def _nll_backward(info):
    """(grad, logits [N, C], target [N], weight, total_weight) -> dlogits: rows independent given the (whole)
    total weight, so the batch may be split; linear in grad."""
    cands = []
    if len(info.shape(1)) == 2:
        cands.append(info.cand({0: R, 1: 0, 2: 0, 3: R, 6: R}, 0))
    return cands + [info.cand({0: P, 1: R, 2: R, 3: R, 6: R}, P)]


replicate_only("a mean over every element of the batch (the loss): small, computed whole; a split batch would "
               "need the global count of targets", aten.nll_loss_forward.default, aten.mse_loss.default)
replicate_only("advanced indexing with tensor indices (mask construction in Hugging Face models, on small "
               "integer tensors): the indexed dims need the whole tensor", aten.index.Tensor)
