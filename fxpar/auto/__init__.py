"""The automatic planner: ``fxpar.auto_plan`` ranks candidate plans by the cost models without building them;
``parallelize(..., strategy="auto")`` builds the best few and keeps the fastest that fits (docs/strategies/auto.md).

- :mod:`fxpar.auto.profile`: the model's work and memory from one eager pass on fake tensors;
- :mod:`fxpar.auto.space`: the candidates and their cheap cost;
- :mod:`fxpar.auto.search`: enumeration, pruning, the finalists, the words of ``explain()``;
- :mod:`fxpar.auto.probe`: a one-stage finalist's estimate composed from builds of the model cut short;
- :mod:`fxpar.auto.workers`: the finalists past the first estimated in forked processes.
"""
from .search import AutoSearch, NoPlanFitsError, as_auto, auto_plan, choose, search
from .space import Candidate

__all__ = ["auto_plan", "AutoSearch", "Candidate", "NoPlanFitsError", "as_auto", "choose", "search"]
