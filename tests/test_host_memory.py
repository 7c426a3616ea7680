"""ClusterSpec.host_memory_reuse: a rank keeps the memory a step frees instead of faulting it in again next step
(fxpar.host.reuse_freed_memory, glibc's mmap and trim thresholds)."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.errors import ClusterSpecError
from fxpar.testing import max_abs_diff, reference_training

_N = 200_000 * 32              # a [200000, 32] fp32 table: its gradient is 24.4 MiB
_PAGES = _N * 4 // 4096         # one such buffer's pages


def _fault_rounds(rounds: int = 6) -> list:
    """Minor page faults of each round of the Bag's all-reduce step (benchmarks/bench_param_server.py) as its
    graph allocates: the table's dense gradient (zeros), its bucket (a copy), the SGD step's temporary ``lr·g``,
    a few small tensors; every one freed by the round's end."""
    import resource
    w, lr, out = torch.zeros(_N), torch.tensor(0.1), []
    for _ in range(rounds):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        small = [torch.ones(1000) for _ in range(20)]
        g = torch.zeros(_N)
        bucket = torch.empty(_N).copy_(g)
        del g
        step = torch._foreach_mul([bucket], lr)
        torch._foreach_sub_([w], step)
        del step, small, bucket
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return out


_PROBE = """
import json, sys
sys.path.insert(0, {root!r})
import torch
from tests.test_host_memory import _fault_rounds
from fxpar.host import reuse_freed_memory
assert reuse_freed_memory()
print(json.dumps(_fault_rounds()))
"""


def _probe() -> list:
    from pathlib import Path
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", _PROBE.format(root=root)], capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_reuse_freed_memory_keeps_the_pages_a_step_freed():
    """After reuse_freed_memory(), from the third step of that pattern on, no page is faulted in again. (With glibc's
    defaults how many are depends on the heap's history: 12468 of the 18750 pages every step in one process here,
    none after the third step in a fresh virtualenv; the Bag's step of benchmarks/bench_param_server.py paid them
    in every run, 1.27-1.57x DDP's step, and 0.99-1.17x with this.)"""
    reused = _probe()
    assert max(reused[2:]) < 0.05 * _PAGES, (reused, _PAGES)


def test_host_memory_reuse_round_trips_and_is_checked():
    spec = fxpar.ClusterSpec.local(2)
    assert spec.host_memory_reuse is True
    off = fxpar.ClusterSpec.local(2, host_memory_reuse=False)
    assert fxpar.ClusterSpec.from_json(off.to_json()).host_memory_reuse is False
    older = json.loads(spec.to_json())
    del older["host_memory_reuse"]                       # a ClusterSpec written before the field: the default
    assert fxpar.ClusterSpec.from_json(json.dumps(older)).host_memory_reuse is True
    assert "host_memory_reuse=False" in str(off) and "host_memory_reuse" not in str(spec)   # explain()'s cluster line
    assert "comm_priority" in str(fxpar.ClusterSpec.local(2, comm_priority=True)) and "comm_priority" not in str(spec)
    with pytest.raises(ClusterSpecError, match=r"host_memory_reuse=1.*True"):
        fxpar.ClusterSpec.local(2, host_memory_reuse=1)
    bad = json.loads(spec.to_json())
    bad["host_memory_reuse"] = "no"
    with pytest.raises(ClusterSpecError, match="host_memory_reuse"):
        fxpar.ClusterSpec.from_json(json.dumps(bad))


def _model_and_batches():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 8), torch.nn.Flatten(), torch.nn.Linear(32, 3)).double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 300, (8, 4), generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    return model, batches


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_ranks_reuse_freed_memory_by_default_and_train_as_single_process(clusters):
    """The payload carries the setting; a rank's Executor applies it (on fresh ranks: later steps take no page
    faults for the buffers the earlier ones freed); off, the ranks train the same."""
    model, batches = _model_and_batches()
    opt = (torch.optim.SGD, {"lr": 0.1})
    ref_losses, ref_state = reference_training(model, batches, F.cross_entropy, opt)
    for reuse in (True, False):
        spec = fxpar.ClusterSpec.local(2, host_memory_reuse=reuse)
        prog = fxpar.parallelize(model, spec, batches[0], F.cross_entropy, opt, strategy=fxpar.Strategy(dp=2))
        assert prog.payload(0).extra["host_memory_reuse"] is reuse
        if reuse:
            lc = fxpar.LocalCluster(2)                    # fresh processes: nothing applied before this program
            try:
                res = prog.run_local(batches, cluster=lc)
                faults = lc.run(_fault_rounds, [()] * 2)
            finally:
                lc.close()
            assert all(max(f[2:]) < 0.05 * _PAGES for f in faults), faults
        else:
            res = prog.run_local(batches, cluster=clusters.get(2))
        assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
        assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
