"""Per stage: a forward graph that returns its saved tensors, a backward graph that takes them.

The stage's forward ``f`` (from :mod:`passes.split_stages`) is traced jointly with its vector-Jacobian
product (``make_fx`` over ``torch.func.vjp``, fake tensors) and the joint graph is partitioned the
way AOTAutograd's ``default_partition`` does it: the forward is every node the stage outputs need;
the backward is every other node the gradients need; what the backward reads from the forward
(placeholders included, e.g. a weight for ``grad_input = grad @ W``) is *saved*::

    stage1.forward(w, h, r)        -> (*outputs, *saved)        # outputs: acts or the loss
    stage1.backward(*saved, *tangents) -> (*grads)              # one grad per differentiable input

Differentiable inputs are the trainable parameters and the floating-point activations; tangents
are one per floating-point output (on the last stage: d(total loss)/d(microbatch loss), 1/(m·dp)).
Nothing in the graphs is random, so a stage is a pure function of its inputs and a schedule may run
its F and B for any microbatch in any order the data dependencies allow.
"""
from __future__ import annotations

from dataclasses import dataclass

import operator

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["StageProgram", "differentiate_stage", "trace_step"]


@dataclass
class StageProgram:
    index: int
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    step: torch.fx.GraphModule | None
    inputs: list                 # (role, key) of forward's inputs
    outputs: list                # (role, key) of forward's first len(outputs) results
    n_saved: int
    diff_inputs: list            # indices into inputs that get a gradient (backward's results, in order)
    diff_outputs: list           # indices into outputs that take a tangent
    input_meta: list             # (shape, dtype) per input (microbatch shapes)
    output_meta: list            # (shape, dtype) per output
    saved_bytes: int = 0          # activation bytes saved per microbatch (weights excluded)
    param_keys: list = None      # trainable parameters of the stage, in input order
    step_inplace: torch.fx.GraphModule | None = None   # ``step`` writing into its parameter/state inputs

    _GRAPHS = ("forward", "backward", "step", "step_inplace")

    # graphs travel node by node: GraphModule's own pickling re-traces them (fxpar.runtime.portable)
    def __getstate__(self):
        from ..runtime.portable import pack_graph_module
        state = dict(self.__dict__)
        for k in self._GRAPHS:
            if state.get(k) is not None:
                state[k] = pack_graph_module(state[k])
        return state

    def __setstate__(self, state):
        from ..runtime.portable import unpack_graph_module
        state = dict(state)
        for k in self._GRAPHS:
            if state.get(k) is not None:
                state[k] = unpack_graph_module(state[k])
        self.__dict__.update(state)


def _meta(n: torch.fx.Node):
    v = n.meta["val"]
    return tuple(v.shape), v.dtype


def _ancestors(roots) -> set:
    seen, stack = set(), [r for r in roots if isinstance(r, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def differentiate_stage(index: int, gm: torch.fx.GraphModule, inputs: list, outputs: list) -> StageProgram:
    """Trace ``gm``'s forward and backward as two graphs with the saved activations explicit."""
    phs = gm.graph.find_nodes(op="placeholder")
    out_nodes = gm.graph.find_nodes(op="output")[0].args[0]
    in_meta = [_meta(n) for n in phs]
    out_meta = [_meta(n) for n in out_nodes]
    diff_in = [i for i, (role, _) in enumerate(inputs)
               if role == "param" or (role == "act" and in_meta[i][1].is_floating_point)]
    diff_out = [j for j, (_, dt) in enumerate(out_meta) if dt.is_floating_point]
    n_in, n_out = len(inputs), len(outputs)

    def joint(*args):
        prim, tang = list(args[:n_in]), args[n_in:]

        def f(*diff):
            full = list(prim)
            for i, d in zip(diff_in, diff):
                full[i] = d
            outs = gm(*full)
            return tuple(outs[j] for j in diff_out), tuple(o for j, o in enumerate(outs) if j not in diff_out)

        douts, vjp_fn, aux = torch.func.vjp(f, *[prim[i] for i in diff_in], has_aux=True)
        grads = vjp_fn(tuple(tang))
        outs, it_d, it_a = [], iter(douts), iter(aux)
        for j in range(n_out):
            outs.append(next(it_d) if j in diff_out else next(it_a))
        return (*outs, *grads)

    examples = [torch.empty(s, dtype=d) for s, d in in_meta] + \
               [torch.empty(out_meta[j][0], dtype=out_meta[j][1]) for j in diff_out]
    jgm = make_fx(joint, tracing_mode="fake")(*examples)
    fw, bw, n_saved, saved_bytes = _partition(jgm, n_in, n_out, index, [i for i, (r, _) in enumerate(inputs) if r == "param"])
    params = [k for r, k in inputs if r == "param"]
    return StageProgram(index, fw, bw, None, list(inputs), list(outputs), n_saved, diff_in, diff_out,
                        in_meta, out_meta, saved_bytes, params)


def _partition(jgm: torch.fx.GraphModule, n_in: int, n_out: int, index: int, param_idx: list):
    g = jgm.graph
    phs = g.find_nodes(op="placeholder")
    primals, tangents = phs[:n_in], phs[n_in:]
    outs = g.find_nodes(op="output")[0].args[0]
    f_outs, g_outs = outs[:n_out], outs[n_out:]
    fwd = _ancestors(f_outs) | set(primals)
    bwd = _ancestors(g_outs) - fwd
    for n in list(bwd):     # an output of a forward op read only by the backward (layer norm's rstd): save it, not the tuple
        if n.target is operator.getitem and n.args[0] in fwd:
            bwd.discard(n)
            fwd.add(n)
    saved = [n for n in g.nodes if n in fwd and (any(u in bwd for u in n.users) or n in g_outs)]
    order = {n: i for i, n in enumerate(g.nodes)}

    fg = torch.fx.Graph()
    env = {}
    for n in primals:
        env[n] = fg.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in sorted(fwd - set(primals), key=order.get):
        env[n] = fg.node_copy(n, lambda a: env[a])
    fg.output(tuple(env[n] for n in list(f_outs) + saved))

    bg = torch.fx.Graph()
    benv = {}
    for n in saved:
        benv[n] = bg.placeholder("saved_" + n.name)
        benv[n].meta = dict(n.meta)
    for n in tangents:
        benv[n] = bg.placeholder(n.name)
        benv[n].meta = dict(n.meta)
    for n in sorted(bwd - set(tangents), key=order.get):
        benv[n] = bg.node_copy(n, lambda a: benv[a])
    bg.output(tuple(benv[n] if isinstance(n, torch.fx.Node) else n for n in g_outs))
    fgm, bgm = torch.fx.GraphModule({}, fg, f"Stage{index}Forward"), torch.fx.GraphModule({}, bg, f"Stage{index}Backward")
    # activation bytes: saved tensors not made from the weights alone (weights and their views are not counted)
    weight_made = {primals[i] for i in param_idx}
    for n in sorted(fwd, key=order.get):
        if n.op == "call_function" and n.all_input_nodes and all(a in weight_made for a in n.all_input_nodes):
            weight_made.add(n)
    per_mb = fwd - weight_made
    storages = {}        # a view keeps its base's storage alive: count each storage once (fake tensors share them too)
    for n in saved:
        v = n.meta.get("val")
        if n in per_mb and isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            storages[st._cdata] = int(st.nbytes())
    nbytes = sum(storages.values())
    return fgm, bgm, len(saved), nbytes


def trace_step(index: int, spec, param_meta: list) -> torch.fx.GraphModule | None:
    """The stage's optimizer update as a graph: ``(params, grads, state, lr, step) -> (new params, new state)``."""
    if not spec.traced:
        return None
    k, n = len(spec.state_names), len(param_meta)

    def step(*flat):
        ps, gs, st = list(flat[:n]), list(flat[n:2 * n]), flat[2 * n:2 * n + n * k]
        lr, count = flat[-2], flat[-1]
        states = [[st[i * k + j] for i in range(n)] for j in range(k)]   # per state name, over params
        new_p, new_s = spec.step_all(ps, gs, states, lr, count)
        return (*new_p, *(new_s[j][i] for i in range(n) for j in range(k)))

    ex = [torch.empty(s, dtype=d) for s, d in param_meta] * 2 + \
         [torch.empty(s, dtype=d) for s, d in param_meta for _ in range(k)] + \
         [torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)]
    ex = [t.clone() for t in ex]   # one placeholder per tensor object
    gm = make_fx(step, tracing_mode="fake")(*ex)
    return gm
