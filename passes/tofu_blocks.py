"""The repeated blocks of a joint graph, for Tofu's coarsening (passes/tofu.py, Wang et al. EuroSys'19 §5).

Tofu searches each repeated block (a transformer layer) once. Here a block is the set of search
variables -- operators, ``_foreach`` groups, parameters and optimizer state -- that belong to one child
of a ``ModuleList`` (``blocks.3``, ``model.layers.7``); ``passes.sharding.search.solve_blocks`` then
eliminates each block's interior once per distinct local problem. Which blocks really are the same is
decided there, by comparing their local problems byte for byte, so a wrong assignment here costs speed,
never the optimum.

Labels are trusted only where they are reliable:

* anchors: forward operators by ``fxpar_module`` (``blocks.1.fc`` -> ``blocks.1``; anything outside a
  repeated family -> OUT), parameters and optimizer state by ``fxpar_param`` (``exp_avg:blocks.1.fc.weight``);
* everything else -- backward operators (their ``fxpar_module`` is often stale: a ``view`` of block 0's
  backward is tagged ``blocks.1``), ``_foreach`` groups (module ``''``) -- takes its block by data flow, in
  waves from the anchors: a variable joins a block when every already-assigned neighbour (producer or
  consumer, one-label variables excluded) is in that block; a variable between two blocks stays outside.

On the test GPT (4 layers, AdamW joint step) every block gets 253 variables: 32 forward operators, 53
backward ones (45 of these 4 x 53 carry a stale ``fxpar_module``, e.g. ``mm_11`` tagged ``blocks.3`` lands in
``blocks.2``, whose ``fc2`` weight it multiplies by), 36 parameters and optimizer states, and 132 ``_foreach``
groups. The seams stay free: each ``ln1`` backward (it reads the previous block's output) and the
residual gradient adds. ``solve_blocks`` then eliminates 3 blocks, not 4, per level::

    level tp0: blocks.0 (touches the embeddings) | blocks.1 == blocks.2 (eliminated once) | blocks.3 (head)
"""
from __future__ import annotations

import operator

from fxpar import meta as M
from fxpar.roles import Role

__all__ = ["block_of", "assign_blocks", "block_lists"]

OUT = "<outside>"       # an anchor outside every repeated family (embeddings, head, loss)


def block_of(path: str) -> tuple:
    """``(family, index)`` of the first numbered component of a dotted path (``blocks.3.fc`` -> ``("blocks", 3)``),
    or None (``wte``, ``''``)."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if i and part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def _anchor(n):
    if n.op == "placeholder":
        if M.get(n, M.ROLE) not in (Role.PARAM, Role.OPT_STATE):
            return None
        key = M.get(n, M.PARAM) or ""
        return block_of(key.split(":", 1)[-1]) or OUT
    if M.get(n, M.PHASE, "forward") == "forward" and n.target is not operator.getitem:
        return block_of(M.get(n, M.MODULE) or "") or OUT
    return None


def assign_blocks(vars_: dict, sizes: list, pairs) -> dict:
    """``{(node, group): block}`` from one level's problem: ``vars_`` maps ``(node, group)`` to ``(variable, labels)``,
    ``sizes`` are the variables' label counts and ``pairs`` the problem's pairwise keys ``(u, v)``. Blocks of a
    family seen only once are dropped."""
    owner = {}
    for (n, _), (v, _) in vars_.items():
        a = _anchor(n)
        if a is not None:
            owner[v] = a
    adj = [[] for _ in sizes]
    for u, v in pairs:
        if sizes[u] > 1 and sizes[v] > 1:
            adj[u].append(v)
            adj[v].append(u)
    front = list(owner)
    while front:
        new = {}
        for w in {w for v in front for w in adj[v] if w not in owner and sizes[w] > 1}:
            seen = {owner[x] for x in adj[w] if x in owner}
            if len(seen) == 1:
                new[w] = seen.pop()
        owner.update(new)
        front = list(new)
    per_family: dict = {}
    for b in set(owner.values()) - {OUT}:
        per_family.setdefault(b[0], set()).add(b[1])
    return {k: owner[v] for k, (v, _) in vars_.items()
            if owner.get(v, OUT) != OUT and len(per_family[owner[v][0]]) > 1}


def block_lists(vars_: dict, owner: dict) -> list:
    """One level's blocks as lists of its variables (``vars_``: ``(node, group)`` -> ``(variable, labels)``), in block
    order, each in creation (graph) order: the canonical order two identical blocks share."""
    by: dict = {}
    for k, b in owner.items():
        by.setdefault(b, []).append(vars_[k][0])
    return [sorted(vs) for _, vs in sorted(by.items())]
