"""Data parallelism: average gradients over the dp axis; keep buffers in step like DDP.

Each dp rank traces and runs the step on its shard of the global batch (the runtime slices
the batch, the graph is traced at the shard's shape). With a mean-reduced loss over equal
shards, the global-batch gradient is the mean of the shards' gradients, so this pass puts one
``all_reduce(sum)`` behind every gradient and divides by dp. The division costs nothing where
the graph seeds backward with ``ones_like(loss)`` (what capture produces): the seed becomes
``full_like(loss, 1/dp)``, so backward itself yields gradients already divided by dp, as DDP's
pre-division does (bitwise equal for dp a power of two; otherwise within rounding). Graphs
without that seed get an explicit ``div`` after the wait instead. Before / after (the
explicit form)::

    mm_5 = aten.mm(t_7, view_3)                       # grad of fc.weight  (fxpar_grad_of)
    sub_2 = aten.sub(fc_weight, mul_4 ... mm_5 ...)   # optimizer

    mm_5 = aten.mm(t_7, view_3)
    all_reduce = _c10d_functional.all_reduce(mm_5, 'sum', 'fxpar:dp')
    wait_tensor = _c10d_functional.wait_tensor(all_reduce)
    div = aten.div(wait_tensor, 2)
    sub_2 = aten.sub(fc_weight, mul_4 ... div ...)

With the seed scaled, ``div`` is absent and ``wait_tensor`` is the gradient
(``fxpar_grad_of``). ``BucketGradients`` then fuses these per-gradient collectives into buckets.
"""
from __future__ import annotations

import torch

from fxpar import meta as M
from fxpar.collectives import insert_all_reduce, insert_broadcast
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.roles import Role

__all__ = ["DataParallelGradSync", "SyncBuffers"]


def grad_nodes(gm) -> list:
    """The raw gradient nodes capture marked (one per parameter), in graph order."""
    sig = gm.meta.get(M.SIGNATURE.name)
    out = gm.graph.find_nodes(op="output")
    if sig is not None and out:
        nodes = [n for n, (r, _) in zip(out[0].args[0], sig.outputs) if r == Role.GRAD and isinstance(n, torch.fx.Node)]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        return sorted(dict.fromkeys(n for n in nodes if M.get(n, M.GRAD_OF) is not None), key=order.get)
    return [n for n in gm.graph.nodes if M.get(n, M.GRAD_OF) is not None]


def loss_seed(gm) -> torch.fx.Node | None:
    """The ``ones_like(loss)`` / ``full_like(loss, c)`` that seeds backward, when there is exactly one."""
    sig = gm.meta.get(M.SIGNATURE.name)
    out = gm.graph.find_nodes(op="output")
    if sig is None or not out:
        return None
    try:
        (li,) = sig.index(Role.LOSS, outputs=True)
    except (ValueError, KeyError, TypeError):
        return None
    loss = out[0].args[0][li]
    seeds = [u for u in getattr(loss, "users", {}) if u.op == "call_function"
             and u.target in (torch.ops.aten.ones_like.default, torch.ops.aten.full_like.default)
             and M.get(u, M.PHASE) == "backward"]
    return seeds[0] if len(seeds) == 1 else None


def _prescale_seed(gm, dp: int) -> bool:
    """Seed backward with c/dp instead of c, so every gradient comes out divided by dp. A stage that
    receives its output gradients (not the last) gets them already scaled by the stage after it."""
    seed = loss_seed(gm)
    sig = gm.meta.get(M.SIGNATURE.name)
    if seed is None:
        return sig is not None and bool(sig.index(Role.TANGENT))
    g = gm.graph
    value = 1.0 if seed.target is torch.ops.aten.ones_like.default else float(seed.args[1])
    with g.inserting_after(seed):
        new = g.call_function(torch.ops.aten.full_like.default, (seed.args[0], value / dp), dict(seed.kwargs))
    M.copy_meta(seed, new)
    seed.replace_all_uses_with(new)
    g.erase_node(seed)
    gm.meta[M.GRAD_PRESCALE.name] = dp
    return True


def stage_groups(ctx: PassContext) -> dict:
    """param key -> group name its gradient is summed over on this stage (planner's decision)."""
    plan = ctx.plan
    if plan is None or not getattr(plan, "grad_groups", None):
        return {}
    return {k: g for k, g in plan.grad_groups[ctx.stage].items() if g}


class DataParallelGradSync(Pass):
    """Sum each gradient over the ranks the planner assigned it to (``Plan.grad_groups``): the stage's dp
    replicas (and Chimera's second pipeline), or, for a parameter several stages share, every rank
    holding one of them. The mean over dp comes from backward's seed, scaled by 1/dp."""
    name = "data_parallel"

    def run(self, gm, ctx: PassContext) -> PassResult:
        groups = stage_groups(ctx)
        dp = ctx.mesh.axis_size("dp")
        g = gm.graph
        grads = [n for n in grad_nodes(gm) if M.get(n, M.GRAD_OF) in groups]
        prescaled = _prescale_seed(gm, dp) if dp > 1 else True
        if not grads:
            return PassResult(gm, dp > 1 and prescaled)
        n_sync = 0
        for grad in grads:
            key = M.get(grad, M.GRAD_OF)
            users = list(grad.users)
            ranks = ctx.plan.group_of(groups[key], ctx.rank)
            ar, w = insert_all_reduce(g, grad, groups[key], ranks)
            M.set_meta(ar, M.REDUCE_GRAD, "issue")
            M.set_meta(w, M.REDUCE_GRAD, "wait")
            if prescaled:
                avg = w
            else:
                with g.inserting_after(w):
                    avg = g.call_function(torch.ops.aten.div.Tensor, (w, dp))
                avg.meta.update({"val": grad.meta.get("val"), M.PHASE.name: "backward",
                                 M.MODULE.name: M.get(grad, M.MODULE, "")})
                M.set_meta(avg, M.REDUCE_GRAD, "wait")
            M.set_meta(avg, M.GRAD_OF, key)      # the synchronised node is the gradient; the raw one keeps its key
            for u in users:
                # backward itself reads this rank's gradient (another parameter's gradient copied from it)
                if u.op == "output" or M.get(u, M.PHASE) != "backward":
                    u.replace_input_with(grad, avg)
            n_sync += 1
        how = "backward seeded with 1/dp, then all_reduce(sum)" if prescaled else "all_reduce(sum)/dp"
        names = sorted(set(groups[M.get(n, M.GRAD_OF)] for n in grads))
        ctx.notes.append(f"data_parallel: {n_sync} gradients summed over {', '.join(names)} ({how})")
        return PassResult(gm, n_sync > 0, {"gradients": n_sync})


class SyncBuffers(Pass):
    """DDP's ``broadcast_buffers`` (``plan.section("data_parallel").broadcast_buffers``): every dp rank leaves the
    step with dp-rank 0's buffers."""
    name = "sync_buffers"

    def run(self, gm, ctx: PassContext) -> PassResult:
        dp = ctx.mesh.axis_size("dp")
        section = ctx.plan.section("data_parallel")
        if dp == 1 or section is None or not section.broadcast_buffers or ctx.plan.n_stages > 1:
            return PassResult(gm, False)
        sig = gm.meta[M.SIGNATURE.name]
        out = gm.graph.find_nodes(op="output")[0]
        outs = list(out.args[0])
        ranks = ctx.mesh.group(ctx.rank, "dp")
        changed = 0
        for i in sig.index(Role.NEW_BUFFER, outputs=True):
            node = outs[i]
            v = node.meta.get("val")
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                continue      # integer counters (num_batches_tracked) are equal on every rank
            # at the end of the step: buffers may be updated in place (batch norm) after they are made
            _, w = insert_broadcast(gm.graph, node, "dp", ranks, src=ranks[0], before=out)
            outs[i] = w
            changed += 1
        out.args = (tuple(outs),)
        if changed:
            ctx.notes.append(f"sync_buffers: {changed} floating buffers broadcast from dp-rank 0 after the step (DDP semantics)")
        return PassResult(gm, changed > 0, {"buffers": changed})
