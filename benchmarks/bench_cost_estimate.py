"""Time ``cost_models.estimate`` on a 96-layer GPT training step over 1,024 simulated ranks.

    python benchmarks/bench_cost_estimate.py [--layers 96] [--ranks 1024] [--hidden 256]

The step (forward, backward, SGD) is traced once with ``make_fx(tracing_mode="fake")``; a
data-parallel all_reduce (functional collective + wait_tensor, with ``fxpar_comm``) is put right
after each gradient is made and waited on just before the optimizer reads it, so communication
can overlap the rest of backward. Every rank runs this one program (pure data parallelism on
``nodes x 8`` A100s). The goal is ``estimate()`` under 2 s; tracing is not timed.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_models import estimate  # noqa: E402
from fxpar.cluster import ClusterSpec  # noqa: E402
from fxpar.meta import CommInfo  # noqa: E402

c10d = torch.ops._c10d_functional


class Block(nn.Module):
    def __init__(self, h, a):
        super().__init__()
        self.a = a
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = (z.view(b, t, self.a, h // self.a).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(h, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers, h, a, vocab, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, a) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def build(layers=96, hidden=256, heads=8, vocab=1024, seq=128, batch=4, world=1024):
    """The per-rank GraphModule of one data-parallel training step, with its all_reduces."""
    with torch.device("meta"):
        model = GPT(layers, hidden, heads, vocab, seq)
    params = {k: torch.empty(v.shape) for k, v in model.named_parameters()}

    def step(params, idx, tgt):
        def loss(p):
            logits = torch.func.functional_call(model, p, (idx,))
            return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
        g, lval = torch.func.grad_and_value(loss)(params)
        g = {k: c10d.wait_tensor(c10d.all_reduce(v, "sum", "dp")) for k, v in g.items()}
        return lval, {k: params[k] - 0.1 * g[k] / world for k in params}

    idx = torch.zeros(batch, seq, dtype=torch.long)
    gm = make_fx(step, tracing_mode="fake")(params, idx, idx)
    group = tuple(range(world))
    for n in gm.graph.nodes:             # what fxpar.capture would record
        if n.op == "placeholder":
            n.meta["fxpar_role"] = "param" if n.name.startswith("params") else "input"
    for n in list(gm.graph.nodes):
        if n.target is c10d.all_reduce.default:
            n.meta["fxpar_comm"] = CommInfo("all_reduce", "dp", group, math.prod(n.meta["val"].shape) * 4)
            n.args[0].append(n)                  # issue as soon as the gradient exists
    gm.recompile()
    return gm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    t0 = time.perf_counter()
    gm = build(args.layers, args.hidden, world=args.ranks)
    t1 = time.perf_counter()
    cluster = ClusterSpec.preset("a100-80gb", nodes=args.ranks // 8, gpus_per_node=8)
    graphs = {r: gm for r in range(args.ranks)}
    times = []
    for _ in range(3):
        s = time.perf_counter()
        est = estimate(graphs, cluster)
        times.append(time.perf_counter() - s)
    # the general path (every rank simulated, no symmetry shortcut), for comparison
    from cost_models.simulate import compile_program, simulate
    progs = {r: compile_program(gm, cluster, {}) for r in range(1)}
    progs = {r: progs[0] for r in range(args.ranks)}
    dur = _durations(progs[0], cluster)
    s = time.perf_counter()
    full = simulate(progs, {r: dur for r in progs})
    t_full = time.perf_counter() - s
    nodes = len(gm.graph.nodes)
    comms = sum(1 for n in gm.graph.nodes if "fxpar_comm" in n.meta)
    print(f"graph: {args.layers} layers, {nodes} nodes, {comms} all_reduces; traced in {t1 - t0:.1f} s")
    print(f"estimate() on {args.ranks} ranks: best {min(times):.3f} s, first {times[0]:.3f} s (goal < 2 s)")
    print(f"general path (all {args.ranks} ranks simulated): {t_full:.3f} s, step "
          f"{max(r.end for r in full.values()) * 1e3:.3f} ms vs {est.step_time_s * 1e3:.3f} ms")
    print(est)


def _durations(program, cluster):
    from cost_models import comm_info_cost
    return [comm_info_cost(i, cluster).time_s for i in program.infos]


if __name__ == "__main__":
    main()
