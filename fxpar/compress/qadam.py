"""BAGUA's QAdam: Adam whose momentum, not its gradient, travels in 8 bits after a warm-up.

Gan, Lian, Zhang, Liu et al., "BAGUA: Scaling up Distributed Learning with System Relaxations", PVLDB 15(4), 2022
(bagua's ``q_adam`` algorithm), which follows Tang et al., "1-bit Adam", ICML 2021, Algorithm 1, with BAGUA's 8-bit
min-max compression (:class:`~fxpar.compress.bytegrad.ByteGrad`) in place of 1-bit signs. Per bucket, at step ``t``
(1 for the first step):

* **warm-up** (the first ``warmup_steps`` steps): plain Adam on the averaged full-precision gradient. One
  all-reduce of the bucket gives ``g``; ``m <- lerp(m, g, 1 - b1)``, ``v <- b2 v + (1 - b2) g^2``.
* **compressed** (every later step): ``v`` stays as the warm-up left it. Each rank moves the averaged momentum of
  the step before by its own gradient, ``m_r = lerp(m, g_r, 1 - b1)`` (``g_r``: the rank's gradient, its shard's
  mean), and the ranks average ``m_r`` by ByteGrad's scatter-reduce-gather (uint8 codes against each chunk's float32
  min and max): ``m <- ByteGrad(m_r / dp)``, the same on every rank.

Either way the step's direction is Adam's, bias-corrected with the current ``t`` (as bagua's ``QAdamOptimizer``
does after warm-up too): ``d = m / (sqrt(v) / sqrt(1 - b2^t) + eps) / (1 - b1^t)``.

Why the method owns Adam's math: the momentum must be formed on each rank before it is compressed, that is inside
the bucket's sum, and ``v`` must stop moving at the step the sum switches; so ``m``, ``v`` and the step count are
the method's per-bucket state (:class:`~fxpar.compress.runtime.CompressState`, saved in checkpoints), and the sum
returns ``d`` where plain data parallelism returns the summed gradient. What is left of the optimizer is the
learning rate: :class:`QAdamOptimizer` steps ``p <- p - lr d``, and any torch LR scheduler moves its ``lr``. A
program with ``grad_sync=QAdam(...)`` and any other optimizer is refused (:meth:`QAdam.check_plan`).

With ``warmup_steps`` at least the number of steps this is data-parallel Adam (``torch.optim.Adam`` with the same
``betas`` and ``eps``, no weight decay) on the global batch, up to rounding.

**What travels**: warm-up, the bucket in full precision (one all-reduce, ``numel * element_size`` bytes); after, the
momentum as ByteGrad sends a bucket, ``(dp + 1) (8 + ceil(numel / dp))`` bytes.

Where this differs from bagua: bagua's optimizer runs ``warmup_steps - 1`` Adam steps and then one step that
all-reduces the gradient but updates with the moments of the step before (its gradient unused); here the warm-up is
``warmup_steps`` Adam steps (1-bit Adam's ``T_w``), and the first compressed step uses its gradient. Bagua takes a
``weight_decay`` it never applies; here there is none. Bagua's hierarchical (intra-node first) all-reduce is not
modelled: dp is one flat group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from fxpar.compress.bytegrad import ByteGrad
from fxpar.compress.describe import tensor_lines
from fxpar.compress.feature import register_method
from fxpar.compress.method import BucketInfo, Comm, Method
from fxpar.errors import StrategyError

__all__ = ["QAdam", "QAdamOptimizer"]

WARMUP, COMPRESS = "warmup", "compress"


class QAdamOptimizer(torch.optim.Optimizer):
    """The optimizer a program with ``grad_sync=QAdam(...)`` takes: ``p <- p - lr * d``, where ``d`` is the Adam
    direction QAdam's bucket sum hands over in place of the gradient (Adam's moments, bias correction and
    ``betas``/``eps`` are QAdam's options and state). ``optimizer=(fxpar.compress.QAdamOptimizer, {"lr": 1e-3})``."""
    # the grad_sync feature whose sum hands this optimizer its direction: parallelize refuses it without that feature
    # (it would run plain SGD on the gradient)
    fxpar_grad_sync = "qadam"

    def __init__(self, params, lr: float = 1e-3):
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0:
            raise ValueError(f"QAdamOptimizer(lr={lr!r}): the learning rate must be a number >= 0, e.g. lr=1e-3")
        super().__init__(params, {"lr": float(lr)})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad * group["lr"])
        return loss


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@register_method
@dataclass(frozen=True)
class QAdam(Method):
    """BAGUA's QAdam (Gan et al., VLDB 2022; Tang et al.'s 1-bit Adam with 8-bit momentum): Adam on the all-reduced
    gradient for ``warmup_steps`` steps, then ``v`` frozen and the momentum averaged as min-max uint8 codes."""
    name: ClassVar[str] = "qadam"
    paper: ClassVar[str] = ("Gan, Lian, Zhang, Liu et al., BAGUA: Scaling up Distributed Learning with System "
                            "Relaxations, PVLDB 15(4) 2022 (QAdam); Tang et al., 1-bit Adam, ICML 2021, Alg. 1")
    warmup_steps: int = 100
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self):
        if isinstance(self.betas, list):           # a Plan's JSON gives a list back
            object.__setattr__(self, "betas", tuple(self.betas))
        self.check(0)

    # ---- options -----------------------------------------------------------------------------------
    def check(self, dp: int) -> None:
        w = self.warmup_steps
        if not _is_int(w) or w < 1:
            raise StrategyError(f"QAdam(warmup_steps={w!r}): the number of full-precision Adam steps must be an int "
                                ">= 1 (the second moment v is frozen when they end: with none it stays 0 and every "
                                "step divides by eps); pass e.g. warmup_steps=100")
        b = self.betas
        if not (isinstance(b, tuple) and len(b) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                           and 0 <= x < 1 for x in b)):
            raise StrategyError(f"QAdam(betas={b!r}): Adam's two decay rates, each in [0, 1); pass e.g. "
                                "betas=(0.9, 0.999)")
        e = self.eps
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not e > 0:
            raise StrategyError(f"QAdam(eps={e!r}): the term added to Adam's denominator must be a number > 0; pass "
                                "e.g. eps=1e-8")

    def to_dict(self) -> dict:
        return {**super().to_dict(), "betas": list(self.betas)}       # JSON's form: the Plan section round-trips

    def check_plan(self, plan) -> None:
        opt = (plan.optimizer or {}).get("name")
        if opt is not None and opt != QAdamOptimizer.__name__:
            raise StrategyError(
                f"Strategy(grad_sync={self.summary()}) with optimizer {opt}: QAdam carries Adam's moments and bias "
                "correction itself (its bucket sum returns Adam's step direction, not a gradient), so the optimizer "
                f"may only apply the learning rate. Pass optimizer=(fxpar.compress.QAdamOptimizer, {{'lr': ...}}) and "
                "Adam's betas and eps to QAdam(betas=..., eps=...)")
        for stage, groups in enumerate(plan.grad_groups):
            other = sorted(k for k, g in groups.items() if g != "dp")
            if other:
                raise StrategyError(
                    f"Strategy(grad_sync={self.summary()}), stage {stage}: the gradient of {other[0]!r} is summed over "
                    f"group {groups[other[0]]!r} (a weight tied across pipeline stages), outside the dp buckets QAdam "
                    "sums, so QAdamOptimizer would step it by its gradient, not by Adam's direction. Untie it, or "
                    "train without pp")

    # ---- per bucket, on the host ----------------------------------------------------------------------
    def init_state(self, bucket: BucketInfo, gen: torch.Generator) -> dict:
        z = torch.zeros(bucket.numel, dtype=bucket.torch_dtype)
        return {"exp_avg": z, "exp_avg_sq": z.clone()}

    def variant(self, bucket: BucketInfo, step: int, state: dict):
        return WARMUP if step < self.warmup_steps else COMPRESS

    def host_inputs(self, bucket: BucketInfo, step: int, state: dict, variant, gen: torch.Generator) -> list:
        """Adam's bias corrections at ``t = step + 1``: ``1 - b1^t`` and ``sqrt(1 - b2^t)`` (float64 scalars)."""
        t = step + 1
        b1, b2 = self.betas
        return [torch.tensor(1 - b1 ** t, dtype=torch.float64),
                torch.tensor(math.sqrt(1 - b2 ** t), dtype=torch.float64)]

    # ---- per bucket, traced -----------------------------------------------------------------------------
    def sum(self, flat, state, inputs, bucket, comm: Comm, variant) -> tuple:
        b1, b2 = self.betas
        bc1, bc2_sqrt = inputs
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if variant == WARMUP:
            g = comm.all_reduce(flat)
            m = torch.lerp(m, g, 1 - b1)
            v = v * b2 + g * g * (1 - b2)
        else:
            mine = torch.lerp(m, flat * comm.size, 1 - b1)
            m = ByteGrad().sum(mine / comm.size, {}, [], bucket, comm, None)[0]
        direction = m / (v.sqrt() / bc2_sqrt + self.eps) / bc1
        return direction, {"exp_avg": m, "exp_avg_sq": v}

    # ---- what it costs and says -----------------------------------------------------------------------------
    def wire_bytes(self, bucket: BucketInfo, variant) -> int:
        if variant == WARMUP:
            return bucket.numel * bucket.element_size
        return ByteGrad().wire_bytes(bucket, None)

    def describe(self, bucket: BucketInfo, variant) -> list:
        b1, b2 = self.betas
        warm = (f"QAdam warm-up (steps 1 to {self.warmup_steps}): the gradient all-reduced in full precision "
                f"({bucket.numel * bucket.element_size} B), Adam's m and v (betas {b1}, {b2}) updated from it")
        after = (f"QAdam after warm-up: v frozen; each rank's momentum m = {b1} m + {1 - b1:.3g} g_rank averaged as "
                 f"ByteGrad's uint8 codes ({ByteGrad().wire_bytes(bucket, None)} B)")
        tail = "; the bucket's result is Adam's direction m / (sqrt(v) + eps), bias-corrected, which QAdamOptimizer " \
               "scales by lr"
        if variant == WARMUP:
            per = tensor_lines(bucket, "its gradient all-reduced in full precision", self.wire_bytes(bucket, variant),
                               f"{bucket.dtype} gradient")
        else:
            m = -(-bucket.numel // bucket.dp)
            per = tensor_lines(bucket, f"its momentum m as uint8 codes against a float32 min and max per chunk (the "
                                       f"flat bucket cut into {bucket.dp} chunks of {m}), ByteGrad's "
                                       "scatter-reduce-gather", self.wire_bytes(bucket, variant),
                               "momentum as uint8 codes + min/max share")
        return [warm if variant == WARMUP else after, tail] + per
