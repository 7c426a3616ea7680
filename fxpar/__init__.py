"""fxpar: a compiler for distributed deep-learning training, built on torch.fx.

    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), example_inputs=batch,
                                loss_fn=torch.nn.functional.cross_entropy,
                                optimizer=(torch.optim.AdamW, {"lr": 1e-3}), strategy=fxpar.Strategy(dp=2))
    print(program.explain()); result = program.run_local(batches)

The package is lazy (PEP 562): ``import fxpar.meta`` or ``from fxpar.plan import Plan`` loads those
modules only; a public name below loads its module on first use.
"""
import importlib

__version__ = "0.1.0"

# public name -> the submodule that defines it (relative to this package)
_EXPORTS = {
    "parallelize": ".api",
    "auto_plan": ".auto", "AutoSearch": ".auto", "Candidate": ".auto", "NoPlanFitsError": ".auto",
    "CapturedStep": ".capture", "StepSignature": ".capture", "capture_training_step": ".capture",
    "trace_forward": ".capture",
    "ClusterSpec": ".cluster", "DeviceSpec": ".cluster", "LinkSpec": ".cluster",
    "insert_all_reduce": ".collectives", "insert_broadcast": ".collectives",
    "CaptureError": ".errors", "ClusterSpecError": ".errors", "FxparError": ".errors", "InputError": ".errors",
    "NonFiniteLossError": ".errors", "PassError": ".errors", "RankFailedError": ".errors",
    "StrategyError": ".errors",
    "Mesh": ".mesh",
    "Pass": ".pass_manager", "PassContext": ".pass_manager", "PassManager": ".pass_manager",
    "PassResult": ".pass_manager", "graph_pass": ".pass_manager",
    "Plan": ".plan",
    "Program": ".program", "RankRunner": ".program", "RunResult": ".program",
    "LocalCluster": ".runtime.launch",
    "shard": ".annotate",
    "Sharding": ".sharding", "ShardingError": ".sharding",
    "Strategy": ".strategy",
    "Feature": ".feature", "Option": ".feature", "PlanSection": ".feature", "RankState": ".feature", "Slot": ".feature",
    "register_feature": ".feature",
}
# public submodules reached as attributes: fxpar.meta, fxpar.nn (layers: fxpar.nn.MoE, fxpar.nn.TiledLinear)
_SUBMODULES = ("meta", "nn", "compress")

__all__ = ["parallelize", "auto_plan", "AutoSearch", "Candidate", "NoPlanFitsError", "ClusterSpec", "DeviceSpec", "LinkSpec", "Strategy", "Plan", "Program", "RunResult",
           "RankRunner", "Mesh", "Pass", "PassResult", "PassContext", "PassManager", "graph_pass", "LocalCluster",
           "CapturedStep", "StepSignature", "capture_training_step", "trace_forward", "insert_all_reduce", "insert_broadcast", "meta",
           "FxparError", "CaptureError", "StrategyError", "ClusterSpecError", "PassError", "RankFailedError",
           "InputError", "NonFiniteLossError", "shard", "Sharding", "ShardingError", "Feature", "Option", "PlanSection",
           "RankState", "Slot", "register_feature"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module("." + name, __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
