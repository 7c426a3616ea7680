"""ZeRO-Offload's one-step delayed parameter update on ZeRO's chunks (Ren et al., ATC'21, §4.2: DPU).

``Strategy(dp=N, zero=1|2|3, offload=("optimizer",), delayed_update=True)``: step t's forward and backward run
on W(t); its update, after its backward, applies step t-1's gradients: W(t+1) = W(t) - lr·grad f(W(t-1)).
ZeRO-Offload's data flow: each bucket's gradients are reduce-scattered into the rank's chunk in backward (waited
in the step: one collective in flight, as ``passes.zero`` keeps it), handed to the optimizer that owns the chunk
(the CPU, in the paper), and consumed one step later, while the next step computes.

With ``passes.zero_offload`` (which runs before) the carried value is each chunk's copy in host memory, made as
soon as its reduce-scatter is waited: the gradients stream to the host in step t and the host update reads them
in step t+1.

Called by ``passes.comm_schedule`` (whose cross-iteration carry the runtime runs: ``fxpar.features.bytescheduler``)
after ``passes.zero``; after ``passes.split_graphs`` the feature derives ``FIRST`` (no update) and ``DRAIN`` (only
the update) from the steady ``FULL`` graph by data flow (``passes.comm_schedule.carry_variants``).
"""
from __future__ import annotations

import torch

from fxpar import meta as M
from fxpar.collectives import C10D
from fxpar.roles import Role

__all__ = ["carry_zero_chunks"]

aten = torch.ops.aten


def carry_zero_chunks(gm) -> list:
    """Each reduce-scatter's waited chunk leaves the step as a carry output; everything that read it (the update on
    chunks) reads the carried one, from the step before. Returns the carry keys. Before / after (one bucket)::

        rs = reduce_scatter_tensor(buf, 'sum', 2, 'fxpar:dp'); w = wait_tensor(rs)
        g = slice(div(w, 2), 0, 0, 4); _foreach_sub([w_chunk], [mul(g)]) ...; return (loss, ..., new_params)

        rs = reduce_scatter_tensor(buf, 'sum', 2, 'fxpar:dp'); w = wait_tensor(rs)
        g = slice(div(carry_chunk0, 2), 0, 0, 4); _foreach_sub([w_chunk], [mul(g)]) ...
        return (loss, ..., new_params, w)                      # w: next step's carry_chunk0
    """
    g = gm.graph
    sig = gm.meta[M.SIGNATURE.name]
    out = g.find_nodes(op="output")[0]
    outs = list(out.args[0])
    last_ph = g.find_nodes(op="placeholder")[-1]
    keys, carried, late = [], [], set()
    for r in [n for n in g.nodes if n.op == "call_function" and n.target is C10D.reduce_scatter_tensor.default]:
        (w,) = [u for u in r.users if u.target is C10D.wait_tensor.default]
        if len(w.users) == 1 and next(iter(w.users)).target is aten._to_copy.default:
            w = next(iter(w.users))        # ZeRO-Offload (passes.zero_offload): the host copy, made in its step
        key = f"chunk{len(keys)}"
        with g.inserting_after(last_ph):
            c = g.placeholder(f"carry_{key}")
        c.meta["val"] = w.meta["val"]
        M.set_meta(c, M.ROLE, Role.CARRY)
        last_ph = c
        w.replace_all_uses_with(c)
        keys.append(key)
        carried.append(w)
        late.add(c)
    for n in g.nodes:         # the carried chunk's slices now run at update time, with the update
        if n.op == "call_function" and any(a in late for a in n.all_input_nodes) and M.get(n, M.PHASE) == "backward":
            M.set_meta(n, M.PHASE, "optimizer")
            late.add(n)
    sig.inputs += [(Role.CARRY, k) for k in keys]
    keep = [i for i, (r, _) in enumerate(sig.outputs) if r != Role.GRAD]       # the update reads last step's gradients
    sig.outputs = [sig.outputs[i] for i in keep] + [(Role.CARRY, k) for k in keys]
    out.args = (tuple([outs[i] for i in keep] + carried),)
    gm.meta[M.DELAYED_UPDATE.name] = True
    gm.meta[M.CARRY.name] = True
    g.lint()
    return keys
