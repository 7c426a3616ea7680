"""Small single-process references of the asynchronous schedules' math (DESIGN §5: a strategy that
changes the math on purpose must give exactly the math its paper defines).

PipeDream with weight stashing (Harlap, Narayanan et al. SOSP'19): microbatch i runs its forward and
backward on stage s with version ``v(s, i) = max(0, i - (p - s - 1))`` of that stage's weights (the
number of updates stage s made before the microbatch reached it, in 1F1B order); after microbatch k's
backward, stage s updates once with that microbatch's gradient: ``W_s^{k+1} = step(W_s^k, g_s^k)``.

PipeDream-2BW (Narayanan et al. ICML'21): batch b's gradient (m microbatches accumulated) is computed
with ``W^{max(b-1, 0)}`` on every stage, and ``W^{b+1} = step(W^b, g^b)``.

Pipelined Backpropagation (Kosson et al. MLSys'21) and PipeMare (Yang et al. MLSys'21), without weight stashing:
microbatch i's forward on stage s computes with ``W_s^{max(0, i - D_s)}`` (``D_s = p - s - 1``) and its backward
differentiates through ``W_s^i``, the stage's weights when the backward runs: every tensor autograd saves that is a
weight (or a view of one) is swapped for the same view of the backward's weights, the rest (activations) stay the
forward's. Then ``W_s^{i+1} = step(W_s^i, g_s^i)``, with the corrections written out as fxpar reads the papers
(:func:`delayed_pipeline_reference`).

All take the stage partition (``[program.stages[s].param_keys for s]``) and an optimizer
``(cls, kwargs)``; each stage's parameters advance with torch's own optimizer, the state per parameter.
Each is one run that never stops over every batch it is given: a run saved after batch b and resumed is checked
against the run over all the batches (the checkpoint carries the versions the microbatches after b read).
"""
from __future__ import annotations

import copy

import torch

__all__ = ["pipedream_reference", "pipedream_2bw_reference", "delayed_pipeline_reference"]


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


def _microbatches(batches, microbatches: int, dp: int) -> list:
    """Update i's rows: microbatch i of every dp replica (replica d's share of a batch is its d-th slice)."""
    return [tuple(torch.cat([t.chunk(dp)[d].chunk(microbatches)[j] for d in range(dp)]) for t in b)
            for b in batches for j in range(microbatches)]


def _weights_swapped_at_backward(forward: dict, backward: dict):
    """Saved-tensor hooks: a tensor autograd saves that lives in a weight of ``forward`` comes back as the same view
    of ``backward``'s weight under that key; every other saved tensor comes back as it was saved."""
    by_ptr = {t.untyped_storage().data_ptr(): k for k, t in forward.items()}

    def pack(t):
        k = by_ptr.get(t.untyped_storage().data_ptr())
        if k is None:
            return t
        return (k, t.size(), t.stride(), t.storage_offset() - forward[k].storage_offset())

    def unpack(x):
        if isinstance(x, torch.Tensor):
            return x
        k, size, stride, offset = x
        w = backward[k]
        return w.as_strided(size, stride, w.storage_offset() + offset)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def delayed_pipeline_reference(model, stage_keys: list, batches: list, loss_fn, optimizer, microbatches: int,
                               schedule: str = "pipelined_bp", correction: str | None = None, lr_warmup: int = 0,
                               discrepancy_correction: bool = False, dp: int = 1):
    """Losses per batch (mean of its microbatches) and the final state dict of Pipelined Backpropagation
    (``schedule="pipelined_bp"``, ``correction`` None, "sc", "lwp" or "sc+lwp") or PipeMare (``"pipemare"``,
    ``lr_warmup``, ``discrepancy_correction``): one update per microbatch on every stage, stage s's gradient
    ``D_s = p - s - 1`` updates late. Written from fxpar's reading of the papers, whose method sections could not be
    checked (docs/strategies/pipelines.md, "Checked against the papers"), for SGD with momentum m, learning rate lr,
    gradient g (weight decay included), momentum buffer v:

    * spike compensation (Kosson et al.): ``v' = m v + g``, ``w' = w - lr (m^D v' + (1 - m^D)/(1 - m) g)``;
    * linear weight prediction (Kosson et al.): the forward computes with ``w - lr D v``;
    * PipeMare's learning rate (Yang et al., technique 1): ``lr_k = lr max(D, 1)^-(1 - min(k/K, 1))`` at update k;
    * PipeMare's discrepancy correction (technique 2): ``delta' = gamma delta + (1 - gamma)(w' - w)``,
      ``gamma = 0.1^(1/D)``, the backward on ``w - D delta``.

    Without spike compensation each update is the torch optimizer's own step at that learning rate."""
    m, params, buffers, opt = _setup(model, optimizer)
    p = len(stage_keys)
    delays = [p - s - 1 for s in range(p)]
    sc, lwp = "sc" in (correction or ""), "lwp" in (correction or "")
    kw = optimizer[1]
    mom, wd = kw.get("momentum", 0.0), kw.get("weight_decay", 0.0)
    base_lr = [g["lr"] for g in opt.param_groups]
    W = [[{k: params[k].detach().clone() for k in keys}] for keys in stage_keys]       # W[s][v]: version v
    V = [[{k: torch.zeros_like(w) for k, w in W[s][0].items()}] for s in range(p)]    # momentum buffer per version
    delta = [{k: torch.zeros_like(w) for k, w in W[s][0].items()} for s in range(p)]
    micro = _microbatches(batches, microbatches, dp)
    losses = [0.0] * len(batches)
    for i, mb in enumerate(micro):
        fwd, bwd = {}, {}
        for s in range(p):
            D, v = delays[s], max(0, i - delays[s])
            for k, w in W[s][v].items():
                w = w - (base_lr[0] * D) * V[s][v][k] if lwp and D else w.clone()
                fwd[k] = w.requires_grad_(True)
            for k, w in W[s][i].items():
                bwd[k] = w - D * delta[s][k] if discrepancy_correction and D else w
        with _weights_swapped_at_backward(fwd, bwd):
            loss = _loss(m, fwd, buffers, mb, loss_fn)
        losses[i // microbatches] += float(loss.detach()) / microbatches
        g = dict(zip(fwd, torch.autograd.grad(loss, list(fwd.values()))))
        for s, keys in enumerate(stage_keys):
            D, w0 = delays[s], W[s][i]
            factor = float(max(D, 1)) ** -(1.0 - min(i / lr_warmup, 1.0)) if lr_warmup else 1.0
            for group, base in zip(opt.param_groups, base_lr):
                group["lr"] = base * factor
            lr = opt.param_groups[0]["lr"]
            if sc:
                a = mom ** D
                b = (1.0 - a) / (1.0 - mom)
                gw = {k: g[k] + wd * w0[k] for k in keys}
                v1 = {k: mom * V[s][i][k] + gw[k] for k in keys}
                w1 = {k: w0[k] - lr * (a * v1[k] + b * gw[k]) for k in keys}
            else:
                w1 = _step(opt, params, set(keys), w0, g)
                v1 = {k: opt.state[params[k]]["momentum_buffer"].clone() if mom else torch.zeros_like(w0[k])
                      for k in keys}
            if discrepancy_correction and D:
                gamma = 0.1 ** (1.0 / D)
                delta[s] = {k: gamma * delta[s][k] + (1.0 - gamma) * (w1[k] - w0[k]) for k in keys}
            W[s].append(w1)
            V[s].append(v1)
    state = {k: v for vs in W for k, v in vs[-1].items()}
    return losses, _state(m, state)


def _state(m, weights: dict) -> dict:
    sd = m.state_dict()
    names = {id(p): k for k, p in m.named_parameters()}
    out = {}
    for k, v in sd.items():
        out[k] = weights.get(k, v)
    for k, p in m.named_parameters(remove_duplicate=False):
        out[k] = weights[names[id(p)]]
    return out
