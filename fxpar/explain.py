"""``Program.explain()``: the plan, the stages, the schedule, the collectives, the passes and the cost
models' estimate, in plain language -- one text for every strategy."""
from __future__ import annotations

import torch

from .feature import get_feature
from .roles import GraphKind, Role
from .schedule import simulate

__all__ = ["explain_program", "fmt_bytes"]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _nbytes(shape, dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def _stage_lines(prog) -> list:
    lines = ["", "stages:"]
    split = prog.split
    for st in prog.stages:
        cap = st.captured
        pbytes = sum(_nbytes(cap.param_shapes[k], cap.param_dtypes[k]) for k in cap.param_names)
        sends = sum(_nbytes(sh, dt) for _, sh, dt in st.messages["acts_out"])
        saved = st.graphs.get(GraphKind.F)
        saved_n = sum(1 for r, _ in saved.outputs if r == Role.SAVED) if saved is not None else 0
        where = f"pipeline rank(s) {prog.plan.stage_to_rank[st.index]}"
        head = f"  stage {st.index} on {where}"
        if split is not None:
            sg = split.stages[st.index]
            head += (f": {len(sg.nodes)} nodes ({sg.flops / 1e6:.2f} MFLOP fwd per microbatch), modules "
                     f"{sg.modules[:3]}{'...' if len(sg.modules) > 3 else ''}")
        lines.append(head)
        lines.append(f"    params {fmt_bytes(pbytes)} in {len(cap.param_names)} tensors; graphs "
                     + ", ".join(f"{k} ({len(g.gm.graph.nodes)} nodes)" for k, g in st.graphs.items())
                     + (f"; F saves {saved_n} tensors ({fmt_bytes(st.saved_bytes)}) per microbatch in flight; sends "
                        f"{fmt_bytes(sends)} forward per microbatch"
                        if saved is not None else ""))
    return lines


def explain_program(prog) -> str:
    plan, cap = prog.plan, prog.captured
    lines = [f"fxpar program for {prog.model_name}: {prog.strategy} on {prog.world_size} rank(s)",
             f"cluster: {prog.cluster}"]
    if getattr(prog, "auto_search", None) is not None:        # the automatic planner's choice, and why
        lines += [""] + prog.auto_search.explain().splitlines()
    lines += ["", "plan:"]
    lines += ["  " + ln for ln in str(plan).splitlines()]
    if len(prog.stages) == 1:
        p_bytes = sum(_nbytes(cap.param_shapes[k], cap.param_dtypes[k]) for k in cap.param_names)
        n_vals = sum(int(torch.Size(s).numel()) for s in cap.param_shapes.values())
        b_bytes = sum(v.numel() * v.element_size() for v in prog._buffers.values())
        less = {}        # what the features keep a rank from holding: row -> (bytes, why)
        for name, section in plan.features.items():
            for row, (nbytes, why) in get_feature(name).held_less(section, prog).items():
                got = less.get(row, (0, ""))
                less[row] = (got[0] + nbytes, "; ".join(w for w in (got[1], why) if w))
        less_note = lambda row: f" ({less[row][1]})" if row in less else ""      # noqa: E731
        less_bytes = lambda row: less.get(row, (0, ""))[0]                      # noqa: E731
        head = ("the whole model (tensor parallelism splits it: what each rank holds is below):" if plan.tp > 1
                else "per replica (what every data-parallel rank holds, unless a feature below shards it):")
        lines += ["", head,
                  f"  parameters      {fmt_bytes(p_bytes - less_bytes('parameters'))} ({n_vals:,} values in "
                  f"{len(cap.param_names)} tensors)" + less_note("parameters"),
                  f"  gradients       {fmt_bytes(p_bytes - less_bytes('gradients'))}" + less_note("gradients"),
                  f"  optimizer state {fmt_bytes(p_bytes * len(cap.optimizer.state_names) - less_bytes('optimizer state'))} "
                  f"({', '.join(cap.optimizer.state_names) or 'none'})" + less_note("optimizer state"),
                  f"  buffers         {fmt_bytes(b_bytes)}"]
    else:
        lines += _stage_lines(prog)
    if prog.aliases:
        lines.append(f"  tied parameters (one tensor, one gradient): {prog.aliases}")
    if len(prog.stages) > 1 or plan.microbatches > 1:
        sim = simulate(prog.pipe_schedule)
        lines += ["", f"schedule {prog.pipe_schedule.name} (dry run with F=1, B=2 units): bubble "
                      f"{sim.bubble_fraction:.3f}; microbatches in flight per rank {sim.peak_activations_per_rank}"]
        lines += ["  " + ln for ln in prog.pipe_schedule.format_lists().splitlines()]
        if prog.asynchronous:
            lines += ["", "asynchronous: the schedule above covers 2 batches; a run covers all its batches in one "
                          f"window with no flush. Weight versions held at once per stage (dry run): {sim.peak_versions}; "
                          "each forward's saved tensors keep the version its backward needs."]
    for name, section in plan.features.items():       # each enabled feature in its own words
        lines += ["", f"{name}:"] + ["  " + ln for ln in get_feature(name).explain(section, prog)]
    comms = prog.collectives(0)
    lines += ["", f"communication per step on rank 0: {len(comms)} operation(s), "
                  f"{fmt_bytes(sum(c.nbytes for c in comms))} handed to them"]
    for i, c in enumerate(comms[:40]):
        lines.append(f"  {i:3d}. {c.kind:<10} over {c.axis} {list(c.ranks)}: {fmt_bytes(c.nbytes)}")
    if len(comms) > 40:
        lines.append(f"  ... {len(comms) - 40} more")
    hist = prog.history(0)
    lines += ["", "passes run (rank 0): " + " -> ".join(f"{h.pass_name}({h.nodes})" for h in hist
                                                       if not h.pass_name.startswith("split_graphs:"))]
    for s in plan.rank_stages(0):
        lines += ["  " + n for n in prog.stages[s].notes]
    if not cap.optimizer.traced:
        lines += ["", f"optimizer {cap.optimizer.name} runs eagerly on each rank ({cap.optimizer.why_not_traced}):",
                  "  its update is not in the graph, so passes that rewrite the optimizer step do not apply."]
    calibrated = any(d.efficiency for d in prog.cluster.devices_of())       # every rank's device
    lines += ["", "estimate (cost models; " + ("calibrated cluster" if calibrated
                                               else "vendor/default figures: ClusterSpec.calibrate() for this machine's") + "):"]
    est = prog.estimate()
    lines += ["  " + ln for ln in str(est).splitlines()]
    dev = getattr(prog.cluster, "device_of", lambda r: prog.cluster.device)      # each rank's own device
    over = [r for r in est.ranks if r.peak_memory_bytes > dev(r.rank).memory_bytes]
    if over:
        worst = max(over, key=lambda r: r.peak_memory_bytes - dev(r.rank).memory_bytes)
        lines.append(f"  WARNING: predicted peak memory {fmt_bytes(worst.peak_memory_bytes)} of rank {worst.rank} exceeds "
                     f"the {fmt_bytes(dev(worst.rank).memory_bytes)} of its {dev(worst.rank).name} ({len(over)} rank(s) "
                     "over their device's memory): shard state (ZeRO), or split the model (tp/pp), or use a smaller "
                     "batch.")
    if est.defaulted:
        lines.append("  ops costed by the default rule (no entry in cost_models.compute.FLOP_RULES): "
                     + ", ".join(f"{k} x{v}" for k, v in est.defaulted.most_common()))
    lines += ["", f"time: capture {prog.timings['capture']:.2f}s, plan+lower {prog.timings['lower']:.2f}s"]
    return "\n".join(lines)
