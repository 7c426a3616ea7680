"""cost_models.compute: FLOPs per op against closed forms and torch.utils.flop_counter."""
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

from cost_models.compute import (SELECTION_CLASSES, eager_compute, graph_compute, merge_classes, node_cost, node_time,
                                   op_cost)
from fxpar.cluster import ClusterSpec, DeviceSpec

pytestmark = pytest.mark.cost


def _trace(fn, *args, mode="fake"):
    return make_fx(fn, tracing_mode=mode)(*args)


def _costs(gm, target):
    return [node_cost(n) for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def test_mm_is_exactly_2mnk_and_bytes_in_plus_out():
    m, k, n = 7, 11, 13
    gm = _trace(torch.mm, torch.randn(m, k), torch.randn(k, n))
    (c,) = _costs(gm, torch.ops.aten.mm.default)
    assert c.flops == 2 * m * n * k
    assert c.bytes == 4 * (m * k + k * n + m * n)
    assert (c.op_class, c.rule) == ("matmul", "table")


def test_addmm_bmm_baddbmm():
    gm = _trace(lambda b, x, w: torch.addmm(b, x, w), torch.randn(5), torch.randn(3, 4), torch.randn(4, 5))
    assert _costs(gm, torch.ops.aten.addmm.default)[0].flops == 2 * 3 * 5 * 4 + 3 * 5
    gm = _trace(torch.bmm, torch.randn(2, 3, 4), torch.randn(2, 4, 6))
    assert _costs(gm, torch.ops.aten.bmm.default)[0].flops == 2 * 2 * 3 * 6 * 4
    gm = _trace(torch.baddbmm, torch.randn(2, 3, 6), torch.randn(2, 3, 4), torch.randn(2, 4, 6))
    assert _costs(gm, torch.ops.aten.baddbmm.default)[0].flops == 2 * 2 * 3 * 6 * 4 + 2 * 3 * 6


def test_conv_forward_and_backward_match_closed_form_and_flop_counter():
    x, w = torch.randn(2, 3, 16, 16, requires_grad=True), torch.randn(8, 3, 3, 3, requires_grad=True)

    def f(x, w):
        y = F.conv2d(x, w, padding=1, stride=2)
        return torch.autograd.grad(y.sum(), (x, w))

    gm = _trace(f, x, w)
    (fwd,) = _costs(gm, torch.ops.aten.convolution.default)
    # out 2x8x8x8; 2 * N * Cout * Hout * Wout * Cin * kh * kw
    assert fwd.flops == 2 * 2 * 8 * 8 * 8 * 3 * 3 * 3
    (bwd,) = _costs(gm, torch.ops.aten.convolution_backward.default)
    with FlopCounterMode(display=False) as fc:
        f(x, w)
    assert fwd.flops + bwd.flops == fc.get_total_flops()


def test_cpu_flash_attention_forward_backward():
    q = torch.randn(2, 4, 16, 8, requires_grad=True)

    def f(q, k, v):
        return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(), q)

    gm = _trace(f, q, torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8))
    costs = [node_cost(n) for n in gm.graph.nodes if "attention" in str(n.target)]
    assert [c.op_class for c in costs] == ["attention", "attention"]
    fwd = 2 * (2 * 2 * 4 * 16 * 16 * 8)
    assert [c.flops for c in costs] == [fwd, 2 * fwd]


def test_unknown_op_gets_default_and_is_listed():
    gm = _trace(lambda x: torch.cumsum(x, 0) + 1, torch.randn(4, 5))
    gc = graph_compute(gm, DeviceSpec())
    assert gc.defaulted == {"aten.cumsum.default": 1}
    (c,) = _costs(gm, torch.ops.aten.cumsum.default)
    assert (c.flops, c.bytes, c.rule) == (20, 160, "default")
    (add,) = _costs(gm, torch.ops.aten.add.Tensor)
    assert add.rule == "pointwise"


def test_views_are_free_and_roofline_picks_the_bound():
    gm = _trace(lambda x: x.t().reshape(-1).sum(), torch.randn(64, 32))
    free = [node_cost(n) for n in gm.graph.nodes if n.target == torch.ops.aten.t.default]
    assert free[0].flops == 0 and free[0].bytes == 0
    dev = DeviceSpec(peak_flops=1e9, mem_bandwidth=1e9, efficiency={"matmul": 0.5})
    mm = _costs(_trace(torch.mm, torch.randn(100, 100), torch.randn(100, 100)), torch.ops.aten.mm.default)[0]
    assert node_time(mm, dev) == 2e6 / 0.5e9                      # compute-bound
    add = _costs(_trace(torch.add, torch.randn(1000), torch.randn(1000)), torch.ops.aten.add.Tensor)[0]
    assert node_time(add, dev) == 12000 / 1e9                     # memory-bound


def test_symbolic_shapes_give_symbolic_flops():
    gm = _trace(torch.mm, torch.randn(6, 5), torch.randn(5, 3), mode="symbolic")
    (c,) = _costs(gm, torch.ops.aten.mm.default)
    assert isinstance(c.flops, torch.SymInt)
    assert node_time(c, ClusterSpec.local(1).device) > 0            # hints make it concrete
    assert int(c.flops.node.hint) == 2 * 6 * 5 * 3


def test_index_add_pays_per_row_beyond_its_bytes():
    """``index_add_`` (Parallax's row update) and ``index_add`` (its dense route, into zeros): the touched rows read
    and written, the source and indices read; the out-of-place one copies its table first. Each index pays
    ``DeviceSpec.index_row_s`` on top of the roofline (ATen's CPU kernel adds the rows one at a time)."""
    V, d, r = 1000, 16, 40
    ids, rows = torch.randint(0, V, (r,)), torch.randn(r, d)
    scatter = 3 * r * d * 4 + r * 8
    inplace = _costs(_trace(lambda w, i, s: w.index_add_(0, i, s), torch.zeros(V, d), ids, rows),
                     torch.ops.aten.index_add_.default)[0]
    assert (inplace.bytes, inplace.rows, inplace.flops) == (scatter, r, r * d)
    copy = _costs(_trace(lambda w, i, s: torch.index_add(w, 0, i, s), torch.zeros(V, d), ids, rows),
                  torch.ops.aten.index_add.default)[0]
    assert (copy.bytes, copy.rows) == (2 * V * d * 4 + scatter, r)
    dev = DeviceSpec(peak_flops=1e12, mem_bandwidth=1e9)
    assert node_time(inplace, dev) == scatter / 1e9                # not measured: the roofline alone
    slow = DeviceSpec(peak_flops=1e12, mem_bandwidth=1e9, index_row_s=2e-7)
    assert node_time(inplace, slow) == pytest.approx(scatter / 1e9 + r * 2e-7)
    assert node_time(copy, slow) == pytest.approx((2 * V * d * 4 + scatter) / 1e9 + r * 2e-7)
    # other gathers and scatters pay no per-row figure
    emb = _costs(_trace(lambda i, w: F.embedding(i, w), ids, torch.zeros(V, d)), torch.ops.aten.embedding.default)[0]
    assert emb.rows == 0 and node_time(emb, slow) == node_time(emb, dev)


def test_transcendental_backward_has_its_own_class_with_the_forward_as_fallback():
    """gelu / gelu_backward: one FLOP per element each, in the classes ``transcendental`` and
    ``transcendental_backward`` (calibrate() measures both); a device calibrated before the backward class existed
    costs it as the forward."""
    x = torch.randn(64, 32)
    fwd = _costs(_trace(lambda t: F.gelu(t), x), torch.ops.aten.gelu.default)[0]
    bwd = _costs(_trace(lambda g, t: torch.ops.aten.gelu_backward(g, t), x, x), torch.ops.aten.gelu_backward.default)[0]
    assert (fwd.flops, fwd.op_class) == (64 * 32, "transcendental")
    assert (bwd.flops, bwd.op_class) == (64 * 32, "transcendental_backward")
    both = DeviceSpec(peak_flops=1e9, mem_bandwidth=1e15, efficiency={"transcendental": 0.1, "transcendental_backward": 0.05})
    assert node_time(fwd, both) == pytest.approx(2048 / 1e8) and node_time(bwd, both) == pytest.approx(2048 / 5e7)
    old = DeviceSpec(peak_flops=1e9, mem_bandwidth=1e15, efficiency={"transcendental": 0.1})
    assert node_time(bwd, old) == node_time(fwd, old)


def test_selection_search_gather_and_draws_have_classes_of_their_own():
    """Ops a CPU runs element by element, far slower than their bytes: ``topk`` (class ``topk``, ``n log2 k``: a
    partial sort with a heap of k), ``searchsorted`` / ``bucketize`` (``search``, ``n log2(levels + 1)``: a binary
    search per value), ``x[ids]`` (``gather``, a look-up per output element), ``randperm`` and the random draws
    (``randperm``, ``random``: one per element), selects, comparisons and indexed writes (``select``: one per output
    element, one per index for ``scatter``). A device calibrated for a class prices its FLOPs at that class's
    efficiency; one without it prices them at the peak's rate (class ``other``; ``select`` as ``elementwise``), with
    the same bytes."""
    aten = torch.ops.aten
    n, k = 5000, 50
    x, levels = torch.randn(n), torch.tensor([0.0, 0.25, 0.5, 1.0])
    ids = torch.randint(0, 4, (n,))
    cases = [(lambda t: torch.topk(t, k), (x,), aten.topk.default, "topk", n * 6),            # log2 50 -> 6
             (lambda lv, t: torch.searchsorted(lv, t), (levels, x), aten.searchsorted.Tensor, "search", n * 3),
             (lambda t, lv: torch.bucketize(t, lv), (x, levels), aten.bucketize.Tensor, "search", n * 3),  # log2 5
             (lambda lv, i: lv[i], (levels, ids), aten.index.Tensor, "gather", n),
             (lambda t: torch.randperm(t.shape[0]), (x,), aten.randperm.default, "randperm", n),
             (lambda t: torch.rand(t.shape[0]), (x,), aten.rand.default, "random", n),
             (lambda t: torch.where(t > 0, t, 0.0), (x,), aten.where.self, "select", n),
             (lambda t: t < 1, (x,), aten.lt.Scalar, "select", n),
             (lambda t, i: t.new_zeros(4).scatter(0, i, t), (x, ids), aten.scatter.src, "select", n)]
    for fn, args, target, cls, flops in cases:
        (c,) = _costs(_trace(fn, *args), target)
        assert (c.op_class, c.flops) == (cls, flops), target
        plain = DeviceSpec(peak_flops=1e9, mem_bandwidth=1e15)
        measured = DeviceSpec(peak_flops=1e9, mem_bandwidth=1e15, efficiency={cls: 0.001})
        assert node_time(c, plain) == pytest.approx(flops / 1e9)
        assert node_time(c, measured) == pytest.approx(flops / 1e6)


def test_eager_compute_costs_the_ops_a_call_runs():
    """``eager_compute``: a call's result and its aten ops costed as they run, per class -- what a compressed sum's
    host inputs cost (RandomK's permutations, a quantizer's uniform draws)."""
    gen = torch.Generator().manual_seed(0)
    out, (ops, flops, nbytes, classes) = eager_compute(
        lambda: [torch.randperm(1000, generator=gen)[:10] for _ in range(2)])
    assert [t.shape for t in out] == [(10,), (10,)]
    assert (ops, flops, nbytes, classes) == (4, 2000, 16000, (("randperm", 2000, 16000),))    # two slices: views
    _, (ops, flops, _, classes) = eager_compute(torch.rand, 300, generator=gen)
    assert (ops, flops, [c[:2] for c in classes]) == (1, 300, [("random", 300)])
    assert merge_classes((("a", 1, 2), ("b", 3, 4)), (("a", 10, 20),)) == (("a", 11, 22), ("b", 3, 4))


def test_calibrated_selection_efficiency_gives_back_the_measured_time():
    """``calibrate()`` turns each probe's measured seconds into the efficiency at which the class's FLOPs take those
    seconds: priced by the cost model on the probe's op, the time is the measured one."""
    from fxpar.tools.calibrate import selection_efficiency
    from fxpar.tools.probes import selection_probes
    peak = 5e10
    for cls, (target, args, call) in selection_probes().items():
        assert cls in SELECTION_CLASSES
        eff = selection_efficiency(cls, 0.2, peak)
        c = op_cost(target, args, call())
        assert c.op_class == cls
        dev = DeviceSpec(peak_flops=peak, mem_bandwidth=1e15, efficiency={cls: eff})
        assert node_time(c, dev) == pytest.approx(0.2)
