import pytest

import fxpar
from fxpar import ClusterSpec, ClusterSpecError

pytestmark = pytest.mark.structure


def test_local_and_json_round_trip(tmp_path):
    spec = ClusterSpec.local(4)
    assert spec.world_size == 4 and spec.backend == "gloo"
    assert ClusterSpec.from_json(spec.to_json()) == spec
    path = tmp_path / "c.json"
    spec.to_json(str(path))
    assert ClusterSpec.from_json(str(path)) == spec


def test_presets_topology():
    spec = ClusterSpec.preset("a100-80gb", nodes=4, gpus_per_node=8)
    assert spec.world_size == 32 and spec.backend == "nccl"
    assert spec.link(0, 7) == spec.intra_node and spec.link(7, 8) == spec.inter_node
    assert spec.device.peak_flops == 312e12
    with pytest.raises(ClusterSpecError, match="unknown ClusterSpec preset 'tpu'"):
        ClusterSpec.preset("tpu")


def test_impossible_numbers_are_rejected():
    import dataclasses
    spec = ClusterSpec.local(2)
    with pytest.raises(ClusterSpecError, match=r"intra_node.bandwidth=0.*positive bandwidth"):
        dataclasses.replace(spec, intra_node=fxpar.LinkSpec(0, 1e-6))
    with pytest.raises(ClusterSpecError, match=r"device.memory_bytes=0"):
        dataclasses.replace(spec, device=dataclasses.replace(spec.device, memory_bytes=0))
    with pytest.raises(ClusterSpecError, match=r"world_size must be a positive int"):
        ClusterSpec.local(0)
    with pytest.raises(ClusterSpecError, match=r"device.index_row_s=-1e-07: must be >= 0 seconds"):
        dataclasses.replace(spec, device=dataclasses.replace(spec.device, index_row_s=-1e-7))
    rows = dataclasses.replace(spec, device=dataclasses.replace(spec.device, index_row_s=2e-7))
    assert ClusterSpec.from_json(rows.to_json()) == rows and ClusterSpec.from_json(rows.to_json()).device.index_row_s == 2e-7
    small = dataclasses.replace(spec, device=dataclasses.replace(spec.device, memory_bytes=1024))
    with pytest.raises(ClusterSpecError, match=r"embedding needs 4096 bytes.*1024 bytes"):
        small.check_fits(4096, "embedding")


def test_device_smaller_than_a_parameter_is_refused_at_parallelize():
    import dataclasses

    import torch
    import torch.nn.functional as F
    spec = ClusterSpec.local(1)
    tiny = dataclasses.replace(spec, device=dataclasses.replace(spec.device, memory_bytes=1000))
    model = torch.nn.Linear(64, 8)
    with pytest.raises(ClusterSpecError, match=r"parameter 'weight' of Linear \(shape \(8, 64\)\) needs 2048 bytes.*1000 bytes"):
        fxpar.parallelize(model, tiny, (torch.randn(2, 64), torch.randn(2, 8)), loss_fn=F.mse_loss)
