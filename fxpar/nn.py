"""Layers fxpar provides for models that need them.

``TiledLinear``: ZeRO-Infinity's memory-centric tiling (Rajbhandari et al., SC'21, §5.1.3): a Linear too big
for the working set is split along its output features into ``tiles`` Linears computed one after another.
Each tile is a parameter of its own, so under ``Strategy(zero=3)`` each is gathered on its own, just before it
is used: the working set holds one tile, not the whole layer. The result and every gradient equal the
untiled layer's (up to the order of the input-gradient sum over tiles).

``tile_linears(model, max_params)`` swaps every ``nn.Linear`` with more than ``max_params`` weights for a
``TiledLinear`` holding the same values (state-dict keys change: ``fc.weight`` becomes ``fc.tiles.0.weight``,
``fc.tiles.1.weight``, ...).

``MoE``: GShard's mixture-of-experts layer with top-2 gating, expert capacity and the auxiliary loss, its
experts split over a mesh axis by ``fxpar.shard`` annotations (:mod:`fxpar.moe`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .moe import MoE

__all__ = ["TiledLinear", "tile_linears", "MoE"]


class TiledLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, tiles: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        if not 1 <= tiles <= out_features:
            raise ValueError(f"TiledLinear({in_features}, {out_features}, tiles={tiles}): tiles must be between 1 and "
                             f"out_features={out_features}")
        self.in_features, self.out_features = in_features, out_features
        step = math.ceil(out_features / tiles)
        sizes = [min(step, out_features - i) for i in range(0, out_features, step)]
        self.tiles = nn.ModuleList(nn.Linear(in_features, n, bias=bias, device=device, dtype=dtype) for n in sizes)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tiles: int) -> "TiledLinear":
        """A tiled copy of ``linear`` (same values)."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, tiles, bias=linear.bias is not None, device=w.device,
                  dtype=w.dtype)
        lo = 0
        with torch.no_grad():
            for t in out.tiles:
                hi = lo + t.out_features
                t.weight.copy_(w[lo:hi])
                if linear.bias is not None:
                    t.bias.copy_(linear.bias[lo:hi])
                lo = hi
        return out

    def forward(self, x):
        return torch.cat([t(x) for t in self.tiles], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tiles={len(self.tiles)}"


def tile_linears(model: nn.Module, max_params: int) -> list:
    """Replace (in place) every ``nn.Linear`` of ``model`` with more than ``max_params`` weights by a
    ``TiledLinear`` whose tiles hold at most ``max_params`` each. Returns the replaced modules' names."""
    done = []
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if type(child) is nn.Linear and child.weight.numel() > max_params:
                rows = max(1, max_params // child.in_features)
                tiles = math.ceil(child.out_features / rows)
                setattr(mod, child_name, TiledLinear.from_linear(child, tiles))
                done.append(f"{name}.{child_name}" if name else child_name)
    return done
