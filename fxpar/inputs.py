"""Checks of what a user hands ``run_local`` and ``runner().step``: every global batch against
``example_inputs`` (structure, shapes, dtypes, rows that split over dp x microbatches), models without
values, and non-finite losses. Each error names the batch, the tensor and what to do."""
from __future__ import annotations

import torch

from .errors import InputError
from .errors import NonFiniteLossError

__all__ = ["check_tensor", "batch_list", "check_materialized", "prepare_batch", "check_nonfinite"]


def check_tensor(t: torch.Tensor, shape: tuple, dtype, name: str, dp: int, m: int) -> None:
    """One tensor of a global batch against its example: the step is compiled for that shape and dtype."""
    if t.dtype != dtype:
        want = str(dtype).replace("torch.", "")
        raise InputError(f"{name} is {str(t.dtype).replace('torch.', '')}, but example_inputs had {want} there: the "
                         f"step is compiled for {want}; convert it with .to(torch.{want}).")
    if t.device.type == "meta":
        raise InputError(f"{name} is on the meta device (no values): pass real tensors to run_local.")
    if tuple(t.shape) == shape:
        return
    if t.dim() == len(shape) and tuple(t.shape[1:]) == shape[1:]:
        split = f" (it must also split evenly over dp={dp} x microbatches={m})" if t.shape[0] % (dp * m) else ""
        raise InputError(f"{name} has {t.shape[0]} rows (shape {tuple(t.shape)}), but the program was compiled for "
                         f"global batches of {shape[0]} rows (example_inputs){split}. Pass batches of {shape[0]} "
                         f"rows (drop or pad a short last batch), or build a program from an example of "
                         f"{t.shape[0]} rows.")
    dims = [d for d in range(min(t.dim(), len(shape))) if t.shape[d] != shape[d]]
    where = f" (dim {dims[0]} differs)" if t.dim() == len(shape) and dims else ""
    raise InputError(f"{name} has shape {tuple(t.shape)}, but example_inputs had {shape}{where}: the step is "
                     "compiled for one shape; give every batch the shapes of example_inputs (pad sequences to one "
                     "length), or build a program from an example of this shape.")


def batch_list(batches, layout) -> list:
    """``run_local``'s batches as a non-empty list of global batches (one per step)."""
    if isinstance(batches, (torch.Tensor, dict)) or (
            isinstance(batches, (tuple, list)) and batches and all(isinstance(b, torch.Tensor) for b in batches)
            and layout is not None and layout.form != "tensor"):
        raise InputError(f"run_local(batches) takes a list of global batches, and got one batch ("
                         f"{type(batches).__name__} of {len(batches)} tensor(s)): pass run_local([batch]), or "
                         "a list with one batch per step.")
    try:
        batches = list(batches)
    except TypeError:
        raise InputError(f"run_local(batches={type(batches).__name__}): pass a list of global batches, each like "
                         "example_inputs.") from None
    if not batches:
        raise InputError("run_local(batches=[]): there is no batch to train on. Pass a list of global batches, "
                         "one per step, each shaped like example_inputs (e.g. [(x, y), (x2, y2)]).")
    return batches


def check_materialized(model_name: str, params: dict, buffers: dict, what: str) -> None:
    """Refuse a model without values (built on the ``meta`` device): it plans and explains, it cannot train."""
    for kind, tensors in (("parameter", params), ("buffer", buffers)):
        for k, v in tensors.items():
            if v.device.type == "meta":
                raise InputError(
                    f"{what}: {model_name}'s {kind} '{k}' is on the meta device (a shape, no values): a meta "
                    "model can be planned, explained and estimated, not trained. Materialize it first -- "
                    "model.to_empty(device='cpu'), then initialise it or load_state_dict(...) -- and call "
                    "fxpar.parallelize again with it.")


def prepare_batch(prog, batch, where: str) -> tuple:
    """A global batch as the flat tuple the ranks take, checked against example_inputs; with the loss's
    extra columns (the global count of counted targets, docs/semantics.md)."""
    layout = prog.layout
    flat = layout.flatten(batch, where)
    if prog._example is not None:
        if len(flat) != len(prog._example):
            raise InputError(f"{where} has {len(flat)} tensors, but example_inputs had {len(prog._example)}: give "
                             "every batch the structure of example_inputs.")
        for j, (t, (shape, dtype)) in enumerate(zip(flat, prog._example)):
            check_tensor(t, shape, dtype, layout.describe(j, where), prog.dp, prog.plan.microbatches)
    extra = () if prog.loss is None else \
        prog.loss.extra_columns(flat, prog.n_inputs, layout.describe(prog.n_inputs, where))
    return flat + extra


def check_nonfinite(res, mode: str) -> None:
    """``run_local(on_nonfinite=...)``: warn about, raise on, or ignore a NaN/inf loss, naming the step and ranks."""
    if mode == "ignore":
        return
    import math
    bad = [i for i, v in enumerate(res.losses) if not math.isfinite(v)]
    if not bad:
        return
    i = bad[0]
    ranks = [r for r, sums in res.per_rank_losses.items() if i < len(sums) and not math.isfinite(sums[i])]
    more = f" (and {len(bad) - 1} later step(s): {bad[1:6]}{'...' if len(bad) > 6 else ''})" if len(bad) > 1 else ""
    text = (f"step {i} (batches[{i}]): the loss is {res.losses[i]} on rank(s) {ranks or 'every last-stage rank'}"
            f"{more}. Later steps train from the weights that step wrote. Check batches[{i}] for NaN/inf, lower "
            "the learning rate, or clip gradients; run_local(on_nonfinite='raise') stops with an error, 'ignore' "
            "says nothing.")
    if mode == "raise":
        raise NonFiniteLossError("run_local(on_nonfinite='raise'): " + text, i, ranks)
    import warnings
    warnings.warn(text, RuntimeWarning, stacklevel=3)
