"""The ``node.meta`` keys fxpar writes: one place, one typed value each, one writer each.

Every key starts with ``fxpar_``. The ``writer`` says which module owns the key; other code
reads it but never writes it. When a pass replaces a node it copies only the keys that stay
true (see :func:`copy_meta`) and records the origin in ``fxpar_origin``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx

from .roles import GraphKind, Role

__all__ = ["MetaKey", "KEYS", "ROLE", "PHASE", "MODULE", "PARAM", "GRAD_OF", "COMM", "BUCKET", "REDUCE_GRAD",
           "ORIGIN", "PASS", "RECOMPUTE_OF", "UNSHARD", "get", "set_meta", "copy_meta", "CommInfo", "GRAPH_KEYS"]


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
    # a node that issues several collectives one after another on this group (a compressed bucket sum):
    # ((kind, bytes), ...) in order, each costed on its own; empty: the one collective kind and nbytes describe
    parts: tuple = ()


ROLE = MetaKey("fxpar_role", Role, "fxpar.capture",
               "on placeholders: the input's fxpar.roles.Role (PARAM, BUFFER, OPT_STATE, LR, STEP, INPUT, TARGET, "
               "ACT, TANGENT; a pass that adds an input gives it the member that says where its value comes from)")
PHASE = MetaKey("fxpar_phase", str, "fxpar.capture", "'forward', 'backward' or 'optimizer'")
MODULE = MetaKey("fxpar_module", str, "fxpar.capture",
                 "dotted path of the user's module that produced the node ('' for the root)")
PARAM = MetaKey("fxpar_param", str, "fxpar.capture",
                "on param/buffer/opt_state placeholders: the model's key (e.g. 'blocks.0.fc.weight')")
GRAD_OF = MetaKey("fxpar_grad_of", str, "fxpar.capture (passes.data_parallel and passes.bucket mark the synchronised copy "
                  "too; passes.precision moves it to the gradient cast back to the master dtype)",
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
INNER_COMPUTE = MetaKey("fxpar_inner_compute", tuple, "fxpar.compress.feature",
                        "on a node that runs a traced graph of its own beside its collectives (a compressed bucket "
                        "sum): (aten ops, flops, bytes, collectives, ((op class, flops, bytes), ...)) of that graph's "
                        "compute, for the cost models")
UNSHARD = MetaKey("fxpar_unshard", bool, "passes.zero",
                  "ZeRO-3 under a pipeline: the node gathers a parameter once per step (the UNSHARD graph)")
ON_HOST = MetaKey("fxpar_on_host", bool, "passes.zero_offload",
                  "offload to the host on a rank that computes on a device: the value lives in host memory (the "
                  "offloaded state, the gradient chunks copied down, the update's values); the memory model counts "
                  "device memory without it")

KEYS = {k.name: k for k in (ROLE, PHASE, MODULE, PARAM, GRAD_OF, COMM, BUCKET, REDUCE_GRAD, ORIGIN, PASS,
                            RECOMPUTE_OF, UNSHARD, INNER_COMPUTE, ON_HOST)}

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


# ---- graph-level keys: ``gm.meta`` of a joint or cut graph ------------------------------------------------------
SIGNATURE = MetaKey("fxpar_signature", "fxpar.capture.StepSignature", "fxpar.capture (fxpar.lower copies it per stage)",
                    "the (role, key) of every input and output; a pass that adds inputs or outputs appends to it")
OPTIMIZER = MetaKey("fxpar_optimizer", dict, "fxpar.lower", "Plan.optimizer, for graphs cut later (how the update runs)")
KIND = MetaKey("fxpar_kind", GraphKind, "passes.split_graphs (and the carry's graphs)",
               "the graph kind a cut graph is (fxpar.roles.GraphKind, or a feature's own kind: the carry's FIRST ...)")
GRAD_PRESCALE = MetaKey("fxpar_grad_prescale", int, "passes.data_parallel",
                        "backward's seed was divided by this (dp): gradients arrive pre-averaged")
ZERO = MetaKey("fxpar_zero", dict, "passes.zero", "ZeRO's layout of the stage: stage, n, per key [shape, chunk numel]")
ZERO_OFFLOAD = MetaKey("fxpar_zero_offload", dict, "passes.zero_offload", "where the update runs and what moved")
BYTEPS = MetaKey("fxpar_byteps", dict, "passes.byteps", "the servers' messages of one step, in order")
SHARDINGS = MetaKey("fxpar_shardings", "passes.propagate_sharding.ShardingResult", "passes.tensor_parallel",
                    "every node's sharding as decided (Program.shardings reads it)")
TP_MODULES = MetaKey("fxpar_tp_modules", dict, "passes.tensor_parallel", "node name -> the user's module path")
CARRY = MetaKey("fxpar_carry", bool, "passes.comm_schedule / passes.delayed_update",
                "a fused step whose waits and update move into the next step (the feature derives FIRST and DRAIN)")
CARRY_STEP = MetaKey("fxpar_carry_step", list, "passes.comm_schedule",
                     "split graphs: the STEP moves into the next step's first F (the feature derives F_UPDATE)")
DELAYED_UPDATE = MetaKey("fxpar_delayed_update", bool, "passes.comm_schedule / passes.delayed_update",
                         "the carried update is the one-step delayed update")

GRAPH_KEYS = {k.name: k for k in (SIGNATURE, OPTIMIZER, KIND, GRAD_PRESCALE, ZERO, ZERO_OFFLOAD, BYTEPS, SHARDINGS,
                                  TP_MODULES, CARRY, CARRY_STEP, DELAYED_UPDATE)}
