"""What a rank saves and restores: its part of the training state, under the model's own keys.

``save_rank_state(executor, path, aliases)`` / ``load_rank_state(executor, path, aliases)`` turn an
:class:`~fxpar.runtime.executor.Executor`'s state into the global-key tensors of
:mod:`fxpar.runtime.checkpoint` and back, so a checkpoint written under one strategy loads under any
other (the keys never name a rank, a stage or a shard):

* parameters (every alias of a tied parameter too, so plain ``dcp.load(model.state_dict())`` finds
  each key) and buffers, under the model's keys;
* optimizer state as ``optim.<state>.<key>`` (traced SGD/Adam/AdamW and eager torch.optim alike), whole: an
  eager optimizer's state of a split parameter is gathered like the parameter and cut again on load;
* the weight versions an asynchronous schedule carries to its next window (``Executor.carried``): the version
  k updates before the newest as ``stash.<key>`` (k = 1: 2BW's W(t-1)) and ``stash<k>.<key>`` (k >= 2: PipeDream's
  and the delayed pipelines' older ones), so a resumed window's first forwards read what they would have read had
  the run not stopped;
* per rank in ``extra`` (:class:`RankExtra`): the RNG states, the default generator's and the rank stream's
  (restored when the world size is the saved one; otherwise each rank is seeded afresh as at the start of a run,
  so replicas do not share a stream: ``fxpar.runtime.groups.seed_rank``), the step count, the LR scheduler's and
  the optimizer's hyper-parameters (learning rate included: a scheduler's state alone does not restore it).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from .groups import group, seed_rank
from .checkpoint import (CheckpointError, load_checkpoint, optim_key, read_manifest, rng_state, save_checkpoint,
                         set_rng_state, split_optim_key, torch_optimizer_state_dict, torch_optimizer_tensors)

__all__ = ["save_rank_state", "load_rank_state", "stash_key", "RankExtra", "torch_optimizer_whole",
           "eager_optimizer_state", "replica_state", "load_replica_state"]

_STASH = "stash."


def stash_key(key: str, back: int) -> str:
    """The checkpoint key of parameter ``key``'s version ``back`` updates before the newest (``back >= 1``)."""
    return _STASH + key if back == 1 else f"stash{back}.{key}"


@dataclass
class RankExtra:
    """One rank's non-tensor state in a checkpoint (its ``extra``), one field each. On disk it is the plain dict of
    these fields (:meth:`to_dict`), so a checkpoint stays readable by any fxpar and by ``torch.load`` alone; a
    field a checkpoint lacks reads as its default (:meth:`from_dict`)."""
    rng: dict = field(default_factory=dict)     # the process's RNG states (fxpar.runtime.checkpoint.rng_state)
    step: int = 0                               # optimizer steps taken
    lr: list = field(default_factory=list)      # the learning rate of each of torch's optimizer's param groups
    optim: dict | None = None                   # an untraced torch.optim's non-tensor state (hyper-parameters)
    scheduler: dict | None = None               # the LR scheduler's state_dict, if the run has one
    features: dict = field(default_factory=dict)    # feature name -> its RankState.save()

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "RankExtra":
        names = {f.name for f in fields(cls)}
        got = cls(**{k: v for k, v in d.items() if k in names})
        got.features = got.features or {}
        return got


def _workers(ex) -> tuple:
    """``(rank, size, process group)`` of the ranks that hold the program's state: the whole world, or, with
    ranks a feature runs beside the workers (CPU summation servers, parameter servers: after the workers, they never
    enter a checkpoint's collectives), the program's group of every worker (``dp``, or the one a feature adds where
    the workers are several pipelines) -- so the checkpoint is the one a run without servers writes."""
    if not dist.is_initialized():
        return 0, 1, None
    n = (1 + max(r for ranks in ex.p.stage_to_rank for r in ranks)) * ex.width
    world = dist.get_world_size()
    if world == n:
        return dist.get_rank(), n, None
    workers = tuple(range(n))
    name = next((nm for nm, ranks in ex.p.groups if tuple(ranks) == workers), None)   # dp, or the workers' own
    if name is None:
        raise RuntimeError(f"rank {ex.rank}: the world has {world} ranks but the program {n} workers, and no group "
                           f"of the program spans the workers {list(workers[:4])}...: a checkpoint is written over "
                           "the ranks that hold state, and only a feature's ranks beside the workers are extra. "
                           f"Launch exactly {n} processes for this program.")
    return dist.get_rank(), n, group(workers, name)   # created by every rank, servers too (Plan.all_groups)


def _refuse_nonfinite(path, got: dict, keys: list, world: int, pg) -> None:
    """Collective: a parameter the checkpoint holds with NaN or inf values refuses the resume on every rank, named
    (training on would only spread it)."""
    bad = next((k for k in keys if got[k].is_floating_point() and not bool(torch.isfinite(got[k]).all())), None)
    error = None if bad is None else (
        f"parameter {bad!r} in the checkpoint {path} holds NaN or inf values "
        f"({int((~torch.isfinite(got[bad])).sum())} of {got[bad].numel()}): the run that saved it had diverged. "
        "Resume from an earlier checkpoint (and lower the learning rate, or clip gradients), or start afresh.")
    if world > 1 and dist.is_initialized():
        errors = [None] * world
        dist.all_gather_object(errors, error, group=pg)
        error = next((e for e in errors if e), None)
    if error:
        raise CheckpointError(error)


def _whole_optimizer_tensors(ex, tensors: dict) -> dict:
    """An untraced optimizer's per-parameter tensors (``optim.<state>.<key>``) laid out like their parameters
    (Adagrad's sum, RMSprop's square average: a piece of a split parameter's), made whole as the features make the
    parameters whole. Collective where a feature's ``whole`` is."""
    if not ex.features:
        return tensors
    held = {k: (s, ex.params[s][k]) for s, k in ex._leaves}
    for name in sorted({split_optim_key(k)[0] for k in tensors if split_optim_key(k) is not None}):
        like: dict = {}
        for k, (s, p) in held.items():
            t = tensors.get(optim_key(name, k))
            if t is not None and t.dim() > 0 and t.shape == p.shape:
                like.setdefault(s, {})[k] = t
        for st in ex.features.values():
            like, _ = st.whole(ex, like, {})
        for ps in like.values():
            tensors.update({optim_key(name, k): v for k, v in ps.items()})
    return tensors


def torch_optimizer_whole(ex) -> tuple[dict, dict]:
    """An untraced optimizer's state on this rank as :func:`~fxpar.runtime.checkpoint.torch_optimizer_tensors`
    splits it, ``(tensors, rest)``, each tensor shaped like its parameter made whole as the parameter is.
    Collective where a feature's ``whole`` is."""
    tensors, rest = torch_optimizer_tensors(ex.torch_opt.state_dict(), [k for _, k in ex._leaves])
    return _whole_optimizer_tensors(ex, tensors), rest


def eager_optimizer_state(ex) -> dict:
    """An untraced optimizer's per-parameter state under ``<state>:<key>`` (``"sum:fc1.weight"``), as the traced
    optimizers' is: tensors whole (a split parameter's state gathered like the parameter), other values as torch's
    optimizer holds them. Collective where a feature's ``whole`` is."""
    tensors, rest = torch_optimizer_whole(ex)
    out = {}
    for ok, v in tensors.items():
        name, key = split_optim_key(ok)
        out[f"{name}:{key}"] = v
    for key, scalars in rest["scalars"].items():
        out.update({f"{name}:{key}": v for name, v in scalars.items()})
    return out


def _optimizer_tensors_laid_out(ex, got: dict, templates: dict) -> dict:
    """The inverse of :func:`_whole_optimizer_tensors` after a load: each whole ``optim.<state>.<key>`` shaped like
    its parameter, as this rank holds the parameter (``RankState.laid_out``)."""
    got = dict(got)
    stage_of = {k: s for s, k in ex._leaves}
    for ok, t in list(got.items()):
        parts = split_optim_key(ok)
        if parts is None or parts[1] not in stage_of:
            continue
        k = parts[1]
        whole = templates.get(k)
        if whole is not None and t.dim() > 0 and t.shape == whole.shape:
            for st in ex.features.values():
                t = st.laid_out(ex, stage_of[k], k, t)
            got[ok] = t
    return got


def save_rank_state(ex, path, aliases: dict) -> None:
    """Collective: every rank of the program calls it with the same ``path``."""
    tensors = {}
    by_canon: dict = {}
    for alias, canon in aliases.items():
        by_canon.setdefault(canon, []).append(alias)
    params, state = ex.whole()            # the features' pieces gathered: the checkpoint holds whole tensors
    for s, ps in params.items():
        for k, v in ps.items():
            tensors[k] = v
            for alias in by_canon.get(k, ()):
                tensors[alias] = v
    tensors.update(ex.own_buffers())      # a buffer from the rank whose stage updates it (BatchNorm under pp)
    rest = None
    if ex.spec.traced:
        for st in state.values():
            for sk, v in st.items():
                name, key = sk.split(":", 1)
                tensors[optim_key(name, key)] = v
    else:
        opt_tensors, rest = torch_optimizer_whole(ex)
        tensors.update(opt_tensors)
    for s, versions in ex.carried().items():        # oldest first: the last is one update before the newest
        for back, ps in enumerate(reversed(versions), start=1):
            for k, v in ps.items():
                tensors[stash_key(k, back)] = v
    extra = RankExtra(rng=rng_state(), step=max(ex.step_count.values(), default=0),
                      lr=[g["lr"] for g in ex.torch_opt.param_groups], optim=rest,
                      scheduler=ex.scheduler.state_dict() if ex.scheduler is not None else None,
                      features={name: st.save() for name, st in ex.features.items()})    # per-rank feature state
    rank, world, pg = _workers(ex)
    save_checkpoint(path, tensors, extra.to_dict(), rank=rank, world_size=world, process_group=pg)


def load_rank_state(ex, path, aliases: dict, need_stash: bool = False) -> None:
    """Collective, like :func:`save_rank_state`. Fills the executor's parameters, buffers, optimizer state,
    step count, LR, scheduler and RNG from ``path`` (saved under any strategy)."""
    manifest = read_manifest(path) or {"tensors": {}}
    saved = manifest["tensors"]
    held = {k for ps in ex.params.values() for k in ps}
    whole = ex.whole()[0] if ex.features else ex.params  # whole shapes
    templates = {k: v for ps in whole.values() for k, v in ps.items()}
    templates.update({k: v for k, v in ex.buffers.items()})
    for k, meta in saved.items():
        parts = split_optim_key(k)
        if parts is not None and parts[1] in held:
            templates[k] = torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]))
    wanted = {stash_key(k, back) for s, ps in ex.params.items() for k in ps
              for back in range(1, ex.p.settings.carried.get(s, 0) + 1)} if need_stash else set()
    for k in wanted & set(saved):
        templates[k] = torch.empty(saved[k]["shape"], dtype=getattr(torch, saved[k]["dtype"]))
    rank, world, pg = _workers(ex)
    got, saved_extra = load_checkpoint(path, templates, rank=rank, world_size=world, process_group=pg)
    _refuse_nonfinite(path, got, sorted(held), world, pg)
    extra = RankExtra.from_dict(saved_extra)
    for s, ps in ex.params.items():
        ex.params[s] = {k: got[k].clone() for k in ps}
    ex.buffers = {k: got[k] for k in ex.buffers}
    if ex.spec.traced:
        for s, st in ex.state.items():
            for sk in list(st):
                name, key = sk.split(":", 1)
                st[sk] = got[optim_key(name, key)].clone()
    else:
        keys = [k for _, k in ex._leaves]
        got = _optimizer_tensors_laid_out(ex, got, templates)
        ex.torch_opt.load_state_dict(torch_optimizer_state_dict(ex.torch_opt, keys, got, extra.optim))
    for st in ex.features.values():       # the features' own layout of what was loaded whole
        st.after_load(ex)
    if need_stash:
        missing = sorted(wanted - set(got))
        if missing:
            raise CheckpointError(
                f"checkpoint {path} holds no {missing[:3]}...: a resumed window of this asynchronous schedule reads, "
                f"per stage, the weight versions before the newest that the run which never stopped would have read "
                f"({dict(sorted(ex.p.settings.carried.items()))} per stage), and only a checkpoint saved by the same "
                "schedule with as many stages or more holds them. Resume from a checkpoint that schedule saved.")
        ex.prev_params = {s: [{k: got[stash_key(k, back)].clone() for k in ps}
                              for back in range(ex.p.settings.carried[s], 0, -1)]
                          for s, ps in ex.params.items() if ex.p.settings.carried.get(s, 0)}
    ex.step_count = {s: int(extra.step) for s in ex.step_count}
    for g, lr in zip(ex.torch_opt.param_groups, extra.lr):
        g["lr"] = lr
    if ex.scheduler is not None and extra.scheduler is not None:
        ex.scheduler.load_state_dict(extra.scheduler)
    saved_features = extra.features
    for name, st in ex.features.items():       # a feature's per-rank state resumes on the rank that saved it
        if not saved_features.get(name):
            continue                           # saved without that feature, or it held nothing: as a fresh run's
        if manifest.get("world_size") != world:
            raise RuntimeError(f"checkpoint {path} holds feature {name!r}'s per-rank state of "
                               f"{manifest.get('world_size')} ranks, and this program has {world}: that state "
                               "(e.g. error-feedback residuals) belongs to each saving rank. Resume on as many "
                               "ranks, or without that feature.")
        st.load(saved_features[name])
    if manifest.get("world_size") == world:
        set_rng_state(extra.rng)
    else:   # another world: rank r got saved rank r % saved's RNG, which replicas would share -- seed afresh
        seed_rank(ex.p.settings.rng_seed, ex.rank, ex.tp_index)


def replica_state(ex) -> dict:
    """This rank's own parameters and optimizer state, as it holds them (copies), for a feature whose dp replicas
    differ on purpose (decentralized SGD): the checkpoint's global keys hold one model, and the feature keeps each
    replica's own in the rank's ``extra`` (its :meth:`~fxpar.feature.RankState.save`)."""
    out = {"params": {s: {k: v.clone() for k, v in ps.items()} for s, ps in ex.params.items()}}
    if ex.spec.traced:
        out["optim"] = {s: {k: v.clone() for k, v in st.items()} for s, st in ex.state.items()}
    else:
        out["torch_optim"] = copy.deepcopy(ex.torch_opt.state_dict())
    return out


def load_replica_state(ex, saved: dict | None, what: str) -> None:
    """Put back what :func:`replica_state` saved (after the checkpoint's global keys were loaded), bitwise; ``saved``
    None (a checkpoint saved without the feature ``what``, whose replicas differ) is refused."""
    if saved is None:
        raise RuntimeError(f"rank {ex.rank}: the checkpoint holds no weights of this dp replica: it was saved without "
                           f"{what}, whose replicas differ; resume from a checkpoint a run with it saved")
    held = {s: sorted(ps) for s, ps in ex.params.items()}
    got = {s: sorted(ps) for s, ps in saved["params"].items()}
    if held != got:
        raise RuntimeError(f"rank {ex.rank}: the checkpoint's own parameters of this replica (stages and keys "
                           f"{got}) are not the ones this program holds ({held}): it was saved by another program; "
                           "resume with the program that saved it")
    ex.params = {s: {k: v.clone() for k, v in ps.items()} for s, ps in saved["params"].items()}
    if ex.spec.traced:
        if "optim" not in saved:
            raise RuntimeError(f"rank {ex.rank}: the checkpoint holds this replica's state of an untraced optimizer, "
                               f"and this program traces {ex.spec.name}: resume with the optimizer that saved it")
        ex.state = {s: {k: v.clone() for k, v in st.items()} for s, st in saved["optim"].items()}
    else:
        if "torch_optim" not in saved:
            raise RuntimeError(f"rank {ex.rank}: the checkpoint holds this replica's state of a traced optimizer, "
                               f"and this program runs {ex.spec.name} untraced: resume with the optimizer that "
                               "saved it")
        ex.torch_opt.load_state_dict(copy.deepcopy(saved["torch_optim"]))
