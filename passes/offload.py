"""offload_activations: saved activations leave the device after their last forward use and come back
just ahead of their backward use (as ZeRO-Offload/ZeRO-Infinity and torch's
``save_on_cpu`` do for activations).

For each forward value that backward reads (an *activation*: not a parameter or something made from
parameters alone, not a graph input), the pass inserts ``_to_copy(x, device=cpu)`` right after x's last
forward use and a copy back to x's device in backward; backward reads the copy back. ``split_graphs``
then saves the host copy per microbatch instead of x. The copies back are *prefetched one use ahead*: in
backward's order of first uses, the copy of the k-th activation is issued just before the first use of
the (k-1)-th, so it overlaps that use's compute where the copy runs on a side stream (CUDA). On a CPU
backend both copies stay in host memory: the pass is then pure cost and only shows the mechanism.
Before / after::

    h = addmm(b, x, t)                  # forward; F saves h
    ... = gelu_backward(d, h)           # backward reads h

    h = addmm(b, x, t); h_off = _to_copy(h, device=cpu)                     # F saves h_off
    h_back = _to_copy(h_off, device=cuda:0)     # backward, one use ahead of ...
    ... = gelu_backward(d, h_back)
"""
from __future__ import annotations

import torch

from fxpar import meta as M
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.roles import Role

__all__ = ["OffloadActivations", "activations"]

aten = torch.ops.aten


def activations(gm) -> list:
    """Forward values backward reads, in forward order, leaving out what is made from parameters (and other
    non-batch inputs) alone, graph inputs themselves, tuples and scalars."""
    sig = gm.meta.get(M.SIGNATURE.name)
    phs = gm.graph.find_nodes(op="placeholder")
    roles = dict(zip(phs, sig.inputs)) if sig is not None else {}
    weight_made = {ph for ph in phs if roles.get(ph, (Role.PARAM,))[0] not in (Role.INPUT, Role.TARGET, Role.ACT)}
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.all_input_nodes and all(a in weight_made for a in n.all_input_nodes):
            weight_made.add(n)
            continue
        v = n.meta.get("val")
        if M.get(n, M.PHASE) != "forward" or not isinstance(v, torch.Tensor) or v.numel() <= 1:
            continue
        if any(M.get(u, M.PHASE) == "backward" for u in n.users):
            out.append(n)
    return out


class OffloadActivations(Pass):
    name = "offload_activations"

    def run(self, gm, ctx: PassContext) -> PassResult:
        section = ctx.plan.section("offload_activations")
        where = section.to if section is not None else None
        if not where:
            return PassResult(gm, False)
        g = gm.graph
        acts = activations(gm)
        if not acts:
            return PassResult(gm, False)
        order = {n: i for i, n in enumerate(g.nodes)}
        host = torch.device(where)
        first_use = {}
        offs = {}
        for x in acts:
            fwd = [u for u in x.users if M.get(u, M.PHASE) == "forward"]
            last = max(fwd + [x], key=order.__getitem__)
            with g.inserting_after(last):
                off = g.call_function(aten._to_copy.default, (x,), {"device": host})
            off.meta.update({"val": x.meta["val"].to("meta").to(host) if host.type != "cpu" else x.meta["val"].clone(),
                             M.PHASE.name: "forward", M.MODULE.name: M.get(x, M.MODULE, "")})
            offs[x] = off
            first_use[x] = min((u for u in x.users if M.get(u, M.PHASE) == "backward"), key=order.__getitem__)
        by_use = sorted(acts, key=lambda x: order[first_use[x]])
        for k, x in enumerate(by_use):
            anchor = first_use[by_use[k - 1]] if k else first_use[x]          # one use ahead
            if order[anchor] > order[first_use[x]]:
                anchor = first_use[x]
            with g.inserting_before(anchor):
                back = g.call_function(aten._to_copy.default, (offs[x],), {"device": x.meta["val"].device})
            back.meta.update({"val": x.meta["val"], M.PHASE.name: "backward",
                              M.MODULE.name: M.get(first_use[x], M.MODULE, "")})
            for u in [u for u in x.users if M.get(u, M.PHASE) == "backward"]:
                u.replace_input_with(x, back)
        g.lint()
        nbytes = sum(x.meta["val"].numel() * x.meta["val"].element_size() for x in acts)
        ctx.notes.append(f"offload_activations: {len(acts)} saved activation(s), {nbytes} bytes per microbatch, "
                         f"copied to {host} after their last forward use and back one backward use ahead")
        return PassResult(gm, True, {"activations": len(acts), "bytes": nbytes})
