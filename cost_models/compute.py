"""FLOPs and bytes moved per aten op, and a roofline time on a :class:`~fxpar.cluster.DeviceSpec`.

A rule per op, in a table keyed by the op's overload packet (``aten.mm``), with a default that
always works. Lookup order for a node's target:

1. ``FLOP_RULES`` (matmuls, convolutions, attention, norms, softmax, embedding, ...);
2. ``torch.Tag.pointwise`` ops and ``_foreach_*`` ops: one FLOP per element (``"elementwise"``);
3. ``torch.Tag.reduction`` ops: one FLOP per input element (class ``"reduction"``);
4. ops whose schema says the output aliases an input (views, ``getitem``): free;
5. the default rule: ``bytes = inputs + outputs``, ``flops = numel(output)``; the op is
   reported in :attr:`GraphCompute.defaulted` so ``explain()`` can show it.

Bytes are every input and output, except for gathers and scatters (``BYTES_RULES``: ``embedding``,
``index_select``, in-place ``index_add_``), which touch only the rows they index, and the fused
Adam/AdamW update (``_fused_adamw_``: four lists read, three written, once).

FLOP formulas follow ``torch/utils/flop_counter.py`` (PyTorch): a matmul ``[m,k]@[k,n]`` is
``2mnk``; a convolution is ``2 * N * C_out * prod(out_spatial) * C_in/groups * prod(kernel)``
(Molchanov et al. 2017 count); its backward is one such count per requested gradient;
scaled-dot-product attention is ``2bhs t d_qk + 2bhs t d_v`` forward and twice that backward
(the causal mask is ignored, as in flop_counter). Norm/softmax constants are element-op counts.

Time is the roofline (Williams, Waterman, Patterson 2009, "Roofline: an insightful visual
performance model")::

    t = max(flops / (peak_flops * eff[class]), bytes / (mem_bandwidth * eff["memory"]))

Shapes may be SymInts: every rule is written with ``*`` and ``+`` only, so on a symbolic graph
the figures are SymInts too (see :mod:`cost_models.symbolic`); :func:`node_time` needs numbers
and uses each SymInt's hint.
"""
from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar import meta as M

__all__ = ["OpCost", "GraphCompute", "FLOP_RULES", "ZERO_COST_TARGETS", "node_cost", "node_time",
           "graph_compute", "op_cost", "tensor_bytes", "numel", "concrete", "fused_adam_cost", "inner_compute",
           "inner_time", "NARROW_COLUMNS", "SELECTION_CLASSES", "eager_compute", "merge_classes", "eager_step_compute"]

aten = torch.ops.aten


@dataclass(frozen=True)
class OpCost:
    """Work of one node: FLOPs, bytes read+written, its op class and which rule gave it."""
    flops: object            # int, or SymInt on a symbolic graph
    bytes: object
    op_class: str            # "matmul", "conv", "attention", "norm", "softmax", "elementwise", ...
    rule: str                # "table", "pointwise", "reduction", "view", "free", "default"
    rows: object = 0         # indices a row-by-row scatter adds (index_add): each pays DeviceSpec.index_row_s
    dtype: object = None     # a tensor-core class's output dtype (a float32 matmul on a GPU: fp32_share)


@dataclass
class GraphCompute:
    """Per-node costs of one graph; ``times`` are seconds on the device it was costed for."""
    costs: dict = field(default_factory=dict)          # node -> OpCost
    times: dict = field(default_factory=dict)          # node -> float seconds
    defaulted: Counter = field(default_factory=Counter)  # op name -> count that hit the default

    @property
    def flops(self) -> float:
        return sum(concrete(c.flops) for c in self.costs.values())

    @property
    def bytes(self) -> float:
        return sum(concrete(c.bytes) for c in self.costs.values())

    @property
    def time_s(self) -> float:
        return sum(self.times.values())

    def by_class(self) -> dict:
        """op class -> (flops, seconds)."""
        out: dict = {}
        for n, c in self.costs.items():
            f, t = out.get(c.op_class, (0.0, 0.0))
            out[c.op_class] = (f + concrete(c.flops), t + self.times.get(n, 0.0))
        return out


# ---- shape helpers -----------------------------------------------------------------------------
def concrete(x) -> float:
    """A number from an int/float/SymInt (a SymInt gives its hint)."""
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        hint = x.node.hint
        if hint is None:
            raise ValueError(f"symbolic size {x} has no hint; cost it with cost_models.symbolic instead")
        return float(hint)
    return float(x)


def _tensors(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def numel(t) -> object:
    return math.prod(t.shape) if t.dim() else 1


def tensor_bytes(v) -> object:
    """Bytes of a tensor, or of every tensor in a (nested) tuple/list."""
    return sum((numel(t) * t.element_size() for t in _tensors(v)), 0)


def _val(a):
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def _args(node):
    return [torch.fx.node.map_aggregate(a, _val) for a in node.args]


def _out_numel(out):
    return sum((numel(t) for t in _tensors(out)), 0)


# ---- rules: (args, out) -> flops ------------------------------------------------------------------
def _mm(a, out):
    (m, k), n = a[0].shape, a[1].shape[-1]
    return 2 * m * n * k


def _addmm(a, out):
    (m, k), n = a[1].shape, a[2].shape[-1]
    return 2 * m * n * k + m * n


def _bmm(a, out):
    (b, m, k), n = a[0].shape, a[1].shape[-1]
    return 2 * b * m * n * k


def _baddbmm(a, out):
    (b, m, k), n = a[1].shape, a[2].shape[-1]
    return 2 * b * m * n * k + b * m * n


def _conv_count(x_shape, w_shape, out_shape, transposed):
    # flop_counter.conv_flop_count: 2 * batch * prod(w) * prod(spatial of the "output" side)
    spatial = out_shape[2:] if not transposed else x_shape[2:]
    return 2 * out_shape[0] * math.prod(w_shape) * math.prod(spatial)


def _conv(a, out):
    return _conv_count(a[0].shape, a[1].shape, out.shape, a[6])


def _conv_bwd(a, out):
    # convolution_backward(grad_out, input, weight, bias_sizes, stride, padding, dilation,
    #                      transposed, output_padding, groups, output_mask)
    g, x, w, transposed, mask = a[0], a[1], a[2], a[7], a[10]
    fwd = _conv_count(x.shape, w.shape, g.shape, transposed)
    return fwd * int(bool(mask[0])) + fwd * int(bool(mask[1])) + (numel(g) if mask[2] else 0)


def _sdpa_fwd(a, out):
    q, k, v = a[0], a[1], a[2]
    b, h, s, d = q.shape
    t, dv = k.shape[-2], v.shape[-1]
    return 2 * b * h * s * t * d + 2 * b * h * s * t * dv


def _sdpa_bwd(a, out):
    # (grad_out, q, k, v, ...): dV, dP, dQ, dK matmuls = 2x forward
    return 2 * _sdpa_fwd(a[1:4], out)


def _per_elem(c, which="out"):
    def rule(a, out):
        return c * (_out_numel(out) if which == "out" else numel(a[0]))
    return rule


def _foreach(a, out):
    return sum((numel(t) for t in _tensors(a[0])), 0)    # one FLOP per element of the first list


def _embedding_bwd(a, out):
    return numel(a[0])          # one add per gradient element scattered into the table


def _zero(a, out):
    return 0


FLOP_RULES = {
    aten.mm: (_mm, "matmul"), aten.addmm: (_addmm, "matmul"), aten.bmm: (_bmm, "matmul"),
    aten.baddbmm: (_baddbmm, "matmul"),
    aten.convolution: (_conv, "conv"), aten.convolution_backward: (_conv_bwd, "conv"),
    aten._convolution: (_conv, "conv"),
    aten.native_layer_norm: (_per_elem(5, "in"), "norm"),
    aten.native_layer_norm_backward: (_per_elem(8, "in"), "norm"),
    aten.native_batch_norm: (_per_elem(5, "in"), "norm"),
    aten._native_batch_norm_legit: (_per_elem(5, "in"), "norm"),
    aten._native_batch_norm_legit_functional: (_per_elem(5, "in"), "norm"),
    aten._native_batch_norm_legit_no_training: (_per_elem(2, "in"), "norm"),
    aten.native_batch_norm_backward: (_per_elem(8, "in"), "norm"),
    aten._softmax: (_per_elem(5), "softmax"), aten._log_softmax: (_per_elem(5), "softmax"),
    aten._safe_softmax: (_per_elem(5), "softmax"),
    aten._softmax_backward_data: (_per_elem(3), "softmax"),
    aten._log_softmax_backward_data: (_per_elem(3), "softmax"),
    aten.embedding: (_zero, "embedding"), aten.embedding_dense_backward: (_embedding_bwd, "embedding"),
    aten.nll_loss_forward: (_per_elem(1, "in"), "reduction"),
    aten.nll_loss_backward: (_per_elem(1), "elementwise"),
    # creation ops write their output and compute nothing
    aten.empty: (_zero, "creation"), aten.empty_like: (_zero, "creation"),
    aten.empty_strided: (_zero, "creation"), aten.zeros: (_zero, "creation"),
    aten.zeros_like: (_zero, "creation"), aten.ones: (_zero, "creation"),
    aten.ones_like: (_zero, "creation"), aten.full: (_zero, "creation"),
    aten.full_like: (_zero, "creation"), aten.scalar_tensor: (_zero, "creation"),
    aten.arange: (_zero, "creation"), aten.clone: (_zero, "copy"), aten.copy: (_zero, "copy"),
    aten.copy_: (_zero, "copy"), aten._to_copy: (_zero, "copy"), aten.cat: (_zero, "copy"),
    aten.slice_backward: (_zero, "copy"), aten.select_backward: (_zero, "copy"),
    aten.slice_scatter: (_zero, "copy"), aten.select_scatter: (_zero, "copy"),
    aten.bernoulli: (_per_elem(1), "elementwise"), aten.bernoulli_: (_per_elem(1), "elementwise"),
    aten.native_dropout: (_per_elem(2, "in"), "elementwise"),
    aten.native_dropout_backward: (_per_elem(1), "elementwise"),
}
# pointwise ops that evaluate a transcendental function (erf, exp, tanh, ...): one FLOP per element as
# any pointwise op, in their own class, whose efficiency calibrate() measures on gelu; their backward ops in a class
# of their own, measured on gelu_backward (it evaluates the function's derivative and multiplies: 1.8-2x gelu's time
# per element on CPU)
for _name in ("gelu", "silu", "sigmoid", "tanh", "exp", "erf", "log", "elu", "softplus"):
    if hasattr(aten, _name):
        FLOP_RULES[getattr(aten, _name)] = (_per_elem(1), "transcendental")
    if hasattr(aten, _name + "_backward"):
        FLOP_RULES[getattr(aten, _name + "_backward")] = (_per_elem(1), "transcendental_backward")
for _name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
    if hasattr(aten, _name):
        FLOP_RULES[getattr(aten, _name)] = (_sdpa_fwd, "attention")
    if hasattr(aten, _name + "_backward"):
        FLOP_RULES[getattr(aten, _name + "_backward")] = (_sdpa_bwd, "attention")

# fxpar's rank-local ops of tensor parallelism (fxpar.local_ops): a slice copied out, a copy or zeros
import fxpar.local_ops  # noqa: E402, F401  (registers the ops)
FLOP_RULES[torch.ops.fxpar.axis_chunk] = (_zero, "copy")
FLOP_RULES[torch.ops.fxpar.first_on_axis] = (_zero, "copy")

# Ops whose time on a CPU is neither their FLOPs at a matmul's rate nor their bytes at the memory's: selection,
# search, gathers by an index tensor and random draws run one element at a time, 3-60x what their bytes take at the
# measured bandwidth here (a compressed bucket sum's TopK selection, its quantizers' level search and table look-up,
# its random draws). Each is a class of its own whose FLOPs count the per-element work below, at an efficiency
# ClusterSpec.calibrate() measures on one such op (fxpar.tools.probes.selection_probes); a spec without it prices them
# as before (class "other": the roofline at the peak's rate).
def _log2_ceil(x) -> int:
    return max(1, math.ceil(math.log2(max(2.0, concrete(x)))))


def _topk(a, out):                  # partial sort with a heap of k (ATen's CPU kernel: std::partial_sort): n log2 k
    return numel(a[0]) * _log2_ceil(a[1] if len(a) > 1 else 1)


def _searchsorted(a, out):          # searchsorted(boundaries, values): a binary search per value
    return _out_numel(out) * _log2_ceil(a[0].shape[-1] + 1)


def _bucketize(a, out):             # bucketize(values, boundaries)
    return _out_numel(out) * _log2_ceil(a[1].shape[-1] + 1)


FLOP_RULES[aten.topk] = (_topk, "topk")
FLOP_RULES[aten.searchsorted] = (_searchsorted, "search")
FLOP_RULES[aten.bucketize] = (_bucketize, "search")
FLOP_RULES[aten.index] = (_per_elem(1), "gather")          # x[ids]: one look-up per output element
FLOP_RULES[aten.randperm] = (_per_elem(1), "randperm")
# a select (where) and a comparison (a bool per element) run a scalar loop on CPU: about 0.7 ns a value here, 2-4x
# what their bytes take; an indexed write (scatter) about the same, one per index. The rate holds where the mask is
# nearly constant (a zero-dim condition, a threshold few values cross, a sparse keep mask); a mask that flips at
# random costs up to 5x (a branch mispredicted per value), which one rate cannot price: a method writes such a
# select as arithmetic where that gives the same bits (fxpar.compress.wangni)
for _name in ("where", "eq", "ne", "lt", "le", "gt", "ge"):
    FLOP_RULES[getattr(aten, _name)] = (_per_elem(1), "select")
FLOP_RULES[aten.scatter] = (lambda a, out: numel(a[2]), "select")
for _name in ("rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "uniform_", "normal_",
              "random_", "uniform", "normal"):
    if hasattr(aten, _name):
        FLOP_RULES[getattr(aten, _name)] = (_per_elem(1), "random")   # one draw per element
# the classes above, measured together by calibrate(): a spec without them prices them as "other" ("select" as
# "elementwise", the class its ops had before it was measured)
SELECTION_CLASSES = ("topk", "search", "gather", "randperm", "random", "select")


# Gathers and scatters touch the rows they index, not the whole table: bytes = what is read and written there.
def _gather_bytes(a, out):          # embedding(weight, ids) / index_select(x, dim, ids): rows read, output written
    ids = a[1] if len(a) > 1 and isinstance(a[1], torch.Tensor) else (a[2] if len(a) > 2 else None)
    return 2 * tensor_bytes(out) + (tensor_bytes(ids) if isinstance(ids, torch.Tensor) else 0)


def _scatter_add_bytes(a, out):     # index_add_(self, dim, ids, src, alpha): the touched rows read and written
    return 3 * tensor_bytes(a[3]) + tensor_bytes(a[2])


# The fused Adam/AdamW update (passes.fuse_optimizer): per element about 12 FLOPs (decay, two moments, the bias-
# corrected square root, the step); memory: parameter, gradient and both moments read once, parameter and moments
# written once (ATen's CPU kernel makes one pass; the foreach chain it replaces makes ten).
def fused_adam_cost(params) -> tuple:
    """(FLOPs, bytes) of one fused Adam/AdamW call over tensors shaped and typed as ``params``."""
    return 12 * sum((numel(t) for t in params), 0), 7 * tensor_bytes(list(params))


FLOP_RULES[aten._fused_adamw_] = FLOP_RULES[aten._fused_adam_] = (lambda a, out: fused_adam_cost(_tensors(a[0]))[0],
                                                                  "elementwise")
FLOP_RULES[aten.index_add_] = FLOP_RULES[aten.index_add] = (lambda a, out: numel(a[3]), "elementwise")   # one add per src element
BYTES_RULES = {aten.embedding: _gather_bytes, aten.index_select: _gather_bytes, aten.index_add_: _scatter_add_bytes,
               aten.index_add: lambda a, out: 2 * tensor_bytes(out) + _scatter_add_bytes(a, out),   # a copy first
               aten._fused_adamw_: lambda a, out: fused_adam_cost(_tensors(a[0]))[1],
               aten._fused_adam_: lambda a, out: fused_adam_cost(_tensors(a[0]))[1]}

# Scatters ATen's CPU kernel runs one index at a time (a slice add per index): OpCost.rows, DeviceSpec.index_row_s.
_ROW_BY_ROW = {aten.index_add_, aten.index_add}

# Nodes that cost nothing on the compute lane (collectives are costed by cost_models.comm).
ZERO_COST_TARGETS = {operator.getitem, aten._unsafe_view.default, aten._reshape_alias.default}
_WRITE_ONLY = {"creation"}
_ZERO = OpCost(0, 0, "view", "view")


def _is_view(target) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    return any(r.alias_info is not None for r in schema.returns)


def node_cost(node: torch.fx.Node) -> OpCost:
    """FLOPs, bytes and op class of one ``call_function`` node (zero for other nodes)."""
    if node.op != "call_function":
        return _ZERO
    target = node.target
    if target in ZERO_COST_TARGETS or _is_view(target):
        return _ZERO
    ns = getattr(target, "namespace", "")
    if ns == "_c10d_functional" or M.COMM.name in node.meta:
        inner = M.get(node, M.INNER_COMPUTE)
        if inner is not None:      # a call that runs a traced graph beside its collectives: that graph's compute
            return OpCost(inner[1], inner[2], "elementwise", "inner graph")
        return OpCost(0, 0, "collective", "free")
    if "val" not in node.meta:
        return OpCost(0, 0, "other", "default")          # no shape to cost: listed in explain()
    return op_cost(target, _args(node), node.meta["val"])


def op_cost(target, args: list, out) -> OpCost:
    """FLOPs, bytes and op class of one call of aten op ``target`` on ``args`` (tensors, or values such as fake or
    meta tensors) giving ``out``: the rule :func:`node_cost` applies to a graph node, for an op seen as it runs
    (an eager pass under a dispatch mode)."""
    if target in ZERO_COST_TARGETS or _is_view(target):
        return _ZERO
    schema = getattr(target, "_schema", None)
    if not _tensors(out) and not (schema is not None and schema.is_mutable):
        return OpCost(0, 0, "size", "free")             # sym_size, operator.mul on SymInts, ...
    packet = getattr(target, "overloadpacket", target)
    entry = FLOP_RULES.get(packet)
    tags = getattr(target, "tags", ())
    if entry is not None:
        rule, cls, how = entry[0], entry[1], "table"
    elif getattr(packet, "__name__", "").startswith("_foreach_"):
        rule, cls, how = _foreach, "elementwise", "pointwise"     # optimizer steps over tensor lists
    elif torch.Tag.pointwise in tags:
        rule, cls, how = _per_elem(1), "elementwise", "pointwise"
    elif torch.Tag.reduction in tags:
        rule, cls, how = (lambda a, o: sum((numel(t) for t in _tensors(a[:1])), 0)), "reduction", "reduction"
    else:
        rule, cls, how = _per_elem(1), "other", "default"
    try:
        flops = rule(args, out)
    except (AttributeError, IndexError, TypeError, ValueError):
        rule, cls, how = _per_elem(1), "other", "default"
        flops = rule(args, out)
    if packet in BYTES_RULES:
        try:
            rows = numel(args[2]) if packet in _ROW_BY_ROW else 0
            return OpCost(flops, BYTES_RULES[packet](args, out), cls, how, rows, _core_dtype(cls, out))
        except (AttributeError, IndexError, TypeError):
            pass
    out_b = tensor_bytes(out) if _tensors(out) or not args else tensor_bytes(args[0])   # in place: rewrites arg 0
    in_b = 0 if cls in _WRITE_ONLY else tensor_bytes(args)
    return OpCost(flops, in_b + out_b, cls, how, 0, _core_dtype(cls, out))


# The op classes a GPU runs on its tensor cores, whose rate (a GPU preset's peak_flops: its 16-bit one) depends on
# the dtype. A float32 matmul runs on the TF32 tensor cores at half of it where torch allows TF32
# (torch.backends.cuda.matmul.allow_tf32, or torch.set_float32_matmul_precision("high")): A100 datasheet 156 of 312
# TFLOPS, H100 SXM 494.5 of 989, H100 PCIe 378 of 756. Torch's default does not: then at the plain float32 rate,
# A100 19.5 of 312, H100 SXM 67 of 989, H100 PCIe 51 of 756 (NVIDIA A100 and H100 Tensor Core GPU datasheets; H200
# SXM as H100 SXM), V100 SXM2 15.7 of 125 (NVIDIA Tesla V100 datasheet; no TF32). A GPU not in the table: its peak_flops for all.
TENSOR_CORE_CLASSES = frozenset({"matmul", "matmul_narrow", "conv", "attention"})
TF32_SHARE = 0.5
FP32_PLAIN_SHARE = {"A100": 19.5 / 312, "H100-SXM": 67 / 989, "H200": 67 / 989, "H100-PCIe": 51 / 756,
                    "V100": 15.7 / 125}
NO_TF32 = ("V100", "P100", "T4")          # GPUs before compute capability 8.0


def _core_dtype(cls: str, out):
    if cls not in TENSOR_CORE_CLASSES:
        return None
    t = next(iter(_tensors(out)), None)
    return None if t is None else t.dtype


def fp32_share(device) -> float:
    """The share of a GPU preset's ``peak_flops`` (its 16-bit tensor-core rate) a float32 matmul reaches: TF32's
    where this process's torch allows TF32 and the GPU has it, else the plain float32 rate; 1 for a CPU and for a
    device not in ``FP32_PLAIN_SHARE`` (one a user described: its ``peak_flops`` is its rate). A run must use the
    TF32 setting of the process that priced it."""
    plain = next((v for k, v in FP32_PLAIN_SHARE.items() if k in device.name), None)
    if device.kind != "cuda" or plain is None:        # a device of the user's: its peak_flops holds for every dtype
        return 1.0
    tf32 = torch.backends.cuda.matmul.allow_tf32 and not any(n in device.name for n in NO_TF32)
    return TF32_SHARE if tf32 else plain


# an op class a spec calibrated before the class existed does not list: the class it was costed as then
_FALLBACK = {"transcendental_backward": "transcendental", "matmul_narrow": "matmul", "select": "elementwise"}

# a matmul whose output has at most this many columns (a low-rank factor: PowerSGD's P = M Q and Q = M^T P) runs
# far below a square matmul's FLOP rate on CPU: its own class, "matmul_narrow", in a compressed bucket sum's compute
NARROW_COLUMNS = 16
_MATMULS = {aten.mm, aten.bmm, aten.addmm, aten.baddbmm}


def inner_compute(gm: torch.fx.GraphModule) -> tuple:
    """``(ops, flops, bytes, classes)`` of the aten ops of a graph that a call runs beside its collectives (a
    compressed bucket sum): their number, their FLOPs and bytes in all, and ``classes``, ``((op class, flops,
    bytes), ...)`` summed per op class (sorted) -- a matmul whose output has at most :data:`NARROW_COLUMNS` columns
    is class ``"matmul_narrow"`` -- which :func:`inner_time` prices each at its class's roofline."""
    ops = flops = nbytes = 0
    classes: dict = {}
    for n in gm.graph.nodes:
        if not pays_dispatch(n):
            continue
        c = node_cost(n)
        cls = c.op_class
        out = n.meta.get("val")
        if getattr(n.target, "overloadpacket", None) in _MATMULS and isinstance(out, torch.Tensor) \
                and concrete(out.shape[-1]) <= NARROW_COLUMNS:
            cls = "matmul_narrow"
        f, b = int(concrete(c.flops)), int(concrete(c.bytes))
        ops, flops, nbytes = ops + 1, flops + f, nbytes + b
        got = classes.setdefault(cls, [0, 0])
        got[0] += f
        got[1] += b
    return ops, flops, nbytes, tuple((k, f, b) for k, (f, b) in sorted(classes.items()))


def merge_classes(*parts) -> tuple:
    """``((op class, flops, bytes), ...)`` summed per class over several such tuples (sorted by class)."""
    got: dict = {}
    for part in parts:
        for k, f, b in part:
            acc = got.setdefault(k, [0, 0])
            acc[0] += int(f)
            acc[1] += int(b)
    return tuple((k, f, b) for k, (f, b) in sorted(got.items()))


class _Costing(TorchDispatchMode):
    """Costs each aten op as it runs (:func:`eager_compute`)."""

    def __init__(self):
        super().__init__()
        self.ops, self.flops, self.bytes, self.classes = 0, 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(func, torch._ops.OpOverload) and func.namespace == "aten" \
                and not func._schema.name.split("::")[-1].startswith("sym_"):
            c = op_cost(func, list(args), out)          # every op pays its dispatch, as a graph's (views too)
            f, b = int(concrete(c.flops)), int(concrete(c.bytes))
            self.ops, self.flops, self.bytes = self.ops + 1, self.flops + f, self.bytes + b
            cls = c.op_class
            if func.overloadpacket in _MATMULS and isinstance(out, torch.Tensor) \
                    and concrete(out.shape[-1]) <= NARROW_COLUMNS:
                cls = "matmul_narrow"                   # a low-rank factor, as inner_compute classes it
            acc = self.classes.setdefault(cls, [0, 0])
            acc[0] += f
            acc[1] += b
        return out


def eager_compute(fn, *args, **kwargs) -> tuple:
    """``(fn(*args, **kwargs), (ops, flops, bytes, classes))``: the call's result and its aten ops costed as they
    run (:func:`op_cost`), as :func:`inner_compute` costs a graph's (a matmul with at most :data:`NARROW_COLUMNS`
    output columns is class ``"matmul_narrow"``) -- what a rank computes on the host beside a traced graph (a
    compressed sum's random draws, ``Method.host_inputs``; an eager method's sum, ``Method.eager_sum_compute``)."""
    with _Costing() as mode:
        out = fn(*args, **kwargs)
    classes = tuple((k, f, b) for k, (f, b) in sorted(mode.classes.items()) if f or b)
    return out, (mode.ops, mode.flops, mode.bytes, classes)


def inner_time(inner: tuple, device) -> float:
    """Roofline seconds of the compute ``inner`` (:data:`fxpar.meta.INNER_COMPUTE`: ``(ops, flops, bytes,
    collectives[, classes])``) on ``device``: each op class's FLOPs and bytes at that class's roofline, summed
    (where the classes are known; else all of it as one elementwise op)."""
    parts = inner[4] if len(inner) > 4 and inner[4] else (("elementwise", inner[1], inner[2]),)
    return sum(node_time(OpCost(f, b, cls, "inner graph"), device) for cls, f, b in parts)


def node_time(cost: OpCost, device) -> float:
    """Roofline seconds of ``cost`` on ``device`` (a :class:`fxpar.cluster.DeviceSpec`)."""
    eff = device.efficiency or {}
    f, b = concrete(cost.flops), concrete(cost.bytes)
    if f == 0 and b == 0:
        return 0.0
    cls = cost.op_class if cost.op_class in eff else _FALLBACK.get(cost.op_class, cost.op_class)
    peak = device.peak_flops * (fp32_share(device) if cost.dtype == torch.float32 else 1.0)
    t_flop = f / (peak * eff.get(cls, eff.get("compute", 1.0)))
    t_mem = b / (device.mem_bandwidth * eff.get("memory", 1.0))
    return max(t_flop, t_mem) + concrete(cost.rows) * getattr(device, "index_row_s", 0.0)


def pays_dispatch(n: torch.fx.Node) -> bool:
    """An aten op that runs as its own kernel (not a symbolic-size query such as ``sym_size``)."""
    t = n.target
    return (isinstance(t, torch._ops.OpOverload) and t.namespace == "aten"
            and not t._schema.name.split("::")[-1].startswith("sym_"))


def issues_collective(n: torch.fx.Node) -> bool:
    """A node that issues a functional collective (its ``wait_tensor`` does not: the wait is the link's time)."""
    t = n.target
    return (n.op == "call_function" and getattr(t, "namespace", "") == "_c10d_functional"
            and "wait_tensor" not in str(t))


def graph_compute(gm: torch.fx.GraphModule, device) -> GraphCompute:
    """Cost every node of ``gm`` on ``device``; ops that hit the default rule are counted."""
    gc = GraphCompute()
    overhead = getattr(device, "op_overhead_s", 0.0)
    issue = getattr(device, "collective_issue_s", 0.0)
    action = getattr(device, "action_overhead_s", 0.0)   # the runtime's own cost of calling the graph
    for n in gm.graph.nodes:
        c = node_cost(n)
        gc.costs[n] = c
        # every aten op pays a fixed dispatch/launch cost on top of its roofline time; issuing a collective
        # costs the rank's CPU too (DeviceSpec.collective_issue_s), its transfer is the link's (cost_models.comm)
        fixed = (overhead if pays_dispatch(n) else issue if issues_collective(n) else
                 action if n.op == "output" else 0.0)
        inner = M.get(n, M.INNER_COMPUTE)
        if inner is not None:        # each aten op of the inner graph pays its dispatch, each collective its issue
            fixed += overhead * inner[0] + issue * inner[3]
        gc.times[n] = (inner_time(inner, device) if inner is not None else node_time(c, device)) + fixed
        if c.rule == "default":
            gc.defaulted[str(n.target)] += 1
    return gc


def eager_step_compute(spec, params: dict, unpriced: list | None = None) -> tuple:
    """``(ops, flops, bytes, classes)``: what one step of an optimizer fxpar does not trace (``spec``: its
    :class:`fxpar.optim.OptimizerSpec`) costs a rank, which runs
    it eagerly after its graphs (``fxpar.runtime.executor.Executor._eager_step``): per parameter the weight copied
    into torch's leaf and the gradient cloned onto it, ``torch.optim``'s own ``step()``, and the new weight cloned
    out. ``params``: key -> ``(shape, dtype)`` of the parameters the rank steps. Run on meta tensors under
    :func:`eager_compute`; the optimizer's first step (which makes its state) runs uncounted
    first, so the count is a step of the steady state. An optimizer whose step cannot run on meta tensors (it reads
    a value, ``.item()``, or needs a closure) is left out: the runtime's copies alone are counted, and ``unpriced``
    (a list) receives why."""
    shapes = {k: (tuple(int(x) for x in sh), dt) for k, (sh, dt) in params.items()}
    weights = {k: torch.empty(sh, dtype=dt, device="meta") for k, (sh, dt) in shapes.items()}
    grads = {k: torch.empty(sh, dtype=dt, device="meta") for k, (sh, dt) in shapes.items()}
    leaves = {k: torch.nn.Parameter(torch.empty(sh, dtype=dt, device="meta")) for k, (sh, dt) in shapes.items()}
    opt = spec.make_torch_optimizer(list(leaves.values()))

    def step(run_optimizer=True):
        for k, leaf in leaves.items():           # the executor's _eager_step, op for op
            with torch.no_grad():
                leaf.copy_(weights[k])
            leaf.grad = grads[k].detach().clone()
        if run_optimizer:
            opt.step()
        return {k: leaf.detach().clone() for k, leaf in leaves.items()}
    try:
        step()
    except Exception as e:                        # noqa: BLE001 -- any optimizer of the user's
        if unpriced is not None:
            unpriced.append(f"{type(opt).__name__}.step() does not run on meta tensors ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:120]})")
        return eager_compute(step, False)[1]
    return eager_compute(step)[1]
