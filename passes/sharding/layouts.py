"""What is fixed before propagation: ``fxpar.shard`` annotations and Mesh-TensorFlow-style layouts.

Layouts are glob patterns over parameter keys (``{"blocks.*.mlp.fc1.weight": ("tp", None)}``,
Shazeer et al., Mesh-TensorFlow, NeurIPS'18: a layout maps tensor dims to mesh axes); a parameter's
optimizer state takes its layout; a tied parameter matches by either key. Each is checked against
its tensor and the mesh here, with errors naming the pattern or the annotation.
"""
from __future__ import annotations

import fnmatch

import torch

from fxpar import meta as M
from fxpar.annotate import annotated_value, is_shard_node, spec_of
from fxpar.roles import Role
from fxpar.sharding import Sharding, ShardingError

__all__ = ["fixed_shardings", "ShardingConflict", "describe", "strip_annotations"]


class ShardingConflict(ShardingError):
    """Two annotations or layouts ask one node for different shardings."""


def describe(node) -> str:
    """``node 'addmm' (blocks.0.fc) of shape [8, 64]`` for error messages."""
    v = node.meta.get("val")
    shape = list(v.shape) if isinstance(v, torch.Tensor) else "?"
    mod = M.get(node, M.MODULE) or M.get(node, M.PARAM) or ""
    return f"node {node.name!r}" + (f" ({mod})" if mod else "") + f" of shape {shape}"


def fixed_shardings(gm, sizes: dict, layouts: dict, aliases: dict) -> dict:
    """``{node: (Sharding, source)}`` from annotations and layouts, each checked against its tensor and mesh."""
    fixed = {}
    for n in gm.graph.nodes:
        if is_shard_node(n):
            val = annotated_value(n)
            spec = spec_of(n)
            src = f"fxpar.shard(..., {spec}) in {M.get(n, M.MODULE) or '<root>'} (node {val.name if val else n.name})"
            spec.check_axes(sizes, src)
            spec.local_shape(n.meta["val"].shape, sizes, name=f"the tensor annotated by {src}")
            if val is not None:
                fixed[val] = (spec, src)
    if not layouts:
        return fixed
    by_key = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and M.get(n, M.ROLE) in (Role.PARAM, Role.OPT_STATE):
            by_key.setdefault(M.get(n, M.PARAM).split(":", 1)[-1], []).append(n)
    inv = {}
    for alias, canon in (aliases or {}).items():
        inv.setdefault(canon, []).append(alias)
    used = set()
    for key, nodes in by_key.items():
        hits = [(pat, spec) for pat, spec in layouts.items()
                if any(fnmatch.fnmatchcase(k, pat) for k in [key] + inv.get(key, []))]
        used.update(p for p, _ in hits)
        specs = {tuple(s) for _, s in hits}
        if len(specs) > 1:
            raise ShardingConflict(f"parameter {key!r} matches layouts {hits[0][0]!r}: {tuple(hits[0][1])} and "
                                   f"{hits[1][0]!r}: {tuple(hits[1][1])}, which differ; make the patterns match it once")
        if not hits:
            continue
        pat, spec = hits[0]
        sh = spec if isinstance(spec, Sharding) else Sharding(tuple(spec))
        src = f"layout {pat!r}: {tuple(sh.dims)}"
        sh.check_axes(sizes, src)
        for n in nodes:
            sh.local_shape(n.meta["val"].shape, sizes, name=f"parameter {key!r} ({src})")
            fixed[n] = (sh, src)
    unused = [p for p in layouts if p not in used]
    if unused:
        raise ShardingError(f"layout pattern {unused[0]!r} matches no parameter; parameter keys look like "
                            f"{sorted(by_key)[:4]} -- fix the pattern (glob syntax: * matches any text)")
    return fixed


def strip_annotations(gm) -> None:
    """Drop the graph's ``fxpar.shard`` markers in place (the annotated value is the plain one): Tofu's search
    decides every node itself, and the graph it lowers has no markers either."""
    for n in list(gm.graph.nodes):
        if is_shard_node(n):
            for u in list(n.users):
                val = annotated_value(n)
                if val is u:
                    u.replace_all_uses_with(u.args[0])
                    gm.graph.erase_node(u)
            gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code()
    gm.recompile()
