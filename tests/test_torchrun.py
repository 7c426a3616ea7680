"""The torchrun (env://) path: the example script under torch.distributed.run equals single-process."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxpar.testing import GPT, gpt_loss, reference_training

pytestmark = pytest.mark.numerics

ROOT = Path(__file__).resolve().parent.parent


def _run_example(nproc: int, *args) -> dict:
    """torchrun the example on ``nproc`` processes; its printed lines by their first word."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                          str(ROOT / "examples" / "torchrun_train.py"), "--steps", "3", *args],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(line.split(" ", 1) for line in out.stdout.splitlines()
                if line.startswith(("losses", "checksum", "served", "server_losses")))


def _assert_single_process(lines: dict) -> None:
    losses = [float(x) for x in lines["losses"].split()]
    assert len(losses) == 3
    torch.manual_seed(0)
    model = GPT().double()
    batches = [(torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))) for _ in range(3)]
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, (torch.optim.AdamW, {"lr": 1e-2}))
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-10
    checksum = sum(float(v.double().sum()) for v in ref_state.values())
    assert abs(float(lines["checksum"]) - checksum) <= 1e-8
    return ref_state


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_torchrun_two_ranks_match_single_process(tp):
    _assert_single_process(_run_example(2, "--tp", str(tp)))


@pytest.mark.slow
def test_torchrun_byteps_two_workers_and_a_cpu_server_match_single_process(tmp_path):
    """3 processes, dp=2 + 1 BytePS server (rank 2): the unchanged loop on every rank equals one process, and the
    server summed each of the 3 steps (the go and the workers' pushes arrived at it); the checkpoint every rank
    saves is the workers' (world 2) and holds the single-process state."""
    from fxpar.runtime.checkpoint import load_checkpoint, read_manifest
    from fxpar.testing import max_abs_diff
    lines = _run_example(3, "--cpu-servers", "1", "--save", str(tmp_path / "ckpt"))
    ref_state = _assert_single_process(lines)
    manifest = read_manifest(tmp_path / "ckpt")
    assert manifest["world_size"] == 2
    saved, _ = load_checkpoint(tmp_path / "ckpt", {k: torch.empty_like(v) for k, v in ref_state.items()},
                               rank=0, world_size=1)
    assert max_abs_diff(saved, ref_state) < 1e-10
    served = [int(x) for x in lines["served"].split()]
    assert len(served) == 3 and len(set(served)) == 1 and served[0] > 2 * 8      # more than the two go flags
    assert lines["server_losses"] == lines["losses"]


FAILING = '''
import os, sys, torch
sys.path.insert(0, {root!r})
import fxpar
from fxpar.testing import MLP
import torch.nn.functional as F
x, y = torch.randn(8, 16), torch.randn(8, 8)
program = fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(2), (x, y), loss_fn=F.mse_loss,
                            strategy=fxpar.Strategy(dp=2))
runner = program.runner()
runner.step((x, y))
if runner.rank == 1:
    raise RuntimeError("boom on rank 1")
runner.step((x, y))        # rank 0 blocks here on rank 1's all_reduce until torchrun stops it
'''


@pytest.mark.slow
def test_torchrun_rank_failure_stops_everyone_quickly(tmp_path):
    """A rank that raises exits at once (no wait at exit for the others), so torchrun reports it
    and stops the rest, instead of everyone hanging until the gloo timeout."""
    import time
    script = tmp_path / "fail.py"
    script.write_text(FAILING.format(root=str(ROOT)))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    took = time.monotonic() - t0
    assert out.returncode != 0
    assert "boom on rank 1" in out.stderr
    assert took < 90, f"torchrun took {took:.0f}s to stop after a rank failed"
