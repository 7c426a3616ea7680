"""fxpar: a compiler for distributed deep-learning training, built on torch.fx.

    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), example_inputs=batch,
                                loss_fn=torch.nn.functional.cross_entropy,
                                optimizer=(torch.optim.AdamW, {"lr": 1e-3}), strategy=fxpar.Strategy(dp=2))
    print(program.explain()); result = program.run_local(batches)
"""
from . import meta
from .api import parallelize
from .capture import CapturedStep, StepSignature, capture_training_step, trace_forward
from .cluster import ClusterSpec, DeviceSpec, LinkSpec
from .collectives import insert_all_reduce, insert_broadcast
from .errors import (CaptureError, ClusterSpecError, FxparError, InputError, NonFiniteLossError, PassError,
                     RankFailedError, StrategyError)
from .feature import Feature, Option, PlanSection, RankState, Slot, register_feature
from .mesh import Mesh
from .pass_manager import Pass, PassContext, PassManager, PassResult, graph_pass
from .plan import Plan
from .program import Program, RankRunner, RunResult
from .runtime.launch import LocalCluster
from .annotate import shard
from . import nn  # layers: fxpar.nn.MoE (GShard), fxpar.nn.TiledLinear
from .sharding import Sharding, ShardingError
from .strategy import Strategy

__version__ = "0.1.0"
__all__ = ["parallelize", "ClusterSpec", "DeviceSpec", "LinkSpec", "Strategy", "Plan", "Program", "RunResult",
           "RankRunner", "Mesh", "Pass", "PassResult", "PassContext", "PassManager", "graph_pass", "LocalCluster",
           "CapturedStep", "StepSignature", "capture_training_step", "trace_forward", "insert_all_reduce", "insert_broadcast", "meta",
           "FxparError", "CaptureError", "StrategyError", "ClusterSpecError", "PassError", "RankFailedError",
           "InputError", "NonFiniteLossError", "shard", "Sharding", "ShardingError", "Feature", "Option", "PlanSection",
           "RankState", "Slot", "register_feature"]
