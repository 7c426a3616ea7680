"""Loss semantics across data-parallel shards and microbatches (``docs/semantics.md``).

A step trains on one global batch, cut into dp shards of m microbatches each. Two ways to make one
loss (and one update) of the m·dp pieces, chosen by ``Strategy(loss_average=...)``:

``"global"``   the loss and update single-process training computes on the whole global batch. A loss
               that is a mean over *counted* elements -- cross-entropy / NLL with ``ignore_index``,
               class ``weight``, ``label_smoothing``, probability targets -- is, per microbatch, its
               SUM over its counted elements divided by the global batch's count N (token-count
               normalisation). Uneven ``ignore_index`` spread changes nothing. ``reduction="sum"``:
               the global sum.
``"per_shard"`` each microbatch's loss as ``loss_fn`` computes it, averaged over the m·dp microbatches:
               torch DDP's semantics (each rank's mean, gradients averaged). It equals ``"global"``
               when every microbatch counts as many elements; under ``reduction="sum"`` it is 1/(m·dp)
               of the global sum.
``"auto"``     (default) ``"global"`` where fxpar can see the loss, else ``"per_shard"``, with a plan note.

fxpar sees the loss when ``loss_fn`` is ``torch.nn.functional.cross_entropy`` or ``nll_loss``, a
``functools.partial`` of one, or an ``nn.CrossEntropyLoss`` / ``nn.NLLLoss``. How ``"global"`` runs:
the traced loss of a microbatch is ``S_mb · (m·dp) / N``, where ``S_mb`` is ``loss_fn`` with
``reduction="sum"`` and N arrives as one more target column (float64, every row N) that the program
fills from the global batch's target before each step (every rank sees the global batch). The
runtime's mean over the m·dp microbatches (backward seeded with 1/(m·dp), gradients summed) then
gives exactly ``sum(S_mb) / N`` and its gradient: no change to the runtime or the passes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import CaptureError, InputError, StrategyError

__all__ = ["LOSS_AVERAGES", "VisibleLoss", "LossChoice", "see_loss", "choose_loss"]

LOSS_AVERAGES = ("auto", "global", "per_shard")
_KINDS = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss"}
_MODULES = {torch.nn.CrossEntropyLoss: "cross_entropy", torch.nn.NLLLoss: "nll_loss"}


@dataclass
class VisibleLoss:
    """A loss fxpar can see into: what it computes and which elements count."""
    kind: str                      # "cross_entropy" | "nll_loss"
    reduction: str                 # "mean" | "sum"
    ignore_index: int = -100
    weight: torch.Tensor | None = None
    label_smoothing: float = 0.0
    name: str = ""                 # how the user wrote it, for messages

    def __post_init__(self):
        self._weight_values = None if self.weight is None else self.weight.detach().cpu().tolist()

    def __call__(self, out, target, reduction: str | None = None):
        weight = None
        if self.weight is not None:    # made inside the trace from plain numbers: a graph constant (fake mode
            weight = torch.tensor(self._weight_values, dtype=self.weight.dtype)     # refuses a real tensor)
        kw = {"weight": weight, "ignore_index": self.ignore_index, "reduction": reduction or self.reduction}
        if self.kind == "cross_entropy":
            return F.cross_entropy(out, target, label_smoothing=self.label_smoothing, **kw)
        return F.nll_loss(out, target, **kw)

    def check_target(self, out, target) -> None:
        """At capture: the target's dtype and shape against the model output (fake tensors: no values)."""
        if target.is_floating_point():
            if self.kind == "cross_entropy" and tuple(target.shape) == tuple(out.shape):
                return                                    # class probabilities
            raise CaptureError(
                f"the target of {self.name} is {_dtype(target)} with shape {tuple(target.shape)}, but the model's "
                f"output has shape {tuple(out.shape)}: {self.kind} takes class indices as int64 (shape "
                f"{tuple(out.shape[:1]) + tuple(out.shape[2:])}) -- pass target.long() --"
                + (" or class probabilities of the output's shape." if self.kind == "cross_entropy" else "."))
        if target.dtype not in (torch.int64, torch.uint8):
            raise CaptureError(f"the target of {self.name} is {_dtype(target)}; {self.kind} takes class indices as "
                               "int64: pass target.long().")

    def count(self, target: torch.Tensor) -> float:
        """N: how many elements of ``target`` count in a mean (the weight of the counted ones, with ``weight``)."""
        if self.reduction == "sum":
            return 1.0
        if target.is_floating_point():                  # probabilities: every position counts once
            return float(target.numel() // target.shape[1]) if target.dim() >= 2 else 1.0
        valid = target != self.ignore_index
        if self.weight is not None:
            return float(self.weight.double()[target[valid]].sum())
        return float(valid.sum())

    def check_classes(self, target: torch.Tensor, n_classes: int | None, where: str) -> None:
        """Before a run: class indices in [0, n_classes) or ignore_index (torch would fail inside a rank)."""
        if n_classes is None or target.is_floating_point():
            return
        valid = target != self.ignore_index
        bad = valid & ((target < 0) | (target >= n_classes))
        if bool(bad.any()):
            pos = tuple(int(i) for i in bad.nonzero()[0])
            raise InputError(f"{where}: class index {int(target[pos])} at position {pos} is outside [0, {n_classes}) "
                             f"(the model's output has {n_classes} classes on dim 1): use class indices in [0, "
                             f"{n_classes}), or ignore_index={self.ignore_index} for positions that should not count.")


def see_loss(loss_fn) -> VisibleLoss | None:
    """The loss fxpar can see into, or None (any other callable, or options it does not model)."""
    fn, kw = loss_fn, {}
    if isinstance(fn, functools.partial) and not fn.args:
        fn, kw = fn.func, dict(fn.keywords)
    if isinstance(fn, tuple(_MODULES)):
        kind = _MODULES[type(fn)]
        kw = {"weight": fn.weight, "ignore_index": fn.ignore_index, "reduction": fn.reduction,
              **({"label_smoothing": fn.label_smoothing} if kind == "cross_entropy" else {})}
    elif fn in _KINDS:
        kind = _KINDS[fn]
    else:
        return None
    if set(kw) - {"weight", "ignore_index", "reduction", "label_smoothing"} or \
            kw.get("reduction", "mean") not in ("mean", "sum"):
        return None
    return VisibleLoss(kind, kw.get("reduction", "mean"), kw.get("ignore_index", -100), kw.get("weight"),
                       kw.get("label_smoothing", 0.0), name=_name(loss_fn))


class _CheckedLoss:
    """The loss as written (what ``loss_fn`` computes), with the target checked against the output at capture."""
    fxpar_n_targets = 1

    def __init__(self, visible: VisibleLoss, loss_fn):
        self.visible, self.loss_fn, self.n_classes = visible, loss_fn, None

    def __call__(self, out, target):
        self.visible.check_target(out, target)
        self.n_classes = int(out.shape[1]) if out.dim() >= 2 else None
        return self.visible(out, target)


class _GlobalBatchLoss(_CheckedLoss):
    """A microbatch's share of the global-batch loss: ``S_mb · k / N`` with k = m·dp, N the global count."""
    fxpar_n_targets = 2

    def __init__(self, visible: VisibleLoss, loss_fn, k: int):
        super().__init__(visible, loss_fn)
        self.k = k

    def __call__(self, out, target, count):
        self.visible.check_target(out, target)
        self.n_classes = int(out.shape[1]) if out.dim() >= 2 else None
        s = self.visible(out, target, reduction="sum")
        return s * self.k / count[0].to(s.dtype)


@dataclass
class LossChoice:
    """What the program does with the loss: the semantics, the callable it traces, and what the runtime adds."""
    mode: str                        # "global" | "per_shard"
    fn: object                       # the loss callable the capture traces
    visible: VisibleLoss | None
    counted: bool                    # the runtime appends the global count N as a target column
    note: str = ""

    @property
    def n_classes(self):
        """Classes on the model output's dim 1, as the capture saw them (None before capture)."""
        return getattr(self.fn, "n_classes", None) if self.fn is not None else self.__dict__.get("_n_classes")

    def __getstate__(self):            # the traced callable (maybe the user's lambda) is not needed after capture
        return {**self.__dict__, "fn": None, "_n_classes": self.n_classes}

    def extra_columns(self, flat: tuple, n_inputs: int, where: str) -> tuple:
        """What the program appends to a flat global batch before a step (checks the target's classes first;
        ``where`` names the target, e.g. ``batches[3][1] (the target)``)."""
        if self.visible is None or len(flat) <= n_inputs:
            return ()
        target = flat[n_inputs]
        if target.is_meta:          # example inputs on the meta device: shapes to plan with, no values to check or
            # count; the count column of a real batch is computed from its values before each step
            return (torch.empty((target.shape[0],), dtype=torch.float64, device="meta"),) if self.counted else ()
        self.visible.check_classes(target, self.n_classes, where)
        if not self.counted:
            return ()
        return (torch.full((target.shape[0],), self.visible.count(target), dtype=torch.float64),)


def choose_loss(loss_average: str, loss_fn, *, asynchronous: bool, k: int) -> LossChoice:
    """Decide the loss semantics (``k`` = dp · microbatches, the pieces a step's global batch is cut into)."""
    visible = see_loss(loss_fn) if loss_fn is not None else None
    seen = ("fxpar cannot see into loss_fn=None (the model computes its own loss)" if loss_fn is None else
            f"fxpar cannot see into loss_fn={_name(loss_fn)} (it sees torch.nn.functional.cross_entropy / nll_loss, "
            "a functools.partial of one, nn.CrossEntropyLoss and nn.NLLLoss)")
    if loss_average == "global":
        if visible is None:
            raise StrategyError(
                f"Strategy(loss_average='global'): {seen}, so it cannot count the elements each shard's loss "
                "averages over. Pass loss_fn=torch.nn.functional.cross_entropy (or nn.CrossEntropyLoss(ignore_index="
                "...)) on outputs shaped (N, C) or (N, C, d...), or use loss_average='per_shard' (each shard's loss "
                "averaged, as torch DDP).")
        if asynchronous:
            raise StrategyError("Strategy(loss_average='global'): an asynchronous schedule (pipedream, 2bw) updates "
                                "the weights once per microbatch, so there is no global batch to normalise over. Use "
                                "loss_average='per_shard', or a synchronous schedule.")
    if loss_average == "per_shard" or visible is None or asynchronous:
        why = ("asked for (Strategy(loss_average='per_shard'))" if loss_average == "per_shard" else
               "the asynchronous schedule updates per microbatch" if asynchronous and visible is not None else seen)
        note = "" if k == 1 else (f"loss: the mean of the {k} microbatch losses (per_shard, as torch DDP): {why}. It "
                                  "equals single-process training only when every microbatch counts as many "
                                  "elements (see docs/semantics.md)")
        fn = _CheckedLoss(visible, loss_fn) if visible is not None else loss_fn
        return LossChoice("per_shard", fn, visible, counted=False, note=note)
    if k == 1:
        return LossChoice("global", _CheckedLoss(visible, loss_fn), visible, counted=False)
    what = "sum" if visible.reduction == "sum" else "mean over the counted elements"
    note = (f"loss: global-batch {what} of {visible.name} (each of the {k} microbatches adds its sum"
            + (", divided by the global batch's count of targets != ignore_index" if visible.reduction == "mean"
               else "") + "): single-process training's loss and update; loss_average='per_shard' for DDP's")
    return LossChoice("global", _GlobalBatchLoss(visible, loss_fn, k), visible, counted=True, note=note)


def _name(fn) -> str:
    if isinstance(fn, functools.partial):
        return f"partial({_name(fn.func)}, {', '.join(f'{k}={v!r}' for k, v in fn.keywords.items())})"
    if isinstance(fn, torch.nn.Module):
        return repr(fn)
    mod = getattr(fn, "__module__", "") or ""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{mod}.{name}" if mod.startswith("torch") else name


def _dtype(t) -> str:
    return str(t.dtype).replace("torch.", "")
