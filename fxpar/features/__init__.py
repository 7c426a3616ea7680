"""fxpar's own features: one module per strategy, each registered with :func:`fxpar.feature.register_feature`.

Importing this package registers them (``fxpar.feature`` imports it the first time its registry is read).
"""
from . import recompute  # noqa: F401  (before offload_activations: both passes sit in Slot.REMAT, in this order)
from . import offload_activations  # noqa: F401
