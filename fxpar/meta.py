"""The ``node.meta`` keys fxpar writes: one place, one typed value each, one writer each.

Every key starts with ``fxpar_``. The ``writer`` says which module owns the key; other code
reads it but never writes it. When a pass replaces a node it copies only the keys that stay
true (see :func:`copy_meta`) and records the origin in ``fxpar_origin``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx

__all__ = ["MetaKey", "KEYS", "ROLE", "PHASE", "MODULE", "PARAM", "GRAD_OF", "COMM", "BUCKET", "REDUCE_GRAD",
           "ORIGIN", "PASS", "RECOMPUTE_OF", "UNSHARD", "get", "set_meta", "copy_meta", "CommInfo"]


@dataclass(frozen=True)
class MetaKey:
    name: str
    type: Any
    writer: str
    doc: str


@dataclass(frozen=True)
class CommInfo:
    """What a collective node does: kind, the mesh axis and ranks of its group, bytes per rank."""
    kind: str                 # "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv"
    axis: str                 # mesh axis name, e.g. "dp"
    ranks: tuple              # global ranks of the group, in group order
    nbytes: int               # size of the tensor handed to the collective on this rank
    # for "send"/"recv", ranks is (src, dst) on both sides
    reduce_op: str = "sum"


ROLE = MetaKey("fxpar_role", str, "fxpar.capture",
               "placeholders and outputs: 'param', 'buffer', 'opt_state', 'lr', 'step', 'input', "
               "'target'; outputs: 'loss', 'new_param', 'new_buffer', 'new_opt_state', 'grad'")
PHASE = MetaKey("fxpar_phase", str, "fxpar.capture", "'forward', 'backward' or 'optimizer'")
MODULE = MetaKey("fxpar_module", str, "fxpar.capture",
                 "dotted path of the user's module that produced the node ('' for the root)")
PARAM = MetaKey("fxpar_param", str, "fxpar.capture",
                "on param/buffer/opt_state placeholders: the model's key (e.g. 'blocks.0.fc.weight')")
GRAD_OF = MetaKey("fxpar_grad_of", str, "fxpar.capture (passes.data_parallel and passes.bucket mark the synchronised copy too)",
                  "on a gradient node: the parameter's key (the raw per-microbatch gradient keeps it)")
COMM = MetaKey("fxpar_comm", CommInfo, "passes (the pass that inserted the collective)",
               "on a functional-collective node: what it sends")
BUCKET = MetaKey("fxpar_bucket", int, "passes.bucket", "on a collective of a gradient bucket: bucket index")
REDUCE_GRAD = MetaKey("fxpar_reduce_grad", str, "passes.data_parallel (and passes.bucket, which replaces its nodes)",
                      "'issue': gathers gradients and starts their collective (the REDUCE_GRAD graph); "
                      "'wait': waits for it and reads the result (the STEP graph)")
ORIGIN = MetaKey("fxpar_origin", str, "fxpar.pass_manager", "name of the node this one replaced, if any")
PASS = MetaKey("fxpar_pass", str, "fxpar.pass_manager", "name of the pass that created the node")
RECOMPUTE_OF = MetaKey("fxpar_recompute_of", str, "passes.recompute",
                       "on a backward node that recomputes a forward value: the forward node it copies")
UNSHARD = MetaKey("fxpar_unshard", bool, "passes.zero",
                  "ZeRO-3 under a pipeline: the node gathers a parameter once per step (the UNSHARD graph)")

KEYS = {k.name: k for k in (ROLE, PHASE, MODULE, PARAM, GRAD_OF, COMM, BUCKET, REDUCE_GRAD, ORIGIN, PASS,
                            RECOMPUTE_OF, UNSHARD)}

# Keys that stay true when a node is replaced by an equivalent computation.
_PORTABLE = ("val", "tensor_meta", PHASE.name, MODULE.name)


def get(node: torch.fx.Node, key: MetaKey, default=None):
    return node.meta.get(key.name, default)


def set_meta(node: torch.fx.Node, key: MetaKey, value) -> None:
    if key.name not in KEYS:
        raise KeyError(f"{key.name} is not declared in fxpar.meta")
    node.meta[key.name] = value


def copy_meta(src: torch.fx.Node, dst: torch.fx.Node) -> None:
    """Copy what stays true from ``src`` to its replacement ``dst`` and record the origin."""
    for k in _PORTABLE:
        if k in src.meta:
            dst.meta[k] = src.meta[k]
    dst.meta[ORIGIN.name] = src.name
