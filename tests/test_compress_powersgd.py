"""PowerSGD's bucket sum against torch's own ``powerSGD_hook`` on the same ranks and bucket contents (float64).

Every rank of a real gloo group runs ``PowerSGD(...).sum`` through an eager :class:`Comm` on the world group and, on
copies of the same buckets, torch's hook with a ``PowerSGDState`` of the same options, for several steps; the two
must agree to 1e-10 (they agree bit for bit: the same arithmetic in the same order)."""
import copy
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import fxpar

from fxpar.compress.ddp_hook import HookBucket
from fxpar.compress.feature import bucket_infos as plan_buckets
from fxpar.compress.method import BucketInfo, Comm
from fxpar.compress.powersgd import PowerSGD, bucket_layout, draw_seed, orthogonalize, rng_state_tensor
from fxpar.errors import StrategyError
from fxpar.testing import MLP, gpt_loss, regression_batches, tiny_gpt, token_batches

NUMERICS, STRUCTURE = pytest.mark.numerics, pytest.mark.structure


def model_buckets(kind: str, n_buckets: int) -> list:
    """Gradient shapes of a model as DDP buckets them on its first step (parameters in reverse order), cut into
    ``n_buckets`` buckets: ``[(keys, shapes)]``."""
    model = tiny_gpt() if kind == "gpt" else MLP()
    named = list(reversed(list(model.named_parameters())))
    cut = [round(i * len(named) / n_buckets) for i in range(n_buckets + 1)]
    return [(tuple(k for k, _ in named[a:b]), tuple(tuple(p.shape) for _, p in named[a:b]))
            for a, b in zip(cut[:-1], cut[1:])]


def bucket_infos(kind: str, n_buckets: int, dp: int, rank: int, dtype: str = "float64") -> list:
    out = []
    for i, (keys, shapes) in enumerate(model_buckets(kind, n_buckets)):
        offsets, at = [], 0
        for s in shapes:
            offsets.append(at)
            at += int(np.prod(s)) if s else 1
        out.append(BucketInfo(0, i, n_buckets, keys, shapes, tuple(offsets), at, dtype, dp, rank))
    return out


def local_grads(info: BucketInfo, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + info.index)
    # a low-rank part plus noise, so the rank-r estimate is neither exact nor meaningless
    return torch.randn(info.numel, generator=g, dtype=torch.float64) * (1 + step % 3)


def torch_state(m: PowerSGD, group=None):
    return psgd.PowerSGDState(process_group=group, matrix_approximation_rank=m.rank, start_powerSGD_iter=m.start_iter,
                              min_compression_rate=m.min_compression_rate, use_error_feedback=m.error_feedback,
                              warm_start=m.warm_start, orthogonalization_epsilon=m.orthogonalization_epsilon,
                              random_seed=m.seed)


def run_method(method, infos, steps, comm, hook_state=None):
    """Every step, every bucket in index order: ``method.sum`` as the runtime calls it. Returns the sums per step
    and bucket."""
    gen = torch.Generator().manual_seed(0)
    states = [method.init_state(b, gen) for b in infos]
    outs = []
    for step in range(steps):
        row = []
        for b in infos:
            v = method.variant(b, step, states[b.index])
            ins = method.host_inputs(b, step, states[b.index], v, gen)
            flat = local_grads(b, step, comm.rank) / comm.size
            s, states[b.index] = method.sum(flat, states[b.index], ins, b, comm, v)
            row.append(s)
        outs.append(row)
    return outs, states


def run_torch_hook(hook, state, infos, steps, rank):
    outs = []
    for step in range(steps):
        row = []
        for b in infos:
            fut = hook(state, HookBucket(local_grads(b, step, rank).clone(), b))
            row.append(fut.wait().clone())
        outs.append(row)
    return outs


def _versus_torch(opts: dict, kind: str, n_buckets: int, steps: int, batched: bool = False):
    """On a rank: (max |ours - torch| over steps and buckets, the largest |sum|, max |ours - plain mean| at the
    last step)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    comm = Comm(world, rank, group=dist.group.WORLD.group_name)
    m = PowerSGD(**opts)
    infos = bucket_infos(kind, n_buckets, world, rank)
    ours, _ = run_method(m, infos, steps, comm)
    ref = run_torch_hook(psgd.powerSGD_hook, torch_state(m), infos, steps, rank)
    diff = max(float((a - b).abs().max()) for ra, rb in zip(ours, ref) for a, b in zip(ra, rb))
    size = max(float(a.abs().max()) for ra in ours for a in ra)
    mean = [sum(local_grads(b, steps - 1, r) for r in range(world)) / world for b in infos]
    off_mean = max(float((a - b).abs().max()) for a, b in zip(ours[-1], mean))
    return diff, size, off_mean


CASES = [
    # rank, start_iter, error feedback, warm start
    dict(rank=1, start_iter=2, error_feedback=True, warm_start=True),
    dict(rank=2, start_iter=3, error_feedback=True, warm_start=True),
    dict(rank=2, start_iter=1, error_feedback=False, warm_start=False),
    dict(rank=1, start_iter=2, error_feedback=True, warm_start=False),
    dict(rank=2, start_iter=2, error_feedback=False, warm_start=True),
    dict(rank=3, start_iter=2, error_feedback=True, warm_start=True, min_compression_rate=1.0),   # QR above rank 2
]


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
@pytest.mark.parametrize("opts", CASES, ids=lambda o: "r{rank}-s{start_iter}-ef{error_feedback:d}-ws{warm_start:d}"
                         .format(**o))
@NUMERICS
def test_equals_torch_powerSGD_hook_2_ranks(clusters, opts, kind):
    # the GPT in one bucket: its blocks' same-shaped matrices are taken grouped by shape, as the hook takes them
    res = clusters.get(2).run(_versus_torch, [(opts, kind, 1 if kind == "gpt" else 2, 6)] * 2)
    for diff, size, off_mean in res:
        assert diff <= 1e-10 * max(1.0, size), res
        assert off_mean > 1e-3          # compression really changed the sum


@NUMERICS
@pytest.mark.slow
def test_equals_torch_powerSGD_hook_4_ranks(clusters):
    for opts in (CASES[0], CASES[2]):
        for diff, size, off_mean in clusters.get(4).run(_versus_torch, [(opts, "gpt", 3, 5)] * 4):
            assert diff <= 1e-10 * max(1.0, size)
            assert off_mean > 1e-3


def _full_rank_is_plain(kind):
    """PowerSGD at a rank >= every matrix's smaller side and min_compression_rate=0 (everything compressed, biases as
    n x 1): the sum against the plain mean."""
    world, rank = dist.get_world_size(), dist.get_rank()
    comm = Comm(world, rank, group=dist.group.WORLD.group_name)
    infos = bucket_infos(kind, 2, world, rank)
    big = max(min(s[0], int(np.prod(s)) // s[0]) for b in infos for s in b.shapes if s)
    m = PowerSGD(rank=big, start_iter=2, min_compression_rate=0.0)
    assert all(t.compressed for b in infos for t in m.layout(b))
    ours, _ = run_method(m, infos, 5, comm)
    worst = 0.0
    for step in range(5):
        for b, got in zip(infos, ours[step]):
            want = sum(local_grads(b, step, r) / world for r in range(world))
            worst = max(worst, float((got - want).abs().max()))
    return worst


@NUMERICS
@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_full_rank_equals_plain_dp(clusters, kind):
    """A rank-min(n, m) approximation of an n x m matrix is the matrix itself, so this is plain data parallelism; not
    bit for bit: P Q^T with P = orth(M Q) and Q = M^T P rounds at each product and in the orthogonalisation (about
    1e-15 relative per step). The residuals (each rank's M minus the mean) sum to zero over the ranks, so the mean
    stays the plain one at every step."""
    for worst in clusters.get(2).run(_full_rank_is_plain, [(kind,)] * 2):
        assert 0 < worst < 1e-8


# ---- the pieces, no ranks ----

@STRUCTURE
@pytest.mark.parametrize("rank", [1, 2, 3, 4])
def test_orthogonalize_matches_torch(rank):
    m = torch.randn(1, 20, rank, dtype=torch.float64)
    want = m.clone()
    psgd._orthogonalize(want, 0)
    assert torch.equal(orthogonalize(m, 0.0), want)
    want = m.clone()
    psgd._orthogonalize(want, 1e-8)
    assert torch.equal(orthogonalize(m, 1e-8), want)


@STRUCTURE
def test_seed_draws_follow_numpy_in_bucket_order():
    rs = np.random.RandomState(7)
    want = [rs.randint(1_000_000_000) for _ in range(6)]
    rng = rng_state_tensor(7)
    got = []
    for _ in range(2):                       # two rounds of three buckets
        round_ = [draw_seed(rng, i, 3)[0] for i in range(3)]
        rng = draw_seed(rng, 0, 3)[1]
        got += round_
    assert got == want


@STRUCTURE
def test_layout_is_torchs_should_compress():
    info = bucket_infos("gpt", 1, 2, 0)[0]
    for rate in (0.0, 1.0, 2.0, 8.0):
        for r in (1, 2, 4):
            for t in bucket_layout(info, r, rate):
                n, m = t.rows, t.cols
                rr = min(n, m, r)
                assert t.compressed == psgd._should_compress(n, m, rr, rate)[0]


@STRUCTURE
@pytest.mark.parametrize("bad, words", [
    (dict(rank=0), "rank"),
    (dict(start_iter=1), "start_iter"),
    (dict(start_iter=1, error_feedback=False), "start_iter"),
    (dict(start_iter=0, warm_start=False), "start_iter"),
    (dict(min_compression_rate=-1.0), "min_compression_rate"),
    (dict(orthogonalization_epsilon=-1e-8), "orthogonalization_epsilon"),
])
def test_refuses_what_torch_refuses(bad, words):
    with pytest.raises(StrategyError, match=words):
        PowerSGD(**bad).check(2)
    if "start_iter" in bad and (bad.get("error_feedback", True) or bad.get("warm_start", True)):
        with pytest.raises(ValueError, match="start_powerSGD_iter"):
            torch_state(PowerSGD(**bad))


@STRUCTURE
def test_allowed_start_iter_without_memory():
    PowerSGD(start_iter=1, error_feedback=False, warm_start=False).check(2)
    PowerSGD(start_iter=0, error_feedback=False, warm_start=False).check(2)


@STRUCTURE
def test_bytes_and_explain():
    info = bucket_infos("mlp", 1, 2, 0)[0]
    m = PowerSGD(rank=2)
    es = 8
    assert m.wire_bytes(info, "allreduce") == info.numel * es
    lay = m.layout(info)
    p = sum(t.rows * t.rank for t in lay if t.compressed)
    q = sum(t.cols * t.rank for t in lay if t.compressed)
    whole = sum(t.numel for t in lay if not t.compressed)
    assert p and q and whole
    assert m.wire_bytes(info, "compressed") == (p + q + whole) * es
    lines = m.describe(info, "compressed")
    assert len(lines) == len(info.keys)
    assert any("compressed as 32 x 16 at rank 2" in x for x in lines)
    assert any("sent whole" in x for x in lines)


@STRUCTURE
def test_warns_once_when_nothing_is_compressed():
    info = bucket_infos("mlp", 1, 2, 0)[0]
    m = PowerSGD(rank=16, min_compression_rate=2.0)
    with pytest.warns(UserWarning, match="bucket 0"):
        m.layout(info)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.layout(info)


# ---- end to end: fxpar.parallelize(...).run_local against DDP with powerSGD_hook --------------------------------
SGD = (torch.optim.SGD, {"lr": 0.1})


def ddp_with_hook(model, batches, loss_fn, optimizer, hook, state_opts):
    """On a rank: torch's DDP (the model in one bucket) with ``hook`` and, when ``state_opts`` is given, a
    ``PowerSGDState(process_group=None, **state_opts)``; the global-batch losses gathered after training and rank 0's
    trained state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = DDP(copy.deepcopy(model), bucket_cap_mb=25.0)
    m.register_comm_hook(None if state_opts is None else psgd.PowerSGDState(process_group=None, **state_opts), hook)
    cls, kw = optimizer
    opt = cls(m.parameters(), **kw)
    local = []
    for b in batches:
        n = b[0].shape[0] // world
        x, y = (t[rank * n:(rank + 1) * n] for t in b)
        opt.zero_grad()
        loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
        local.append(loss.item())
    t = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(t)
    return {"losses": (t / world).tolist(), "state": m.module.state_dict() if rank == 0 else None}


def state_opts(m: PowerSGD) -> dict:
    return dict(matrix_approximation_rank=m.rank, start_powerSGD_iter=m.start_iter,
                min_compression_rate=m.min_compression_rate, use_error_feedback=m.error_feedback,
                warm_start=m.warm_start, orthogonalization_epsilon=m.orthogonalization_epsilon, random_seed=m.seed)


def model_and_data(kind: str, n: int):
    if kind == "gpt":
        return tiny_gpt(), token_batches(n), gpt_loss
    torch.manual_seed(0)
    return MLP().double(), regression_batches(n), F.mse_loss


def program(model, batches, loss_fn, method, dp=2, **kw):
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(dp), batches[0], loss_fn=loss_fn, optimizer=SGD,
                             strategy=fxpar.Strategy(dp=dp, grad_sync=method, **kw))


def assert_equals_ddp(res, ddp):
    assert max(abs(a - b) for a, b in zip(res.losses, ddp[0]["losses"])) <= 1e-10
    state = res.state_dict()
    worst = max(float((state[k] - v).abs().max()) for k, v in ddp[0]["state"].items())
    assert worst <= 1e-10, worst


E2E = [PowerSGD(rank=1, start_iter=2), PowerSGD(rank=2, start_iter=3, min_compression_rate=1.0),
       PowerSGD(rank=1, start_iter=1, error_feedback=False, warm_start=False, seed=4)]


@NUMERICS
@pytest.mark.parametrize("method, kind", [
    pytest.param(m, k, id=f"{name}-{k}", marks=[pytest.mark.slow] if k == "gpt" and name != "r1-no-memory" else [])
    for m, name in zip(E2E, ["r1", "r2", "r1-no-memory"]) for k in ("mlp", "gpt")])
def test_run_local_equals_ddp_with_powerSGD_hook(clusters, kind, method):
    model, batches, loss_fn = model_and_data(kind, 6)
    res = program(model, batches, loss_fn, method).run_local(batches, cluster=clusters.get(2))
    ddp = clusters.get(2).run(ddp_with_hook, [(model, batches, loss_fn, SGD, psgd.powerSGD_hook,
                                               state_opts(method))] * 2)
    assert_equals_ddp(res, ddp)
    plain = clusters.get(2).run(ddp_with_hook, [(model, batches, loss_fn, SGD, allreduce_hook, None)] * 2)
    assert max(abs(a - b) for a, b in zip(res.losses, plain[0]["losses"])) > 1e-8   # compression changed the run


@NUMERICS
@pytest.mark.slow
def test_run_local_equals_ddp_with_powerSGD_hook_4_ranks(clusters):
    model, batches, loss_fn = model_and_data("gpt", 5)
    method = PowerSGD(rank=2, start_iter=2)
    res = program(model, batches, loss_fn, method, dp=4).run_local(batches, cluster=clusters.get(4))
    ddp = clusters.get(4).run(ddp_with_hook, [(model, batches, loss_fn, SGD, psgd.powerSGD_hook,
                                               state_opts(method))] * 4)
    assert_equals_ddp(res, ddp)


@NUMERICS
def test_checkpoint_resumes_warm_start_and_residuals_bitwise(clusters, tmp_path):
    """Save after step 4 (compressed since step 2: residuals and warm-start Qs in use), resume, 3 more == 7 straight."""
    model, batches, loss_fn = model_and_data("mlp", 7)
    method = PowerSGD(rank=1, start_iter=2)
    lc = clusters.get(2)
    straight = program(model, batches, loss_fn, method).run_local(batches, cluster=lc)
    program(model, batches, loss_fn, method).run_local(batches[:4], cluster=lc, save_to=tmp_path / "ck")
    resumed = program(model, batches, loss_fn, method).run_local(batches[4:], cluster=lc, resume_from=tmp_path / "ck")
    assert resumed.losses == straight.losses[4:]
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    restart = program(model, batches, loss_fn, method).run_local(batches[4:], cluster=lc)
    assert restart.losses != straight.losses[4:]


@NUMERICS
def test_measured_bytes_equal_wire_bytes(clusters):
    """Per step and bucket: a plain all-reduce before start_iter, then the whole tensors, P and Q."""
    model, batches, loss_fn = model_and_data("mlp", 4)
    method = PowerSGD(rank=2, start_iter=2, min_compression_rate=1.0)
    prog = program(model, batches, loss_fn, method, bucket_cap_mb=0.004)
    infos = plan_buckets(prog.plan, 0, prog.stages[0].captured)
    assert len(infos) >= 2
    res = prog.run_local(batches, cluster=clusters.get(2), measure_comm=True)
    for r in range(2):
        for step, calls in enumerate(res.comm_calls[r]):
            want = []
            for b in infos:
                v = method.variant(b, step, None)
                lay = method.layout(b)
                if v == "allreduce":
                    want.append(("all_reduce", b.numel * 8))
                    continue
                parts = [sum(t.numel for t in lay if not t.compressed),
                         sum(t.rows * t.rank for t in lay if t.compressed),
                         sum(t.cols * t.rank for t in lay if t.compressed)]
                want += [("all_reduce", n * 8) for n in parts if n]
            assert calls == want, (r, step)
            assert sum(n for _, n in calls) == sum(method.wire_bytes(b, method.variant(b, step, None)) for b in infos)
    # explain() shows the steady state (compressed) and what the first steps send (a plain all-reduce)
    steady = method.wire_bytes(infos[0], method.variant(infos[0], 10**6, None))
    assert f"wire_bytes={steady} (" in prog.explain() and steady < infos[0].numel * 8
    assert f"until the method starts: wire_bytes={method.wire_bytes(infos[0], 'allreduce')} (" in prog.explain()
