"""``explain()``'s lines per tensor of a compressed bucket: each gradient's name, shape, what happens to it, and its
share of the bucket's bytes before and after.

Most methods compress a bucket as one flat buffer (chunks of a quantizer, the k values of a sparsifier, ByteGrad's
dp chunks), so a tensor has no bytes of its own on the wire: its share is counted **in proportion to its values**,
``wire_bytes * numel_t / numel``, apportioned to whole bytes by largest remainder so the shares add up to the
bucket's bytes exactly (the bucket line is exact; the shares are a split of it). Where a method sends each value on
its own (FP16, BF16) the proportional share is the tensor's exact bytes.

Repeated layers collapse: tensors whose names differ only in their numbers (``layers.0.attn.weight``,
``layers.1.attn.weight``) and whose shapes are equal make one line (``layers.*.attn.weight x2``), and a bucket
shows at most :data:`MAX_LINES` lines, then ``... and N more tensors`` with their bytes.
"""
from __future__ import annotations

import math
import re

from .method import BucketInfo

__all__ = ["tensor_lines", "shares", "MAX_LINES"]

MAX_LINES = 8        # tensor lines per bucket before "... and N more"

_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def shares(total: int, sizes: list) -> list:
    """``total`` split over ``sizes`` in proportion, whole numbers that add up to ``total`` (largest remainder;
    ties to the earlier)."""
    whole = sum(sizes)
    if whole <= 0:
        return [0] * len(sizes)
    exact = [total * s / whole for s in sizes]
    out = [math.floor(x) for x in exact]
    left = total - sum(out)
    order = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[:left]:
        out[i] += 1
    return out


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def tensor_lines(bucket: BucketInfo, how: str, after_total: int, what: str, rule: str = "in proportion to its values",
                 before_total: int | None = None) -> list:
    """A head line (``how``: what happens to every tensor of the bucket), then per tensor of ``bucket`` (repeated
    layers collapsed, at most :data:`MAX_LINES` lines): ``name [shape]: what; before B -> after B``, where ``after`` is its share of ``after_total`` counted by ``rule`` (a phrase, shown once
    in the first line) and ``before`` its bytes in an all-reduce of the bucket (a share of ``before_total`` where
    given: a method that sends something other than the gradient, such as weights)."""
    sizes = [_numel(s) for s in bucket.shapes]
    es = bucket.element_size
    before = shares(before_total, sizes) if before_total is not None else [n * es for n in sizes]
    after = shares(int(after_total), sizes)
    groups: dict = {}
    for key, shape, b, a in zip(bucket.keys, bucket.shapes, before, after):
        pattern = _NUMBER.sub("*", str(key))
        g = groups.setdefault((pattern, tuple(int(s) for s in shape)), {"keys": [], "before": 0, "after": 0})
        g["keys"].append(str(key))
        g["before"] += b
        g["after"] += a
    lines = [f"per tensor: {how}; a tensor's bytes after are its share of the bucket's {int(after_total)} B "
             f"counted {rule}"]
    rows = list(groups.items())
    for (pattern, shape), g in rows[:MAX_LINES]:
        n = len(g["keys"])
        name = g["keys"][0] if n == 1 else f"{pattern} x{n}"
        each = "" if n == 1 else " together"
        lines.append(f"  {name} {list(shape)}: {what}; {g['before']} B -> {g['after']} B{each}")
    rest = rows[MAX_LINES:]
    if rest:
        count = sum(len(g["keys"]) for _, g in rest)
        b = sum(g["before"] for _, g in rest)
        a = sum(g["after"] for _, g in rest)
        lines.append(f"  ... and {count} more tensors: {b} B -> {a} B")
    return lines
