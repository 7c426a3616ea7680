"""The optimizer update written from a template (fxpar.capture_optim) is the graph a full trace of the update makes:
node by node (name, target, arguments, every meta key, each fake value's layout), code, signature."""
import re

import pytest
import torch
import torch.nn as nn

import fxpar
import fxpar.capture_optim as CO
from fxpar.capture import capture_training_step
from fxpar.optim import OptimizerSpec, resolve_optimizer
from fxpar.testing import GPT, gpt_loss, tiny_gpt

# capture is what these tests test: each build traces (tests/conftest.py)
SHARED_CAPTURES = False

pytestmark = pytest.mark.structure

OPTS = [(torch.optim.AdamW, {"lr": 1e-3}), (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 0.1}),
        (torch.optim.Adam, {"lr": 1e-3}), (torch.optim.SGD, {"lr": 0.1}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}),
        (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.0, "betas": (0.8, 0.9)})]


def _layout(v):
    if isinstance(v, torch.Tensor):
        return (type(v).__name__, tuple(v.shape), v.stride(), v.dtype, v.device, v.storage_offset(), v.requires_grad)
    if isinstance(v, (list, tuple)):
        return type(v).__name__, [_layout(x) for x in v]
    return v


def _same_graph(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> int:
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    assert len(na) == len(nb)
    # autograd's sequence number runs on across traces in a process: compare it from each graph's least
    sa, sb = (min((n.meta["seq_nr"] for n in ns if "seq_nr" in n.meta), default=0) for ns in (na, nb))
    names = lambda args: torch.fx.node.map_arg(args, lambda n: n.name)   # noqa: E731
    for x, y in zip(na, nb):
        assert (x.name, x.op, x.target, x.type) == (y.name, y.op, y.target, y.type), (x.format_node(), y.format_node())
        assert names(x.args) == names(y.args) and names(x.kwargs) == names(y.kwargs), x.name
        assert sorted(x.meta) == sorted(y.meta), (x.name, sorted(x.meta), sorted(y.meta))
        for k in x.meta:
            if k == "seq_nr":
                assert x.meta[k] - sa == y.meta[k] - sb, x.name
            elif k == "val":
                assert _layout(x.meta[k]) == _layout(y.meta[k]), x.name
            elif k == "from_node":          # provenance names the source graph by its object id
                assert re.sub(r"graph_id=\d+", "", str(x.meta[k])) == re.sub(r"graph_id=\d+", "", str(y.meta[k]))
            else:
                assert x.meta[k] == y.meta[k] or str(x.meta[k]) == str(y.meta[k]), (x.name, k)
    assert a.code == b.code
    return len(na)


def _captures(monkeypatch, model, batch, opt, **kw):
    spec = resolve_optimizer(opt)
    monkeypatch.setattr(CO, "ENABLED", False)
    full = capture_training_step(model, batch, gpt_loss if kw.pop("gpt", True) else kw.pop("loss"), spec, **kw)
    monkeypatch.setattr(CO, "ENABLED", True)
    return full, spec


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: f"{o[0].__name__}{sorted(o[1].items())}")
def test_stamped_update_is_the_traced_one(monkeypatch, opt):
    model, x = tiny_gpt(), torch.randint(0, 32, (4, 16))
    full, spec = _captures(monkeypatch, model, (x, x), opt)
    stamped = capture_training_step(model, (x, x), gpt_loss, spec)
    assert _same_graph(full.gm, stamped.gm) > 300
    assert full.signature.inputs == stamped.signature.inputs and full.signature.outputs == stamped.signature.outputs


class _Mixed(nn.Module):
    """Layouts a GPT does not have: a float64 layer after a float32 one, a transposed weight, a parameter the loss
    does not reach (the capture freezes it and traces again), one used only through .detach()."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4).double()
        self.w_t = nn.Parameter(torch.randn(16, 8).t())          # (8, 16), stride (1, 8)
        self.unused = nn.Parameter(torch.randn(3))
        self.detached = nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x):
        h = torch.tanh(self.a(x) + x @ self.w_t)
        return self.b(h.double()) + self.detached.detach()


def test_stamped_update_mixed_layouts(monkeypatch):
    torch.manual_seed(0)
    model, x, y = _Mixed(), torch.randn(4, 8), torch.randn(4, 4, dtype=torch.float64)
    loss = lambda out, t: ((out - t) ** 2).mean()       # noqa: E731
    for opt in (OPTS[0], OPTS[4]):
        full, spec = _captures(monkeypatch, model, (x, y), opt, gpt=False, loss=loss)
        stamped = capture_training_step(model, (x, y), loss, spec)
        _same_graph(full.gm, stamped.gm)
        assert "unused" not in stamped.param_names and "detached" not in stamped.param_names


def test_template_kept_and_refused(monkeypatch):
    model, x = GPT(vocab=64, d=32, layers=2, heads=2, max_seq=16, dropout=0.1), torch.randint(0, 64, (8, 16))
    opt = (torch.optim.AdamW, {"lr": 1e-3, "eps": 1e-7})
    full, spec = _captures(monkeypatch, model, (x, x), opt)
    monkeypatch.setattr(CO, "_CACHE", type(CO._CACHE)())
    calls = []
    step_all = OptimizerSpec.step_all
    monkeypatch.setattr(OptimizerSpec, "step_all", lambda self, *a: calls.append(len(a[0])) or step_all(self, *a))
    capture_training_step(model, (x, x), gpt_loss, spec)
    assert calls == [9]                     # one trace, over the 9 distinct layouts of its 28 parameters
    again = capture_training_step(model, (x, x), gpt_loss, spec)
    assert calls == [9]                     # kept: no trace of the update
    _same_graph(full.gm, again.gm)
    # a template whose shape is not recognised: the update is traced with the step, as before
    monkeypatch.setattr(CO, "_CACHE", type(CO._CACHE)())
    monkeypatch.setattr(CO, "_REFUSED", set())
    monkeypatch.setattr(CO._Template, "_read", classmethod(lambda cls, *a: None))
    refused = capture_training_step(model, (x, x), gpt_loss, spec)
    _same_graph(full.gm, refused.gm)
    assert CO._REFUSED and calls[1:] == [9, 28]


def test_pipeline_stages_built_alike(monkeypatch):
    """A pipeline's stages (their own capture each) and the passes after: the per-rank graphs are the same."""
    model, x = tiny_gpt(), torch.randint(0, 32, (8, 16))

    def build():
        return fxpar.parallelize(model, fxpar.ClusterSpec.local(4), (x, x), loss_fn=gpt_loss,
                                 optimizer=(torch.optim.AdamW, {"lr": 1e-3}),
                                 strategy=fxpar.Strategy(pp=2, dp=2, microbatches=2, zero=1))
    monkeypatch.setattr(CO, "ENABLED", False)
    a = build()
    monkeypatch.setattr(CO, "ENABLED", True)
    b = build()
    for r in (0, 3):
        ga, gb = a.graphs(r), b.graphs(r)
        assert sorted(ga) == sorted(gb)
        for k in ga:
            _same_graph(ga[k], gb[k])
