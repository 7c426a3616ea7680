"""``fxpar.shard(x, spec)``: a GShard-style sharding annotation inside a model's forward.

    def forward(self, x):                                  # x: [batch, seq, hidden]
        x = fxpar.shard(x, ("dp", None, "tp"))             # identity on one device
        ...

On one device it is the identity: ``x + marker(x.detach())``, where the marker is a custom op
(``torch.ops.fxpar.shard``, so ``make_fx`` keeps it as one node) that returns zeros. The value is
``x`` exactly and the backward is the identity (the gradient flows through the add; the marker sees
a detached input). A custom op with its own autograd formula would be simpler, but the capture
traces ``functionalize(vjp(...))`` and torch cannot functionalize a Python autograd formula (torch
2.13: "NYI: Functionalize rule for custom_function_call"). The captured step holds::

    detach = torch.ops.aten.detach.default(addmm)                           # fxpar_phase=forward
    shard = torch.ops.fxpar.shard.default(detach, '["dp", null, "tp"]')
    add = torch.ops.aten.add.Tensor(addmm, shard)                           # the annotated value

``passes.propagate_sharding`` fixes the sharding of ``add`` (:func:`annotated_value`) to the spec
(:func:`spec_of`); ``passes.lower_sharding`` replaces ``add`` by ``addmm`` laid out that way.
The gradient is not annotated: propagation decides it from the forward (Lepikhin et al., GShard,
ICLR'21, §3.2: annotations are on the forward; the backward follows).
"""
from __future__ import annotations

import json

import torch

from .sharding import Sharding, ShardingError

__all__ = ["shard", "SHARD_OP", "spec_of", "is_shard_node", "annotated_value"]


def _encode(spec, x: torch.Tensor) -> str:
    dims = spec.dims if isinstance(spec, Sharding) else spec
    if not isinstance(dims, (tuple, list)) or not all(s is None or isinstance(s, str) for s in dims):
        raise ShardingError(f"fxpar.shard(x, {spec!r}): the spec is a tuple with one entry per dim of x, each a mesh "
                            "axis name or None, e.g. ('dp', None, 'tp')")
    if len(dims) != x.dim():
        raise ShardingError(f"fxpar.shard(x, {spec!r}): x has {x.dim()} dims (shape {list(x.shape)}) but the spec has "
                            f"{len(dims)} entries; give one entry (a mesh axis or None) per dim")
    return json.dumps(list(dims))


@torch.library.custom_op("fxpar::shard", mutates_args=())
def _shard_op(x: torch.Tensor, spec: str) -> torch.Tensor:
    """The marker: zeros shaped like ``x`` (:func:`shard` adds it to x)."""
    return torch.zeros_like(x)


@_shard_op.register_fake
def _(x, spec):
    return torch.empty_like(x)


SHARD_OP = torch.ops.fxpar.shard.default


def shard(x: torch.Tensor, spec) -> torch.Tensor:
    """Annotate ``x``: dim i is split over mesh axis ``spec[i]`` (or not, for None). Identity on one device."""
    return x + torch.ops.fxpar.shard(x.detach(), _encode(spec, x))


def is_shard_node(node) -> bool:
    return node.op == "call_function" and node.target is SHARD_OP


def spec_of(node) -> Sharding:
    """The sharding an ``fxpar.shard`` node asks for."""
    return Sharding.from_json(json.loads(node.args[1]))


def annotated_value(shard_node):
    """The node carrying ``shard_node``'s annotation, ``add(x, shard(detach(x)))``; None if it was rewritten away."""
    for u in shard_node.users:
        if u.op == "call_function" and len(u.args) == 2 and u.args[1] is shard_node:
            return u
    return None
