"""Memory and time as sympy expressions of batch, micro-batch and sequence length.

Two sources of expressions:

1. A graph traced with ``make_fx(..., tracing_mode="symbolic")``: every size is a SymInt whose
   ``node.expr`` is a sympy expression in the trace's symbols (``s0, s1, ...``).
   :func:`symbolic_cost` names the sizes you keep (``keep={"b": ("x", 0)}``: dim 0 of
   placeholder ``x`` is ``b``) and fixes every other symbol at the value it was traced with::

       gm = make_fx(step, tracing_mode="symbolic")(params, x, y)
       sc = symbolic_cost(gm, cluster.device, keep={"b": ("x_1", 0)})
       sc.peak_bytes            # e.g. 9216*b + 1315880
       largest_microbatch(cluster.device.memory_bytes, sc.peak_bytes, "b")

   The FLOP/byte rules are those of :mod:`cost_models.compute`; time is the sum over nodes of
   the roofline ``Max(flops/(peak·eff), bytes/(bw·eff))``. The peak is the ``Max`` over the
   live sets of the nodes, after dropping every live set another one dominates for all sizes.

2. Closed forms in symbols: :func:`transformer_memory_expr` adds ZeRO model states
   (Rajbhandari et al. 2020) and per-layer activations (Korthikanti et al. 2022).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import sympy
import torch

from .compute import pays_dispatch, node_cost
from .memory import CATEGORIES, korthikanti_activation_bytes, liveness, zero_model_state_bytes

__all__ = ["SymbolicCost", "symbolic_cost", "to_sympy", "largest_microbatch", "transformer_memory_expr",
           "B", "S"]

B = sympy.Symbol("b", positive=True, integer=True)      # micro-batch size
S = sympy.Symbol("s", positive=True, integer=True)      # sequence length


@dataclass
class SymbolicCost:
    """Sympy expressions of one graph's work and memory in the kept symbols."""
    flops: sympy.Expr
    bytes: sympy.Expr
    time_s: sympy.Expr
    peak_bytes: sympy.Expr
    memory: dict                 # category -> total bytes of that category

    def at(self, **values) -> dict:
        """Every figure evaluated at ``values`` (e.g. ``b=16``)."""
        subs = {sympy.Symbol(k, positive=True, integer=True): v for k, v in values.items()}
        figs = {"flops": self.flops, "bytes": self.bytes, "time_s": self.time_s, "peak_bytes": self.peak_bytes}
        return {k: float(v.subs(subs)) for k, v in figs.items()}


def to_sympy(x) -> sympy.Expr:
    """A sympy expression from an int, float or SymInt."""
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        return x.node.expr
    return sympy.Integer(x) if isinstance(x, int) else sympy.Float(x)


def _subs_for(gm, keep: dict) -> dict:
    env, named = None, {}
    phs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for name, (ph, dim) in keep.items():
        if ph not in phs:
            raise KeyError(f"keep={{{name!r}: ({ph!r}, {dim})}}: no placeholder {ph!r}; placeholders are {sorted(phs)}")
        size = phs[ph].meta["val"].shape[dim]
        if not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
            raise ValueError(f"dim {dim} of {ph!r} is {size!r}, not a free symbol; trace with tracing_mode='symbolic'")
        named[size.node.expr] = sympy.Symbol(name, positive=True, integer=True)
        env = size.node.shape_env
    if env is None:
        return named
    vals = getattr(env, "backed_var_to_val", None)
    vals = env.var_to_val if vals is None else vals
    fixed = {sym: sympy.Integer(int(v)) for sym, v in vals.items() if sym not in named}
    return {**fixed, **named}


def symbolic_cost(gm: torch.fx.GraphModule, device, keep: dict) -> SymbolicCost:
    """FLOPs, bytes, roofline time and memory of ``gm`` in the symbols named by ``keep``."""
    subs = _subs_for(gm, keep)

    def ex(x):
        return sympy.expand(to_sympy(x).xreplace(subs))

    eff = device.efficiency or {}
    terms: Counter = Counter()
    flops = by = sympy.Integer(0)
    n_aten = 0
    for n in gm.graph.nodes:
        if pays_dispatch(n):
            n_aten += 1          # each pays the device's fixed per-op cost, as in cost_models.compute
        c = node_cost(n)
        if c.flops == 0 and c.bytes == 0:
            continue
        f, b = ex(c.flops), ex(c.bytes)
        flops, by = flops + f, by + b
        terms[(f, b, c.op_class)] += 1
    time = n_aten * sympy.Float(getattr(device, "op_overhead_s", 0.0))
    for (f, b, cls), k in terms.items():
        pf = device.peak_flops * eff.get(cls, eff.get("compute", 1.0))
        time += k * sympy.Max(f / pf, b / (device.mem_bandwidth * eff.get("memory", 1.0)))
    lv = liveness(gm)
    peak = _peak_expr(lv, ex, [sympy.Symbol(k, positive=True, integer=True) for k in keep])
    memory = {cat: sum((ex(s.size) for s in lv.storages if s.category == cat), sympy.Integer(0)) for cat in CATEGORIES}
    return SymbolicCost(sympy.expand(flops), sympy.expand(by), time, sympy.expand(peak), memory)


def _peak_expr(lv, ex, symbols) -> sympy.Expr:
    """``Max`` of the live bytes at every node, keeping only live sets that no other dominates.

    Live bytes are polynomials with non-negative coefficients in positive symbols, so a live
    set whose coefficients are all >= another's is larger for every size: the other is dropped.
    """
    n = len(lv.nodes)
    delta: list = [dict() for _ in range(n + 1)]
    for st in lv.storages:
        for mono, c in sympy.Poly(ex(st.size), *symbols).as_dict().items():
            delta[st.start][mono] = delta[st.start].get(mono, 0) + c
            delta[st.end + 1][mono] = delta[st.end + 1].get(mono, 0) - c
    cur: dict = {}
    front: list = []
    for i in range(n):
        for mono, c in delta[i].items():
            cur[mono] = cur.get(mono, 0) + c
        cand = {m: c for m, c in cur.items() if c != 0}
        if any(all(f.get(m, 0) >= c for m, c in cand.items()) for f in front):
            continue
        front = [f for f in front if not all(cand.get(m, 0) >= c for m, c in f.items())] + [cand]
    exprs = [sympy.Add(*[c * sympy.Mul(*[x**e for x, e in zip(symbols, m)]) for m, c in f.items()]) for f in front]
    return sympy.Max(*exprs) if exprs else sympy.Integer(0)


def largest_microbatch(fits_bytes: float, memory_expr, symbol="b", upper: int = 1 << 20) -> int:
    """The largest integer value of ``symbol`` with ``memory_expr <= fits_bytes`` (0 if none).

    ``memory_expr`` must not decrease as ``symbol`` grows (true of memory in a batch size).
    """
    sym = sympy.Symbol(symbol, positive=True, integer=True) if isinstance(symbol, str) else symbol
    f = sympy.lambdify(sym, memory_expr, "math")

    def fits(v):
        return float(f(v)) <= fits_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= upper and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, upper + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def transformer_memory_expr(layers: int, hidden: int, heads: int, params: float, b=B, s=S, dp: int = 1,
                            tp: int = 1, pp: int = 1, zero_stage: int = 0, in_flight: int = 1,
                            recompute: str = "none", sequence_parallel: bool = False) -> sympy.Expr:
    """Bytes per rank of a GPT stage: ZeRO model states of its ``params/(tp·pp)`` share plus
    ``in_flight`` micro-batches of activations for its ``layers/pp`` layers (1F1B keeps up to
    ``pp`` in flight on the first stage; Narayanan et al. 2021)."""
    states = zero_model_state_bytes(params / (tp * pp), zero_stage, dp)
    act = korthikanti_activation_bytes(s, b, hidden, heads, tp=tp, sequence_parallel=sequence_parallel,
                                       recompute=recompute)
    return sympy.nsimplify(states) + sympy.Rational(layers, pp) * in_flight * sympy.expand(act)
