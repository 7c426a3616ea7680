"""What a graph costs compiled by an op-fusing compiler (inductor), against the same graph run op by op.

Eager, every aten op of a graph is a kernel of its own: it pays its roofline time and a fixed dispatch/launch cost
(``DeviceSpec.op_overhead_s``), as :func:`cost_models.compute.graph_compute` prices it. Compiled, inductor

* calls the matrix products, convolutions and attention as the same library kernels (``extern`` ops: MKL or cuBLAS
  either way), at the same roofline and the same per-call cost;
* fuses the other ops (pointwise, reductions, norms, softmax, copies, the optimizer's list ops) that feed one another,
  through views, into generated kernels: a *region* is a connected set of such ops up to and including a reduction
  (whose result is written: the ops reading it start another region); it costs one kernel (a list op over ``k``
  tensors, ``k``), and its bytes are what enters it from outside and what leaves it, once each, not every op's
  inputs and outputs;
* runs views for free, and collectives as eager does.

So, per graph (:func:`fused_compute`)::

    eager    = sum over ops      (roofline(op) + op_overhead)
    compiled = sum over extern   (roofline(op) + op_overhead)
             + sum over regions  (roofline(flops, bytes in + bytes out) * CODE_FACTOR[kind] + kernels * call_s)

``call_s`` is the cost of one call of a generated kernel: on CUDA a launch (``op_overhead_s``: the same launch as an
eager op's, less the eager dispatcher's share, which this model does not split out); on CPU the call of a C++ kernel
from inductor's Python wrapper (:data:`CALL_S`, measured). ``CODE_FACTOR[kind]`` is how the generated loops compare
with the roofline that aten's kernels are priced at (:data:`CODE_FACTOR`, measured on CPU). Per-node times
(:func:`fused_times`) put a region's time on its last node, so the simulation of a step keeps the order of its
collectives and compute (``cost_models.sequence.Item(fused=True)``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from .compute import OpCost, concrete, graph_compute, node_cost, node_time, pays_dispatch, tensor_bytes

__all__ = ["EXTERN_CLASSES", "CODE_FACTOR", "CALL_S", "FusedCompute", "fused_compute", "fused_times", "regions"]

# the op classes inductor calls as library kernels (extern_kernels.mm / addmm / bmm, convolution, the SDPA ops)
EXTERN_CLASSES = frozenset({"matmul", "matmul_narrow", "conv", "attention"})
# the op classes that end a generated kernel (a reduction; inductor fuses pointwise prologues and epilogues into it)
_REDUCING = frozenset({"norm", "softmax", "reduction", "embedding"})
# Generated code against aten's kernels, by device kind: seconds of a fused region per second of its roofline.
# CPU: 1.4, measured. On the benchmark GPT (d=256, 2 layers, dp=2, one thread a rank; docs/strategies/compile.md,
# "Where the time goes"), the ops inductor generates code for took 17.8% of the compiled step's CPU (aten's other
# kernels 7.4% + inductor's C++ kernels 10.4%) where the same ops took 12.7% of the eager step (aten's non-matmul
# kernels), in two steps of the same length: 17.8 / 12.7 = 1.40 (at one thread its loops are no faster than aten's:
# the cross-entropy over the vocabulary costs about 3x aten's, the fused chains save less). CUDA: 1.0 (triton's
# fused kernels run at the memory roofline aten's elementwise kernels are priced at); not measured here.
CODE_FACTOR = {"cpu": 1.40, "cuda": 1.0}
# Seconds one call of a generated kernel costs its rank beside the kernel's work. CPU: the wrapper's call into the
# compiled C++ and the buffers it allocates for it, 4 us: fitted on the 1-layer tiny GPT of the tests (float32, one
# process, one thread), whose compiled step measured 0.527 ms of CPU against 0.347 ms the other terms give with 2 us
# for its 81 generated kernels (docs/strategies/compile.md, "compile='auto'"). Absent: the device's op_overhead_s
# (a CUDA launch).
CALL_S = {"cpu": 4e-6}
_VIEW_CLASSES = frozenset({"view", "size"})


@dataclass
class FusedCompute:
    """One graph, eager and compiled: seconds, aten ops that dispatch, kernels compiled code launches."""
    eager_s: float = 0.0
    compiled_s: float = 0.0
    ops: int = 0
    kernels: int = 0
    extern: int = 0
    regions: list = field(default_factory=list)     # [[node, ...], ...]

    def __add__(self, other: "FusedCompute") -> "FusedCompute":
        return FusedCompute(self.eager_s + other.eager_s, self.compiled_s + other.compiled_s, self.ops + other.ops,
                            self.kernels + other.kernels, self.extern + other.extern, self.regions + other.regions)


def _kind(node: torch.fx.Node, cost: OpCost) -> str:
    """``"view"`` (a view or size of its first input, an item of a tuple), ``"free"`` (not an op: placeholders,
    the output), ``"extern"`` (called as it is either way: a library kernel, a collective and its wait, fxpar's own
    ops) or ``"fuse"``."""
    if node.op != "call_function":
        return "free"
    if node.target is operator.getitem:
        return "view"
    if not pays_dispatch(node):
        return "extern"
    if cost.op_class in _VIEW_CLASSES:
        return "view"
    return "extern" if cost.op_class in EXTERN_CLASSES else "fuse"


def _base(node, kinds: dict):
    """Through views: the node a value comes from."""
    seen = 0
    while isinstance(node, torch.fx.Node) and kinds.get(node) == "view" and node.args \
            and isinstance(node.args[0], torch.fx.Node) and seen < 64:
        node, seen = node.args[0], seen + 1
    return node


def regions(gm: torch.fx.GraphModule, costs: dict | None = None) -> tuple:
    """``(kinds, regions)``: each node's kind (:func:`_kind`) and the fused regions, lists of ``"fuse"`` nodes that
    feed one another (through views), in graph order."""
    costs = costs if costs is not None else {n: node_cost(n) for n in gm.graph.nodes}
    kinds = {n: _kind(n, costs[n]) for n in gm.graph.nodes}
    parent = {n: n for n, k in kinds.items() if k == "fuse"}

    def find(x):
        while parent[x] is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    for n in parent:
        for a in n.all_input_nodes:
            b = _base(a, kinds)
            # a reduction ends its kernel: its result is written, and the ops that read it start another
            if b in parent and costs[b].op_class not in _REDUCING:
                ra, rb = find(n), find(b)
                if ra is not rb:
                    parent[ra] = rb
    groups: dict = {}
    for n in gm.graph.nodes:
        if n in parent:
            groups.setdefault(find(n), []).append(n)
    return kinds, list(groups.values())


def _list_len(n: torch.fx.Node) -> int:
    """Tensors a ``_foreach_*`` op runs over (1 for another op)."""
    if getattr(getattr(n.target, "overloadpacket", n.target), "__name__", "").startswith("_foreach_") and n.args \
            and isinstance(n.args[0], (list, tuple)):
        return len(n.args[0])
    return 1


def _region_cost(region: list, costs: dict, kinds: dict) -> tuple:
    """``(flops, bytes, kernels)`` of one region: its FLOPs; the bytes of the values entering it from outside and of
    its values read outside it (or returned), each once; one kernel per reduction in it, at least one (a list op
    over k tensors: k)."""
    inside = set(region)
    flops = sum(concrete(costs[n].flops) for n in region)
    entering, leaving = {}, set()
    for n in region:
        for a in n.all_input_nodes:
            b = _base(a, kinds)
            if b not in inside:
                entering[a] = concrete(tensor_bytes(a.meta.get("val")))
        if any(_base(u, kinds) not in inside or u.op == "output" for u in n.users) or not n.users:
            leaving.add(n)
    out_bytes = sum(concrete(tensor_bytes(n.meta.get("val"))) for n in leaving)
    reduces = sum(1 for n in region if costs[n].op_class in _REDUCING)
    kernels = max(1, reduces, max(_list_len(n) for n in region))
    return flops, sum(entering.values()) + out_bytes, kernels


def _call_s(device) -> float:
    return CALL_S.get(getattr(device, "kind", "cpu"), getattr(device, "op_overhead_s", 0.0))


def fused_times(gm: torch.fx.GraphModule, device) -> tuple:
    """``(eager GraphCompute, {node: seconds compiled}, FusedCompute)`` of ``gm`` on ``device``: extern ops and
    collectives at their eager times, each region's time on its last node, views and the region's other nodes 0."""
    gc = graph_compute(gm, device)
    kinds, regs = regions(gm, gc.costs)
    times = {n: (gc.times[n] if kinds[n] in ("extern", "free") else 0.0) for n in gm.graph.nodes}
    factor = CODE_FACTOR.get(getattr(device, "kind", "cpu"), 1.0)
    call = _call_s(device)
    fc = FusedCompute(regions=regs)
    for region in regs:
        flops, nbytes, kernels = _region_cost(region, gc.costs, kinds)
        t = node_time(OpCost(flops, nbytes, "elementwise", "fused"), device) * factor + kernels * call
        times[region[-1]] += t
        fc.kernels += kernels
    fc.ops = sum(1 for n in gm.graph.nodes if pays_dispatch(n))
    fc.extern = sum(1 for n in gm.graph.nodes if kinds[n] == "extern")
    fc.kernels += fc.extern
    fc.eager_s, fc.compiled_s = gc.time_s, sum(times.values())
    return gc, times, fc


def fused_compute(gm: torch.fx.GraphModule, device) -> FusedCompute:
    """``gm``'s seconds on ``device`` run op by op and compiled, with its ops and kernels (module docstring)."""
    return fused_times(gm, device)[2]
