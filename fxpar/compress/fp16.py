"""Narrow-dtype gradient buckets: ``FP16()`` and ``BF16()``, torch's ``fp16_compress_hook`` and
``bf16_compress_hook`` (``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``) on fxpar's buckets.

Per bucket, each rank casts its gradients to the narrow dtype, divides them by dp there, the narrow buckets are
all-reduced (summed in the narrow dtype), and the sum is cast back to the bucket's dtype (Micikevicius et al.,
"Mixed Precision Training", ICLR 2018, section 3, for the half-precision format):

    g = cast_back( sum_r ( cast_narrow(g_r) / dp ) )

That is the hook's order: ``buffer.to(float16).div_(world_size)``, then the all-reduce, then ``copy_`` back. fxpar's
bucket arrives as ``g_r / dp`` in the bucket's dtype, so the method first multiplies by dp: exactly ``g_r`` for dp a
power of two (and within one rounding of the bucket's dtype otherwise), then casts and divides as the hook does --
dividing before the cast would round differently where ``g_r / dp`` is subnormal in the narrow dtype. Bytes per
rank: numel x 2 (one all-reduce), against numel x the bucket's element size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .describe import tensor_lines
from .feature import register_method
from .method import BucketInfo, Comm, Method

__all__ = ["FP16", "BF16"]


@dataclass(frozen=True)
class _Narrow(Method):
    narrow: ClassVar[torch.dtype] = torch.float16

    def sum(self, flat: torch.Tensor, state: dict, inputs: list, bucket: BucketInfo, comm: Comm, variant) -> tuple:
        narrow = (flat * bucket.dp).to(self.narrow).div(bucket.dp)      # the hook's cast, then its divide
        summed = comm.all_reduce(narrow)
        return summed.to(flat.dtype), state

    def wire_bytes(self, bucket: BucketInfo, variant) -> int:
        return bucket.numel * torch.empty((), dtype=self.narrow).element_size()

    def describe(self, bucket: BucketInfo, variant) -> list:
        n = str(self.narrow).replace("torch.", "")
        return tensor_lines(bucket, f"each value cast to {n}, summed in {n}, cast back to {bucket.dtype}",
                            self.wire_bytes(bucket, variant), f"{n} values", rule="in proportion to its values (its "
                            f"exact bytes: 2 per value)")


@register_method
@dataclass(frozen=True)
class FP16(_Narrow):
    """Gradient buckets all-reduced in float16 (torch's ``fp16_compress_hook``)."""
    name: ClassVar[str] = "fp16"
    paper: ClassVar[str] = "torch fp16_compress_hook; Micikevicius et al., ICLR 2018"
    narrow: ClassVar[torch.dtype] = torch.float16


@register_method
@dataclass(frozen=True)
class BF16(_Narrow):
    """Gradient buckets all-reduced in bfloat16 (torch's ``bf16_compress_hook``)."""
    name: ClassVar[str] = "bf16"
    paper: ClassVar[str] = "torch bf16_compress_hook; Kalamkar et al., arXiv:1905.12322, 2019"
    narrow: ClassVar[torch.dtype] = torch.bfloat16
