"""Sharding rules per aten op (the table), see :mod:`passes.sharding.core`.

Coverage: every op the test models' joint training steps produce (fxpar.testing's tied GPT, MLP and
CNN; Hugging Face GPT-2, Llama, BERT and T5 built from configs), forward, backward and the traced
optimizer's ``_foreach_*`` ops; ``tests/test_sharding_rules.py`` checks it on their captured graphs.
"""
from . import nn, pointwise, shape  # noqa: F401 - registering the rules
from .layouts import ShardingConflict, fixed_shardings, strip_annotations
from .core import REPLICATE, RULES, Group, OpInfo, groups_of, has_rule, replicate_only, rule, tensor_leaves
from .shape import view_dim_map

__all__ = ["RULES", "REPLICATE", "Group", "OpInfo", "groups_of", "has_rule", "rule", "replicate_only",
           "tensor_leaves", "view_dim_map", "fixed_shardings", "ShardingConflict",
           "strip_annotations"]
