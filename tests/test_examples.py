"""The examples a newcomer starts from keep running and keep saying what they claim."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args, timeout=240):
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_quickstart_trains_and_matches_pytorch():
    text = _run("examples/quickstart.py", "--steps", "3")
    assert "plan:" in text and "collectives per step" in text and "estimated step time" in text
    losses = [float(x) for x in re.findall(r"step \d: loss ([0-9.]+)", text)]
    assert len(losses) == 3
    loss_diff = float(re.search(r"largest loss difference ([0-9.e+-]+)", text).group(1))
    assert loss_diff < 1e-5


def test_custom_pass_example_shows_its_nodes():
    text = _run("examples/custom_pass.py")
    assert "clip_grad_values" in text and "aten.clamp.default" in text and "losses:" in text
