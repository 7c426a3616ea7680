"""A rank's step as a sequence: the graphs and messages it runs in order, simulated as one program.

A schedule gives each rank a list of actions (``F``, ``B``, ``SEND``, ``RECV``, ``REDUCE_GRAD``,
``STEP``, ...). :func:`cost_models.estimate` takes that list per rank::

    estimate({0: [("F0.0", f0), send01, ("F0.1", f0), send01, recv10, ("B0.1", b0), ...],
              1: [recv01, ("F1.0", f1), ("B1.0", b1), send10, ...]}, cluster)

An item of a sequence is one of:

=====================================  ===========================================================
``gm`` (a ``torch.fx.GraphModule``)    a graph, run in order; its collectives as on its own
``(label, gm)`` or ``Item(gm, label,   a named graph: the label names it in timelines, errors,
keep=...)``                            ``("wait", label)`` and ``keep`` (memory, see below)
``CommInfo("send", ax, (s, d), n)``    a message to ``d``: issued, never blocks compute (isend);
                                       it completes by the end of the step at the latest
``CommInfo("recv", ax, (s, d), n)``    a message from ``s``: compute blocks until it arrives
``(label, CommInfo)``                  the same, named
``("wait", label)``                    block until the collectives that the items labelled
                                       ``label`` returned unwaited have finished (``None``: all)
=====================================  ===========================================================

The n-th send ``s -> d`` meets the n-th recv at ``d`` from ``s``; the transfer (α + n/β on the
link between them) starts once both are issued and that pair's channel is free, beside the ranks'
collective lanes (:mod:`cost_models.simulate`).

Collectives across graphs: a collective a graph returns without a ``wait_tensor`` (REDUCE_GRAD
starting its bucket all_reduces) stays in flight after the graph ends. A later graph's
``wait_tensor`` on a *placeholder* waits on it, where that wait sits in the later graph (STEP
waiting on the buckets): the pending collective whose node (or the getitem of it that the graph
returns) has the placeholder's name, else the oldest one still pending (issue order). An explicit
``("wait", label)`` item waits too; what nobody waits on completes by the end of the step.

Each distinct graph is costed once (:func:`compile_program` caches by identity, then by code and
input shapes), and the flattened steps are shared by every rank whose sequence has the same shape.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import torch.fx

from .memory import sequence_peak
from .simulate import compile_program

__all__ = ["Item", "SequenceProgram", "compile_sequence"]

_P2P = ("send", "recv")


@dataclass(frozen=True)
class Item:
    """A graph of a sequence, with a label and how long its outputs stay alive (memory only).

    ``keep``: ``None`` (the next graph reads them), a later item's label, ``"end"``, or a dict
    ``{flat output index: label or "end"}``; see :func:`cost_models.memory.sequence_peak`.
    ``beside``: ``(bytes while it runs, bytes after its end)`` the runtime makes for this graph outside it (a
    feature's copy of the weights the graph reads; what an update's correction builds after it), freed by the next.
    """
    gm: torch.fx.GraphModule
    label: str = ""
    keep: object = None
    groups: object = None         # {(axis, ranks in the graph's CommInfo): this rank's ranks}: ranks sharing a
    #                               graph lowered for another rank (tensor parallelism: one graph per stage)
    beside: tuple = (0.0, 0.0)
    fused: bool = False           # compiled by an op-fusing compiler: priced by cost_models.fusion


@dataclass(frozen=True)
class _Message:
    info: object                  # a fxpar.meta.CommInfo of kind send or recv
    label: str = ""


@dataclass(frozen=True)
class _Wait:
    label: object = None


def _beside(item) -> tuple:
    return tuple(getattr(item, "beside", None) or (0.0, 0.0))


def _is_comm(x) -> bool:
    return all(hasattr(x, a) for a in ("kind", "ranks", "nbytes", "axis"))


def _item(entry, rank, pos):
    if isinstance(entry, (Item, _Message, _Wait)):
        return entry
    if isinstance(entry, torch.fx.GraphModule):
        return Item(entry)
    if _is_comm(entry):
        return _message(entry, "", rank, pos)
    if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
        a, b = entry
        if a == "wait" and (b is None or isinstance(b, str)):
            return _Wait(b)
        if isinstance(b, torch.fx.GraphModule):
            return Item(b, a)
        if _is_comm(b):
            return _message(b, a, rank, pos)
    raise TypeError(f"rank {rank}, item {pos}: {entry!r:.100} is not a GraphModule, a (label, GraphModule) pair, "
                    "an Item, a send/recv CommInfo (or a (label, CommInfo) pair) or ('wait', label)")


def _message(info, label, rank, pos):
    where = f"rank {rank}, item {pos}{f' ({label})' if label else ''}"
    if info.kind not in _P2P:
        raise ValueError(f"{where}: a {info.kind} CommInfo cannot stand alone in a sequence; only send/recv "
                         "messages can. Put the collective in a graph (a node with node.meta['fxpar_comm']).")
    ranks = tuple(info.ranks)
    if len(ranks) != 2 or ranks[0 if info.kind == "send" else 1] != rank:
        raise ValueError(f"{where}: {info.kind} with ranks={ranks}; ranks is (src, dst) on both sides, and the "
                         f"{'src' if info.kind == 'send' else 'dst'} must be this rank ({rank})")
    return _Message(info, label)


class _Flat:
    """Steps of one sequence shape (shared by ranks): steps, segments, and where comm k came from."""

    def __init__(self, items, parts, rank):
        self.steps: list = []
        self.segments: list = []
        self.seg_item: list = []
        self.comm_src: list = []              # global comm k -> (item index, local k or None)
        pending: list = []                    # [global k, item index, names] issued, returned unwaited
        labels = [getattr(it, "label", "") for it in items]

        def wait_for(name):
            hit = next((e for e in pending if name in e[2]), pending[0] if pending else None)
            if hit is not None:
                pending.remove(hit)
                self.steps.append(("wait", hit[0]))

        for i, (it, p) in enumerate(zip(items, parts)):
            if p is not None:
                c0, s0 = len(self.comm_src), len(self.segments)
                self.segments.extend(p.segments)
                self.seg_item.extend([i] * len(p.segments))
                self.comm_src.extend((i, k) for k in range(len(p.infos)))
                waits_at: dict = {}
                for pos, name in p.placeholder_waits:
                    waits_at.setdefault(pos, []).append(name)
                for pos, st in enumerate(p.steps):
                    for name in waits_at.get(pos, ()):
                        wait_for(name)
                    if st[0] == "compute":
                        self.steps.append(("compute", st[1], st[2] + s0))
                    elif st[0] == "issue":
                        self.steps.append(("issue", st[1] + c0))
                    elif st[1] in p.deferred:
                        pending.append([st[1] + c0, i, p.deferred[st[1]]])
                    else:
                        self.steps.append(("wait", st[1] + c0))
                for name in waits_at.get(len(p.steps), ()):
                    wait_for(name)
            elif isinstance(it, _Message):
                k = len(self.comm_src)
                self.comm_src.append((i, None))
                self.steps.append(("issue", k))
                if it.info.kind == "recv":
                    self.steps.append(("wait", k))
            else:
                if it.label is not None and it.label not in labels[:i]:
                    raise ValueError(f"rank {rank}, item {i}: ('wait', {it.label!r}) names no earlier item of the "
                                     f"sequence; labels before it: {sorted(set(x for x in labels[:i] if x))[:12]}")
                for e in [e for e in pending if it.label is None or labels[e[1]] == it.label]:
                    pending.remove(e)
                    self.steps.append(("wait", e[0]))


class SequenceProgram:
    """One rank's sequence, compiled into the step list :func:`cost_models.simulate.simulate` runs.

    ``items``: the normalised items; ``parts[i]``: item i's :class:`~cost_models.simulate.Program`
    (``None`` for a message or a wait); ``seg_item`` / ``comm_item``: which item a compute segment /
    a comm index belongs to; ``peak_bytes`` / ``memory_breakdown``: :func:`sequence_peak`.
    """

    def __init__(self, rank, items, parts, flat, memory):
        self.rank, self.items, self.parts, self._flat = rank, items, parts, flat
        self.steps, self.segments, self.seg_item = flat.steps, flat.segments, flat.seg_item
        self.comm_item = [i for i, _ in flat.comm_src]
        self.infos, self.comm_names = [], []
        for i, k in flat.comm_src:
            it, p = items[i], parts[i]
            if k is None:
                self.infos.append(it.info)
                self.comm_names.append(it.label or f"{it.info.kind} {it.info.ranks[0]}->{it.info.ranks[-1]}")
            else:
                info = p.infos[k]
                mine = (it.groups or {}).get((info.axis, tuple(info.ranks)))
                self.infos.append(info if mine is None else dataclasses.replace(info, ranks=mine))
                self.comm_names.append(f"{it.label}/{p.comm_names[k]}" if it.label else p.comm_names[k])
        self.compute_time_s = sum(p.compute_time_s for p in parts if p is not None)
        self.peak_bytes, self.memory_breakdown, self.peak_item = memory

    slowdown: float = 1.0             # a straggler's copy (cost_models.simulate.slowed)

    @property
    def class_key(self):
        """Equal for sequences that run the same steps (same graphs' code, same item kinds) as fast."""
        return (id(self._flat), self.slowdown)

    @property
    def programs(self) -> list:
        """The distinct graph programs of the sequence."""
        return list({id(p.compute): p for p in self.parts if p is not None}.values())

    def label(self, i: int) -> str:
        """Item i's label; unlabelled: ``send 0->1`` / ``recv 0->1``, ``wait``, or ``#i`` for a graph."""
        it = self.items[i]
        if getattr(it, "label", None):
            return it.label
        if isinstance(it, _Message):
            return f"{it.info.kind} {it.info.ranks[0]}->{it.info.ranks[-1]}"
        return "wait" if isinstance(it, _Wait) else f"#{i}"


def _freeze(keep):
    return tuple(sorted(keep.items(), key=repr)) if isinstance(keep, dict) else keep


def compile_sequence(seq, cluster, cache: dict, rank: int = 0) -> SequenceProgram:
    """Compile rank ``rank``'s sequence; graphs, shapes and memory are shared through ``cache``."""
    items = [_item(e, rank, i) for i, e in enumerate(seq)]
    parts = [compile_program(it.gm, cluster, cache, it.fused) if isinstance(it, Item) else None for it in items]
    shape = tuple(("g", id(p.steps), it.label) if p is not None else
                  ("m", it.info.kind, it.label) if isinstance(it, _Message) else ("w", it.label)
                  for it, p in zip(items, parts))
    flat = cache.get(("flat", shape))
    if flat is None:
        flat = cache[("flat", shape)] = _Flat(items, parts, rank)
    mkey = ("memory", tuple((id(p.liveness), it.label, _freeze(it.keep), _beside(it)) if p is not None
                            else ("-", it.label) for it, p in zip(items, parts)))
    memory = cache.get(mkey)
    if memory is None:
        memory = cache[mkey] = sequence_peak([(p.liveness, it.label, it.keep, _beside(it)) if p is not None
                                              else (None, it.label, None) for it, p in zip(items, parts)])
    return SequenceProgram(rank, items, parts, flat, memory)
