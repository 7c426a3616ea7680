"""Mixed precision: forward and backward compute in a narrower dtype, from master parameters kept as captured.

The joint graph is captured in the model's own dtype (the masters: float32). This pass casts each value that
enters the forward and backward from outside -- a parameter (for forward and backward uses only: the optimizer
keeps reading the master), a floating batch input, a received activation or output gradient -- to the compute
dtype right after its placeholder, rewrites dtype arguments the trace fixed to the master dtype (a ``full``,
a ``_to_copy``, ``_softmax_backward_data``'s ``input_dtype``) to the compute dtype, recomputes the fake
values the new dtypes reach (``passes.fake_values``), and casts back to its captured dtype every value that
leaves the compute: each parameter's gradient right where backward makes it (``reduce="master"``: it is
reduced in the master dtype) or right before the optimizer reads it (``reduce="compute"``: reduced in the
compute dtype), the activations and activation gradients a pipeline stage sends, the buffers forward updates.
Before / after (one Linear, bf16)::

    t = aten.t(w);  addmm = aten.addmm(b, x, t)             # forward
    mm_1 = aten.mm(t_3, x);  t_4 = aten.t(mm_1)             # backward: t_4 is w's gradient (fxpar_grad_of)
    _foreach_add(..., [t_4], ...)                           # optimizer

    w_bf16 = aten._to_copy(w, dtype=bfloat16);  x_bf16 = aten._to_copy(x, dtype=bfloat16)
    t = aten.t(w_bf16);  addmm = aten.addmm(b_bf16, x_bf16, t)
    mm_1 = aten.mm(t_3, x_bf16);  t_4 = aten.t(mm_1)
    t_4_f32 = aten._to_copy(t_4, dtype=float32)             # fxpar_grad_of moves here (reduce="master")
    _foreach_add(..., [t_4_f32], ...)

With a loss scale (fp16), the seed of backward is multiplied by the scale the precision feature's per-rank state
provides (``("state", "precision.scale")``) and each gradient is unscaled as it is cast back (a multiplication by
``1/scale``, a power of two: exact); the update itself is left to :class:`LossScaleStep`.
"""
from __future__ import annotations

import torch
import torch.fx

from fxpar import meta as M
from fxpar.collectives import insert_all_reduce
from fxpar.errors import PassError
from fxpar.feature import add_state_input, add_state_output
from fxpar.pass_manager import Pass, PassContext, PassResult
from fxpar.roles import Role

from .data_parallel import loss_seed
from .fake_values import NodeFailed, record, refresh

__all__ = ["CastToCompute", "CastGradsForUpdate", "LossScaleStep", "compute_dtype_of", "PRECISION_DTYPES"]

A = torch.ops.aten
PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# values entering the compute from outside: parameters (their forward and backward uses), buffers, the batch,
# a pipeline stage's received activations and output gradients
_CAST_IN = (Role.PARAM, Role.BUFFER, Role.INPUT, Role.TARGET, Role.ACT, Role.TANGENT)
_COMPUTE_PHASES = ("forward", "backward")
_STATE = "precision"


def compute_dtype_of(name: str) -> torch.dtype:
    return PRECISION_DTYPES[name]


def _cast(g, x, dtype, like):
    n = g.call_function(A._to_copy.default, (x,), {"dtype": dtype})
    for k in (M.PHASE.name, M.MODULE.name):
        if k in like.meta:
            n.meta[k] = like.meta[k]
    return n


def _retype(a, master, compute):
    if isinstance(a, torch.dtype):
        return compute if a == master else a
    if isinstance(a, (list, tuple)):
        return type(a)(_retype(x, master, compute) for x in a)
    if isinstance(a, dict):
        return {k: _retype(v, master, compute) for k, v in a.items()}
    return a


def _propagate(gm, before: dict, what: str) -> None:
    """The fake values of the nodes the pass made or edited, and of what their new dtypes reach."""
    try:
        refresh(gm, before)
    except NodeFailed as e:
        node = e.node
        raise PassError(f"precision: the step does not run with {what} at {node.target} (module "
                        f"{M.get(node, M.MODULE) or '<root>'}): {e}. Train this model with Strategy(precision='fp32'), "
                        "or keep the module that fails in the master dtype (run it under torch.autocast(enabled=False) "
                        "and cast its inputs with .float())") from e.__cause__


class CastToCompute(Pass):
    """Forward and backward in ``compute`` (``torch.bfloat16`` / ``torch.float16``), gradients back to the master
    dtype right where backward makes them (``reduce="master"``) or left in the compute dtype for the reduction
    (``reduce="compute"``: :class:`CastGradsForUpdate` casts them before the update). ``scale``: multiply backward's
    seed by the per-rank loss scale and unscale each gradient as it is cast back (fp16)."""
    name = "precision"

    def __init__(self, compute: torch.dtype, reduce: str = "master", scale: bool = False):
        self.compute, self.reduce, self.scale = compute, reduce, scale

    def run(self, gm, ctx: PassContext) -> PassResult:
        g = gm.graph
        sig = gm.meta[M.SIGNATURE.name]
        phs = g.find_nodes(op="placeholder")
        out = g.find_nodes(op="output")[0]
        masters = {v.dtype for n, (r, _) in zip(phs, sig.inputs) if r == Role.PARAM
                   for v in [n.meta.get("val")] if isinstance(v, torch.Tensor) and v.is_floating_point()}
        if not masters:
            return PassResult(gm, False)
        if len(masters) > 1:
            raise PassError(f"precision: the stage's parameters have several dtypes {sorted(map(str, masters))}; "
                            "mixed precision casts from one master dtype: convert the model to one (model.float())")
        master = masters.pop()
        if master == self.compute:
            return PassResult(gm, False)
        before = record(gm)
        compute_nodes = [n for n in g.nodes if n.op == "call_function" and M.get(n, M.PHASE) in _COMPUTE_PHASES]
        cast_in = 0
        for n, (r, _) in zip(phs, sig.inputs):
            v = n.meta.get("val")
            if r not in _CAST_IN or not isinstance(v, torch.Tensor) or v.dtype != master:
                continue
            users = [u for u in n.users if u.op == "call_function" and M.get(u, M.PHASE) in _COMPUTE_PHASES]
            if not users:
                continue
            with g.inserting_after(phs[-1]):
                c = _cast(g, n, self.compute, users[0])
            M.set_meta(c, M.PHASE, "forward" if r != Role.TANGENT else "backward")
            for u in users:
                u.replace_input_with(n, c)
            cast_in += 1
        for n in compute_nodes:        # dtypes the trace fixed to the master's follow the compute
            n.args, n.kwargs = _retype(n.args, master, self.compute), _retype(n.kwargs, master, self.compute)
        # every value leaving the compute (to the update, to the graph's outputs) goes back to its captured dtype
        # (the loss leaves as computed: backward's seed reads it, and data parallelism scales that seed by 1/dp)
        loss_outs = {o for o, (r, _) in zip(out.args[0], sig.outputs) if r == Role.LOSS}
        back = {}
        for n in compute_nodes:
            v = n.meta.get("val")
            leaving = [u for u in n.users if (u.op == "output" and n not in loss_outs)
                       or (u.op != "output" and M.get(u, M.PHASE) not in _COMPUTE_PHASES)]
            if not leaving or not isinstance(v, torch.Tensor) or not v.is_floating_point():
                continue
            with g.inserting_after(n):
                back[n] = _cast(g, n, v.dtype, n)
            for u in leaving:
                u.replace_input_with(n, back[n])
        scale_ph = self._seed_scale(gm) if self.scale else None
        what = f"its forward and backward in {self.compute}"
        _propagate(gm, before, what)
        grad_outs = {o for o, (r, _) in zip(out.args[0], sig.outputs) if r == Role.GRAD and isinstance(o, torch.fx.Node)}
        kept = 0
        for n, c in back.items():
            is_grad = M.get(n, M.GRAD_OF) is not None and (c in grad_outs or n in grad_outs)
            if n.meta["val"].dtype == c.meta["val"].dtype or (is_grad and self.reduce == "compute" and not self.scale):
                c.replace_all_uses_with(n)     # already in its dtype; or reduced as it is, cast before the update
                g.erase_node(c)
                continue
            kept += 1
            last = c
            if is_grad and scale_ph is not None:
                with g.inserting_after(c):
                    last = g.call_function(A.div.Tensor, (c, scale_ph))
                M.copy_meta(c, last)
                last.meta["val"] = c.meta["val"]
                for u in list(c.users):
                    if u is not last:
                        u.replace_input_with(c, last)
            if is_grad:                       # the gradient is the master-dtype value from here on
                M.set_meta(last, M.GRAD_OF, M.get(n, M.GRAD_OF))
                del n.meta[M.GRAD_OF.name]
        g.lint()
        gm.recompile()
        ctx.notes.append(f"precision: forward and backward in {str(self.compute).replace('torch.', '')} "
                         f"({cast_in} input(s) cast in, {kept} value(s) cast back to "
                         f"{str(master).replace('torch.', '')}"
                         + (", the loss scaled and each gradient unscaled" if self.scale else "") + ")")
        return PassResult(gm, True, {"cast_in": cast_in, "cast_back": kept})

    def _seed_scale(self, gm):
        """Backward's seed times the loss scale (a per-rank state scalar); a stage that receives its output
        gradients gets them scaled by the stage after it."""
        g = gm.graph
        scale = add_state_input(gm, _STATE, "scale", torch.empty((), dtype=torch.float32))
        seed = loss_seed(gm)
        if seed is not None:
            with g.inserting_before(seed.next):      # seed x scale in float32 (the scale may exceed fp16's range)
                s = g.call_function(A._to_copy.default, (seed,), {"dtype": scale.meta["val"].dtype})
                p = g.call_function(A.mul.Tensor, (s, scale))
                m = g.call_function(A._to_copy.default, (p,), {"dtype": self.compute})
            for n in (s, p, m):
                M.copy_meta(seed, n)
            for u in list(seed.users):
                if u is not s:
                    u.replace_input_with(seed, m)
        return scale


class CastGradsForUpdate(Pass):
    """``reduce="compute"``: the gradients were reduced in the compute dtype; cast each value the update reads that
    is not in its parameter's dtype back to it, right before the first optimizer op that reads it."""
    name = "precision_update"

    def run(self, gm, ctx: PassContext) -> PassResult:
        g = gm.graph
        opt = [n for n in g.nodes if n.op == "call_function" and M.get(n, M.PHASE) == "optimizer"]
        if not opt:
            return PassResult(gm, False)
        masters = {n.meta["val"].dtype for n in g.find_nodes(op="placeholder")
                   if M.get(n, M.ROLE) in (Role.PARAM, Role.PARAM_SHARD) and isinstance(n.meta.get("val"), torch.Tensor)}
        if len(masters) != 1:
            return PassResult(gm, False)
        master = masters.pop()
        done = {}
        for n in opt:
            for a in n.all_input_nodes:
                v = a.meta.get("val")
                if M.get(a, M.PHASE) == "optimizer" or not isinstance(v, torch.Tensor) or not v.is_floating_point() \
                        or v.dtype == master or v.dtype == torch.float64:
                    continue
                if a not in done:
                    with g.inserting_before(n):
                        c = _cast(g, a, master, n)
                    c.meta["val"] = v.to(master)
                    done[a] = c
                n.replace_input_with(a, done[a])
        if not done:
            return PassResult(gm, False)
        g.lint()
        gm.recompile()
        ctx.notes.append(f"precision: {len(done)} gradient(s) reduced in the compute dtype, cast to "
                         f"{str(master).replace('torch.', '')} for the update")
        return PassResult(gm, True, {"cast": len(done)})


class LossScaleStep(Pass):
    """fp16's dynamic loss scale (torch.amp.GradScaler's rule), on the step's synchronised gradients: ``found`` is
    1 where any gradient the update reads is not finite; the update is then skipped (every parameter and state
    output keeps its input, the optimizer's step count does not advance), the scale is multiplied by ``backoff``
    and the growth count restarts; otherwise the count grows, and at ``interval`` the scale is multiplied by
    ``growth``. Scale, growth count and skipped steps are the feature's per-rank state.

    ``group`` (a Plan group: the ranks that hold the parts of one update): the rank's update reads only its part of
    the gradients (its pipeline stage's, its tensor-parallel pieces, its chunks of an update sharded over dp), so its
    0/1 flag is max-reduced over the group before anything reads it, as torch's ``ShardedGradScaler`` and
    Megatron-LM's ``found_inf`` do::

        found = any(isinf_or_nan(g0)) | any(isinf_or_nan(g1))          # this rank's gradients
        flag = _to_copy(found, dtype=float32)
        ar = all_reduce(flag, 'max', 'fxpar:loss_scale');  found = gt(wait_tensor(ar), 0)
    """
    name = "loss_scale"

    def __init__(self, growth: float, backoff: float, interval: int, group: str | None = None):
        self.growth, self.backoff, self.interval = float(growth), float(backoff), int(interval)
        self.group = group

    def run(self, gm, ctx: PassContext) -> PassResult:
        g = gm.graph
        sig = gm.meta[M.SIGNATURE.name]
        phs = dict(zip(sig.inputs, g.find_nodes(op="placeholder")))
        opt = [n for n in g.nodes if n.op == "call_function" and M.get(n, M.PHASE) == "optimizer"]
        if not opt:
            return PassResult(gm, False)
        first = opt[0]
        grads = {a for n in opt for a in n.all_input_nodes
                 if M.get(a, M.PHASE) != "optimizer" and a.op != "placeholder"
                 and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].is_floating_point()}
        order = {n: i for i, n in enumerate(g.nodes)}
        grads = sorted(grads, key=order.get)
        if not grads:
            return PassResult(gm, False)
        scale = phs[(Role.STATE, f"{_STATE}.scale")]
        before = record(gm)
        tracker = add_state_input(gm, _STATE, "growth_tracker", torch.empty((), dtype=torch.float32))
        skipped = add_state_input(gm, _STATE, "skipped", torch.empty((), dtype=torch.float64))
        step = phs.get((Role.STEP, "step"))
        with g.inserting_before(grads[-1].next):
            found = None
            for x in grads:
                bad = g.call_function(A.logical_not.default, (g.call_function(A.isfinite.default, (x,)),))
                anyb = g.call_function(A.any.default, (bad,))
                found = anyb if found is None else g.call_function(A.logical_or.default, (found, anyb))
            if found is None:
                return PassResult(gm, False)
        if self.group is not None:
            found = _found_everywhere(g, found, self.group, ctx.plan.group_of(self.group, ctx.rank))
        with g.inserting_before(found.next):
            new_skipped = g.call_function(A.add.Tensor, (skipped, g.call_function(
                A._to_copy.default, (found,), {"dtype": torch.float64})))
        eff = None
        if step is not None:          # the optimizer counts the steps it took: the executor's less those skipped
            with g.inserting_after(skipped):
                eff = g.call_function(A.sub.Tensor, (step, skipped))
            M.set_meta(eff, M.PHASE, "optimizer")
        if eff is not None:
            for n in opt:
                n.replace_input_with(step, eff)
        out = g.find_nodes(op="output")[0]
        with g.inserting_before(out):
            tr1 = g.call_function(A.add.Tensor, (tracker, 1.0))
            grow = g.call_function(A.ge.Scalar, (tr1, float(self.interval)))
            grown = g.call_function(A.where.self, (grow, g.call_function(A.mul.Tensor, (scale, self.growth)), scale))
            new_scale = g.call_function(A.where.self, (found, g.call_function(A.mul.Tensor, (scale, self.backoff)),
                                                       grown))
            zero = g.call_function(A.zeros_like.default, (tracker,))
            new_tracker = g.call_function(A.where.self, (found, zero, g.call_function(A.where.self, (grow, zero, tr1))))
        add_state_output(gm, _STATE, "scale", new_scale)
        add_state_output(gm, _STATE, "growth_tracker", new_tracker)
        add_state_output(gm, _STATE, "skipped", new_skipped)
        ctx.scratch.setdefault(_STATE, {})["found"] = found
        for n in g.nodes:
            if n.op == "call_function" and n.meta.get("val") is None and M.get(n, M.PHASE) is None:
                M.set_meta(n, M.PHASE, "optimizer")
        _keep_on_overflow(gm, sig, phs, found)
        _propagate(gm, before, "the loss scale")
        g.lint()
        gm.recompile()
        ctx.notes.append(f"precision: dynamic loss scale (growth {self.growth} every {self.interval} finite steps, "
                         f"backoff {self.backoff}); a step with a non-finite gradient is skipped"
                         + (f" (the found-inf flag max-reduced over group '{self.group}')" if self.group else ""))
        return PassResult(gm, True, {"gradients_checked": len(grads), "found_reduced": self.group is not None})


def _found_everywhere(g, found, group: str, ranks: tuple):
    """``found`` (this rank's bool) as a 0/1 float32 flag, max-reduced over ``group``: 1 on every rank of the group
    where any rank found a non-finite gradient. Returns the reduced bool."""
    with g.inserting_after(found):
        flag = g.call_function(A._to_copy.default, (found,), {"dtype": torch.float32})
    flag.meta["val"] = torch.empty((), dtype=torch.float32, device="meta")    # sizes the collective (4 bytes)
    ar, w = insert_all_reduce(g, flag, group, ranks, reduce_op="max")
    with g.inserting_after(w):
        out = g.call_function(A.gt.Scalar, (w, 0.0))
    for n in (flag, ar, w, out):
        M.set_meta(n, M.PHASE, "optimizer")
    return out


def _keep_on_overflow(gm, sig, phs, found) -> None:
    """Every new parameter and optimizer-state output becomes ``where(found, old, new)``: a skipped step leaves
    them as they came in."""
    g = gm.graph
    out = g.find_nodes(op="output")[0]
    vals = list(out.args[0])
    for i, (o, (r, k)) in enumerate(zip(vals, sig.outputs)):
        if r not in (Role.NEW_PARAM, Role.NEW_OPT_STATE) or not isinstance(o, torch.fx.Node):
            continue
        src = phs.get((Role.PARAM, k) if r == Role.NEW_PARAM else (Role.OPT_STATE, k))
        if src is None:
            continue
        with g.inserting_before(out):
            w = g.call_function(A.where.self, (found, src, o))
        M.set_meta(w, M.PHASE, "optimizer")
        vals[i] = w
    out.args = (tuple(vals),)
