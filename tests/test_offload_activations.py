"""Activation offload: what backward reads from forward goes to host memory after its last
forward use and comes back one backward use ahead; the math is unchanged."""
from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.testing import gpt_loss, max_abs_diff, reference_training, tiny_gpt, token_batches

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
TOL = 1e-10
COPY = torch.ops.aten._to_copy.default


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [dict(dp=2), dict(pp=2, microbatches=2), dict(dp=2, recompute="selective")],
                         ids=["dp2", "pp2", "dp2_selective"])
def test_offloaded_activations_leave_the_math_alone(clusters, strategy):
    model, batches = tiny_gpt(), token_batches(3)
    st = fxpar.Strategy(offload_activations=True, **strategy)
    prog = fxpar.parallelize(model, st.size, batches[0], gpt_loss, ADAMW, strategy=st)
    res = prog.run_local(batches, cluster=clusters.get(st.size))
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, ADAMW)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL


@pytest.mark.structure
def test_forward_saves_host_copies_and_backward_fetches_them_one_use_ahead():
    model, batches = tiny_gpt(), token_batches(1)
    prog = fxpar.parallelize(model, 2, batches[0], gpt_loss, ADAMW,
                             strategy=fxpar.Strategy(pp=2, microbatches=2, offload_activations=True))
    for st in prog.stages:
        f, b = st.graphs["F"], st.graphs["B"]
        outs = f.gm.graph.find_nodes(op="output")[0].args[0]
        saved = [o for o, (role, _) in zip(outs, f.outputs) if role == "saved"]
        copies = [o for o in saved if o.target is COPY]
        assert copies and all(o.kwargs["device"] == torch.device("cpu") for o in copies)
        # whatever else F saves is a parameter, a batch input or made from them alone (not an activation)
        phs = set(f.gm.graph.find_nodes(op="placeholder"))
        for o in saved:
            if o.target is not COPY:
                stack, seen = [o], set()
                while stack:
                    x = stack.pop()
                    assert x.op in ("placeholder", "get_attr") or x.target is not COPY, o
                    seen.add(x)
                    stack += [a for a in x.all_input_nodes if a not in seen]
                assert all(a in phs or a.op == "get_attr" for a in seen if not a.all_input_nodes), o
        # backward: each copy back comes before its value's first use, and from the second on, before the
        # first use of the value fetched just before it (one use ahead)
        g = b.gm.graph
        order = {n: i for i, n in enumerate(g.nodes)}
        backs = [n for n in g.nodes if n.target is COPY]
        assert len(backs) == len(copies)
        first = [min((u for u in n.users), key=order.__getitem__) for n in backs]
        for k, (n, u) in enumerate(zip(backs, first)):
            assert order[n] < order[u]
            if k:
                assert order[n] < order[first[k - 1]] or first[k - 1] is u
