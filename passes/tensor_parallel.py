"""tensor_parallel: split each operator's tensors over the tp mesh axes, on each stage's joint graph.

The mechanism only: every node's sharding is decided before lowering, by the tensor-parallel feature's planning
(``fxpar.features.tensor_parallel``, :meth:`plan_stage <fxpar.Feature.plan_stage>`: Tofu's search for ``auto``,
Megatron's Linear pairs, Mesh-TensorFlow layouts or ``fxpar.shard`` annotations, then GShard's propagation) and
kept per stage in the Plan's ``tensor_parallel`` section (``"auto"`` or ``"propagated"``: each node's output
shardings and the shardings its inputs must be in). This pass reads that choice and rewrites the graph
(``passes.lower_sharding``): collectives where a producer's layout differs from its consumer's, local sizes in
views, local shapes checked with fake tensors. Batch inputs come in whole and the loss and stage outputs leave
whole; parameters, their gradients and optimizer state stay split as decided, so the optimizer updates pieces.
The graph is the same on every rank of the stage (slices and partial-sum zeros read the rank's coordinate at run
time, ``fxpar.local_ops``), and the passes after this one (recompute, data_parallel, bucket, ...) see local
shapes. Megatron's MLP on tp=2::

    before                                        after
    t = aten.t(fc1_weight)          # [64, 16]    t = aten.t(fc1_weight)                            # [32, 16]
    addmm = aten.addmm(fc1_bias, view, t)         addmm = aten.addmm(fc1_bias, view, t)             # [24, 32]
    gelu = aten.gelu(view_1)                      gelu = aten.gelu(view_1)
    ...                                           ...
    addmm_1 = aten.addmm(fc2_bias, view_2, t_1)   first_on_axis = fxpar.first_on_axis(fc2_bias, 'fxpar:tp')
                                                  addmm_1 = aten.addmm(first_on_axis, view_2, t_1) # partial sums
                                                  all_reduce = _c10d_functional.all_reduce(view_3, 'sum', 'fxpar:tp')
                                                  wait_tensor = _c10d_functional.wait_tensor(all_reduce)
"""
from __future__ import annotations

import torch

from fxpar import meta as M
from fxpar.errors import PassError
from fxpar.mesh import Mesh
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.roles import Role
from fxpar.sharding import ShardingError

from .lower_sharding import lower_shardings
from .propagate_sharding import ShardingResult
from .sharding import strip_annotations

__all__ = ["TensorParallel", "stage_choice"]

SECTION = "tensor_parallel"          # the Plan section (fxpar.features.tensor_parallel) this pass carries out


def _gradients_laid_out(gm, sig) -> None:
    """A gradient leaves laid out as its parameter; where the lowering redistributed it for that (a partial sum
    all-reduced over tp), the redistributed value is the gradient (``fxpar_grad_of``: what microbatches sum and
    data parallelism reduces), computed in backward."""
    out = gm.graph.output_node()
    leaves = [a for a in torch.utils._pytree.tree_flatten(out.args[0])[0] if isinstance(a, torch.fx.Node)]
    for (role, key), x in zip(sig.outputs, leaves):
        if role != Role.GRAD or M.get(x, M.GRAD_OF) == key:
            continue
        chain, n = [], x
        while M.get(n, M.GRAD_OF) != key:
            if M.get(n, M.PASS) != "lower_sharding" or not n.args or not isinstance(n.args[0], torch.fx.Node):
                raise PassError(f"tensor_parallel: the gradient of {key!r} reaches the step's output through "
                                f"{n.name} ({n.target}), not a redistribution of its raw gradient -- please report it")
            chain.append(n)
            n = n.args[0]
        anchor = n                                   # the raw gradient: the chain runs right after it
        for c in reversed(chain):
            M.set_meta(c, M.PHASE, "backward")
            anchor.append(c)
            anchor = c
        M.set_meta(x, M.GRAD_OF, key)


def stage_choice(entry: dict, mode: str) -> dict | None:
    """The per-node choice a stage's entry of the ``tensor_parallel`` section holds for ``mode`` (the JSON of a
    :class:`~passes.propagate_sharding.ShardingResult`), or None: Tofu's under ``"auto"``, the propagated
    layouts and annotations under ``"propagated"`` for the other modes."""
    return entry.get("auto" if mode == "auto" else "propagated")


def _uncovered(gm, res: ShardingResult):
    """A node of ``gm`` the decided shardings do not name (the graph changed after the decision), or None."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.name not in res.out and n.name not in res.need:
            return n
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor) and n.name not in res.out:
            return n
    return None


class TensorParallel(Pass):
    name = "tensor_parallel"

    def run(self, gm, ctx: PassContext) -> PassResult:
        sh = ctx.plan.section(SECTION)
        mesh = Mesh(tuple((a, int(n)) for a, n in sh.axes))
        sig = gm.meta[M.SIGNATURE.name]
        entry = sh.stages[ctx.stage] if ctx.stage < len(sh.stages) else {}
        choice = stage_choice(entry, sh.mode)
        if choice is None:
            raise PassError(f"tensor_parallel: the Plan's tensor_parallel section holds no choice for stage "
                            f"{ctx.stage} (sharding={sh.mode!r}); the feature's planning writes it once the stage is "
                            "captured (fxpar.parallelize runs it): plan through fxpar.parallelize, or hand back a "
                            "Plan that program made")
        if sh.mode == "auto":
            strip_annotations(gm)               # Tofu decided every node itself, markers included
        res = ShardingResult.from_json(choice, mesh)
        odd = _uncovered(gm, res)
        if odd is not None:
            raise PassError(f"tensor_parallel, stage {ctx.stage}: node {odd.name!r} ({odd.target}) is not in the "
                            "shardings the Plan decided for the captured graph: a pass placed before "
                            "tensor_parallel (before=('tensor_parallel',)) changed the graph; place it after "
                            "tensor_parallel, which splits the graph the planning saw")
        try:
            new = lower_shardings(gm, res, mesh, rank=ctx.rank, world=ctx.plan.mesh)
        except ShardingError as e:
            raise PassError(f"tensor parallelism over {dict(mesh.axes)} (sharding={sh.mode!r}), stage {ctx.stage}: "
                            f"{e}") from None
        new.meta.update(gm.meta)
        _gradients_laid_out(new, sig)
        ctx.notes.extend(entry.get("notes", ()))
        split = sum(1 for v in entry["params"].values() if any(v))
        n_coll = sum(1 for n in new.graph.nodes if M.COMM.name in n.meta)
        whole = ", ".join(f"{n} ({op.split('.')[-2] if '.' in op else op} in {mod or '<root>'})"
                          for n, op, mod in res.no_rule[:6]) + (" ..." if len(res.no_rule) > 6 else "")
        ctx.notes.append(f"tensor_parallel: {split} of {len(entry['params'])} parameter(s) split over "
                         f"{dict(mesh.axes)}, {n_coll} collective(s) inserted"
                         + (f"; ops without a sharding rule, run whole: {whole}" if res.no_rule else ""))
        new.meta[M.SHARDINGS.name] = res                  # program.shardings(rank) reads it
        new.meta[M.TP_MODULES.name] = {n.name: M.get(n, M.MODULE) or (M.get(n, M.PARAM) or "").split(":")[-1]
                                       .rpartition(".")[0] for n in gm.graph.nodes}
        return PassResult(new, True, {"split_params": split, "collectives": n_coll})
