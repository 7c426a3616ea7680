"""Shardings: how a tensor is laid out over a device mesh, and what changing the layout costs.

A :class:`Sharding` says, for each tensor dim, the mesh axis it is split over (or ``None``), and
the mesh axes over which the tensor is a *partial sum* (each rank holds a summand; the value is
their sum). It prints like a JAX ``PartitionSpec`` and round-trips through JSON (the Plan's ``tensor_parallel``
section)::

    >>> s = Sharding(("dp", None, "tp"))
    >>> print(s), s.local_shape((8, 16, 64), {"dp": 2, "tp": 4})
    P('dp', None, 'tp') (4, 16, 16)
    >>> print(Sharding((None, None), partial=("tp",)))
    P(None, None, partial=('tp',))

Per mesh axis a sharding is one *placement* (the per-axis view the rules and the propagation use,
as DTensor's placements): ``R`` (replicated), ``P`` (partial sum) or an int ``d`` (split along dim d).

Redistribution costs are closed forms for ring collectives, bytes sent per rank, with ``L`` the
bytes of the tensor the rank hands to the collective and ``n`` the axis size (Thakur et al.,
"Optimization of collective communication operations in MPICH", IJHPCA 2005; the same figures as
``cost_models.comm``):

    P -> R     all_reduce       2(n-1)/n · L
    P -> S(d)  reduce_scatter   (n-1)/n · L
    S(d) -> R  all_gather       (n-1) · L
    S(d)->S(e) all_to_all       (n-1)/n · L
    R -> S(d)  local slice      0
    R -> P     local (rank 0 keeps the value, the others hold zeros)   0

A split must divide its dim evenly; :meth:`Sharding.local_shape` names the tensor and what to change.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import FxparError

__all__ = ["Sharding", "ShardingMap", "ShardingError", "R", "P", "fmt_placement", "redistribute_steps", "redistribute_bytes",
           "collective_bytes", "axis_sizes"]

R = "R"     # replicated along the axis
P = "P"     # partial sum along the axis
# an int d: split along tensor dim d


class ShardingError(FxparError, ValueError):
    """A sharding does not fit its tensor or mesh, or two shardings conflict."""


def fmt_placement(pl) -> str:
    return f"S({pl})" if isinstance(pl, int) else str(pl)


def axis_sizes(mesh) -> dict:
    """``{axis: size}`` from a ``fxpar.Mesh`` or a dict."""
    if isinstance(mesh, dict):
        return {str(k): int(v) for k, v in mesh.items()}
    return {n: int(s) for n, s in mesh.axes}


@dataclass(frozen=True)
class Sharding:
    dims: tuple                 # per tensor dim: a mesh axis name, or None
    partial: tuple = ()         # mesh axes over which the value is a partial sum (sorted)

    def __post_init__(self):
        dims, partial = tuple(self.dims), tuple(sorted(set(self.partial)))
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "partial", partial)
        for d in dims:
            if d is not None and not isinstance(d, str):
                raise ShardingError(f"sharding {dims}: each entry is a mesh axis name or None, not {d!r} "
                                    "(one axis per dim; write e.g. ('dp', None, 'tp'))")
        named = [d for d in dims if d is not None]
        if len(named) != len(set(named)):
            raise ShardingError(f"sharding {dims} splits two dims over the same mesh axis; split each axis over "
                                "at most one dim")
        both = set(named) & set(partial)
        if both:
            raise ShardingError(f"sharding {dims} with partial={partial}: axis {sorted(both)} cannot both split a dim "
                                "and hold partial sums")

    # --- construction -------------------------------------------------------------------------------
    @classmethod
    def replicate(cls, ndim: int) -> "Sharding":
        return cls((None,) * ndim)

    @classmethod
    def from_placements(cls, ndim: int, placements: dict) -> "Sharding":
        """``{axis: R | P | d}`` -> Sharding (axes not named are replicated)."""
        dims, partial = [None] * ndim, []
        for axis, pl in placements.items():
            if pl == P:
                partial.append(axis)
            elif isinstance(pl, int):
                if dims[pl] is not None:
                    raise ShardingError(f"dim {pl} would be split over both {dims[pl]!r} and {axis!r}; fxpar splits a "
                                        "dim over one mesh axis -- shard one of them along another dim")
                dims[pl] = axis
        return cls(tuple(dims), tuple(partial))

    # --- queries ------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def axes(self) -> set:
        return {d for d in self.dims if d is not None} | set(self.partial)

    @property
    def is_replicated(self) -> bool:
        return not self.axes

    def placement(self, axis: str):
        """This sharding along one mesh axis: ``R``, ``P`` or the split dim."""
        if axis in self.partial:
            return P
        return self.dims.index(axis) if axis in self.dims else R

    def with_placement(self, axis: str, pl) -> "Sharding":
        pls = {a: self.placement(a) for a in self.axes if a != axis}
        pls[axis] = pl
        return Sharding.from_placements(self.ndim, pls)

    def check_axes(self, mesh, what: str) -> None:
        sizes = axis_sizes(mesh)
        unknown = sorted(a for a in self.axes if a not in sizes)
        if unknown:
            raise ShardingError(f"{what}: {self} names mesh axis {unknown}, which the mesh does not have (its axes: "
                                f"{sorted(sizes)}); use one of those axes or add the axis to the mesh")

    def local_shape(self, shape, mesh, name: str = "tensor") -> tuple:
        """The shape each rank holds. A split must divide its dim; the error names ``name`` and the fix."""
        sizes = axis_sizes(mesh)
        shape = tuple(int(s) for s in shape)
        if len(shape) != self.ndim:
            raise ShardingError(f"{name} has shape {list(shape)} ({len(shape)} dims) but its sharding {self} has "
                                f"{self.ndim} entries: give one entry (a mesh axis or None) per dim")
        self.check_axes(sizes, name)
        out = []
        for d, (size, axis) in enumerate(zip(shape, self.dims)):
            if axis is None:
                out.append(size)
                continue
            n = sizes[axis]
            if size % n:
                raise ShardingError(f"{name}: dim {d} has size {size}, which mesh axis {axis!r} (size {n}) does not "
                                    f"divide; split another dim, pick a mesh axis whose size divides {size}, or make "
                                    f"that dim a multiple of {n}")
            out.append(size // n)
        return tuple(out)

    # --- printing and JSON --------------------------------------------------------------------------
    def __str__(self) -> str:
        parts = [repr(d) if d is not None else "None" for d in self.dims]
        if self.partial:
            parts.append(f"partial={self.partial!r}")
        return f"P({', '.join(parts)})"

    __repr__ = __str__

    def to_json(self) -> dict:
        return {"dims": list(self.dims), "partial": list(self.partial)}

    @classmethod
    def from_json(cls, d) -> "Sharding":
        if isinstance(d, (list, tuple)):                       # a bare spec: ["dp", null, "tp"]
            return cls(tuple(d))
        return cls(tuple(d["dims"]), tuple(d.get("partial", ())))


# --- redistribution: the collective (or local op) each change of placement takes ------------------------

def redistribute_steps(src, dst) -> list:
    """The steps that turn placement ``src`` into ``dst`` along one axis, in order: a list of
    ``(kind, src, dst)`` with kind in all_reduce, reduce_scatter, all_gather, all_to_all, slice, zero."""
    if src == dst:
        return []
    if src == P:
        return [("all_reduce", P, R)] if dst == R else [("reduce_scatter", P, dst)] if isinstance(dst, int) else []
    if isinstance(src, int):
        if dst == R:
            return [("all_gather", src, R)]
        if isinstance(dst, int):
            return [("all_to_all", src, dst)]
        return [("all_gather", src, R), ("zero", R, P)]          # S -> P: gather, then keep it on one rank
    if isinstance(dst, int):
        return [("slice", R, dst)]
    return [("zero", R, P)]


def collective_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring collective handed ``nbytes`` (its local input) over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n * nbytes, "reduce_scatter": (n - 1) / n * nbytes,
            "all_gather": (n - 1) * nbytes, "all_to_all": (n - 1) / n * nbytes}.get(kind, 0.0)


def redistribute_bytes(src, dst, local_nbytes: float, n: int) -> float:
    """Bytes sent per rank to turn ``src`` into ``dst`` along one axis of size ``n``; ``local_nbytes`` is the
    tensor's size on one rank under ``src``."""
    total, cur = 0.0, float(local_nbytes)
    for kind, _, to in redistribute_steps(src, dst):
        total += collective_bytes(kind, cur, n)
        if kind == "all_gather":
            cur *= n
        elif kind in ("reduce_scatter", "slice"):
            cur /= n
    return total


class ShardingMap(dict):
    """``program.shardings(rank)``: node name -> :class:`Sharding` (of its first output) in the joint graph of each
    stage the rank holds (names prefixed ``stage<s>.`` when it holds several); ``modules`` maps a name to the
    module that made it. Printed: the split and partial-sum nodes, grouped by module."""

    def __init__(self, items=(), modules: dict | None = None):
        super().__init__(items)
        self.modules = dict(modules or {})

    def __str__(self) -> str:
        by_mod: dict = {}
        for name, sh in self.items():
            if not sh.is_replicated:
                by_mod.setdefault(self.modules.get(name) or "<root>", []).append(f"{name} {sh}")
        if not by_mod:
            return f"{len(self)} node(s), all whole (replicated)"
        lines = [f"{len(self)} node(s), {sum(len(v) for v in by_mod.values())} split or partial:"]
        for mod, items in by_mod.items():
            lines.append(f"  {mod}: " + ", ".join(items[:8]) + (f" ... (+{len(items) - 8})" if len(items) > 8 else ""))
        return "\n".join(lines)
