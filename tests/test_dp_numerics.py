"""Numerics tier: dp ranks on gloo reproduce single-process training on the global batch (DESIGN §5)."""
import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.testing import CNN, GPT, MLP, BNConvNet, ddp_reference, ddp_worker, gpt_loss, max_abs_diff, reference_training

pytestmark = pytest.mark.numerics

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})


def _data(kind, batch, dtype, steps=3):
    if kind == "mlp":
        return [(torch.randn(batch, 16, dtype=dtype), torch.randn(batch, 8, dtype=dtype)) for _ in range(steps)]
    if kind in ("cnn", "bn"):
        return [(torch.randn(batch, 3, 8, 8, dtype=dtype), torch.randint(0, 10, (batch,))) for _ in range(steps)]
    return [(torch.randint(0, 64, (batch, 16)), torch.randint(0, 64, (batch, 16))) for _ in range(steps)]


MODELS = {"mlp": (MLP, F.mse_loss), "cnn": (CNN, F.cross_entropy), "gpt": (GPT, gpt_loss)}


def _run(clusters, model, batches, loss_fn, opt, dp, **kw):
    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(dp), batches[0], loss_fn=loss_fn, optimizer=opt,
                                strategy=fxpar.Strategy(dp=dp, **kw))
    return program, program.run_local(batches, cluster=clusters.get(dp))


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("opt", [SGD_M, ADAMW], ids=["sgd_momentum", "adamw"])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "gpt"])
def test_dp_float64_matches_single_process(clusters, kind, opt, dp):
    cls, loss_fn = MODELS[kind]
    model = cls().double()
    batches = _data(kind, 8, torch.float64)
    _, res = _run(clusters, model, batches, loss_fn, opt, dp, bucket_cap_mb=0.01)
    ref_losses, ref_state = reference_training(model, batches, loss_fn, opt)
    assert len(res.losses) == 3
    for a, b in zip(res.losses, ref_losses):
        assert abs(a - b) <= 1e-10 * max(1.0, abs(b))
    assert max_abs_diff(res.state_dict(), ref_state) <= 1e-10


def test_gpt_float32_dp2_sgd_momentum(clusters):
    model = GPT()
    batches = _data("gpt", 8, torch.float32)
    _, res = _run(clusters, model, batches, gpt_loss, SGD_M, 2)
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, SGD_M)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    got = res.state_dict()
    assert got.keys() == ref_state.keys()
    for k in ref_state:
        torch.testing.assert_close(got[k], ref_state[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_gpt_float32_dp2_adamw_matches_torch_ddp(clusters):
    """float32 AdamW: fxpar equals torch DDP (same shards, same all_reduce) to rtol 1e-5 everywhere.

    Against single-process training the losses agree to rtol 1e-5 but a few parameter elements do
    not: where a gradient element is cancellation-dominated (|g| near Adam's eps), any change of
    summation order (DDP's too) moves g by ~1e-7 relative and Adam normalises that into a visible
    step. The test measures that DDP shows the same gap, so the gap is float32's, not fxpar's.
    """
    model = GPT(qkv_bias=False)   # the key bias's gradient is exactly 0 in exact arithmetic: pure noise
    batches = _data("gpt", 8, torch.float32)
    _, res = _run(clusters, model, batches, gpt_loss, ADAMW, 2)
    ddp = clusters.get(2).run(ddp_worker, [(model, batches, gpt_loss, ADAMW)] * 2)[0]
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, ADAMW)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ddp["losses"]), rtol=1e-5, atol=0)
    got = res.state_dict()
    for k in ref_state:
        torch.testing.assert_close(got[k], ddp["state"][k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    ours = max_abs_diff(got, ref_state)
    theirs = max_abs_diff(ddp["state"], ref_state)
    assert ours <= 2 * theirs + 1e-6, f"fxpar is {ours:.3g} from single-process, DDP {theirs:.3g}"


def test_tied_weights_stay_tied(clusters):
    model = GPT().double()
    batches = _data("gpt", 4, torch.float64)
    program, res = _run(clusters, model, batches, gpt_loss, ADAMW, 2)
    sd = res.state_dict()
    assert torch.equal(sd["head.weight"], sd["wte.weight"])
    assert program.captured.aliases == {"head.weight": "wte.weight"}
    assert "head.weight" not in program.captured.param_names


def test_batchnorm_follows_ddp_semantics(clusters):
    """Per-rank batch statistics; dp-rank 0's running stats kept (DDP broadcast_buffers=True)."""
    model = BNConvNet().double()
    batches = _data("bn", 8, torch.float64)
    _, res = _run(clusters, model, batches, F.cross_entropy, SGD_M, 2)
    ref_losses, ref_state = ddp_reference(model, batches, F.cross_entropy, SGD_M, dp=2)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) <= 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) <= 1e-10
    # and it is not global-batch BatchNorm: the single-process reference differs
    _, global_state = reference_training(model, batches, F.cross_entropy, SGD_M)
    assert max_abs_diff(res.state_dict(), global_state) > 1e-6


def test_untraced_optimizer_runs_eagerly(clusters):
    opt = (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5})
    model = MLP().double()
    batches = _data("mlp", 8, torch.float64)
    program, res = _run(clusters, model, batches, F.mse_loss, opt, 2)
    assert not program.captured.optimizer.traced
    assert "RMSprop runs eagerly" in program.explain()
    ref_losses, ref_state = reference_training(model, batches, F.mse_loss, opt)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) <= 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) <= 1e-10


def test_lr_scheduler_drives_traced_optimizer(clusters):
    sched = (torch.optim.lr_scheduler.StepLR, {"step_size": 1, "gamma": 0.5})
    model = MLP().double()
    batches = _data("mlp", 8, torch.float64, steps=4)
    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=F.mse_loss, optimizer=SGD_M,
                                strategy=fxpar.Strategy(dp=2), lr_scheduler=sched)
    res = program.run_local(batches, cluster=clusters.get(2))
    ref_losses, ref_state = reference_training(model, batches, F.mse_loss, SGD_M, lr_scheduler=sched)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) <= 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) <= 1e-10


def test_model_returning_its_loss(clusters):
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = MLP()

        def forward(self, x, y):
            return F.mse_loss(self.net(x), y)

    model = WithLoss().double()
    batches = _data("mlp", 8, torch.float64)
    _, res = _run(clusters, model, batches, None, SGD_M, 2)
    ref_losses, ref_state = reference_training(model, batches, None, SGD_M)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) <= 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) <= 1e-10


def test_unpicklable_scheduler_is_refused_before_spawning():
    model = MLP()
    batches = _data("mlp", 8, torch.float32, steps=1)
    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=F.mse_loss, optimizer=SGD_M,
                                lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    with pytest.raises(TypeError, match=r"cannot be sent to the spawned ranks.*StepLR"):
        program.run_local(batches)


def test_dropout_follows_ddp_with_per_rank_seeds(clusters):
    """Dropout under dp: run_local(seed=s) seeds rank r with s + r, so each dp rank draws its own
    masks, reproducibly. That is torch DDP with torch.manual_seed(s + rank) in each process: the
    two agree to 1e-10 in float64 (the captured graph draws its masks exactly as eager dropout)."""
    torch.manual_seed(0)
    model = GPT(dropout=0.2).double()
    x = torch.randint(0, 64, (2, 16))
    batches = [(torch.cat([x, x]), torch.cat([x, x]))] * 3      # both dp shards see the same tokens
    p = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=gpt_loss, optimizer=ADAMW,
                          strategy=fxpar.Strategy(dp=2))
    assert any(n.target is torch.ops.aten.bernoulli.p for n in p.graphs(0)["step"].graph.nodes)
    res = p.run_local(batches, cluster=clusters.get(2), seed=7)
    ddp = clusters.get(2).run(ddp_worker, [(model, batches, gpt_loss, ADAMW, 25.0, 0, 7)] * 2)[0]
    assert max(abs(a - b) for a, b in zip(res.losses, ddp["losses"])) <= 1e-10
    assert max_abs_diff(res.state_dict(), ddp["state"]) <= 1e-10
    # same tokens on both ranks, different losses: the ranks' masks differ
    assert all(abs(a - b) > 1e-6 for a, b in zip(res.per_rank_losses[0], res.per_rank_losses[1]))
    again = p.run_local(batches, cluster=clusters.get(2), seed=7)
    other = p.run_local(batches, cluster=clusters.get(2), seed=8)
    assert again.losses == res.losses and other.losses != res.losses
