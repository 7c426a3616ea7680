"""What the pipeline runtime keeps track of besides the math: the weight versions an asynchronous schedule
holds (:class:`VersionStore`), the bytes a microbatch's saved tensors keep alive (:func:`activation_bytes`)
and a fingerprint of the exact weights a computation used (:func:`digest`)."""
from __future__ import annotations

import hashlib

import torch

from ..schedule import ActionKind

__all__ = ["VersionStore", "activation_bytes", "digest"]

_K = ActionKind


def weight_storages(weights: dict) -> set:
    """The storage addresses of a stage's weights (what :func:`activation_bytes` leaves out)."""
    return {t.untyped_storage().data_ptr() for t in weights.values()}


def activation_bytes(saved, args, weights: dict, wptr: set | None = None) -> int:
    """Bytes the saved tensors of one microbatch keep alive, weights excluded: each storage made by the
    forward counts whole (a view keeps its base alive), an input (a slice of the batch, a received tensor)
    counts its own elements -- the rule :func:`fxpar.pipeline.autodiff._partition` predicts with.
    ``wptr``: ``weight_storages(weights)``, when the caller keeps it between calls."""
    wptr = weight_storages(weights) if wptr is None else wptr
    inputs = {}
    for t in args:
        if isinstance(t, torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in wptr:
                inputs.setdefault(ptr, t.numel() * t.element_size())
    held = {}
    for t in saved:
        if not isinstance(t, torch.Tensor):
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in wptr:
            continue
        held[ptr] = inputs[ptr] if ptr in inputs else int(t.untyped_storage().nbytes())
    return sum(held.values())


def digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class VersionStore:
    """Weight versions of each stage this rank holds, for asynchronous schedules (PipeDream, 2BW).

    Version 0 is the weights at the start of the window; ``STEP s@v`` adds version v. A version is
    dropped once no later F or B of this rank's list names it and a newer one exists (a B needs no
    lookup: its forward's saved tensors already hold the weights it differentiates through).
    ``peak`` counts the versions held at once per stage, ``peak_bytes`` their bytes on this rank.
    """

    def __init__(self, params: dict, actions: list, previous: dict | None = None):
        """``previous``: stage -> the versions before the newest, oldest first (a resumed window starts holding
        versions ``0 .. n-1`` = those and ``n`` = ``params``: 2BW's one, PipeDream's ``p-s-1``)."""
        previous = previous or {}
        self.versions = {s: {**dict(enumerate(previous.get(s, ()))), len(previous.get(s, ())): ps}
                         for s, ps in params.items()}
        self.last_use: dict = {}
        for idx, a in enumerate(actions):
            if a.kind in (_K.F, _K.B) and a.version is not None:
                self.last_use[(a.stage, a.version)] = idx
        self.peak = {s: len(vs) for s, vs in self.versions.items()}
        self.peak_bytes = self._bytes()

    def get(self, s: int, version):
        vs = self.versions[s]
        if version is None:
            return vs[max(vs)]
        if version not in vs:
            raise RuntimeError(f"stage {s} version {version} is not held on this rank (held: {sorted(vs)})")
        return vs[version]

    def created(self, s: int, version: int, params: dict, idx: int) -> None:
        vs = self.versions[s]
        vs[version] = params
        for v in [v for v in vs if v != max(vs) and self.last_use.get((s, v), -1) <= idx]:
            del vs[v]
        self.peak[s] = max(self.peak[s], len(vs))
        self.peak_bytes = max(self.peak_bytes, self._bytes())

    def _bytes(self) -> int:
        return sum(t.numel() * t.element_size() for vs in self.versions.values() for ps in vs.values()
                   for t in ps.values())
