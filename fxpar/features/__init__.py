"""fxpar's own features: one module per strategy, each registered with :func:`fxpar.feature.register_feature`.

Importing this package registers them (``fxpar.feature`` imports it the first time its registry is read).
"""
from . import data_parallel  # noqa: F401  first: its plan() and plan_stage() (the buckets) come before the others'
from . import compile  # noqa: F401  (Strategy(compile=True)) early: its plan() sets the update's kernel others read
from . import pipeline_flush, pipeline_zero_bubble, pipeline_async, pipeline_chimera  # noqa: F401  (schedule=)
from . import pipeline_delayed  # noqa: F401  (schedule='pipelined_bp' | 'pipemare')
from . import wavelet  # noqa: F401  (schedule='wavelet': tick-tock waves on data-parallel ranks)
from . import pipeline  # noqa: F401  hand-written schedules (Strategy(schedule=Schedule or its text))
from . import tensor_parallel  # noqa: F401  (Strategy(tp=N, sharding=...))
from . import precision  # noqa: F401  (Strategy(precision='bf16' | 'fp16'); Slot.PRECISION, after tp)
from . import recompute  # noqa: F401  (before offload_activations: both passes sit in Slot.REMAT, in this order)
from . import offload_activations  # noqa: F401
from . import zero  # noqa: F401  ZeRO stages 1-3
from . import zero_offload  # noqa: F401  ZeRO-Offload / ZeRO-Infinity (after zero: it offloads zero's chunks)
from . import grad_sync  # noqa: F401  the grad_sync option the gradient-sync methods share
from . import herring, byteps, parallax      # noqa: F401  gradient-sync methods (Strategy(grad_sync=...))
from . import bytescheduler  # noqa: F401  ByteScheduler and the delayed update on its carry
from . import inplace_update  # noqa: F401  the traced update in place (Slot.OPTIMIZER)
import fxpar.compress  # noqa: F401,E402  gradient-compression methods, one feature each (Strategy(grad_sync=C.TopK()))
import fxpar.sync  # noqa: F401,E402  synchronisation methods (Strategy(sync=S.LocalSGD(period=8)))
from . import pipeline_hetpipe  # noqa: F401,E402  (schedule='hetpipe'; after fxpar.sync, whose SSP it runs on)
