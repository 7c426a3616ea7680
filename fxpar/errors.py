"""Errors fxpar raises. Each names the user's module, node, shape or setting and says what to do."""

__all__ = ["FxparError", "CaptureError", "StrategyError", "ClusterSpecError", "PassError", "RankFailedError",
           "InputError", "NonFiniteLossError"]


class FxparError(Exception):
    """Base class of every error fxpar raises on purpose."""


class CaptureError(FxparError):
    """The model, loss or optimizer could not be captured as a training-step graph."""


class StrategyError(FxparError, ValueError):
    """The Strategy does not fit the model, the batch or the cluster."""


class ClusterSpecError(FxparError, ValueError):
    """A ClusterSpec holds impossible or inconsistent numbers."""


class InputError(FxparError, ValueError, TypeError):
    """An argument the user passed (a batch, example_inputs, the optimizer, an option) is malformed or does
    not match what the program was built for. Raised before any rank starts. A ValueError and a TypeError,
    so code that caught torch's or Python's own errors for these keeps working."""


class PassError(FxparError):
    """A pass failed, or left a graph that does not pass the checks."""


class RankFailedError(FxparError, RuntimeError):
    """A rank of a distributed run raised; carries that rank's traceback."""

    def __init__(self, rank: int, traceback_text: str):
        self.rank = rank
        self.traceback_text = traceback_text
        super().__init__(f"rank {rank} failed; every other rank was stopped. Its traceback:\n{traceback_text}")


class NonFiniteLossError(FxparError, FloatingPointError):
    """``run_local(on_nonfinite="raise")``: a step's loss was NaN or infinite; names the step and the ranks."""

    def __init__(self, message: str, step: int, ranks: list):
        self.step, self.ranks = step, list(ranks)
        super().__init__(message)
