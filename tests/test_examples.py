"""The examples a newcomer starts from keep running and keep saying what they claim.

One Python process (``RUNNER``) runs every example in turn as ``python examples/<name>.py ARGS`` would (``runpy``
with ``__name__ == "__main__"`` and that ``sys.argv``): torch, fxpar and the forkserver ranks start from are loaded
once instead of once per example. Each example's printed text and any traceback are kept apart, a feature an
example registers is unregistered before the next one, and each test below checks its own example's text and names
it when it failed."""
import json
import pytest
import re
import subprocess
import sys
from pathlib import Path

pytestmark = [pytest.mark.numerics,
              # one worker runs the file (`--dist loadgroup`): the examples run in one process, once
              pytest.mark.xdist_group("examples")]

ROOT = Path(__file__).resolve().parent.parent

# example -> its command-line arguments (the other modes of tensor_parallel.py: test_tensor_parallel)
EXAMPLES = {
    "quickstart": ["--steps", "3"],
    "custom_pass": [],
    "pipeline": ["--steps", "2", "--show-graphs"],
    "hf_gpt2": [],
    "zero": ["--steps", "2"],
    "tensor_parallel": ["--steps", "2", "--mode", "megatron"],
    "custom_strategy": [],
    "compression": ["--steps", "5"],
}

RUNNER = r"""
import contextlib, io, json, runpy, sys, traceback
examples, out = json.loads(sys.argv[1]), {}
for name, args in examples.items():
    path, text = f"examples/{name}.py", io.StringIO()
    argv, path0 = sys.argv, list(sys.path)
    before = None
    try:
        from fxpar.feature import registered_features
        before = {f.name for f in registered_features()}
        sys.argv = [path, *args]
        with contextlib.redirect_stdout(text):
            runpy.run_path(path, run_name="__main__")
        error = None
    except BaseException:               # SystemExit included: argparse's, or the example's own
        error = traceback.format_exc()
    finally:
        sys.argv, sys.path[:] = argv, path0
        if before is not None:
            from fxpar.feature import registered_features, unregister_feature
            for f in registered_features():
                if f.name not in before:
                    unregister_feature(f.name)
    out[name] = {"stdout": text.getvalue(), "error": error}
print(json.dumps(out))
"""


_RAN: dict = {}      # the run's output, kept for the process: a worker that runs this module's tests in two parts
                     # (pytest-xdist may hand it other tests between them, which ends the module fixture) runs it once


@pytest.fixture(scope="module")
def examples():
    """Each example's printed text, or its traceback, from one run of RUNNER over EXAMPLES."""
    if "out" not in _RAN:
        _RAN["out"] = _run_examples()
    return _RAN["out"]


def _run_examples() -> dict:
    try:
        import transformers  # noqa: F401
        todo = EXAMPLES
    except ImportError:
        todo = {k: v for k, v in EXAMPLES.items() if k != "hf_gpt2"}
    out = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(todo)], capture_output=True, text=True,
                         timeout=240 * len(todo), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _text(examples, name):
    got = examples[name]
    assert got["error"] is None, f"examples/{name}.py {' '.join(EXAMPLES[name])} failed:\n{got['error'][-3000:]}"
    return got["stdout"]


@pytest.mark.slow
def test_quickstart_trains_and_matches_pytorch(examples):
    text = _text(examples, "quickstart")
    # explain() is one text for every strategy now; its "collectives per step" section became
    # "communication per step on rank 0" (collectives, and for pipelines the sends and receives)
    assert "plan:" in text and "communication per step" in text and "estimated step time" in text
    losses = [float(x) for x in re.findall(r"step \d: loss ([0-9.]+)", text)]
    assert len(losses) == 3
    loss_diff = float(re.search(r"largest loss difference ([0-9.e+-]+)", text).group(1))
    assert loss_diff < 1e-5


@pytest.mark.slow
def test_custom_pass_example_shows_its_nodes(examples):
    text = _text(examples, "custom_pass")
    assert "clip_grad_values" in text and "aten.clamp.default" in text and "losses:" in text


@pytest.mark.slow
def test_pipeline_example_trains_through_parallelize_and_matches_pytorch(examples):
    text = _text(examples, "pipeline")
    assert "schedule 1f1b" in text and "# ---- stage0.F (rank 0) ----" in text and "# ---- stage0.B (rank 0) ----" in text
    assert len(re.findall(r"step \d: loss [0-9.]+", text)) == 2
    m = re.search(r"max \|loss - single-process\| = ([0-9.e+-]+), max \|param - single-process\| = ([0-9.e+-]+)", text)
    assert m and float(m.group(1)) < 1e-10 and float(m.group(2)) < 1e-10      # float64: synchronous 1F1B is exact


@pytest.mark.slow
def test_hugging_face_example_trains_gpt2_as_a_pipeline(examples):
    pytest.importorskip("transformers")
    text = _text(examples, "hf_gpt2")
    pairs = re.findall(r"step \d: fxpar loss ([0-9.]+)\s+single-process loss ([0-9.]+)", text)
    assert len(pairs) == 4 and "RG0 STEP0" in text
    # float32 (as the model is built): the two agree to the printed 6 decimals, up to rounding of the last one
    assert max(abs(float(a) - float(b)) for a, b in pairs) <= 2e-6


@pytest.mark.slow
def test_zero_example_holds_what_the_formulas_say_and_matches_pytorch(examples):
    text = _text(examples, "zero")
    rows = re.findall(r"ZeRO-(\d): rank 0 holds .* = (\d+) B \(formula (\d+) B\); max \|loss - single-process\| = "
                      r"([0-9.e+-]+), max \|param - single-process\| = ([0-9.e+-]+)", text)
    assert [r[0] for r in rows] == ["1", "2", "3"]
    for _, held, formula, dloss, dparam in rows:
        assert held == formula and float(dloss) < 1e-10 and float(dparam) < 1e-10
    disk = re.search(r"ZeRO-3 with parameters and optimizer state in files .*: (\d+) B on disk per rank; "
                     r"max \|param - single-process\| = ([0-9.e+-]+)", text)
    assert disk and int(disk.group(1)) > 0 and float(disk.group(2)) < 1e-10


@pytest.mark.slow
def test_tensor_parallel_example_splits_and_matches_pytorch(examples):
    text = _text(examples, "tensor_parallel")
    rows = re.findall(r"== Strategy\((.*?)\): (\d+) parameters split.*\n.*tp collectives per step: (.*)\n.*"
                      r"max \|loss - single-process\| = ([0-9.e+-]+), max \|param - single-process\| = ([0-9.e+-]+)", text)
    assert len(rows) == 1, text
    for _, n_split, comm, dloss, dparam in rows:
        assert int(n_split) > 0 and float(dloss) < 1e-10 and float(dparam) < 1e-10
    assert "forward all_reduce" in rows[0][2]          # the Megatron preset's row-parallel all-reduce


@pytest.mark.slow
def test_custom_strategy_example_matches_its_reference(examples):
    text = _text(examples, "custom_strategy")
    assert "ef16:" in text and "error_feedback_sum" in text
    got = [float(x) for x in re.search(r"losses    : \[(.*)\]", text).group(1).split(",")]
    ref = [float(x) for x in re.search(r"reference : \[(.*)\]", text).group(1).split(",")]
    assert len(got) == 4 and got == ref


@pytest.mark.slow
def test_compression_example_sends_what_explain_says(examples):
    text = _text(examples, "compression")
    # explain(): PowerSGD's bucket sends P, Q and the whole tensors once it starts, a plain all-reduce before; TopK's
    # bucket one all-gather of its pairs
    psgd, plain = map(int, re.search(r"powersgd:\n(?:.*\n)*?.*wire_bytes=(\d+) .*\n.*until the method starts: "
                                     r"wire_bytes=(\d+)", text).groups())
    topk = int(re.search(r"topk:\n(?:.*\n)*?.*wire_bytes=(\d+) \(all_gather", text).group(1))
    assert psgd < plain / 4 and topk < plain / 4
    rows = re.findall(r"^\s*(\d+) \|" + r"\s+([0-9.]+)\s+([0-9,]+) \|" * 2 + r"\s+([0-9.]+)\s+([0-9,]+)$", text, re.M)
    assert [int(r[0]) for r in rows] == list(range(5))
    loss = [[float(r[i]) for r in rows] for i in (1, 3, 5)]
    sent = [[int(r[i].replace(",", "")) for r in rows] for i in (2, 4, 6)]
    # measured on the ranks, per step: the bytes explain() gives
    assert sent == [[plain] * 5, [plain] * 3 + [psgd] * 2, [topk] * 5]
    # PowerSGD sums plainly until start_iter=3: the losses of steps 0-3 are plain dp's; TopK's first loss too
    assert loss[1][:4] == loss[0][:4] and loss[2][0] == loss[0][0]
    assert loss[1][4] != loss[0][4] and f"({plain / psgd:.1f}x fewer)" in text
