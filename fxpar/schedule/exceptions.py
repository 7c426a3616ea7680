"""Errors of the pipeline schedule IR: bad arguments, malformed schedules, deadlocks."""
from __future__ import annotations

from fxpar.errors import FxparError

__all__ = ["ScheduleError", "ScheduleParseError", "ScheduleValidationError", "ScheduleDeadlockError"]


class ScheduleError(FxparError, ValueError):
    """A schedule cannot be built for these arguments (e.g. ``interleaved`` with m not a multiple of p)."""


class ScheduleParseError(ScheduleError):
    """A piece of schedule text does not follow the grammar in :mod:`fxpar.schedule.ir`."""


class ScheduleValidationError(ScheduleError):
    """A schedule breaks a structural rule: a missing F/B, an unmatched SEND/RECV, a bad version."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        shown = "\n  ".join(self.problems[:20])
        more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
        super().__init__(f"schedule is invalid ({len(self.problems)} problem(s)):\n  {shown}{more}")


class ScheduleDeadlockError(ScheduleError):
    """The simulator found ranks that wait forever.

    ``stuck`` maps each blocked rank to ``(step, action, reason)``: the index of the action in
    that rank's list, the action itself, and why it can never run.
    """

    def __init__(self, message: str, stuck: dict):
        self.stuck = dict(stuck)
        self.step = min(step for step, _, _ in self.stuck.values()) if self.stuck else None
        super().__init__(message)
