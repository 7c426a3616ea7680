"""BAGUA's decentralized SGD: no gradient all-reduce; each replica's weights are averaged with its peers'.

Lian, Zhang, Zhang, Hsieh, Zhang and Liu, "Can Decentralized Algorithms Outperform Centralized Algorithms? A Case
Study for Decentralized Parallel Stochastic Gradient Descent", NeurIPS 2017, Algorithm 1 (D-PSGD), as BAGUA runs it
(Gan, Lian, Zhang, Liu et al., "BAGUA: Scaling up Distributed Learning with System Relaxations", PVLDB 15(4), 2022;
bagua's ``decentralized`` algorithm). Each dp rank ``r`` keeps its own weights ``x_r``. At step ``t`` (0 first):

1. it computes its gradient ``g_r`` on its own shard at its own weights ``x_r`` (no gradient collective);
2. on an averaging step (``t % communication_interval == 0``) it averages the weights the gradient was taken at with
   its peers': ``y_r = sum_j W_rj x_j``; on the other steps ``y_r = x_r``;
3. its optimizer steps from ``y_r`` with ``g_r``: ``x_r <- y_r - lr g_r`` for SGD.

The average is of the weights *before* the local update, and the update applies to the average (Lian et al.'s
``x_{k+1} = x_k W - lr dF(x_k)``): BAGUA's forward pre-hook starts the weights' communication, its post-backward hook
copies the averaged weights back into the parameters, and the optimizer steps after that.

**Peers** (``W``; ``k = t // communication_interval``, the averaging step's index):

* ``"all"``: every rank, weights ``1/dp`` (one all-reduce of the bucket's weights);
* ``"ring"``: the rank and its two ring neighbours ``r - 1`` and ``r + 1`` (mod dp), weights ``1/3`` (needs dp >= 3);
* ``"shift_one"``: one peer, weights ``1/2``, changing with ``k`` (bagua's pairing, needs an even dp): rank
  ``r < dp/2`` pairs with ``(k + r) mod (dp/2) + dp/2``, rank ``r >= dp/2`` with ``(r - dp/2 - k) mod (dp/2)``.

**How it runs here**: the method rides on the gradient-bucket sum. Its rank state
(:class:`DecentralizedState`) hands each bucket's sum the bucket's weights ``x_r`` as the rank holds them when the
bucket is summed (before the update); the sum exchanges them with the peers, keeps ``y_r - x_r`` as its state
``delta`` and returns the rank's own gradient (the bucket times dp) for the update. After the stage's update
(:meth:`DecentralizedState.after_update`) the rank adds ``delta`` to the updated weights:
``x_r <- opt(x_r, g_r) + (y_r - x_r)``, which is ``opt(y_r, g_r)`` for an optimizer whose step does not depend on the
weights' values -- every torch optimizer without weight decay. One with weight decay (AdamW's default 0.01) is
refused in full precision (:meth:`Decentralized.check_optimizer`).

**What travels** per bucket on an averaging step (``B = numel * element_size``): ``"all"`` one all-reduce of ``B``;
``"ring"`` one all-to-all handing ``2 B`` (the weights to each neighbour); ``"shift_one"`` one all-to-all handing
``B`` (to the peer). The exchanges are all-to-alls with a size of 0 to every rank but the peers (gloo and NCCL carry
the sends in one call, as bagua groups its sends and receives). Nothing on the other steps.

**What the user gets** (docs/semantics.md, "Replicas that differ"): ``RunResult.state_dict()``,
``optimizer_state()`` and the checkpoint's model keys hold the average over the dp replicas; each replica's own
weights are in ``RunResult.features[rank]["decentralized"]["replica"]``; the losses are each rank's loss on its
shard at its own weights, averaged; a checkpoint keeps each replica's own weights and optimizer state in its rank's
extra, and a resume on as many ranks restores them bitwise.

**Low precision** (``low_precision=True``; ``peers="ring"``, ``communication_interval=1``, as bagua's
``LowPrecisionDecentralizedAlgorithm``, which follows Tang, Gan, Zhang, Zhang and Liu, "Communication Compression for
Decentralized Training", NeurIPS 2018): the weights move *after* the update, and what travels is the change, not the
weights. Per bucket a rank keeps ``weight`` (its weights as its neighbours know them) and ``left``, ``right`` (its
copies of its neighbours'), all the starting weights at first; its weights are ``weight``. Each step: the optimizer
steps ``p = opt(weight, g_r)``; the difference ``z = p + left/3 + right/3 - 5/3 weight`` (the ring average's step
less ``weight``) is coded as one row of min-max uint8 codes (:func:`~fxpar.compress.bytegrad.quantize_rows`: a
float32 min and max, then a code per value) and sent to both neighbours in one all-to-all, ``2 (8 + numel)`` bytes;
each received code moves the copy of its sender, and the rank's own moves ``weight`` (:meth:`Decentralized.settle`).

**Order** (``order``): ``"combine_then_adapt"`` (the default, above: BAGUA's and Lian et al.'s D-PSGD,
``x_{t+1} = W x_t - lr g(x_t)``) or ``"adapt_then_combine"`` (the diffusion order of Sayed, "Adaptation, Learning, and
Optimization over Networks", Foundations and Trends in Machine Learning 7(4-5), 2014, §7.2 (ATC); Chen and Sayed,
IEEE TSP 60(8), 2012): each rank steps its own weights with its own gradient first, then averages the stepped weights
with its peers, ``x_{t+1} = W (x_t - lr g(x_t))``. The bucket's sum sends nothing and returns the rank's gradient;
after the stage's update (:meth:`DecentralizedState.after_update`) the rank averages each bucket's updated weights
over the same peers, with the same collectives and bytes as the default order, on the same averaging steps (``t %
communication_interval == 0``, after that step's update). Only the weights are averaged: each rank's optimizer
state (momentum, Adam's moments) stays its own, and the optimizer steps from the rank's own weights, so weight
decay runs.

*The reduction to data parallelism*: with ``peers="all"`` (``W = 11^T / dp``), ``communication_interval=1`` and
an optimizer whose step is linear in the gradient and the weights -- SGD, with momentum, dampening, Nesterov and
weight decay -- adapt-then-combine is synchronous data-parallel training: the replicas start equal, each rank's
gradient is taken at the same weights, and averaging the ``dp`` steps is the step of the averaged gradient, since the
mean of the ranks' momentum buffers obeys the buffer's own recursion in the mean gradient (each rank's buffer differs;
the weights do not). Adam, Adagrad and other steps that are not linear in the gradient average ``dp`` different
steps, which is not the step of the mean gradient. Combine-then-adapt is data parallelism on the first step only:
from the second on each rank's gradient is taken at weights not yet averaged with its peers' last step.

Where this differs from bagua: bagua averages ``hierarchical``ly (inside a node first) by default; here dp is one
flat group. Bagua's full-precision decentralized op has no ``"ring"`` (its low-precision op does); here full
precision has it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from fxpar.compress.bytegrad import dequantize_rows, quantize_rows
from fxpar.compress.describe import tensor_lines
from fxpar.compress.feature import STEADY_STEP, register_method
from fxpar.compress.method import BucketInfo, Comm, Method
from fxpar.compress.runtime import CompressState, EagerComm
from fxpar.errors import StrategyError
from fxpar.runtime.state import load_replica_state, replica_state

__all__ = ["Decentralized", "DecentralizedState", "peers_of"]

MIX, LOCAL, LOW, MIX_AFTER = "mix", "local", "low_precision", "mix_after"
PEERS = ("all", "ring", "shift_one")
CTA, ATC = "combine_then_adapt", "adapt_then_combine"
ORDERS = (CTA, ATC)


def peers_of(peers: str, rank: int, dp: int, k: int) -> list:
    """The ranks whose weights rank ``rank`` of ``dp`` averages with its own at averaging step ``k``, in rank order
    (itself excluded; ``"all"``: every other rank)."""
    if peers == "all":
        return [j for j in range(dp) if j != rank]
    if peers == "ring":
        return sorted({(rank - 1) % dp, (rank + 1) % dp})
    half = dp // 2
    peer = (k + rank) % half + half if rank < half else (rank - half - k) % half
    return [peer]


def mix(peers: str, mine: torch.Tensor, theirs: dict) -> torch.Tensor:
    """The averaged weights of a rank from its own ``mine`` and its peers' ``theirs`` (``{rank: tensor}``): the
    expression every rank and the one-process reference evaluate, so both round alike."""
    if peers == "ring":
        low, high = sorted(theirs)
        return (theirs[low] + mine + theirs[high]) / 3
    (peer,) = theirs.values()
    return (mine + peer) / 2


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class DecentralizedState(CompressState):
    """A rank's :class:`~fxpar.compress.runtime.CompressState` for :class:`Decentralized`: it hands each bucket's sum
    the bucket's weights, moves the weights by the averaging's ``delta`` after the update, keeps this replica's own
    weights and optimizer state in checkpoints, and makes whole tensors (``state_dict()``, the checkpoint's model
    keys) the average over the dp replicas (a collective: every rank calls it)."""
    collective = True

    def setup(self, ex) -> None:
        super().setup(ex)
        self.ex = ex
        self.moved: dict = {}              # bucket -> averaging index k, for the buckets after_update moves this step
        if self.method.low_precision:      # the replica's own weights and its estimates of its neighbours': its own
            for key, b in self.buckets.items():
                w = self._flat(ex.params[b.stage], b)
                self.state[key] = {"weight": w.clone(), "left": w.clone(), "right": w.clone()}

    @staticmethod
    def _flat(params: dict, b: BucketInfo) -> torch.Tensor:
        return torch.cat([params[k].detach().reshape(-1) for k in b.keys])

    def inputs(self, b: BucketInfo, step: int, state: dict, variant) -> list:
        return [self._flat(self.ex.params[b.stage], b), *super().inputs(b, step, state, variant)]

    def sum(self, flat, feature, stage, index):
        key = (stage, index)
        b = self.buckets.get(key)
        mixes = b is not None and self.method.variant(b, self.steps[key], self.state[key]) in (MIX, MIX_AFTER)
        k = self.steps[key] // self.method.communication_interval if mixes else None
        out = super().sum(flat, feature, stage, index)
        if mixes:
            self.moved[key] = k
        return out

    def after_update(self, ex, stage: int) -> None:
        if self.method.low_precision:
            self._settle_low_precision(ex, stage)
            return
        keys = sorted(k for k in self.moved if k[0] == stage)
        if not keys:
            return
        ps = dict(ex.params[stage])
        for key in keys:
            b, k = self.buckets[key], self.moved.pop(key)
            if self.method.order == ATC:       # the updated weights averaged with the peers' (every rank, bucket order)
                averaged = self.method.combine(self._flat(ps, b), k, EagerComm(b.dp, b.dp_rank, self.pg))
                for name, v in zip(b.keys, b.views(averaged)):
                    ps[name] = v.clone()
                continue
            for name, d in zip(b.keys, b.views(self.state[key]["delta"])):
                ps[name] = ps[name] + d
        ex.params[stage] = ps

    def _settle_low_precision(self, ex, stage: int) -> None:
        """After the update: each bucket's weights settled by :meth:`Decentralized.settle` (the compressed
        difference exchanged with both neighbours); the rank's weights become the settled ones."""
        ps = dict(ex.params[stage])
        for key in sorted(k for k in self.buckets if k[0] == stage):
            b = self.buckets[key]
            comm = EagerComm(b.dp, b.dp_rank, self.pg)
            weight, self.state[key] = self.method.settle(self._flat(ps, b), dict(self.state[key]), b, comm)
            for k, v in zip(b.keys, b.views(weight)):
                ps[k] = v.clone()
        ex.params[stage] = ps

    def whole(self, ex, params: dict, state: dict) -> tuple:
        return _average(params, self.pg, len(self.info.dp_ranks)), _average(state, self.pg, len(self.info.dp_ranks))

    def report(self):
        return {"replica": {k: v.clone() for ps in self.ex.params.values() for k, v in ps.items()}}

    def save(self) -> dict:
        return {**super().save(), "replica": replica_state(self.ex)}

    def load(self, saved: dict) -> None:
        super().load(saved)
        load_replica_state(self.ex, saved.get("replica"), self.method.summary())


def _average(per_stage: dict, pg, dp: int) -> dict:
    """Each floating tensor of ``{stage: {key: tensor}}`` averaged over the dp group (stages and keys in sorted order
    on every rank); other tensors as they are."""
    if pg is None:
        return per_stage
    out = {}
    for s in sorted(per_stage):
        out[s] = dict(per_stage[s])
        for k in sorted(per_stage[s]):
            t = per_stage[s][k]
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                total = t.detach().clone()
                dist.all_reduce(total, group=pg)
                out[s][k] = total / dp
    return out


@register_method
@dataclass(frozen=True)
class Decentralized(Method):
    """BAGUA's decentralized SGD (Lian et al., NeurIPS 2017, D-PSGD; Gan et al., VLDB 2022): no gradient all-reduce;
    every ``communication_interval`` steps each replica's weights are averaged with its ``peers``' before its update
    (``order="combine_then_adapt"``) or after it (``"adapt_then_combine"``, Sayed 2014's diffusion order)."""
    name: ClassVar[str] = "decentralized"
    paper: ClassVar[str] = ("Lian et al., Can Decentralized Algorithms Outperform Centralized Algorithms?, NeurIPS "
                            "2017, Alg. 1 (D-PSGD); Gan, Lian, Zhang, Liu et al., BAGUA, PVLDB 15(4) 2022 "
                            "(decentralized)")
    eager: ClassVar[bool] = True
    rank_state: ClassVar[type] = DecentralizedState
    peers: str = "all"
    communication_interval: int = 1
    low_precision: bool = False
    order: str = CTA

    def __post_init__(self):
        self.check(0)

    # ---- options -----------------------------------------------------------------------------------
    def check(self, dp: int) -> None:
        if self.peers not in PEERS:
            raise StrategyError(f"Decentralized(peers={self.peers!r}): whose weights each replica averages with its "
                                f"own; one of {list(PEERS)} (bagua's peer_selection_mode)")
        n = self.communication_interval
        if not _is_int(n) or n < 1:
            raise StrategyError(f"Decentralized(communication_interval={n!r}): the steps between two averagings must "
                                "be an int >= 1 (1: average every step)")
        if not isinstance(self.low_precision, bool):
            raise StrategyError(f"Decentralized(low_precision={self.low_precision!r}): pass True or False")
        if self.order not in ORDERS:
            raise StrategyError(f"Decentralized(order={self.order!r}): when each replica averages its weights with its "
                                f"peers'; one of {list(ORDERS)} ({CTA!r}: before the update, BAGUA's; {ATC!r}: after "
                                "it)")
        if self.low_precision and self.order != CTA:
            raise StrategyError(f"Decentralized(low_precision=True, order={self.order!r}): the low-precision variant "
                                "(Tang et al. NeurIPS 2018) moves each replica toward its neighbours' weights of the "
                                f"step before, which is order={CTA!r}; pass order={CTA!r}, or low_precision=False")
        if self.low_precision and (self.peers != "ring" or n != 1):
            raise StrategyError(f"Decentralized(low_precision=True, peers={self.peers!r}, "
                                f"communication_interval={n!r}): the low-precision variant (bagua's, Tang et al. "
                                "NeurIPS 2018) exchanges every step "
                                "with both ring neighbours; pass peers='ring', communication_interval=1, or "
                                "low_precision=False")
        if dp and self.peers == "ring" and dp < 3:
            raise StrategyError(f"Strategy(dp={dp}, grad_sync=Decentralized(peers='ring')): a ring's two neighbours "
                                "are one rank when dp < 3; use peers='all' or 'shift_one', or dp >= 3")
        if dp and self.peers == "shift_one" and dp % 2:
            raise StrategyError(f"Strategy(dp={dp}, grad_sync=Decentralized(peers='shift_one')): shift_one pairs the "
                                "ranks, so dp must be even; use an even dp, or peers='all' or 'ring'")

    def check_plan(self, plan) -> None:
        if len(plan.stage_to_rank) > 1 or plan.asynchronous:
            raise StrategyError(f"Strategy(grad_sync={self.summary()}) with a pipeline (pp > 1): each dp replica's "
                                "weights are its own and are averaged per bucket, which is built for one stage per "
                                "rank only; train with pp=1")

    def check_optimizer(self, spec) -> None:
        wd = spec.kwargs.get("weight_decay", 1e-2 if spec.cls is torch.optim.AdamW else 0)
        if wd and not self.low_precision and self.order == CTA:   # the others step from the rank's own weights
            raise StrategyError(
                f"Strategy(grad_sync={self.summary()}) with optimizer {spec.name}(weight_decay={wd}): the update is "
                "applied to each replica's own weights and the averaging's change added after, which is BAGUA's update "
                "of the averaged weights only when the step does not depend on the weights' values. Pass "
                f"weight_decay=0 to {spec.name}, or add the decay to the loss; or pass "
                f"Decentralized(order={ATC!r}) (the update, then the averaging, which steps each replica's own weights)")

    def plan_note(self) -> str:
        how = ("after each update moves them toward its ring neighbours' by 8-bit codes of the change" if
               self.low_precision else f"every {self.communication_interval} step(s) averages them with its peers "
               f"({self.peers!r}) {'after' if self.order == ATC else 'before'} the update")
        return (f"no gradient all-reduce: each dp replica updates its own weights with its own gradient, and {how}; "
                "the replicas differ between averaging steps. state_dict(), optimizer_state() and checkpoints' "
                "model keys hold the replicas' average, RunResult.features[rank]['decentralized']['replica'] each "
                "replica's own (docs/semantics.md, 'Replicas that differ')")

    # ---- per bucket, on the host ----------------------------------------------------------------------
    def init_state(self, bucket: BucketInfo, gen: torch.Generator) -> dict:
        """Full precision: ``delta``, the averaging's change of the weights. Low precision: ``weight``, the replica's
        own weights as its neighbours know them, and ``left`` and ``right``, its copies of its neighbours' (the rank
        state sets all three to the starting weights)."""
        z = torch.zeros(bucket.numel, dtype=bucket.torch_dtype)
        if self.low_precision:
            return {"weight": z, "left": z.clone(), "right": z.clone()}
        if self.order == ATC:              # the averaging runs after the update, on the weights the rank holds then
            return {}
        return {"delta": z}

    def variant(self, bucket: BucketInfo, step: int, state: dict):
        """``"mix"`` (``"mix_after"`` in the adapt-then-combine order) on an averaging step, ``"local"`` on the
        others. The step the plan shows and the cost models count (``STEADY_STEP``) is an averaging step: the plan
        lists what an averaging step sends."""
        if self.low_precision:
            return LOW
        if step % self.communication_interval == 0 or step >= STEADY_STEP:
            return MIX_AFTER if self.order == ATC else MIX
        return LOCAL

    def host_inputs(self, bucket: BucketInfo, step: int, state: dict, variant, gen: torch.Generator) -> list:
        """The averaging step's index ``k = step // communication_interval`` (shift_one's pairing)."""
        return [torch.tensor(step // self.communication_interval)]

    # ---- per bucket, eager ---------------------------------------------------------------------------------
    def sum(self, flat, state, inputs, bucket, comm: Comm, variant) -> tuple:
        """``inputs``: the bucket's weights on this rank (before the update), then ``k``. Returns the rank's own
        gradient and ``delta``, the averaged weights less its own (zeros on a step that does not average)."""
        mine, k = inputs[0], int(inputs[1])
        local = flat * comm.size
        if variant in (LOW, MIX_AFTER) or (variant == LOCAL and self.order == ATC):
            return local, state            # the weights move after the update (settle, DecentralizedState)
        if variant == LOCAL:
            return local, {"delta": torch.zeros_like(mine)}
        return local, {"delta": self.combine(mine, k, comm) - mine}

    def combine(self, mine: torch.Tensor, k: int, comm) -> torch.Tensor:
        """This rank's weights ``mine`` (one bucket) averaged with its peers' at averaging step ``k``: ``(W x)_r``
        (``"all"``: one all-reduce; the others: one all-to-all with the peers)."""
        if self.peers == "all":
            return comm.all_reduce(mine) / comm.size
        return mix(self.peers, mine, _exchange(mine, peers_of(self.peers, comm.rank, comm.size, k), comm))

    def settle(self, updated: torch.Tensor, state: dict, bucket: BucketInfo, comm) -> tuple:
        """Low precision, after the update, one bucket: ``updated`` is the rank's weights after its optimizer step
        (from ``weight``). The difference ``z = updated + left/3 + right/3 - 5/3 weight`` (the averaged step's
        weights less ``weight``) goes as one row of min-max uint8 codes (ByteGrad's ``quantize_rows``) to both ring
        neighbours; each received code moves the copy of its sender, the rank's own moves ``weight``. Returns
        ``(weights, new_state)``: the rank's weights are ``weight``."""
        w, left, right = state["weight"], state["left"], state["right"]
        z = updated + left * (1 / 3) + right * (1 / 3) + w * (-5 / 3)
        packed = quantize_rows(z.view(1, -1)).reshape(-1)
        low, high = peers_of("ring", comm.rank, comm.size, 0)
        got = _exchange(packed, [low, high], comm)
        ring_left, ring_right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
        m = packed.numel()
        left = left + dequantize_rows(got[ring_left].view(1, m), w.dtype).reshape(-1)
        right = right + dequantize_rows(got[ring_right].view(1, m), w.dtype).reshape(-1)
        w = dequantize_rows(packed.view(1, m), w.dtype).reshape(-1) + w
        return w, {"weight": w, "left": left, "right": right}

    # ---- what it costs and says -----------------------------------------------------------------------------
    def wire_bytes(self, bucket: BucketInfo, variant) -> int:
        return sum(n for _, n in self.collectives(bucket, variant))

    def collectives(self, bucket: BucketInfo, variant) -> list:
        if variant == LOCAL:
            return []
        if variant == LOW:
            return [("all_to_all", 2 * (8 + bucket.numel))]
        nbytes = bucket.numel * bucket.element_size
        if self.peers == "all":
            return [("all_reduce", nbytes)]
        return [("all_to_all", nbytes * (2 if self.peers == "ring" else 1))]

    def describe(self, bucket: BucketInfo, variant) -> list:
        nbytes = bucket.numel * bucket.element_size
        if variant == LOW:
            return [f"Decentralized, low precision: no gradient collective; after each update the change of the "
                    f"bucket's weights from the ring average, as {bucket.numel} uint8 codes and a float32 min and max, "
                    f"sent to both ring neighbours ({2 * (8 + bucket.numel)} B in one all-to-all, {2 * nbytes} B in "
                    "full precision); the replicas differ"] + \
                tensor_lines(bucket, "its weights' change as uint8 codes against the bucket's float32 min and max, "
                             "to both ring neighbours; its gradient stays on the rank",
                             self.wire_bytes(bucket, variant), "weight change as uint8 codes + min/max share")
        how = {"all": f"all-reduced over the {bucket.dp} replicas ({nbytes} B), weights 1/{bucket.dp}",
               "ring": f"sent to both ring neighbours ({2 * nbytes} B in one all-to-all), weights 1/3",
               "shift_one": f"exchanged with one peer that changes each averaging ({nbytes} B in one all-to-all), "
                            "weights 1/2"}[self.peers]
        when = ("after the update (adapt, then combine)" if self.order == ATC
                else "before the update (combine, then adapt)")
        sent = {"all": "all-reduced", "ring": "sent to both ring neighbours",
                "shift_one": "sent to one peer"}[self.peers]
        return [f"Decentralized: no gradient collective; every {self.communication_interval} step(s) the bucket's "
                f"weights are {how}, {when}; the replicas differ between averagings"] + \
            tensor_lines(bucket, f"its weights {sent} in {bucket.dtype} on an averaging step; its gradient stays on "
                         "the rank", self.wire_bytes(bucket, variant), f"{bucket.dtype} weights")


def _exchange(mine: torch.Tensor, peers: list, comm) -> dict:
    """``{peer: its tensor}``: ``mine`` sent to each of ``peers`` and theirs received, in one all-to-all (a size of 0
    to and from every other rank) on the rank's dp group."""
    n = mine.numel()
    sizes = [n if j in peers else 0 for j in range(comm.size)]
    out = mine.new_empty(n * len(peers))
    dist.all_to_all_single(out, torch.cat([mine] * len(peers)), sizes, sizes, group=comm.pg)
    return {j: out[i * n:(i + 1) * n] for i, j in enumerate(peers)}
