"""Distributed Any-Batch Mirror Descent (:class:`DABMD`): a time budget per round, a mirror step, a consensus.

Eshraghi and Liang, "Distributed Online Optimization over a Heterogeneous Network with Any-Batch Mirror Descent",
ICML 2020. A round is one step. In round ``t`` node (dp replica) ``i`` holds ``x_i(t)`` and:

1. **any batch**: it takes its shard's microbatches one after another while the round's computing time
   ``round_time_s`` lasts (the first always; the next only if the time used so far plus the mean time of one
   microbatch so far stays within the budget), so its batch ``b_i(t)`` varies by node and by round and a straggler
   takes fewer; the rest of its shard is left out. ``g_i(t)`` is the mean gradient over the samples it took
   (each microbatch's mean gradient, averaged over the ``b_i(t)`` microbatches it took);
2. **mirror step**, from its own point: ``y_i = argmin_x <alpha g_i(t), x> + B_psi(x, x_i(t))`` (``alpha``: the
   optimizer's learning rate). Euclidean map ``psi = |x|^2 / 2``: ``y_i = x_i(t) - alpha g_i(t)``, the user's
   optimizer step (SGD: exactly this). Entropic map ``psi = sum x log x`` on the simplex (negative entropy,
   ``B_psi`` the KL divergence): ``y_i = x_i(t) exp(-alpha g_i(t)) / sum(x_i(t) exp(-alpha g_i(t)))``,
   exponentiated gradient;
3. **consensus**, one iteration over the doubly stochastic matrix ``P``: ``x_i(t + 1) = sum_j P_ij y_j`` (the
   nodes average their primal variables, as the paper's single-consensus version does). ``mixing="full"``:
   ``P_ij = 1/n`` (one all-reduce); ``mixing="ring"``: ``P_ij = 1/3`` for ``j`` in ``{i - 1, i, i + 1}`` mod ``n``
   (each node exchanges its parameters with its two ring neighbours). A convex combination of points of the
   simplex is on the simplex: the entropic map's parameters stay there.

The consensus weights are ``P``'s alone: the batch sizes enter only through ``g_i(t)``, a mean over the node's own
``b_i(t)`` samples (its variance falls as ``b_i(t)`` grows: the paper's bounds carry ``1 / b_i(t)``). The paper's
abstract fixes the primal averaging, one or several consensus iterations; the order (mirror step, then consensus)
is our reading of its algorithm, the one under which full mixing with equal batches is synchronous SGD.

``fixed_microbatches=(c_0, ..., c_{n-1})``: node ``i`` takes its first ``c_i`` microbatches every round, no
clock -- the deterministic mode the one-process reference (``fxpar.testing.sync.dabmd_reference``) is checked
against. ``RunResult.features[rank]["sync"]["batch_sizes"]``: the samples the rank took per round.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from fxpar.errors import StrategyError
from fxpar.runtime.groups import group
from fxpar.schedule import ActionKind

from .method import SyncMethod, _is_number, register_method
from .runtime import unflatten
from .runtime import SyncState, average_over

__all__ = ["DABMD", "DABMDState", "MIRRORS", "MIXINGS", "mixing_matrix", "simplex_problem"]

MIRRORS = ("euclidean", "entropic")
MIXINGS = ("full", "ring")
SIMPLEX_TOL = 1e-6            # how far a simplex parameter's sum may be from 1
_TAG_RIGHT, _TAG_LEFT = 7301, 7302     # consensus messages to the right / left ring neighbour
REPLICA_GROUP = "sync_replica"         # under tensor parallelism: the tp ranks of one dp replica


def mixing_matrix(mixing: str, n: int) -> list:
    """The doubly stochastic ``n x n`` matrix ``P`` (rows of floats) of ``mixing``: ``"full"`` ``1/n`` everywhere,
    ``"ring"`` ``1/3`` on the node and its two ring neighbours (``n >= 3``)."""
    if mixing == "full":
        return [[1.0 / n] * n for _ in range(n)]
    rows = []
    for i in range(n):
        row = [0.0] * n
        for j in (i - 1, i, i + 1):
            row[j % n] += 1.0 / 3
        rows.append(row)
    return rows


def simplex_problem(t: torch.Tensor) -> str:
    """Why tensor ``t`` is not a point of the probability simplex (every entry > 0, the entries summing to 1 within
    ``SIMPLEX_TOL``); "" when it is."""
    if not t.is_floating_point():
        return f"its dtype is {t.dtype}"
    if t.numel() == 0:
        return "it is empty"
    low = float(t.min())
    if not low > 0:
        return f"its smallest entry is {low:g} (the entropic map needs every entry > 0)"
    total = float(t.sum())
    if abs(total - 1.0) > SIMPLEX_TOL:
        return f"its entries sum to {total:g}, not 1"
    return ""


@register_method
@dataclass(frozen=True, repr=False)
class DABMD(SyncMethod):
    """Distributed Any-Batch Mirror Descent (module docstring): each round a node takes as many microbatches of its
    shard as ``round_time_s`` allows (or ``fixed_microbatches[i]``), steps by the ``mirror`` map with their mean
    gradient, and mixes its parameters with its neighbours' by ``mixing``. ``simplex``: the parameter keys the
    entropic map steps (each whole tensor a point of the simplex); empty with ``mirror="entropic"``: every
    parameter."""
    name: ClassVar[str] = "dabmd"
    paper: ClassVar[str] = ("Eshraghi and Liang, Distributed Online Optimization over a Heterogeneous Network with "
                            "Any-Batch Mirror Descent, ICML 2020")
    keeps_anchor: ClassVar[bool] = False
    options: ClassVar[tuple] = ("round_time_s", "mirror", "mixing", "simplex", "fixed_microbatches")
    round_time_s: float | None = 0.5
    mirror: str = "euclidean"
    mixing: str = "full"
    simplex: tuple = ()
    fixed_microbatches: tuple = ()

    def __post_init__(self):
        for f in ("simplex", "fixed_microbatches"):
            v = getattr(self, f)
            if isinstance(v, list):
                object.__setattr__(self, f, tuple(v))
            elif v is None:
                object.__setattr__(self, f, ())
        super().__post_init__()

    def check(self) -> None:
        if self.period != 1 or self.warmup_steps != 0:
            raise StrategyError(f"DABMD(period={self.period!r}, warmup_steps={self.warmup_steps!r}): every round "
                                "mixes the replicas and there is no warm-up; leave both out")
        if self.fixed_microbatches:
            if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in self.fixed_microbatches):
                raise StrategyError(f"DABMD(fixed_microbatches={self.fixed_microbatches!r}): one count per dp rank, "
                                    "each an int >= 1 (the microbatches that rank takes every round)")
            if self.round_time_s is not None:
                raise StrategyError(f"DABMD(round_time_s={self.round_time_s!r}, fixed_microbatches="
                                    f"{self.fixed_microbatches!r}): the fixed counts replace the round's clock; pass "
                                    "round_time_s=None with them, or drop fixed_microbatches")
        elif (not _is_number(self.round_time_s) or not math.isfinite(self.round_time_s)
              or self.round_time_s <= 0):
            raise StrategyError(f"DABMD(round_time_s={self.round_time_s!r}): each round's computing time must be a "
                                "number of seconds > 0 (e.g. round_time_s=0.5), or pass fixed_microbatches=(...) "
                                "for fixed per-rank batches")
        if self.mirror not in MIRRORS:
            raise StrategyError(f"DABMD(mirror={self.mirror!r}): the mirror map is one of {list(MIRRORS)} "
                                "('euclidean': an SGD step; 'entropic': exponentiated gradient on the simplex)")
        if self.mixing not in MIXINGS:
            raise StrategyError(f"DABMD(mixing={self.mixing!r}): the consensus matrix is one of {list(MIXINGS)} "
                                "('full': every replica 1/n; 'ring': the replica and its two ring neighbours 1/3 each)")
        if not all(isinstance(k, str) for k in self.simplex):
            raise StrategyError(f"DABMD(simplex={self.simplex!r}): name the simplex parameters by their keys "
                                "(strings, as model.named_parameters() names them)")
        if self.simplex and self.mirror != "entropic":
            raise StrategyError(f"DABMD(mirror={self.mirror!r}, simplex={list(self.simplex)!r}): simplex names the "
                                "parameters the entropic map steps; pass mirror='entropic' or drop simplex")

    # ---- what the Strategy and the program must allow --------------------------------------------------------
    def check_strategy(self, strategy) -> None:
        """Refusals with DABMD's reasons (``SyncFeature.validate`` calls it before the generic ones)."""
        me = f"Strategy(sync={self.summary()}"
        if strategy.option("zero"):
            raise StrategyError(f"{me}, zero={strategy.option('zero')!r}): ZeRO shards one model's parameters and "
                                "optimizer state over the dp replicas, while DABMD's replicas take different batches "
                                "and hold different parameters after a ring's consensus; drop zero or drop sync")
        if strategy.tp > 1 and self.mirror == "entropic":
            raise StrategyError(f"{me}, tp={strategy.tp}): the entropic map normalises each simplex parameter over "
                                "all its entries (x exp(-lr g) / sum), and tensor parallelism may split a parameter "
                                "into shards whose sums are not the whole one's; use mirror='euclidean' (it composes "
                                "with tp) or train with tp=1")
        if strategy.pp > 1 or strategy.schedule is not None:
            raise StrategyError(f"{me}, pp={strategy.pp}): the round's time budget admits one stage's microbatches "
                                "on one rank, and a pipeline spreads each microbatch over stages; train with pp=1 "
                                "or drop sync")
        m = strategy.microbatches
        if m < 2:
            raise StrategyError(f"{me}, microbatches={m}): a rank takes or leaves its shard microbatch by microbatch "
                                "within the round's time, and with one microbatch it always takes the whole shard; "
                                "set microbatches to 2 or more (the per-rank batch size: one sample each)")
        if self.fixed_microbatches:
            counts = self.fixed_microbatches
            if len(counts) != strategy.dp:
                raise StrategyError(f"{me}): fixed_microbatches has {len(counts)} count(s) for dp={strategy.dp} "
                                    "replicas; give one count per dp rank")
            if max(counts) > m:
                raise StrategyError(f"{me}, microbatches={m}): fixed_microbatches asks for {max(counts)} "
                                    f"microbatches of a shard cut into {m}; use counts <= {m}")
        if self.mixing == "ring" and strategy.dp < 3:
            raise StrategyError(f"Strategy(dp={strategy.dp}, sync={self.summary()}): a ring's two neighbours are one "
                                "rank at dp=2; use mixing='full', or dp >= 3")

    def simplex_keys(self, keys) -> tuple:
        """The parameter keys the entropic map steps, of a stage's ``keys``."""
        if self.mirror != "entropic":
            return ()
        return tuple(k for k in keys if k in self.simplex) if self.simplex else tuple(keys)

    def check_program(self, params: dict, optimizer) -> None:
        """Before a run: the entropic map's parameters exist and lie on the simplex, and their step is the paper's
        (plain SGD's learning rate, no momentum or weight decay)."""
        if self.mirror != "entropic":
            return
        me = f"Strategy(sync={self.summary()})"
        unknown = sorted(set(self.simplex) - set(params))
        if unknown:
            raise StrategyError(f"{me}: simplex names {unknown}, which are not parameters of the model (its "
                                f"parameters: {sorted(params)[:8]}); name them as model.named_parameters() does")
        for k in self.simplex_keys(sorted(params)):
            why = simplex_problem(params[k].detach())
            if why:
                hint = ("list only the simplex parameters in simplex=(...)" if not self.simplex else
                        "initialise it on the simplex (e.g. torch.softmax(x, 0) or x / x.sum() for x > 0)")
                raise StrategyError(f"{me}: parameter {k!r} is not on the probability simplex ({why}), so the "
                                    f"entropic map does not fit it; {hint}, or use mirror='euclidean'")
        kw = getattr(optimizer, "kwargs", {}) or {}
        if getattr(optimizer, "cls", None) is not torch.optim.SGD or kw.get("momentum", 0) or kw.get("weight_decay", 0):
            name = getattr(getattr(optimizer, "cls", None), "__name__", optimizer)
            raise StrategyError(f"{me} with optimizer {name}({kw}): the entropic map steps the simplex parameters "
                                "by exponentiated gradient with the optimizer's learning rate as its step size; pass "
                                "optimizer=(torch.optim.SGD, {'lr': ...}) without momentum or weight decay")

    # ---- the schedule: every round mixes ----------------------------------------------------------------------
    def averages(self, step: int) -> bool:
        return True

    def matrix(self, n: int) -> list:
        return mixing_matrix(self.mixing, n)

    # ---- JSON and words ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {"method": self.name, "round_time_s": self.round_time_s, "mirror": self.mirror, "mixing": self.mixing}
        if self.simplex:
            out["simplex"] = list(self.simplex)
        if self.fixed_microbatches:
            out["fixed_microbatches"] = list(self.fixed_microbatches)
        return out

    def summary(self) -> str:
        opts = [f"round_time_s={self.round_time_s!r}", f"mirror={self.mirror!r}", f"mixing={self.mixing!r}"]
        if self.simplex:
            opts.append(f"simplex={list(self.simplex)!r}")
        if self.fixed_microbatches:
            opts.append(f"fixed_microbatches={list(self.fixed_microbatches)!r}")
        return f"DABMD({', '.join(opts)})"

    def __repr__(self) -> str:
        return self.summary()

    def budget_words(self) -> str:
        if self.fixed_microbatches:
            return (f"dp rank i takes its first fixed_microbatches[i] microbatches every round "
                    f"({list(self.fixed_microbatches)})")
        return (f"each rank takes its shard's microbatches while the round's {self.round_time_s} s of computing last "
                "(at least one), so a slower rank takes fewer")

    def outer_words(self) -> str:
        step = ("an SGD step (the user's optimizer)" if self.mirror == "euclidean" else
                "exponentiated gradient on the simplex parameters (x exp(-lr g) / sum), the optimizer's step on the "
                "others")
        mix = ("every replica's parameters averaged (P = 1/n, one all-reduce)" if self.mixing == "full" else
               "each replica's parameters averaged with its two ring neighbours' (P = 1/3 each, point to point)")
        return f"the mirror step is {step} with the mean gradient of the samples taken; then {mix}"

    def note(self) -> str:
        return (f"sync: {self.summary()} -- {self.budget_words()}; {self.outer_words()}. The batch sizes differ by "
                "rank and round (RunResult.features[rank]['sync']['batch_sizes']); the loss is the mean over the "
                "ranks of each rank's mean over the samples it took. state_dict() and checkpoints hold the replicas' "
                "average, each replica's own weights are in RunResult.features[rank]['sync']['replica'] "
                "(docs/semantics.md, 'Synchronisation methods')")

    def explain_lines(self) -> list:
        return [f"every round: {self.budget_words()}; {self.outer_words()}; the batch sizes are recorded per rank "
                "and round"]

    # ---- what estimate() prices: the microbatches each rank's speed admits ------------------------------------------
    def taken(self, i: int, microbatch_s: float, m: int) -> int:
        """How many of its ``m`` microbatches dp rank ``i`` takes per round when one takes it ``microbatch_s``
        seconds (its forward and backward): ``fixed_microbatches[i]``, or under the budget the rule of
        :meth:`DABMDState._takes` in steady state -- microbatch ``j >= 1`` is taken while ``(j + 1) * microbatch_s <=
        round_time_s`` -- so ``floor(round_time_s / microbatch_s)``, at least one and at most ``m``."""
        if self.fixed_microbatches:
            return min(m, self.fixed_microbatches[i])
        if microbatch_s <= 0:
            return m
        return max(1, min(m, math.floor(self.round_time_s / microbatch_s * (1 + 1e-9))))

    @staticmethod
    def replica_groups(dp: int, tp: int) -> list:
        """The ranks of each dp replica (``pp=1``: rank = dp index * tp + tp index): under tensor parallelism they
        agree on every microbatch they take."""
        return [list(range(d * tp, (d + 1) * tp)) for d in range(dp)]

    def priced_calls(self, program, calls: dict, first) -> tuple:
        """Each rank's step as its round runs it: the forward and backward of the microbatches it takes
        (:meth:`taken`, from its own seconds per microbatch in ``first``, the estimate of every microbatch: a
        straggler's are longer), then its update and the consensus; and the lines that say so. The round then
        lasts as long as the slowest rank's admitted microbatches, the update and the consensus (a rank stops
        taking microbatches when the next would overrun the budget, and waits for the others at the consensus)."""
        m = program.plan.microbatches
        per = program.plan.global_batch // max(1, program.dp * m)          # samples per microbatch
        tp = program.plan.tp
        secs = {r: first.work_time_s(r, lambda label: label[:1] in ("F", "B")) / m for r in calls}
        # a replica's tp ranks take a microbatch only where every one of them would (the slowest decides)
        k_of = {r: min(self.taken(r // tp, secs[q], m) for q in range(r - r % tp, r - r % tp + tp) if q in secs)
                for r in calls}
        out, rows = {}, {}
        for r, items in calls.items():
            mb_s, k = secs[r], k_of[r]
            out[r] = [it for it in items if _microbatch(getattr(it, "label", "")) < k]
            rows.setdefault((k, round(mb_s, 9)), []).append(r)
        budget = ("fixed_microbatches" if self.fixed_microbatches else
                  f"a budget of {self.round_time_s * 1e3:.3g} ms per round")
        said = "; ".join(f"{_ranks(rs)}: {k} of {m} microbatch(es), {k * per} samples per round "
                         f"({mb_s * 1e3:.3g} ms each)" for (k, mb_s), rs in sorted(rows.items(), key=lambda x: x[1][0]))
        return out, [f"DABMD, {budget}: {said}. The step above is a round: the slowest rank's microbatches, "
                     "its update and the consensus"]


def _microbatch(label: str) -> int:
    """The microbatch of a forward or backward item's label (``F0.3`` -> 3); -1 for any other item (kept)."""
    if label[:1] not in ("F", "B") or "." not in label:
        return -1
    tail = label.split(".", 1)[1]
    return int(tail) if tail.isdigit() else -1


def _ranks(rs: list) -> str:
    """``rank 3``, ``ranks 0-2``, ``ranks 0, 2``."""
    if len(rs) == 1:
        return f"rank {rs[0]}"
    run = len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1))
    return f"ranks {rs[0]}-{rs[-1]}" if run else f"ranks {', '.join(map(str, rs))}"


class DABMDState(SyncState):
    """One DABMD node: the round's admission of microbatches (its wrapped F and B actions), the mean gradient of
    the samples taken (its bucket sums), the entropic step and the consensus after the update, the batch sizes.
    Under tensor parallelism (Euclidean map) the rank is one tp rank of its replica: it mixes its own pieces over its
    dp group, and the replica's tp ranks max-reduce their stop flags before each microbatch after the first, so they
    take the same ones."""

    def setup(self, ex) -> None:
        super().setup(ex)
        self.n = self.dp
        self.me = list(self.info.dp_ranks).index(self.rank)
        self.m = ex.p.microbatches
        self.stage = next(iter(ex.params))
        self.row = self.sync.matrix(self.n)[self.me]
        self.simplex = self.sync.simplex_keys(sorted(ex.params[self.stage]))
        self.before = {k: ex.params[self.stage][k].detach().clone() for k in self.simplex}
        for k, v in self.before.items():
            why = simplex_problem(v)
            if why:
                raise RuntimeError(f"rank {self.rank}: Strategy(sync={self.sync.summary()}): parameter {k!r} is not "
                                   f"on the probability simplex ({why}); initialise it there or use mirror='euclidean'")
        # tensor parallelism: the replica's tp ranks, who stop taking microbatches together (a stop flag max-reduced)
        ranks = ex.p.bindings.get(REPLICA_GROUP)
        self.replica_pg = group(ranks, REPLICA_GROUP) if ranks and len(ranks) > 1 else None
        self.grads: dict = {}
        self.batch_sizes: list = []          # samples taken, per round
        self.taken: list = []                # microbatches taken, per round
        self.compute_s: list = []            # seconds from the round's first microbatch to its update
        self._round()

    def _round(self) -> None:
        self.count, self.samples, self.left_out, self.stopped = 0, 0, set(), False
        self.t0 = None

    # ---- the round's batch: which microbatches the rank takes ----------------------------------------------------
    def handlers(self, ex) -> dict:
        return {ActionKind.F: lambda a, w, idx: self._forward(ex, a, w, idx),
                ActionKind.B: lambda a, w, idx: self._backward(ex, a, w, idx),
                ActionKind.STEP: lambda a, w, idx: self._step(ex, a, w, idx)}

    def _takes(self, i: int) -> bool:
        if self.sync.fixed_microbatches:
            return i < self.sync.fixed_microbatches[self.me]
        if i == 0:
            return True
        if self.stopped:
            return False
        used = time.perf_counter() - self.t0
        if used + used / i > self.sync.round_time_s:     # the next microbatch would not end within the budget
            self.stopped = True
        if self.replica_pg is not None:                  # every tp rank of the replica takes it, or none does
            flag = torch.tensor([1.0 if self.stopped else 0.0], dtype=torch.float64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.replica_pg)
            self.stopped = bool(flag.item())
        return not self.stopped

    def _forward(self, ex, a, w, idx) -> None:
        i = a.microbatch
        if i == 0:
            self._round()
            self.t0 = time.perf_counter()
        if not self._takes(i):
            self.left_out.add(i)
            return
        ex._forward(a, w, idx)
        self.count += 1
        self.samples += int(w.micro[i][0].shape[0]) if w.micro[i] else 0

    def _backward(self, ex, a, w, idx) -> None:
        if a.microbatch not in self.left_out:
            ex._backward(a, w, idx)

    def _step(self, ex, a, w, idx) -> None:
        """The loss of the round: the mean over the microbatches taken (the executor divides by all of them)."""
        w.loss_sums[0] *= self.m / self.count
        self.compute_s.append(time.perf_counter() - self.t0)
        self.batch_sizes.append(self.samples)
        self.taken.append(self.count)
        ex._step(a, w, idx)

    # ---- the gradient: the mean over the samples taken ------------------------------------------------------------
    def sum(self, flat, feature: str, stage: int, index: int, overlapped: bool = False):
        """The bucket's sum (the rank's own gradient, :class:`GradientStep`) scaled from the mean over all ``m``
        microbatches to the mean over the ``b`` taken; the simplex parameters' gradients kept for the entropic
        step."""
        g = super().sum(flat, feature, stage, index, overlapped) * (self.m / self.count)
        if self.simplex:
            b = self.buckets[(stage, index)]
            for k, shape, off in zip(b.keys, b.shapes, b.offsets):
                if k in self.before:
                    n = int(torch.Size(shape).numel())
                    self.grads[k] = g[off:off + n].view(shape).clone()
        return g

    # ---- after the update: the entropic step, the consensus ---------------------------------------------------
    def after_update(self, ex, stage: int) -> None:
        self.step += 1
        ps = dict(ex.params[stage])
        if self.simplex:
            lr = float(ex.torch_opt.param_groups[0]["lr"])
            for k in self.simplex:
                y = self.before[k] * torch.exp(-lr * self.grads[k])
                ps[k] = y / y.sum()
        ps = self._mix(ps)
        ex.params[stage] = ps
        self.before = {k: ps[k].detach().clone() for k in self.simplex}
        self.averaged.append(self.step - 1)

    def _mix(self, ps: dict) -> dict:
        """``x_i = sum_j P_ij y_j``: one all-reduce (full), or the two ring neighbours' parameters (ring)."""
        if self.sync.mixing == "full":
            return average_over(ps, self.pg, self.n)
        keys = [k for k in sorted(ps) if isinstance(ps[k], torch.Tensor) and ps[k].is_floating_point()]
        out = dict(ps)
        for dtype in sorted({ps[k].dtype for k in keys}, key=str):
            ks = [k for k in keys if ps[k].dtype == dtype]
            mine = torch.cat([ps[k].detach().reshape(-1) for k in ks])
            ranks = self.info.dp_ranks
            left, right = (self.me - 1) % self.n, (self.me + 1) % self.n
            got = {left: torch.empty_like(mine), right: torch.empty_like(mine)}
            works = [dist.isend(mine, ranks[right], tag=_TAG_RIGHT), dist.isend(mine, ranks[left], tag=_TAG_LEFT),
                     dist.irecv(got[left], ranks[left], tag=_TAG_RIGHT),
                     dist.irecv(got[right], ranks[right], tag=_TAG_LEFT)]
            for wk in works:
                wk.wait()
            got[self.me] = mine
            flat = None
            for j in sorted(got):                      # sum_j P_ij y_j, j in rank order
                term = self.row[j] * got[j]
                flat = term if flat is None else flat + term
            out.update(unflatten(flat, ks, ps))
        return out

    # ---- what the run tells, and checkpoints ------------------------------------------------------------------
    def report(self):
        return {"replica": {k: v.clone() for ps in self.ex.params.values() for k, v in ps.items()},
                "steps": self.step, "averaged_steps": list(self.averaged), "batch_sizes": list(self.batch_sizes),
                "microbatches_taken": list(self.taken), "compute_s": list(self.compute_s), "mixing_row": list(self.row)}

    def save(self) -> dict:
        return {**super().save(), "batch_sizes": list(self.batch_sizes), "taken": list(self.taken),
                "before": {k: v.clone() for k, v in self.before.items()}}

    def load(self, saved: dict) -> None:
        super().load(saved)
        self.batch_sizes = list(saved["batch_sizes"])
        self.taken = list(saved["taken"])
        self.before = {k: v.clone() for k, v in saved["before"].items()}
