"""Save and resume training state with ``torch.distributed.checkpoint`` (DCP), under the model's own keys.

A checkpoint is one DCP directory plus a manifest. Tensors are stored under **global keys** that do
not depend on the parallel strategy, so a checkpoint taken under one strategy (or world size) loads
under another, and plain PyTorch reads it without fxpar::

    path/
      .metadata                 DCP's index (written by DCP's coordinator, rank 0)
      __0_0.distcp, __1_0 ...   DCP's data files, one per saving rank
      fxpar_checkpoint.json     the manifest, written LAST: its presence means "complete"

Key naming (one flat namespace, every key a string):

================================  =================================================================
``blocks.0.fc.weight``            a parameter or buffer: the model's own ``state_dict()`` key
``optim.<state>.<param key>``     per-parameter optimizer state, e.g. ``optim.exp_avg.blocks.0.fc.weight``,
                                  ``optim.exp_avg_sq.<key>``, ``optim.momentum_buffer.<key>``,
                                  ``optim.step.<key>`` (see :func:`optim_key`, :func:`split_optim_key`)
``fxpar.extra.rank<r>``           rank r's ``extra`` (RNG state, step counts, LR scheduler state ...),
                                  one pickled object per saving rank (reserved prefix ``fxpar.``)
================================  =================================================================

Because model keys are the model's own, ``dcp.load(model.state_dict(), checkpoint_id=path)`` in a
process without a process group fills a fresh ``nn.Module``; the extra ``optim.*`` and ``fxpar.*``
entries are simply not asked for.

Who holds what. Each rank passes the tensors it holds under their global keys. Ranks may hold
different subsets, and a key may be held by several ranks (replicas, e.g. data parallel): DCP writes
one copy of each key (``dedup_save_plans``), so replicas must be equal, which fxpar's executor
guarantees. Sharded tensors are not split here: the caller passes whole tensors (gather first, or
save each shard under its own key); DTensor support can be added by passing DTensors, which DCP
already understands.

Why ``extra`` goes through DCP (as a pickled object per rank) and not a side file: it then lives in the
same directory, is written by the same storage writer (a later switch to another DCP storage backend
moves it along), needs no gather to rank 0, and is covered by the same write-then-rename commit. It is
stored as the bytes of ``torch.save(extra)`` so DCP does not flatten nested dicts/lists of the
scheduler state into keys of its own. Loading it unpickles (``torch.load(weights_only=False)``):
load checkpoints you trust, as with any pickle.

Commit protocol (a killed save never damages the previous checkpoint)::

    1. rank 0 removes a stale  <path>.fxpar-partial  (left by a killed save); every rank agrees
    2. all ranks: dcp.save(...) into  <path>.fxpar-partial
    3. rank 0: write fxpar_checkpoint.json (to a temp name, fsync, os.replace) into the partial dir
    4. rank 0: if <path> exists, rename it to <path>.fxpar-old; rename the partial dir to <path>;
       delete <path>.fxpar-old
    5. rank 0 broadcasts success or its error; every rank returns or raises the same error

A directory without the manifest is refused by :func:`load_checkpoint` with an error that names it.

Integrity. The manifest records a CRC-32 of every tensor's bytes and of every rank's ``extra``
(``"checksums"``: key -> ``{"crc32", "file"}``, the file being the DCP data file that holds it), computed by
the saving ranks before the write. :func:`load_checkpoint` checks each tensor it loads (and the extra it
unpickles) against it and refuses a mismatch, naming the file, the tensor and the fix; a data file DCP cannot
read is refused the same way. Checksumming costs about 0.05 s per 100 MB on each side (docs/benchmarks.md).
The directories must be on a filesystem every rank sees (as DCP's ``FileSystemWriter`` requires).
"""
from __future__ import annotations

import difflib
import errno
import io
import json
import os
import shutil
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import FxparError
from ..local_ops import rank_stream_state, set_rank_stream_state

__all__ = ["CheckpointError", "incomplete_message", "save_checkpoint", "load_checkpoint", "is_complete", "read_manifest",
           "checksum",
           "optim_key", "split_optim_key", "torch_optimizer_tensors", "torch_optimizer_state_dict",
           "rng_state", "set_rng_state", "MANIFEST", "FORMAT_VERSION"]

MANIFEST = "fxpar_checkpoint.json"
FORMAT_VERSION = 1
_FORMAT = "fxpar-checkpoint"
_PARTIAL, _OLD = ".fxpar-partial", ".fxpar-old"
_EXTRA = "fxpar.extra.rank"
_OPTIM = "optim."


class CheckpointError(FxparError, RuntimeError):
    """A checkpoint could not be saved or loaded: incomplete, missing a key, wrong shape ..."""


# ---------------------------------------------------------------- naming

def optim_key(state_name: str, param_key: str) -> str:
    """``optim_key("exp_avg", "blocks.0.fc.weight") == "optim.exp_avg.blocks.0.fc.weight"``."""
    if not state_name or "." in state_name:
        raise ValueError(f"optimizer state name {state_name!r} must be non-empty and contain no '.'")
    return f"{_OPTIM}{state_name}.{param_key}"


def split_optim_key(key: str) -> tuple[str, str] | None:
    """``"optim.exp_avg.blocks.0.fc.weight" -> ("exp_avg", "blocks.0.fc.weight")``; None if not optim."""
    if not key.startswith(_OPTIM) or key.count(".") < 2:
        return None
    name, param = key[len(_OPTIM):].split(".", 1)
    return name, param


def torch_optimizer_tensors(opt_state: dict, param_keys: list[str]) -> tuple[dict, dict]:
    """Split ``torch.optim.Optimizer.state_dict()`` into global-key tensors and a picklable rest.

    ``param_keys[i]`` is the model key of the optimizer's i-th parameter (torch numbers parameters
    in param-group order). Returns ``(tensors, rest)``: ``tensors`` = ``{optim.<state>.<key>: tensor}``
    for every tensor in the per-parameter state (Adam's ``step`` is a tensor too); ``rest`` =
    ``{"param_groups": [hyper-parameters without "params"], "scalars": {key: {state: value}}}`` to put
    in ``extra``. Rebuild with :func:`torch_optimizer_state_dict`.
    """
    tensors, scalars = {}, {}
    for idx, st in opt_state["state"].items():
        key = param_keys[idx]
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[optim_key(name, key)] = v
            else:
                scalars.setdefault(key, {})[name] = v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt_state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def torch_optimizer_state_dict(optimizer: torch.optim.Optimizer, param_keys: list[str], tensors: dict,
                               rest: dict | None = None) -> dict:
    """The inverse of :func:`torch_optimizer_tensors`, for ``optimizer.load_state_dict(...)``.

    Parameter numbering and groups come from ``optimizer`` as built now (possibly under another
    strategy, holding other keys); saved hyper-parameters (lr, betas ...) are applied to groups by
    position. ``tensors`` may hold more keys than this optimizer's parameters.
    """
    sd = optimizer.state_dict()
    rest = rest or {"param_groups": [], "scalars": {}}
    by_param: dict = {}
    for k, v in tensors.items():
        parts = split_optim_key(k)
        if parts is not None:
            by_param.setdefault(parts[1], {})[parts[0]] = v
    state = {}
    for idx, key in enumerate(param_keys):
        st = {**by_param.get(key, {}), **rest["scalars"].get(key, {})}
        if st:
            state[idx] = st
    groups = [dict(g, **(rest["param_groups"][i] if i < len(rest["param_groups"]) else {}), params=g["params"])
              for i, g in enumerate(sd["param_groups"])]
    return {"state": state, "param_groups": groups}


def rng_state() -> dict:
    """This process's RNG states (CPU, and CUDA when initialised) and its rank stream (the dropout on tensors
    split over tp: ``fxpar.local_ops.rank_stream_state``), for ``extra["rng"]``."""
    out = {"cpu": torch.get_rng_state(), "rank_stream": rank_stream_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if "rank_stream" in state:
        set_rank_stream_state(state["rank_stream"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- completeness

def _siblings(path) -> tuple[Path, Path, Path]:
    p = Path(os.fspath(path)).absolute()
    return p, p.with_name(p.name + _PARTIAL), p.with_name(p.name + _OLD)


def read_manifest(path) -> dict | None:
    """The manifest of the checkpoint at ``path``, or None where there is none (or it is unreadable)."""
    try:
        with open(Path(path) / MANIFEST) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("format") == _FORMAT else None


def is_complete(path) -> bool:
    """True when ``path`` holds a checkpoint whose save finished (manifest and DCP index present)."""
    return read_manifest(path) is not None and (Path(path) / ".metadata").is_file()


def incomplete_message(path) -> str:
    p = Path(os.fspath(path)).absolute()
    if p.name.endswith(_PARTIAL):
        p = p.with_name(p.name[: -len(_PARTIAL)])
    p, partial, old = _siblings(p)
    if not Path(path).exists():
        msg = f"no checkpoint at {path}: the directory does not exist."
    else:
        msg = (f"the checkpoint at {path} is incomplete: it has no {MANIFEST} (or no DCP .metadata), which is "
               "written last, so the save that wrote it was killed or failed before it finished "
               "(or the directory was not written by fxpar's save_checkpoint).")
    hints = []
    if is_complete(p) and Path(path).absolute() != p:
        hints.append(f"the previous checkpoint {p} is complete: load that one")
    if not p.exists() and is_complete(partial) and Path(path).absolute() != partial:
        hints.append(f"{partial} is a complete newer checkpoint whose save was interrupted before its final "
                     f"rename: rename it to {p} and load it")
    if is_complete(old):
        hints.append(f"{old} is a complete earlier checkpoint left by a save interrupted while swapping "
                     f"directories: rename it to {p} and load it")
    if Path(path).exists():
        hints.append(f"delete {path} (a new save_checkpoint also replaces it)")
    return msg + (" What to do: " + "; or ".join(hints) + "." if hints else "")


# ---------------------------------------------------------------- process group

class _Group:
    """The collectives this module needs; all no-ops in a single process."""

    def __init__(self, rank: int, world_size: int, process_group):
        self.rank, self.world_size, self.pg = rank, world_size, process_group
        self.dist = world_size > 1
        if not self.dist:
            if rank != 0:
                raise CheckpointError(f"rank={rank} with world_size=1: a single process is rank 0")
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError(f"world_size={world_size} needs an initialised torch.distributed process "
                                  "group (call it from every rank of a LocalCluster or torchrun), or pass "
                                  "world_size=1 to save/load in this process alone")
        got_ws, got_rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        if (got_ws, got_rank) != (world_size, rank):
            raise CheckpointError(f"rank={rank}, world_size={world_size} were passed, but the process group says "
                                  f"rank {got_rank} of {got_ws}: pass the rank and size within process_group")
        self.src = dist.get_global_rank(process_group, 0) if process_group is not None else 0

    def agree(self, error: str | None) -> None:
        """Every rank raises if any rank has an error (so no rank enters DCP's collectives alone)."""
        if not self.dist:
            if error:
                raise CheckpointError(error)
            return
        errors = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.pg)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            if error:
                raise CheckpointError(error)
            raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in bad))

    def gather_to_rank0(self, obj) -> list:
        """Every rank's ``obj``, in rank order (on every rank: rank 0 needs it, the others ignore it)."""
        if not self.dist:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def from_rank0(self, obj):
        if not self.dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.pg)
        return box[0]


def _quiet_dcp(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kw)


# ---------------------------------------------------------------- save

def save_checkpoint(path, tensors: dict, extra: dict, *, rank: int, world_size: int, process_group=None) -> None:
    """Save this rank's ``tensors`` (global key -> tensor) and ``extra`` (picklable) to ``path``.

    Collective: every rank of ``process_group`` (the default group if None) calls it, with the same
    ``path``. ``world_size=1`` saves from this process alone, with or without a process group. Returns
    after the checkpoint at ``path`` is complete on disk on every rank; ``path`` keeps the previous
    checkpoint until then (see the module docstring). Raises :class:`CheckpointError` on every rank
    if any rank's arguments are wrong or the commit fails.
    """
    g = _Group(rank, world_size, process_group)
    p, partial, old = _siblings(path)
    error = _check_save_args(tensors)
    if rank == 0 and error is None:
        error = _prepare(p, partial)
    g.agree(error)

    state = {k: _own_storage(v.detach()) for k, v in tensors.items()}
    state[f"{_EXTRA}{rank}"] = _pickle(extra)
    sums = g.gather_to_rank0({k: checksum(v) for k, v in state.items()})
    import torch.distributed.checkpoint as dcp   # here, not at the top: importing it takes ~0.8 s per process
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        metadata = _quiet_dcp(dcp.save, state, checkpoint_id=str(partial), process_group=process_group,
                              no_dist=not g.dist)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises the writers' errors on every rank
        full = any(getattr(x, "errno", None) == errno.ENOSPC for x in _causes(e))
        raise CheckpointError(f"writing the checkpoint {p} failed{' (the disk is full)' if full else ''}: "
                              f"{_describe(e)}. "
                              f"{p} still holds the previous checkpoint (if any), untouched; {partial} is the "
                              "unfinished one (the next save removes it)."
                              + (" Free space on that filesystem or save elsewhere." if full else "")) from e

    failure = None
    if rank == 0:
        try:
            _write_manifest(partial, metadata, world_size, sums)
            _swap_in(p, partial, old)
        except Exception as e:  # noqa: BLE001 - sent to every rank, re-raised here below
            failure = e
    msg = g.from_rank0(None if failure is None else f"rank 0 could not commit the checkpoint {p}: {failure!r}. "
                       f"{p} still holds the previous checkpoint (if any); {partial} is the unfinished one.")
    if msg:
        raise CheckpointError(msg) from failure


def _check_save_args(tensors: dict) -> str | None:
    for k, v in tensors.items():
        if not isinstance(k, str) or k.startswith("fxpar."):
            return f"tensor key {k!r}: keys are the model's state-dict keys (strings); 'fxpar.' is reserved"
        if not isinstance(v, torch.Tensor):
            return f"tensors[{k!r}] is a {type(v).__name__}, not a Tensor: put non-tensors in `extra`"
    return None


def _prepare(p: Path, partial: Path) -> str | None:
    if p.exists() and not p.is_dir():
        return f"{p} exists and is not a directory: choose another checkpoint path"
    if p.is_dir() and any(p.iterdir()) and read_manifest(p) is None:
        return (f"{p} is a non-empty directory that is not an fxpar checkpoint (no {MANIFEST}): refusing to "
                "replace it. Delete it or choose another path")
    try:
        if partial.exists():
            shutil.rmtree(partial)  # a killed save's leftovers
        partial.mkdir(parents=True)
    except OSError as e:
        return f"cannot create {partial}: {e}"
    return None


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    # a view into a larger storage: keep only its own elements
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


def _pickle(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def checksum(v) -> int:
    """CRC-32 of a tensor's bytes (its own elements, in order) or of a bytes object."""
    if isinstance(v, (bytes, bytearray)):
        return zlib.crc32(v)
    t = v.detach().reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


def _causes(e: BaseException) -> list:
    """``e`` and what it wraps (``__cause__``, ``__context__``, DCP's per-rank failures)."""
    out, todo = [], [e]
    while todo:
        x = todo.pop()
        if x is None or any(x is y for y in out):
            continue
        out.append(x)
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return [x for x in out if isinstance(x, BaseException)]


def _describe(e: BaseException) -> str:
    """One line per failing rank (DCP's exception carries each rank's), else the error itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {type(x[0] if isinstance(x, tuple) else x).__name__}: "
                         f"{x[0] if isinstance(x, tuple) else x}" for r, x in failures.items())
    return f"{type(e).__name__}: {e}"


def _files_of(metadata) -> dict:
    """Key -> the DCP data file(s) that hold it (from DCP's storage index)."""
    out: dict = {}
    for idx, info in (getattr(metadata, "storage_data", None) or {}).items():
        out.setdefault(idx.fqn, set()).add(info.relative_path)
    return {k: sorted(v) for k, v in out.items()}


def _write_manifest(partial: Path, metadata, world_size: int, sums: list | None = None) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    keys = {k: {"shape": list(md.size), "dtype": str(md.properties.dtype).removeprefix("torch.")}
            for k, md in sorted(metadata.state_dict_metadata.items()) if isinstance(md, TensorStorageMetadata)}
    manifest = {"format": _FORMAT, "version": FORMAT_VERSION, "world_size": world_size,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "created_unix": time.time(),
                "torch": torch.__version__, "extra_keys": [f"{_EXTRA}{r}" for r in range(world_size)],
                "tensors": keys}
    if sums is not None:       # every rank's CRC-32 of what it saved; replicas of a key agree (DCP writes one)
        files = _files_of(metadata)
        table: dict = {}
        for rank_sums in sums:
            for k, c in rank_sums.items():
                table.setdefault(k, set()).add(int(c))
        manifest["checksum"] = "crc32"
        manifest["checksums"] = {k: {"crc32": sorted(c) if len(c) > 1 else next(iter(c)),
                                     "file": ", ".join(files.get(k, ["?"]))} for k, c in sorted(table.items())}
    tmp = partial / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, partial / MANIFEST)


def _swap_in(p: Path, partial: Path, old: Path) -> None:
    if old.exists():
        shutil.rmtree(old)   # stale: the new checkpoint is complete, so the older one can go
    if p.exists():
        os.rename(p, old)
    os.rename(partial, p)
    if old.exists():
        shutil.rmtree(old)


# ---------------------------------------------------------------- load

def load_checkpoint(path, templates: dict, *, rank: int, world_size: int, process_group=None) -> tuple[dict, dict]:
    """Load the tensors named by ``templates`` (key -> tensor giving shape, dtype, device) and this rank's extra.

    Collective like :func:`save_checkpoint`; ranks may ask for different keys, and ``world_size`` may
    differ from the saving world's. Returns ``(tensors, extra)``: new tensors (the templates are not
    written), and the ``extra`` saved by rank ``rank % saved_world_size`` (so with more ranks than at
    save time, ranks r and r + saved_world_size get the same extra — reseed their RNGs if they must
    differ; with fewer, the extras of the higher saved ranks are not returned). Refuses, on every rank,
    an incomplete checkpoint (naming the directory and what to do), a key the checkpoint lacks (naming
    close keys), and a shape or dtype different from the saved one.
    """
    g = _Group(rank, world_size, process_group)
    manifest, error = None, None
    if not is_complete(path):
        error = incomplete_message(path)
    else:
        manifest = read_manifest(path)
        error = _check_templates(path, templates, manifest)
    g.agree(error)

    extra_key = f"{_EXTRA}{rank % manifest['world_size']}"
    state = {k: torch.empty(t.shape, dtype=t.dtype, device=t.device) for k, t in templates.items()}
    state[extra_key] = b""
    import torch.distributed.checkpoint as dcp   # here, not at the top: importing it takes ~0.8 s per process
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        _quiet_dcp(dcp.load, state, checkpoint_id=str(Path(path)), process_group=process_group, no_dist=not g.dist)
        error = _verify(path, state, manifest)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises the readers' errors on every rank
        error = (f"the checkpoint {path} could not be read: {_describe(e)}. One of its data files "
                 f"({', '.join(sorted(x.name for x in Path(path).glob('*.distcp')))}) or its .metadata is damaged or "
                 "truncated. Resume from the previous checkpoint (save to rotating directories to keep one), or "
                 "restore this one from a copy.")
    g.agree(error)
    extra = torch.load(io.BytesIO(state.pop(extra_key)), weights_only=False)
    return state, extra


def _verify(path, state: dict, manifest: dict) -> str | None:
    """The first loaded tensor (or extra) whose CRC-32 is not the one the manifest recorded at save, named."""
    sums = manifest.get("checksums")
    if not sums:
        return None              # saved before checksums were recorded
    for k, v in state.items():
        want = sums.get(k)
        if want is None:
            continue
        ok = want["crc32"] if isinstance(want["crc32"], list) else [want["crc32"]]
        got = checksum(v)
        if got not in ok:
            what = "rank extra (RNG, step, scheduler)" if k.startswith(_EXTRA) else "tensor"
            return (f"the checkpoint {path} is damaged: {what} {k!r} in file {want['file']} does not match the "
                    f"checksum recorded when it was saved (CRC-32 {got:#010x}, saved {ok[0]:#010x}), so its bytes "
                    "changed on disk after the save. Resume from the previous checkpoint (save to rotating "
                    "directories to keep one), or restore this one from a copy.")
    return None


def _check_templates(path, templates: dict, manifest: dict) -> str | None:
    saved = manifest["tensors"]
    for k, t in templates.items():
        if k not in saved:
            close = difflib.get_close_matches(k, list(saved), n=5, cutoff=0.6)
            return (f"key {k!r} is not in the checkpoint {path} ({len(saved)} tensor keys, saved by "
                    f"{manifest['world_size']} rank(s)). Close keys: {close or 'none'}. Keys are the model's "
                    "state-dict keys: was the model renamed, or its optimizer state saved under another name?")
        shape, dtype = list(t.shape), str(t.dtype).removeprefix("torch.")
        if saved[k]["shape"] != shape or saved[k]["dtype"] != dtype:
            return (f"key {k!r}: the checkpoint {path} holds {saved[k]['dtype']}{saved[k]['shape']}, the template is "
                    f"{dtype}{shape}. Load into a template of the saved shape and dtype, then convert")
    return None
