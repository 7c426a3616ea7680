"""ClusterSpec.host_memory_reuse: a rank keeps the memory a step frees instead of giving it back to the OS and
faulting it in again next step (fxpar.host.reuse_freed_memory, glibc's mmap and trim thresholds)."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.errors import ClusterSpecError
from fxpar.testing import max_abs_diff, reference_training

_MIB = 40                 # above the 32 MiB up to which glibc's own mmap threshold adjusts: with its defaults such a
                          # block is always a fresh mmap, and freeing it gives it back to the OS at once


def _kept_after_free(n: int = 3) -> float:
    """Of ``n`` buffers of ``_MIB`` MiB made, written and freed (as a step frees a large gradient, its bucket, an
    optimizer temporary), the fraction of their bytes this process still holds afterwards (resident set)."""
    import os
    page = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page
    r0 = rss()
    bufs = [torch.empty(_MIB * 2**20 // 4).fill_(1.0) for _ in range(n)]
    made = rss() - r0
    del bufs
    return (rss() - r0) / made


_PROBE = """
import json, sys
sys.path.insert(0, {root!r})
import torch
from tests.test_host_memory import _kept_after_free
if {reuse}:
    from fxpar.host import reuse_freed_memory
    assert reuse_freed_memory()
if {measure}:       # ClusterSpec.calibrate times an Executor in the caller's process: it must not set its allocator
    from fxpar.tools.runtime_cost import action_overhead_s
    action_overhead_s(steps=5)
print(json.dumps(_kept_after_free()))
"""


def _probe(reuse: bool, measure: bool = False) -> float:
    from pathlib import Path
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", _PROBE.format(root=root, reuse=reuse, measure=measure)], capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_reuse_freed_memory_keeps_what_a_step_frees():
    """With glibc's defaults a freed 40 MiB block goes back to the OS (its pages come back as page faults when the
    next step makes it again); after reuse_freed_memory() the process keeps it. (Blocks of 24 MiB, as the Bag's
    step of benchmarks/bench_param_server.py frees three of, go back or not depending on the heap's history; its
    ranks paid the faults in every run, 1.27-1.57x DDP's step, and 0.99-1.17x with this.)"""
    assert _probe(False) < 0.1
    assert _probe(True) > 0.9
    assert _probe(False, measure=True) < 0.1      # calibrate's in-process Executor leaves the caller's allocator be


@pytest.mark.structure
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


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_ranks_reuse_freed_memory_by_default_and_train_as_single_process(clusters):
    """The payload carries the setting; a rank's Executor applies it (fresh ranks keep what they free after a run);
    off, the ranks train the same."""
    model, batches = _model_and_batches()
    opt = (torch.optim.SGD, {"lr": 0.1})
    ref_losses, ref_state = reference_training(model, batches, F.cross_entropy, opt)
    for reuse in (True, False):
        spec = fxpar.ClusterSpec.local(2, host_memory_reuse=reuse)
        prog = fxpar.parallelize(model, spec, batches[0], F.cross_entropy, opt, strategy=fxpar.Strategy(dp=2))
        assert prog.payload(0).settings.host.host_memory_reuse is reuse
        if reuse:
            lc = fxpar.LocalCluster(2)                    # fresh processes: nothing applied before this program
            try:
                res = prog.run_local(batches, cluster=lc)
                kept = lc.run(_kept_after_free, [()] * 2)
            finally:
                lc.close()
            assert min(kept) > 0.9, kept                  # glibc's defaults: < 0.1 (the test above)
        else:
            res = prog.run_local(batches, cluster=clusters.get(2))
        assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
        assert max_abs_diff(res.state_dict(), ref_state) < 1e-10


def _frozen():
    import gc
    return gc.get_freeze_count()


@pytest.mark.numerics
def test_a_rank_keeps_what_it_inherits_out_of_its_collections(clusters):
    """A rank starts with the forkserver's objects (torch, fxpar) in the collector's permanent generation: its full
    collections walk only what the rank made, instead of touching, and so copying, every inherited page. (The
    generations the collector walks hold what the rank made since: how many depends on the tests it ran before.)"""
    for frozen in clusters.get(2).run(_frozen, [()] * 2):
        assert frozen > 100_000, frozen          # torch's and fxpar's objects, about 290,000 here; 0 without it
