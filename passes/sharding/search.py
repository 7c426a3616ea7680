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
the exact optimum; a back-substitution in reverse order recovers the labels.

    >>> p = Problem(); a = p.var(2); b = p.var(2)
    >>> p.unary(a, [0.0, 1.0]); p.pair(a, b, [[5.0, 0.0], [0.0, 5.0]])
    >>> p.solve()                                   # (cost, labels)
    (0.0, [0, 1])
"""
from __future__ import annotations

import heapq

import numpy as np

__all__ = ["Problem"]


class Problem:
    def __init__(self):
        self.sizes: list = []             # var -> number of labels
        self.unaries: list = []           # var -> np.ndarray of costs
        self.pairs: dict = {}             # (u, v) with u < v -> np.ndarray [labels u, labels v]
        self.max_table = 0                # the largest table the last solve built (entries)

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
    def solve(self):
        """``(optimal cost, labels per var)``: exact; eliminating in min-degree order."""
        n = len(self.sizes)
        factors: dict = {}                       # id -> (scope tuple, table)
        of: list = [set() for _ in range(n)]     # var -> factor ids touching it
        adj: list = [set() for _ in range(n)]
        for v in range(n):
            factors[v] = ((v,), self.unaries[v])
            of[v].add(v)
        fid = n
        for (u, v), t in self.pairs.items():
            factors[fid] = ((u, v), t)
            of[u].add(fid)
            of[v].add(fid)
            adj[u].add(v)
            adj[v].add(u)
            fid += 1
        heap = [(len(adj[v]), v) for v in range(n)]
        heapq.heapify(heap)
        done = [False] * n
        trace = []                               # (var, scope of the combined table, combined table)
        const = 0.0
        self.max_table = 0
        while heap:
            deg, x = heapq.heappop(heap)
            if done[x] or deg != len(adj[x]):
                continue
            done[x] = True
            scope = (x,) + tuple(sorted(adj[x]))
            table = None                         # full shape: every neighbour shares a factor with x
            for f in of[x]:
                fs, ft = factors.pop(f)
                a = _aligned(ft, fs, scope)
                table = a if table is None else table + a
                for v in fs:
                    if v != x:
                        of[v].discard(f)
            self.max_table = max(self.max_table, table.size)
            trace.append((x, scope, table))
            red = table.min(axis=0)
            rest = scope[1:]
            if rest:
                factors[fid] = (rest, red)
                for v in rest:
                    of[v].add(fid)
                    adj[v].discard(x)
                    adj[v].update(w for w in rest if w != v)
                fid += 1
                for v in rest:
                    heapq.heappush(heap, (len(adj[v]), v))
            else:
                const += float(red)
            adj[x] = set()
        labels = [0] * n
        for x, scope, table in reversed(trace):
            idx = (slice(None),) + tuple(labels[v] for v in scope[1:])
            labels[x] = int(np.argmin(table[idx]))
        return const, labels


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
