"""What a rank holds under tensor parallelism: its pieces of the split parameters and optimizer state.

A mixin of :class:`fxpar.runtime.executor.Executor` (``self.params``, ``self.state``, ``self.p``,
``self.tp_index``). ``payload.extra["tp"]`` (from ``Plan.shardings``, written by
``passes.tensor_parallel``) gives the tp mesh axes and, per held stage, each parameter's and each
optimizer state's layout: a mesh axis or None per dim. The rank keeps the piece at its coordinate
(``torch.chunk`` along each split dim, as ``passes.lower_sharding`` cuts); ``_tp_whole`` gathers
whole tensors over the tp groups for ``state_dict()``, results and checkpoints (collective over tp).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..mesh import Mesh

__all__ = ["TensorParallelState"]


class TensorParallelState:
    def _tp_init(self) -> None:
        info = self.p.extra.get("tp") or {}
        self.tp_axes = Mesh(tuple((a, int(n)) for a, n in info.get("axes", ())))
        self.tp_layouts = {s: st for s, st in info.get("stages", {}).items() if s in self.params}
        self.tp_split = any(any(d is not None for d in dims) for st in self.tp_layouts.values()
                            for part in st.values() for dims in part.values())
        self._tp_slice()

    def _coords(self) -> dict:
        return self.tp_axes.coords(self.tp_index) if self.tp_axes.axes else {}

    def _piece(self, t: torch.Tensor, dims: list, whole_shape) -> torch.Tensor:
        if tuple(t.shape) != tuple(whole_shape):          # already this rank's piece
            return t
        c = self._coords()
        for d, axis in enumerate(dims):
            if axis is not None:
                t = t.chunk(self.tp_axes.axis_size(axis), dim=d)[c[axis]]
        return t.clone(memory_format=torch.contiguous_format)

    def _tp_slice(self) -> None:
        """Cut whole parameters and optimizer state into this rank's pieces (after building and loading)."""
        for s, st in self.tp_layouts.items():
            for k, dims in st.get("params", {}).items():
                if any(dims) and k in self.params[s]:
                    self.params[s][k] = self._piece(self.params[s][k], dims, st["shapes"][k])
            for k, dims in st.get("opt_state", {}).items():
                if any(dims) and k in self.state[s]:
                    self.state[s][k] = self._piece(self.state[s][k], dims, st["shapes"][k.split(":", 1)[1]])

    def _gather(self, t: torch.Tensor, dims: list) -> torch.Tensor:
        from .executor import group
        for d, axis in enumerate(dims):
            if axis is None:
                continue
            ranks = self.p.bindings[axis]
            parts = [torch.empty_like(t) for _ in ranks]
            dist.all_gather(parts, t.contiguous(), group=group(ranks, axis))
            t = torch.cat(parts, dim=d)
        return t

    def _tp_whole(self, params: dict, state: dict) -> tuple:
        """Whole tensors of ``params`` / ``state`` (per held stage, copies of the dicts); collective over tp."""
        for s, st in sorted(self.tp_layouts.items()):
            for k, dims in st.get("params", {}).items():
                if any(dims) and k in params.get(s, {}):
                    params[s][k] = self._gather(params[s][k], dims)
            for k, dims in st.get("opt_state", {}).items():
                if any(dims) and k in state.get(s, {}):
                    state[s][k] = self._gather(state[s][k], dims)
        return params, state
