"""A device mesh: named axes over ranks, row-major (the last axis varies fastest).

    >>> m = Mesh((("pp", 2), ("dp", 2)))
    >>> m.coords(3), m.group(3, "dp"), m.groups("dp")
    ({'pp': 1, 'dp': 1}, (2, 3), [(0, 1), (2, 3)])
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["Mesh"]


@dataclass(frozen=True)
class Mesh:
    axes: tuple  # ((name, size), ...)

    @property
    def names(self) -> tuple:
        return tuple(n for n, _ in self.axes)

    @property
    def shape(self) -> tuple:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        out = 1
        for s in self.shape:
            out *= s
        return out

    def axis_size(self, axis: str) -> int:
        return dict(self.axes).get(axis, 1)

    def coords(self, rank: int) -> dict:
        out = {}
        for name, size in reversed(self.axes):
            out[name] = rank % size
            rank //= size
        return {n: out[n] for n in self.names}

    def rank_of(self, coords: dict) -> int:
        r = 0
        for name, size in self.axes:
            r = r * size + coords.get(name, 0)
        return r

    def group(self, rank: int, axis: str) -> tuple:
        """The ranks that differ from ``rank`` only along ``axis``, in axis order."""
        if axis not in self.names:
            return (rank,)
        c = self.coords(rank)
        return tuple(self.rank_of({**c, axis: i}) for i in range(self.axis_size(axis)))

    def groups(self, axis: str) -> list:
        """Every group along ``axis``, in a fixed order (every rank creates them in this order)."""
        others = [(n, s) for n, s in self.axes if n != axis]
        out = []
        for combo in itertools.product(*(range(s) for _, s in others)):
            c = dict(zip((n for n, _ in others), combo))
            out.append(tuple(self.rank_of({**c, axis: i}) for i in range(self.axis_size(axis))))
        return out

    def __str__(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in self.axes) or "single rank"
