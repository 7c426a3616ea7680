"""Plan: the decisions, as pure data. Printable, JSON round-trip, editable by hand.

A Plan is what the planner decided and what the passes carry out. Edit one and hand it back:

    plan = program.plan
    plan.buckets = [[...names...], [...]]          # your own bucket split
    program = fxpar.parallelize(..., plan=plan)
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .mesh import Mesh

__all__ = ["Plan"]


@dataclass
class Plan:
    mesh_axes: list = field(default_factory=lambda: [["dp", 1]])   # [[name, size], ...], row-major
    batch_dim: int = 0                         # dim of every batch tensor that dp splits
    global_batch: int = 0
    bucket_cap_bytes: int = 25 * 2**20
    first_bucket_cap_bytes: int = 2**20
    buckets: list = field(default_factory=list)   # [[param key, ...], ...] in issue order
    broadcast_buffers: bool = True
    optimizer: dict = field(default_factory=dict)  # {"name": ..., "traced": bool, "why_not_traced": str}
    custom_passes: list = field(default_factory=list)
    schedule: str | None = None
    microbatches: int = 1

    @property
    def mesh(self) -> Mesh:
        return Mesh(tuple((n, int(s)) for n, s in self.mesh_axes))

    @property
    def dp(self) -> int:
        return self.mesh.axis_size("dp")

    def structural_key(self, rank: int) -> tuple:
        """Ranks with the same key get the same graph (collectives name mesh axes, not ranks)."""
        c = self.mesh.coords(rank)
        return tuple(c[a] for a in self.mesh.names if a not in ("dp",))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls(**json.loads(text))

    def __str__(self) -> str:
        lines = [f"mesh: {self.mesh}", f"batch: {self.global_batch} split on dim {self.batch_dim} over dp={self.dp}"]
        if self.dp > 1:
            lines.append(f"gradient sync: mean over dp (all_reduce(sum)) in {len(self.buckets)} "
                         f"bucket(s) (cap {self.bucket_cap_bytes / 2**20:.3g} MiB, the first "
                         f"{min(self.first_bucket_cap_bytes, self.bucket_cap_bytes) / 2**20:.3g} MiB), issued in backward order")
            lines.append("buffers: " + ("dp-rank 0's broadcast after each step (DDP broadcast_buffers)"
                                        if self.broadcast_buffers else "per-rank (not synchronised)"))
        opt = self.optimizer
        lines.append(f"optimizer: {opt.get('name')} " + ("traced into the graph" if opt.get("traced")
                                                          else f"eager on each rank ({opt.get('why_not_traced')})"))
        if self.custom_passes:
            lines.append(f"custom passes: {self.custom_passes}")
        return "\n".join(lines)
