"""``fxpar.parallelize``: model + cluster + strategy → Program. One road for every strategy:

    capture ─▶ Plan ─▶ one pass list over each stage's joint graph ─▶ split into the graphs the
    schedule calls ─▶ one executor

A program without a pipeline is a one-stage pipeline whose schedule is ``FULL0.0`` (forward,
backward, gradient collectives and update as one graph), or, with ``microbatches > 1``,
``F0.0 B0.0 F0.1 B0.1 ... RG0 STEP0`` (gradient accumulation).
"""
from __future__ import annotations

import contextlib
import difflib
import inspect
import time
import warnings

import torch

from .batch_semantics import batch_notes
from .auto import as_auto, choose
from .auto import search as auto_search
from .auto.workers import worker_count
from .capture import capture_training_step, captures_differ, shared_captures, unshared_captures
from .cluster import ClusterSpec
from ._tracing import BatchLayout
from .errors import InputError, StrategyError
from .feature import get_feature, schedule_names
from .losses import choose_loss
from .lower import lower
from .optim import check_optimizer_params, resolve_optimizer
from .plan import Plan
from .planner import check_batch, grad_groups, grad_scale, is_asynchronous, make_plan
from .program import Program, Stage, stage_messages
from .strategy import AutoStrategy, Strategy

__all__ = ["parallelize"]


def parallelize(model: torch.nn.Module, cluster, example_inputs, loss_fn=None, optimizer=None,
                strategy=None, lr_scheduler=None, plan: Plan | None = None, check_capture: bool = False) -> Program:
    """Compile ``model``'s training step into one program per rank.

    model: an ``nn.Module`` that trains on one device.
    cluster: a :class:`ClusterSpec` (or an int: ``ClusterSpec.local(n)``).
    example_inputs: one *global* batch, the batch on dim 0 of every tensor: ``(inputs..., target)``; a dict of
        keyword inputs (Hugging Face style ``{"input_ids": ..., "attention_mask": ..., "labels": ...}``); or both,
        ``((inputs..., target), {...})`` / ``(inputs..., target, {...})``. ``run_local``'s batches take the same
        structure, shapes and dtypes (checked before any rank starts).
    loss_fn: ``loss_fn(model(*inputs, **keywords), target)``; None if the model returns its loss (a tensor, or an
        output with a ``loss`` field). Cross-entropy / NLL are seen into: by default the loss is the global
        batch's across shards and microbatches (``Strategy(loss_average=...)``, docs/semantics.md).
    optimizer: ``(torch.optim.X, kwargs)``; SGD, Adam and AdamW are traced into the graph.
    strategy: a :class:`Strategy`; None (data parallel over every rank); ``"auto"`` or ``Strategy.auto(...)`` (the
        automatic planner: it ranks meshes, schedules, microbatches and the features' options by the cost models,
        builds the best few and returns the fastest predicted to fit; ``program.explain()`` shows the search); or a
        list of passes (data parallel over every rank, then those passes).
    lr_scheduler: ``(torch.optim.lr_scheduler.X, kwargs)`` or a picklable ``callable(torch_optimizer)``;
        stepped after every optimizer step.
    plan: a Plan to use instead of the planner's (e.g. one you edited from ``program.plan``): its
        schedule, microbatches, cuts and buckets are taken; what depends on an edit is planned again.
    check_capture: capture the step a second time and warn where the two graphs differ: a decision forward takes in
        Python on something other than the batch (a clock, a global, a counter) is frozen into the graph at
        capture, and one that changes between two captures shows here (docs/semantics.md). Doubles capture time.
    """
    if isinstance(cluster, int):
        cluster = ClusterSpec.local(cluster)
    if not isinstance(cluster, ClusterSpec):
        raise TypeError(f"cluster={cluster!r}: pass fxpar.ClusterSpec.local(world_size) or another ClusterSpec")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model is a {type(model).__name__}; fxpar parallelises a torch.nn.Module: pass the module "
                        "(wrap a plain function in an nn.Module whose forward calls it).")
    if strategy == "auto" or isinstance(strategy, AutoStrategy):
        if plan is not None:
            raise StrategyError("parallelize(plan=..., strategy='auto'): a handed-back Plan is already decided; pass "
                                "its strategy (program.strategy) with it, or drop plan= to search again")
        layout = BatchLayout.of(example_inputs, loss_fn)
        auto = as_auto(strategy)
        found = auto_search(model, cluster, layout.flatten(example_inputs, "example_inputs"), loss_fn, optimizer,
                            auto)
        # finalists on the same microbatch (a tp point's two modes) trace it once; check_capture traces each twice;
        # one-stage finalists past the first are probed on the model cut to 1 and 2 blocks (fxpar/auto/probe.py);
        # the finalists past the first are estimated in forked workers while this process builds the first
        with contextlib.nullcontext() if check_capture else shared_captures():
            program, _ = choose(found, lambda s, model=model: parallelize(
                model, cluster, example_inputs, loss_fn, optimizer, s, lr_scheduler, check_capture=check_capture),
                model=model, workers=worker_count(auto.workers))
        program.auto_search = found
        return program
    explicit = strategy is not None          # a handed-back Plan with no Strategy: the Plan says what runs
    strategy = Strategy.coerce(strategy, cluster.world_size)
    if strategy.size != cluster.world_size:
        raise StrategyError(
            f"{strategy} uses dp*tp*pp = {strategy.size} ranks but the ClusterSpec has {cluster.world_size} "
            f"({cluster.nodes} node(s) x {cluster.devices_per_node}); make them equal, e.g. "
            f"Strategy(dp={cluster.world_size}) or ClusterSpec.local({strategy.size}).")
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan={plan!r}: pass a fxpar.Plan (e.g. program.plan, or Plan.from_json(text))")
    if plan is not None:
        plan.check_edits(strategy, [k for k, _ in model.named_parameters(remove_duplicate=False)],
                         against_made_with=explicit)
    spec = resolve_optimizer(optimizer)
    needs = getattr(spec.cls, "fxpar_grad_sync", None)        # an optimizer made for one gradient-sync feature
    if needs is not None and not get_feature(needs).enabled(strategy) and (plan is None or plan.section(needs) is None):
        raise StrategyError(f"optimizer {spec.cls.__name__} steps along the direction the grad_sync feature {needs!r} "
                            f"computes, not along a gradient; {strategy} has no grad_sync={needs!r}, so it would run "
                            f"plain SGD. Pass Strategy(grad_sync={needs!r}) (or the method with its options), or "
                            "another optimizer, e.g. (torch.optim.Adam, {'lr': 1e-3}).")
    layout = BatchLayout.of(example_inputs, loss_fn)
    _check_call(model, layout)
    example = layout.flatten(example_inputs, "example_inputs")
    m = plan.microbatches if plan is not None else strategy.microbatches
    check_batch(example, strategy.dp, m, names=[layout.describe(i, "example_inputs") for i in range(len(example))])
    loss = choose_loss(strategy.loss_average, loss_fn, asynchronous=is_asynchronous(strategy, plan),
                       k=strategy.dp * m)
    batch = example + loss.extra_columns(example, layout.n_inputs, layout.describe(layout.n_inputs, "example_inputs"))
    if any(p.device.type == "meta" for p in model.parameters()):     # a meta model is planned on meta inputs
        batch = tuple(t.to("meta") for t in batch)
    t0 = time.perf_counter()
    given = plan
    plan, sched, trace, split = make_plan(strategy, batch, model=model, loss_fn=loss.fn, cluster=cluster,
                                          base=given, optimizer=spec, layout=layout)
    plan.loss_average = loss.mode
    if loss.note:
        plan.notes.append(loss.note)
    if plan.asynchronous and lr_scheduler is not None:
        raise StrategyError(f"schedule {plan.schedule!r} updates weights inside a window of microbatches; an "
                            "lr_scheduler stepped once per batch is not defined for it. Drop lr_scheduler or use a "
                            f"synchronous schedule {schedule_names(asynchronous=False)}.")
    m = plan.microbatches
    micro = layout.unflatten(tuple(t.narrow(0, 0, plan.global_batch // (plan.dp * m)) for t in batch))
    scale = grad_scale(plan)       # 1/m: an update averages the step's microbatches (unless the schedule says)

    def capture_all():
        if split is None:
            return [capture_training_step(model, micro, loss.fn, spec, grad_scale=scale)]
        return [capture_training_step(model, micro, loss.fn, spec, stage=st, grad_scale=scale) for st in split.stages]
    with unshared_captures() if check_capture else contextlib.nullcontext():
        captured = capture_all()
    if check_capture:
        with warnings.catch_warnings(), unshared_captures():
            warnings.simplefilter("ignore")           # what the first capture warned about, it said once
            again = capture_all()
        for s, (a, b) in enumerate(zip(captured, again)):
            diff = captures_differ(a.gm, b.gm)
            if diff:
                where = "" if split is None else f" (stage {s})"
                warnings.warn(f"{type(model).__name__}: two captures of the training step{where} differ: {diff}. "
                              "forward takes a decision in Python on something other than the batch (a clock, a "
                              "global, a counter, Python's random), and the graph replays the branch of the first "
                              "capture every step; make the decision a tensor op on the batch, or fix it before "
                              "parallelize (docs/semantics.md, Python-level randomness and state).", stacklevel=2)
    t1 = time.perf_counter()
    _without_gradient(plan, captured, model)
    plan.notes += batch_notes(captured, plan, {k: type(v).__name__ for k, v in model.named_modules()},
                              type(model).__name__)
    _check_parameters_fit(captured, cluster, model)
    check_optimizer_params(spec, {k: cap.param_shapes[k] for cap in captured for k in cap.param_names})
    for name, section in plan.features.items():       # the features' decisions that need each stage's graph (buckets)
        for s, cap in enumerate(captured):
            get_feature(name).plan_stage(section, plan, s, cap, cluster, sched)
    lowered = lower(captured, plan, sched, cluster, strategy.passes)
    plan.passes = [h.pass_name for h in lowered[0][2][1:] if not h.pass_name.startswith("split_graphs:")]
    stages = [Stage(s, cap, parts, gm, hist, notes, stage_messages(cap))
              for s, (cap, (parts, gm, hist, notes)) in enumerate(zip(captured, lowered))]
    if given is not None:
        given.check_derived(plan)          # an edit of a field the run derives is refused, not dropped
    t2 = time.perf_counter()
    return Program(model=model, plan=plan, strategy=strategy, cluster=cluster, schedule=sched, stages=stages,
                   split=split, trace=trace, optimizer=spec, lr_scheduler=lr_scheduler, n_inputs=layout.n_inputs,
                   timings={"capture": t1 - t0, "lower": t2 - t1}, layout=layout, loss=loss, example=example)


def _check_call(model: torch.nn.Module, layout: BatchLayout) -> None:
    """The model's forward takes the batch's inputs: keyword names it knows, no more positional inputs than it
    has parameters, every required one given."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return
    P = inspect.Parameter
    name = f"{type(model).__name__}.forward"
    known = [p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    if not any(p.kind == P.VAR_KEYWORD for p in params):
        for k in layout.kwargs:
            if k not in known:
                near = difflib.get_close_matches(k, known, n=1)
                raise InputError(f"example_inputs[{k!r}]: {name} has no argument {k!r} (its arguments: "
                                 f"{', '.join(known)}); rename the key" + (f" (did you mean {near[0]!r}?)" if near else "")
                                 + " or pass the tensor by position.")
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    if not any(p.kind == P.VAR_POSITIONAL for p in params) and layout.n_args > len(positional):
        target = " before the target (the last element, which goes to loss_fn)" if layout.n_targets else ""
        raise InputError(f"example_inputs has {layout.n_args} model input(s){target}, but {name} takes "
                         f"{len(positional)} ({', '.join(p.name for p in positional) or 'none'}): drop the extra "
                         "tensor(s), or pass loss_fn=None if the model takes the labels and returns the loss itself.")
    given = {p.name for p in positional[:layout.n_args]} | set(layout.kwargs)
    missing = [p.name for p in params if p.default is P.empty and p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD,
                                                                            P.KEYWORD_ONLY) and p.name not in given]
    if missing:
        raise InputError(f"{name} needs {', '.join(repr(k) for k in missing)}, which example_inputs does not give "
                         f"(it is {layout.shape_text()}): add the tensor(s) to example_inputs"
                         + (" before the target." if layout.n_targets else "."))


def _without_gradient(plan: Plan, captured: list, model: torch.nn.Module) -> None:
    """Parameters the loss never reaches (capture froze them, or no pipeline stage uses them): torch.optim
    skips a parameter whose ``.grad`` is None, so they are never updated; the Plan says so."""
    frozen = [k for s, cap in enumerate(captured) for k in plan.stage_params[s] if k not in cap.param_names]
    if frozen:
        plan.stage_params = [list(cap.param_names) for cap in captured]
        tied = {k: [s for s in v if k in plan.stage_params[s]] for k, v in plan.tied.items()}
        plan.tied = {k: v for k, v in tied.items() if len(v) > 1}
        kept = {n: g for n, g in plan.groups.items() if not n.startswith(("tied.", "stage"))}   # the features' groups
        plan.groups, plan.grad_groups = grad_groups(plan)
        plan.groups.update(kept)
    placed = {k for keys in plan.stage_params for k in keys}
    never = [k for k, v in model.named_parameters() if v.requires_grad and k not in placed]
    if never:
        plan.notes.append(f"parameters {never} get no gradient from the loss: like torch.optim with .grad None, "
                          "they are never updated and have no optimizer state; state_dict() keeps them as they were")


def _check_parameters_fit(captured: list, cluster: ClusterSpec, model) -> None:
    """Every rank holds at least one whole parameter tensor: it must fit in one device."""
    best, size = None, -1
    for cap in captured:
        for k in cap.param_names:
            n = int(torch.Size(cap.param_shapes[k]).numel()) * torch.empty((), dtype=cap.param_dtypes[k]).element_size()
            if n > size:
                best, size = (k, cap.param_shapes[k]), n
    if best is not None:
        cluster.check_fits(size, f"parameter '{best[0]}' of {type(model).__name__} (shape {tuple(best[1])})")
