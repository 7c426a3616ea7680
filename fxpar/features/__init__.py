"""fxpar's own features: one module per strategy, each registered with :func:`fxpar.feature.register_feature`.

Importing this package registers them (``fxpar.feature`` imports it the first time its registry is read).
"""
from . import zero  # noqa: F401  ZeRO stages 1-3
from . import zero_offload  # noqa: F401  ZeRO-Offload / ZeRO-Infinity (after zero: it offloads zero's chunks)
