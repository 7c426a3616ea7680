"""Look up a schedule generator by name: ``get_schedule("1f1b", p=4, m=8)``, the IR's own table for users and tests.

A program does not read this table: ``Strategy(schedule=...)`` reaches the generators through the pipeline
schedule features (``fxpar/features/pipeline*``: each lists the names it builds), where a user's own schedule
is registered too.

=============  =====================================  ==========================================
name           generator                              paper
=============  =====================================  ==========================================
single         :func:`~.synchronous.single`           (no pipeline: the one-stage program)
gpipe          :func:`~.synchronous.gpipe`            Huang et al., NeurIPS'19
1f1b           :func:`~.synchronous.one_f_one_b`      Narayanan et al., ICML'21 (PipeDream-Flush)
interleaved    :func:`~.synchronous.interleaved`      Narayanan et al., SC'21 (Megatron-LM)
pipedream      :func:`~.asynchronous.pipedream`       Harlap, Narayanan et al., SOSP'19
2bw            :func:`~.asynchronous.pipedream_2bw`   Narayanan et al., ICML'21 (PipeDream-2BW)
pipelined_bp   :func:`~.delayed.pipelined_bp`         Kosson et al., MLSys'21 (Pipelined Backpropagation)
pipemare       :func:`~.delayed.pipemare`             Yang et al., MLSys'21 (PipeMare)
chimera        :func:`~.chimera.chimera`              Li & Hoefler, SC'21
zb1p           :func:`~.zero_bubble.zb1p`             Qi et al., ICLR'24 (ZB-H1)
hetpipe        :func:`~.hetpipe.hetpipe`              Park et al., USENIX ATC'20 (one virtual worker's wave)
=============  =====================================  ==========================================
"""
from __future__ import annotations

import difflib
import inspect
from typing import Callable

from fxpar.schedule.asynchronous import pipedream, pipedream_2bw
from fxpar.schedule.chimera import chimera
from fxpar.schedule.delayed import pipelined_bp, pipemare
from fxpar.schedule.exceptions import ScheduleError
from fxpar.schedule.hetpipe import hetpipe
from fxpar.schedule.ir import Schedule
from fxpar.schedule.synchronous import gpipe, interleaved, one_f_one_b, single
from fxpar.schedule.zero_bubble import zb1p

__all__ = ["SCHEDULES", "get_schedule"]

SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "single": single,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "pipedream": pipedream,
    "2bw": pipedream_2bw,
    "pipelined_bp": pipelined_bp,
    "pipemare": pipemare,
    "chimera": chimera,
    "zb1p": zb1p,
    "hetpipe": hetpipe,
}


def get_schedule(name: str, p: int, m: int, **kw) -> Schedule:
    """Build the schedule ``name`` for p pipeline ranks and m microbatches; ``kw`` goes to the generator
    (``v`` for interleaved, ``n_batches`` for 2bw)."""
    key = name.lower().replace("_", "").replace("-", "")
    key = {"onefoneb": "1f1b", "pipedreamflush": "1f1b", "pipedream2bw": "2bw", "zbh1": "zb1p", "pipelinedbp": "pipelined_bp"}.get(key, key)
    if key not in SCHEDULES:
        near = difflib.get_close_matches(name, list(SCHEDULES), n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ScheduleError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}.{hint}")
    gen = SCHEDULES[key]
    allowed = set(inspect.signature(gen).parameters) - {"p", "m"}
    extra = set(kw) - allowed
    if extra:
        raise ScheduleError(f"schedule {key!r} takes no option(s) {sorted(extra)}; it accepts "
                            f"{sorted(allowed) or 'none besides p and m'}")
    return gen(p, m, **kw)
