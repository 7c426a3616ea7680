"""What a captured step computes over the batch, where sharding the batch changes it (docs/semantics.md §6-§7).

A step's global batch runs as ``dp x microbatches`` pieces, each on its own rows. Everything that treats rows
one at a time trains exactly as one process does; two kinds of forward computation see only their piece:

* **BatchNorm in training mode** (:func:`batch_norm_nodes`): it normalises with the statistics of the rows the
  forward sees, and updates its running statistics once per forward -- once per microbatch.
* **A batch-wide statistic** (:func:`batch_reductions`): a reduction over the batch dimension whose result flows
  back into per-row computation -- ``x - x.mean(0)``, ``x / x.std(0)``, ``F.normalize(x, dim=0)``, a ``.item()``
  of a batch mean dividing the activations, a matrix product contracting the batch (``x.T @ x``,
  ``einsum('bi,bj->ij', x, x)``) -- rather than only into the loss's own reduction.

Both read the captured joint graph: the batch is dim 0 of the batch inputs (and of the activations a pipeline
stage receives), followed through transposes, permutes and views to the dim that carries it in each forward
tensor (:func:`batch_dims`); the loss and a stage's outputs are the forward's results. Nothing here changes a
graph: the planner turns what is found into plan notes.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from . import meta as M
from .roles import Role

__all__ = ["batch_norm_nodes", "batch_dims", "batch_reductions", "batch_notes"]

aten = torch.ops.aten

# BatchNorm ops; op -> index of its ``training`` argument (None: always training)
_BATCH_NORMS = {aten.native_batch_norm.default: 5, aten._native_batch_norm_legit.default: 5,
                aten._native_batch_norm_legit.no_stats: 3, aten._native_batch_norm_legit_functional.default: 5,
                aten._batch_norm_with_update.default: None, aten._batch_norm_with_update_functional.default: None,
                aten.batch_norm.default: 5, aten.cudnn_batch_norm.default: 5, aten.miopen_batch_norm.default: 5}
# ops that reduce over their ``dim`` argument (argument 1; missing or empty: every dim)
_REDUCTIONS = {aten.sum, aten.mean, aten.var, aten.std, aten.var_mean, aten.std_mean, aten.amax, aten.amin,
               aten.max, aten.min, aten.prod, aten.logsumexp, aten.linalg_vector_norm, aten.norm, aten.median,
               aten.argmax, aten.argmin, aten.cumsum, aten.cumprod, aten.logcumsumexp, aten.cummax, aten.cummin}
# matrix products; op -> (operand index, its contracted dim) for each operand
_CONTRACTIONS = {aten.mm.default: ((0, 1), (1, 0)), aten.addmm.default: ((1, 1), (2, 0)),
                 aten.bmm.default: ((0, 2), (1, 1)), aten.baddbmm.default: ((1, 2), (2, 1)),
                 aten.mv.default: ((0, 1), (1, 0)), aten.addmv.default: ((1, 1), (2, 0)),
                 aten.dot.default: ((0, 0), (1, 0)), aten.vdot.default: ((0, 0), (1, 0)),
                 aten.outer.default: (), aten.addr.default: ()}
# matrix products; op -> (operand index, its dim, the output dim it becomes) for each dim a product keeps
_PRODUCT_DIMS = {aten.mm.default: ((0, 0, 0), (1, 1, 1)), aten.addmm.default: ((1, 0, 0), (2, 1, 1)),
                 aten.bmm.default: ((0, 0, 0), (1, 0, 0), (0, 1, 1), (1, 2, 2)),
                 aten.baddbmm.default: ((1, 0, 0), (2, 0, 0), (1, 1, 1), (2, 2, 2)),
                 aten.mv.default: ((0, 0, 0),), aten.addmv.default: ((1, 0, 0),),
                 aten.outer.default: ((0, 0, 0), (1, 0, 1)), aten.addr.default: ((1, 0, 0), (2, 0, 1))}
# ops that regroup dims: the batch dim is followed by element offsets, not by sizes
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view}
_BATCH_ROLES = (Role.INPUT, Role.TARGET, Role.ACT)


def _packet(node):
    return getattr(node.target, "overloadpacket", node.target)


def _forward(node) -> bool:
    return node.op == "call_function" and M.get(node, M.PHASE) == "forward"


def _arg(node, i, name, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def batch_norm_nodes(gm: torch.fx.GraphModule, module_types: dict | None = None) -> list:
    """The forward BatchNorm nodes in training mode: ``[(node, module path, updates running statistics)]``.
    ``module_types`` (module path -> class name) leaves out InstanceNorm, whose statistics are per row."""
    out = []
    for n in gm.graph.nodes:
        if not _forward(n) or n.target not in _BATCH_NORMS:
            continue
        at = _BATCH_NORMS[n.target]
        if at is not None and not _arg(n, at, "training", False):
            continue
        mod = M.get(n, M.MODULE, "")
        if "InstanceNorm" in (module_types or {}).get(mod, ""):
            continue
        running = n.target not in (aten._native_batch_norm_legit.no_stats,) and _arg(n, 3, "running_mean") is not None
        out.append((n, mod, running))
    return out


def _batch_rows(gm: torch.fx.GraphModule, sig) -> tuple:
    """(rows of a piece, the placeholders carrying the batch on dim 0)."""
    phs = gm.graph.find_nodes(op="placeholder")
    carriers = [ph for ph, (role, _) in zip(phs, sig.inputs) if role in _BATCH_ROLES
                and isinstance(ph.meta.get("val"), torch.Tensor) and ph.meta["val"].dim() >= 1]
    rows = int(carriers[0].meta["val"].shape[0]) if carriers else 0
    return rows, carriers


def _has_rows(node, rows: int) -> bool:
    v = node.meta.get("val")
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and isinstance(v.shape[0], int) and v.shape[0] >= rows \
        and v.shape[0] % rows == 0


def _reduced_dims(node) -> list | None:
    """The dims ``node`` reduces over (None: every dim)."""
    dim = _arg(node, 1, "dim")
    if _packet(node) in (aten.linalg_vector_norm, aten.norm):
        dim = _arg(node, 2, "dim")
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    return list(dim) if isinstance(dim, (list, tuple)) else [dim]


def _shape(node):
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


def _regrouped_dim(src: tuple, out: tuple, k: int) -> int | None:
    """The dim of ``out`` (the same elements as ``src``, regrouped by a view) that holds ``src``'s dim ``k``
    whole, where one does; None where the view splits it over dims or sizes leave it ambiguous (size 1)."""
    if src[k] == 1:
        return None
    start = _prod(src[:k])
    for j in range(len(out)):
        if _prod(out[:j]) <= start < _prod(out[:j + 1]):
            return j if _prod(out[:j + 1]) >= start * src[k] and out[j] % src[k] == 0 else None
    return None


def _moved_dim(node, k: int, src: tuple, out: tuple) -> int | None:
    """Where ``node`` puts its batched input's dim ``k`` (None: nowhere it can tell, or reduced away)."""
    target, pk = node.target, _packet(node)
    if target is aten.t.default:
        return (1 - k) if len(src) == 2 else k
    if pk is aten.transpose:
        d0, d1 = (d % len(src) for d in node.args[1:3])
        return d1 if k == d0 else d0 if k == d1 else k
    if pk is aten.permute:
        return [d % len(src) for d in node.args[1]].index(k)
    if pk is aten.unsqueeze:
        return k + (1 if node.args[1] % len(out) <= k else 0)
    if pk is aten.squeeze and len(node.args) > 1:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = {d % len(src) for d in dims if src[d % len(src)] == 1}
        return None if k in dims else k - sum(d < k for d in dims)
    if pk is aten.expand:
        return k + len(out) - len(src)
    if pk in _VIEWS and out != src:
        return _regrouped_dim(src, out, k)
    if pk in _REDUCTIONS and pk not in (aten.cumsum, aten.cumprod, aten.logcumsumexp, aten.cummax, aten.cummin):
        dims = [d % len(src) for d in (_reduced_dims(node) or range(len(src)))]
        if k in dims:
            return None
        return k if len(out) == len(src) else k - sum(d < k for d in dims)
    if k == 0 and out and out[0] == src[0]:
        return 0
    if len(out) >= len(src) and out[k + len(out) - len(src)] == src[k]:    # elementwise, broadcast on the left
        return k + len(out) - len(src)
    return None


def batch_dims(gm: torch.fx.GraphModule, sig) -> dict:
    """``{forward node: the dim of its tensor that carries the batch}`` for the forward tensors computed from
    the batch, where it can be followed (dim 0 of the batch inputs; through transposes, permutes, views,
    elementwise and matrix ops). A product that contracts the batch dim, or a reduction over it, ends it."""
    rows, carriers = _batch_rows(gm, sig)
    dims = {ph: 0 for ph in carriers} if rows else {}
    for n in gm.graph.nodes:
        if not _forward(n):
            continue
        src = n.args[0] if n.target is operator.getitem else n
        ins = [(a, dims[a]) for a in src.all_input_nodes if a in dims] if isinstance(src, torch.fx.Node) else []
        out = _shape(n)
        if not ins or out is None:
            continue
        if n.target in _CONTRACTIONS:
            if not _contracts_batch(n, dims):
                kept = [o for i, d, o in _PRODUCT_DIMS.get(n.target, ())
                        if i < len(n.args) and isinstance(n.args[i], torch.fx.Node) and dims.get(n.args[i]) == d]
                if kept:
                    dims[n] = kept[0]
            continue
        a, k = ins[0]
        got = _moved_dim(src, k, _shape(a), out) if _shape(a) else None
        if got is not None and 0 <= got < len(out):
            dims[n] = got
    return {n: d for n, d in dims.items() if d is not None}


def _contracts_batch(node, dims: dict) -> bool:
    """Whether a matrix product contracts an operand's batch dim (``x.T @ x``: the batch summed over)."""
    for i, d in _CONTRACTIONS.get(node.target, ()):
        a = node.args[i] if i < len(node.args) else None
        if isinstance(a, torch.fx.Node) and a in dims and dims[a] == d % max(len(_shape(a) or ()), 1):
            return True
    return False


def batch_reductions(gm: torch.fx.GraphModule, sig) -> list:
    """Forward reductions over the batch dimension whose result flows back into per-row computation on its
    way to the loss (or a pipeline stage's outputs): ``[(node, module path)]``. A reduction that only makes
    the loss (its value meets no tensor that still has the batch's rows) is the loss's own and not listed."""
    rows, carriers = _batch_rows(gm, sig)
    if not rows:
        return []
    from_batch = set(carriers)
    for n in gm.graph.nodes:
        if _forward(n) and any(a in from_batch for a in n.all_input_nodes):
            from_batch.add(n)
    out_node = gm.graph.find_nodes(op="output")[0]
    results = [a for a, (role, _) in zip(out_node.args[0], sig.outputs)
               if role in (Role.LOSS, Role.ACT) and isinstance(a, torch.fx.Node)]
    feeds, todo = set(), list(results)
    while todo:                                             # what the loss and a stage's outputs read
        a = todo.pop()
        if a not in feeds:
            feeds.add(a)
            todo += a.all_input_nodes
    dims = batch_dims(gm, sig)
    found = []
    for n in gm.graph.nodes:
        if not (_forward(n) and n in from_batch and n in feeds):
            continue
        if n.target in _CONTRACTIONS:
            over_batch = _contracts_batch(n, dims)
        elif _packet(n) in _REDUCTIONS:
            over_batch = _reduces_batch(n, rows, from_batch, dims)
        else:
            continue
        if over_batch and _meets_rows(n, rows, feeds, from_batch):
            found.append((n, M.get(n, M.MODULE, "")))
    return found


def _reduces_batch(n, rows: int, from_batch: set, dims: dict) -> bool:
    """Whether reduction ``n`` reduces over the batch: dim 0 of a tensor with the batch's rows, or the dim that
    carries the batch after a transpose (``x.T.sum(1)``)."""
    src = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
    if src is None or src not in from_batch:
        return False
    ndim = len(_shape(src) or ())
    if not ndim:
        return False
    reduced = _reduced_dims(n)
    reduced = range(ndim) if reduced is None else [d % ndim for d in reduced]
    return (_has_rows(src, rows) and 0 in reduced) or dims.get(src, -1) in reduced


def _how(n) -> str:
    """How a noted node reduces over the batch, for the plan note."""
    if n.target in _CONTRACTIONS:
        return "contracting the batch dimension"
    dims = _reduced_dims(n)
    return "over dim 0" if dims is None or 0 in dims else "over the batch dimension"


def _meets_rows(red, rows: int, feeds: set, from_batch: set) -> bool:
    """Whether ``red``'s value, followed through forward users toward the loss, is combined with a tensor that
    has the batch's rows and does not come from ``red`` (a per-row computation reads the statistic)."""
    after, todo = set(), [red]
    while todo:
        u = todo.pop()
        if u not in after:
            after.add(u)
            todo += [w for w in u.users if w in feeds and _forward(w)]
    return any(u is not red and _has_rows(u, rows) and any(a not in after and a in from_batch and _has_rows(a, rows)
                                                           for a in u.all_input_nodes) for u in after)


def batch_notes(captured: list, plan, module_types: dict | None = None, model_name: str = "the model") -> list:
    """Plan notes for what the step's pieces compute over their own rows only: BatchNorm in training mode and
    batch-wide statistics, when the global batch runs as more than one piece (``dp * microbatches > 1``)."""
    dp, microbatches, global_batch = plan.dp, plan.microbatches, plan.global_batch
    pieces = dp * microbatches
    if pieces <= 1:
        return []
    rows = global_batch // pieces
    where = (f"each of the {pieces} pieces of the step (dp={dp} shard(s) x {microbatches} microbatch(es), "
             f"{rows} row(s) each)")
    notes = []
    bns = [x for cap in captured for x in batch_norm_nodes(cap.gm, module_types)]
    if bns:
        mods = sorted({m or "(top level)" for _, m, _ in bns})
        running = sorted({m or "(top level)" for _, m, r in bns if r})
        text = (f"BatchNorm: {model_name}'s {', '.join(repr(m) for m in mods)} normalise with the statistics of "
                f"{where}, not of the global batch of {global_batch} rows, as torch's gradient accumulation and DDP "
                "do (one process on the whole batch would differ)")
        if running:
            text += (f"; running statistics are updated {microbatches} time(s) per step (once per microbatch, "
                     f"num_batches_tracked +{microbatches} per step)"
                     + ("" if dp == 1 else ", on each dp rank from its own rows; state_dict() holds dp-rank 0's"))
        notes.append(text + ". docs/semantics.md 'BatchNorm'")
    reds = [x for cap in captured for x in batch_reductions(cap.gm, cap.signature)]
    if reds:
        what = "; ".join(f"node {n.name} ({_packet(n).__name__} "
                         f"{_how(n)}, "
                         f"{f'module {m!r}' if m else 'top level'})" for n, m in reds[:4]) + \
            ("; ..." if len(reds) > 4 else "")
        notes.append(f"batch-wide statistic: {model_name}'s forward reduces over the batch dimension and uses the "
                     f"result per row ({what}): it is computed over {where}, not over the global batch of "
                     f"{global_batch} rows, so training differs from one process. Compute it outside the model "
                     "(over the whole batch, passed in as an input), or run with dp=1 and microbatches=1; "
                     "docs/semantics.md 'Batch-wide statistics'")
    return notes
