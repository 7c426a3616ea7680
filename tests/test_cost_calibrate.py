"""cost_models.calibrate: two gloo ranks on 127.0.0.1 give a valid ClusterSpec."""
import pytest

from cost_models.calibrate import fit_alpha_beta
from fxpar.cluster import ClusterSpec


def test_fit_recovers_ring_alpha_beta():
    n, alpha, bw = 4, 20e-6, 2e9
    sizes = [1e3, 1e5, 1e6, 1e7]
    times = [2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw for s in sizes]
    a, b = fit_alpha_beta(sizes, times, n)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)


@pytest.mark.slow
def test_calibrate_two_local_ranks():
    spec = ClusterSpec.calibrate(world_size=2, sizes=(4 << 10, 1 << 20, 4 << 20), reps=3)
    assert spec.world_size == 2 and spec.backend == "gloo"
    assert 1e8 < spec.intra_node.bandwidth < 1e12 and 0 <= spec.intra_node.latency < 5e-3
    assert 1e8 < spec.device.peak_flops < 1e13 and spec.device.mem_bandwidth > 1e8
    assert 0 < spec.device.efficiency["softmax"] <= 1 and spec.device.efficiency["matmul"] == 1.0
    assert ClusterSpec.from_json(spec.to_json()) == spec
