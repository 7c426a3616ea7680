"""What a rank holds under ZeRO and ZeRO-Infinity: chunks, whole tensors on demand, memory-mapped files.

A mixin of :class:`fxpar.runtime.executor.Executor` (``self.params``, ``self.state``, ``self.zero``,
``self.offload``, ``self.spec``, ``self.p``, ``self.rank``, ``self.dp_index``):

* ``_rechunk``: cut whole tensors into this rank's ZeRO chunks (optimizer state for stages 1-3,
  parameters for stage 3; ``fxpar.zero`` layout), after building and after loading a checkpoint;
* ``whole``: every chunked tensor gathered whole (collective over dp), for ``state_dict()`` and saving;
* ``_offload`` / ``_settle``: ZeRO-Infinity's disk offload, each tensor a memory-mapped file under
  ``offload_dir/rank<r>/`` that the graphs read and update in place, tracked so that the graphs'
  ``fxpar::prefetch`` nodes can read a file ahead (``fxpar.prefetch``);
* ``_note_state_bytes``: the model-state bytes held at an update (``RunResult.state_bytes``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import prefetch       # registers fxpar::prefetch before any graph holding it is unpacked on a rank
from ..zero import chunk, unchunk

__all__ = ["ShardState"]


class ShardState:
    def _rechunk(self) -> None:
        """Cut whole tensors into this rank's chunks where ZeRO manages them: optimizer state (stages 1-3) and
        parameters (stage 3). Chunks stay chunks."""
        for s, info in self.zero.items():
            n = info["n"]
            for k, (shape, c) in info["keys"].items():
                if info["stage"] == 3 and self.params[s][k].numel() != c:
                    self.params[s][k] = chunk(self.params[s][k], n, self.dp_index).clone()
                for name in self.spec.state_names:
                    t = self.state[s][f"{name}:{k}"]
                    if t.numel() != c or t.dim() != 1:
                        self.state[s][f"{name}:{k}"] = chunk(t, n, self.dp_index).clone()

    def _offload(self) -> None:
        """ZeRO-Infinity to disk: each offloaded tensor (parameters, optimizer state) becomes a memory-mapped file
        under ``offload_dir/rank<r>/``: read in as a layer uses it, written back in place by the update."""
        if self.offload.get("to") != "disk":
            return
        import os
        root = os.path.join(self.offload["dir"], f"rank{self.rank}")
        os.makedirs(root, exist_ok=True)
        prefetch.reset()             # fxpar::prefetch (passes.zero_offload) reads ahead in the files tracked below
        self._on_disk = {}
        what = self.offload["what"]
        for s in sorted(self.params):
            groups = ([("param", self.params[s])] if "params" in what else []) + \
                     ([("optim", self.state[s])] if "optimizer" in what else [])
            for kind, store in groups:
                for k, t in store.items():
                    path = os.path.join(root, f"{kind}.{k.replace(':', '.')}.bin")
                    f = torch.from_file(path, shared=True, size=t.numel(), dtype=t.dtype).view(t.shape)
                    f.copy_(t)
                    store[k] = f
                    self._on_disk[(s, kind, k)] = f
                    prefetch.track(f, path)

    def _settle(self, s: int) -> None:
        """After an update: a new tensor the graph made for an offloaded one is written into its file (an update
        made in place already is); then the features' own hook."""
        for st in self.features.values():
            st.after_update(self, s)
        if self.offload.get("to") != "disk":
            return
        for (st, kind, k), f in self._on_disk.items():
            store = self.params[st] if kind == "param" else self.state[st]
            if st == s and store[k] is not f:
                f.copy_(store[k])
                store[k] = f
        self.state_bytes["prefetched"] = prefetch.STATS["bytes"]    # read ahead so far (RunResult.state_bytes)

    def disk_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in getattr(self, "_on_disk", {}).values())

    def _whole(self, s: int, key: str, t: torch.Tensor) -> torch.Tensor:
        """Collective over dp: the whole tensor from every rank's chunk ``t`` of parameter ``key``."""
        info = self.zero[s]
        parts = [torch.empty_like(t) for _ in range(info["n"])]
        from .executor import group
        dist.all_gather(parts, t.contiguous(), group=group(self.p.bindings["dp"], "dp"))
        return unchunk(parts, info["keys"][key][0])

    def whole(self) -> tuple:
        """``(params, state)`` per held stage with whole tensors. Collective under ZeRO: every rank calls it."""
        params = {s: dict(ps) for s, ps in self.params.items()}
        state = {s: dict(st) for s, st in self.state.items()}
        for s in sorted(self.zero):
            info = self.zero[s]
            for k in info["keys"]:
                if info["stage"] == 3:
                    params[s][k] = self._whole(s, k, self.params[s][k])
                for name in self.spec.state_names:
                    state[s][f"{name}:{k}"] = self._whole(s, k, self.state[s][f"{name}:{k}"])
        for st in self.features.values():                   # the features' own whole tensors
            params, state = st.whole(self, params, state)
        return params, state

    def _note_state_bytes(self, w, s) -> None:
        """Model-state bytes this rank holds when a step updates (the paper's accounting): parameters, gradient
        accumulators handed to the update (none for a fused step: its gradients live inside the graph), state."""
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)       # noqa: E731
        grads = [w.acc[k] for k in self.p.stage_params[s] if k in w.acc]
        now = {"params": nbytes(v for ps in self.params.values() for v in ps.values()), "grads": nbytes(grads),
               "optimizer": nbytes(v for st in self.state.values() for v in st.values())}
        self.state_bytes = {**self.state_bytes, **{k: max(v, self.state_bytes.get(k, 0)) for k, v in now.items()}}

