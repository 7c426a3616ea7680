"""Small single-process references of the asynchronous schedules' math (DESIGN §5: a strategy that
changes the math on purpose must give exactly the math its paper defines).

PipeDream with weight stashing (Harlap, Narayanan et al. SOSP'19): microbatch i runs its forward and
backward on stage s with version ``v(s, i) = max(0, i - (p - s - 1))`` of that stage's weights (the
number of updates stage s made before the microbatch reached it, in 1F1B order); after microbatch k's
backward, stage s updates once with that microbatch's gradient: ``W_s^{k+1} = step(W_s^k, g_s^k)``.

PipeDream-2BW (Narayanan et al. ICML'21): batch b's gradient (m microbatches accumulated) is computed
with ``W^{max(b-1, 0)}`` on every stage, and ``W^{b+1} = step(W^b, g^b)``.

Both take the stage partition (``[program.stages[s].param_keys for s]``) and an optimizer
``(cls, kwargs)``; each stage's parameters advance with torch's own optimizer, the state per parameter.
"""
from __future__ import annotations

import copy

import torch

__all__ = ["pipedream_reference", "pipedream_2bw_reference"]


def _setup(model, optimizer):
    m = copy.deepcopy(model)
    params = dict(m.named_parameters())
    buffers = dict(m.named_buffers())
    cls, kw = optimizer
    return m, params, buffers, cls(list(params.values()), **kw)


def _loss(m, weights, buffers, batch, loss_fn):
    out = torch.func.functional_call(m, ({**weights, **buffers}), tuple(batch[:-1]) if loss_fn else tuple(batch))
    return loss_fn(out, batch[-1]) if loss_fn else out


def _step(opt, params, keys, start: dict, grads: dict) -> dict:
    """One optimizer update of ``keys`` from weights ``start`` with ``grads``; returns the new weights."""
    with torch.no_grad():
        for k, p in params.items():
            p.grad = None
            if k in keys:
                p.copy_(start[k])
                p.grad = grads[k].clone()
    opt.step()
    return {k: params[k].detach().clone() for k in keys}


def pipedream_reference(model, stage_keys: list, batches: list, loss_fn, optimizer, microbatches: int, dp: int = 1):
    """Losses per batch (mean of its microbatches) and the final state dict under PipeDream's math.

    With ``dp`` replicas, update i averages microbatch i of every replica: replica d's microbatch i is
    rows ``d*n + i*b .. d*n + (i+1)*b`` of the batch (n = batch/dp, b = n/microbatches)."""
    m, params, buffers, opt = _setup(model, optimizer)
    p = len(stage_keys)
    versions = [[{k: params[k].detach().clone() for k in keys}] for keys in stage_keys]
    micro = [tuple(torch.cat([t.chunk(dp)[d].chunk(microbatches)[j] for d in range(dp)]) for t in b)
             for b in batches for j in range(microbatches)]
    losses = [0.0] * len(batches)
    for i, mb in enumerate(micro):
        weights = {}
        for s in range(p):
            weights.update({k: v.clone().requires_grad_(True) for k, v in versions[s][max(0, i - (p - s - 1))].items()})
        loss = _loss(m, weights, buffers, mb, loss_fn)
        losses[i // microbatches] += float(loss.detach()) / microbatches
        g = dict(zip(weights, torch.autograd.grad(loss, list(weights.values()))))
        for s, keys in enumerate(stage_keys):
            versions[s].append(_step(opt, params, set(keys), versions[s][-1], g))
    state = {k: v for vs in versions for k, v in vs[-1].items()}
    return losses, _state(m, state)


def pipedream_2bw_reference(model, batches: list, loss_fn, optimizer):
    """Losses per batch and the final state dict under PipeDream-2BW's W(b+1) = step(W(b), grad f(W(b-1)))."""
    m, params, buffers, opt = _setup(model, optimizer)
    keys = set(params)
    W = [{k: v.detach().clone() for k, v in params.items()}]
    losses = []
    for b, batch in enumerate(batches):
        weights = {k: v.clone().requires_grad_(True) for k, v in W[max(b - 1, 0)].items()}
        loss = _loss(m, weights, buffers, batch, loss_fn)
        losses.append(float(loss.detach()))
        g = dict(zip(weights, torch.autograd.grad(loss, list(weights.values()))))
        W.append(_step(opt, params, keys, W[b], g))
    return losses, _state(m, W[-1])


def _state(m, weights: dict) -> dict:
    sd = m.state_dict()
    names = {id(p): k for k, p in m.named_parameters()}
    out = {}
    for k, v in sd.items():
        out[k] = weights.get(k, v)
    for k, p in m.named_parameters(remove_duplicate=False):
        out[k] = weights[names[id(p)]]
    return out
