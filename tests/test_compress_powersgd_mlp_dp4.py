"""PowerSGD against torch's ``powerSGD_hook`` on the MLP at dp=4 (float64), beside the GPT cases of
``tests/test_compress_powersgd.py``: the bucket sums on a real 4-rank gloo group for rank 1 and 2, with and without
error feedback and warm start (start_iter > 1), and ``run_local`` against DDP with the hook, to 1e-10."""
import pytest
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from fxpar.compress.powersgd import PowerSGD
from test_compress_powersgd import (CASES, SGD, _versus_torch, assert_equals_ddp, ddp_with_hook, model_and_data,
                                    program, state_opts)


@pytest.mark.numerics
@pytest.mark.slow
def test_mlp_bucket_sums_equal_torch_powerSGD_hook_4_ranks(clusters):
    """CASES[:5]: rank 1 and 2; error feedback and warm start on, off and each alone; start_iter 2 and 3 (and 1
    without memory, where torch allows it)."""
    for opts in CASES[:5]:
        for diff, size, off_mean in clusters.get(4).run(_versus_torch, [(opts, "mlp", 2, 5)] * 4):
            assert diff <= 1e-10 * max(1.0, size), (opts, diff)
            assert off_mean > 1e-3, opts          # compression really changed the sum


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("method", [PowerSGD(rank=1, start_iter=2),
                                    PowerSGD(rank=2, start_iter=3, error_feedback=False, warm_start=False,
                                             min_compression_rate=1.0)],
                         ids=["r1-ef-ws", "r2-no-memory"])
def test_mlp_run_local_equals_ddp_with_powerSGD_hook_4_ranks(clusters, method):
    model, batches, loss_fn = model_and_data("mlp", 5)
    res = program(model, batches, loss_fn, method, dp=4).run_local(batches, cluster=clusters.get(4))
    ddp = clusters.get(4).run(ddp_with_hook, [(model, batches, loss_fn, SGD, psgd.powerSGD_hook,
                                               state_opts(method))] * 4)
    assert_equals_ddp(res, ddp)
    plain = clusters.get(4).run(ddp_with_hook, [(model, batches, loss_fn, SGD, allreduce_hook, None)] * 4)
    assert max(abs(a - b) for a, b in zip(res.losses, plain[0]["losses"])) > 1e-8   # compression changed the run
