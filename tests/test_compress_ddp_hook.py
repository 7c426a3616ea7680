"""DDPHook runs a DDP comm hook on a bucket exactly as DistributedDataParallel does (float64).

The oracle is torch's own DDP: on every rank of a gloo group, DDP trains a model with the hook wrapped in a recorder
that keeps each bucket DDP hands the hook (index, is_last, the buffer, its gradients' shapes and parameters) and
what the hook's future returned. Then ``DDPHook(hook, fresh_state).sum`` replays the same buckets, in the same order,
from fxpar's side (each rank's buffer scaled by 1/dp, as fxpar's buckets come) and must return the same tensors."""
import copy
import functools
import math
import pickle
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import fxpar
from fxpar import compress as C
from cost_models.compute import NARROW_COLUMNS
from fxpar.compress.ddp_hook import DDPHook, HookBucket
from fxpar.compress.feature import CompressSection
from fxpar.compress.method import BucketInfo, Comm
from fxpar.errors import StrategyError
from fxpar.testing import MLP, class_batches, gpt_loss, regression_batches, tiny_gpt, token_batches

NUMERICS, STRUCTURE = pytest.mark.numerics, pytest.mark.structure


class Recorder:
    """A hook's state that records what DDP handed the hook and what the hook's future held."""

    def __init__(self, hook, state):
        self.hook, self.state, self.calls = hook, state, []


def recording_hook(rec: Recorder, bucket):
    names = {id(p): n for n, p in rec.names}
    call = {"index": bucket.index(), "is_last": bucket.is_last(), "buffer": bucket.buffer().clone(),
            "shapes": tuple(tuple(g.shape) for g in bucket.gradients()),
            "views": all(g.data_ptr() >= bucket.buffer().data_ptr() for g in bucket.gradients()),
            "keys": tuple(names[id(p)] for p in bucket.parameters())}
    rec.calls.append(call)

    def keep(fut):
        call["out"] = fut.value().clone()
        return fut.value()
    return rec.hook(rec.state, bucket).then(keep)


def make_state(kind: str):
    if kind == "none":
        return None
    return psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1 if kind == "psgd1" else 2,
                              start_powerSGD_iter=2, min_compression_rate=0.5, random_seed=3)


HOOKS = {
    "allreduce": (dh.allreduce_hook, "none"),
    "fp16": (dh.fp16_compress_hook, "none"),
    "bf16": (dh.bf16_compress_hook, "none"),
    "powerSGD": (psgd.powerSGD_hook, "psgd2"),
}
BATCHED = {"batched_powerSGD": (psgd.batched_powerSGD_hook, "psgd1")}


def info_of(call, n_buckets, dp, rank) -> BucketInfo:
    offsets, at = [], 0
    for s in call["shapes"]:
        offsets.append(at)
        at += int(torch.Size(s).numel())
    return BucketInfo(0, call["index"], n_buckets, call["keys"], call["shapes"], tuple(offsets), at, "float64", dp,
                      rank)


def _ddp_then_replay(name: str, steps: int, bucket_cap_mb: float):
    """On a rank: DDP trains an MLP with the hook (recorded); DDPHook replays the recorded buckets. Returns (max
    |DDPHook - DDP| over every call, the recorded calls' (index, is_last) per step, whether the buffers were DDP's
    raw local gradients, the number of calls)."""
    hook, state_kind = {**HOOKS, **BATCHED}[name]
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = MLP(d_in=16, hidden=32, d_out=4).double()
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
    rec = Recorder(hook, make_state(state_kind))
    rec.names = list(ddp.module.named_parameters())
    ddp.register_comm_hook(rec, recording_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    batches = class_batches(steps, 8 * world, 16, 4, seed=5)
    per_step, raw_ok, ddp_failed = [], True, None
    for b in batches:
        x, y = (t[rank * 8:(rank + 1) * 8] for t in b)
        before = len(rec.calls)
        opt.zero_grad()
        # the local gradient, taken without DDP, to check DDP hands the hook the un-divided local gradients
        local = torch.autograd.grad(F.cross_entropy(ddp.module(x.double()), y), list(ddp.module.parameters()))
        by_name = {n: g for (n, _), g in zip(rec.names, local)}
        try:
            F.cross_entropy(ddp(x.double()), y).backward()
        except Exception as e:          # torch's own hook failing inside DDP: DDPHook must fail at the same call
            ddp_failed = (len(rec.calls) - 1, type(e).__name__)
            per_step.append(tuple((c["index"], c["is_last"]) for c in rec.calls[before:]))
            break
        opt.step()
        calls = rec.calls[before:]
        per_step.append(tuple((c["index"], c["is_last"]) for c in calls))
        for c in calls:
            want = torch.cat([by_name[k].reshape(-1) for k in c["keys"]])
            raw_ok &= bool(torch.equal(want, c["buffer"])) and c["views"]
    # replay on fxpar's side: a fresh state, the same buckets in the same order
    method = DDPHook(hook, make_state(state_kind))
    comm = Comm(world, rank, group=dist.group.WORLD.group_name)
    worst, at, ours_failed = 0.0, 0, None
    for i, step in enumerate(per_step):
        # the step's bucket count: DDP's, or (the step DDP failed in) that of the step before
        count = len(step) if i + 1 < len(per_step) or ddp_failed is None else len(per_step[i - 1])
        for k, c in enumerate(rec.calls[at:at + len(step)]):
            info = info_of(c, count, world, rank)
            try:
                got, _ = method.sum(c["buffer"] / world, {}, [], info, comm, None)
            except StrategyError as e:
                ours_failed = (at + k, type(e.__cause__).__name__, hook.__name__ in str(e))
                break
            worst = max(worst, float((got - c["out"]).abs().max()))
        at += len(step)
    return worst, per_step, raw_ok, len(rec.calls), ddp_failed, ours_failed


@NUMERICS
@pytest.mark.parametrize("name", list(HOOKS))
def test_equals_ddp_with_the_hook(clusters, name):
    # 0.001 MB buckets: the MLP's 1 380 float64 gradients fill several buckets. powerSGD_hook gets one bucket: DDP on
    # gloo with it and several buckets deadlocks (each bucket's future callback blocks one of gloo's two threads in
    # a wait for the next all-reduce, which needs a free thread); DDPHook waits bucket by bucket and does not
    cap = 25.0 if "powerSGD" in name else 0.001
    res = clusters.get(2).run(_ddp_then_replay, [(name, 4, cap)] * 2)
    for worst, per_step, raw_ok, calls, ddp_failed, ours_failed in res:
        assert ddp_failed is None and ours_failed is None
        assert worst <= 1e-12, (name, worst)
        assert raw_ok                     # DDP hands the hook the local, un-divided gradients, as HookBucket does
        # DDP starts with one bucket and rebuilds them after the first step
        assert calls == sum(len(s) for s in per_step) and (len(per_step[-1]) > 1) == (cap < 1)
        for s in per_step:                # one call per bucket, in index order; is_last on the last
            assert [i for i, _ in s] == list(range(len(s)))
            assert [last for _, last in s] == [False] * (len(s) - 1) + [True]


@NUMERICS
def test_batched_powerSGD_fails_where_ddp_fails(clusters):
    """torch 2.13's ``batched_powerSGD_hook`` hands ``_orthogonalize`` a 2-D matrix, which it refuses (an
    AssertionError) on the first compressed step, inside DDP too: DDPHook runs the steps before it as DDP does and
    fails at the same call, naming the hook."""
    for worst, per_step, raw_ok, calls, ddp_failed, ours_failed in clusters.get(2).run(
            _ddp_then_replay, [("batched_powerSGD", 4, 25.0)] * 2):
        assert worst <= 1e-12 and raw_ok and len(per_step) == 3           # steps 0 and 1 ran; step 2 failed
        assert ddp_failed == (calls - 1, "AssertionError")
        assert ours_failed == (calls - 1, "AssertionError", True)


@STRUCTURE
def test_batched_powerSGD_is_refused_by_name():
    """What the test above shows, said before a run: the Strategy refuses the hook, naming it and the fix."""
    st = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    with pytest.raises(StrategyError, match=r"DDPHook\(.*batched_powerSGD_hook\).*2-D matrix.*powerSGD_hook"):
        fxpar.Strategy(dp=2, grad_sync=C.DDPHook(psgd.batched_powerSGD_hook, st))
    with pytest.raises(StrategyError, match="batched_powerSGD_hook"):
        C.DDPHook(functools.partial(psgd.batched_powerSGD_hook), st).check(2)
    C.DDPHook(psgd.powerSGD_hook, st).check(2)


def never_completes(state, bucket):
    return torch.futures.Future()


def wrong_shape(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer()[:-1].clone())
    return fut


def wrong_dtype(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer().float())
    return fut


def reads_parameters(state, bucket):
    bucket.parameters()
    return dh.allreduce_hook(state, bucket)


def _bad_hook(hook, timeout_s):
    world, rank = dist.get_world_size(), dist.get_rank()
    info = BucketInfo(0, 1, 2, ("fc.weight", "fc.bias"), ((3, 4), (3,)), (0, 12), 15, "float64", world, rank)
    comm = Comm(world, rank, group=dist.group.WORLD.group_name)
    try:
        DDPHook(hook, None, timeout_s=timeout_s).sum(torch.ones(15, dtype=torch.float64), {}, [], info, comm, None)
    except StrategyError as e:
        return str(e)
    return None


@NUMERICS
@pytest.mark.parametrize("hook, words", [
    (never_completes, ["never_completes", "did not complete in 0.3 s", "timeout_s", "bucket 1"]),
    (wrong_shape, ["wrong_shape", "bucket 1", "fc.weight", "(14,)", "shape (15,)", "torch.float64"]),
    (wrong_dtype, ["wrong_dtype", "torch.float32", "dtype torch.float64"]),
    (reads_parameters, ["bucket.parameters()", "bucket 1", "nn.Parameter"]),
])
def test_bad_hooks_fail_naming_the_hook(clusters, hook, words):
    for msg in clusters.get(2).run(_bad_hook, [(hook, 0.3)] * 2):
        assert msg is not None
        for w in words:
            assert w in msg, (w, msg)


def _pickled_state_binds_group(blob: bytes):
    """On a rank: the DDPHook unpickled (state without its process group) runs powerSGD_hook on the dp group."""
    method = pickle.loads(blob)
    world, rank = dist.get_world_size(), dist.get_rank()
    comm = Comm(world, rank, group=dist.group.WORLD.group_name)
    info = BucketInfo(0, 0, 1, ("w", "b"), ((8, 6), (8,)), (0, 48), 56, "float64", world, rank)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        flat = torch.randn(56, generator=g, dtype=torch.float64)
        got, _ = method.sum(flat / world, {}, [], info, comm, None)
    return method.state.process_group is not None and method.state.iter == 4, float(got.abs().max())


@NUMERICS
def test_state_travels_without_its_process_group(clusters):
    st = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    st.iter = 0
    blob = pickle.dumps(DDPHook(psgd.powerSGD_hook, st))
    for ok, size in clusters.get(2).run(_pickled_state_binds_group, [(blob,)] * 2):
        assert ok and size > 0


@STRUCTURE
def test_pickles_with_no_default_group():
    assert not dist.is_initialized()
    st = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=5, random_seed=9)
    back = pickle.loads(pickle.dumps(DDPHook(psgd.powerSGD_hook, st, timeout_s=7.0)))
    assert back.hook is psgd.powerSGD_hook and back.timeout_s == 7.0
    assert back.state.process_group is None and back.state.matrix_approximation_rank == 2
    assert back.state.rng.randint(10 ** 9) == st.rng.randint(10 ** 9)


@STRUCTURE
def test_refuses_hooks_that_cannot_travel():
    with pytest.raises(StrategyError, match="top level of a module"):
        DDPHook(lambda s, b: None).check(2)
    with pytest.raises(StrategyError, match="hook must be a function"):
        DDPHook("allreduce").check(2)
    with pytest.raises(StrategyError, match="timeout_s"):
        DDPHook(dh.allreduce_hook, timeout_s=0).check(2)
    DDPHook(functools.partial(dh.allreduce_hook)).check(2)


@STRUCTURE
def test_explain_says_what_the_hook_sends():
    info = BucketInfo(0, 0, 1, ("w",), ((4, 4),), (0,), 16, "float64", 2)
    m = DDPHook(dh.fp16_compress_hook)
    said = " ".join(m.describe(info, None))
    assert "float16" in said and "all_reduce of 32 B" in said and "measure" in said
    assert "fp16_compress_hook" in m.summary()
    assert m.to_dict()["hook"].endswith("default_hooks.fp16_compress_hook")
    # the plan's printed section names the hook and its state; the pickle that carries them in JSON is not shown
    section = CompressSection(method=m.to_dict())
    head = section.lines()[0]
    assert "fp16_compress_hook" in head and "state='NoneType'" in head and "timeout_s=300.0" in head
    assert "pickle" not in head and m.to_dict()["pickle"] not in head
    assert DDPHook.from_dict(section.method).hook is dh.fp16_compress_hook


# ---- what the plan and estimate() price for a hook: what torch's hooks send, as they form it --------------------
SHAPES = ((8, 16), (16,), (4, 3, 3), (2, 40), (5,), (30, 2))


def _info(shapes=SHAPES) -> BucketInfo:
    offsets, at = [], 0
    for sh in shapes:
        offsets.append(at)
        at += math.prod(sh)
    return BucketInfo(0, 0, 1, tuple(f"t{i}" for i in range(len(shapes))), shapes, tuple(offsets), at, "float64", 2)


def _powersgd_formula(shapes, rank, rate) -> tuple:
    """torch's powerSGD_hook, steps I-III: each gradient as an n x m matrix (m: the rest of its dims) at r = min(n,
    m, rank) is compressed when (n + m) r rate < n m, adding n r to P and m r to Q; the others go whole."""
    whole = p = q = 0
    for sh in shapes:
        n, m = sh[0], math.prod(sh) // sh[0]
        r = min(n, m, rank)
        if (n + m) * r * rate < n * m:
            p, q = p + n * r, q + m * r
        else:
            whole += math.prod(sh)
    return whole, p, q


def users_hook(state, bucket):
    """A hook of the user's own (module level: it travels by pickle)."""
    return dh.allreduce_hook(state, bucket)


@STRUCTURE
@pytest.mark.filterwarnings("ignore:.*worth compressing:UserWarning")
@pytest.mark.parametrize("rank, rate", [(1, 2.0), (2, 1.0), (2, 0.0), (4, 0.5)])
def test_powerSGD_hook_is_priced_by_its_P_and_Q(rank, rate):
    state = psgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=3, min_compression_rate=rate)
    m, info = DDPHook(psgd.powerSGD_hook, state), _info()
    assert [m.variant(info, k, {}) for k in range(5)] == ["allreduce"] * 3 + ["powersgd"] * 2
    whole, p, q = _powersgd_formula(SHAPES, rank, rate)
    assert p > 0
    assert m.collectives(info, "powersgd") == [("all_reduce", 8 * whole), ("all_reduce", 8 * p), ("all_reduce", 8 * q)]
    assert m.collectives(info, "allreduce") == [("all_reduce", 8 * info.numel)]
    assert m.wire_bytes(info, "powersgd") == 8 * (whole + p + q)
    # its compute is priced as fxpar's PowerSGD with the state's options (the same math), which sends the same
    like, variant = m.priced_like(info, "powersgd")
    assert like == C.PowerSGD(rank=rank, start_iter=3, min_compression_rate=rate, error_feedback=True, warm_start=True)
    assert variant == "compressed" and like.wire_bytes(info, variant) == m.wire_bytes(info, "powersgd")
    assert m.priced_like(info, "allreduce") is None
    assert f"all_reduce of {8 * p} B" in m.describe(info, "powersgd")[0]


@STRUCTURE
def test_torch_hooks_and_a_users_hook_are_priced_by_what_they_send():
    info = _info()
    n = info.numel
    assert DDPHook(dh.allreduce_hook).collectives(info, None) == [("all_reduce", 8 * n)]
    assert DDPHook(dh.allreduce_hook).priced_like(info, None) is None
    for hook in (dh.fp16_compress_hook, dh.bf16_compress_hook, functools.partial(dh.fp16_compress_hook)):
        m = DDPHook(hook)
        assert m.collectives(info, None) == [("all_reduce", 2 * n)] and m.wire_bytes(info, None) == 2 * n
        assert isinstance(m.priced_like(info, None)[0], (C.FP16, C.BF16))
    batched = DDPHook(psgd.batched_powerSGD_hook, psgd.PowerSGDState(None, matrix_approximation_rank=2,
                                                                     start_powerSGD_iter=2))
    side = math.ceil(math.sqrt(n))
    assert batched.collectives(info, "powersgd") == [("all_reduce", 8 * side * 2)] * 2
    assert batched.collectives(info, "allreduce") == [("all_reduce", 8 * n)]
    # a hook of the user's own, or torch's PowerSGD hook with a state that is not a PowerSGDState: an all-reduce,
    # said in explain() and the plan's notes
    for m in (DDPHook(users_hook), DDPHook(psgd.powerSGD_hook, {"rank": 2})):
        assert m.torch_hook() is None and m.variant(info, 10, {}) is None
        assert m.collectives(info, None) == [("all_reduce", 8 * n)] and m.priced_like(info, None) is None
        assert "user's own" in m.describe(info, None)[0] and "priced as one plain all-reduce" in m.plan_note()


@NUMERICS
@pytest.mark.parametrize("hook", [dh.allreduce_hook, dh.fp16_compress_hook, dh.bf16_compress_hook, users_hook],
                         ids=lambda h: h.__name__)
def test_measured_bytes_equal_what_the_plan_prices(clusters, hook):
    """Per bucket (several), the collectives measured on each rank are those the plan declares, and estimate()'s
    bytes are theirs (an all-reduce at dp=2 sends its bytes once: 2 (N-1)/N S); a user's hook is priced as the
    all-reduce it issues here, and the plan's notes say it is priced so."""
    model, batches, loss_fn = _data("mlp")
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=loss_fn, optimizer=SGD,
                             strategy=fxpar.Strategy(dp=2, bucket_cap_mb=0.004, grad_sync=C.DDPHook(hook)))
    rows = prog.plan.section("ddp_hook").stages[0]
    assert len(rows) >= 2
    declared = [tuple(c) for row in rows for c in row["declared"]]
    res = prog.run_local(batches[:2], cluster=clusters.get(2), measure_comm=True)
    for r in range(2):
        assert res.comm_calls[r] == [declared] * 2
    assert prog.estimate().ranks[0].comm_bytes == pytest.approx(sum(b for _, b in declared), rel=1e-12)
    assert any("priced as one plain all-reduce" in n for n in prog.plan.notes) == (hook is users_hook)


@STRUCTURE
def test_hook_bucket_answers_as_grad_bucket():
    info = BucketInfo(0, 2, 3, ("a", "b"), ((2, 3), (4,)), (0, 6), 10, "float64", 2)
    buf = torch.arange(10, dtype=torch.float64)
    hb = HookBucket(buf, info)
    assert hb.index() == 2 and hb.is_last() and hb.buffer() is buf
    a, b = hb.gradients()
    assert a.shape == (2, 3) and torch.equal(b, buf[6:]) and a.data_ptr() == buf.data_ptr()
    new = buf.float()
    hb.set_buffer(new)
    assert hb.buffer() is new and hb.gradients()[1].dtype == torch.float32


# ---- end to end: fxpar.parallelize(...).run_local with DDPHook against DDP with the hook ------------------------
SGD = (torch.optim.SGD, {"lr": 0.1})


def bf16_hook(state, bucket):
    """torch's bf16_compress_hook by another name: DDP refuses that hook by its name off CUDA + NCCL."""
    return dh.bf16_compress_hook(state, bucket)


E2E_HOOKS = {"allreduce": (dh.allreduce_hook, None), "fp16": (dh.fp16_compress_hook, None),
             "bf16": (bf16_hook, None),
             "powerSGD": (psgd.powerSGD_hook, dict(matrix_approximation_rank=2, start_powerSGD_iter=2,
                                                   min_compression_rate=1.0, random_seed=5))}


def ddp_run(model, batches, loss_fn, hook, state_opts):
    """On a rank: torch's DDP (one bucket) with ``hook``; losses gathered after training, rank 0's state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = DDP(copy.deepcopy(model), bucket_cap_mb=25.0)
    m.register_comm_hook(None if state_opts is None else psgd.PowerSGDState(None, **state_opts), hook)
    opt = SGD[0](m.parameters(), **SGD[1])
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


def _data(kind):
    if kind == "gpt":
        return tiny_gpt(), token_batches(5), gpt_loss
    torch.manual_seed(0)
    return MLP().double(), regression_batches(5), F.mse_loss


@NUMERICS
@pytest.mark.parametrize("name, kind", [(n, "mlp") for n in E2E_HOOKS] + [("bf16", "gpt"), ("powerSGD", "gpt")])
def test_run_local_equals_ddp_with_the_hook(clusters, name, kind):
    hook, opts = E2E_HOOKS[name]
    model, batches, loss_fn = _data(kind)
    state = None if opts is None else psgd.PowerSGDState(None, **opts)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=loss_fn, optimizer=SGD,
                             strategy=fxpar.Strategy(dp=2, grad_sync=C.DDPHook(hook, state)))
    res = prog.run_local(batches, cluster=clusters.get(2))
    ddp = clusters.get(2).run(ddp_run, [(model, batches, loss_fn, hook, opts)] * 2)
    assert max(abs(a - b) for a, b in zip(res.losses, ddp[0]["losses"])) <= 1e-10
    got = res.state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in ddp[0]["state"].items()) <= 1e-10


@NUMERICS
def test_measured_bytes_and_explain(clusters):
    """The plan counts what torch's fp16 hook sends (half the bucket) and a measured run reports it."""
    model, batches, loss_fn = _data("mlp")
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=loss_fn, optimizer=SGD,
                             strategy=fxpar.Strategy(dp=2, grad_sync=C.DDPHook(dh.fp16_compress_hook)))
    numel = sum(p.numel() for p in model.parameters())
    assert f"wire_bytes={numel * 2}" in prog.explain() and "measure" in prog.explain()
    res = prog.run_local(batches[:2], cluster=clusters.get(2), measure_comm=True)
    for r in range(2):
        assert res.comm_calls[r] == [[("all_reduce", numel * 2)]] * 2


@NUMERICS
def test_run_local_stops_on_a_future_that_never_completes(clusters):
    model, batches, loss_fn = _data("mlp")
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=loss_fn, optimizer=SGD,
                             strategy=fxpar.Strategy(dp=2, grad_sync=C.DDPHook(never_completes, timeout_s=0.5)))
    with pytest.raises(fxpar.RankFailedError, match=r"never_completes.*did not complete in 0.5 s"):
        prog.run_local(batches[:1], cluster=clusters.get(2))


# ---- the hook's state in checkpoints ------------------------------------------------------------------------------
CK_HOOKS = {"fp16": (dh.fp16_compress_hook, None),
            "powerSGD": (psgd.powerSGD_hook, dict(matrix_approximation_rank=2, start_powerSGD_iter=2,
                                                  min_compression_rate=1.0, random_seed=5)),
            # no warm start: each compressed step draws its Qs from the state's numpy generator
            "powerSGD_cold": (psgd.powerSGD_hook, dict(matrix_approximation_rank=1, start_powerSGD_iter=2,
                                                       min_compression_rate=1.0, random_seed=5, warm_start=False))}


def _hook_program(model, batches, loss_fn, hook, opts):
    state = None if opts is None else psgd.PowerSGDState(None, **opts)
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=loss_fn, optimizer=SGD,
                             strategy=fxpar.Strategy(dp=2, grad_sync=C.DDPHook(hook, state)))


@pytest.mark.slow
@NUMERICS
@pytest.mark.parametrize("name", list(CK_HOOKS))
def test_checkpoint_resumes_the_hook_state_bitwise(clusters, tmp_path, name):
    """3 steps (PowerSGD compresses from step 2), save, a fresh program resumes for 3 more == 6 steps straight,
    bitwise: each rank's PowerSGDState (error_dict, p/q_memory_dict, iter, its numpy rng) is in the checkpoint."""
    hook, opts = CK_HOOKS[name]
    model = _data("mlp")[0]
    batches = regression_batches(6)
    straight = _hook_program(model, batches, F.mse_loss, hook, opts).run_local(batches, cluster=clusters.get(2))
    _hook_program(model, batches, F.mse_loss, hook, opts).run_local(batches[:3], cluster=clusters.get(2),
                                                                     save_to=tmp_path / "ck")
    resumed = _hook_program(model, batches, F.mse_loss, hook, opts).run_local(
        batches[3:], cluster=clusters.get(2), resume_from=tmp_path / "ck")
    assert resumed.losses == straight.losses[3:]
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    if opts is not None:         # a hook state started afresh is another run: the saved state is what resumes it
        restart = _hook_program(model, batches, F.mse_loss, hook, opts).run_local(batches[3:], cluster=clusters.get(2))
        assert restart.losses != straight.losses[3:]


class CountingState:
    """A user's hook state with state_dict() / load_state_dict(): what a checkpoint keeps of it."""

    def __init__(self):
        self.calls = 0

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, d):
        self.calls = d["calls"]


class PlainState:
    def __init__(self):
        self.calls = 0


def locking_hook(state, bucket):
    """Counts its calls, and keeps a lock in its state (which no checkpoint can save)."""
    state.calls += 1
    state.lock = threading.Lock()
    return dh.allreduce_hook(None, bucket)


@STRUCTURE
def test_host_state_is_what_a_checkpoint_keeps():
    st = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=4)
    st.process_group = object()              # the rank's group: never saved, never replaced
    m = DDPHook(psgd.powerSGD_hook, st)
    saved = m.host_state()["attributes"]
    assert "process_group" not in saved and {"error_dict", "p_memory_dict", "q_memory_dict", "iter", "rng"} <= set(saved)
    draw = st.rng.randint(10 ** 9)
    st.iter, st.error_dict[0] = 7, torch.ones(3)
    group = st.process_group
    m.load_host_state({"attributes": saved})
    assert st.iter == 0 and st.error_dict == {} and st.rng.randint(10 ** 9) == draw and st.process_group is group
    counting = CountingState()
    counting.calls = 3
    assert DDPHook(dh.allreduce_hook, counting).host_state() == {"state_dict": {"calls": 3}}
    DDPHook(dh.allreduce_hook, counting).load_host_state({"state_dict": {"calls": 1}})
    assert counting.calls == 1
    assert DDPHook(dh.allreduce_hook, None).host_state() is None
    plain = PlainState()
    plain.lock = threading.Lock()
    with pytest.raises(StrategyError, match=r"DDPHook\(.*locking_hook, state=PlainState\): the checkpoint cannot save "
                                            r"the hook state's attribute 'lock'.*state_dict\(\) and load_state_dict"):
        DDPHook(locking_hook, plain).host_state()


@NUMERICS
def test_checkpoint_refuses_a_state_it_cannot_save(clusters, tmp_path):
    model, batches, loss_fn = _data("mlp")
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=loss_fn, optimizer=SGD,
                             strategy=fxpar.Strategy(dp=2, grad_sync=C.DDPHook(locking_hook, PlainState())))
    with pytest.raises(fxpar.RankFailedError, match=r"locking_hook.*attribute 'lock'"):
        prog.run_local(batches[:2], cluster=clusters.get(2), save_to=tmp_path / "ck")


# ---- bytes: what a hook issues from its future's callbacks is counted ---------------------------------------------
@pytest.mark.slow
@NUMERICS
def test_measured_bytes_of_powerSGD_hook_include_its_callbacks(clusters):
    """powerSGD_hook all-reduces the uncompressed tensors from the hook, then P and Q from its future's callbacks
    (on gloo's threads): each is counted, and each equals the hook's formula -- per matrix n x m (m: the rest of the
    dims) compressed at r' = min(n, m, rank) when (n + m) r' min_compression_rate < n m, P = sum n r', Q = sum m r';
    the rest (the biases, rank 1) all-reduced whole. The steps before start_powerSGD_iter: one plain all-reduce."""
    model, batches, loss_fn = _data("mlp")
    opts = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=1.0, random_seed=5)
    prog = _hook_program(model, batches[:4], loss_fn, psgd.powerSGD_hook, opts)
    res = prog.run_local(batches[:4], cluster=clusters.get(2), measure_comm=True)
    whole = P = Q = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, 2)
        if p.dim() > 1 and (n + m) * r * 1.0 < n * m:
            P, Q = P + n * r, Q + m * r
        else:
            whole += p.numel()
    numel = sum(p.numel() for p in model.parameters())
    assert P > 0 and whole > 0
    for r in range(2):
        assert res.comm_calls[r] == [[("all_reduce", numel * 8)]] * 2 + \
            [[("all_reduce", whole * 8), ("all_reduce", P * 8), ("all_reduce", Q * 8)]] * 2
    # the plan prices the same: the steps after the start, and (first_step) those before it
    row, = prog.plan.section("ddp_hook").stages[0]
    assert row["declared"] == [["all_reduce", whole * 8], ["all_reduce", P * 8], ["all_reduce", Q * 8]]
    assert row["first_step"]["declared"] == [["all_reduce", numel * 8]]
    est = prog.estimate()
    assert est.ranks[0].comm_bytes == pytest.approx((whole + P + Q) * 8, rel=1e-12)
    # fxpar's PowerSGD with the same options sends the same bytes
    own = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=loss_fn, optimizer=SGD,
                            strategy=fxpar.Strategy(dp=2, grad_sync=C.PowerSGD(rank=2, start_iter=2,
                                                                               min_compression_rate=1.0)))
    assert own.estimate().ranks[0].comm_bytes == pytest.approx(est.ranks[0].comm_bytes, rel=1e-12)


@STRUCTURE
@pytest.mark.filterwarnings("ignore:.*worth compressing:UserWarning")
@pytest.mark.parametrize("rank, rate, feedback", [(1, 2.0, True), (2, 1.0, True), (2, 1.0, False), (4, 0.5, True)])
def test_powerSGD_hook_compute_is_counted_from_torchs_own_code(rank, rate, feedback):
    """The plan prices torch's powerSGD_hook by running it (on meta tensors, against a group that moves nothing) and
    counting its ops: its collectives are the formula's; its matmuls, per compressed n x m gradient at rank r, are
    P = M Q and Q = M^T P (2 n m r FLOPs each, r output columns: ``matmul_narrow``) and P Q^T (2 n m r, ``matmul``);
    before start_powerSGD_iter it scales the bucket and divides the all-reduced one (N FLOPs each). The hook's own
    state and the process's random state are untouched."""
    state = psgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=3, min_compression_rate=rate,
                               use_error_feedback=feedback, warm_start=True)
    m, info = DDPHook(psgd.powerSGD_hook, state), _info()
    rng = torch.get_rng_state()
    (ops, flops, nbytes, classes), sent = m.dry_run(info, "powersgd")
    assert torch.equal(torch.get_rng_state(), rng)          # the hook's draws leave the process's generator alone
    assert sent == m.collectives(info, "powersgd")
    narrow = wide = 0               # P Q^T is n x m: narrow too where m <= NARROW_COLUMNS
    for sh in SHAPES:
        n = sh[0]
        cols = math.prod(sh) // n
        r = min(n, cols, rank)
        if (n + cols) * r * rate < n * cols:
            narrow += 4 * n * cols * r
            if cols <= NARROW_COLUMNS:
                narrow += 2 * n * cols * r
            else:
                wide += 2 * n * cols * r
    by = {k: (f, b) for k, f, b in classes}
    assert narrow > 0 and by["matmul_narrow"][0] == narrow and by.get("matmul", (0,))[0] == wide
    assert flops == sum(f for _, f, _ in classes) and nbytes == sum(b for _, _, b in classes) and ops > 0
    assert m.eager_sum_compute(info, "powersgd") == (ops, flops, nbytes, classes)
    (ops0, flops0, _, classes0), sent0 = m.dry_run(info, "allreduce")
    assert sent0 == m.collectives(info, "allreduce") == [("all_reduce", 8 * info.numel)]
    assert flops0 == 2 * info.numel and {k for k, _, _ in classes0} <= {"elementwise", "view"}
    assert state.iter == 0 and not state.error_dict and not state.p_memory_dict and not state.q_memory_dict


@STRUCTURE
def test_torch_default_hooks_compute_is_counted():
    """allreduce_hook: the bucket scaled to DDP's units and the all-reduced bucket divided (N FLOPs each);
    fp16/bf16_compress_hook: also the casts to 2 bytes and back, and the all-reduce of the 2-byte copy. A hook of the
    user's own is not run (not counted: priced as a plain all-reduce)."""
    info = _info()
    n = info.numel
    (_, flops, _, classes), sent = DDPHook(dh.allreduce_hook).dry_run(info, None)
    assert sent == [("all_reduce", 8 * n)] and flops == 2 * n
    for hook in (dh.fp16_compress_hook, dh.bf16_compress_hook):
        (_, flops, nbytes, classes), sent = DDPHook(hook).dry_run(info, None)
        assert sent == [("all_reduce", 2 * n)] == DDPHook(hook).collectives(info, None)
        assert flops >= 2 * n and "copy" in {k for k, _, _ in classes}
    assert DDPHook(users_hook).dry_run(info, None) is None and DDPHook(users_hook).eager_sum_compute(info, None) is None


@STRUCTURE
@pytest.mark.filterwarnings("ignore:.*worth compressing:UserWarning")
def test_the_plan_prices_the_hooks_counted_compute():
    """A plan of DDPHook(powerSGD_hook) carries, per bucket, the compute dry_run counts (what estimate() prices)."""
    model, batches, loss_fn = _data("mlp")
    state = psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    hook = DDPHook(psgd.powerSGD_hook, state)
    prog = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=loss_fn, optimizer=SGD,
                             strategy=fxpar.Strategy(dp=2, grad_sync=hook))
    from fxpar.compress.feature import bucket_infos
    rows = prog.plan.section("ddp_hook").stages[0]
    infos = bucket_infos(prog.plan, 0, prog.stages[0].captured)
    assert rows and len(rows) == len(infos)
    for row, b in zip(rows, infos):
        ops, flops, nbytes, classes = hook.eager_sum_compute(b, "powersgd")
        assert row["compute"] == [ops, flops, nbytes]
        assert row["compute_classes"] == [[k, f, n] for k, f, n in classes]
