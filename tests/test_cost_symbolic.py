"""cost_models.symbolic: expressions in the batch size agree with concrete traces."""
import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from cost_models.compute import graph_compute
from cost_models.memory import korthikanti_activation_bytes, liveness, zero_model_state_bytes
from cost_models.symbolic import B, S, largest_microbatch, symbolic_cost, transformer_memory_expr
from fxpar.cluster import ClusterSpec

pytestmark = pytest.mark.cost

_m = nn.Sequential(nn.Linear(48, 160), nn.ReLU(), nn.Linear(160, 10))
_params = {k: v.detach() for k, v in _m.named_parameters()}


def _step(params, x, y):
    g, lval = torch.func.grad_and_value(
        lambda p: F.cross_entropy(torch.func.functional_call(_m, p, (x,)), y))(params)
    return lval, {k: params[k] - 0.1 * g[k] for k in params}


def _trace(b, mode):
    return make_fx(_step, tracing_mode=mode)(_params, torch.randn(b, 48), torch.randint(0, 10, (b,)))


def test_symbolic_graph_cost_matches_concrete_traces():
    dev = ClusterSpec.local(1).device
    sc = symbolic_cost(_trace(37, "symbolic"), dev, keep={"b": ("x_1", 0)})
    assert sc.flops.free_symbols == {sympy.Symbol("b", positive=True, integer=True)}
    for b in (5, 37, 200):
        gm = _trace(b, "fake")
        gc, lv = graph_compute(gm, dev), liveness(gm)
        got = sc.at(b=b)
        assert got["flops"] == gc.flops and got["bytes"] == gc.bytes
        assert got["peak_bytes"] == lv.peak_bytes                 # the Max picks the right node at every b
        assert got["time_s"] == pytest.approx(gc.time_s, rel=1e-9)


def test_largest_microbatch_is_the_boundary():
    sc = symbolic_cost(_trace(37, "symbolic"), ClusterSpec.local(1).device, keep={"b": ("x_1", 0)})
    budget = 1e7
    b = largest_microbatch(budget, sc.peak_bytes)
    assert sc.at(b=b)["peak_bytes"] <= budget < sc.at(b=b + 1)["peak_bytes"]
    assert largest_microbatch(10, sc.peak_bytes) == 0


def test_transformer_memory_expr_closed_form():
    psi, L, h, a = 1.3e9, 24, 2048, 16
    expr = transformer_memory_expr(L, h, a, psi, dp=8, zero_stage=2)
    expect = zero_model_state_bytes(psi, 2, 8) + L * korthikanti_activation_bytes(1024, 4, h, a)
    assert float(expr.subs({B: 4, S: 1024})) == pytest.approx(expect)
    b = largest_microbatch(80 * 2**30, expr.subs(S, 1024), B)
    assert float(expr.subs({B: b, S: 1024})) <= 80 * 2**30 < float(expr.subs({B: b + 1, S: 1024}))
