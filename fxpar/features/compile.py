"""A compiled backend: every per-rank graph through ``torch._inductor`` as one Feature, ``Strategy(compile=True)``.

fxpar owns each rank's whole step as graphs (the fused one-stage step, or F/B/I/W, REDUCE_GRAD, STEP, UNSHARD and
the features' own); eager, they run op by op. With ``compile=True`` each rank compiles each graph it runs with
inductor's ``compile_fx`` (C++ and OpenMP on CPU) at its first call, and runs the compiled code from then on:

* option ``compile`` (False; True; ``"auto"``: the cost model decides, :func:`decide`) and ``compile_steps`` (the
  steps of the run, for ``"auto"`` to weigh inductor's compile time against what it saves over them);
* its Plan section :class:`CompileSection`: the backend the ranks use (``"inductor"``, or ``"eager"`` with why:
  no working C++ compiler, a one-line warning when the Plan is made; ``"auto"`` found it does not pay) and, for
  ``"auto"``, the figures it decided on;
* its planning (:meth:`Compile.plan`): the traced Adam/AdamW update runs as list ops inductor compiles itself
  (inductor has no lowering for ``aten._fused_adamw_``, fxpar's fused CPU kernel);
* its per-rank state :class:`CompileState`: once the rank's graphs are bound to its groups
  (:meth:`~fxpar.feature.RankState.after_setup`), each graph's callable becomes a :class:`CompiledGraph`. At its
  first call it makes the graph's collectives functional (``passes.functional_collectives``: inductor refuses the
  in-place ``all_reduce_``) and compiles it from fake copies of the call's arguments. A graph inductor cannot
  compile runs eager, with one warning naming the graph, its kind and the op; a graph that calls Python functions
  (a compression method's bucket sums) compiles in parts around the calls (:func:`around_calls`);
* its report (``RunResult.features[rank]["compile"]``): per graph, compiled or why not, seconds, inductor's cache
  (``"hit"``: a second ``parallelize`` of the same model compiles nothing), inductor's code and the CPU threads
  its kernels are made for (the rank's own: ``torch.get_num_threads()`` where it compiles);
* its lines in ``explain()``: which graphs compile, which run eager and why; for ``"auto"``, the decision and each
  graph's predicted seconds op by op and compiled;
* its cost effect (:meth:`Compile.priced_calls`): ``estimate()`` prices each graph that compiles as inductor's fused
  kernels (``cost_models.fusion``).

Shapes are static: the graphs are made for ``example_inputs``' shapes, and a batch of another shape (a smaller last
batch) is refused before any rank starts, with or without ``compile``. So a graph compiles once per run, never again
(a call whose arguments share storage otherwise than at the first call compiles a variant for that aliasing, with a
warning; fxpar's executor hands every call the same layout).
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import operator
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field, replace
from unittest import mock

import torch
import torch.fx
from filelock import FileLock
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from fxpar.collectives import axis_of_tag, in_flight_across_graphs, lower_for_backend, stage_through_host
from fxpar.errors import StrategyError
from fxpar.feature import Feature, Option, PlanSection, RankState, register_feature
from fxpar.roles import GraphKind
from fxpar.runtime.launch import local_threads
from cost_models.compute import graph_compute
from cost_models.fusion import fused_times
from cost_models.sequence import Item
from passes.functional_collectives import functional_collectives
from passes.fuse_optimizer import fused_chain_times

__all__ = ["Compile", "CompileSection", "CompileState", "CompiledGraph", "compiler_missing", "decide", "eager_reason",
           "graph_label", "AUTO_MARGIN", "COMPILE_CPU_S_PER_NODE", "CUDA_LAUNCH_S"]

_OPTION = "compile"
_STEPS = "compile_steps"
# compile="auto" compiles where the cost model predicts the compiled step at most (1 - AUTO_MARGIN) of the eager one:
# on the benchmark GPT on CPU (docs/strategies/compile.md) the model predicted 0.96 where the steps measured 0.97-1.03
# (CPU seconds), so a predicted gain under 10% is inside its error
AUTO_MARGIN = 0.10
# CPU seconds inductor takes to compile a graph cold, per FX node: GPT-2 small's dp=2 step (2,567 nodes) took 101 s
# of CPU (the compile workers' included) on the 2-core machine, 3.3 s from inductor's cache
# (benchmarks/bench_parallelize.py --compile; docs/benchmarks.md)
COMPILE_CPU_S_PER_NODE = 101.0 / 2567
# the host's cost of one CUDA kernel launch through the driver and runtime, 4-6 us (measured on an RTX 5070 Ti,
# CUDA 13: github.com/xiaguan/cuda-kernel-launch-lab, "From Launch Overhead to CUDA Graph"; NVIDIA's "Getting
# Started with CUDA Graphs" describes the same few microseconds): where a CUDA device's spec gives no op_overhead_s
# (the GPU presets), "auto" prices each eager op and each compiled kernel at 5 us
CUDA_LAUNCH_S = 5e-6


def compiler_missing() -> str | None:
    """What keeps inductor from compiling on this machine's CPU (None: nothing): ``torch._inductor`` that does not
    import, or no C++ compiler it can find."""
    try:
        # loaded here, not at the top: importing inductor costs seconds, paid only where a Strategy compiles
        from torch._inductor import cpp_builder
    except Exception as e:  # noqa: BLE001 - any failure to import means: not usable
        return f"torch._inductor does not import ({type(e).__name__}: {_first_line(e)})"
    try:
        cxx = cpp_builder.get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - inductor's search raises when it finds none
        return f"a C++ compiler (inductor found none: {_first_line(e)}; install g++ or set CXX)"
    if shutil.which(cxx) is None:
        return f"a C++ compiler ({cxx!r} is not on PATH; install it or set CXX)"
    return None


def graph_label(stage: int, kind) -> str:
    """How ``program.graphs(rank)`` names a graph: ``"step"`` for the fused one-stage step, else ``"stage{s}.{kind}"``."""
    return "step" if kind == GraphKind.FULL else f"stage{stage}.{getattr(kind, 'value', kind)}"


def _python_call(n: torch.fx.Node) -> bool:
    """Whether ``n`` calls a Python function rather than an operator (inductor would trace it with fake tensors,
    running its side effects): a compression feature's ``bucket_sum``, a pass's own function."""
    return n.op == "call_function" and not isinstance(n.target, (torch._ops.OperatorBase, torch._ops.OpOverloadPacket)) \
        and getattr(n.target, "__module__", None) != "_operator"


def eager_reason(gm: torch.fx.GraphModule) -> str | None:
    """Why ``gm`` cannot go to inductor as it stands (None: nothing known): a node that calls a Python function
    rather than an operator. Such a graph is compiled in parts around those calls (:func:`around_calls`)."""
    for n in gm.graph.nodes:
        if _python_call(n):
            name = getattr(n.target, "__qualname__", None) or repr(n.target)
            return f"node {n.name} calls the Python function {name}, which inductor cannot compile"
    return None


def around_calls(gm: torch.fx.GraphModule) -> tuple:
    """``gm`` cut around its Python calls: ``(top, parts)``, where ``top`` is a GraphModule (``split_module``, the
    original order kept) that runs each stretch of operators between two Python calls as one submodule and each
    Python call (with the ``getitem`` nodes that unpack its result) as another, and ``parts`` names the stretches
    worth compiling (at least one operator that is not a view or a ``getitem``), in order. The Python calls run
    where the graph placed them, between compiled code; what crosses a cut is what the original graph kept alive
    there."""
    from torch.fx.passes.split_module import split_module
    part, where = 0, {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        if _python_call(n):
            part += 1
            where[n] = part
            part += 1
        elif n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) \
                and _python_call(n.args[0]):
            where[n] = where[n.args[0]]           # a Python call's results are unpacked beside it
        else:
            where[n] = part
    top = split_module(gm, gm, lambda n: where[n], keep_original_order=True)
    parts = []
    for n in list(top.graph.nodes):
        if n.op != "call_module":
            continue
        sub = getattr(top, n.target)
        if any(_python_call(m) for m in sub.graph.nodes):
            continue
        if any(m.op == "call_function" and isinstance(m.target, torch._ops.OpOverload)
               and not m.target.is_view for m in sub.graph.nodes):
            parts.append(n.target)
            out = sub.graph.find_nodes(op="output")[0]
            if isinstance(out.args[0], torch.fx.Node):     # one result: returned as a tuple, as inductor takes it
                out.args = ((out.args[0],),)
                sub.recompile()
                with top.graph.inserting_after(n):
                    first = top.graph.call_function(operator.getitem, (n, 0))
                n.replace_all_uses_with(first, delete_user_cb=lambda u: u is not first)
    top.recompile()
    return top, parts


class _Part(torch.nn.Module):
    """A compiled stretch of a graph cut around Python calls, called where ``split_module`` calls its submodule."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


@dataclass
class CompileSection(PlanSection):
    """The decision: the backend each rank's graphs run on (``"inductor"``; ``"eager"`` where ``why`` says what is
    missing, or why ``compile="auto"`` found compiling does not pay). ``asked``: ``"true"`` or ``"auto"``. For
    ``"auto"``: the cost model's seconds of one step op by op (``eager_s``) and compiled (``compiled_s``), on the
    slowest stage; the predicted CPU seconds of compiling cold (``compile_s``); ``steps`` (``compile_steps``, 0: not
    given); per stage ``[eager s, compiled s, FX nodes, aten ops, kernels]`` of its training step, one microbatch
    (``stages``)."""
    backend: str = "inductor"
    why: str = ""
    asked: str = "true"
    eager_s: float = 0.0
    compiled_s: float = 0.0
    compile_s: float = 0.0
    steps: int = 0
    stages: dict = field(default_factory=dict)

    def lines(self) -> list:
        if self.asked == "auto":
            return [f"compile='auto': {'compiled by torch._inductor' if self.backend == 'inductor' else 'eager'}: "
                    f"{self.why}"]
        if self.backend != "inductor":
            return [f"compile=True asked, but the graphs run eager: {self.why}"]
        return ["every graph a rank runs is compiled by torch._inductor (C++/OpenMP on CPU) at its first call on the "
                "rank, and cached on disk (inductor's FX graph cache); shapes static (example_inputs')"]


@dataclass
class CompileInfo:
    """What a rank's :class:`CompileState` starts from: the graphs known to run eager, label -> why."""
    eager: dict


class CompiledGraph:
    """One graph of one rank: compiled by inductor at its first call (from fake copies of the call's arguments),
    eager where inductor cannot compile it. Called like the GraphModule it stands for."""

    def __init__(self, gm: torch.fx.GraphModule, label: str, kind, state: "CompileState"):
        self.gm, self.label, self.kind, self.state = gm, label, kind, state
        self.variants: dict = {}           # the arguments' aliasing -> the callable

    def __call__(self, *args):
        key = _aliasing(args)
        fn = self.variants.get(key)
        if fn is None:
            fn = self.variants[key] = self.state.compile(self, args, len(self.variants))
        return fn(*args)


class CompileState(RankState):
    """A rank's compiled graphs and what became of each (:meth:`report`)."""

    def __init__(self, info: CompileInfo, rank: int):
        super().__init__(info, rank)
        self.graphs: dict = {}             # label -> {"compiled", "why", "seconds", "cache", "code", "threads"}

    def after_setup(self, ex) -> None:
        for s, parts in list(ex.p.graphs.items()):
            ex.p.graphs[s] = {kind: replace(sg, gm=CompiledGraph(sg.gm, graph_label(s, kind), kind, self))
                              for kind, sg in parts.items()}

    def compile(self, cg: CompiledGraph, args: tuple, variant: int):
        """The callable for ``cg`` on arguments like ``args``: inductor's, or the graph itself where it fails."""
        if variant:
            warnings.warn(f"Strategy(compile=True): rank {self.rank}: graph {cg.label} is called with arguments that "
                          f"share storage otherwise than before; it compiles again for them (variant {variant + 1})",
                          RuntimeWarning, stacklevel=3)
        why = self.info.eager.get(cg.label) or eager_reason(cg.gm)
        if why is not None and any(_python_call(n) for n in cg.gm.graph.nodes):
            try:
                return self._around_calls(cg, why)
            except Exception as e:  # noqa: BLE001 - a graph that cannot be cut runs eager whole, as a failed compile
                why = f"{why}; cutting the graph around its calls failed ({_first_line(e)[:200]})"
        t0 = time.perf_counter()
        fn, cache, code = None, None, None
        if why is None:
            try:
                fn, cache, code = _inductor(cg.gm, args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: the graph runs eager, the run goes on
                why = f"{_failed_op(e)} did not compile ({_first_line(e)[:200]})"
        self.graphs[cg.label] = {"kind": str(getattr(cg.kind, "value", cg.kind)), "compiled": fn is not None,
                                 "why": why, "seconds": time.perf_counter() - t0, "cache": cache, "code": code,
                                 "threads": _threads()}
        if fn is None:
            _warn_once(f"Strategy(compile=True): graph {cg.label} (kind {self.graphs[cg.label]['kind']}) runs eager: "
                       f"{why}")
            return cg.gm
        return fn

    def _around_calls(self, cg: CompiledGraph, why: str):
        """``cg`` compiled in parts around its Python calls (:func:`around_calls`): each stretch of operators is a
        graph of its own (``"<label>.part<i>"`` in the report), compiled at its first call, or eager where inductor
        fails on it; the calls run between them."""
        t0 = time.perf_counter()
        top, parts = around_calls(cg.gm)
        for i, name in enumerate(parts, 1):
            setattr(top, name, _Part(CompiledGraph(getattr(top, name), f"{cg.label}.part{i}", cg.kind, self)))
        top.recompile()
        calls = sum(1 for n in cg.gm.graph.nodes if _python_call(n))
        self.graphs[cg.label] = {"kind": str(getattr(cg.kind, "value", cg.kind)), "compiled": "in parts",
                                 "why": f"{why}: compiled in {len(parts)} parts around its {calls} Python call(s), "
                                        f"{cg.label}.part1 to .part{len(parts)}",
                                 "seconds": time.perf_counter() - t0, "cache": None, "code": None, "threads": _threads()}
        return top

    def report(self):
        return {label: dict(g) for label, g in self.graphs.items()}


@register_feature
class Compile(Feature):
    name = "compile"
    doc = "every per-rank graph compiled by torch._inductor (C++/OpenMP on CPU), eager where a graph cannot compile"
    options = {_OPTION: Option(False, "True: each rank compiles every graph it runs with torch._inductor's compile_fx "
                                      "at its first call (cached on disk: a second parallelize of the same model "
                                      "compiles nothing); a graph that cannot compile runs eager, with a warning. "
                                      "Shapes are static. 'auto': compile where the cost model predicts the step at "
                                      "most 0.9x the eager one (and, with compile_steps, the compile time paid back "
                                      "over the run); eager otherwise, with the reason in the Plan and explain(). "
                                      "False (default): eager"),
               _STEPS: Option(None, "with compile='auto': the steps the run will take; 'auto' then compiles only where "
                                    "the time saved over them exceeds the predicted compile time")}
    section = CompileSection
    state = CompileState

    def validate(self, strategy) -> None:
        v, steps = strategy.option(_OPTION), strategy.option(_STEPS)
        if not (isinstance(v, bool) or v == "auto"):
            raise StrategyError(f"Strategy(compile={v!r}): pass True (every graph through torch._inductor), False "
                                "(eager, the default) or 'auto' (compile where the cost model says it pays)")
        if steps is not None:
            if v != "auto":
                raise StrategyError(f"Strategy(compile={v!r}, compile_steps={steps!r}): compile_steps is what "
                                    "compile='auto' weighs the compile time against; pass compile='auto' or drop it")
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise StrategyError(f"Strategy(compile_steps={steps!r}): pass the number of steps the run will take, "
                                    "a positive int")

    def plan(self, strategy, plan, cluster):
        auto = strategy.option(_OPTION) == "auto"
        missing = compiler_missing()
        if missing is not None:
            if not auto:
                warnings.warn(f"Strategy(compile=True): inductor is not usable here, missing {missing}; the graphs run "
                              "eager", UserWarning, stacklevel=2)
            return CompileSection(backend="eager", why=f"inductor is not usable here: missing {missing}",
                                  asked="auto" if auto else "true")
        if auto:        # decided once the stages are captured (plan_stage), before any pass reads the update's kernel
            return CompileSection(backend="undecided", asked="auto", steps=strategy.option(_STEPS) or 0)
        _unfuse_update(plan)
        return CompileSection()

    def adopt(self, section, strategy, plan, cluster):
        if section.asked != "auto" or section.backend == "undecided":
            return self.plan(strategy, plan, cluster)
        if section.backend == "inductor":      # a handed-back decision stays, where inductor is usable here
            missing = compiler_missing()
            if missing is not None:
                return replace(section, backend="eager", why=f"inductor is not usable here: missing {missing}")
            _unfuse_update(plan)
        return section

    def plan_stage(self, section, plan, stage: int, captured, cluster, schedule) -> None:
        if section.backend != "undecided":
            return
        rank = plan.stage_ranks(stage)[0]
        device = cluster.device_of(rank) if hasattr(cluster, "device_of") else cluster.device
        section.stages[f"stage{stage}"] = list(_priced(captured.gm, _priced_device(device), plan.optimizer or {}))
        if stage == plan.n_stages - 1:
            decide(section, plan)

    def priced_calls(self, section, program, calls: dict, first):
        """Each graph a rank compiles priced as inductor's fused kernels (``cost_models.fusion``)."""
        if section.backend != "inductor":
            return None
        # a graph that calls Python functions compiles in parts around them: priced as fused too (its calls are
        # priced by the features that put them there; the few fusions a cut prevents are not counted)
        out = {r: [replace(it, fused=True) if isinstance(it, Item) else it for it in items]
               for r, items in calls.items()}
        return out, ["compiled graphs priced as inductor runs them: library kernels (matmuls, attention) as eager, "
                     "the other ops fused into a kernel per reduction (cost_models.fusion); a graph compiled in parts "
                     "around Python calls alike"]

    def rank_info(self, section, program, rank: int):
        if section.backend != "inductor":
            return None
        return CompileInfo(eager=_known_eager(program, rank))

    def code(self, section, program, rank: int, threads: int | None = None) -> dict:
        """Inductor's code for each graph of ``rank``, compiled here from the graphs' recorded shapes as the rank
        compiles them at its first call (groups not bound: each collective names its Plan group, ``'fxpar:dp'``;
        gathers the rank runs through ``dist`` on gloo lowered as the rank lowers them), for ``threads`` CPU
        threads (None: as many as ``run_local`` gives each rank, this machine's cores / the ranks). A graph that
        runs eager gives one line saying why. Compiled once per Program and thread count."""
        if threads is None:
            threads = local_threads(program.world_size)
        cache = program.__dict__.setdefault("_compiled_code", {})
        if (rank, threads) in cache:
            return cache[rank, threads]
        gms = {graph_label(s, k): sg.gm for s in program.plan.rank_stages(rank)
               for k, sg in program.stages[s].graphs.items()}
        if section.backend != "inductor":
            return {lb: f"# runs eager: {section.why}" for lb in gms}
        across = in_flight_across_graphs(list(gms.values()))
        groups = {name: tuple(ranks) for name, ranks in program.plan.all_groups() if rank in ranks}
        out = {}
        with _stand_in_groups(gms.values(), groups, rank):
            for lb, gm in gms.items():
                out[lb] = _code(gm, across, program.cluster.backend, threads)
        cache[rank, threads] = out
        return out

    def explain(self, section, program) -> list:
        lines = section.lines()
        if section.asked == "auto" and section.backend != "undecided" and not section.why.startswith("inductor is not"):
            device = _priced_device(program.cluster.device_of(0) if hasattr(program.cluster, "device_of")
                                    else program.cluster.device)
            for s in program.plan.rank_stages(0):
                for kind, sg in program.stages[s].graphs.items():
                    _, times, fc = fused_times(sg.gm, device)
                    lines.append(f"rank 0 {graph_label(s, kind)}: predicted {fc.eager_s * 1e3:.3f} ms op by op "
                                 f"({fc.ops} aten ops), {fc.compiled_s * 1e3:.3f} ms compiled ({fc.kernels} kernels)")
        if section.backend != "inductor":
            return lines
        eager = _known_eager(program, 0)
        labels = [graph_label(s, k) for s in program.plan.rank_stages(0) for k in program.stages[s].graphs]
        lines.append("rank 0 compiles: " + (", ".join(lb for lb in labels if lb not in eager) or "nothing whole"))
        lines += [f"rank 0 compiles in parts: {lb}, each stretch between its Python calls, the calls eager ({why})"
                  for lb, why in eager.items()]
        lines.append("inductor's code: program.compiled_code(rank); what each rank compiled and how long it took: "
                     "RunResult.features[rank]['compile']")
        return lines


# ---- compile="auto" -----------------------------------------------------------------------------------------
def decide(section: CompileSection, plan) -> None:
    """``compile="auto"``'s decision, from the stages priced in ``section.stages``: compile where the slowest stage's
    step compiled is predicted at most ``1 - AUTO_MARGIN`` of its step op by op and, where ``section.steps`` is
    given, the seconds saved over them exceed the predicted compile time; else eager. Writes ``backend``, ``why``
    and the figures; where it compiles, the traced update runs as list ops inductor compiles (as compile=True)."""
    m = max(1, plan.microbatches)
    priced = list(section.stages.values())
    eager = max(p[0] for p in priced) * m
    compiled = max(p[1] for p in priced) * m
    nodes = max(p[2] for p in priced)
    section.eager_s, section.compiled_s = eager, compiled
    section.compile_s = nodes * COMPILE_CPU_S_PER_NODE
    ratio = compiled / eager if eager > 0 else 1.0
    saved = eager - compiled
    ops = sum(p[3] for p in priced)
    kernels = sum(p[4] for p in priced)
    figures = (f"the cost model predicts a step {compiled * 1e3:.3f} ms compiled ({kernels} kernels) against "
               f"{eager * 1e3:.3f} ms op by op ({ops} aten ops), {ratio:.2f}x")
    if ratio > 1 - AUTO_MARGIN:
        section.backend = "eager"
        section.why = f"{figures}: under the {AUTO_MARGIN:.0%} gain the model's error allows"
        return
    payback = section.compile_s / saved
    if section.steps and section.steps * saved <= section.compile_s:
        section.backend = "eager"
        section.why = (f"{figures}, but compiling (about {section.compile_s:.0f} CPU s cold) pays back after "
                       f"{payback:.0f} steps, more than compile_steps={section.steps}")
        return
    section.backend = "inductor"
    over = (f"over compile_steps={section.steps} it saves {section.steps * saved:.1f} s" if section.steps
            else "compile_steps not given: the compile time is not weighed")
    section.why = (f"{figures}; compiling takes about {section.compile_s:.0f} CPU s cold and pays back after "
                   f"{payback:.0f} steps ({over})")
    _unfuse_update(plan)


def _priced_device(device):
    """The device ``"auto"`` prices on: a CUDA spec without a per-op cost gets a kernel launch's (CUDA_LAUNCH_S)."""
    if getattr(device, "kind", "cpu") == "cuda" and not getattr(device, "op_overhead_s", 0.0):
        return replace(device, op_overhead_s=CUDA_LAUNCH_S)
    return device


def _priced(gm: torch.fx.GraphModule, device, optimizer: dict) -> tuple:
    """``(eager s, compiled s, nodes, aten ops, kernels)`` of a stage's captured training step; eager with the
    update as the program runs it eager (one fused kernel where ``Plan.optimizer`` says so)."""
    _, times, fc = fused_times(gm, device)
    eager = fc.eager_s
    if optimizer.get("kernel") == "fused":
        eager = sum(fused_chain_times(gm, graph_compute(gm, device).times, device, optimizer).values())
    return eager, fc.compiled_s, len(gm.graph.nodes), fc.ops, fc.kernels


# ---- helpers -----------------------------------------------------------------------------------------------
def _unfuse_update(plan) -> None:
    """Inductor has no lowering for ``aten._fused_adamw_``: the traced update runs as list ops it compiles."""
    opt = plan.optimizer or {}
    if opt.get("kernel") == "fused":
        opt.pop("hyper", None)
        opt.update({"kernel": "foreach", "why_kernel": "compile=True: inductor generates the update from the list "
                                                       "ops (it has no lowering for aten._fused_adamw_)"})


def _known_eager(program, rank: int) -> dict:
    """label -> why, for the graphs of ``rank`` known before any run not to compile."""
    out = {}
    for s in program.plan.rank_stages(rank):
        for kind, sg in program.stages[s].graphs.items():
            why = eager_reason(sg.gm)
            if why is not None:
                out[graph_label(s, kind)] = why
    return out


def _aliasing(args) -> tuple:
    """For each argument (a tuple's tensors one by one), the index of the first on the same storage (compiled code is
    specialised to it)."""
    first, out = {}, []
    for i, a in enumerate(pytree.tree_leaves(list(args))):
        out.append(first.setdefault(a.untyped_storage().data_ptr(), i) if isinstance(a, torch.Tensor) else -1)
    return tuple(out)


def _inductor(gm: torch.fx.GraphModule, args: tuple | None, threads: int | None = None) -> tuple:
    """``(compiled callable, "hit" | "miss", inductor's code)`` for ``gm`` on arguments like ``args`` (None: like
    its placeholders' recorded values, each on storage of its own, as :meth:`Compile.code` shows it); ``threads``:
    the CPU threads the code is made for (None: this process's)."""
    # loaded here, not at the top: importing inductor costs seconds, paid only where a Strategy compiles
    from torch._dynamo.utils import counters
    from torch._guards import TracingContext, tracing
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.graph import GraphLowering
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    codes = []
    with _disable_current_modes():        # compiling is no step's work: a rank's counters and trackers do not see it
        g = copy.deepcopy(gm)
        # fake copies under a shape environment, static: inductor's FX graph cache keys on them (real tensors bypass it)
        fake = FakeTensorMode(shape_env=ShapeEnv())
        if args is None:
            with fake:
                fakes = [_like(n.meta.get("val"), n.name) for n in g.graph.find_nodes(op="placeholder")]
        else:
            fakes = pytree.tree_map_only(torch.Tensor, lambda a: fake.from_tensor(a, static_shapes=True), list(args))
        if any("val" not in n.meta for n in g.graph.nodes if n.op == "call_function"):
            # a rank's graphs come without their values (a Program ships graphs as plain data): recorded again from
            # the call's, so the pass below sees shapes and dtypes as it does on the Program's graphs
            FakeTensorProp(g, mode=fake).propagate_dont_convert_inputs(*fakes)
        functional_collectives(g)
        spec = _flat_outputs(g)            # compile_fx takes a graph that returns a flat tuple of tensors
        own = _realize_scalars(g)          # the graph's own outputs come first; None: nothing added
        # ranks of one host that run the same graph (every dp rank) compile it once: the first holds the lock, the
        # others wait for it, then load the result from inductor's cache (no rank waits on another for args=None)
        lock = contextlib.nullcontext() if args is None else FileLock(_lock_path(g, args))
        hits = counters["inductor"]["fxgraph_cache_hit"]
        # inductor's peak-memory reordering would pull each wait_tensor up to its collective (and the bucket's update
        # after it), closing the overlap window the passes opened: off, so the compiled code keeps the graph's order
        threads_cfg = {} if threads is None else {"cpp.threads": threads}
        with lock, inductor_config.patch(reorder_for_peak_memory=False, **threads_cfg), \
                mock.patch.object(GraphLowering, "save_output_code", codes.append), tracing(TracingContext(fake)):
            fn = compile_fx(g, fakes)
    cache = "hit" if counters["inductor"]["fxgraph_cache_hit"] > hits else "miss"
    if spec is not None or own is not None:
        flat_fn = fn
        spec = spec if spec is not None else list(range(own))

        def fn(*a):                     # the flat results back in the graph's own structure, the scalars left out
            res = flat_fn(*a)
            return tuple(res[i] if isinstance(i, int) else tuple(res[k] for k in i) for i in spec)
    return fn, cache, codes[-1] if codes else None


def _code(gm: torch.fx.GraphModule, across: bool, backend: str, threads: int) -> str:
    """Inductor's code for ``gm`` as a rank of a ``backend`` cluster with ``threads`` CPU threads compiles it, or one
    line saying why it runs eager."""
    g = copy.deepcopy(gm)
    device = next((n.meta["val"].device for n in g.graph.find_nodes(op="placeholder")
                   if isinstance(n.meta.get("val"), torch.Tensor)), torch.device("cpu"))
    lower_for_backend(g, anywhere=across, backend=backend)
    if device.type != "cpu" and backend == "gloo":
        stage_through_host(g, backend="gloo")
    why = eager_reason(g)
    if why is not None:                  # compiled in parts around its Python calls, as a rank does
        try:
            top, parts = around_calls(g)
        except Exception as e:  # noqa: BLE001 - as on a rank: the graph runs eager whole
            return f"# runs eager: {why}; cutting the graph around its calls failed ({_first_line(e)[:200]})"
        texts = [f"# {why}: compiled in {len(parts)} parts around its Python calls"]
        for i, name in enumerate(parts, 1):
            texts += [f"# ---- part {i} ({name}) ----", _code_of(getattr(top, name), threads)]
        return "\n".join(texts)
    return _code_of(g, threads)


def _code_of(g: torch.fx.GraphModule, threads: int) -> str:
    try:
        _, _, text = _inductor(g, None, threads)
        return text or "# inductor wrote no code for this graph"
    except Exception as e:  # noqa: BLE001 - as on a rank: the graph runs eager
        return f"# runs eager: {_failed_op(e)} did not compile ({_first_line(e)[:200]})"


@contextlib.contextmanager
def _stand_in_groups(gms, groups: dict, rank: int):
    """Inductor looks up each collective's process group by name while it compiles: for graphs whose collectives
    still name their Plan group (``'fxpar:dp'``), a fake process group of the group's size stands under that name
    (torch's ``FakeProcessGroup``: it moves nothing), removed afterwards."""
    from torch._C._distributed_c10d import (FakeProcessGroup, HashStore, ProcessGroup, _register_process_group,
                                            _unregister_process_group)
    tags = {a for gm in gms for n in gm.graph.nodes if n.op == "call_function" for a in n.args
            if axis_of_tag(a) is not None}
    made = []
    try:
        for tag in sorted(tags):
            ranks = groups.get(axis_of_tag(tag), (rank,))
            at, size = ranks.index(rank), len(ranks)
            pg = ProcessGroup(HashStore(), at, size)
            for device in ("cpu", "cuda"):
                pg._register_backend(torch.device(device), ProcessGroup.BackendType.CUSTOM,
                                     FakeProcessGroup._create_internal(at, size))
            pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)
            pg._set_group_name(tag)
            _register_process_group(tag, pg)
            made.append(tag)
        yield
    finally:
        for tag in made:
            _unregister_process_group(tag)


def _like(val, name: str):
    """A tensor of the current (fake) mode shaped like a placeholder's recorded value (a tuple: each of its)."""
    if isinstance(val, (tuple, list)):
        return type(val)(_like(v, name) for v in val)
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=val.device)
    if isinstance(val, (int, float, bool)) or val is None:
        return val
    raise TypeError(f"placeholder {name} holds no recorded tensor value ({type(val).__name__}): the graph cannot be "
                    "compiled outside a run; run it (RunResult.features[rank]['compile'] holds inductor's code)")


def _flat_outputs(gm: torch.fx.GraphModule) -> list | None:
    """Where ``gm`` returns the whole result of a multi-output op (a tuple: the zero-bubble ``I`` graph saves
    ``native_layer_norm_backward`` for its ``W``), return its elements one by one instead; returns where each output
    went (an index, or a list of indices for a tuple), or None where nothing changed."""
    out = gm.graph.find_nodes(op="output")[0]
    flat, spec = [], []
    for x in out.args[0]:
        schema = getattr(getattr(x, "target", None), "_schema", None)
        if not (isinstance(x, torch.fx.Node) and x.op == "call_function" and schema is not None
                and len(schema.returns) > 1):
            spec.append(len(flat))
            flat.append(x)
            continue
        val = x.meta.get("val")
        idx = []
        for j in range(len(schema.returns)):
            with gm.graph.inserting_before(out):
                item = gm.graph.call_function(operator.getitem, (x, j))
            if isinstance(val, (tuple, list)):
                item.meta["val"] = val[j]
            idx.append(len(flat))
            flat.append(item)
        spec.append(idx)
    if all(isinstance(i, int) for i in spec):
        return None
    out.args = (tuple(flat),)
    gm.recompile()
    return spec


def _realize_scalars(gm: torch.fx.GraphModule) -> int | None:
    """Make inductor compute each float scalar that an op on whole tensors reads once, in a kernel of its own: it
    otherwise inlines a 0-d pointwise chain into the loop of every consumer and evaluates it per element (the
    update's bias corrections ``1 - beta ** step`` become two ``std::pow`` calls per eight elements of every
    parameter). A graph output is realized, so each such scalar is appended to the outputs; the values are the same
    computations in the same dtype. Returns how many outputs the graph had (they stay first), or None where no
    scalar qualifies (float32/float64 pointwise nodes with a 0-d result that an op with another result reads:
    a larger tensor, or none, as an in-place ``_foreach`` op has)."""
    out = gm.graph.find_nodes(op="output")[0]
    outs = list(out.args[0])
    have = set(outs)
    add = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op != "call_function" or n in have or not _scalar(val) or val.dtype not in (torch.float32, torch.float64) \
                or torch.Tag.pointwise not in getattr(n.target, "tags", ()):
            continue
        if any(u.op == "call_function" and not _scalar(u.meta.get("val")) for u in n.users):
            add.append(n)
    if not add:
        return None
    out.args = (tuple(outs + add),)
    gm.recompile()
    return len(outs)


def _threads() -> int:
    """The CPU threads inductor makes this process's C++ kernels for (``cpp.threads``, else torch's threads here)."""
    from torch._inductor.utils import parallel_num_threads
    return parallel_num_threads()


def _scalar(val) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _lock_path(gm: torch.fx.GraphModule, args: tuple) -> str:
    """A lock file in inductor's cache directory, one per graph code and argument layout."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    layout = [(tuple(a.shape), a.stride(), str(a.dtype)) if isinstance(a, torch.Tensor) else repr(a)
              for a in pytree.tree_leaves(list(args))]
    key = hashlib.sha256((gm.code + repr(layout) + repr(_aliasing(args))).encode()).hexdigest()[:24]
    os.makedirs(os.path.join(cache_dir(), "fxpar_locks"), exist_ok=True)
    return os.path.join(cache_dir(), "fxpar_locks", f"{key}.lock")


def _failed_op(e: BaseException) -> str:
    """The op a compiler error names (``aten.foo.default``), or a phrase saying it names none."""
    text = str(e)
    m = re.search(r"target=([\w.:]+)", text) or re.search(r"target: ([\w.:]+)", text) \
        or re.search(r"\b([a-z_0-9]+::[\w.]+)", text)
    return f"op {m.group(1)}" if m else f"a node ({type(e).__name__})"


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0].strip() if lines else type(e).__name__


_WARNED: set = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
