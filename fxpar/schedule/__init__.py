"""fxpar's pipeline schedule IR: per-rank action lists that print, parse, validate and dry-run.

    >>> from fxpar.schedule import get_schedule, simulate
    >>> s = get_schedule("1f1b", p=2, m=4)
    >>> print(s.format_lists().splitlines()[1])
    rank 0: F0.0 SF0.0>1 F0.1 SF0.1>1 RB0.0<1 B0.0 F0.2 SF0.2>1 RB0.1<1 B0.1 F0.3 SF0.3>1 RB0.2<1 B0.2 RB0.3<1 B0.3 RG0 STEP0
    >>> round(simulate(s).bubble_fraction, 3)    # (p-1)/(m+p-1)
    0.2
    >>> print(get_schedule("single", p=1, m=1).format_lists().splitlines()[1])
    rank 0: FULL0.0

Modules: :mod:`.ir` (Action, Schedule, text grammar), :mod:`.synchronous` (the one-stage program,
GPipe, 1F1B, interleaved), :mod:`.zero_bubble` (ZB-H1), :mod:`.asynchronous` (PipeDream,
PipeDream-2BW), :mod:`.delayed` (Pipelined Backpropagation, PipeMare), :mod:`.chimera`, :mod:`.registry` (``get_schedule``), :mod:`.reduce_grad` (where the
``RG`` actions go), :mod:`.validate` (structural checks), :mod:`.dryrun` (``simulate``, the dry run,
and the runtime semantics an executor must follow).
"""
from fxpar.schedule.asynchronous import carried_versions, pipedream, pipedream_2bw
from fxpar.schedule.chimera import chimera
from fxpar.schedule.delayed import pipelined_bp, pipemare, steady_state_bubble
from fxpar.schedule.dryrun import SimResult, simulate
from fxpar.schedule.exceptions import (ScheduleDeadlockError, ScheduleError, ScheduleParseError,
                                   ScheduleValidationError)
from fxpar.schedule.ir import Action, ActionKind, Schedule, parse_action
from fxpar.schedule.reduce_grad import add_unshard, ensure_reduce_grad
from fxpar.schedule.registry import SCHEDULES, get_schedule
from fxpar.schedule.synchronous import gpipe, interleaved, one_f_one_b, single
from fxpar.schedule.validate import find_problems, validate
from fxpar.schedule.zero_bubble import zb1p

__all__ = ["Action", "ActionKind", "Schedule", "parse_action",
           "single", "gpipe", "one_f_one_b", "interleaved", "zb1p", "pipedream", "pipedream_2bw", "chimera",
           "carried_versions",
           "pipelined_bp", "pipemare", "steady_state_bubble",
           "SCHEDULES", "get_schedule", "ensure_reduce_grad", "add_unshard", "simulate", "SimResult", "validate",
           "find_problems", "ScheduleError", "ScheduleParseError", "ScheduleValidationError",
           "ScheduleDeadlockError"]
