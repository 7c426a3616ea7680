"""Gradient compression: methods that change how each data-parallel gradient bucket is summed
(``Strategy(grad_sync=fxpar.compress.<Method>(...))``). ``method.py`` holds the contract every method meets."""
