"""Exact min-sum search over per-node choices: the dynamic program under Tofu's search (passes/tofu.py).

The problem: variables (one per operator, or per group of a ``_foreach`` op), each with a few labels
(the legal candidates of its sharding rule); unary costs per label (compute, memory) and pairwise
costs per pair of labels (the bytes of redistributing a producer's output into what its consumer
needs). Minimise the sum.

Tofu (Wang et al., EuroSys'19, §5) runs a dynamic program over the coarsened dataflow graph: chains
of operators are fused into one, and the DP walks the graph keeping the choices of the tensors still
live. Variable elimination is the same DP written for any graph (Bertelè and Brioschi, "Nonserial
Dynamic Programming", 1972; Dechter's bucket elimination, 1999): eliminating a variable with one or
two neighbours is Tofu's chain fusion (a min-plus matrix product), and eliminating in min-degree
order keeps the live set small -- a transformer's joint graph (forward chain, backward chain, the
saved activations between them) is ladder-like, so the tables stay a few labels wide. The answer is
the exact optimum; a back-substitution in reverse order recovers the labels. ``solve_blocks`` is Tofu's
coarsening of repeated blocks: each block's interior is eliminated first, once per distinct block.

    >>> p = Problem(); a = p.var(2); b = p.var(2)
    >>> p.unary(a, [0.0, 1.0]); p.pair(a, b, [[5.0, 0.0], [0.0, 5.0]])
    >>> p.solve()                                   # (cost, labels)
    (0.0, [0, 1])
"""
from __future__ import annotations

import heapq

import numpy as np

__all__ = ["Problem", "solve_blocks"]


class Problem:
    def __init__(self):
        self.sizes: list = []             # var -> number of labels
        self.unaries: list = []           # var -> np.ndarray of costs
        self.pairs: dict = {}             # (u, v) with u < v -> np.ndarray [labels u, labels v]
        self.max_table = 0                # the largest table the last solve built (entries)
        self.stats: dict = {}             # the last block solve: blocks, solved (eliminations run), wide (left flat)

    def var(self, n_labels: int) -> int:
        if n_labels < 1:
            raise ValueError("a variable needs at least one label")
        self.sizes.append(int(n_labels))
        self.unaries.append(np.zeros(n_labels))
        return len(self.sizes) - 1

    def unary(self, v: int, costs) -> None:
        self.unaries[v] = self.unaries[v] + np.asarray(costs, dtype=float)

    def pair(self, u: int, v: int, table) -> None:
        t = np.asarray(table, dtype=float)
        if u == v:
            self.unary(u, np.diag(t))
            return
        if u > v:
            u, v, t = v, u, t.T
        key = (u, v)
        self.pairs[key] = self.pairs[key] + t if key in self.pairs else t

    def cost(self, labels) -> float:
        """The objective of one full assignment (what brute force evaluates)."""
        total = sum(float(self.unaries[v][labels[v]]) for v in range(len(self.sizes)))
        return total + sum(float(t[labels[u], labels[v]]) for (u, v), t in self.pairs.items())

    # --- variable elimination ------------------------------------------------------------------------------
    def solve(self, blocks=None, reuse: bool = True):
        """``(optimal cost, labels per var)``: exact; eliminating in min-degree order. ``blocks``: disjoint lists
        of variables (each in a canonical order) whose interiors are eliminated block by block first, and with
        ``reuse`` once per distinct block (``solve_blocks``); ``self.stats`` then says how many were solved."""
        if blocks:
            return solve_blocks(self, blocks, reuse)
        factors = [((v,), self.unaries[v]) for v in range(len(self.sizes))]
        factors += [(k, t) for k, t in self.pairs.items()]
        _, trace, const, self.max_table = _eliminate(factors, None)
        labels = [0] * len(self.sizes)
        _back_substitute(trace, labels)
        return const, labels


def _eliminate(factors: list, targets, sizes=None):
    """Variable elimination of ``targets`` (every variable when None), min-degree first, over ``factors``
    (``[(scope tuple, table)]``). Returns ``(factors left, trace, constant, largest table)``; the factors left
    span only variables not eliminated. With ``sizes`` (labels per variable) it is a dry run: the same order,
    scopes only, no table built; it returns ``(scopes left, entries of every table it would build, largest)``."""
    if sizes is not None:
        return _dry_run(factors, targets, sizes)
    live: dict = {}                          # factor id -> (scope, table)
    of: dict = {}                            # var -> factor ids touching it
    adj: dict = {}                           # var -> neighbours
    for fid, (fs, ft) in enumerate(factors):
        live[fid] = (fs, ft)
        for v in fs:
            of.setdefault(v, set()).add(fid)
            adj.setdefault(v, set()).update(w for w in fs if w != v)
    fid = len(factors)
    todo = set(adj) if targets is None else set(targets) & set(adj)
    heap = [(len(adj[v]), v) for v in todo]
    heapq.heapify(heap)
    trace, const, biggest = [], 0.0, 0       # trace: (var, scope of the combined table, combined table)
    while heap:
        deg, x = heapq.heappop(heap)
        if x not in todo or deg != len(adj[x]):
            continue
        todo.discard(x)
        scope = (x,) + tuple(sorted(adj[x]))
        table = None                         # full shape: every neighbour shares a factor with x
        for f in of.pop(x):
            fs, ft = live.pop(f)
            a = _aligned(ft, fs, scope)
            table = a if table is None else table + a
            for v in fs:
                if v != x:
                    of[v].discard(f)
        biggest = max(biggest, table.size)
        trace.append((x, scope, table))
        red = table.min(axis=0)
        rest = scope[1:]
        if rest:
            live[fid] = (rest, red)
            for v in rest:
                of[v].add(fid)
                adj[v].discard(x)
                adj[v].update(w for w in rest if w != v)
            fid += 1
            for v in rest:
                if v in todo:
                    heapq.heappush(heap, (len(adj[v]), v))
        else:
            const += float(red)
        del adj[x]
    return list(live.values()), trace, const, biggest


def _dry_run(scopes: list, targets, sizes) -> tuple:
    """``_eliminate``'s order on scopes alone: ``(scopes left, entries of every table built, largest table)``."""
    of: dict = {}
    adj: dict = {}
    live = dict(enumerate(scopes))
    for fid, fs in live.items():
        for v in fs:
            of.setdefault(v, set()).add(fid)
            adj.setdefault(v, set()).update(w for w in fs if w != v)
    fid = len(scopes)
    todo = set(adj) if targets is None else set(targets) & set(adj)
    heap = [(len(adj[v]), v) for v in todo]
    heapq.heapify(heap)
    work = biggest = 0
    while heap:
        deg, x = heapq.heappop(heap)
        if x not in todo or deg != len(adj[x]):
            continue
        todo.discard(x)
        rest = tuple(sorted(adj[x]))
        size = sizes[x]
        for v in rest:
            size *= sizes[v]
        work, biggest = work + size, max(biggest, size)
        for f in of.pop(x):
            for v in live.pop(f):
                if v != x:
                    of[v].discard(f)
        if rest:
            live[fid] = rest
            for v in rest:
                of[v].add(fid)
                adj[v].discard(x)
                adj[v].update(w for w in rest if w != v)
            fid += 1
            for v in rest:
                if v in todo:
                    heapq.heappush(heap, (len(adj[v]), v))
        del adj[x]
    return list(live.values()), work, biggest


def _back_substitute(trace, labels) -> None:
    for x, scope, table in reversed(trace):
        idx = (slice(None),) + tuple(labels[v] for v in scope[1:])
        labels[x] = int(np.argmin(table[idx]))


WIDEST = 1 << 20      # a block whose kept variables span more label combinations than this is left flat


def solve_blocks(p: Problem, blocks: list, reuse: bool = True):
    """Tofu's coarsening (§5), exact: eliminate each block's interior as a function of its boundary.

    A block is a list of variables in a canonical order (one-label variables are first folded into their
    neighbours' unaries, which is exact). Its local problem: its own unaries and pairs, and its pairs with
    *free* variables (in no block), which it keeps; its *interface* -- variables with a neighbour in another
    block -- is kept too, and the rest, the interior, is eliminated. That leaves min-plus tables over the
    kept variables, which join every term left in one flat elimination; back-substitution then recovers
    each interior. An interior variable touches only its own block and free variables, so no other block's
    elimination changes its terms: the result is the exact optimum, whatever the blocks.

    Two blocks whose local problems are identical -- label counts, which are kept, and every unary and
    pairwise table, byte for byte -- have identical tables and back-substitution traces; with ``reuse`` each
    distinct local problem is eliminated once (``p.stats["solved"]``) and mapped onto every copy. A block
    equal in structure but not in costs (its neighbours chose differently at an earlier level) is just
    another signature."""
    n = len(p.sizes)
    un, pairs, nbrs = list(p.unaries), {}, [[] for _ in range(n)]
    for (u, v), t in p.pairs.items():
        if p.sizes[v] == 1:
            un[u] = un[u] + t[:, 0]
        elif p.sizes[u] == 1:
            un[v] = un[v] + t[0, :]
        else:
            pairs[(u, v)] = t
            nbrs[u].append(v)
            nbrs[v].append(u)
    owner = {v: b for b, vs in enumerate(blocks) for v in vs}
    if len(owner) != sum(len(vs) for vs in blocks):
        raise ValueError("solve_blocks: the blocks overlap")
    local_problems, kept = [], set()
    for b, vs in enumerate(blocks):
        loc = {v: i for i, v in enumerate(vs)}
        keep = [any(owner.get(w, b) != b for w in nbrs[v]) for v in vs]
        for v in vs:                                       # free neighbours, in order of first encounter
            for w in nbrs[v]:
                if w not in owner and w not in loc:
                    loc[w] = len(loc)
                    keep.append(True)
        allv = list(loc)
        if _width(p.sizes, allv, keep) > WIDEST:
            continue
        kept.add(b)
        local = sorted(_local_pairs(vs, loc, nbrs, pairs), key=lambda e: (e[0], e[1]))
        sig = None
        if reuse:
            sig = (tuple(p.sizes[v] for v in allv), tuple(keep), b"".join(un[v].tobytes() for v in vs),
                   tuple((a, c) for a, c, _ in local), b"".join(t.tobytes() for _, _, t in local))
        local_problems.append((b, vs, keep, allv, local, sig))
    if _blocks_dearer(p, local_problems, owner, kept, pairs, n):
        const, labels = p.solve()                          # a flat elimination builds far smaller tables
        p.stats = {"blocks": 0, "solved": 0, "wide": len(blocks), "flat": True}
        return const, labels
    cache, outer, parts, const, biggest = {}, [], [], 0.0, 0
    for b, vs, keep, allv, local, sig in local_problems:
        solved = cache.get(sig) if sig is not None else None
        if solved is None:
            fs = [((i,), un[v]) for i, v in enumerate(vs)] + [((a, c), t) for a, c, t in local]
            rest, trace, k, big = _eliminate(fs, [i for i in range(len(vs)) if not keep[i]])
            biggest = max(biggest, big)
            solved = (rest, trace, k, {})               # the last: kept labels -> back-substituted labels
            if sig is not None:
                cache[sig] = solved
        rest, trace, k, subs = solved
        const += k
        outer += [(tuple(allv[i] for i in fs), ft) for fs, ft in rest]
        parts.append((allv, keep, trace, subs))
    outer += [((v,), un[v]) for v in range(n) if owner.get(v) not in kept]
    outer += [(key, t) for key, t in pairs.items() if not _consumed(owner.get(key[0]), owner.get(key[1]), kept)]
    _, trace, k, big = _eliminate(outer, None)
    labels = [0] * n
    _back_substitute(trace, labels)
    for allv, keep, trace, subs in parts:           # copies whose kept labels agree share their interior's labels
        lab = [labels[v] if f else 0 for v, f in zip(allv, keep)]
        key = tuple(lab)
        if key not in subs:
            _back_substitute(trace, lab)
            subs[key] = lab
        for v, x in zip(allv, subs[key]):
            labels[v] = x
    p.max_table = max(biggest, big)
    p.stats = {"blocks": len(kept), "solved": len(cache) if reuse else len(kept), "wide": len(blocks) - len(kept)}
    return const + k, labels


def _blocks_dearer(p: Problem, local_problems: list, owner: dict, kept: set, pairs: dict, n: int) -> bool:
    """Whether eliminating block by block would build tables wider than ``WIDEST`` and over four times the entries
    of one flat elimination (by dry runs of both orders: scopes only). Keeping every block's boundary can force
    wide tables where the flat min-degree order does not (a joint graph whose blocks share many saved tensors)."""
    outer, work, seen, biggest = [], 0, set(), 0
    for _, vs, keep, allv, local, sig in local_problems:
        fs = [(i,) for i in range(len(vs))] + [(a, c) for a, c, _ in local]
        rest, w, big = _eliminate(fs, [i for i in range(len(vs)) if not keep[i]], [p.sizes[v] for v in allv])
        if sig is None or sig not in seen:
            work, biggest = work + w, max(biggest, big)
            seen.add(sig)
        outer += [tuple(allv[i] for i in r) for r in rest]
    outer += [(v,) for v in range(n) if owner.get(v) not in kept]
    outer += [key for key in pairs if not _consumed(owner.get(key[0]), owner.get(key[1]), kept)]
    _, w, big = _eliminate(outer, None, p.sizes)
    work, biggest = work + w, max(biggest, big)
    if biggest <= WIDEST:
        return False
    _, flat, _ = _eliminate([(v,) for v in range(n)] + list(p.pairs), None, p.sizes)
    return 4 * flat < work


def _consumed(a, b, kept) -> bool:
    """Whether a pair between variables of blocks ``a`` and ``b`` (None: free) is in a kept block's local problem."""
    return (a in kept and b in (a, None)) or (b in kept and a is None)


def _local_pairs(vs, loc, nbrs, pairs):
    """A block's pairwise tables -- inside it and with free variables -- as ``(local u, local v, table)``, u < v."""
    for v in vs:
        a = loc[v]
        for w in nbrs[v]:
            c = loc.get(w, -1)
            if a < c:
                yield a, c, pairs[(v, w)] if v < w else pairs[(w, v)].T


def _width(sizes, vs, keep) -> int:
    w = 1
    for v, f in zip(vs, keep):
        if f:
            w *= sizes[v]
            if w > WIDEST:
                break
    return w


def _aligned(table, scope, target):
    """``table`` over ``scope`` broadcast to the axes of ``target`` (scope is a subset of target)."""
    if scope == target:
        return table
    if len(scope) == 1:
        shape = [1] * len(target)
        shape[target.index(scope[0])] = table.shape[0]
        return table.reshape(shape)
    order = sorted(range(len(scope)), key=lambda i: target.index(scope[i]))
    t = np.transpose(table, order) if order != list(range(len(scope))) else table
    shape = [1] * len(target)
    for i in order:
        shape[target.index(scope[i])] = table.shape[i]
    return t.reshape(shape)
