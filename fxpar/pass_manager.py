"""The pass API: ``(GraphModule, PassContext) -> PassResult``, run in order by a PassManager.

A pass declares the passes it ``requires`` (must have run before it) and those it must come
``before``; the manager checks the order before running anything, lints the graph and checks
the step signature after every pass, stamps each new node with the pass that made it
(``fxpar_pass``), and keeps a history entry per pass so a user can print the graph after each::

    class CountMatmuls(fxpar.Pass):
        name = "count_matmuls"
        def run(self, gm, ctx):
            ctx.notes.append(f"{sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes)} mm")
            return fxpar.PassResult(gm, modified=False)

    program = fxpar.parallelize(..., strategy=fxpar.Strategy(dp=2, passes=[CountMatmuls()]))
    program.history(rank=0)["count_matmuls"]      # the graph after it, as code
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx

from . import meta as M
from ._tracing import gc_paused
from .errors import PassError
from .roles import GraphKind

__all__ = ["Pass", "PassResult", "PassContext", "PassManager", "HistoryEntry", "graph_pass"]


@dataclass
class PassResult:
    graph_module: torch.fx.GraphModule
    modified: bool
    info: dict = field(default_factory=dict)


@dataclass
class PassContext:
    """What a pass may read: the plan, the cluster, the mesh, which rank it lowers for; and what passes hand on.

    ``kinds`` is set by ``fxpar.lower`` before the passes run; ``split`` is written by the last pass,
    ``split_graphs``, and read by ``lower``. A feature's or a user's pass that hands data to a later pass keeps it
    under its own name in ``scratch`` (``ctx.scratch.setdefault("my_feature", {})["x"] = ...``): core state has
    a typed field here, never a ``scratch`` key.
    """
    plan: Any = None
    cluster: Any = None
    mesh: Any = None
    rank: int = 0
    stage: int = 0                     # the pipeline stage whose joint graph is lowered (0 without a pipeline)
    signature: Any = None              # fxpar.capture.StepSignature of the graph being lowered
    captured: Any = None               # fxpar.capture.CapturedStep
    kinds: tuple = (GraphKind.FULL,)   # the graphs the split will cut (fxpar.roles.GraphKind), in order
    split: dict | None = None          # {GraphKind: passes.split_graphs.SplitGraph}, once split_graphs has run
    notes: list = field(default_factory=list)    # plain-language lines for explain()
    scratch: dict = field(default_factory=dict)  # feature or pass name -> its own data for later passes


class Pass:
    """Subclass and implement :meth:`run`; set ``name``, and optionally ``requires``/``before``."""
    name: str = ""
    requires: tuple = ()
    before: tuple = ()

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, gm, ctx) -> PassResult:
        return self.run(gm, ctx)

    def __repr__(self) -> str:
        return f"<pass {self.name or type(self).__name__}>"


def graph_pass(name: str, requires: tuple = (), before: tuple = ()) -> Callable:
    """Turn ``fn(gm, ctx) -> PassResult | bool | None`` into a Pass."""
    def wrap(fn):
        class _FnPass(Pass):
            def run(self, gm, ctx):
                r = fn(gm, ctx)
                if isinstance(r, PassResult):
                    return r
                return PassResult(gm, bool(r) if r is not None else True)
        p = _FnPass()
        p.name, p.requires, p.before = name, tuple(requires), tuple(before)
        p.__doc__ = fn.__doc__
        return p
    return wrap


class _GraphSnapshot:
    """A graph's code as it stands when taken, rendered (``Graph.python_code``) when first read.

    Holds each node's op, name, target, arguments and type: an argument tuple is replaced, never edited, when a
    pass rewires a node, so keeping it keeps the arguments as they were; the nodes it names may be renamed or
    erased later, so their names are kept here. Taking it is a walk over the nodes; rendering rebuilds a graph of
    the same nodes and prints it, which a history nobody reads never pays."""

    def __init__(self, graph: torch.fx.Graph):
        self._codegen = graph._codegen
        self._nodes = [(n, n.op, n.name, n.target, n.args, n.kwargs, n.type) for n in graph.nodes]
        self._text = None

    def render(self) -> str:
        if self._text is None:
            g = torch.fx.Graph()
            g.set_codegen(self._codegen)
            made = {n: g.create_node(op, target, name=name, type_expr=type_expr)
                    for n, op, name, target, _, _, type_expr in self._nodes}
            for n, _, _, _, args, kwargs, _ in self._nodes:
                made[n].args = torch.fx.node.map_arg(args, made.__getitem__)
                made[n].kwargs = torch.fx.node.map_arg(kwargs, made.__getitem__)
            self._text = g.python_code(root_module="self").src
            self._nodes = None
        return self._text


class HistoryEntry:
    """One step of a stage's pass history: the pass, whether it changed the graph, its time, the node count,
    ``code`` (the graph after it, as Python) and what the pass reported (``info``)."""

    def __init__(self, pass_name: str, modified: bool, seconds: float, nodes: int, code, info: dict):
        self.pass_name, self.modified, self.seconds, self.nodes, self.info = pass_name, modified, seconds, nodes, info
        self._code = code          # a str, or a _GraphSnapshot printed when ``code`` is first read

    @property
    def code(self) -> str:
        if not isinstance(self._code, str):
            self._code = self._code.render()
        return self._code

    @code.setter
    def code(self, value: str) -> None:
        self._code = value

    def _fields(self) -> tuple:
        return self.pass_name, self.modified, self.seconds, self.nodes, self.code, self.info

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self._fields() == other._fields()

    __hash__ = None

    def __getstate__(self) -> dict:            # pickled and copied as text
        return {**self.__dict__, "_code": self.code}

    def __repr__(self) -> str:
        return (f"HistoryEntry(pass_name={self.pass_name!r}, modified={self.modified!r}, seconds={self.seconds!r}, "
                f"nodes={self.nodes!r}, code={self.code!r}, info={self.info!r})")

    def __str__(self) -> str:
        return f"# after {self.pass_name} ({'modified' if self.modified else 'unchanged'}, {self.nodes} nodes)\n{self.code}"


class PassManager:
    def __init__(self, passes: list, check: bool = True, keep_history: bool = True):
        self.passes = list(passes)
        self.check = check
        self.keep_history = keep_history
        self._check_order()

    def _check_order(self) -> None:
        names = [p.name for p in self.passes]
        for i, p in enumerate(self.passes):
            if not p.name:
                raise PassError(f"{p!r} has no name: set `name = '...'` on the pass class")
            for r in p.requires:
                if r not in names[:i]:
                    where = f"it comes at position {names.index(r)}" if r in names else "it is not in the pipeline"
                    raise PassError(f"pass '{p.name}' requires '{r}' to run before it, but {where}. "
                                    f"Pipeline order: {names}")
            for b in p.before:
                if b in names[:i]:
                    raise PassError(f"pass '{p.name}' must run before '{b}', but '{b}' is at position "
                                    f"{names.index(b)} and '{p.name}' at {i}. Pipeline order: {names}")

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> tuple:
        """The passes in order over ``gm``: ``(graph module, history)``."""
        with gc_paused():         # the passes make and drop nodes and fake values by the thousand (_tracing.gc_paused)
            return self._run(gm, ctx)

    def _run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> tuple:
        history = []
        if self.keep_history:
            history.append(HistoryEntry("capture", True, 0.0, len(gm.graph.nodes), _GraphSnapshot(gm.graph), {}))
        done, modified_any = [], False
        for p in self.passes:
            before = set(gm.graph.nodes)
            t0 = time.perf_counter()
            try:
                result = p(gm, ctx)
            except PassError:
                raise
            except Exception as e:
                first = (str(e).strip().splitlines() or [""])[0][:500]
                raise PassError(f"pass '{p.name}' failed on rank {ctx.rank} with {type(e).__name__}: {first} "
                                f"(passes run before it: {done or 'none'})") from e
            if not isinstance(result, PassResult):
                raise PassError(f"pass '{p.name}' returned {type(result).__name__}; a pass returns "
                                "PassResult(graph_module, modified)")
            gm = result.graph_module
            for n in gm.graph.nodes:
                if n not in before and M.PASS.name not in n.meta:
                    n.meta[M.PASS.name] = p.name
            if self.check:
                self._verify(gm, ctx, p.name, done)
            modified_any = modified_any or result.modified
            done.append(p.name)
            if self.keep_history:
                code = _GraphSnapshot(gm.graph) if result.modified else history[-1]._code
                history.append(HistoryEntry(p.name, result.modified, time.perf_counter() - t0,
                                            len(gm.graph.nodes), code, result.info))
        if modified_any:
            gm.recompile()     # once: passes edit the graph; the Python code is regenerated at the end
        return gm, history

    @staticmethod
    def _verify(gm, ctx, name, done) -> None:
        try:
            gm.graph.lint()
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:500]
            raise PassError(f"after pass '{name}' the graph is malformed: {first} (passes before: {done or 'none'})") from e
        sig = gm.meta.get(M.SIGNATURE.name)
        if sig is not None:
            n_in = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
            outs = gm.graph.find_nodes(op="output")[0].args[0]
            if n_in != len(sig.inputs) or len(outs) != len(sig.outputs):
                raise PassError(f"after pass '{name}' the graph has {n_in} inputs / {len(outs)} outputs but its "
                                f"signature lists {len(sig.inputs)} / {len(sig.outputs)}: a pass that adds inputs or "
                                "outputs must update gm.meta['fxpar_signature']")
