"""Strategy(compile=True): inductor keeps every collective window the passes opened, in each graph kind that issues
collectives inside a graph.

:func:`check_windows` reads inductor's code for each graph of rank 0 against the FX graph ``program.graphs(0)`` gives
it: the collectives are issued in the FX graph's order, and the k-th ``wait_tensor`` comes after at least as many
issued collectives as in the FX graph -- no wait moves up towards its issue, so no overlap window shrinks. Inductor may
issue a collective earlier than the FX graph does (ZeRO-3's gathers: in the FX graph each is waited before the next
is issued; the compiled code issues up to several before their waits), which widens windows and holds more gathered
parameters at once. Here: Megatron tp=2's step, read from ``program.compiled_code(0)`` (inductor's code for rank 0,
compiled here without a run). ``tests/test_compile.py`` reads the fused dp step the same way, and checks the code
rank 0 ran for ZeRO-3's step, the REDUCE_GRAD/STEP graphs of dp with microbatches and Megatron tp=2's step, beside
their numerics (the same graphs and shapes as here, so inductor's cache serves the kernels whichever test builds
them first)."""
import re

import pytest
import torch

import fxpar
from fxpar.collectives import is_wait
from fxpar.testing import gpt_loss, tiny_gpt

pytestmark = [pytest.mark.structure, pytest.mark.slow]      # inductor compiles each graph here: 10-60 s a case

_KINDS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast")


def _fx_order(gm) -> list:
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if is_wait(n):
            out.append("W")
            continue
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0].rstrip("_")
        if name in _KINDS:
            out.append(name)
    return out


def _compiled_order(code: str) -> list:
    out = []
    for line in code.split("def call(", 1)[1].splitlines():
        if line.strip().startswith("#"):
            continue
        m = re.search(r"_c10d_functional\.(\w+)\.default\(", line)
        if m:
            name = m.group(1).rstrip("_")
            out.append("W" if name == "wait_tensor" else name)
    return out


def _issued_before_each_wait(order: list) -> list:
    counts, issued = [], 0
    for x in order:
        if x == "W":
            counts.append(issued)
        else:
            issued += 1
    return counts


def check_windows(prog, code_of) -> int:
    """For each graph of rank 0 that issues a collective: ``code_of(label)``, inductor's code for it, issues the FX
    graph's collectives in its order, waits each of them, and no wait moves up. Returns how many graphs it checked."""
    checked = 0
    for label, gm in prog.graphs(0).items():
        fx = _fx_order(gm)
        if not fx:
            continue
        code = code_of(label)
        assert not code.startswith("# runs eager"), (label, code[:200])
        got = _compiled_order(code)
        assert [x for x in got if x != "W"] == [x for x in fx if x != "W"], label       # the same issues, in order
        assert got.count("W") == fx.count("W"), label
        before_fx, before_got = _issued_before_each_wait(fx), _issued_before_each_wait(got)
        assert all(c >= f for c, f in zip(before_got, before_fx)), (label, "".join(x[0] for x in got))
        checked += 1
    return checked


@pytest.mark.parametrize("strategy", [
    {"tp": 2, "sharding": "megatron"},                  # tensor parallelism's all-reduces in the step
], ids=["tp2_megatron"])
def test_no_wait_moves_up_and_issues_keep_their_order(strategy):
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g))
    world = strategy.get("dp", 1) * strategy.get("tp", 1)
    prog = fxpar.parallelize(tiny_gpt(layers=1), fxpar.ClusterSpec.local(world), batch, loss_fn=gpt_loss,
                             optimizer=(torch.optim.AdamW, {"lr": 1e-2}),
                             strategy=fxpar.Strategy(compile=True, **strategy))
    assert check_windows(prog, lambda label: prog.compiled_code(0, label)), "no graph of rank 0 issues a collective"
