"""Features: one strategy, one object, one module.

A strategy (a gradient-sync method, a way to shard state, a schedule of communication ...) is a
:class:`Feature`. It declares, in its own module:

* the :class:`Strategy <fxpar.Strategy>` options it owns (:class:`Option`), with ``requires`` and
  ``conflicts_with`` naming other features -- checked when the Strategy is made;
* its typed Plan section (a :class:`PlanSection` dataclass: JSON round-trip, prints itself);
* its planning function (:meth:`Feature.plan`, and :meth:`Feature.plan_stage` once each stage is
  captured): the decision, written into its section;
* its passes, each in a :class:`Slot` of the one pass list (``fxpar.lower``);
* its per-rank runtime state (:class:`RankState`): the graph inputs it provides (role ``state``),
  the outputs it takes back (role ``new_state``), what it saves in a checkpoint;
* its cost-model effect (:meth:`Feature.state_bytes`: bytes each rank holds beside the graphs;
  :meth:`Feature.priced_calls`: what a rank runs where the feature changes it at run time);
* its lines in ``explain()`` (:meth:`Feature.explain`).

The core (planner, lowering, executor, checkpoints, ``Plan.__str__``) loops over the enabled features
and names none. A user registers a Feature of their own the same way, from their own file::

    @fxpar.register_feature
    class MyMethod(fxpar.Feature):
        name = "my_method"
        options = {"my_method": fxpar.Option(None, "what it does")}
        section = MySection
        ...

    fxpar.Strategy(dp=2, my_method=...)

See ``examples/custom_strategy.py`` for a whole one (a gradient-sync method with per-rank state).
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar

import torch.fx

from . import meta as M
from .errors import StrategyError
from .roles import Role

__all__ = ["Feature", "Option", "Slot", "PlanSection", "RankState", "ExtraRank", "register_feature", "registered_features",
           "unregister_feature", "get_feature", "enabled_features", "check_strategy", "section_from_dict", "option_owner", "option_defaults",
           "add_state_input", "add_state_output", "BUILTIN_FEATURES", "STATE_ROLE", "NEW_STATE_ROLE", "state_key",
           "split_state_key", "settle_strategy", "register_shared_option", "shared_options", "option_spec",
           "schedule_features", "schedule_names"]

# The graph roles of a feature's per-rank state: an input ("state", "<feature>.<name>") the rank's RankState
# provides, and an output ("new_state", "<feature>.<name>") it takes back after the graph ran.
STATE_ROLE = Role.STATE
NEW_STATE_ROLE = Role.NEW_STATE

# The package whose modules register fxpar's own features, imported the first time the registry is read (a
# plug-in discovery by name, as entry points do: the floor never imports the features' layer itself).
BUILTIN_FEATURES = "fxpar.features"


def state_key(feature: str, name: str) -> str:
    """The key of a feature's state tensor in graph roles and checkpoints: ``"<feature>.<name>"``."""
    return f"{feature}.{name}"


def split_state_key(key: str) -> tuple:
    """``"<feature>.<name>"`` -> ``(feature, name)``."""
    feature, _, name = key.partition(".")
    return feature, name


class Slot(enum.IntEnum):
    """Where a feature's pass sits in the one pass list; ``fxpar.lower`` runs the slots top to bottom."""
    PARTITION = 10       # split operators over tp: every later pass works on the rank's local pieces
    PRECISION = 15       # forward and backward in the compute dtype: every later pass sees its values and bytes
    REMAT = 20           # recompute / activation offload: copies placed before collectives follow backward's order
    GRAD_ORDER = 30      # the order backward makes the gradients in
    GRAD_SYNC = 40       # each gradient summed over the ranks the planner named
    GRAD_ROUTE = 45      # gradients that travel another way than dense buckets (sparse pairs)
    BUCKET = 50          # per-gradient collectives fused into buckets
    BUCKET_SUM = 60      # how a bucket is summed: hierarchically, through servers, compressed
    SHARD_STATE = 70     # optimizer state, gradients, parameters sharded over dp
    SHARD_OFFLOAD = 75   # sharded state kept on the host or on disk
    COMM_ORDER = 80      # the order and overlap of the gradient communication
    BUFFERS = 90         # buffers synchronised across replicas
    OPTIMIZER = 100      # the update written into the parameters' own storage
    USER = 110           # the user's passes (Strategy(passes=[...])) see the finished distributed graph


@dataclass(frozen=True)
class Option:
    """A Strategy option a feature owns: its default and its doc (what it does, its values, what it needs), which
    ``help(fxpar.Strategy)`` lists under the feature."""
    default: Any = None
    doc: str = ""


class PlanSection:
    """Base of a feature's Plan section. Subclass it as a ``@dataclass`` whose fields are JSON values (numbers,
    strings, lists, dicts); ``Plan.to_json`` writes ``dataclasses.asdict`` of it under the feature's name, and
    ``Plan.from_json`` reads it back through :func:`section_from_dict`, refusing unknown fields by name."""
    # how the feature orders the gradient buckets, for the gradient-sync line of ``print(plan)`` (None: it does not)
    bucket_order: ClassVar[str | None] = None
    # True in a pipeline schedule's section (``fxpar.features.pipeline.PipelineSection``): its ``schedule`` field is the
    # schedule the program runs (``Plan.schedule``), and its feature builds it (``make_schedule``), cuts the stages
    # (``cut_stages``) and scales each update's gradient (``grad_scale``); a Plan holds at most one such section
    picks_schedule: ClassVar[bool] = False
    # the schedule keeps several weight versions per stage: a stage updates inside the window, never flushed
    # (``Plan.asynchronous``: no lr_scheduler, no in-place update, no ZeRO)
    asynchronous: ClassVar[bool] = False

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def lines(self) -> list:
        """What ``print(plan)`` shows of this section (default: its fields)."""
        return [", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))]

    def plan_lines(self, plan) -> list:
        """What ``print(plan)`` shows of this section where the words need the rest of ``plan`` (its groups, the
        other sections); default: :meth:`lines`."""
        return self.lines()


class RankState:
    """A feature's state on one rank (error-feedback residuals, ZeRO's chunks, a clock ...).

    The executor makes one per enabled feature that declares ``state``, from the feature's
    :meth:`Feature.rank_info` (picklable: it travels to the spawned ranks), and calls its hooks at fixed points
    of a rank's life; every hook has a default that does nothing, so a RankState is as small as its state:

    * ``tensors``: its own tensors, graph inputs ``("state", "<feature>.<name>")`` (:meth:`provide`) that come
      back as outputs ``("new_state", "<feature>.<name>")`` (:meth:`take`), saved per rank in checkpoints
      (:meth:`save` / :meth:`load`) and resumed bitwise;
    * :meth:`setup`: once the rank holds its parameters, optimizer state and buffers (cut them into chunks or
      pieces, map them to files);
    * ``input_roles`` / :meth:`provide_role`: graph inputs of other roles it provides (``"param_shard"``);
    * :meth:`handlers`: schedule actions it runs itself, ``{ActionKind: handler(action, window, index)}``;
    * :meth:`after_setup`: once every feature's :meth:`setup` ran: what runs the rank's graphs (a compiler's callables
      in their place);
    * :meth:`whole`: whole tensors from what the rank holds, for ``state_dict()`` and checkpoints (a collective
      where ``collective`` is True: then every rank calls it; an instance may set it in :meth:`setup`);
      :meth:`laid_out`: the other way, for a whole tensor laid out like a parameter;
    * :meth:`after_update`, :meth:`after_load`, :meth:`drain`: after a stage's update, after a checkpoint
      replaced the state with whole tensors, before results and checkpoints are taken;
    * :meth:`report`: what it tells the run's result (``RunResult.features``).
    """
    input_roles: ClassVar[tuple] = ()
    collective: ClassVar[bool] = False

    def __init__(self, info, rank: int):
        self.info, self.rank = info, rank
        self.tensors: dict = {}

    def provide(self, name: str, stage: int):
        """The value of graph input ``("state", "<feature>.<name>")`` for a graph of ``stage``."""
        try:
            return self.tensors[name]
        except KeyError:
            raise RuntimeError(f"rank {self.rank}: a graph of stage {stage} reads feature state {name!r}, which "
                               f"{type(self).__name__} does not hold (it holds {sorted(self.tensors)}): the "
                               "feature's pass and its rank_info() disagree") from None

    def take(self, name: str, value, stage: int) -> None:
        """Graph output ``("new_state", "<feature>.<name>")``: the value for the next step."""
        self.tensors[name] = value

    def setup(self, ex) -> None:
        """Once the executor ``ex`` holds the rank's parameters, optimizer state and buffers."""

    def after_setup(self, ex) -> None:
        """Once every enabled feature's :meth:`setup` ran (the graphs are bound to this rank's groups and to the
        features' state): a feature may put callables of its own in place of the graphs the rank runs, in
        ``ex.p.graphs[stage][kind]`` (a :class:`~passes.split_graphs.SplitGraph` copy whose ``gm`` it replaced), never
        changing the SplitGraphs themselves (a one-rank run shares them with the Program)."""

    def provide_role(self, ex, role: str, key: str, stage: int, weights: dict):
        """A graph input of one of ``input_roles``."""
        raise NotImplementedError(f"{type(self).__name__} lists role {role!r} in input_roles but does not provide it")

    def handlers(self, ex) -> dict:
        """``{ActionKind: handler(action, window, index)}``: actions this state runs in place of the executor."""
        return {}

    def whole(self, ex, params: dict, state: dict) -> tuple:
        """``(params, state)`` per held stage with whole tensors (copies of the dicts may be changed)."""
        return params, state

    def laid_out(self, ex, stage: int, key: str, t):
        """``t``, a whole tensor shaped like parameter ``key`` of ``stage`` (an untraced optimizer's state, loaded
        from a checkpoint), as this rank holds that parameter (its piece, its chunk); :meth:`whole` gathers it back.
        Default: ``t``."""
        return t

    def after_update(self, ex, stage: int) -> None:
        """After ``stage``'s update wrote new parameters and optimizer state."""

    def after_load(self, ex) -> None:
        """After a checkpoint load put whole tensors back into the executor."""

    def drain(self, ex) -> None:
        """Before results, ``state_dict()`` and checkpoints: finish what is in flight (a collective)."""

    def report(self):
        """What this state tells the run's result once the run is over (picklable; None: nothing), as
        ``RunResult.features[rank][<feature>]`` (an adaptive method's decisions, say)."""
        return None

    def save(self) -> dict:
        """This rank's state for a checkpoint (picklable; tensors are copied)."""
        return {k: v.clone() for k, v in self.tensors.items()}

    def load(self, saved: dict) -> None:
        missing = sorted(set(self.tensors) - set(saved))
        if missing:
            raise RuntimeError(f"rank {self.rank}: the checkpoint holds no {type(self).__name__} state for "
                               f"{missing}: it was saved by a program with other buckets or stages")
        self.tensors = {k: saved[k].clone() for k in self.tensors}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class ExtraRank:
    """A rank a feature runs beside the workers, after them (ranks ``world_size ..``): BytePS's CPU summation
    servers. Picklable: it travels to its own process. ``rank``: its global rank; ``label``: what it is, in
    messages (``"BytePS CPU server"``); :meth:`origin`: what asked for it (``"ClusterSpec(cpu_servers=1)"``)."""
    rank: int
    label: ClassVar[str] = "extra rank"

    def origin(self) -> str:
        return ""

    def serve(self) -> dict:
        """Its whole run under ``run_local``, until every worker's :meth:`release`; returns what it reports
        (``RunResult.servers[rank]``)."""
        raise NotImplementedError(f"{type(self).__name__}.serve")

    def release(self) -> None:
        """On each worker, after its last step under ``run_local``: let this rank's :meth:`serve` return."""


class Feature:
    """A strategy. Subclass, set the class attributes, override what the strategy needs, and register it
    (:func:`register_feature`). Every method has a default that does nothing, so a feature is as small as the
    strategy it is."""
    name: ClassVar[str] = ""
    doc: ClassVar[str] = ""                         # one line: the strategy and its paper
    options: ClassVar[dict] = {}                    # Strategy option name -> Option
    section: ClassVar[type | None] = None           # its PlanSection dataclass
    requires: ClassVar[tuple] = ()                  # features that must be enabled with it
    conflicts_with: ClassVar[tuple] = ()            # features that must not be
    passes: ClassVar[tuple] = ()                    # (Slot, Pass class or factory) pairs
    state: ClassVar[type | None] = None             # its RankState class, if it keeps state per rank
    # options it does not own whose value enables it (its enabled() tests them; messages name them): a core field
    # (``tp``) or an option several features share (register_shared_option: each gradient-sync method is a value
    # of one ``grad_sync``)
    enabled_by: ClassVar[tuple] = ()
    # its per-rank state changes while the gradients are summed, before the update (error feedback, an averaging
    # clock): a step skipped after the sum (fp16's loss scale on an overflow) would leave that state moved
    state_moves_in_sum: ClassVar[bool] = False

    # ---- the decision ------------------------------------------------------------------------------
    def enabled(self, strategy) -> bool:
        """Whether ``strategy`` asks for this feature: by default, any option it owns is set off its default."""
        return any(strategy.option(k) != o.default for k, o in self.options.items())

    def settle(self, strategy) -> None:
        """Before any check of ``strategy``: set the options this feature's own options imply (an option that
        needs another one on, say). Default: nothing."""

    def validate(self, strategy) -> None:
        """Refuse option values this feature cannot carry out (raise :class:`fxpar.StrategyError` naming them)."""

    def check_off(self, strategy) -> None:
        """``strategy`` leaves this feature off: refuse its options set off their defaults, which nothing would
        carry out. Default: a :class:`fxpar.StrategyError` naming them and what turns the feature on."""
        given = [f"{k}={strategy.option(k)!r}" for k, o in self.options.items() if strategy.option(k) != o.default]
        if given:
            on = (f"{', '.join(self.enabled_by)} turns it on" if self.enabled_by
                  else f"it is on with any of {', '.join(self.options)} off its default")
            raise StrategyError(f"Strategy({', '.join(given)}): option(s) of feature {self.name!r}, which this "
                                f"Strategy leaves off ({on}), so nothing would use them; turn the feature on or "
                                "drop them")

    def mesh_axes(self, strategy, given) -> list:
        """The mesh axes this feature adds after ``pp`` and ``dp`` (``[[name, size], ...]``, fastest last), from
        ``strategy`` or, where a Plan is handed back, from its section ``given`` (else None). Asked when the Plan
        is made, before the schedule and the gradient groups that read the mesh."""
        return []

    def check_cluster(self, strategy, cluster) -> None:
        """Refuse a ClusterSpec (None: not known) this feature cannot run on, or one that asks for this feature while
        ``strategy`` leaves it off (a resource only it uses). Called for every registered feature, on or off."""

    def uses_server_ranks(self, strategy) -> bool:
        """Whether ``strategy`` has this feature run on the ClusterSpec's CPU-only server ranks (a ClusterSpec with
        server ranks that no enabled feature uses is refused). Default: False."""
        return False

    def plan(self, strategy, plan, cluster):
        """Before capture: return this feature's Plan section (or None to leave it off)."""
        return self.section() if self.section is not None else None

    def adopt(self, section, strategy, plan, cluster):
        """A handed-back Plan's section (a copy) in place of :meth:`plan`: re-derive what the new ``plan`` keeps
        outside the section (process groups ...); return the section to use."""
        return section

    def bucket_groups(self, section, plan, stage: int, captured, groups: dict) -> dict:
        """Before stage ``stage``'s gradient buckets are cut: ``groups`` (param key -> the group its gradient is
        summed over) with the gradients this feature sends outside the dense buckets mapped to None."""
        return groups

    def plan_buckets(self, section, plan, stage: int, captured, groups: dict, cluster):
        """Stage ``stage``'s gradient buckets (``[[param key, ...], ...]``) where this feature cuts them itself, or
        None: DDP-style buckets at the ``data_parallel`` section's cap. Not called where a handed-back Plan's buckets
        fit."""
        return None

    def plan_schedule(self, section, plan, schedule):
        """Before capture, once the sections are decided: the schedule (``fxpar.schedule.Schedule``) with the
        actions this feature runs added (a copy), or ``schedule`` unchanged."""
        return schedule

    def plan_stage(self, section, plan, stage: int, captured, cluster, schedule) -> None:
        """After capture, once per stage, feature by feature in registration order (fxpar's ``data_parallel``
        first: it cuts the gradient buckets the others read): decisions that need the stage's joint graph
        (``captured``: its ``fxpar.capture.CapturedStep``) or the schedule (``fxpar.schedule.Schedule``), into
        ``section``."""

    # ---- the mechanism -----------------------------------------------------------------------------
    def make_passes(self, section) -> list:
        """``[(Slot, Pass)]``: this feature's passes and where each sits in the pass list."""
        return [(slot, make()) for slot, make in self.passes]

    def replaces(self, section) -> tuple:
        """Names of other features' passes this feature's passes do the work of: left out of the pass list
        (``fxpar.lower.default_passes``)."""
        return ()

    def after_split(self, section, parts: dict, joint, ctx) -> dict:
        """After ``split_graphs`` cut the stage's joint graph ``joint`` (``ctx``: the stage's PassContext) into
        ``parts`` (``{kind: SplitGraph}``): the graphs the stage runs (more kinds, or others in their place)."""
        return parts

    def rank_info(self, section, program, rank: int):
        """What rank ``rank``'s :class:`RankState` starts from (picklable), or None: no state on that rank."""
        return None

    def check_run(self, section, program, n_batches: int, resume_from) -> None:
        """Before ``program.run_local`` starts its ranks on ``n_batches`` batches (``resume_from``: the checkpoint it
        resumes from, or None): refuse, or warn about, a run this feature cannot serve as asked. Default: nothing."""

    # ---- what it costs and what it says --------------------------------------------------------------
    def held_shape(self, section, program, rank: int, stage: int, key: str, shape: tuple) -> tuple:
        """The shape of the piece of parameter ``key`` (of ``stage``; ``shape``: as the features before this one
        leave it) that rank ``rank`` holds and steps when the optimizer runs eagerly. Default: ``shape`` (the
        feature cuts nothing)."""
        return shape

    def state_bytes(self, section, program, rank: int) -> int:
        """Bytes rank ``rank`` holds for this feature beside what its graphs hold (per-rank state)."""
        return 0

    def action_bytes(self, section, program, action, graph) -> tuple:
        """``(bytes while it runs, bytes after its end)`` this feature's state makes for one compute ``action``
        (``fxpar.schedule.Action``) outside its ``graph`` (the stage's ``SplitGraph``), freed before the next:
        weights it computes for the graph to read, what it builds after an update. Default: none."""
        return (0.0, 0.0)

    def priced_calls(self, section, program, calls: dict, first) -> tuple | None:
        """Where the feature changes at run time what a rank runs in a step (a time budget that leaves microbatches
        out): ``(calls, lines)``, each rank's items as ``estimate()`` should price them (``calls``: rank -> the
        items the program lowered; ``first``: their Estimate) and plain-language lines on how, which the Estimate
        prints. None (default): priced as lowered."""
        return None

    def explain(self, section, program) -> list:
        """Plain-language lines for ``program.explain()`` (default: what ``print(plan)`` shows of the section)."""
        return [] if section is None else section.plan_lines(program.plan)

    def code(self, section, program, rank: int, threads: int | None = None) -> dict | None:
        """The code rank ``rank`` runs in place of its FX graphs where this feature replaces them (a compiler's
        output, for ``threads`` CPU threads; None: as ``run_local`` gives each rank): ``{label: text}`` with
        ``program.graphs(rank)``'s labels, for ``program.compiled_code``; None (the default): this feature runs the
        graphs as they are."""
        return None

    def window(self, section, program, rank: int) -> list:
        """Steps whose actions differ from the one step ``program.schedule(rank)`` lists, for its printout: a header
        line, then ``"  step T: ACTION ..."`` over one window of steps (a synchronisation method's averaging every H
        steps, its warm-up). Default: none (every step runs the same actions)."""
        return []

    def held_less(self, section, program) -> dict:
        """What each rank does not hold of the model state ``explain()`` lists per rank (one stage):
        ``{"gradients" | "parameters" | "optimizer state": (bytes, why)}``."""
        return {}

    # ---- ranks beside the workers ----------------------------------------------------------------------
    def extra_ranks(self, section, program, host) -> list:
        """Payloads of the ranks this feature runs after the workers' (``program.world_size`` on), one per rank,
        each an :class:`ExtraRank`; ``host``: the settings every rank's process applies to itself
        (:class:`fxpar.host.HostSettings`)."""
        return []

    def extra_runner(self, payload, program):
        """What ``program.runner()`` returns on one of :meth:`extra_ranks` under torchrun (the surface of
        ``fxpar.runner.RankRunner``: ``step``, ``save``, ``load``, ``state_dict``, ``close``)."""
        raise NotImplementedError(f"feature {self.name!r} runs ranks beside the workers but no runner for them")


# ---- the registry -------------------------------------------------------------------------------------
_REGISTRY: dict = {}          # name -> Feature instance, in registration order (the order within a Slot)
_OWNER: dict = {}             # option name -> feature name
_OPTIONS: dict = {}           # option name -> Option: every feature's own and every shared one
_SHARED: dict = {}            # shared option name -> the module that declared it
_LOADED: list = []
# the options the core Strategy owns itself (its dataclass fields), set by fxpar.strategy
_CORE_OPTIONS: set = set()


def _load_builtin() -> None:
    if not _LOADED:
        _LOADED.append(True)
        importlib.import_module(BUILTIN_FEATURES)


def register_shared_option(name: str, option: Option, module: str) -> Option:
    """Declare option ``name``, which several features share: each carries out some of its values and lists
    ``name`` in its ``enabled_by`` (``grad_sync``: one gradient-sync method per value). Off its default, an enabled
    feature must list it, or the Strategy is refused. ``module``: the declaring module, for messages."""
    if not name.isidentifier() or name in _CORE_OPTIONS or name in _OWNER:
        where = "the core Strategy" if name in _CORE_OPTIONS else f"feature {_OWNER.get(name)!r}"
        raise StrategyError(f"{module}: shared option {name!r} is " + ("not an identifier" if not name.isidentifier()
                            else f"owned by {where}") + "; name it differently")
    _SHARED[name] = module
    _OPTIONS[name] = option
    return option


def register_feature(cls):
    """Register a :class:`Feature` subclass (usable as a class decorator). Refuses a name already taken and an
    option another feature owns, naming both."""
    _load_builtin()
    if not (isinstance(cls, type) and issubclass(cls, Feature)):
        raise TypeError(f"register_feature({cls!r}): pass a subclass of fxpar.Feature")
    if not cls.name or not cls.name.isidentifier():
        raise StrategyError(f"feature {cls.__name__}: set `name` to an identifier (it keys the Plan section, the "
                            f"graph roles of its state and its checkpoint entries); got {cls.name!r}")
    old = _REGISTRY.get(cls.name)
    if old is not None and type(old) is not cls:
        if type(old).__qualname__ == cls.__qualname__ and type(old).__module__ == cls.__module__:
            _unregister(cls.name)          # the same class defined again (a re-run script or notebook cell)
        else:
            raise StrategyError(f"feature {cls.__module__}.{cls.__qualname__} is named {cls.name!r}, which "
                                f"{type(old).__module__}.{type(old).__qualname__} already registered; pick another name")
    for opt in cls.options:
        # a built-in feature may declare an option the core Strategy still holds as a field (the field keeps it)
        if opt in _CORE_OPTIONS and not cls.__module__.startswith(BUILTIN_FEATURES + "."):
            raise StrategyError(f"feature {cls.name!r} declares Strategy option {opt!r}, which the core Strategy "
                                f"owns ({', '.join(sorted(_CORE_OPTIONS))}); name your option differently")
        if opt in _SHARED:
            raise StrategyError(f"feature {cls.name!r} declares Strategy option {opt!r}, which several features "
                                f"share ({_SHARED[opt]} declares it): leave it out of `options`, list it in "
                                "`enabled_by` and test its value in `enabled()`")
        owner = _OWNER.get(opt)
        if owner is not None and owner != cls.name:
            raise StrategyError(f"feature {cls.name!r} ({cls.__module__}.{cls.__qualname__}) declares Strategy option "
                                f"{opt!r}, which feature {owner!r} ({type(_REGISTRY[owner]).__module__}) owns; "
                                "name your option differently")
    for other in tuple(cls.requires) + tuple(cls.conflicts_with):
        if not isinstance(other, str):
            raise StrategyError(f"feature {cls.name!r}: requires/conflicts_with list feature names (str), got {other!r}")
    _REGISTRY[cls.name] = cls()
    for opt, spec in cls.options.items():
        _OWNER[opt] = cls.name
        _OPTIONS[opt] = spec
    return cls


def unregister_feature(name: str) -> None:
    """Remove feature ``name`` from the registry (a test's or a notebook's own feature); unknown names are ignored."""
    _unregister(name)


def _unregister(name: str) -> None:
    feat = _REGISTRY.pop(name, None)
    for opt in getattr(feat, "options", {}):
        _OWNER.pop(opt, None)
        _OPTIONS.pop(opt, None)


def registered_features() -> list:
    """Every registered feature, in registration order."""
    _load_builtin()
    return list(_REGISTRY.values())


def get_feature(name: str) -> Feature:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no feature named {name!r}; registered: {sorted(_REGISTRY)}") from None


def schedule_features() -> list:
    """The registered pipeline schedule features (their section has ``picks_schedule``), in registration order."""
    return [f for f in registered_features() if f.section is not None and f.section.picks_schedule]


def schedule_names(asynchronous: bool | None = None) -> tuple:
    """The schedule names ``Strategy(schedule=...)`` takes, from the registered pipeline schedule features (their
    ``schedules``); ``asynchronous``: only those whose schedules keep several weight versions (True) or one (False)."""
    return tuple(n for f in schedule_features() if asynchronous is None or f.section.asynchronous == asynchronous
                 for n in getattr(f, "schedules", ()))


def option_owner(option: str) -> str | None:
    """The feature that owns ``option`` (None: a core field, a shared option or no option)."""
    _load_builtin()
    return _OWNER.get(option)


def option_spec(option: str) -> Option | None:
    """The :class:`Option` a feature (or a shared declaration) declares as ``option``; None if none does."""
    _load_builtin()
    return _OPTIONS.get(option)


def option_defaults() -> dict:
    """Every option the features declare (their own and the shared ones) and its default."""
    _load_builtin()
    return {k: o.default for k, o in _OPTIONS.items()}


def shared_options() -> dict:
    """Every shared option (:func:`register_shared_option`): name -> (Option, the features that list it in
    ``enabled_by``)."""
    _load_builtin()
    return {k: (_OPTIONS[k], [f.name for f in _REGISTRY.values() if k in f.enabled_by]) for k in _SHARED}


def enabled_features(strategy) -> list:
    """The features ``strategy`` enables, in registration order."""
    return [f for f in registered_features() if f.enabled(strategy)]


def settle_strategy(strategy) -> None:
    """Each enabled feature sets the options its own options imply (:meth:`Feature.settle`), before any check."""
    for f in registered_features():
        if f.enabled(strategy):
            f.settle(strategy)


def check_strategy(strategy) -> list:
    """Validate every enabled feature's options and the declared ``requires`` / ``conflicts_with`` between them,
    that a shared option off its default is carried out by an enabled feature, and that no feature left off has
    options given (:meth:`Feature.check_off`); returns the enabled features.
    Errors name both features and the options that enabled them."""
    on = enabled_features(strategy)
    names = {f.name for f in on}
    for f in registered_features():
        if f.name not in names:
            f.check_off(strategy)

    def why(f) -> str:
        set_ = [f"{k}={strategy.option(k)!r}" for k, o in f.options.items() if strategy.option(k) != o.default]
        set_ += [f"{k}={strategy.option(k)!r}" for k in f.enabled_by]
        return f"{f.name!r} ({', '.join(set_) or 'enabled'})"
    for f in on:
        f.validate(strategy)
        for other in f.conflicts_with:
            if other in names:
                raise StrategyError(f"{strategy}: feature {why(f)} conflicts with feature "
                                    f"{why(_REGISTRY[other])}: they do not compose; drop one of them")
        for other in f.requires:
            if other not in names:
                need = _REGISTRY.get(other)
                how = (f" (set one of its options: {', '.join(need.options)})" if need is not None and need.options
                       else "")
                raise StrategyError(f"{strategy}: feature {why(f)} requires feature {other!r}{how}")
    for name, (spec, carriers) in shared_options().items():
        v = strategy.option(name)
        if v != spec.default and not any(name in f.enabled_by for f in on):
            cls = (f"; {v.__name__} is a class: pass a setting of it, e.g. {name}={v.__name__}()"
                   if isinstance(v, type) else "")
            raise StrategyError(f"Strategy({name}={v!r}): choose {spec.default!r} (the default) or a method a "
                                f"registered feature carries out: {', '.join(repr(n) for n in carriers)}{cls}")
    return on


def section_from_dict(name: str, data: dict):
    """A Plan section back from its JSON form; unknown sections and fields are refused by name."""
    _load_builtin()
    feat = _REGISTRY.get(name)
    if feat is None or feat.section is None:
        known = sorted(n for n, f in _REGISTRY.items() if f.section is not None)
        raise ValueError(f"Plan.from_json: unknown feature section {name!r}; the sections that exist: {known} "
                         "(a section of your own Feature needs fxpar.register_feature(...) before loading)")
    fields = {f.name for f in dataclasses.fields(feat.section)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"Plan.from_json: section {name!r} has unknown field(s) {unknown}; its fields: {sorted(fields)}")
    return feat.section(**data)


# ---- graph helpers for a feature's pass ------------------------------------------------------------------
def add_state_input(gm: torch.fx.GraphModule, feature: str, name: str, val) -> torch.fx.Node:
    """A new placeholder ``("state", "<feature>.<name>")`` after the last one (``val``: a tensor of its shape and
    dtype, e.g. ``torch.empty(n)`` or a fake); the graph's signature lists it. The rank's RankState provides it."""
    g = gm.graph
    key = state_key(feature, name)
    with g.inserting_after(g.find_nodes(op="placeholder")[-1]):
        ph = g.placeholder(f"state_{feature}_{name}".replace(".", "_"))
    ph.meta["val"] = val
    M.set_meta(ph, M.ROLE, STATE_ROLE)
    gm.meta[M.SIGNATURE.name].inputs.append((STATE_ROLE, key))
    return ph


def add_state_output(gm: torch.fx.GraphModule, feature: str, name: str, node: torch.fx.Node) -> None:
    """Make ``node`` the graph output ``("new_state", "<feature>.<name>")``: the state's value for the next step."""
    out = gm.graph.find_nodes(op="output")[0]
    out.args = (tuple(out.args[0]) + (node,),)
    gm.meta[M.SIGNATURE.name].outputs.append((NEW_STATE_ROLE, state_key(feature, name)))
