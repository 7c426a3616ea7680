"""What every synchronisation method is: its options, when it averages, what it does with the average.

A synchronisation method (the value of ``Strategy(sync=...)``) changes *when* the data-parallel replicas agree, not
how a gradient is summed. Every method here shares one schedule, torch's post-local SGD
(``PostLocalSGDState(start_localSGD_iter=W, post_local_gradient_allreduce=False)`` with
``PeriodicModelAverager(period=H, warmup_steps=W)``), steps counted from 0:

* steps ``t < W`` (the warm-up): the gradient buckets are all-reduced, as plain data parallelism;
* steps ``t >= W``: no gradient collective; each replica steps its own optimizer with its own gradient;
* after the optimizer step of every step with ``t >= W`` and ``(t - W) % H == 0`` (``W``, ``W + H``, ...), the
  replicas' parameters are averaged over dp (one all-reduce of the parameters, each divided by dp first); the
  optimizer state is not averaged.

What each method does with the average (:meth:`SyncMethod.outer`):

* :class:`LocalSGD` keeps it (Lin, Stich, Patel and Jaggi, "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020);
* :class:`DiLoCo` treats ``anchor - average`` (``anchor``: the parameters at the last averaging) as a gradient of
  an outer optimizer that steps the anchor (Douillard et al., "DiLoCo: Distributed Low-Communication Training of
  Language Models", 2023, Algorithm 1); with ``fragments=F`` it is streaming DiLoCo (Douillard et al., "Streaming
  DiLoCo with overlapping communication: Towards a Distributed Free Lunch", 2025): the parameter tensors cut into
  ``F`` fragments, fragment ``f`` averaged and stepped by the outer optimizer on its own steps (:meth:`DiLoCo.
  fragment_averages`), optionally merged ``delay`` steps later; the fragments consecutive tensors or the model's
  blocks dealt round-robin (``pattern="strided"``), the pseudo-gradients sent in 4 bits (``quantize="e3m0"``);
* :class:`SlowMo` applies slow momentum: ``u = beta u + (anchor - average) / gamma``,
  ``x = anchor - alpha gamma u`` (``gamma``: the inner learning rate; Wang, Tantia, Ballas and Rabbat, "SlowMo:
  Improving Communication-Efficient Distributed SGD with Slow Momentum", ICLR 2020, Algorithm 1).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass
from typing import ClassVar

import torch

from fxpar.errors import StrategyError

from .quantize import FORMATS, wire_bytes

__all__ = ["SyncMethod", "LocalSGD", "DiLoCo", "SlowMo", "method_from_dict", "register_method", "METHODS",
           "fragment_keys", "model_blocks", "block_of", "PATTERNS"]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SyncMethod:
    """Base of a synchronisation method's options (a frozen dataclass of JSON values): ``period`` (steps between two
    averagings, ``H``) and ``warmup_steps`` (synchronous steps first, ``W``)."""
    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    # whether its outer step reads the parameters of the last averaging (kept per rank, checkpointed)
    keeps_anchor: ClassVar[bool] = True
    # whether the parameters live on parameter-server ranks (ClusterSpec(cpu_servers=k)) instead of being averaged
    uses_servers: ClassVar[bool] = False
    period: int = 1
    warmup_steps: int = 0

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        me = type(self).__name__
        if not _is_int(self.period) or self.period < 1:
            raise StrategyError(f"{me}(period={self.period!r}): the steps between two averagings of the replicas "
                                "must be an int >= 1 (1: average after every step)")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise StrategyError(f"{me}(warmup_steps={self.warmup_steps!r}): the synchronous steps before the "
                                "replicas train apart must be an int >= 0 (0: none)")

    # ---- the schedule ----------------------------------------------------------------------------------------
    def gradient_allreduce(self, step: int) -> bool:
        """Whether the gradient buckets are all-reduced at ``step`` (0 first): the warm-up's steps."""
        return step < self.warmup_steps

    def averages(self, step: int) -> bool:
        """Whether the replicas' parameters are averaged after ``step``'s optimizer step."""
        return step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0

    def averaging_steps(self, steps: int) -> list:
        """The steps among the first ``steps`` after which the replicas are averaged."""
        return [t for t in range(steps) if self.averages(t)]

    # ---- what it does with the average ------------------------------------------------------------------------
    def init_outer(self, anchor: dict) -> dict:
        """The rank's outer state from the parameters at the start (``{key: tensor}``, copies it may keep)."""
        return {}

    def outer(self, anchor: dict, average: dict, state: dict, inner_lr: float) -> tuple:
        """``(new parameters, new outer state)`` from ``anchor`` (the parameters at the last averaging) and
        ``average`` (the replicas' mean); the new parameters become the next anchor. Default: the average."""
        return average, state

    # ---- JSON and words ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"method": self.name, **dataclasses.asdict(self)}

    def summary(self) -> str:
        opts = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({opts})"

    def outer_words(self) -> str:
        """What the method does with each average, for plan notes and explain()."""
        return "the replicas continue from the average"


_LEVELS = ("node", "global")


@dataclass(frozen=True)
class LocalSGD(SyncMethod):
    """Post-local SGD: synchronous data parallelism for ``warmup_steps`` steps, then local steps with the replicas'
    parameters averaged every ``period`` steps (torch's ``PostLocalSGDOptimizer`` + ``PeriodicModelAverager``).

    ``hierarchical``: torch's ``HierarchicalModelAverager`` instead -- ``{period: group size}`` (the dp ranks cut
    into consecutive groups of that size, as ``dist.new_subgroups`` does; the largest period's group is every dp
    rank), or ``{"node": period, "global": period}`` (the ranks of one node; every dp rank). After step ``t >= W``
    the replicas are averaged within the groups of the largest period that divides ``t`` (torch counts ``t`` from
    0, not from the warm-up's end), and not at all where none does; ``period`` is then left at 1."""
    name: ClassVar[str] = "local_sgd"
    paper: ClassVar[str] = ("Lin, Stich, Patel and Jaggi, Don't Use Large Mini-Batches, Use Local SGD, ICLR 2020 "
                            "(post-local SGD)")
    keeps_anchor: ClassVar[bool] = False
    hierarchical: tuple = ()

    def __post_init__(self):
        h = self.hierarchical
        if isinstance(h, dict):
            h = tuple(h.items())
        elif isinstance(h, list):
            h = tuple(tuple(x) if isinstance(x, list) else x for x in h)
        object.__setattr__(self, "hierarchical", h if h is not None else ())
        super().__post_init__()

    def check(self) -> None:
        super().check()
        h = self.hierarchical
        if not h:
            return
        if not all(isinstance(x, tuple) and len(x) == 2 for x in h):
            raise StrategyError(f"LocalSGD(hierarchical={h!r}): pass {{period: group size}}, e.g. {{2: 4, 8: 16}}, "
                                "or {'node': period, 'global': period}")
        named = [k for k, _ in h if isinstance(k, str)]
        if named and (sorted(named) != sorted(_LEVELS) or len(h) != 2 or not all(_is_int(v) and v >= 1 for _, v in h)):
            raise StrategyError(f"LocalSGD(hierarchical={dict(h)!r}): the named form is {{'node': period, 'global': "
                                "period}} (both, each an int >= 1); or give {period: group size}")
        if not named and not all(_is_int(p) and p >= 1 and _is_int(g) and g >= 1 for p, g in h):
            raise StrategyError(f"LocalSGD(hierarchical={dict(h)!r}): periods and group sizes must be ints >= 1, "
                                "{period: group size}")
        if self.period != 1:
            raise StrategyError(f"LocalSGD(period={self.period}, hierarchical={dict(h)!r}): the periods are "
                                "hierarchical's keys; leave period at 1")

    def levels(self, dp: int, per_node: int) -> tuple:
        """``((period, group size), ...)`` by period, the named form resolved for ``dp`` replicas with ``per_node`` of
        them on one node; checked as torch's averager checks it (the largest period's group is every replica)."""
        h = self.hierarchical
        if h and isinstance(h[0][0], str):
            d = dict(h)
            h = ((d["node"], per_node), (d["global"], dp))
        h = tuple(sorted(h))
        for p, g in h:
            if dp % g:
                raise StrategyError(f"LocalSGD(hierarchical=...): a group of {g} replica(s) (period {p}) does not divide "
                                    f"dp={dp}; use group sizes that divide it")
        if h and h[-1][1] != dp:
            raise StrategyError(f"LocalSGD(hierarchical={dict(h)!r}): the largest period's group ({h[-1][1]}) must be "
                                f"every replica (dp={dp}), as torch's HierarchicalModelAverager requires")
        return h

    def averages(self, step: int) -> bool:
        if not self.hierarchical:
            return super().averages(step)
        return step >= self.warmup_steps and self.group_at(step) is not None

    def group_at(self, step: int, levels: tuple | None = None):
        """Hierarchical: the group size of the largest period dividing ``step`` (None: no averaging)."""
        if levels is None:
            h = self.hierarchical
            levels = tuple(sorted((v, k) for k, v in h)) if h and isinstance(h[0][0], str) else tuple(sorted(h))
        for p, g in reversed(levels):         # the largest period first ("node" / "global" before resolution)
            if step % p == 0:
                return g
        return None

    def summary(self) -> str:
        if not self.hierarchical:
            return f"LocalSGD(period={self.period!r}, warmup_steps={self.warmup_steps!r})"
        return f"LocalSGD(warmup_steps={self.warmup_steps!r}, hierarchical={dict(self.hierarchical)!r})"

    def to_dict(self) -> dict:
        out = {"method": self.name, "period": self.period, "warmup_steps": self.warmup_steps}
        if self.hierarchical:
            out["hierarchical"] = [list(x) for x in self.hierarchical]
        return out


def _outer_spec(outer) -> tuple:
    """``(torch optimizer class, kwargs)`` of DiLoCo's ``outer`` option, checked."""
    if not (isinstance(outer, (tuple, list)) and len(outer) == 2 and isinstance(outer[0], type)
            and issubclass(outer[0], torch.optim.Optimizer) and isinstance(outer[1], dict)):
        raise StrategyError(f"DiLoCo(outer={outer!r}): pass (torch optimizer class, its keyword arguments), e.g. "
                            "(torch.optim.SGD, {'lr': 0.7, 'momentum': 0.9, 'nesterov': True})")
    return outer[0], dict(outer[1])


SEQUENTIAL, STRIDED = "sequential", "strided"
PATTERNS = (SEQUENTIAL, STRIDED)
# streaming DiLoCo's options and their defaults (left out of the JSON and the summary when default)
_STREAMING = {"fragments": 1, "delay": 0, "mix": 0.0, "pattern": SEQUENTIAL, "quantize": None}


def block_of(key: str) -> str:
    """The block a parameter tensor belongs to, for strided fragments: its name up to its first numbered part (one
    child of a ``ModuleList`` or ``Sequential``: ``h.3.attn.c_attn.weight`` -> ``h.3``), else the module holding it
    (``transformer.wte.weight`` -> ``transformer.wte``; a parameter of the model itself: ``""``)."""
    parts = key.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1])


def model_blocks(keys) -> list:
    """``[(block, [keys])]``: ``keys`` (the parameter tensors in the model's order) grouped by :func:`block_of`, the
    blocks in the order of their first tensor."""
    out: dict = {}
    for k in keys:
        out.setdefault(block_of(k), []).append(k)
    return list(out.items())


def fragment_keys(keys, fragments: int, pattern: str = SEQUENTIAL) -> list:
    """Streaming DiLoCo's fragments of ``keys`` (the parameter tensors in the model's order). ``"sequential"``:
    ``fragments`` consecutive runs of tensors whose lengths differ by at most one (the first ones longer).
    ``"strided"``: the model's blocks (:func:`model_blocks`) dealt round-robin, fragment ``p`` holding blocks ``p,
    p + F, p + 2F, ...``, each fragment's tensors in the model's order."""
    keys = list(keys)
    if pattern == STRIDED:
        blocks = model_blocks(keys)
        return [[k for _, ks in blocks[f::fragments] for k in ks] for f in range(fragments)]
    q, r = divmod(len(keys), fragments)
    out, at = [], 0
    for f in range(fragments):
        n = q + (1 if f < r else 0)
        out.append(keys[at:at + n])
        at += n
    return out


@dataclass(frozen=True)
class DiLoCo(SyncMethod):
    """DiLoCo: the user's optimizer is the inner one; after every ``period`` steps the pseudo-gradient
    ``anchor - average`` is handed to the ``outer`` optimizer (a torch optimizer class and its keyword arguments),
    which steps the anchor; every replica continues from it. The outer optimizer's state is kept per rank.

    Streaming DiLoCo (Douillard et al. 2025): ``fragments=F`` cuts the parameter tensors into ``F`` consecutive
    fragments (:func:`fragment_keys`, the model's order); fragment ``p`` is averaged after the steps ``t >= W`` with
    ``(t - W - p H / F) % H == 0`` (``H``: ``period``, a multiple of ``F``; ``W``: ``warmup_steps``), and only its
    tensors go through the outer optimizer there (the paper's eq. for ``Delta_p`` and ``OuterOpt`` restricted to
    fragment ``p``): ``Delta_p = anchor_p - mean_m x_{m,p}``, ``anchor_p <- OuterOpt(anchor_p, Delta_p)``. The
    fragments' averagings are staggered, so each step moves ``1/F`` of the bytes one DiLoCo averaging moves.
    ``delay=tau`` (0 <= tau < H / F) overlaps the fragment's all-reduce with ``tau`` more inner steps: the outer
    step's result reaches the replicas after step ``t + tau``, merged as ``x_{m,p} <- mix x_{m,p} +
    (1 - mix) anchor_p`` (the paper's merge with ``alpha = mix``; 0: the replicas take the outer result). With
    ``fragments=1, delay=0`` it is DiLoCo.

    ``pattern="strided"`` deals the model's blocks (:func:`model_blocks`) to the fragments round-robin instead of
    cutting the tensors into consecutive runs (the paper's strided pattern). ``quantize="e3m0"`` sends each rank's
    pseudo-gradient ``anchor_p - x_{m,p}`` in the paper's 4-bit format (:mod:`fxpar.sync.quantize`): all-gathered,
    dequantized and averaged in float32 on every rank alike, then the outer optimizer's gradient."""
    name: ClassVar[str] = "diloco"
    paper: ClassVar[str] = ("Douillard et al., DiLoCo: Distributed Low-Communication Training of Language Models, "
                            "2023, Alg. 1")
    outer: tuple = (torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})
    fragments: int = 1
    delay: int = 0
    mix: float = 0.0
    pattern: str = SEQUENTIAL
    quantize: str | None = None

    def check(self) -> None:
        super().check()
        cls, kw = _outer_spec(self.outer)
        try:
            cls([torch.zeros(1, requires_grad=True)], **kw)
        except (TypeError, ValueError) as e:
            raise StrategyError(f"DiLoCo(outer=({cls.__name__}, {kw!r})): {cls.__name__} refuses these arguments "
                                f"({e}); pass ones it takes") from None
        f = self.fragments
        if not _is_int(f) or f < 1:
            raise StrategyError(f"DiLoCo(fragments={f!r}): the number of fragments the parameters are cut into must "
                                "be an int >= 1 (1: plain DiLoCo, every parameter at each averaging)")
        if self.period % f:
            raise StrategyError(f"DiLoCo(period={self.period}, fragments={f}): fragment p is averaged at offset "
                                f"p * period / fragments, so period must be a multiple of fragments; use period="
                                f"{-(-self.period // f) * f} or fragments dividing {self.period}")
        if not _is_int(self.delay) or not 0 <= self.delay < max(1, self.period // f):
            raise StrategyError(f"DiLoCo(delay={self.delay!r}): the inner steps a fragment's averaging overlaps must "
                                f"be an int in [0, period / fragments) = [0, {self.period // f}) (0: no overlap)")
        if not _is_number(self.mix) or not 0 <= self.mix <= 1:
            raise StrategyError(f"DiLoCo(mix={self.mix!r}): the weight of the replica's own fragment when the outer "
                                "result arrives must be a number in [0, 1] (0: take the outer result)")
        if self.mix and not self.delay:
            raise StrategyError(f"DiLoCo(mix={self.mix}, delay=0): the merge weighs the inner steps made while the "
                                "fragment was in flight; with no delay there are none: set delay >= 1 or leave mix "
                                "at 0")
        if self.pattern not in PATTERNS:
            raise StrategyError(f"DiLoCo(pattern={self.pattern!r}): how the parameters are cut into fragments must be "
                                "'sequential' (consecutive tensors) or 'strided' (fragment p holds the model's blocks "
                                "p, p + fragments, ...)")
        if self.quantize is not None and self.quantize not in FORMATS:
            raise StrategyError(f"DiLoCo(quantize={self.quantize!r}): the format the pseudo-gradients travel in; "
                                f"the formats built: {list(FORMATS)} (4 bits: 1 sign, 3 exponent, 0 mantissa bits), "
                                "or None for the parameters' own dtype")

    def __hash__(self):               # ``outer`` holds a dict: hash the JSON form
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    @property
    def streaming(self) -> bool:
        """Whether fragments, a delay, the strided pattern or quantized pseudo-gradients are set (else the whole model
        at once, DiLoCo's Algorithm 1)."""
        return self.fragments > 1 or self.delay > 0 or self.pattern != SEQUENTIAL or self.quantize is not None

    def fragment_keys(self, keys) -> list:
        """This method's fragments of ``keys`` (a stage's parameter tensors in the model's order)."""
        return fragment_keys(keys, self.fragments, self.pattern)

    def wire_bytes(self, sizes) -> int:
        """The bytes one rank sends to average tensors of ``sizes`` (``[(numel, element size)]``): the values
        themselves, or quantized, each tensor's scale and 4-bit codes."""
        if self.quantize is None:
            return sum(n * e for n, e in sizes)
        return sum(wire_bytes(n) for n, _ in sizes)

    def fragment_offset(self, f: int) -> int:
        return f * (self.period // self.fragments)

    def fragment_averages(self, f: int, step: int) -> bool:
        """Whether fragment ``f``'s replicas are averaged (its all-reduce started) after ``step``'s update."""
        t = step - self.warmup_steps - self.fragment_offset(f)
        return t >= 0 and t % self.period == 0

    def averages(self, step: int) -> bool:
        return any(self.fragment_averages(f, step) for f in range(self.fragments))

    def make_outer(self, params: list) -> torch.optim.Optimizer:
        cls, kw = _outer_spec(self.outer)
        return cls(params, **kw)

    def to_dict(self) -> dict:
        cls, kw = _outer_spec(self.outer)
        out = {"method": self.name, "period": self.period, "warmup_steps": self.warmup_steps,
               "outer": [f"{cls.__module__}.{cls.__qualname__}", kw]}
        for k, default in _STREAMING.items():
            if getattr(self, k) != default:
                out[k] = getattr(self, k)
        return out

    def summary(self) -> str:
        extra = "".join(f", {k}={getattr(self, k)!r}" for k, default in _STREAMING.items()
                        if getattr(self, k) != default)
        return f"DiLoCo(period={self.period!r}, warmup_steps={self.warmup_steps!r}, outer={self.outer!r}{extra})"

    def outer_words(self) -> str:
        cls, kw = _outer_spec(self.outer)
        words = (f"the outer optimizer {cls.__name__}({', '.join(f'{k}={v!r}' for k, v in kw.items())}) steps the "
                 "parameters of the last averaging with their difference to the average as its gradient")
        if self.fragments > 1:
            cut = "the model's blocks p, p + F, ..." if self.pattern == STRIDED else "consecutive tensors"
            words += (f", one fragment of {self.fragments} at a time (fragment p: {cut}; after steps t with "
                      f"(t - {self.warmup_steps} - p*{self.period // self.fragments}) % {self.period} == 0)")
        if self.quantize:
            words += (f"; each rank's pseudo-gradient travels in {self.quantize.upper()} (4 bits and a float32 scale "
                      "per tensor, all-gathered), the ranks' mean taken in float32")
        if self.delay:
            words += (f"; the result reaches the replicas {self.delay} step(s) later, merged as {self.mix} x own + "
                      f"{1 - self.mix} x outer")
        return words


@dataclass(frozen=True)
class SlowMo(SyncMethod):
    """SlowMo on local SGD (``base="localsgd"``): after every ``period`` steps ``u = slow_momentum u +
    (anchor - average) / lr`` and ``x = anchor - slow_lr lr u`` (``lr``: the inner optimizer's learning rate then)."""
    name: ClassVar[str] = "slowmo"
    paper: ClassVar[str] = ("Wang, Tantia, Ballas and Rabbat, SlowMo: Improving Communication-Efficient Distributed "
                            "SGD with Slow Momentum, ICLR 2020, Alg. 1")
    slow_lr: float = 1.0
    slow_momentum: float = 0.5
    base: str = "localsgd"

    def check(self) -> None:
        super().check()
        if self.base != "localsgd":
            raise StrategyError(f"SlowMo(base={self.base!r}): the base algorithm between two averagings; "
                                "'localsgd' is the one built (each replica steps its own optimizer)")
        if not _is_number(self.slow_lr) or self.slow_lr <= 0:
            raise StrategyError(f"SlowMo(slow_lr={self.slow_lr!r}): the slow learning rate alpha must be a number > 0 "
                                "(1.0: the paper's default)")
        if not _is_number(self.slow_momentum) or not 0 <= self.slow_momentum < 1:
            raise StrategyError(f"SlowMo(slow_momentum={self.slow_momentum!r}): the slow momentum beta must be a "
                                "number in [0, 1) (0: no slow momentum)")

    def init_outer(self, anchor: dict) -> dict:
        return {k: torch.zeros_like(v) for k, v in anchor.items()}

    def outer(self, anchor: dict, average: dict, state: dict, inner_lr: float) -> tuple:
        u = {k: self.slow_momentum * state[k] + (anchor[k] - average[k]) / inner_lr for k in anchor}
        return {k: anchor[k] - (self.slow_lr * inner_lr) * u[k] for k in anchor}, u

    def outer_words(self) -> str:
        return (f"slow momentum u = {self.slow_momentum} u + (x_prev - x_avg) / lr, then "
                f"x = x_prev - {self.slow_lr} lr u (x_prev: the parameters of the last averaging)")


METHODS: dict = {}            # method name -> class (register_method)


def register_method(cls):
    """Make a :class:`SyncMethod` subclass readable from a Plan section (``method_from_dict``) by its ``name``."""
    METHODS[cls.name] = cls
    return cls


for _cls in (LocalSGD, DiLoCo, SlowMo):
    register_method(_cls)


def method_from_dict(data: dict) -> SyncMethod:
    """The method a Plan section's ``method`` (``SyncMethod.to_dict()``) describes."""
    name = data.get("method")
    cls = METHODS.get(name)
    if cls is None:
        raise StrategyError(f"Plan section 'sync' names method {name!r}; the methods: {sorted(METHODS)}")
    opts = {k: v for k, v in data.items() if k != "method"}
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(opts) - fields)
    if unknown:
        raise StrategyError(f"{cls.__name__}: unknown option(s) {unknown}; its options: {sorted(fields)}")
    if cls is DiLoCo and "outer" in opts:
        path, kw = opts["outer"]
        mod, _, qual = path.rpartition(".")
        opts["outer"] = (getattr(importlib.import_module(mod), qual), dict(kw))
    return cls(**opts)
