"""``Program.explain()``: the plan, the stages, the schedule, the collectives, the passes and the cost
models' estimate, in plain language -- one text for every strategy."""
from __future__ import annotations

import torch

from .feature import get_feature

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
        saved = st.graphs.get("F")
        saved_n = sum(1 for r, _ in saved.outputs if r == "saved") if saved is not None else 0
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


def _tp_lines(prog) -> list:
    """Tensor parallelism per module on rank 0: parameters split (and how), the collectives the lowering inserted
    (by phase and kind, bytes handed to them per step), and the parameter bytes each rank holds."""
    from collections import defaultdict

    from . import meta as M
    plan = prog.plan
    lines = ["", "tensor parallelism on rank 0, per module (every tp rank runs the same graphs):"]
    for s in plan.rank_stages(0):
        st, entry = prog.stages[s], plan.shardings["stages"][s]
        cap, tp = st.captured, plan.mesh
        mods: dict = defaultdict(lambda: {"split": [], "whole": 0, "comm": defaultdict(lambda: [0, 0])})
        held = whole = 0
        for k, dims in entry["params"].items():
            mod, _, leaf = k.rpartition(".")
            nb = _nbytes(cap.param_shapes[k], cap.param_dtypes[k])
            div = 1
            for a in dims:
                div *= tp.axis_size(a) if a else 1
            held, whole = held + nb / div, whole + nb
            if div > 1:
                mods[mod or "<root>"]["split"].append(f"{leaf} {tuple(dims)}")
            else:
                mods[mod or "<root>"]["whole"] += 1
        for n in st.joint.graph.nodes:
            c = n.meta.get(M.COMM.name)
            if c is not None and c.axis in plan.tp_axes:
                cell = mods[M.get(n, M.MODULE) or "<root>"]["comm"][(M.get(n, M.PHASE) or "step", c.kind)]
                cell[0], cell[1] = cell[0] + 1, cell[1] + c.nbytes
        lines.append(f"  stage {s}: parameters {fmt_bytes(held)} per rank of {fmt_bytes(whole)}")
        for mod, d in mods.items():
            comm = "; ".join(f"{ph} {k} x{c} ({fmt_bytes(b)})" for (ph, k), (c, b) in d["comm"].items())
            split = ", ".join(d["split"])
            lines.append(f"    {mod}: " + ", ".join(x for x in (f"split {split}" if split else "",
                                                                f"{d['whole']} whole" if d["whole"] else "",
                                                                comm) if x))
    return lines


def explain_program(prog) -> str:
    plan, cap = prog.plan, prog.captured
    lines = [f"fxpar program for {prog.model_name}: {prog.strategy} on {prog.world_size} rank(s)",
             f"cluster: {prog.cluster}", "", "plan:"]
    lines += ["  " + ln for ln in str(plan).splitlines()]
    if len(prog.stages) == 1:
        p_bytes = sum(_nbytes(cap.param_shapes[k], cap.param_dtypes[k]) for k in cap.param_names)
        n_vals = sum(int(torch.Size(s).numel()) for s in cap.param_shapes.values())
        b_bytes = sum(v.numel() * v.element_size() for v in prog._buffers.values())
        rows = [k for k, r in (plan.grad_sync or {}).get("sparse_update", {}).items() if r.get("route") == "rows"]
        rows_bytes = sum(_nbytes(cap.param_shapes[k], cap.param_dtypes[k]) for k in rows if k in cap.param_shapes)
        head = ("the whole model (tensor parallelism splits it: what each rank holds is below):" if plan.shardings
                else "per replica (what every data-parallel rank holds, unless a feature below shards it):")
        lines += ["", head,
                  f"  parameters      {fmt_bytes(p_bytes)} ({n_vals:,} values in {len(cap.param_names)} tensors)",
                  f"  gradients       {fmt_bytes(p_bytes - rows_bytes)}" + (
                      f" (no dense gradient for {sorted(rows)}: Parallax's row update applies the gathered rows)"
                      if rows else ""),
                  f"  optimizer state {fmt_bytes(p_bytes * len(cap.optimizer.state_names))} "
                  f"({', '.join(cap.optimizer.state_names) or 'none'})",
                  f"  buffers         {fmt_bytes(b_bytes)}"]
    else:
        lines += _stage_lines(prog)
    if plan.shardings:
        lines += _tp_lines(prog)
    if prog.aliases:
        lines.append(f"  tied parameters (one tensor, one gradient): {prog.aliases}")
    if len(prog.stages) > 1 or plan.microbatches > 1:
        from .schedule import simulate
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
    lines += ["", "estimate (cost models; " + ("calibrated cluster" if prog.cluster.device.efficiency
                                               else "vendor/default figures: ClusterSpec.calibrate() for this machine's") + "):"]
    est = prog.estimate()
    lines += ["  " + ln for ln in str(est).splitlines()]
    mem = prog.cluster.device.memory_bytes
    over = [r.rank for r in est.ranks if r.peak_memory_bytes > mem]
    if over:
        lines.append(f"  WARNING: predicted peak memory {fmt_bytes(max(r.peak_memory_bytes for r in est.ranks))} exceeds "
                     f"the {fmt_bytes(mem)} of a {prog.cluster.device.name} on {len(over)} rank(s): shard state (ZeRO), "
                     "or split the model (tp/pp), or use a smaller batch.")
    if est.defaulted:
        lines.append("  ops costed by the default rule (no entry in cost_models.compute.FLOP_RULES): "
                     + ", ".join(f"{k} x{v}" for k, v in est.defaulted.most_common()))
    lines += ["", f"time: capture {prog.timings['capture']:.2f}s, plan+lower {prog.timings['lower']:.2f}s"]
    return "\n".join(lines)
