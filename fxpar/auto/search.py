"""The automatic planner: enumerate, price cheaply, prune, then estimate the finalists in full.

    candidates = fxpar.auto_plan(model, cluster, example_inputs, loss_fn=..., optimizer=...)   # ranked, nothing built
    program = fxpar.parallelize(model, cluster, example_inputs, ..., strategy="auto")      # the pick built
    print(program.explain())        # the chosen plan, the ranked table, why each other family lost

Order of work: the model's profile (one eager forward + backward on fake tensors at two microbatch sizes, the
first repeated block standing for all); every candidate of the space priced from it (:mod:`fxpar.auto.space`);
those predicted over ``margin`` x the device's memory dropped, then every candidate another beats on both step time
and memory (dominated); the rest ranked by predicted step time, ties by memory. ``parallelize`` estimates the first
``finalists`` in full (:func:`choose`: the first built, a one-stage one probed on the model cut short, one too far
behind by the cheap cost not built) and returns the build of the fastest whose full estimate fits.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .._tracing import BatchLayout
from ..cluster import ClusterSpec
from ..errors import StrategyError
from ..feature import schedule_names
from ..explain import fmt_bytes
from ..optim import resolve_optimizer
from ..strategy import AutoStrategy, Strategy
from .probe import extrapolate, probe_depths, truncated
from .profile import profile_model
from .space import AUTO_IS_NONE, SCHEDULES, Candidate, _Pricer, bf16_supported, cost_candidate, rank_devices
from .workers import Forked

__all__ = ["auto_plan", "AutoSearch", "search", "choose", "as_auto", "finalists", "fixed_options", "NoPlanFitsError",
           "SEARCHED", "ALLOW"]

RECOMPUTE = ("none", "selective", "full", "auto")
MAX_MICROBATCHES = 64
# the dimensions the search covers (Strategy.auto pins them; its other keywords are options every candidate gets)
SEARCHED = ("dp", "tp", "pp", "schedule", "microbatches", "zero", "recompute", "sharding", "precision", "offload",
            "bucket_cap_mb", "comm_schedule", "grad_sync", "memory_budget_gb")
COMM_SCHEDULES = ("fifo", "bytescheduler")
# the grad_sync values the search prices: a pin of only these restricts the dimension; any other grad_sync pin (a
# compression method of fxpar.compress) is an option every candidate gets
SEARCHED_GRAD_SYNC = ("allreduce", "herring", "bf16")
PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}     # the compute dtypes a profile is run in
# methods that change the math, searched only when Strategy.auto(allow=...) names them: name -> what it adds
ALLOW = {"compression": "bf16 gradient buckets (grad_sync='bf16': half the bytes, rounded sums)",
         "asynchronous": "the asynchronous pipeline schedule '2bw' (PipeDream-2BW: weights one update stale)"}
# a probed finalist this close to the best built one (step time; memory: to the budget) is built whole. The
# composition's largest errors measured (tests/test_auto_probe.py): 1.7% of the step and 3.8% of the peak (ZeRO-1
# with 5 MiB buckets that cut across blocks), 2% of the peak (Megatron's tp under bf16), 0.3% of the step (ZeRO-3
# under bf16; Tofu's tp, whose split changes with the depth); none (1e-15) for plain dp, ZeRO-2 and recompute
PROBE_MARGIN = 0.05
# the smallest ratio of a built program's step estimate to its cheap cost measured over 67 builds (the three
# models of bench_planner measure at 2 and 4 ranks, local and calibrated; GPT-2 small at 8 A100s, H100s and H200s;
# an 8 x 1024 GPT at 4 A100s): 0.644 (GPT-2 small's dp=8 at 8 H100s), less a tenth. A finalist whose cheap step
# times it is above the best built one's full step is not built: no build of it is expected to beat that one
CHEAP_FLOOR = 0.58


def _choices(auto: AutoStrategy, name: str, default) -> tuple:
    """The values dimension ``name`` may take: the pinned ones, else ``default``."""
    if name not in auto.pins:
        return tuple(default)
    v = auto.pins[name]
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _offloads(auto: AutoStrategy, zero: int, searched: bool) -> list:
    """The ZeRO-Offload settings a candidate of ZeRO stage ``zero`` may take: the pinned one(s) (a tuple of what is
    offloaded, or a list of such tuples), else none, and where ``searched`` (a GPU, a traced optimizer) the
    optimizer state for ZeRO 1-3 and also the parameters for ZeRO-3."""
    if "offload" in auto.pins:
        v = auto.pins["offload"]
        got = [tuple(x) if not isinstance(x, str) else (x,) for x in v] if isinstance(v, list) else \
            [(v,) if isinstance(v, str) else tuple(v)]
        return [o for o in got if not o or zero >= (3 if "params" in o else 1)]
    if not searched or zero == 0:
        return [()]
    return [(), ("optimizer",)] + ([("optimizer", "params")] if zero == 3 else [])


def _grad_sync_searched(auto: AutoStrategy) -> bool:
    """Whether ``grad_sync`` is a searched dimension: unpinned, or pinned to values of ``SEARCHED_GRAD_SYNC``."""
    if "grad_sync" not in auto.pins:
        return True
    v = auto.pins["grad_sync"]
    vals = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    return all(isinstance(x, str) and x in SEARCHED_GRAD_SYNC for x in vals)


def fixed_options(auto: AutoStrategy) -> dict:
    """Options every candidate gets (the keywords of Strategy.auto that are not searched dimensions; a ``grad_sync``
    pin outside ``SEARCHED_GRAD_SYNC``, a compression method, is one)."""
    return {k: v for k, v in auto.pins.items()
            if k not in SEARCHED or (k == "grad_sync" and not _grad_sync_searched(auto))}


def _check_auto(auto: AutoStrategy) -> None:
    """``allow`` entries the search knows; the fixed options make a Strategy (with ``comm_schedule`` where it is
    pinned to ByteScheduler alone: its own options, ``partition_mb`` and the rest, are fixed options then)."""
    bad = [a for a in auto.allow if a not in ALLOW]
    if bad:
        raise StrategyError(f"{auto}: allow entry {bad[0]!r} is not a method the planner knows; known: "
                            + "; ".join(f"{k!r} ({v})" for k, v in ALLOW.items()))
    only = _choices(auto, "comm_schedule", ())
    Strategy(**fixed_options(auto), **({"comm_schedule": only[0]} if only == ("bytescheduler",) else {}))


class NoPlanFitsError(StrategyError):
    """No candidate of the search space is predicted to fit the devices' memory."""


@dataclass
class AutoSearch:
    """What the search saw and decided: ``ranked`` (fitting, undominated, best first), every candidate it priced,
    and its timings. ``explain()`` prints it."""
    model_name: str
    cluster: ClusterSpec
    auto: AutoStrategy
    ranked: list
    priced: list
    budget_bytes: float
    fitting: list = field(default_factory=list)     # every candidate predicted to fit, fastest first (cheap cost)
    seconds: dict = field(default_factory=dict)
    chosen: Candidate | None = None
    built: list = field(default_factory=list)       # finalists built or probed, in order, with what happened
    dominated: int = 0
    blocks: tuple = (None, 0)                       # the model's repeated blocks: (module path, how many)
    skipped: list = field(default_factory=list)     # finalists not built: their cheap cost is too far behind

    def families(self) -> dict:
        """family -> its best candidate (fitting first, then by step time)."""
        out: dict = {}
        for c in self.priced:
            best = out.get(c.family)
            if best is None or _key(c) < _key(best):
                out[c.family] = c
        return out

    def rejected(self) -> list:
        """``(family, reason)`` for every family the chosen plan is not of."""
        win = self.chosen or (self.ranked[0] if self.ranked else None)
        out = []
        for fam, c in sorted(self.families().items(), key=lambda kv: _key(kv[1])):
            if win is not None and fam == win.family:
                continue
            failed = [b for b in self.built if b.family == fam and b.full and b.full.get("note")]
            why = "; ".join(f"finalist {b} built: {b.full['note']}" for b in failed)
            if win is not None and win.full and any(b.family == fam for b in self.skipped):
                why = (f"not built: its cheap step {c.step_s * 1e3:.3f} ms x {CHEAP_FLOOR} is above the chosen plan's "
                       f"full estimate {win.full['step_s'] * 1e3:.3f} ms")
            out.append((fam, (why + "; then " if why else "") + _why(c, win, self.budget_bytes)))
        return out

    def explain(self, top: int = 8) -> str:
        dev = smallest_device(self.cluster)
        lines = [f"automatic plan ({self.auto}) for {self.model_name} on {self.cluster.world_size} rank(s) of "
                 f"{_devices_name(self.cluster)} ({fmt_bytes(dev.memory_bytes)}; a plan may use "
                 f"{self.auto.margin:.0%}: {fmt_bytes(self.budget_bytes)})"]
        n_fit = sum(c.fits for c in self.priced)
        lines.append(f"  searched {len(self.priced)} candidates in {self.seconds.get('search', 0):.2f}s (profile "
                     f"{self.seconds.get('profile', 0):.2f}s): {len(self.priced) - n_fit} do not fit, "
                     f"{self.dominated} dominated (another is faster and smaller), {len(self.ranked)} ranked")
        if self.built:
            probed = [c for c in self.built if c.full and "probe" in c.full]
            lines.append(f"  finalists: {len(self.built) - len(probed)} built in full"
                         + (f", {len(probed)} probed (built on the model cut to "
                            f"{' and '.join(map(str, probed[0].full['probe']))} blocks, the estimate composed to "
                            f"{self.blocks[1]})" if probed else "")
                         + (f", {len(self.skipped)} not built (cheap step x {CHEAP_FLOOR} above the best built "
                            "one's full step)" if self.skipped else "") + f", in {self.seconds.get('build', 0):.2f}s"
                         + (f" ({self.seconds['workers']} forked worker(s) beside this process)"
                            if self.seconds.get("workers") else ""))
        if self.chosen is not None:
            lines.append(f"  chosen: {self.chosen.strategy(fixed_options(self.auto))}")
        lines += ["", "  ranked: finalists by their full estimate (built or probed), then the rest by the cheap cost",
                  f"  {'':>3}  {'plan':<62} {'cheap step':>10} {'peak':>10} {'built step':>10} {'peak':>10} "
                  f"{'sent/rank':>10}"]
        for i, c in enumerate(self.ranked[:top]):
            full = c.full or {}
            built = (f"{full['step_s'] * 1e3:>8.3f}ms {fmt_bytes(full['peak_bytes']):>10}"
                     if full and math.isfinite(full["step_s"]) else f"{'-':>10} {'-':>10}")
            row = str(c) + (" (cross-iteration)" if c.cross_iteration else "")     # ByteScheduler's, by its cost
            lines.append(f"  {i + 1:>3}  {row[:62]:<62} {c.step_s * 1e3:>8.3f}ms {fmt_bytes(c.peak_bytes):>10} "
                         f"{built} {fmt_bytes(c.predicted[2]):>10}" + (f"  {full['note']}" if full.get("note") else "")
                         + ("  probed" if "probe" in full else ""))
        rej = self.rejected()
        if rej:
            lines += ["", "  other families, and why they lost (their best candidate):"]
            lines += [f"    {fam}: {why}" for fam, why in rej]
        return "\n".join(lines)


def smallest_device(cluster: ClusterSpec):
    """The device with the least memory among the worker ranks' (a plan must fit every rank)."""
    return min(rank_devices(cluster), key=lambda d: d.memory_bytes)


def _devices_name(cluster: ClusterSpec) -> str:
    """``A100-80GB``, or for a heterogeneous cluster ``A100-80GB, V100-32GB (smallest: V100-32GB)``."""
    devs = rank_devices(cluster)
    if len(devs) == 1:
        return devs[0].name
    return f"{', '.join(d.name for d in devs)} (smallest: {smallest_device(cluster).name})"


def _key(c: Candidate) -> tuple:
    """Fitting first, then built before not built (the full estimate is the better figure), then predicted step
    time, then peak memory."""
    step, peak, _ = c.predicted
    return (not c.fits, c.full is None, step, peak)


def _cheap_key(c: Candidate) -> tuple:
    return (not c.fits, c.step_s, c.peak_bytes)


def _why(c: Candidate, win: Candidate | None, budget: float) -> str:
    if not c.fits:
        if c.note:
            return c.note
        cls = max(c.memory, key=c.memory.get)
        return (f"does not fit: {fmt_bytes(c.peak_bytes)} > {fmt_bytes(budget)} by {fmt_bytes(c.peak_bytes - budget)}"
                f" ({str(c)}); the largest class is {cls} at {fmt_bytes(c.memory[cls])}")
    if win is None:
        return "not chosen"
    full = c.full is not None and win.full is not None     # compare like with like: both built, or both cheap
    step, wstep = (c.full["step_s"], win.full["step_s"]) if full else (c.step_s, win.step_s)
    how = ("cheap cost" if not full else "built programs' estimates" if "probe" not in {**c.full, **win.full}
           else "full estimates (a probed one composed from its cut builds)")
    extra = {k: c.time.get(k, 0.0) - win.time.get(k, 0.0) for k in c.time}
    part = max(extra, key=extra.get)
    return (f"slower by the {how}: {step * 1e3:.3f} ms vs {wstep * 1e3:.3f} ms ({str(c)}); the cheap cost puts "
            f"most of the difference in {part} ({c.time.get(part, 0.0) * 1e3:.3f} ms vs "
            f"{win.time.get(part, 0.0) * 1e3:.3f} ms)")


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_pins(auto: AutoStrategy, prof, cluster: ClusterSpec, batch: int, model_name: str) -> None:
    """A pinned dimension that the world size or the model rules out is named with what rules it out."""
    world = cluster.world_size
    for name in ("dp", "tp", "pp"):
        for v in _choices(auto, name, ()):
            if not isinstance(v, int) or v < 1 or world % v:
                raise StrategyError(f"{auto}: {name}={v!r} does not divide the ClusterSpec's world size {world}; "
                                    f"pin one of {_divisors(world)}")
    for v in _choices(auto, "tp", ()):
        if prof.heads and prof.heads % v:
            raise StrategyError(f"{auto}: tp={v} does not divide {model_name}'s {prof.heads} attention heads; pin a "
                                f"divisor of {prof.heads} that divides {world}: "
                                f"{[d for d in _divisors(world) if prof.heads % d == 0]}")
    for v in _choices(auto, "pp", ()):
        if prof.n_blocks and prof.n_blocks % v:
            raise StrategyError(f"{auto}: pp={v} does not divide {model_name}'s {prof.n_blocks} layers "
                                f"({prof.block_path}); pin a divisor of {prof.n_blocks} that divides {world}: "
                                f"{[d for d in _divisors(world) if prof.n_blocks % d == 0]}")
        if not prof.n_blocks and v > prof.leaf_modules:
            raise StrategyError(f"{auto}: pp={v} stages but {model_name} has {prof.leaf_modules} modules with "
                                "parameters to cut between; pin a smaller pp")
    for v in _choices(auto, "dp", ()):
        if batch % v:
            raise StrategyError(f"{auto}: dp={v} does not divide the global batch {batch}; pin a divisor of {batch}")
    for v in _choices(auto, "schedule", ()):
        if v not in schedule_names():
            raise StrategyError(f"{auto}: schedule={v!r} is not a pipeline schedule; choose among {schedule_names()}")
    if "grad_sync" in auto.pins and _grad_sync_searched(auto):
        vals = _choices(auto, "grad_sync", ())
        if "herring" in vals and (cluster.nodes < 2 or cluster.devices_per_node < 2):
            raise StrategyError(f"{auto}: grad_sync='herring' sums within nodes, then across them; the ClusterSpec has "
                                f"{cluster.nodes} node(s) of {cluster.devices_per_node} device(s). Give it at least 2 "
                                "nodes of at least 2 devices (ClusterSpec.preset(..., nodes=2), ClusterSpec.local(4, "
                                "nodes=2, devices_per_node=2)) or pin grad_sync='allreduce'")
    v = auto.pins.get("memory_budget_gb")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
        raise StrategyError(f"{auto}: memory_budget_gb={v!r}: recompute='auto''s budget of saved activations per "
                            "stage, a positive number of GB (1e9 bytes); or leave it out (the room under the memory "
                            "budget)")
    if v is not None and "auto" not in _choices(auto, "recompute", RECOMPUTE):
        raise StrategyError(f"{auto}: memory_budget_gb={v!r} is recompute='auto''s budget, and the recompute pin "
                            f"{auto.pins['recompute']!r} leaves no 'auto': add 'auto' to it or drop memory_budget_gb")
    for v in _choices(auto, "comm_schedule", ()):
        if v not in COMM_SCHEDULES:
            raise StrategyError(f"{auto}: comm_schedule={v!r} is not a gradient communication order the planner "
                                f"searches; pin one or more of {COMM_SCHEDULES}")


def _precisions(auto: AutoStrategy, cluster: ClusterSpec, elem: int) -> tuple:
    """The compute precisions searched: the pinned ones, else the model's own and, on a GPU with bfloat16
    arithmetic and a float32 model, bf16."""
    bf16 = all(bf16_supported(d) for d in rank_devices(cluster)) and elem == 4
    return _choices(auto, "precision", ("fp32", "bf16") if bf16 else ("fp32",))


def _enumerate(auto: AutoStrategy, prof, cluster: ClusterSpec, batch: int, traced: bool, elem: int = 4) -> list:
    """Every candidate the pins, the model and the world size allow (before any cost)."""
    world, per_node = cluster.world_size, cluster.devices_per_node
    precisions = _precisions(auto, cluster, elem)
    offload_searched = all(d.kind == "cuda" for d in rank_devices(cluster)) and traced
    bucket = auto.pins.get("bucket_cap_mb")
    out = []
    tps = _choices(auto, "tp", [d for d in _divisors(world) if per_node % d == 0 or d <= per_node])
    for tp in tps:
        if prof.heads and prof.heads % tp:
            continue
        for pp in _choices(auto, "pp", _divisors(world // tp)):
            if world % (tp * pp):
                continue
            if pp > 1 and (prof.n_blocks % pp if prof.n_blocks else pp > prof.leaf_modules):
                continue
            dp = world // (tp * pp)
            if "dp" in auto.pins and dp not in _choices(auto, "dp", ()):
                continue
            if batch % dp:
                continue
            scheds = [None] if pp == 1 else list(SCHEDULES) + (["2bw"] if "asynchronous" in auto.allow else [])
            if pp > 1:
                scheds = [s for s in scheds if s != "interleaved" or not prof.n_blocks or prof.n_blocks % (2 * pp) == 0]
            scheds = [s for s in scheds if s is None or s in _choices(auto, "schedule", scheds)]
            per_dp = batch // dp
            # microbatches: with a pipeline, pp x 1, 2, 4, ... (more shrink the bubble and the microbatch); without,
            # gradient accumulation's first few (they only save memory)
            divs = [m for m in _divisors(per_dp) if m <= MAX_MICROBATCHES]
            ms = [m for m in divs if m >= pp and (m // pp) & (m // pp - 1) == 0 and m % pp == 0] if pp > 1 else divs[:4]
            if pp > 1:      # microbatches of one and two samples (Megatron's choice at scale), past MAX_MICROBATCHES too
                ms += [m for m in (per_dp // 2, per_dp) if m >= pp and m % pp == 0 and per_dp % m == 0 and m not in ms]
            ms = [m for m in _choices(auto, "microbatches", ms) if pp == 1 or m >= pp]
            zeros = _choices(auto, "zero", (0, 1, 2, 3) if dp > 1 and tp == 1 and traced else (0,))
            modes = [None] if tp == 1 else [m for m in ("megatron", "auto") if m != "auto" or not tp & (tp - 1)]
            modes = [x for x in modes if x is None or x in _choices(auto, "sharding", modes)]
            syncs = [None] + (["bf16"] if "compression" in auto.allow and dp > 1 else [])
            # Herring: several nodes of several ranks each, data parallelism alone (its feature's conditions)
            if dp > 1 and tp == 1 and pp == 1 and cluster.nodes > 1 and per_node > 1 and dp % per_node == 0 \
                    and dp // per_node > 1:
                syncs.append("herring")
            if "grad_sync" in auto.pins and _grad_sync_searched(auto):
                pinned = [None if x == "allreduce" else x for x in _choices(auto, "grad_sync", ())]
                syncs = [g for g in pinned if g is None or g == "herring" and g in syncs or g == "bf16" and dp > 1]
            # ByteScheduler: gradients summed over dp by plain all-reduce, one stage, one microbatch (the fused step
            # its cheap cost simulates), repeated blocks to order; not with ZeRO or tp (the features refuse it)
            orders = _choices(auto, "comm_schedule", COMM_SCHEDULES)
            for sched in scheds:
                for m in ms:
                    if per_dp % m:
                        continue
                    for z in zeros:
                        if z and (dp == 1 or tp > 1 or (sched == "2bw")):
                            continue
                        offs = _offloads(auto, z, offload_searched and sched != "2bw")
                        for rc in _choices(auto, "recompute", RECOMPUTE):
                            for mode in modes:
                                for gs in syncs:
                                    if gs and (z or tp > 1):
                                        continue
                                    for cs in orders:
                                        if cs != "fifo" and (dp == 1 or z or tp > 1 or pp > 1 or m > 1 or gs
                                                             or not prof.n_blocks):
                                            continue
                                        for prec in precisions:
                                            for off in offs:
                                                out.append(Candidate(dp, tp, pp, sched, m, z, rc, mode, gs, prec,
                                                                     off, bucket, comm_schedule=cs))
    return out


def _pareto(fitting: list) -> tuple:
    """(undominated, best first; how many were dominated). Sorted by (step, memory), a candidate survives when its
    memory is below every faster one's."""
    ranked, low, dropped = [], math.inf, 0
    for c in sorted(fitting, key=_cheap_key):
        if c.peak_bytes < low or not ranked:
            ranked.append(c)
            low = min(low, c.peak_bytes)
        else:
            dropped += 1
    return ranked, dropped


def search(model, cluster: ClusterSpec, example: tuple, loss_fn, optimizer, auto: AutoStrategy,
           prune: bool = True, profile=None) -> AutoSearch:
    """Price every candidate; ``prune=False`` keeps the dominated ones in ``ranked`` (for checks)."""
    t0 = time.perf_counter()
    _check_auto(auto)
    spec = resolve_optimizer(optimizer)
    n_state = len(spec.state_names) if spec.traced else 2
    prof = profile if profile is not None else profile_model(model, example, loss_fn)
    t1 = time.perf_counter()
    batch = int(example[0].shape[0])
    name = type(model).__name__
    _check_pins(auto, prof, cluster, batch, name)
    elem = max((p.element_size() for p in model.parameters()), default=4)
    profiles = {p: profile_model(model, example, loss_fn, dtype=PRECISION_DTYPES[p])
                for p in _precisions(auto, cluster, elem) if p in PRECISION_DTYPES}
    t1 = time.perf_counter()
    pr = _Pricer(prof, cluster, batch, n_state, elem, profiles, fixed_options(auto))
    pr.search_buckets = "bucket_cap_mb" not in auto.pins
    pr.traced = spec.traced
    pr.budget = budget = auto.margin * smallest_device(cluster).memory_bytes
    pr.auto_only = _choices(auto, "recompute", RECOMPUTE) == ("auto",)
    pr.budget_pin = auto.pins.get("memory_budget_gb")
    priced = []
    for c in _enumerate(auto, prof, cluster, batch, spec.traced, elem):
        cost_candidate(c, pr)
        if c.note == AUTO_IS_NONE:       # the same plan as recompute="none": not a candidate of its own
            continue
        c.fits = c.fits and c.peak_bytes <= budget
        priced.append(c)
    fitting = [c for c in priced if c.fits]
    if prune:
        ranked, dropped = _pareto(fitting)
    else:
        ranked, dropped = sorted(fitting, key=_cheap_key), 0
    out = AutoSearch(name, cluster, auto, ranked, priced, budget, sorted(fitting, key=_cheap_key), dominated=dropped,
                     blocks=(prof.block_path, prof.n_blocks))
    out.seconds = {"profile": t1 - t0, "search": time.perf_counter() - t0}
    if not priced:
        raise StrategyError(f"{auto}: no candidate plan for {name} on {cluster.world_size} rank(s): the pins, the "
                            f"global batch {batch} and the model ({prof.n_blocks} layers, {prof.heads} heads) leave "
                            "none; loosen a pin")
    if not ranked:
        raise _no_fit(out, [c for c in priced if c.note == ""])
    return out


def _no_fit(s: AutoSearch, priced: list) -> NoPlanFitsError:
    small = min(priced or s.priced, key=lambda c: c.peak_bytes)
    dev = smallest_device(s.cluster)
    return NoPlanFitsError(
        f"{s.auto}: no plan for {s.model_name} fits {s.cluster.world_size} x {_devices_name(s.cluster)} "
        f"({fmt_bytes(dev.memory_bytes)}, {s.auto.margin:.0%} usable: {fmt_bytes(s.budget_bytes)}). The smallest "
        f"predicted peak is {fmt_bytes(small.peak_bytes)} per device, by {small.strategy(fixed_options(s.auto))} "
        f"({', '.join(f'{k} {fmt_bytes(v)}' for k, v in small.memory.items())}); it would fit devices of "
        f"{fmt_bytes(small.peak_bytes / s.auto.margin)}. Use more ranks or bigger devices, a smaller global batch, "
        "or allow more (Strategy.auto(margin=...)).")


def auto_plan(model: torch.nn.Module, cluster, example_inputs, loss_fn=None, optimizer=None, strategy="auto",
         prune: bool = True) -> list:
    """The automatic planner's candidates for ``model`` on ``cluster``, best first, without building a program:
    each a :class:`~fxpar.auto.space.Candidate` (``.strategy()``, ``.step_s``, ``.peak_bytes``, ``.memory``,
    ``.time``). ``strategy``: ``"auto"`` or ``Strategy.auto(...)`` (pins, ``allow``, ``margin``).
    The returned list has the search itself as ``.search`` (an :class:`AutoSearch`; ``print(x.search.explain())``)."""
    cluster = ClusterSpec.local(cluster) if isinstance(cluster, int) else cluster
    auto = as_auto(strategy)
    layout = BatchLayout.of(example_inputs, loss_fn)
    example = layout.flatten(example_inputs, "example_inputs")
    s = search(model, cluster, example, loss_fn, optimizer, auto, prune=prune)
    out = _Ranked(s.ranked)
    out.search = s
    return out


class _Ranked(list):
    search: AutoSearch


def as_auto(strategy) -> AutoStrategy:
    if isinstance(strategy, AutoStrategy):
        return strategy
    if strategy == "auto":
        return AutoStrategy()
    raise StrategyError(f"strategy={strategy!r}: the automatic planner takes 'auto' or fxpar.Strategy.auto(...)")


def finalists(s: AutoSearch) -> list:
    """``(finalists, the rest)``: the fastest fitting candidate (cheap cost) of each of the ``finalists`` families
    whose fastest is fastest (a family: mesh and schedule), with every tp mode of a tensor-parallel one, and beside a
    ByteScheduler one its FIFO twin (the same point with FIFO buckets: whether cross-iteration overlap pays is decided
    on the captured step, near the feature's 2% the build may decide otherwise); then the ranking (the undominated
    candidates), in order, built only while none of the finalists fits."""
    first, fams, seen, twins = [], [], set(), set()
    for c in s.fitting:
        point = (c.family, c.microbatches, c.zero, c.recompute, c.grad_sync, c.precision, c.offload, c.budget_gb)
        key = point + (c.bucket_mb, c.comm_schedule)
        if c.family not in fams:
            if len(fams) == s.auto.finalists:
                continue
            fams.append(c.family)
            seen.add(key)
            if c.comm_schedule != "fifo":
                twins.add(point)
            first.append(c)
        elif key in seen and c.sharding is not None:      # the same point under the other tp mode
            first.append(c)
        elif point in twins and c.comm_schedule == "fifo":  # the fastest FIFO twin of a ByteScheduler finalist
            twins.discard(point)
            first.append(c)
    return first, [c for c in s.ranked if all(c is not f for f in first)]


def choose(s: AutoSearch, build, model: torch.nn.Module | None = None, workers: int = 0) -> tuple:
    """Estimate the :func:`finalists` in full and keep the fastest that fits (ties: less memory). Returns
    ``(program, candidate)``. ``build(strategy) -> Program`` builds on the user's model; with ``model`` (that
    model), ``build(strategy, model=cut)`` builds on a cut copy of it for the probes (without, every finalist is
    built). ``workers``: forked processes that estimate the finalists past the first while this one builds it
    (:mod:`fxpar.auto.workers`; 0: none); the decisions below are taken in the same order either way.

    The cheap cost's first finalist is built; each other one-stage finalist of a model with repeated blocks is
    probed (:mod:`fxpar.auto.probe`: built on the model cut to 1 and 2 blocks, its estimate composed to the whole
    depth); a pipeline is built. A probed finalist that comes within ``PROBE_MARGIN`` of the best built one is then
    built too, and so is the best one whose whole build ran in a worker, so the returned program is always this
    process's build of the whole model, and the pick is the best by the full estimates. Past the finalists,
    candidates are built in rank order until one fits."""
    t0 = time.perf_counter()
    first, rest = finalists(s)
    path, n_blocks = s.blocks
    fixed = fixed_options(s.auto)
    cut: dict = {}              # depth -> the cut model, held so a shared capture's key (its id) stays its own
    programs: dict = {}         # id(candidate) -> its program, built in full here
    whole: set = set()          # id(candidate) whose figures are a whole build's (here or in a worker)

    def depths_of(i: int, c):
        return probe_depths(c, n_blocks) if i > 0 and model is not None else None

    def probe_figures(c, depths, models: dict) -> list:
        for k in depths:
            if k not in models:
                models[k] = truncated(model, path, k)
        return [_figures(build(c.strategy(fixed), model=models[k]).estimate()) for k in depths]

    def set_whole(c, figures: dict) -> None:
        was = c.full if c.full and "probe" in c.full else None
        c.full = {**figures, "note": ""}
        if was is not None:                 # what the probe had composed, beside the whole build's figures
            c.full["probed"] = {k: was[k] for k in ("step_s", "peak_bytes", "comm_bytes", "probe")}
        whole.add(id(c))
        _memory_note(c, s.budget_bytes)

    def set_probed(c, depths, got: list) -> None:
        c.full = {**extrapolate(got[0], got[1], depths[0], depths[1], n_blocks), "note": "", "probe": tuple(depths)}
        _memory_note(c, s.budget_bytes * (1 + PROBE_MARGIN))       # near the budget: built whole if it is chosen

    def full_build(c) -> None:
        try:
            prog = build(c.strategy(fixed))
            figures = _figures(prog.estimate())
        except Exception as e:  # noqa: BLE001 - a candidate the program builder refuses is reported and skipped
            _refused(c, f"{type(e).__name__}: {e}")
            return
        programs[id(c)] = prog
        set_whole(c, figures)

    def evaluate(members: list) -> list:    # in a worker: each member's figures, or why there are none
        models: dict = {}
        out = []
        for c, depths in members:
            try:
                out.append(("probe", probe_figures(c, depths, models)) if depths is not None
                           else ("whole", _figures(build(c.strategy(fixed)).estimate())))
            except Exception as e:  # noqa: BLE001 - the parent decides, as it would on its own build
                out.append(("error", f"{type(e).__name__}: {e}"))
        return out

    pool, group_of = None, {}
    if workers and len(first) > 1:
        groups: dict = {}       # one task per (family, microbatches, probe depths): a tp point's modes share captures
        for i, c in enumerate(first[1:], 1):
            d = depths_of(i, c)
            members = groups.setdefault((c.family, c.microbatches, d), [])
            group_of[id(c)] = ((c.family, c.microbatches, d), len(members))
            members.append((c, d))
        pool = Forked(workers)
        for key, members in groups.items():
            pool.submit(key, lambda members=members: evaluate(members))
        pool.start()

    def from_worker(c):
        if pool is None or id(c) not in group_of:
            return None
        key, j = group_of[id(c)]
        # a worker does what this process does in about the time it took here so far: far past that, it is hung
        got = pool.result(key, timeout_s=max(60.0, 10 * (time.perf_counter() - t0)))
        return got[1][j] if got is not None and got[0] == "ok" else None

    def best_built():
        done = [c for c in s.built if c.fits and id(c) in whole]
        return min(done, key=_key) if done else None

    try:
        for i, c in enumerate(first):
            best = best_built()
            if best is not None and c.step_s * CHEAP_FLOOR > best.full["step_s"]:
                s.skipped.append(c)         # no build of it can beat the best built one, by the cheap cost's error
                continue
            depths, got = depths_of(i, c), from_worker(c)
            if got is not None and got[0] == "error":
                got = None                  # estimated here, as without workers: its own error is the answer
            if depths is not None:
                if got is None:
                    try:
                        got = ("probe", probe_figures(c, depths, cut))
                    except Exception:  # noqa: BLE001 - a model that does not run cut short is built whole instead
                        got = None
                if got is not None and got[0] == "probe":
                    set_probed(c, depths, got[1])
                else:
                    full_build(c)
            elif got is not None and got[0] == "whole":
                set_whole(c, got[1])
            else:
                full_build(c)
            s.built.append(c)
    finally:
        if pool is not None:
            s.seconds["workers"] = pool.started
            pool.close()
    while True:                 # the best by the full estimates, built here; a probed rival near it, built too
        best = best_built()
        if best is not None and id(best) not in programs:
            full_build(best)        # its whole build ran in a worker: the program returned is built here
            continue
        near = [c for c in s.built if c.fits and id(c) not in whole and c.full and
                (best is None or c.full["step_s"] <= best.full["step_s"] * (1 + PROBE_MARGIN))]
        if not near:
            break
        full_build(min(near, key=_key))
    for c in rest:
        if best_built() is not None:
            break
        full_build(c)
        s.built.append(c)
    s.seconds["build"] = time.perf_counter() - t0
    s.ranked = sorted(s.built + [c for c in s.ranked if all(c is not b for b in s.built)], key=_key)
    s.chosen = best_built()
    if s.chosen is None:
        raise _no_fit(s, [c for c in s.priced if not c.note])
    return programs[id(s.chosen)], s.chosen


def _figures(est) -> dict:
    return {"step_s": est.step_time_s, "peak_bytes": max(r.peak_memory_bytes for r in est.ranks),
            "comm_bytes": max(r.comm_bytes for r in est.ranks)}


def _refused(c: Candidate, why: str) -> None:
    """``why``: the builder's error as ``TypeName: message``."""
    c.full = {"step_s": math.inf, "peak_bytes": c.peak_bytes, "comm_bytes": c.comm_bytes,
              "note": f"refused: {why[:160 + why.find(': ') + 2]}"}
    c.fits = False


def _memory_note(c: Candidate, budget: float) -> None:
    if c.full["peak_bytes"] > budget:
        c.full["note"] = f"over memory: {fmt_bytes(c.full['peak_bytes'])}"
        c.fits = False
