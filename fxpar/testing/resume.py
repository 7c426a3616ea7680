"""A checkpoint's round trip for the tests: a run cut in two at a checkpoint must be the uninterrupted run.

:func:`assert_resume_is_exact` runs ``program`` on every batch, then on ``batches[:k]`` saving a checkpoint and on
``batches[k:]`` resuming from it, on one cluster, and checks the two halves against the whole run::

    whole  = run(batches)                            losses L0 L1 L2 L3    state S
    first  = run(batches[:k], save_to=d)             losses L0 L1
    second = run(batches[k:], resume_from=d)         losses       L2 L3    state S (bitwise)
"""
from __future__ import annotations

from .reference import max_abs_diff

__all__ = ["assert_resume_is_exact"]


def assert_resume_is_exact(program, batches: list, k: int, cluster, directory):
    """Raise AssertionError unless ``first.losses + second.losses == whole.losses`` and ``second``'s parameters are
    ``whole``'s bitwise (the module docstring's three runs; ``directory`` receives the checkpoint). Returns
    ``(whole, first, second)``, the three RunResults, for a test's own further checks (servers, replicas, ...)."""
    if not 0 < k < len(batches):
        raise ValueError(f"assert_resume_is_exact(k={k}): cut inside the {len(batches)} batches, 0 < k < "
                         f"{len(batches)}")
    whole = program.run_local(batches, cluster=cluster)
    first = program.run_local(batches[:k], cluster=cluster, save_to=directory)
    second = program.run_local(batches[k:], cluster=cluster, resume_from=directory)
    if first.losses + second.losses != whole.losses:
        raise AssertionError(f"losses cut at step {k}: {first.losses} + {second.losses}, uninterrupted "
                             f"{whole.losses}")
    diff = max_abs_diff(second.state_dict(), whole.state_dict())
    if diff != 0:
        raise AssertionError(f"the resumed run's parameters differ from the uninterrupted run's by up to {diff}")
    return whole, first, second
