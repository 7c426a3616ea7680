"""Real models end to end: Hugging Face GPT-2, Llama, BERT (masked LM) and T5, built from tiny
configs (no download, float64, dropout off), trained by fxpar under dp=2, pp=2 (1f1b and gpipe) and
dp=2 x pp=2, against single-process training of the same model on the same global batches: losses
and every parameter to 1e-10 (they meet ~1e-14).

Pipeline cuts are the planner's own (``split_points`` left out): the candidates are the elements of
the models' nested block lists (``model.transformer.h.N``, ``model.model.layers.N``,
``model.bert.encoder.layer.N``, T5's encoder/decoder blocks), and the chosen cut is checked to
balance the stages to within one block's FLOPs. A cut forced before ``lm_head`` is unbalanced, and
``explain()`` says so.

Loss weights: every row of these batches counts the same number of label positions
(``fxpar.testing.hf.hf_batch``), so the mean of per-shard means is the global mean; uneven
``ignore_index`` counts are another test's subject (tests/test_loss_semantics.py).
"""
from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.testing.hf import HF_MODELS, hf_batches, hf_example
from fxpar.testing.reference import max_abs_diff, reference_training

# one pytest-xdist worker runs the whole file (`--dist loadgroup`): the models ``cases`` builds, once per module
pytestmark = pytest.mark.xdist_group("real_models")

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
TOL = 1e-10
N_STEPS = 2
GLOBAL_BATCH = 4            # dp=2 x microbatches=2: one row per microbatch

STRATEGIES = {
    "dp2": dict(dp=2),
    "pp2-1f1b": dict(pp=2, schedule="1f1b", microbatches=2),
    "pp2-gpipe": dict(pp=2, schedule="gpipe", microbatches=2),
    "dp2xpp2": dict(dp=2, pp=2, microbatches=2),
}
# the block list each model's cut must fall in, and the block the auto cut starts the second stage at
BLOCKS = {"gpt2": "model.transformer.h", "llama": "model.model.layers", "bert": "model.bert.encoder.layer",
          "t5": "model.decoder"}

class _Case:
    """One model, its batches and its single-process training (computed once per module)."""

    def __init__(self, name: str):
        torch.manual_seed(0)
        self.name = name
        self.model, _, self.loss_fn = hf_example(name, n_layers=2)
        self.batches = hf_batches(name, N_STEPS, batch=GLOBAL_BATCH)
        self.ref_losses, self.ref_state = reference_training(self.model, self.batches, self.loss_fn, ADAMW)

    def parallelize(self, **strategy) -> fxpar.Program:
        st = fxpar.Strategy(**strategy)
        return fxpar.parallelize(self.model, fxpar.ClusterSpec.local(st.size), self.batches[0], self.loss_fn,
                                 ADAMW, strategy=st)


@pytest.fixture(scope="module")
def cases():
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    made = {}

    def get(name: str) -> _Case:
        if name not in made:
            made[name] = _Case(name)
        return made[name]
    return get


def _block_flops(prog: fxpar.Program, block: str) -> int:
    """Forward FLOPs of the module ``block`` (and its submodules) in the whole-model trace."""
    from cost_models.compute import concrete, node_cost
    from fxpar import meta as M
    total = 0
    for n in prog.trace.gm.graph.nodes:
        if n.op == "call_function" and (M.get(n, M.MODULE, "") + ".").startswith(block + "."):
            total += int(concrete(node_cost(n).flops))
    return total


def _assert_balanced_cut(case: _Case, prog: fxpar.Program) -> None:
    """The auto cut is the natural one (GPT-2, Llama, BERT: before the second of their two blocks; T5:
    before the decoder, encoder | decoder), and the two stages' forward FLOPs differ by at most one
    block's."""
    block_list = BLOCKS[case.name]
    (cut,) = prog.plan.cuts
    assert cut == prog.split.cuts[0]
    assert any(c.startswith(block_list) for c in prog.split.candidates), prog.split.candidates
    if case.name == "t5":
        assert cut == "model.decoder", prog.split.candidates
        one_block = _block_flops(prog, "model.decoder.block.0")
    else:
        assert cut == f"{block_list}.1", (cut, prog.split.candidates)
        one_block = _block_flops(prog, f"{block_list}.0")
    flops = [st.flops for st in prog.split.stages]
    assert one_block > 0 and abs(flops[0] - flops[1]) <= one_block, (flops, one_block)


# gpipe runs the same stage graphs as 1f1b in another order: marked slow to keep the default run short
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("sid", [pytest.param(s, marks=pytest.mark.slow) if s == "pp2-gpipe" else s
                                 for s in STRATEGIES])
@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_model_matches_single_process(clusters, cases, name, sid):
    case = cases(name)
    strategy = STRATEGIES[sid]
    prog = case.parallelize(**strategy)
    res = prog.run_local(case.batches, cluster=clusters.get(prog.world_size))
    loss_err = max(abs(a - b) for a, b in zip(res.losses, case.ref_losses))
    state_err = max_abs_diff(res.state_dict(), case.ref_state)
    assert loss_err < TOL, (res.losses, case.ref_losses)
    assert state_err < TOL, state_err              # max_abs_diff also asserts the same keys (buffers too)
    if strategy.get("pp", 1) > 1:
        assert prog.plan.n_stages == 2
        _assert_balanced_cut(case, prog)


@pytest.mark.slow
@pytest.mark.structure
def test_cut_forced_before_lm_head_is_reported_unbalanced(cases):
    case = cases("gpt2")
    auto = case.parallelize(pp=2, microbatches=2)
    assert "unbalanced" not in auto.explain()
    forced = case.parallelize(pp=2, microbatches=2, split_points=["model.lm_head"])
    assert forced.plan.cuts == ["model.lm_head"]
    text = forced.explain()
    assert "unbalanced" in text, text
    line = next(ln for ln in text.splitlines() if "unbalanced" in ln)
    assert "model.lm_head" in line and "split_points" in line, line
