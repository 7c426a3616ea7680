"""The torchrun (env://) path: the example script under torch.distributed.run equals single-process."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxpar.testing import GPT, gpt_loss, reference_training

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tp", [1, 2])
def test_torchrun_two_ranks_match_single_process(tp):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "examples" / "torchrun_train.py"), "--steps", "3", "--tp", str(tp)],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("losses", "checksum")))
    losses = [float(x) for x in lines["losses"].split()]
    torch.manual_seed(0)
    model = GPT().double()
    batches = [(torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))) for _ in range(3)]
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, (torch.optim.AdamW, {"lr": 1e-2}))
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-10
    checksum = sum(float(v.double().sum()) for v in ref_state.values())
    assert abs(float(lines["checksum"]) - checksum) <= 1e-8


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
