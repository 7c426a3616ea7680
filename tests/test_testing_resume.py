"""fxpar.testing.resume: the checkpoint round trip the numerics tests share fails on a cut run that differs."""
from types import SimpleNamespace

import pytest
import torch

from fxpar.testing.resume import assert_resume_is_exact

pytestmark = pytest.mark.structure


class _Canned:
    """Stands in for a Program: run_local answers from a table keyed by the batches it is given."""

    def __init__(self, losses: dict, states: dict):
        self.losses, self.states, self.calls = losses, states, []

    def run_local(self, batches, cluster=None, save_to=None, resume_from=None):
        key = tuple(batches)
        self.calls.append((key, cluster, save_to, resume_from))
        return SimpleNamespace(losses=self.losses[key], state_dict=lambda: self.states[key])


def _program(second_loss=2.0, second_weight=1.0):
    w = {"w": torch.tensor([1.0])}
    return _Canned({(0, 1, 2): [1.0, 2.0, 3.0], (0,): [1.0], (1, 2): [second_loss, 3.0]},
                   {(0, 1, 2): w, (0,): {"w": torch.tensor([0.0])}, (1, 2): {"w": torch.tensor([second_weight])}})


def test_runs_whole_then_saves_at_k_and_resumes():
    prog = _program()
    whole, first, second = assert_resume_is_exact(prog, [0, 1, 2], 1, "lc", "ck")
    assert prog.calls == [((0, 1, 2), "lc", None, None), ((0,), "lc", "ck", None), ((1, 2), "lc", None, "ck")]
    assert (whole.losses, first.losses, second.losses) == ([1.0, 2.0, 3.0], [1.0], [2.0, 3.0])


def test_a_differing_loss_or_parameter_fails():
    with pytest.raises(AssertionError, match=r"losses cut at step 1: \[1.0\] \+ \[2.5, 3.0\]"):
        assert_resume_is_exact(_program(second_loss=2.5), [0, 1, 2], 1, "lc", "ck")
    with pytest.raises(AssertionError, match=r"parameters differ .* by up to 0.5"):
        assert_resume_is_exact(_program(second_weight=1.5), [0, 1, 2], 1, "lc", "ck")
    with pytest.raises(ValueError, match=r"k=3.*0 < k < 3"):
        assert_resume_is_exact(_program(), [0, 1, 2], 3, "lc", "ck")
