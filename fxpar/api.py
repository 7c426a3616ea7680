"""``fxpar.parallelize``: model + cluster + strategy → Program."""
from __future__ import annotations

import time

import torch

from .capture import capture_training_step
from .cluster import ClusterSpec
from .errors import StrategyError
from .lower import lower
from .optim import resolve_optimizer
from .plan import Plan
from .planner import check_batch, make_plan
from .program import Program
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
    plan: a Plan to use instead of the planner's (e.g. one you edited from ``program.plan``).
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
    if strategy.pp > 1:
        if plan is not None:
            raise StrategyError("plan= is not used by pipeline programs yet; choose the cuts with "
                                "Strategy(split_points=[...]) instead")
        from .pipeline import build_pipeline_program   # pipelines: stage graphs + schedule executor
        return build_pipeline_program(model, cluster, example_inputs, loss_fn, resolve_optimizer(optimizer),
                                      strategy, lr_scheduler)
    batch = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    global_batch = check_batch(batch, strategy.dp)
    local = tuple(t.narrow(0, 0, global_batch // strategy.dp) for t in batch)
    t0 = time.perf_counter()
    captured = capture_training_step(model, local, loss_fn, resolve_optimizer(optimizer))
    t1 = time.perf_counter()
    _check_parameters_fit(captured, cluster, model)
    plan = plan or make_plan(strategy, captured, global_batch)
    graphs, histories, notes = lower(captured, plan, cluster, strategy.passes)
    t2 = time.perf_counter()
    return Program(model=model, captured=captured, plan=plan, strategy=strategy, cluster=cluster, graphs=graphs,
                   histories=histories, notes=notes, lr_scheduler=lr_scheduler,
                   timings={"capture": t1 - t0, "lower": t2 - t1})


def _check_parameters_fit(captured, cluster: ClusterSpec, model) -> None:
    """Every rank holds at least one whole parameter tensor: it must fit in one device."""
    if not captured.param_names:
        return
    def nbytes(k):
        n = 1
        for d in captured.param_shapes[k]:
            n *= int(d)
        return n * torch.empty((), dtype=captured.param_dtypes[k]).element_size()
    key = max(captured.param_names, key=nbytes)
    cluster.check_fits(nbytes(key), f"parameter '{key}' of {type(model).__name__} (shape {tuple(captured.param_shapes[key])})")
