"""``fxpar.parallelize``: model + cluster + strategy → Program. One road for every strategy:

    capture ─▶ Plan ─▶ one pass list over each stage's joint graph ─▶ split into the graphs the
    schedule calls ─▶ one executor

A program without a pipeline is a one-stage pipeline whose schedule is ``FULL0.0`` (forward,
backward, gradient collectives and update as one graph), or, with ``microbatches > 1``,
``F0.0 B0.0 F0.1 B0.1 ... RG0 STEP0`` (gradient accumulation).
"""
from __future__ import annotations

import time

import torch

from .capture import capture_training_step
from .cluster import ClusterSpec
from .errors import StrategyError
from .lower import lower
from .optim import resolve_optimizer
from .plan import Plan
from .planner import ASYNC, make_plan, plan_buckets
from .program import Program, Stage, stage_messages
from .strategy import Strategy

__all__ = ["parallelize"]


def parallelize(model: torch.nn.Module, cluster, example_inputs, loss_fn=None, optimizer=None,
                strategy="auto", lr_scheduler=None, plan: Plan | None = None) -> Program:
    """Compile ``model``'s training step into one program per rank.

    model: an ``nn.Module`` that trains on one device.
    cluster: a :class:`ClusterSpec` (or an int: ``ClusterSpec.local(n)``).
    example_inputs: one *global* batch ``(inputs..., target)``, the batch on dim 0.
    loss_fn: ``loss_fn(model(*inputs), target)``; None if ``model(*example_inputs)`` returns the loss.
    optimizer: ``(torch.optim.X, kwargs)``; SGD, Adam and AdamW are traced into the graph.
    strategy: a :class:`Strategy`, ``"auto"`` (data parallel over every rank) or a list of passes.
    lr_scheduler: ``(torch.optim.lr_scheduler.X, kwargs)`` or a picklable ``callable(torch_optimizer)``;
        stepped after every optimizer step.
    plan: a Plan to use instead of the planner's (e.g. one you edited from ``program.plan``): its
        schedule, microbatches, cuts and buckets are taken; what depends on an edit is planned again.
    """
    if isinstance(cluster, int):
        cluster = ClusterSpec.local(cluster)
    if not isinstance(cluster, ClusterSpec):
        raise TypeError(f"cluster={cluster!r}: pass fxpar.ClusterSpec.local(world_size) or another ClusterSpec")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model is a {type(model).__name__}; fxpar parallelises a torch.nn.Module")
    strategy = Strategy.coerce(strategy, cluster.world_size)
    if strategy.size != cluster.world_size:
        raise StrategyError(
            f"{strategy} uses dp*tp*pp = {strategy.size} ranks but the ClusterSpec has {cluster.world_size} "
            f"({cluster.nodes} node(s) x {cluster.devices_per_node}); make them equal, e.g. "
            f"Strategy(dp={cluster.world_size}) or ClusterSpec.local({strategy.size}).")
    if strategy.tp > 1:
        raise StrategyError(f"{strategy}: tensor parallelism is not available in this version of fxpar; "
                            "use dp and pp (see docs/support-matrix.md for what is planned).")
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan={plan!r}: pass a fxpar.Plan (e.g. program.plan, or Plan.from_json(text))")
    spec = resolve_optimizer(optimizer)
    batch = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    t0 = time.perf_counter()
    plan, sched, trace, split = make_plan(strategy, batch, model=model, loss_fn=loss_fn, cluster=cluster,
                                          base=plan, optimizer=spec)
    if plan.schedule in ASYNC and lr_scheduler is not None:
        raise StrategyError(f"schedule {plan.schedule!r} updates weights inside a window of microbatches; an "
                            "lr_scheduler stepped once per batch is not defined for it. Drop lr_scheduler or use a "
                            "synchronous schedule ('gpipe', '1f1b', 'interleaved', 'zb1p', 'chimera').")
    m = plan.microbatches
    micro = tuple(t.narrow(0, 0, plan.global_batch // (plan.dp * m)) for t in batch)
    scale = 1.0 if plan.schedule == "pipedream" else 1.0 / m      # PipeDream: one update per microbatch
    if split is None:
        captured = [capture_training_step(model, micro, loss_fn, spec, grad_scale=scale)]
    else:
        captured = [capture_training_step(model, micro, loss_fn, spec, stage=st, grad_scale=scale)
                    for st in split.stages]
    t1 = time.perf_counter()
    _check_parameters_fit(captured, cluster, model)
    _plan_buckets(plan, captured)
    lowered = lower(captured, plan, sched, cluster, strategy.passes, synchronous=plan.schedule not in ASYNC)
    plan.passes = [h.pass_name for h in lowered[0][2][1:] if not h.pass_name.startswith("split_graphs:")]
    stages = [Stage(s, cap, parts, gm, hist, notes, stage_messages(cap))
              for s, (cap, (parts, gm, hist, notes)) in enumerate(zip(captured, lowered))]
    t2 = time.perf_counter()
    n_inputs = len(batch) - (1 if loss_fn is not None else 0)
    return Program(model=model, plan=plan, strategy=strategy, cluster=cluster, schedule=sched, stages=stages,
                   split=split, trace=trace, optimizer=spec, lr_scheduler=lr_scheduler, n_inputs=n_inputs,
                   timings={"capture": t1 - t0, "lower": t2 - t1})


def _plan_buckets(plan: Plan, captured: list) -> None:
    """Keep the buckets of a handed-in Plan where they still match each stage's gradients; plan the rest."""
    given = plan.buckets if len(plan.buckets) == len(captured) else None
    out = []
    for s, cap in enumerate(captured):
        groups = plan.grad_groups[s]
        want = {k for k, g in groups.items() if g}
        if given is not None and sorted(k for b in given[s] for k in b) == sorted(want):
            out.append([list(b) for b in given[s]])
            continue
        if given is not None and given[s]:
            plan.notes.append(f"stage {s}: the given buckets do not cover its synchronised gradients "
                              f"{sorted(want)}; planned again")
        out.append(plan_buckets(cap, plan.bucket_cap_bytes, plan.first_bucket_cap_bytes, groups) if want else [])
    plan.buckets = out


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
