"""Backward in the order the next step needs the gradients (ByteScheduler's priority, applied to compute).

ByteScheduler (Peng et al., SOSP'19) orders *communication* by when the next forward needs each layer:
first layers first. But backward makes the first layers' gradients last, so with cross-iteration overlap
the pieces the next forward needs first are the last ones handed to the link: they cannot overlap anything
(the tied embedding and the first block of a GPT). A compiler that owns the whole step can also reorder
the *compute*: backward's data flow only fixes that each layer's input gradient (dX) comes before the
layer below; the weight gradients (dW) are leaves that nothing else in backward reads. This pass runs
backward as "for each gradient in the planned order: whatever it still needs, in the original order,
then it", then everything left. With the need order (``priority``) the dX chain runs first, then the
embedding's and the first block's dW, and the last blocks' dW run while the first ones are on the link
(as zero-bubble pipelines split B into B and W; Qi et al., ICLR'24). It moves nodes only: the same ops on
the same values, bit for bit; dY tensors live longer (the memory estimate sees it: it reads this order).

The planner decides (``fxpar.features.bytescheduler.plan_comm_schedule`` simulates each candidate with
``cost_models.comm_tuning``, natural included) and writes ``grad_order`` into stage s of the Plan's ``bytescheduler`` section:
``{"mode": "natural" | "priority" | "hybrid", "keys": [...], "first": j, ...}`` -- ``hybrid`` keeps the
first ``j`` gradients of backward where they are (they go on the link while the dX chain runs) and moves
the rest in need order. This pass runs before ``data_parallel`` so that every later pass (buckets, the
issue plan) sees the new order. Before / after (2 blocks; dX: input gradients, dW: weight gradients)::

    mm_10 = mm(g, w1)      # dX block 1       mm_10 = mm(g, w1)      # dX block 1
    mm_11 = mm(t(g), x1)   # dW block 1       mm_12 = mm(g1, w0)     # dX block 0
    mm_12 = mm(g1, w0)     # dX block 0       mm_13 = mm(t(g1), x0)  # dW block 0: its all_reduce goes first
    mm_13 = mm(t(g1), x0)  # dW block 0       mm_11 = mm(t(g), x1)   # dW block 1: overlaps block 0's
"""
from __future__ import annotations

from fxpar.backward_order import backward_region, reordered_backward, why_not_reorder
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.errors import PassError

__all__ = ["GradOrder", "backward_region", "reordered_backward", "why_not_reorder"]


class GradOrder(Pass):
    """Reorder backward so gradients come in the order the Plan's ``bytescheduler`` section gives (``stages[stage]['grad_order']['keys']``)."""
    name = "grad_order"

    def run(self, gm, ctx: PassContext) -> PassResult:
        section = ctx.plan.section("bytescheduler")
        stages = section.stages if section is not None else []
        entry = (stages[ctx.stage] if ctx.stage < len(stages) else {}).get("grad_order") or {}
        if entry.get("mode", "natural") == "natural":
            return PassResult(gm, False, {"mode": "natural"})
        why = why_not_reorder(gm)
        if why:
            raise PassError(f"grad_order: the Plan's bytescheduler stages[{ctx.stage}]['grad_order'] is "
                            f"{entry['mode']!r}, but backward of stage {ctx.stage} cannot be reordered: {why}. Plan "
                            "again (drop the Plan's bytescheduler stages) and the planner keeps the natural order.")
        region = backward_region(gm)
        order = reordered_backward(gm, entry["keys"])
        anchor = region[0].prev
        for n in order:
            anchor.append(n)
            anchor = n
        gm.graph.lint()
        gm.recompile()
        moved = sum(a is not b for a, b in zip(region, order))
        ctx.notes.append(f"grad_order (stage {ctx.stage}): backward runs the gradients in the next forward's need "
                         f"order ({entry['mode']}, first {entry.get('first', 0)} kept): {moved} of {len(region)} "
                         "backward nodes moved")
        return PassResult(gm, moved > 0, {"mode": entry["mode"], "moved": moved})

