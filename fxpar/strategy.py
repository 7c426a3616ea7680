"""Strategy: what the user asks for. The planner turns it into a Plan (what will be done)."""
from __future__ import annotations

import difflib
import inspect
import textwrap
from dataclasses import MISSING, dataclass, field, fields

from . import feature as _feature_registry
from .errors import StrategyError
from .losses import LOSS_AVERAGES
from .schedule import Schedule, ScheduleParseError

__all__ = ["Strategy", "AutoStrategy"]

_READY = False      # Strategy.__doc__ lists the options once the class and its fields are made

ONE_STAGE = "single"      # the core's one-stage program: the schedule where no pipeline schedule feature is on


def _core(default=None, doc: str = "", factory=None):
    """A core field with its doc (``help(fxpar.Strategy)`` lists it)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


class _StrategyType(type):
    # Strategy's ``__doc__`` lists the core fields and every registered feature's options with their docs, read from
    # the registry when it is asked for (the built-in features load then; a feature registered later is listed too)
    @property
    def __doc__(cls):
        return _doc(cls) if _READY else cls.__dict__.get("__doc__")


@dataclass
class Strategy(metaclass=_StrategyType):
    """How to parallelise a training step.

    The core's settings below are its dataclass fields; every other keyword is an option of the feature that carries
    it out (``fxpar.Feature``: fxpar's own in ``fxpar/features/``, or one you registered, as examples/custom_strategy.py
    does: ``Strategy(dp=2, ef_dtype="float16")``), listed after them. Each reads like a field (``strategy.ef_dtype``);
    unset, it is its default; ``strategy.options`` holds the ones given. A keyword no registered feature declares is
    refused, naming the nearest option.
    """
    dp: int = _core(1, "size of the data-parallel mesh axis; dp * tp * pp must equal the ClusterSpec's world size")
    tp: int = _core(1, "size of the tensor-parallel mesh axis")
    pp: int = _core(1, "size of the pipeline-parallel mesh axis (the number of stages)")
    schedule: "str | Schedule | None" = _core(None, (
        "(pp > 1; default ``'1f1b'``) a schedule name a registered pipeline schedule feature builds (its "
        "``schedules``; ``fxpar/features/pipeline*``, or your own ``PipelineSchedule`` subclass), or a hand-written "
        "schedule: a "
        "``fxpar.schedule.Schedule`` or its text (``str(schedule)``'s grid or ``schedule.format_lists()``), read with "
        "``Schedule.parse``. A hand-written one is validated and dry-run when the program is built: one that would "
        "deadlock raises ``fxpar.schedule.ScheduleDeadlockError`` naming the step and ranks."))
    microbatches: int = _core(1, "microbatches each dp shard of the step's batch is cut into (a pipeline's, or "
                                       "gradient accumulation with pp=1)")
    split_points: list | None = _core(None, "(pp > 1) the module path each stage after the first starts "
                                            "at; None: the planner balances the stages")
    passes: list = _core(doc=(
        "your own passes (fxpar.Pass), appended after fxpar's, in order; a pass whose ``before`` names one of "
        "fxpar's (e.g. ``before=('data_parallel',)``) is placed just ahead of it."), factory=list)
    loss_average: str = _core("auto", (
        "how the dp shards' and microbatches' losses make the step's loss (docs/semantics.md): ``'global'`` -- "
        "single-process training on the global batch: a mean over counted elements (cross-entropy with "
        "``ignore_index``) divides the sum of every shard by the global count; ``'per_shard'`` -- the mean of each "
        "shard's loss, as torch DDP; ``'auto'`` (default) -- ``'global'`` where fxpar sees the loss "
        "(``torch.nn.functional.cross_entropy``/``nll_loss``, ``nn.CrossEntropyLoss``/``nn.NLLLoss``), else "
        "``'per_shard'``."))
    options: dict = _core(doc="the features' options given (keywords that are not fields land here), by name",
                          factory=dict)

    def __post_init__(self):
        self.options = dict(self.options)           # its own: settle() and validate() may normalise values in it
        self._check_options()
        _feature_registry.settle_strategy(self)     # options other options imply, before any check
        for name in ("dp", "tp", "pp", "microbatches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise StrategyError(f"Strategy({name}={v!r}): {name} must be a positive int")
        if self.loss_average not in LOSS_AVERAGES:
            raise StrategyError(f"Strategy(loss_average={self.loss_average!r}): choose one of {LOSS_AVERAGES} "
                                "('global': single-process semantics, 'per_shard': each shard's mean averaged, as DDP)")
        if isinstance(self.schedule, str) and self.schedule.lstrip().startswith("#"):
            try:
                self.schedule = Schedule.parse(self.schedule)
            except ScheduleParseError as e:
                raise StrategyError(f"Strategy(schedule=<text>): {e}") from None
        names = _feature_registry.schedule_names() + (ONE_STAGE,)     # what the schedule features build
        if self.schedule is not None and not self._custom_schedule and self.schedule not in names:
            raise StrategyError(f"Strategy(schedule={self.schedule!r}): choose one of {names}, or pass a "
                                "fxpar.schedule.Schedule or its text (starting with its '# schedule ...' header)")
        # each enabled feature's options, the requires / conflicts_with between features, the shared options
        _feature_registry.check_strategy(self)

    def _check_options(self) -> None:
        """Every key of ``options`` is an option a registered feature declares."""
        owned = _feature_registry.option_defaults()
        for k in self.options:
            if k not in owned:
                near = difflib.get_close_matches(k, list(owned) + sorted(_FIELDS), n=1)
                raise StrategyError(f"Strategy({k}=...): no registered feature owns option {k!r}"
                                    + (f" (did you mean {near[0]!r}?)" if near else "")
                                    + "; register the Feature that declares it (fxpar.register_feature) before making "
                                    f"the Strategy. Feature options: {sorted(owned) or 'none'}")

    def option(self, name: str):
        """The value of option ``name``: a Strategy field, or a registered feature's option (its default if unset)."""
        if name in _FIELDS:
            return getattr(self, name)
        given = self.__dict__.get("options", {})
        if name in given:
            return given[name]
        spec = _feature_registry.option_spec(name)
        if spec is None:
            raise AttributeError(f"Strategy has no option {name!r}")
        return spec.default

    def __getattr__(self, name: str):       # a feature's option reads like a field: strategy.ef_dtype
        if name.startswith("_") or name == "options":
            raise AttributeError(name)
        try:
            return self.option(name)
        except AttributeError:
            raise AttributeError(f"'Strategy' object has no attribute {name!r}") from None

    def __setattr__(self, name: str, value) -> None:     # and is set like one (a feature's settle() or validate())
        if name in _FIELDS or name.startswith("_"):
            object.__setattr__(self, name, value)
        elif _feature_registry.option_spec(name) is not None:
            self.options[name] = value
        else:
            near = difflib.get_close_matches(name, list(_feature_registry.option_defaults()) + sorted(_FIELDS), n=1)
            raise AttributeError(f"Strategy has no option {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                                 + ": set a field or a registered feature's option")

    def _settings(self) -> dict:
        """Every field but ``options``, then every declared option, with its value (its default where unset)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        for k, default in _feature_registry.option_defaults().items():
            out.setdefault(k, self.options.get(k, default))
        return out

    def __eq__(self, other) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._settings() == other._settings()

    __hash__ = None

    def __repr__(self) -> str:
        """Every setting off its default, as keywords: ``Strategy(dp=2, ef_dtype='float16')``."""
        defaults = {f.name: _default(f) for f in fields(self)} | _feature_registry.option_defaults()
        return "Strategy(" + ", ".join(f"{k}={v!r}" for k, v in self._settings().items()
                                       if _off_default(v, defaults[k])) + ")"

    def given_settings(self) -> dict:
        """Every setting off its default, as its repr (``Plan.made_with``), but ``passes`` and the reprs that name an
        object's address (they differ between processes)."""
        defaults = {f.name: _default(f) for f in fields(self)} | _feature_registry.option_defaults()
        return {k: r for k, v in self._settings().items() if k != "passes" and _off_default(v, defaults[k])
                for r in (repr(v),) if " at 0x" not in r}

    @property
    def _custom_schedule(self) -> bool:
        return isinstance(self.schedule, Schedule)

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    @classmethod
    def auto(cls, allow=(), margin: float = 0.9, finalists: int = 3, workers: int | None = None,
             **pins) -> "AutoStrategy":
        """The automatic planner (docs/strategies/auto.md): it searches the mesh, the pipeline schedule, the
        microbatches and the features' options it knows by the cost models. A keyword pins a searched dimension to
        a value or a tuple of values (``Strategy.auto(tp=8)``, ``Strategy.auto(microbatches=(4, 8))``); any other
        Strategy keyword is an option every candidate gets. Methods that change the math are searched only when
        ``allow`` names them. ``margin``: the share of a device's memory a plan may be predicted to use;
        ``finalists``: how many of the best candidates are built and estimated in full before one is chosen.
        ``workers``: how many forked processes estimate the finalists past the first while this one builds it
        (``fxpar.auto.workers``): None, one per CPU this process may run on (none on one CPU, without ``fork``, or while
        the load average is at least the CPU count);
        0, every finalist in this process. The choice is the same either way."""
        return AutoStrategy(pins=dict(pins), allow=tuple(allow), margin=margin, finalists=finalists, workers=workers)

    @classmethod
    def coerce(cls, strategy, world_size: int) -> "Strategy":
        """Accept a Strategy, None (data parallel over every rank), or a list of passes."""
        if strategy is None:
            return cls(dp=world_size)
        if isinstance(strategy, (list, tuple)):
            return cls(dp=world_size, passes=list(strategy))
        if not isinstance(strategy, cls):
            raise StrategyError(f"strategy={strategy!r}: pass fxpar.Strategy(...), 'auto' (the automatic planner), "
                                "fxpar.Strategy.auto(...), None (data parallel over every rank) or a list of passes")
        return strategy

    def __str__(self) -> str:
        """The mesh, the pipeline's schedule, then each enabled feature's options off their defaults."""
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        named = isinstance(self.schedule, str) and self.schedule != ONE_STAGE      # a one-stage schedule by name
        if self.pp > 1 or named:
            sched = self.schedule
            if self._custom_schedule:
                sched = f"<hand-written {sched.name!r}: {sched.n_ranks} ranks, {sched.n_stages} stages>"
            parts += ([f"schedule={sched}"] if sched is not None else []) + [f"microbatches={self.microbatches}"]
        shown = set(_FIELDS)
        for f in _feature_registry.enabled_features(self):
            for k in (*f.options, *f.enabled_by):
                spec = _feature_registry.option_spec(k)
                if k not in shown and spec is not None and _off_default(self.option(k), spec.default):
                    shown.add(k)
                    parts.append(f"{k}={_brief(self.option(k))}")
        return "Strategy(" + ", ".join(parts) + ")"


@dataclass
class AutoStrategy:
    """``Strategy.auto(...)``: what the automatic planner may choose (see :meth:`Strategy.auto`). ``pins``: a Strategy
    field or feature option -> a value or a tuple of values (which of them the planner searches is its own list,
    ``fxpar.auto.search.SEARCHED``)."""
    pins: dict = field(default_factory=dict)
    allow: tuple = ()
    margin: float = 0.9
    finalists: int = 3
    workers: int | None = None

    def __post_init__(self):
        if not (isinstance(self.margin, (int, float)) and 0 < self.margin <= 1):
            raise StrategyError(f"Strategy.auto(margin={self.margin!r}): the share of a device's memory a plan may "
                                "use, in (0, 1], e.g. 0.9")
        if not isinstance(self.finalists, int) or self.finalists < 1:
            raise StrategyError(f"Strategy.auto(finalists={self.finalists!r}): how many candidates are built in "
                                "full, a positive int")
        if self.workers is not None and (not isinstance(self.workers, int) or isinstance(self.workers, bool)
                                         or self.workers < 0):
            raise StrategyError(f"Strategy.auto(workers={self.workers!r}): how many processes estimate finalists "
                                "beside this one, an int >= 0 (0: none), or None for one per CPU")
        owned = _feature_registry.option_defaults()
        for k in self.pins:
            if k not in _FIELDS and k not in owned:
                near = difflib.get_close_matches(k, list(owned) + sorted(_FIELDS), n=1)
                raise StrategyError(f"Strategy.auto({k}=...): no Strategy field or registered feature option "
                                    f"{k!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))

    def __str__(self) -> str:
        args = [f"{k}={v!r}" for k, v in self.pins.items()] + ([f"allow={self.allow!r}"] if self.allow else [])
        return "Strategy.auto(" + ", ".join(args) + ")"


def _default(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _off_default(value, default) -> bool:
    try:
        return not (value is default or bool(value == default))
    except Exception:  # noqa: BLE001 - a value that does not compare (an array): shown
        return True


def _brief(value) -> str:
    """An option's value in ``str(strategy)``: a policy function by its name, a dict of layouts by its size."""
    if callable(value) and not isinstance(value, type):
        return f"<{getattr(value, '__qualname__', type(value).__name__)}>"
    if isinstance(value, dict):
        return f"<dict of {len(value)}>"
    return repr(value)


def _wrap(text: str, indent: int) -> list:
    return textwrap.wrap(text, 120 - indent, initial_indent=" " * indent, subsequent_indent=" " * (indent + 4),
                         break_on_hyphens=False)


def _entry(name: str, default, doc: str) -> list:
    return _wrap(f"{name} (default {default!r}): {doc}", 8)


def _doc(cls) -> str:
    """The class docstring, then each core field and each registered feature's options with their docs."""
    lines = [(cls.__dict__.get("__doc__") or "").rstrip(), "", "    Core settings (dataclass fields):"]
    for f in fields(cls):
        if _feature_registry.option_owner(f.name) is None:      # a feature that declares it documents it
            lines += _entry(f.name, _default(f), f.metadata.get("doc", ""))
    for feat in _feature_registry.registered_features():
        if feat.options:
            lines += [""] + _wrap(f"Feature {feat.name!r} ({type(feat).__module__}): {feat.doc}", 4)
            lines += [line for k, o in feat.options.items() for line in _entry(k, o.default, o.doc)]
    for k, (o, carriers) in _feature_registry.shared_options().items():
        lines += ["", f"    Shared by several features: {k}"] + _entry(k, o.default, o.doc + ":")
        for name in carriers:
            lines += _wrap(f"{name!r}: {_feature_registry.get_feature(name).doc}", 12)
    return "\n".join(lines) + "\n"


_FIELDS = frozenset(f.name for f in fields(Strategy))
_feature_registry._CORE_OPTIONS.update(_FIELDS - {"options"})
_dataclass_init = Strategy.__init__


def _init(self, *args, **kwargs):
    """``Strategy(dp=2, ef_dtype="float16")``: keywords that are not fields are registered features' options
    (``help(fxpar.Strategy)`` lists them)."""
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in _FIELDS}
    if extra:
        kwargs["options"] = {**kwargs.get("options", {}), **extra}
    _dataclass_init(self, *args, **kwargs)


_sig = inspect.signature(_dataclass_init)
_init.__signature__ = _sig.replace(parameters=[*_sig.parameters.values(), inspect.Parameter(
    "feature_options", inspect.Parameter.VAR_KEYWORD)])
Strategy.__init__ = _init
_READY = True
