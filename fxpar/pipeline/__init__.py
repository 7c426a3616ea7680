"""Pipeline parallelism: stage cutting, per-stage forward/backward/step graphs, a schedule runtime.

    program = fxpar.pipeline.build_pipeline_program(model, cluster, batch, loss_fn,
                                                    fxpar.optim.resolve_optimizer((torch.optim.SGD, {...})),
                                                    fxpar.Strategy(pp=2, schedule="1f1b", microbatches=4))
    print(program.explain()); print(program.schedule(0)); program.graphs(0)["stage0.backward"]
    result = program.run_local(batches)

Modules: :mod:`.trace` (forward + loss at aten level), :mod:`passes.split_stages` (the cut),
:mod:`.autodiff` (forward/backward with saved tensors explicit, the step), :mod:`.executor`
(the runtime), :mod:`.program` (``build_pipeline_program``, ``PipelineProgram``).
"""
from .program import ActionList, PipelinePlan, PipelineProgram, PipelineRankRunner, build_pipeline_program

__all__ = ["build_pipeline_program", "PipelineProgram", "PipelinePlan", "PipelineRankRunner", "ActionList"]
