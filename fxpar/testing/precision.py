"""Single-process references for mixed-precision training (``Strategy(precision=...)``).

:func:`mixed_precision_reference` is fxpar's own math written in eager torch: the model's parameters, buffers and
floating batch tensors cast to the compute dtype, forward, loss and backward there, each gradient cast back to the
master dtype (summed there over the step's pieces: dp shards and microbatches), the optimizer on the master
parameters -- what torch FSDP's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` computes per rank.
With ``scaler``, fp16's dynamic loss scale follows torch.amp.GradScaler's rule, driven by a real ``GradScaler``.
:func:`autocast_reference` is ``torch.autocast`` over the float32 model with float32 gradients and update (with
``scaler``, a ``torch.amp.GradScaler`` around it): a different rule (autocast keeps some ops in float32), compared
at a looser tolerance.
"""
from __future__ import annotations

import copy

import torch

__all__ = ["mixed_precision_reference", "autocast_reference"]


def _cast(x, dtype):
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _untie(low: torch.nn.Module) -> None:
    """Each use of a tied parameter gets its own copy: its gradient is cast to the master dtype apart from the
    others' (a pipeline's stages each hold one use and sum them across ranks in the master dtype)."""
    seen = set()
    for mod in low.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and id(p) in seen:
                mod._parameters[name] = torch.nn.Parameter(p.detach().clone())
            elif p is not None:
                seen.add(id(p))


def mixed_precision_reference(model, batches, loss_fn, optimizer, compute=torch.bfloat16, pieces: int = 1,
                              scaler: dict | None = None, untie: bool = False):
    """Train a copy of ``model`` (the masters) on each global batch, cut into ``pieces`` equal pieces along dim 0,
    each seeded with ``1/pieces`` (the mean over pieces). ``untie``: each use of a tied parameter has its own
    compute-dtype gradient, cast and summed in the master dtype (the uses sit on different pipeline stages).
    Returns ``(losses, state_dict, info)``; ``info`` holds the loss scale and skipped steps under ``scaler``
    (GradScaler's keyword arguments)."""
    master = copy.deepcopy(model)
    cls, kw = optimizer
    opt = cls(master.parameters(), **kw)
    gs = torch.amp.GradScaler("cpu", **scaler) if scaler is not None else None
    losses, skipped = [], 0
    for batch in batches:
        opt.zero_grad()
        low = copy.deepcopy(master).to(compute)
        if untie:
            _untie(low)
        owner = dict(master.named_parameters(remove_duplicate=False))
        total = 0.0
        for i in range(pieces):
            piece = [_cast(b.chunk(pieces, 0)[i], compute) for b in batch]
            loss = loss_fn(low(*piece[:-1]), piece[-1])
            seed = torch.full_like(loss, 1.0 / pieces)
            if gs is not None:                # the scale may exceed fp16's range: the product is made in float32
                seed = gs.scale(seed.float()).to(loss.dtype)
            loss.backward(seed)
            total += float(loss.detach().float()) / pieces
            for name, q in low.named_parameters():
                p = owner[name]
                g = q.grad.to(p.dtype)
                p.grad = g if p.grad is None else p.grad + g
                q.grad = None
        losses.append(total)
        if gs is None:
            opt.step()
        else:
            before = gs.get_scale()
            gs.step(opt)
            gs.update()
            skipped += gs.get_scale() < before
    info = {} if gs is None else {"scale": gs.get_scale(), "skipped_steps": skipped}
    return losses, master.state_dict(), info


def autocast_reference(model, batches, loss_fn, optimizer, compute=torch.bfloat16, scaler: dict | None = None):
    """``torch.autocast("cpu", dtype=compute)`` around forward and loss of a float32 copy of ``model``; backward,
    gradients and the update in float32. ``scaler``: a ``torch.amp.GradScaler`` with these keyword arguments scales
    the loss, skips the steps whose gradients are not finite and moves the scale (fp16). Returns
    ``(losses, state_dict, info)``; ``info`` holds the loss scale and skipped steps under ``scaler``."""
    m = copy.deepcopy(model)
    cls, kw = optimizer
    opt = cls(m.parameters(), **kw)
    gs = torch.amp.GradScaler("cpu", **scaler) if scaler is not None else None
    losses, skipped = [], 0
    for batch in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=compute):
            loss = loss_fn(m(*batch[:-1]), batch[-1])
        if gs is None:
            loss.backward()
            opt.step()
        else:
            gs.scale(loss).backward()
            before = gs.get_scale()
            gs.step(opt)
            gs.update()
            skipped += gs.get_scale() < before
        losses.append(float(loss.detach()))
    info = {} if gs is None else {"scale": gs.get_scale(), "skipped_steps": skipped}
    return losses, m.state_dict(), info
