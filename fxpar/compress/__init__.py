"""Gradient compression: methods that change how each data-parallel gradient bucket is summed
(``Strategy(grad_sync=fxpar.compress.<Method>(...))``, or ``grad_sync="<name>"`` for a method's defaults).

``method.py`` holds the contract every method meets; ``feature.py`` the Feature, Plan section and pass every method
rides on (:func:`register_method` makes one per method class); ``runtime.py`` a rank's state and bucket sums. Each
method family is a module that registers its classes with ``@register_method``; importing this package imports
them all, so every method's name works as a ``grad_sync`` string::

    from fxpar import compress as C
    fxpar.Strategy(dp=4, grad_sync=C.TopK(ratio=0.01))
"""
from __future__ import annotations

import importlib
import importlib.util

from .method import BucketInfo, Comm, Method
from .feature import CompressFeature, CompressSection, register_method, registered_methods, unregister_method
from .runtime import EagerComm
from .fp16 import BF16, FP16
from .sparse import RandomK, TopK

# The method modules beside the ones above, each registering its classes when imported: name -> module
_MODULES = {"PowerSGD": "powersgd", "Accordion": "accordion", "DDPHook": "ddp_hook", "QSGD": "quantize",
            "NUQSGD": "quantize", "ALQ": "quantize", "AMQ": "quantize", "Wangni": "wangni", "ByteGrad": "bytegrad",
            "QAdam": "qadam", "QAdamOptimizer": "qadam", "Decentralized": "decentralized"}

for _mod in dict.fromkeys(_MODULES.values()):        # registered at import: their names work as grad_sync strings
    if importlib.util.find_spec(f"{__name__}.{_mod}") is not None:
        importlib.import_module(f"{__name__}.{_mod}")

__all__ = ["Method", "BucketInfo", "Comm", "EagerComm", "register_method", "unregister_method", "registered_methods",
           "CompressFeature",
           "CompressSection", "FP16", "BF16", "TopK", "RandomK"] + [
    n for n, m in _MODULES.items() if importlib.util.find_spec(f"{__name__}.{m}") is not None]


def __getattr__(name: str):
    mod = _MODULES.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if importlib.util.find_spec(f"{__name__}.{mod}") is None:
        raise AttributeError(f"fxpar.compress.{name}: its module fxpar/compress/{mod}.py is not in this fxpar; the "
                             f"methods here: {sorted(registered_methods())}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
