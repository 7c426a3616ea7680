"""Stale synchronous parallel on parameter-server ranks: :class:`SSP` (Ho et al. 2013) and :class:`DSSP` (Zhao et al.
2019), the methods' options and the rule that bounds a worker's staleness (the decision; the mechanism is in
:mod:`fxpar.sync.ssp_server` and :mod:`fxpar.sync.ssp_worker`).

The parameters live on the ClusterSpec's ``cpu_servers=k`` ranks, each holding a shard of them. A worker's clock is
its step count (clock ``c`` is step ``c``, 0 first). Per clock a worker

1. computes its gradient at the parameters it read for clock ``c`` and steps its own optimizer (its own state);
2. pushes its *update*, the change that step made divided by ``n`` (its share of the global batch), to every
   server, which adds it to its shard as it arrives;
3. reads the parameters for clock ``c + 1``: a server answers once every worker has pushed every clock before
   ``c + 1 - s`` (``s``: the staleness bound), with its shard as it is then -- every update it has received, the
   worker's own included (read-my-writes).

So a worker at clock ``c`` computes with every update of clocks ``< c - s`` and all of its own, plus whichever later
ones had arrived: Ho et al.'s bounded-staleness read (their Theorem 1's ``x~``), and no worker is more than ``s``
clocks ahead of the slowest when it reads. With ``s = 0`` every read waits for every worker's previous clock:
synchronous SGD on the global batch (the sum of the ``n`` updates of one clock is one step on the mean gradient
for SGD and SGD-momentum; with Adam it is the mean of the workers' own Adam steps).

:class:`DSSP` picks ``s`` in ``[low, high]`` per read (Zhao, An, Liu and Chen, "Dynamic Stale Synchronous Parallel
Distributed Training for Deep Learning", ICDCS 2019, Algorithms 1-2, as we read them): a worker within ``low``
clocks of the slowest reads at ``low``. One that is further ahead runs on while an earlier grant of extra clocks
lasts; else the synchronisation controller grants it ``r`` in ``[0, high - low]`` extra clocks, the ``r`` for which
its own ``r``-th next push (its last push time plus ``r`` times its last iteration interval) comes nearest the
slowest worker's next push (that worker's last push plus its last interval): the fast worker then waits least
(:func:`extra_clocks`). Intervals are the differences of the last two pushes the server timed; until a worker has
pushed twice, no extra clocks are granted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from fxpar.errors import StrategyError

from .method import SyncMethod, register_method

__all__ = ["SSP", "DSSP", "ClockTable", "extra_clocks"]


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class _ServerMethod(SyncMethod):
    """A method whose parameters live on parameter-server ranks: no period, no warm-up, no averaging."""
    keeps_anchor: ClassVar[bool] = False
    uses_servers: ClassVar[bool] = True
    options: ClassVar[tuple] = ()         # its own fields, for to_dict() and summary()

    def check(self) -> None:
        me = type(self).__name__
        if self.period != 1 or self.warmup_steps != 0:
            raise StrategyError(f"{me}(period={self.period!r}, warmup_steps={self.warmup_steps!r}): {me} has no "
                                "averaging period and no warm-up (every clock pushes and reads through the "
                                f"servers); leave both out, e.g. {me}({', '.join(f'{o}=...' for o in self.options)})")

    def averages(self, step: int) -> bool:
        return False

    def staleness_for(self, table: "ClockTable", worker: int, clock: int) -> int:
        """The bound ``s`` of worker ``worker``'s read for ``clock``, from the server's clock table."""
        raise NotImplementedError

    def dynamic(self) -> bool:
        """Whether the bound is chosen per read on the first server (else every worker knows it)."""
        return False

    def to_dict(self) -> dict:
        return {"method": self.name, **{o: getattr(self, o) for o in self.options}}

    def summary(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{o}={getattr(self, o)!r}' for o in self.options)})"

    def __repr__(self) -> str:
        return self.summary()


@register_method
@dataclass(frozen=True, repr=False)
class SSP(_ServerMethod):
    """Stale synchronous parallel: a worker reads the servers' parameters for clock ``c`` once every worker has
    pushed clock ``c - staleness - 1``; ``staleness=0`` is synchronous SGD."""
    name: ClassVar[str] = "ssp"
    paper: ClassVar[str] = ("Ho et al., More Effective Distributed ML via a Stale Synchronous Parallel Parameter "
                            "Server, NIPS 2013")
    options: ClassVar[tuple] = ("staleness",)
    staleness: int = 3

    def check(self) -> None:
        super().check()
        if not _is_count(self.staleness):
            raise StrategyError(f"SSP(staleness={self.staleness!r}): the most clocks a worker may run ahead of the "
                                "slowest must be an int >= 0 (0: synchronous SGD)")

    def staleness_for(self, table, worker: int, clock: int) -> int:
        return self.staleness

    def bounds(self) -> tuple:
        return self.staleness, self.staleness

    def outer_words(self) -> str:
        return (f"a worker reads the servers' parameters for clock c once every worker has pushed clock "
                f"c - {self.staleness + 1} (at most {self.staleness} clock(s) ahead of the slowest)")


@register_method
@dataclass(frozen=True, repr=False)
class DSSP(_ServerMethod):
    """Dynamic SSP: the bound of each read is chosen in ``[low, high]`` on the first server from the workers'
    measured iteration times (module docstring; :func:`extra_clocks`)."""
    name: ClassVar[str] = "dssp"
    paper: ClassVar[str] = ("Zhao, An, Liu and Chen, Dynamic Stale Synchronous Parallel Distributed Training for Deep "
                            "Learning, ICDCS 2019, Alg. 1-2")
    options: ClassVar[tuple] = ("low", "high")
    low: int = 1
    high: int = 8

    def check(self) -> None:
        super().check()
        for o in self.options:
            if not _is_count(getattr(self, o)):
                raise StrategyError(f"DSSP({o}={getattr(self, o)!r}): the staleness bounds must be ints >= 0 "
                                    "(low: the bound every worker may use; high: the most it may be raised to)")
        if self.low > self.high:
            raise StrategyError(f"DSSP(low={self.low}, high={self.high}): low must be <= high (the staleness is "
                                f"chosen in [low, high]); swap them, e.g. DSSP(low={self.high}, high={self.low})")

    def dynamic(self) -> bool:
        return self.high > self.low

    def bounds(self) -> tuple:
        return self.low, self.high

    def staleness_for(self, table, worker: int, clock: int) -> int:
        """Zhao et al.'s server logic (Alg. 1) for worker ``worker`` going to ``clock``: ``low`` while it is within
        ``low`` clocks of the slowest; else the rest of an earlier grant; else a new grant of the controller's
        ``r`` extra clocks (bound ``low + r``), or ``low`` (it waits) when ``r = 0``."""
        slowest = min(range(len(table.done)), key=lambda w: (table.done[w], w))
        if clock - table.done[slowest] <= self.low:
            return self.low
        left, bound = table.extra.get(worker, (0, self.low))
        if left > 0:
            table.extra[worker] = (left - 1, bound)
            return bound
        r = extra_clocks(table.last_push(worker), table.interval(worker), table.last_push(slowest),
                         table.interval(slowest), self.high - self.low)
        table.extra[worker] = (max(r - 1, 0), self.low + r)
        return self.low + r

    def outer_words(self) -> str:
        return (f"a worker reads the servers' parameters for clock c once every worker has pushed clock c - s - 1, "
                f"s chosen per read in [{self.low}, {self.high}] from the workers' measured iteration times")


def extra_clocks(t_fast: float | None, i_fast: float | None, t_slow: float | None, i_slow: float | None,
                 r_max: int) -> int:
    """DSSP's synchronisation controller (Zhao et al. 2019, Alg. 2, as we read it): the ``r`` in ``[0, r_max]`` for
    which the fast worker's ``r``-th next push, ``t_fast + r i_fast``, comes nearest the slowest worker's next push,
    ``t_slow + i_slow`` (``t``: last push times, ``i``: last iteration intervals; the smaller ``r`` on a tie). 0
    where an interval is not measured yet."""
    if r_max <= 0 or None in (t_fast, i_fast, t_slow, i_slow) or i_fast <= 0:
        return 0
    target = t_slow + i_slow
    return min(range(r_max + 1), key=lambda r: (abs(t_fast + r * i_fast - target), r))


@dataclass
class ClockTable:
    """The first server's view of the workers: per worker the clocks it has pushed (``done``) and when (server
    time), the bounds chosen per read (``chosen``: ``(worker, clock, s)``), and the largest clock spread seen when a
    push arrived (the pushing worker's clock minus the slowest's, ``max_spread``). A checkpoint keeps it
    (:meth:`state`, :meth:`restored`)."""
    n: int
    done: list = field(default_factory=list)
    times: list = field(default_factory=list)
    chosen: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)        # DSSP: worker -> (extra clocks left, the bound granted)
    max_spread: int = 0
    shift: float = 0.0          # a resumed table: this server's clock minus the saving run's (pushed() subtracts it)

    def __post_init__(self):
        self.done = self.done or [0] * self.n
        self.times = self.times or [[] for _ in range(self.n)]

    def pushed(self, worker: int, clock: int, t: float) -> None:
        self.max_spread = max(self.max_spread, clock - min(self.done))
        self.done[worker] = max(self.done[worker], clock + 1)
        self.times[worker].append(t - self.shift)

    def slowest(self) -> int:
        """Clocks every worker has pushed."""
        return min(self.done)

    def last_push(self, worker: int) -> float | None:
        return self.times[worker][-1] if self.times[worker] else None

    def interval(self, worker: int) -> float | None:
        t = self.times[worker]
        return t[-1] - t[-2] if len(t) >= 2 else None

    def report(self) -> dict:
        return {"clocks": list(self.done), "push_times": [list(t) for t in self.times],
                "staleness": [list(c) for c in self.chosen], "max_spread": self.max_spread}

    def state(self) -> dict:
        """Everything the table holds, picklable: what a checkpoint keeps (:meth:`restored` reads it back)."""
        return {"n": self.n, "done": list(self.done), "times": [list(t) for t in self.times],
                "chosen": [tuple(c) for c in self.chosen], "extra": dict(self.extra), "max_spread": self.max_spread}

    @classmethod
    def restored(cls, state: dict, now: float) -> "ClockTable":
        """The table :meth:`state` saved, bitwise, whose later pushes are timed on the saving run's clock: ``now``
        (this server's clock at the resume) counts as the latest saved push, so the time between the save and the
        resume is no iteration, and DSSP's controller, which reads only intervals and the offsets between the
        workers' pushes (:func:`extra_clocks`), goes on as if the run had not stopped."""
        last = max((t[-1] for t in state["times"] if t), default=None)
        return cls(n=int(state["n"]), done=list(state["done"]), times=[list(t) for t in state["times"]],
                   chosen=[tuple(c) for c in state["chosen"]], extra=dict(state["extra"]),
                   max_spread=int(state["max_spread"]), shift=0.0 if last is None else now - last)
