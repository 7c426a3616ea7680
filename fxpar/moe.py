"""``fxpar.nn.MoE``: GShard's mixture-of-experts layer, experts sharded over a mesh axis by annotations.

Lepikhin et al., *GShard*, ICLR'21: §2.2 (top-2 gating, expert capacity, auxiliary loss), Algorithm 1
(group-level top-2 gating with the auxiliary loss) and Algorithm 2 (the layer as einsums, with its annotations):

    x [G, S, M]  -- G groups of S tokens (the layer reshapes [..., M] into groups of ``group_size``)
    gates    = softmax(einsum("GSM,ME->GSE", x, wg))
    combine, dispatch, l_aux = top2_gating(gates)                    # dense one-hot [G, S, E, C]
    d        = einsum("GSEC,GSM->EGCM", dispatch, x)                 # annotated: split on E (experts)
    h        = act(einsum("EGCM,EMH->EGCH", d, wi))                  # wi [E, M, H] split on E
    out      = einsum("EGCH,EHM->GECM", h, wo)                       # annotated: split on G (tokens)
    y        = einsum("GSEC,GECM->GSM", combine, out)

Every einsum is a ``bmm`` between views, so ``make_fx`` traces the layer to ops with sharding rules
(``passes/sharding/``), and the ``fxpar.shard`` annotations (identity on one device) say what GShard's
say: tokens split on G over ``axis``, the dispatched tensor and the expert weights split on E. Propagation
then finds the layout changes G -> E (dispatch) and E -> G (combine), and the lowering inserts them as
``all_to_all`` (GShard §3), forward and, for the gradients, backward. Rank 0's lowered forward at tp=2::

    bmm = aten.bmm(transpose, view_2)                   # [G/n, E·C, M]  this rank's groups, every expert
    all_to_all_single_default = _c10d_functional.all_to_all_single(clone_default_1, [1, 1], [1, 1], 'fxpar:tp')
    wait_tensor_default = ...                           # dispatch: split on G -> split on E
    bmm_1 = aten.bmm(view_6, moe_wi)                    # [E/n, G·C, H]  this rank's experts, every group
    bmm_2 = aten.bmm(relu, moe_wo)
    all_to_all_single_default_1 = ...                   # combine: split on E -> split on G
    bmm_3 = aten.bmm(view_8, view_9)                    # [G/n, S, M]

Top-2 gating per group (Algorithm 1): each token's best expert e1 and second-best e2 with weights
g1/(g1+g2) and g2/(g1+g2). An expert takes at most C tokens of a group, C = ceil(capacity_factor·2·S/E)
(GShard's 2S/E at capacity_factor=1; at most S); places fill in token order, every first choice before any
second choice. A token over capacity at an expert gets nothing from it (its combine weight is 0; the
residual around the layer carries it). Unlike Algorithm 1, the second expert is always used when it has
room (no random dispatch ``2·g2 > uniform(0, 1)``): the layer is deterministic.

Auxiliary load-balancing loss, §2.2 and Algorithm 1 line 13, per group:
``l_aux = 1/E · Σ_e (c_e/S) · m_e``, c_e the tokens whose first choice is e (before capacity),
m_e = 1/S Σ_s g_{s,e} the mean gate (the differentiable stand-in for c_e/S); averaged over groups.
GShard trains on ``l = l_nll + k · l_aux``. The layer returns it: ``y, l_aux = moe(x)``; a model sums its
layers' ``l_aux`` and returns it beside its output, and the loss_fn adds it (a plain function of the
model's outputs, so it works wherever ``fxpar.parallelize`` runs a loss_fn)::

    def forward(self, x):                                 # the model
        y, aux = self.moe(self.inp(x))
        return self.head(x + y), aux
    loss_fn = lambda out, target: F.cross_entropy(out[0], target) + 0.01 * out[1]
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .annotate import shard

__all__ = ["MoE", "top2_gating", "expert_capacity"]


def expert_capacity(group_size: int, experts: int, capacity_factor: float | None) -> int:
    """Places per expert per group: ``ceil(capacity_factor · 2 · S / E)`` (GShard), at most S; None: S (no drop)."""
    if capacity_factor is None:
        return group_size
    return max(1, min(group_size, math.ceil(capacity_factor * 2 * group_size / experts)))


def _first_choice(gates: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """One-hot [G, S, E] of each token's best expert (``argmax == arange``: a one-hot with a sharding rule)."""
    return (gates.argmax(-1, keepdim=True) == experts).to(gates.dtype)


def _place(keep: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[G, S, E, C]: 1 where a kept token sits in its expert's buffer (at place ``pos``)."""
    slot = (pos * keep).sum(-1, keepdim=True)                         # [G, S, 1] its place at its expert
    return keep.unsqueeze(-1) * (slot == slots).to(keep.dtype).unsqueeze(2)


def top2_gating(gates: torch.Tensor, capacity: int):
    """GShard's Algorithm 1 on all groups at once. ``gates``: [G, S, E] (softmax over E).

    Returns ``(combine [G, S, E, C], dispatch [G, S, E, C], l_aux)``: dispatch is 1 where token s sits in
    expert e's place c; combine holds its normalised gate there."""
    G, S, E = gates.shape
    dt = gates.dtype
    experts = torch.arange(E, dtype=dt, device=gates.device)
    g = gates.detach()                                                  # the choices carry no gradient
    mask1 = _first_choice(g, experts)
    mask2 = _first_choice(g * (1 - mask1), experts)                     # best of the rest (gates are > 0)
    # l_aux (Algorithm 1, line 13): 1/E Σ_e (c_e/S) m_e per group, averaged over the G groups
    l_aux = (mask1.mean(1) * gates.mean(1)).sum() / (G * E)
    # places in each expert's buffer, in token order, first choices before second choices
    pos1 = torch.cumsum(mask1, 1) - mask1
    keep1 = mask1 * (pos1 < capacity).to(dt)
    pos2 = torch.cumsum(mask2, 1) - mask2 + keep1.sum(1, keepdim=True)
    keep2 = mask2 * (pos2 < capacity).to(dt)
    g1, g2 = (gates * mask1).sum(-1), (gates * mask2).sum(-1)
    slots = torch.arange(capacity, dtype=dt, device=gates.device)
    d1, d2 = _place(keep1, pos1, slots), _place(keep2, pos2, slots)
    combine = (g1 / (g1 + g2))[..., None, None] * d1 + (g2 / (g1 + g2))[..., None, None] * d2
    return combine, d1 + d2, l_aux


class MoE(nn.Module):
    """A GShard mixture-of-experts feed-forward layer: ``y, l_aux = moe(x)`` with x, y [..., dim].

    dim, hidden: each expert is ``act(x @ wi[e]) @ wo[e]`` with wi [dim, hidden], wo [hidden, dim].
    experts: E. group_size: S, the tokens per group (x's token count must be a multiple of it).
    capacity_factor: expert capacity C = ceil(capacity_factor · 2 · S / E) (at most S); None: no dropping.
    axis: the mesh axis the experts are split over (and the groups, between dispatch and combine); None:
        no annotations (a plain single-device layer).
    """

    def __init__(self, dim: int, hidden: int, experts: int, group_size: int, capacity_factor: float | None = 1.0,
                 axis: str | None = "tp", activation=F.relu, device=None, dtype=None):
        super().__init__()
        if experts < 2:
            raise ValueError(f"MoE(experts={experts}): top-2 gating needs at least 2 experts")
        self.dim, self.hidden, self.experts, self.group_size = dim, hidden, experts, group_size
        self.capacity_factor, self.axis, self.activation = capacity_factor, axis, activation
        kw = {"device": device, "dtype": dtype}
        self.wg = nn.Parameter(torch.empty(dim, experts, **kw))          # gating [M, E], replicated
        self.wi = nn.Parameter(torch.empty(experts, dim, hidden, **kw))  # experts' first layers [E, M, H]
        self.wo = nn.Parameter(torch.empty(experts, hidden, dim, **kw))  # experts' second layers [E, H, M]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As ``nn.Linear``'s weights: uniform in ±1/sqrt(fan_in)."""
        for w, fan_in in ((self.wg, self.dim), (self.wi, self.dim), (self.wo, self.hidden)):
            nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    @property
    def capacity(self) -> int:
        return expert_capacity(self.group_size, self.experts, self.capacity_factor)

    def _shard(self, t: torch.Tensor, split_dim: int) -> torch.Tensor:
        if self.axis is None:
            return t
        return shard(t, tuple(self.axis if d == split_dim else None for d in range(t.dim())))

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE(dim={self.dim}) got input of shape {list(x.shape)}: its last dim must be {self.dim}")
        tokens = x.numel() // self.dim
        if tokens % self.group_size:
            raise ValueError(f"MoE(group_size={self.group_size}) got input of shape {list(x.shape)}: its {tokens} "
                             f"tokens do not split into groups of {self.group_size}; pick a group_size dividing "
                             f"{tokens}")
        return x.reshape(tokens // self.group_size, self.group_size, self.dim)

    def forward(self, x: torch.Tensor):
        xs = self._shard(self._groups(x), 0)                               # tokens: split on G
        G, S, M = xs.shape
        E, C = self.experts, self.capacity
        gates = torch.softmax(torch.matmul(xs, self.wg), dim=-1)           # GSM,ME->GSE
        combine, dispatch, l_aux = top2_gating(gates, C)
        d = torch.bmm(dispatch.view(G, S, E * C).transpose(1, 2), xs)      # GSEC,GSM->GECM
        d = self._shard(d.view(G, E, C, M).permute(1, 0, 2, 3).contiguous(), 0)    # EGCM, split on E
        wi, wo = self._shard(self.wi, 0), self._shard(self.wo, 0)
        h = self.activation(torch.bmm(d.view(E, G * C, M), wi))            # EGCM,EMH->EGCH
        out = torch.bmm(h, wo).view(E, G, C, M).permute(1, 0, 2, 3).contiguous()  # EGCH,EHM->GECM
        out = self._shard(out, 0)                                          # split on G again
        y = torch.bmm(combine.view(G, S, E * C), out.view(G, E * C, M))    # GSEC,GECM->GSM
        return y.view(x.shape), l_aux

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden={self.hidden}, experts={self.experts}, group_size={self.group_size}, "
                f"capacity={self.capacity}, axis={self.axis!r}")
