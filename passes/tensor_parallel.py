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
from fxpar.local_ops import rank_bernoulli
from fxpar.mesh import Mesh
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.roles import Role
from fxpar.sharding import ShardingError

from .lower_sharding import lower_shardings
from .propagate_sharding import ShardingResult
from .sharding import strip_annotations, tensor_leaves

__all__ = ["TensorParallel", "stage_choice", "random_ops", "is_random_op", "split_draws", "draw_from_streams"]

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


def is_random_op(node: torch.fx.Node) -> bool:
    """A seeded random op (torch tags them ``nondeterministic_seeded``: dropout's ``bernoulli``, ``rand*``, an
    attention op with ``dropout_p`` > 0)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == "dropout_p":
            return (node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)) != 0.0
    return True


def random_ops(gm, res: ShardingResult) -> list:
    """The random ops of ``gm`` in graph order, each with the layout ``res`` gives its output: ``{"node", "op",
    "module", "shape", "dims"}`` (per dim the mesh axis it is split over, or None) and ``"stream"``: ``"shared"``
    (whole: every tp rank draws the same values from the stream they share) or ``"rank"`` (split: each rank draws
    its piece from its own stream). docs/semantics.md, "Random numbers under tensor parallelism"."""
    out = []
    for n in gm.graph.nodes:
        if not is_random_op(n):
            continue
        sh = res.out.get(n.name)
        dims = list(sh[0].dims) if sh else []
        out.append({"node": n.name, "op": str(n.target), "module": M.get(n, M.MODULE) or "<root>",
                    "shape": list(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else [],
                    "dims": dims,
                    "stream": "rank" if any(d is not None for d in dims) else "shared"})
    return out


def split_draws(gm, res: ShardingResult) -> dict:
    """``{node name: (Sharding, why)}``: each dropout mask (``bernoulli``) ``res`` draws whole whose every use wants
    it split, through elementwise ops of its shape (``mask / (1 - p)``) -- drawn split instead, each rank drawing its
    piece (Megatron's dropout in split regions), as a wish for :func:`propagate_shardings`' ``prefer``."""
    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.bernoulli.p or n.name not in res.out:
            continue
        if not res.out[n.name][0].is_replicated:
            continue
        shape, frontier, wants = tuple(n.meta["val"].shape), [n], set()
        while frontier and len(wants) <= 1:
            v = frontier.pop()
            for u in v.users:
                if u.op != "call_function" or u.name not in res.need:
                    wants.add(None)
                    continue
                need = {res.need[u.name][j] for j, (_, leaf) in enumerate(tensor_leaves(u)) if leaf is v}
                if len(need) != 1:
                    wants.add(None)
                    continue
                sh = next(iter(need))
                val = u.meta.get("val")
                if sh.is_replicated and len(tensor_leaves(u)) == 1 and res.out[u.name] \
                        and res.out[u.name][0].is_replicated and isinstance(val, torch.Tensor) \
                        and tuple(val.shape) == shape and len(u.users) > 0:
                    frontier.append(u)                      # mask / (1 - p): follow it to where it is used
                elif not sh.partial and not sh.is_replicated and len(sh.dims) == len(shape):
                    wants.add(sh)
                else:
                    wants.add(None)
        if len(wants) == 1 and None not in wants:
            out[n.name] = (next(iter(wants)), f"dropout mask {n.name} ({M.get(n, M.MODULE) or '<root>'}), drawn "
                                              "split where it is used")
    return out


def draw_from_streams(gm, drawn: list, stage: int) -> None:
    """Point each random op the decided shardings split at this rank's own stream (``fxpar.rank_bernoulli``: the
    rank draws its piece of the mask); a whole one stays on torch's generator, which the tp ranks seed alike."""
    by_name = {n.name: n for n in gm.graph.nodes}
    for d in drawn:
        if d["stream"] != "rank":
            continue
        n = by_name[d["node"]]
        if n.target is not torch.ops.aten.bernoulli.p:
            raise PassError(f"tensor_parallel, stage {stage}: random op {d['node']!r} ({d['op']}) in module "
                            f"{d['module']} is split over tp {tuple(d['dims'])}, and only dropout's bernoulli can "
                            "draw its piece from the rank's own stream; run that module whole (leave it out of "
                            "Strategy(sharding=...) layouts, or use sharding='megatron'), or set its dropout to 0")
        n.target = rank_bernoulli
        n.args, n.kwargs = (n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)), {}
    gm.recompile()


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
        drawn = random_ops(gm, res)
        draw_from_streams(new, drawn, ctx.stage)
        if drawn:
            n_rank = sum(d["stream"] == "rank" for d in drawn)
            ctx.notes.append(f"tensor_parallel: {len(drawn)} random op(s) (dropout): {len(drawn) - n_rank} on whole "
                             f"tensors draw the same values on every tp rank (the tp group's shared stream), "
                             f"{n_rank} on split tensors draw each rank's piece from its own stream "
                             "(docs/semantics.md, 'Random numbers under tensor parallelism')")
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
