"""Which schedule a pipeline program runs: a generator by name (asynchronous ones cover a whole run's
batches in one window), or a hand-written Schedule, checked against the Strategy, validated and dry-run
before anything runs."""
from __future__ import annotations

from ..errors import StrategyError
from ..schedule import Schedule, ScheduleDeadlockError, ScheduleValidationError, get_schedule, simulate, validate
from ..schedule.ir import ActionKind

__all__ = ["schedule_for", "check_custom_schedule", "ASYNC"]

ASYNC = ("pipedream", "2bw")


def schedule_for(name: str, pp: int, m: int, n_batches: int):
    """The schedule for ``n_batches`` batches: one window for asynchronous schedules (no flush between
    batches), a per-batch schedule otherwise."""
    if name == "pipedream":
        return get_schedule(name, pp, m * n_batches)     # one weight update per microbatch, never flushed
    if name == "2bw":
        return get_schedule(name, pp, m, n_batches=n_batches)
    return get_schedule(name, pp, m)


def check_custom_schedule(sched: Schedule, strategy) -> Schedule:
    """Check a hand-written schedule against the Strategy, then validate and dry-run it, so that a schedule
    that would hang the ranks fails here, at ``parallelize`` time, naming the step, ranks and actions."""
    pp, m = strategy.pp, strategy.microbatches
    if sched.n_ranks != pp or sorted(sched.actions) != list(range(pp)):
        raise StrategyError(f"{strategy}: the schedule lists ranks {sorted(sched.actions)}, but pp={pp} needs "
                            f"ranks 0..{pp - 1}; write one 'rank R:' line per pipeline rank or change pp.")
    if sched.n_microbatches != m:
        raise StrategyError(f"{strategy}: the schedule covers {sched.n_microbatches} microbatches but "
                            f"microbatches={m}; set Strategy(microbatches={sched.n_microbatches}).")
    if any(a.version is not None for acts in sched.actions.values() for a in acts):
        raise StrategyError(f"{strategy}: a hand-written schedule with weight versions (@v, asynchronous) is not "
                            "run yet: the runtime would need it to cover every batch of the run in one window. "
                            "Use schedule='pipedream' or '2bw', or drop the versions for a synchronous schedule.")
    if any(a.kind == ActionKind.W for acts in sched.actions.values() for a in acts):
        raise StrategyError(f"{strategy}: the schedule splits backward into B and W; the pipeline runtime runs "
                            "B as the full backward (input and weight gradients). Drop the W actions.")
    try:
        validate(sched)
    except ScheduleValidationError as e:
        raise ScheduleValidationError([f"hand-written schedule {sched.name!r}: {q}" for q in e.problems]) from None
    try:
        simulate(sched)
    except ScheduleDeadlockError as e:
        raise ScheduleDeadlockError(f"{strategy}: hand-written {e}", e.stuck) from None
    return sched
