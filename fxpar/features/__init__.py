"""fxpar's own features: one module per strategy, each registered with :func:`fxpar.feature.register_feature`.

Importing this package registers them (``fxpar.feature`` imports it the first time its registry is read).
"""
from . import tensor_parallel  # noqa: F401  (Strategy(tp=N, sharding=...))
