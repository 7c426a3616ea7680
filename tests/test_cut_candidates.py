"""Where automatic pipeline cuts may go: every element of every repeated block list, at any depth.

Hugging Face models hold their blocks deep (``transformer.h.N``, ``model.layers.N``); the cuts the
balancer picks among them must be even to within one block, and ``stage_imbalance`` says how even.
Structure only: fake-tensor traces, no ranks.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar._tracing import capture_context
from fxpar.testing import GPT, MLP, SkipMLP, gpt_loss
from passes.split_stages import (IMBALANCE_WARN, cut_candidates, imbalance_warning, split_stages,
                                 stage_imbalance)

pytestmark = pytest.mark.structure

try:                                   # the one-road capture holds the forward trace ...
    from fxpar.capture import trace_forward
except ImportError:                    # ... the pipeline package held it before
    from fxpar.pipeline.trace import trace_forward


def _trace(model, batch, loss_fn):
    with capture_context():            # nests: harmless where capture enters it itself
        return trace_forward(model, batch, loss_fn)


def _candidates(model, batch, loss_fn):
    ft = _trace(model, batch, loss_fn)
    return cut_candidates(ft.gm, ft.roles, ft.module_types)


def _run_stages(split, model, batch, n_inputs):
    """The stage graphs run one after another on real tensors: (loss, grads by autograd through them)."""
    params = dict(model.named_parameters())
    state = {**params, **dict(model.named_buffers())}
    acts = {}
    for st in split.stages:
        args = [state[k] if r in ("param", "buffer") else batch[int(k)] if r == "input"
                else batch[n_inputs + int(k)] if r == "target" else acts[k] for r, k in st.inputs]
        outs = st.gm(*args)
        acts.update({k: v for (_, k), v in zip(st.outputs, outs)})
    loss = acts["loss"]
    return loss, dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def _block_flops(ft, block: str) -> int:
    from passes.split_stages import _node_flops
    from fxpar import meta as M
    return sum(_node_flops(n) for n in ft.gm.graph.nodes
               if n.op == "call_function" and (M.get(n, M.MODULE) + ".").startswith(block + "."))


# ---- models without transformers -------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))   # not a block list

    def forward(self, x):
        return x + self.mlp(self.fc(self.ln(x)))


class _Body(nn.Module):
    def __init__(self, d=16, n=3):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(_Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class _Nested(nn.Module):
    """Blocks two levels down (as Hugging Face's ``model.layers.N``), and two blocks held as attributes."""

    def __init__(self, d=16):
        super().__init__()
        self.model = _Body(d, n=2)
        self.extra1, self.extra2 = _Block(d), _Block(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.extra2(self.extra1(self.model(x))))


def _x(d=16, batch=4):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, d, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g)


def test_nested_block_lists_and_repeated_blocks_are_candidates():
    cands = _candidates(_Nested().double(), _x(), F.cross_entropy)
    assert cands == ["model.layers.0", "model.layers.1", "model.norm", "extra1", "extra2", "head"]


def test_existing_models_keep_their_candidates():
    x = torch.randint(0, 64, (2, 8))
    assert _candidates(GPT(layers=3).double(), (x, x), gpt_loss) == ["blocks.0", "blocks.1", "blocks.2", "ln_f", "head"]
    assert _candidates(SkipMLP().double(), _x(), F.cross_entropy) == ["layers.1", "layers.2", "layers.3", "out"]
    assert _candidates(MLP(layers=3).double(), (_x()[0], torch.randint(0, 8, (4,))), F.cross_entropy) == \
        ["layers.1", "layers.2", "out"]
    # a Sequential of Sequential(Linear, Tanh): the inner, mixed lists are not cut inside
    seq = nn.Sequential(nn.Linear(16, 16), nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                                           for _ in range(3)]), nn.Linear(16, 4))
    assert _candidates(seq.double(), _x(), F.cross_entropy) == ["1.0", "1.1", "1.2", "2"]


def test_stage_imbalance_and_its_warning():
    ft = _trace(_Nested().double(), _x(), F.cross_entropy)
    even = split_stages(ft.gm, ft.roles, 2, None, ft.module_types)
    flops = [st.flops for st in even.stages]
    assert stage_imbalance(even) == pytest.approx(max(flops) / min(flops) - 1)
    assert stage_imbalance(split_stages(ft.gm, ft.roles, 1, None, ft.module_types)) == 0.0
    assert stage_imbalance(even) <= IMBALANCE_WARN and imbalance_warning(even) == ""
    lopsided = split_stages(ft.gm, ft.roles, 2, ["head"], ft.module_types)
    assert stage_imbalance(lopsided) > 1
    assert "stage 0" in imbalance_warning(lopsided) and "split_points" in imbalance_warning(lopsided)



def test_split_stages_pass_form_hands_its_split_on():
    """``SplitStages`` as a pass: the same cut as the function, in ``info['split']`` and ``ctx.scratch``."""
    from fxpar.pass_manager import PassContext, PassManager
    from passes.split_stages import SplitStages
    ft = _trace(_Nested().double(), _x(), F.cross_entropy)
    ctx = PassContext()
    gm, hist = PassManager([SplitStages(2, ft.roles, None, ft.module_types)]).run(ft.gm, ctx)
    want = split_stages(ft.gm, ft.roles, 2, None, ft.module_types)
    got = ctx.scratch["split_stages"]
    assert hist[-1].info["split"] is got and gm is ft.gm and not hist[-1].modified
    assert got.cuts == want.cuts and [st.nodes for st in got.stages] == [st.nodes for st in want.stages]
    assert ctx.notes == [f"split_stages: 2 stages, cuts before {want.cuts}"]

# ---- Hugging Face models ---------------------------------------------------------------------------

@pytest.fixture
def hf():
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    from fxpar.testing import hf as hf_models
    return hf_models


@pytest.mark.parametrize("name,blocks", [("gpt2", "model.transformer.h"), ("llama", "model.model.layers"),
                                         ("bert", "model.bert.encoder.layer"), ("t5", "model.encoder.block")])
def test_hf_candidates_include_every_block(hf, name, blocks):
    cands = _candidates(*hf.hf_example(name, n_layers=4))
    assert [c for c in cands if c.startswith(blocks + ".")] == [f"{blocks}.{i}" for i in range(4)]
    if name in ("gpt2", "llama"):
        assert cands[-1] == "model.lm_head" and len(cands) == 7     # + the embedding side, final norm, head
    if name == "t5":
        assert [f"model.decoder.block.{i}" for i in range(4)] == [c for c in cands if ".decoder.block." in c]


@pytest.mark.parametrize("pp", [2, 4])
def test_llama_auto_cuts_are_balanced_within_one_block(hf, pp):
    ft = _trace(*hf.hf_example("llama", n_layers=4))
    split = split_stages(ft.gm, ft.roles, pp, None, ft.module_types)
    flops = [st.flops for st in split.stages]
    block = _block_flops(ft, "model.model.layers.1")
    assert len(split.stages) == pp and all(c.startswith("model.model.layers.") for c in split.cuts)
    assert max(flops) - min(flops) <= block, (split.cuts, flops, block)
    assert sum(flops) >= 4 * block


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_hf_stage_graphs_compose_to_the_model(hf, name):
    """Cut at the automatic places (pp=3), the stage graphs chained give eager's loss and gradients."""
    model, batch, loss_fn = hf.hf_example(name, n_layers=4)
    ft = _trace(model, batch, loss_fn)
    split = split_stages(ft.gm, ft.roles, 3, None, ft.module_types)
    n_in = len(batch) - (loss_fn is not None)
    loss, grads = _run_stages(split, model, batch, n_in)
    ref = loss_fn(model(*batch[:-1]), batch[-1]) if loss_fn is not None else model(*batch)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-10
    for k, p in model.named_parameters():
        assert (grads[k] - p.grad).abs().max().item() <= 1e-10, k
