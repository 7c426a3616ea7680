"""A silent-wrong sweep: every feature alone, and every pair of them fxpar accepts, trains a tiny model with
dropout, BatchNorm, a tied embedding/head and an unused parameter for 3 steps, and must equal what
docs/semantics.md says it computes:

* §6 (BatchNorm): one process looping over the step's ``dp x m`` pieces, each normalised with its own statistics,
  the gradient the mean over the pieces, the running statistics those of dp-rank 0's pieces;
* §10 (random numbers): dp rank r's dropout draws from torch's generator seeded ``seed + r``, in the order its
  microbatches run, so the reference draws rank r's pieces from a generator seeded so;
* §2 (a parameter without a gradient) stays as it was, as torch's SGD leaves it.

Where a feature's semantics make that reference the wrong one, the sweep runs the documented special case:
tensor parallelism and pipelines run with dropout off (§10: split masks are drawn per rank by design, and each
pipeline rank has its own stream; ``tests/test_tp_rng.py`` checks those draws), and pipelines with data parallelism
without BatchNorm (the support matrix: buffers written in forward are refused in a pipeline with dp > 1;
``test_pipeline_refuses_batch_norm_with_data_parallelism``).
Compression methods run at the setting where their math is plain data parallelism (§9: ``TopK`` / ``RandomK``
with ratio 1, ``PowerSGD`` before ``start_iter``); their own math away from it is checked against
``fxpar.testing.compress*`` references in tests/test_compress_*.py. Methods that change the math on purpose with no
exact setting (QSGD, NUQSGD, ALQ, AMQ, Wangni, ByteGrad, FP16/BF16, the delayed update, PipeDream, 2BW) are left to
those files.

The features (``FEATURES``) are the support matrix's strategy rows (docs/support-matrix.md) that run on gloo CPU
ranks; the pairs are every two of them with different options, merged (sizes: the larger of each), that
``parallelize`` accepts: the pairs the matrix's Limits column refuses ("not with ...") are refused at plan time,
which ``test_every_refused_pair_is_refused_with_a_reason`` checks names both. The quick suite runs
``QUICK``; the rest is marked ``slow``."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
import fxpar.compress as C
from fxpar.errors import FxparError
from fxpar.testing import max_abs_diff

# one pytest-xdist worker runs the whole file (`--dist loadgroup`): the refusal test builds every pair, and the
# parametrised cases run the programs it built (``_BUILT``) instead of building them again on the other worker
pytestmark = pytest.mark.xdist_group("sweep")

LR, STEPS, SEED, ROWS = 0.1, 3, 0, 16      # 16 rows: 2 per piece at dp=4 x 2 microbatches (BatchNorm needs 2)


class SweepNet(nn.Module):
    """An embedding tied to the output head, BatchNorm, dropout, and a parameter forward never uses."""

    def __init__(self, batch_norm: bool = True, p: float = 0.25):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16) if batch_norm else nn.Identity()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.unused = nn.Linear(3, 3)

    def forward(self, ids):
        return self.head(self.fc2(self.drop(torch.tanh(self.bn(self.fc1(self.emb(ids)))))))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 16, (ROWS,), generator=g), torch.randint(0, 16, (ROWS,), generator=g))
            for _ in range(STEPS)]


def _model(batch_norm: bool, p: float):
    torch.manual_seed(0)
    return SweepNet(batch_norm, p).double()


def reference(model, batches, dp: int, m: int):
    """docs/semantics.md §6 and §10 in one process: for each step, dp-rank r's rows in m microbatches (ranks in
    reverse order, so rank 0's running statistics are the ones kept), dropout drawn from rank r's generator
    (seeded ``SEED + r`` at the start, carried across steps), each piece's loss over dp*m; then SGD."""
    mdl = copy.deepcopy(model)
    opt = torch.optim.SGD(mdl.parameters(), lr=LR)
    with torch.random.fork_rng(devices=[]):
        gens = []
        for r in range(dp):
            torch.manual_seed(SEED + r)
            gens.append(torch.get_rng_state())
        losses = []
        for ids, y in batches:
            n, total = ROWS // dp, 0.0
            rows = n // m
            opt.zero_grad()
            for r in reversed(range(dp)):
                base = {k: v.clone() for k, v in mdl.named_buffers()}
                torch.set_rng_state(gens[r])
                for j in range(m):
                    sl = slice(r * n + j * rows, r * n + (j + 1) * rows)
                    loss = F.cross_entropy(mdl(ids[sl]), y[sl]) / (dp * m)
                    loss.backward()
                    total += loss.item()
                gens[r] = torch.get_rng_state()
                if r:
                    with torch.no_grad():
                        for k, v in mdl.named_buffers():
                            v.copy_(base[k])
            opt.step()
            losses.append(total)
    return losses, mdl.state_dict()


# name -> (Strategy options, ClusterSpec options). One row per feature of the support matrix that runs here.
FEATURES = {
    "dp": ({"dp": 2}, {}),
    "grad_accumulation": ({"microbatches": 2}, {}),
    "zero1": ({"dp": 2, "zero": 1}, {}),
    "zero2": ({"dp": 2, "zero": 2}, {}),
    "zero3": ({"dp": 2, "zero": 3}, {}),
    "zero_offload": ({"dp": 2, "zero": 2, "offload": ("optimizer",)}, {}),
    "recompute_full": ({"recompute": "full"}, {}),
    "recompute_selective": ({"recompute": "selective"}, {}),
    "offload_activations": ({"offload_activations": True}, {}),
    "bytescheduler": ({"dp": 2, "comm_schedule": "bytescheduler"}, {}),
    "bytescheduler_cross_iteration": ({"dp": 2, "comm_schedule": "bytescheduler", "cross_iteration": True}, {}),
    "herring": ({"dp": 4, "grad_sync": "herring"}, {"nodes": 2, "devices_per_node": 2}),
    "parallax": ({"dp": 2, "grad_sync": "parallax"}, {}),
    "tp_megatron": ({"tp": 2, "sharding": "megatron"}, {}),
    "tp_tofu": ({"tp": 2}, {}),
    "gpipe": ({"pp": 2, "schedule": "gpipe", "microbatches": 2}, {}),
    "1f1b": ({"pp": 2, "schedule": "1f1b", "microbatches": 2}, {}),
    "zb1p": ({"pp": 2, "schedule": "zb1p", "microbatches": 2}, {}),
    "topk_ratio_1": ({"dp": 2, "grad_sync": C.TopK(ratio=1.0)}, {}),
    "randomk_ratio_1": ({"dp": 2, "grad_sync": C.RandomK(ratio=1.0)}, {}),
    "powersgd_before_start": ({"dp": 2, "grad_sync": C.PowerSGD(rank=1, start_iter=10)}, {}),
}
_SIZES = ("dp", "tp", "pp", "microbatches")


def _merge(a: str, b: str):
    """Two features' options together (the larger of each size), or None where they set one option apart."""
    (sa, ca), (sb, cb) = FEATURES[a], FEATURES[b]
    out = dict(sa)
    for k, v in sb.items():
        if k in _SIZES:
            out[k] = max(out.get(k, 1), v)
        elif k in out and out[k] != v:
            return None
        else:
            out[k] = v
    if "grad_sync" in sa and "grad_sync" in sb and sa["grad_sync"] != sb["grad_sync"]:
        return None
    return out, {**ca, **cb}


PAIRS = [(a, b) for a, b in itertools.combinations(FEATURES, 2) if _merge(a, b) is not None]
QUICK = {("dp",), ("zero3",), ("tp_megatron",), ("1f1b",), ("recompute_full",), ("dp", "grad_accumulation"),
         ("zero2", "recompute_full"), ("dp", "tp_megatron")}

# Deviations the sweep found that docs/semantics.md does not describe: bugs, kept here (strict xfail, so a fix
# turns them into failures to remove from this table) until they are fixed.
KNOWN_BUGS: dict = {}


def _spec(names):
    if len(names) == 1:
        return FEATURES[names[0]]
    return _merge(*names)


def _cluster(strategy: fxpar.Strategy, options: dict):
    return fxpar.ClusterSpec.local(strategy.size, **options)


_BUILT: dict = {}


def _build(names):
    """(program, model, batches, strategy) for a feature or a pair, or its plan-time refusal raised: built once per
    module (the parametrised test asks whether a pair is accepted, then runs it; the refusal test reads them all)."""
    if names not in _BUILT:
        try:
            _BUILT[names] = (_make(names), None)
        except FxparError as e:
            _BUILT[names] = (None, e)
    built, refusal = _BUILT[names]
    if refusal is not None:
        raise refusal
    return built


def _make(names):
    options, cluster_options = _spec(names)
    pipeline, tp = options.get("pp", 1) > 1, options.get("tp", 1) > 1
    model = _model(batch_norm=not (pipeline and options.get("dp", 1) > 1), p=0.0 if (pipeline or tp) else 0.25)
    batches = _batches()
    strategy = fxpar.Strategy(**options)
    program = fxpar.parallelize(model, _cluster(strategy, cluster_options), batches[0], F.cross_entropy,
                                (torch.optim.SGD, {"lr": LR}), strategy=strategy)
    return program, model, batches, strategy


def _accepted(names) -> bool:
    """False for a pair refused on purpose (a StrategyError); any other error is left to fail the test."""
    try:
        _build(names)
    except fxpar.StrategyError:
        return False
    return True


def _check(names, clusters):
    program, model, batches, strategy = _build(names)
    n = program.world_size + len(program.extra_ranks())
    res = program.run_local(batches, cluster=clusters.get(n) if n > 1 else None, seed=SEED)
    losses, state = reference(model, batches, strategy.dp, program.plan.microbatches)
    got = res.state_dict()
    assert max(abs(a - b) for a, b in zip(res.losses, losses)) < 1e-10, (names, res.losses, losses)
    assert max_abs_diff(got, state) < 1e-10, (names, max_abs_diff(got, state))
    assert torch.equal(got["unused.weight"], model.state_dict()["unused.weight"])


def _marks(names):
    marks = [] if names in QUICK else [pytest.mark.slow]
    if names in KNOWN_BUGS:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[names]))
    return marks


def _cases():
    return [pytest.param(names, id="+".join(names), marks=_marks(names))
            for names in [(a,) for a in FEATURES] + PAIRS]


@pytest.mark.numerics
@pytest.mark.parametrize("names", _cases())
def test_matches_its_documented_semantics(names, clusters):
    if len(names) == 2 and not _accepted(names):
        pytest.skip("a pair the support matrix says does not compose (refused at plan time; see the test below)")
    _check(names, clusters)


@pytest.mark.slow
@pytest.mark.structure
def test_every_refused_pair_is_refused_with_a_reason():
    """A pair parallelize refuses (the support matrix's "not with ...": ZeRO with tp, ByteScheduler or a
    gradient-sync method; tp with ByteScheduler or a gradient-sync method; Herring and Parallax with a pipeline)
    is refused with a StrategyError that names a setting of each of the two."""
    refused = []
    for names in PAIRS:
        if names in KNOWN_BUGS:
            continue
        try:
            _build(names)
        except FxparError as e:
            refused.append((names, e))
    assert len(refused) >= 50, "the support matrix lists more pairs that do not compose"
    for names, e in refused:
        assert isinstance(e, fxpar.StrategyError), (names, e)
        for n in names:
            assert any(f"{k}=" in str(e) for k in FEATURES[n][0]), (names, n, str(e))


@pytest.mark.structure
@pytest.mark.parametrize("options", [dict(dp=2, pp=2, microbatches=2), dict(pp=2, schedule="chimera", microbatches=2)])
def test_pipeline_refuses_batch_norm_with_data_parallelism(options):
    """BatchNorm's running statistics in a pipeline are exact with one copy of each stage (the sweep's pipelines);
    dp replicas of the pipeline, or a stage held twice (Chimera), would each keep their own: refused by name."""
    model, batches = _model(batch_norm=True, p=0.0), _batches()
    strategy = fxpar.Strategy(**options)
    with pytest.raises(fxpar.StrategyError, match=r"bn\.running_mean.*(dp=2|two pipeline ranks)"):
        fxpar.parallelize(model, strategy.size, batches[0], F.cross_entropy, (torch.optim.SGD, {"lr": LR}),
                          strategy=strategy)


@pytest.mark.structure
def test_the_sweep_covers_every_feature_and_its_pairs():
    assert len(FEATURES) >= 20 and len(PAIRS) >= 150
    assert all(any(n in p for p in QUICK) for n in ("dp", "zero3", "tp_megatron", "1f1b"))
