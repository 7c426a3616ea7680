"""What a captured step computes over the batch, where sharding the batch changes it (docs/semantics.md §6-§7).

A step's global batch runs as ``dp x microbatches`` pieces, each on its own rows. Everything that treats rows
one at a time trains exactly as one process does; two kinds of forward computation see only their piece:

* **BatchNorm in training mode** (:func:`batch_norm_nodes`): it normalises with the statistics of the rows the
  forward sees, and updates its running statistics once per forward -- once per microbatch.
* **A batch-wide statistic** (:func:`batch_reductions`): a reduction over the batch dimension (dim 0 of a tensor
  computed from the batch) whose result flows back into per-row computation -- ``x - x.mean(0)``, a
  ``.item()`` of a batch mean dividing the activations -- rather than only into the loss's own reduction.

Both read the captured joint graph: the batch is dim 0 of the batch inputs (and of the activations a pipeline
stage receives); the loss and a stage's outputs are the forward's results. Nothing here changes a graph: the
planner turns what is found into plan notes.
"""
from __future__ import annotations

import torch
import torch.fx

from . import meta as M
from .roles import Role

__all__ = ["batch_norm_nodes", "batch_reductions", "batch_notes"]

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
    found = []
    for n in gm.graph.nodes:
        if not (_forward(n) and _packet(n) in _REDUCTIONS and n in from_batch and n in feeds):
            continue
        src = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        if src is None or src not in from_batch or not _has_rows(src, rows):
            continue
        dims = _reduced_dims(n)
        ndim = src.meta["val"].dim()
        if dims is not None and 0 not in [d % ndim for d in dims]:
            continue
        if _meets_rows(n, rows, feeds, from_batch):
            found.append((n, M.get(n, M.MODULE, "")))
    return found


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
        what = "; ".join(f"node {n.name} ({_packet(n).__name__} over dim 0, module "
                         f"{m!r})" if m else f"node {n.name} ({_packet(n).__name__} over dim 0, top level)"
                         for n, m in reds[:4]) + ("; ..." if len(reds) > 4 else "")
        notes.append(f"batch-wide statistic: {model_name}'s forward reduces over the batch dimension and uses the "
                     f"result per row ({what}): it is computed over {where}, not over the global batch of "
                     f"{global_batch} rows, so training differs from one process. Compute it outside the model "
                     "(over the whole batch, passed in as an input), or run with dp=1 and microbatches=1; "
                     "docs/semantics.md 'Batch-wide statistics'")
    return notes
