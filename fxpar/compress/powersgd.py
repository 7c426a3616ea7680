"""PowerSGD: low-rank gradient compression by one step of power iteration per training step.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization",
NeurIPS 2019, Algorithm 1 (rank-r power iteration with error feedback and warm start), carried out with the
arithmetic of torch's ``powerSGD_hook`` (``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``), so a
run equals DDP with that hook and the same ``PowerSGDState`` to the last bits:

- each gradient ``G`` of the bucket is viewed as ``n x m`` (``n = G.shape[0]``) and compressed at rank
  ``r' = min(n, m, rank)`` when ``(n + m) r' * min_compression_rate < n m`` (torch's ``_should_compress``); the
  others are all-reduced whole, in one flat buffer, and divided by the world size. The compressed ones are taken
  grouped by matrix shape, as the hook takes them (:func:`compress_order`): that order places P and Q in their
  buffers and draws the initial Qs;
- with error feedback, ``M = G_local + e`` (``e``: this rank's residual of the previous compressed step, in the
  hook's units: DDP hands the hook un-divided local gradients);
- Algorithm 1: ``Q <- orth(Q)``; ``P = M Q``; all-reduce P (a sum); ``P <- orth(P)``; ``Q = M^T P``; all-reduce Q
  and divide by the world size; the estimate is ``P Q^T``; ``e <- M - P Q^T`` (torch takes the residual of the
  whole buffer, so a tensor sent whole keeps ``M - mean``, as torch does);
- ``orth`` is Gram-Schmidt column by column, ``col / (||col|| + epsilon)``, for rank <= 2, and
  ``torch.linalg.qr`` above (torch's ``_orthogonalize``);
- Q starts from ``torch.randn`` under ``torch.manual_seed(s)``, ``s`` drawn by ``numpy.random.RandomState(seed)
  .randint(1_000_000_000)`` once per bucket in bucket order, on the first compressed step (warm start) or every
  compressed step (no warm start). Each bucket keeps that generator's state as a tensor (``"rng"``), so a
  checkpoint resumes the same draws;
- steps ``0 .. start_iter - 1`` are a plain all-reduce (torch's ``state.iter < start_powerSGD_iter``; its
  ``iter`` counts finished steps).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from fxpar.compress.feature import register_method
from fxpar.compress.method import BucketInfo, Comm, Method
from fxpar.errors import StrategyError

__all__ = ["PowerSGD", "TensorPlan", "bucket_layout", "compress_order", "power_step", "orthogonalize",
           "rng_state_tensor", "draw_seed", "random_q", "describe_layout", "warn_if_nothing_compressed",
           "should_compress", "p_size", "q_size", "uncompressed_size"]

_SEED_BOUND = 1_000_000_000      # torch's ``state.rng.randint(1_000_000_000)``
_MT_WORDS = 624                  # MT19937's state: 624 words, then position, has_gauss, cached gaussian
_warned_buckets: set = set()


@dataclass(frozen=True)
class TensorPlan:
    """One gradient of a bucket: where it lies in the flat buffer and how it is sent.

    ``rows`` x ``cols`` is the matrix view (``n x m``); ``rank`` > 0: compressed at that rank (P is ``rows x rank``,
    Q ``cols x rank``); 0: all-reduced whole."""
    offset: int
    numel: int
    shape: tuple
    rows: int
    cols: int
    rank: int

    @property
    def compressed(self) -> bool:
        return self.rank > 0


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """torch's ``_should_compress``: ``(n + m) r * min_compression_rate < n m`` (``r`` already ``min(n, m, rank)``)."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


def bucket_layout(bucket: BucketInfo, ranks, min_compression_rate: float) -> tuple:
    """Each gradient of ``bucket`` as a :class:`TensorPlan`, given each one's requested rank (``ranks``: one per
    gradient, or one int for all)."""
    if isinstance(ranks, int):
        ranks = (ranks,) * len(bucket.shapes)
    out = []
    for shape, off, want in zip(bucket.shapes, bucket.offsets, ranks):
        numel = 1
        for s in shape:
            numel *= int(s)
        if len(shape) == 0:           # a scalar has no matrix view (torch's hook cannot take one): sent whole
            out.append(TensorPlan(off, numel, tuple(shape), 1, 1, 0))
            continue
        rows = int(shape[0])
        cols = numel // rows if rows else 0
        r = min(rows, cols, int(want))
        keep = r > 0 and should_compress(rows, cols, r, min_compression_rate)
        out.append(TensorPlan(off, numel, tuple(shape), rows, cols, r if keep else 0))
    return tuple(out)


def orthogonalize(m: torch.Tensor, epsilon: float) -> torch.Tensor:
    """The columns of each ``[batch, rows, rank]`` matrix made orthonormal, as torch's ``_orthogonalize`` does it:
    Gram-Schmidt for rank <= 2 (and half precision), ``torch.linalg.qr`` above. Returns a new tensor; the work is
    done in place on a contiguous copy, column views and all, because the norms and dot products are reductions
    whose rounding follows the memory layout (a strided column sums in another order than a contiguous one)."""
    rank = m.shape[2]
    if rank > 2 and m.dtype not in (torch.float16, torch.bfloat16):
        return torch.linalg.qr(m).Q
    m = m.clone(memory_format=torch.contiguous_format)
    for i in range(rank):
        col = m[:, :, i:i + 1]
        # PowerSGD's orthogonalisation (Vogels et al. 2019, Algorithm 1): normalise the column (plus epsilon, against
        # a column of zeros), then remove its component from the columns after it
        if epsilon == 0:
            col.div_(torch.norm(col, dim=1, keepdim=True))
        else:
            col.div_(torch.norm(col, dim=1, keepdim=True) + epsilon)
        if i + 1 < rank:
            rest = m[:, :, i + 1:]
            rest.sub_(torch.sum(col * rest, dim=1, keepdim=True) * col)
    return m


def rng_state_tensor(seed: int) -> torch.Tensor:
    """``numpy.random.RandomState(seed)``'s state as an int64 tensor (624 words, position, has_gauss, gauss bits)."""
    return _pack(np.random.RandomState(seed).get_state())


def _pack(st) -> torch.Tensor:
    _, keys, pos, has_gauss, gauss = st
    tail = np.array([pos, has_gauss, np.float64(gauss).view(np.int64)], dtype=np.int64)
    return torch.from_numpy(np.concatenate([keys.astype(np.int64), tail]))


def _unpack(t: torch.Tensor) -> np.random.RandomState:
    a = t.detach().cpu().numpy().astype(np.int64)
    rs = np.random.RandomState()
    rs.set_state(("MT19937", a[:_MT_WORDS].astype(np.uint32), int(a[_MT_WORDS]), int(a[_MT_WORDS + 1]),
                  float(a[_MT_WORDS + 2:_MT_WORDS + 3].view(np.float64)[0])))
    return rs


def draw_seed(rng: torch.Tensor, index: int, count: int) -> tuple:
    """One round of torch's seed draws: every bucket of the stage draws ``randint(1_000_000_000)`` in bucket order
    from the one shared generator; returns (this bucket's draw, the generator's state after the round)."""
    rs = _unpack(rng)
    seeds = [int(rs.randint(_SEED_BOUND)) for _ in range(count)]
    return seeds[index], _pack(rs.get_state())


def compress_order(layout: tuple) -> list:
    """The compressed gradients in the order torch's hook takes them: grouped by matrix shape ``(n, m)``, the groups
    in the order their first member appears in the bucket (its ``shape_to_tensors`` dict). P and Q lie in this
    order in their flat buffers, and the initial Qs are drawn in it."""
    groups: dict = {}
    for t in layout:
        if t.compressed:
            groups.setdefault((t.rows, t.cols), []).append(t)
    return [t for g in groups.values() for t in g]


def random_q(layout: tuple, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The initial Qs of one bucket, flat: ``torch.randn(1, m, r)`` per compressed gradient in
    :func:`compress_order`, after ``torch.manual_seed(seed)`` (a generator of its own seeded alike gives the same
    numbers)."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn((1, t.cols, t.rank), generator=g, dtype=dtype).reshape(-1) for t in compress_order(layout)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def q_size(layout: tuple) -> int:
    return sum(t.cols * t.rank for t in layout if t.compressed)


def p_size(layout: tuple) -> int:
    return sum(t.rows * t.rank for t in layout if t.compressed)


def uncompressed_size(layout: tuple) -> int:
    return sum(t.numel for t in layout if not t.compressed)


def power_step(x: torch.Tensor, q_in: torch.Tensor, layout: tuple, comm: Comm, epsilon: float) -> tuple:
    """One PowerSGD step on a bucket in the hook's units (``x``: this rank's un-divided gradients plus residual):
    ``(estimate of the mean over ranks, Q after the step)`` (Vogels et al. 2019, Algorithm 1; torch's
    ``powerSGD_hook`` steps I-III). ``q_in``: the Qs to start from, flat, before orthogonalisation."""
    world = comm.size
    comp = compress_order(layout)
    mats, qs, ps = [], [], []
    qo = 0
    for t in comp:
        mats.append(x[t.offset:t.offset + t.numel].view(1, t.rows, t.cols))
        q = q_in[qo:qo + t.cols * t.rank].view(1, t.cols, t.rank)
        qo += t.cols * t.rank
        qs.append(orthogonalize(q, epsilon))
    for m, q in zip(mats, qs):
        ps.append(torch.bmm(m, q))
    # the tensors sent whole: one all-reduce, then the division by the world size (the hook's order)
    whole = [x[t.offset:t.offset + t.numel] for t in layout if not t.compressed]
    whole_sum = comm.all_reduce(torch.cat(whole)) / world if whole else None
    p_all = None
    if comp:
        # P is summed, not averaged: it is orthogonalised next (the hook's comment)
        p_all = comm.all_reduce(torch.cat([p.reshape(-1) for p in ps]))
        po = 0
        ps = []
        for t in comp:
            ps.append(orthogonalize(p_all[po:po + t.rows * t.rank].view(1, t.rows, t.rank), epsilon))
            po += t.rows * t.rank
        qs = [torch.bmm(m.transpose(1, 2), p) for m, p in zip(mats, ps)]
        q_all = comm.all_reduce(torch.cat([q.reshape(-1) for q in qs])) / world
    else:
        q_all = q_in
    # the estimates P Q^T, then the buffer in its own order
    approx, qo = {}, 0
    for t, p in zip(comp, ps):
        q = q_all[qo:qo + t.cols * t.rank].view(1, t.cols, t.rank)
        qo += t.cols * t.rank
        approx[t.offset] = torch.bmm(p, q.transpose(1, 2)).reshape(-1)
    pieces, wo, at = [], 0, 0
    for t in layout:
        if t.offset > at:                        # padding between gradients: kept as it is
            pieces.append(x[at:t.offset])
        if t.compressed:
            pieces.append(approx[t.offset])
        else:
            pieces.append(whole_sum[wo:wo + t.numel])
            wo += t.numel
        at = t.offset + t.numel
    if at < x.shape[0]:
        pieces.append(x[at:])
    return torch.cat(pieces), q_all


@register_method
@dataclass(frozen=True)
class PowerSGD(Method):
    """PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019) on each gradient bucket, exactly as torch's
    ``powerSGD_hook`` computes it. Options are ``PowerSGDState``'s: ``rank`` (``matrix_approximation_rank``),
    ``start_iter`` (``start_powerSGD_iter``: steps before it are a plain all-reduce), ``min_compression_rate``,
    ``error_feedback`` (``use_error_feedback``), ``warm_start``, ``orthogonalization_epsilon``, ``seed``
    (``random_seed``)."""
    rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    seed: int = 0

    name: ClassVar[str] = "powersgd"
    paper: ClassVar[str] = ("Vogels, Karimireddy & Jaggi, PowerSGD: Practical Low-Rank Gradient Compression for "
                            "Distributed Optimization, NeurIPS 2019 (Algorithm 1); torch's powerSGD_hook")

    # ---- options ----
    def check(self, dp: int) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise StrategyError(f"PowerSGD(rank={self.rank!r}): the rank of the approximation must be an int >= 1 "
                                "(1 to 4 is usual; torch's matrix_approximation_rank)")
        if not isinstance(self.start_iter, int) or isinstance(self.start_iter, bool) or self.start_iter < 0:
            raise StrategyError(f"PowerSGD(start_iter={self.start_iter!r}): the first compressed step must be an "
                                "int >= 0")
        if (self.error_feedback or self.warm_start) and self.start_iter <= 1:
            raise StrategyError(f"PowerSGD(start_iter={self.start_iter}): with error_feedback or warm_start on, "
                                "start_iter must be > 1 (torch's PowerSGDState refuses start_powerSGD_iter <= 1 "
                                "there); set start_iter=2 or more, or error_feedback=False and warm_start=False")
        if self.min_compression_rate < 0:
            raise StrategyError(f"PowerSGD(min_compression_rate={self.min_compression_rate!r}): must be >= 0 "
                                "(0 compresses every matrix)")
        if self.orthogonalization_epsilon < 0:
            raise StrategyError(f"PowerSGD(orthogonalization_epsilon={self.orthogonalization_epsilon!r}): must be "
                                ">= 0 (1e-8 guards against columns of zeros)")

    # ---- plan ----
    def layout(self, bucket: BucketInfo) -> tuple:
        lay = bucket_layout(bucket, self.rank, self.min_compression_rate)
        warn_if_nothing_compressed(bucket, lay, f"PowerSGD(rank={self.rank}, "
                                               f"min_compression_rate={self.min_compression_rate})")
        return lay

    # ---- per bucket, on the host ----
    def init_state(self, bucket: BucketInfo, gen: torch.Generator) -> dict:
        dtype = bucket.torch_dtype
        st = {"rng": rng_state_tensor(self.seed)}
        if self.error_feedback:
            st["residual"] = torch.zeros(bucket.numel, dtype=dtype)
        if self.warm_start:
            st["q"] = torch.zeros(q_size(self.layout(bucket)), dtype=dtype)
        return st

    def variant(self, bucket: BucketInfo, step: int, state: dict):
        # one graph for every compressed step: where its Qs come from (drawn afresh or the last step's, warm started)
        # is the host's choice (host_inputs), so a bucket's sum is traced once, not once per source
        return "allreduce" if step < self.start_iter else "compressed"

    def host_inputs(self, bucket: BucketInfo, step: int, state: dict, variant, gen: torch.Generator) -> list:
        """The compressed sum's ``[Qs to start from, the seed generator's state after this step]``: the last
        step's Qs (warm start, after the first compressed step), or Qs drawn afresh as the hook draws them."""
        if variant == "allreduce":
            return []
        if self.warm_start and step > self.start_iter:
            return [state["q"], state["rng"]]
        seed, rng = draw_seed(state["rng"], bucket.index, bucket.count)
        return [random_q(self.layout(bucket), seed, bucket.torch_dtype), rng]

    # ---- traced ----
    def sum(self, flat: torch.Tensor, state: dict, inputs: list, bucket: BucketInfo, comm: Comm, variant) -> tuple:
        if variant == "allreduce":
            # the hook's plain all-reduce: each rank's bucket divided by the world size, then summed
            return comm.all_reduce(flat), dict(state)
        new = dict(state)
        # DDP hands the hook un-divided local gradients: back to its units (exact for a power-of-two dp)
        x = flat * comm.size
        if self.error_feedback:
            x = x + state["residual"]
        q_in, new["rng"] = inputs
        out, q = power_step(x, q_in, self.layout(bucket), comm, self.orthogonalization_epsilon)
        if self.error_feedback:
            new["residual"] = x - out
        if self.warm_start:
            new["q"] = q
        return out, new

    # ---- cost and words ----
    def wire_bytes(self, bucket: BucketInfo, variant) -> int:
        if variant == "allreduce":
            return bucket.numel * bucket.element_size
        lay = self.layout(bucket)
        return (uncompressed_size(lay) + p_size(lay) + q_size(lay)) * bucket.element_size

    def describe(self, bucket: BucketInfo, variant) -> list:
        if variant == "allreduce":
            return [f"bucket {bucket.index}: plain all-reduce of {bucket.numel * bucket.element_size} B "
                    f"(steps before start_iter={self.start_iter})"]
        return describe_layout(bucket, self.layout(bucket))


def describe_layout(bucket: BucketInfo, layout: tuple) -> list:
    es = bucket.element_size
    lines = []
    for key, t in zip(bucket.keys, layout):
        if t.compressed:
            lines.append(f"{key}: compressed as {t.rows} x {t.cols} at rank {t.rank} "
                         f"(P {t.rows * t.rank * es} B + Q {t.cols * t.rank * es} B instead of {t.numel * es} B)")
        else:
            lines.append(f"{key}: sent whole ({t.numel * es} B, in the bucket's one uncompressed all-reduce)")
    return lines


def warn_if_nothing_compressed(bucket: BucketInfo, layout: tuple, what: str) -> None:
    key = (what, bucket.stage, bucket.index, bucket.keys)
    if layout and not any(t.compressed for t in layout) and key not in _warned_buckets:
        _warned_buckets.add(key)
        warnings.warn(f"{what}: no gradient of bucket {bucket.index} (stage {bucket.stage}: "
                      f"{', '.join(map(str, bucket.keys))}) is worth compressing at this rank, so the bucket is "
                      "all-reduced whole; lower the rank or min_compression_rate to compress it", stacklevel=3)
