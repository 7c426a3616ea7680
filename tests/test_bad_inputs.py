"""A corpus of common mistakes. Each must raise a clear fxpar error before any rank
starts, whose message names the user's object (the batch and tensor, the module, the setting, the file)
AND says what to do. Each case asserts both, as two patterns."""
from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
import fxpar.compress as C
import fxpar.sync as S
from fxpar.errors import InputError, NonFiniteLossError, PassError

CE = F.cross_entropy
SGD = (torch.optim.SGD, {"lr": 0.1})


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)).double()


X = torch.randn(8, 6, dtype=torch.float64)
Y = torch.randint(0, 5, (8,))


class KwModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.emb(input_ids) * attention_mask.unsqueeze(-1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


IDS = torch.randint(0, 16, (4, 5))
DICT = {"input_ids": IDS, "attention_mask": torch.ones(4, 5, dtype=torch.float64), "labels": IDS}


@functools.lru_cache(maxsize=None)
def _prog(kind: str):
    if kind == "dp2":
        return fxpar.parallelize(_net(), 2, (X, Y), CE, SGD, strategy=fxpar.Strategy(dp=2))
    if kind == "one":
        return fxpar.parallelize(_net(), 1, (X, Y), CE, SGD)
    if kind == "dict":
        torch.manual_seed(0)
        return fxpar.parallelize(KwModel().double(), 2, DICT, None, SGD, strategy=fxpar.Strategy(dp=2))
    if kind == "meta":
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)).double()
        return fxpar.parallelize(model, 2, (X, Y), CE, SGD, strategy=fxpar.Strategy(dp=2))
    if kind == "lambda_sched":
        return fxpar.parallelize(_net(), 2, (X, Y), CE, SGD, strategy=fxpar.Strategy(dp=2),
                                 lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1))
    raise KeyError(kind)


def _run(kind, batches, **kw):
    return _prog(kind).run_local(batches, **kw)


def _par(model=None, example=(X, Y), loss_fn=CE, optimizer=SGD, world=1, **strategy):
    model = _net() if model is None else model
    return fxpar.parallelize(model, world, example, loss_fn, optimizer, strategy=fxpar.Strategy(dp=world, **strategy)
                             if not strategy.get("_raw") else strategy["_raw"])


def _spec_json(**change):
    d = json.loads(fxpar.ClusterSpec.local(2).to_json())
    for k, v in change.items():
        if v is None:
            del d[k]
        else:
            d[k] = v
    return json.dumps(d)


def _dp2(**options):
    """A dp=2 program with these options: the plan-time checks (no rank starts)."""
    return _par(world=2, _raw=fxpar.Strategy(dp=2, **options))


def _on2(strategy):
    return _par(world=2, _raw=strategy)


@functools.lru_cache(maxsize=None)
def _plan_json(kind: str) -> str:
    strategy = fxpar.Strategy(dp=2) if kind == "dp2" else fxpar.Strategy(pp=2, microbatches=2)
    return _on2(strategy).plan.to_json()


def _edited_plan(kind: str, edit):
    """Plan.from_json of ``kind``'s plan JSON after ``edit(dict)``, handed back to parallelize."""
    data = json.loads(_plan_json(kind))
    edit(data)
    strategy = fxpar.Strategy(dp=2) if kind == "dp2" else fxpar.Strategy(pp=2, microbatches=2)
    return fxpar.parallelize(_net(), 2, (X, Y), CE, SGD, strategy=strategy, plan=fxpar.Plan.from_json(json.dumps(data)))


def _plan_text(**change) -> str:
    data = json.loads(_plan_json("dp2"))
    data.update(change)
    return json.dumps(data)


def _set_schedule(data, name):
    for sec in data["features"].values():
        if "schedule" in sec:
            sec["schedule"] = name


class NotAnOptimizer:
    def __init__(self, params, lr=0.1):
        pass


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(6, 5)

    def forward(self, x, mask):
        return self.w(x * mask)


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(6, 5).requires_grad_(False)

    def forward(self, x):
        return self.w(x)


class _FakeCluster:
    world_size = 4


NAN_X = X.clone()
NAN_X[3, 2] = float("nan")
SCHED_NO_MB = "# schedule name=mine ranks=2 stages=2 placement=0:0,1:1\nrank 0: F0.0 SF0.0>1 RB0.0<1 B0.0\n" \
              "rank 1: RF1.0<0 F1.0 B1.0 SB1.0>0"

# id -> (callable, exception type, pattern naming the user's thing, pattern saying what to do)
CASES = {
    # ---- part 4: run_local's batches against example_inputs -------------------------------------------
    "batch_wrong_width": (lambda: _run("dp2", [(X[:, :5], Y)]), InputError,
                          r"batches\[0\]\[0\] has shape \(8, 5\), but example_inputs had \(8, 6\) \(dim 1 differs\)",
                          r"give every batch the shapes of example_inputs"),
    "batch_wrong_dtype": (lambda: _run("dp2", [(X.float(), Y)]), InputError,
                          r"batches\[0\]\[0\] is float32, but example_inputs had float64", r"\.to\(torch\.float64\)"),
    "batch_nine_rows_at_dp2": (lambda: _run("dp2", [(torch.randn(9, 6, dtype=torch.float64), torch.zeros(9, dtype=torch.long))]),
                               InputError, r"batches\[0\]\[0\] has 9 rows .*compiled for global batches of 8 rows"
                               r".*split evenly over dp=2", r"Pass batches of 8 rows \(drop or pad a short last batch\)"),
    "batch_fewer_rows": (lambda: _run("dp2", [(X[:4], Y[:4])]), InputError, r"batches\[0\]\[0\] has 4 rows",
                         r"Pass batches of 8 rows"),
    "batch_later_one_bad": (lambda: _run("dp2", [(X, Y), (X, Y), (X, Y[:6])]), InputError,
                            r"batches\[2\]\[1\] \(the target\) has 6 rows", r"Pass batches of 8 rows"),
    "batch_extra_tensor": (lambda: _run("dp2", [(X, Y, Y)]), InputError,
                           r"batches\[0\] is a tuple of 3 element\(s\), but example_inputs was a tuple of 2 tensor",
                           r"give every batch the structure of example_inputs"),
    "batch_missing_target": (lambda: _run("dp2", [(X,)]), InputError, r"batches\[0\] is a tuple of 1 element",
                             r"give every batch the structure of example_inputs"),
    "batch_list_empty": (lambda: _run("dp2", []), InputError, r"run_local\(batches=\[\]\)",
                         r"Pass a list of global batches, one per step"),
    "batch_not_a_list": (lambda: _run("dp2", (X, Y)), InputError, r"got one batch \(tuple of 2 tensor",
                         r"pass run_local\(\[batch\]\)"),
    "batch_numpy": (lambda: _run("dp2", [(X.numpy(), Y)]), InputError, r"batches\[0\]\[0\] is a ndarray",
                    r"torch\.as_tensor"),
    "batch_target_int32": (lambda: _run("dp2", [(X, Y.int())]), InputError,
                           r"batches\[0\]\[1\] \(the target\) is int32, but example_inputs had int64",
                           r"\.to\(torch\.int64\)"),
    "batch_class_out_of_range": (lambda: _run("dp2", [(X, torch.full((8,), 7))]), InputError,
                                 r"batches\[0\]\[1\] \(the target\): class index 7 at position \(0,\) is outside \[0, 5\)",
                                 r"use class indices in \[0, 5\), or ignore_index=-100"),
    "batch_on_meta": (lambda: _run("dp2", [(X.to("meta"), Y)]), InputError, r"batches\[0\]\[0\] is on the meta device",
                      r"pass real tensors"),
    "dict_batch_missing_key": (lambda: _run("dict", [{"input_ids": IDS, "labels": IDS}]), InputError,
                               r"batches\[0\] is a dict .*missing keys \['attention_mask'\]",
                               r"give every batch the structure of example_inputs"),
    "dict_batch_extra_key": (lambda: _run("dict", [{**DICT, "token_type_ids": IDS}]), InputError,
                             r"unexpected keys \['token_type_ids'\]", r"give every batch the structure"),
    "dict_batch_as_tuple": (lambda: _run("dict", [(IDS, DICT["attention_mask"], IDS)]), InputError,
                            r"batches\[0\] is a tuple of 3 element\(s\), but example_inputs was a dict with keys "
                            r"\['input_ids', 'attention_mask', 'labels'\]", r"give every batch the structure"),
    "dict_batch_wrong_seq_len": (lambda: _run("dict", [{**DICT, "attention_mask": torch.ones(4, 6, dtype=torch.float64)}]),
                                 InputError, r"batches\[0\]\['attention_mask'\] has shape \(4, 6\), but example_inputs "
                                 r"had \(4, 5\) \(dim 1 differs\)", r"pad sequences to one length"),
    "run_local_cluster_size": (lambda: _run("dp2", [(X, Y)], cluster=_FakeCluster()), InputError,
                               r"run_local\(cluster=LocalCluster\(4\)\): this program needs 2 ranks",
                               r"pass a LocalCluster\(2\) or none"),
    # ---- part 8: every mistake of the list ---------------------------------------------------------------
    "meta_model_run_local": (lambda: _run("meta", [(X, Y)]), InputError,
                             r"Sequential's parameter '0.weight' is on the meta device",
                             r"Materialize it first -- model.to_empty\(device='cpu'\)"),
    "on_nonfinite_value": (lambda: _run("dp2", [(X, Y)], on_nonfinite="stop"), InputError,
                           r"run_local\(on_nonfinite='stop'\)", r"choose one of \('warn', 'raise', 'ignore'\)"),
    "nan_loss_raise": (lambda: _run("one", [(X, Y), (NAN_X, Y)], on_nonfinite="raise"), NonFiniteLossError,
                       r"step 1 \(batches\[1\]\): the loss is nan on rank\(s\) \[0\]",
                       r"Check batches\[1\] for NaN/inf, lower the learning rate"),
    "optimizer_instance": (lambda: _par(optimizer=torch.optim.SGD(_net().parameters(), lr=0.1)), InputError,
                           r"optimizer=SGD\(model.parameters\(\), ...\) is an optimizer instance",
                           r"pass \(torch.optim.X, .*here \(torch.optim.SGD, \{'lr': 0.1"),
    "optimizer_not_torch_optim": (lambda: _par(optimizer=(NotAnOptimizer, {"lr": 0.1})), InputError,
                                  r"NotAnOptimizer is not a torch.optim.Optimizer class",
                                  r"Use one from torch.optim .*or your own subclass of torch.optim.Optimizer"),
    "optimizer_as_string": (lambda: _par(optimizer="adamw"), InputError, r"optimizer='adamw' is a name",
                            r"\(torch.optim.AdamW, \{'lr': 1e-3\}\)"),
    "optimizer_lr_string": (lambda: _par(optimizer=(torch.optim.SGD, {"lr": "x"})), InputError,
                            r"optimizer=\(SGD, \{'lr': 'x', ...\}\)", r"lr must be a number \(a float such as 1e-3\)"),
    "optimizer_lr_negative": (lambda: _par(optimizer=(torch.optim.Adam, {"lr": -1.0})), InputError,
                              r"optimizer=\(Adam, \{'lr': -1.0\}\): torch.optim.Adam refuses these settings: "
                              r"Invalid learning rate", r"Fix the setting it names"),
    "optimizer_unknown_setting": (lambda: _par(optimizer=(torch.optim.SGD, {"lr": 0.1, "momentom": 0.9})), InputError,
                                  r"SGD has no setting 'momentom'", r"use one of its settings \(lr, momentum"),
    "optimizer_settings_not_dict": (lambda: _par(optimizer=(torch.optim.SGD, 0.1)), InputError,
                                    r"optimizer=\(SGD, 0.1\): the settings must be a dict",
                                    r"e.g. \(SGD, \{'lr': 0.1\}\)"),
    "cluster_json_missing_file": (lambda: fxpar.ClusterSpec.from_json("no/such/cluster.json"), fxpar.ClusterSpecError,
                                  r"from_json\('no/such/cluster.json'\): there is no such file",
                                  r"Pass the path of a file ClusterSpec.to_json\(path\) wrote"),
    "cluster_json_bad_json": (lambda: fxpar.ClusterSpec.from_json('{"nodes": 1,\n "device": }'), fxpar.ClusterSpecError,
                              r"the JSON text is not valid JSON: .* at line 2, column 12", r"Fix it there"),
    "cluster_json_wrong_type": (lambda: fxpar.ClusterSpec.from_json(_spec_json(nodes="2")), fxpar.ClusterSpecError,
                                r"nodes is '2' \(a str\)", r"it must be a positive integer. Fix that field"),
    "cluster_json_wrong_nested_type": (lambda: fxpar.ClusterSpec.from_json(
        _spec_json(intra_node={"bandwidth": "fast", "latency": 1e-6})), fxpar.ClusterSpecError,
        r"intra_node.bandwidth is 'fast'", r"it must be a number \(bytes/s\)"),
    "cluster_json_missing_field": (lambda: fxpar.ClusterSpec.from_json(_spec_json(devices_per_node=None)),
                                   fxpar.ClusterSpecError, r"has no devices_per_node", r"add it \(ClusterSpec.to_json"),
    "cluster_json_unknown_field": (lambda: fxpar.ClusterSpec.from_json(_spec_json(nodez=1)), fxpar.ClusterSpecError,
                                   r"unknown field\(s\) \['nodez'\]", r"Fix the name or remove it"),
    "cluster_not_a_spec": (lambda: fxpar.parallelize(_net(), "cpu", (X, Y), CE), TypeError, r"cluster='cpu'",
                           r"pass fxpar.ClusterSpec.local\(world_size\)"),
    "too_many_local_ranks": (lambda: fxpar.LocalCluster(100_000), fxpar.ClusterSpecError,
                             r"fxpar.LocalCluster\(100000\): 100000 local ranks need about .* GiB",
                             r"Use at most \d+ ranks"),
    "local_cluster_zero": (lambda: fxpar.LocalCluster(0), InputError, r"LocalCluster\(world_size=0\)",
                           r"must be a positive int"),
    "float_target_cross_entropy": (lambda: _par(example=(X, Y.double())), fxpar.CaptureError,
                                   r"the target of torch.nn.functional.cross_entropy is float64 with shape \(8,\)",
                                   r"pass target.long\(\)"),
    "int32_target_cross_entropy": (lambda: _par(example=(X, Y.int())), fxpar.CaptureError,
                                   r"the target of torch.nn.functional.cross_entropy is int32", r"pass target.long\(\)"),
    "schedule_with_pp1": (lambda: _par(_raw=fxpar.Strategy(schedule="gpipe")), fxpar.StrategyError,
                          r"schedule='gpipe' needs a pipeline", r"Drop schedule= or set pp"),
    "schedule_header_missing_field": (lambda: fxpar.Strategy(pp=2, schedule=SCHED_NO_MB), fxpar.StrategyError,
                                      r"schedule header '# schedule name=mine .*' has no microbatches=",
                                      r"add microbatches=\.\.\."),
    "schedule_unknown_name": (lambda: fxpar.Strategy(pp=2, schedule="zigzag"), fxpar.StrategyError,
                              r"Strategy\(schedule='zigzag'\)", r"choose one of"),
    "loss_average_unknown": (lambda: fxpar.Strategy(dp=2, loss_average="mean"), fxpar.StrategyError,
                             r"Strategy\(loss_average='mean'\)", r"choose one of \('auto', 'global', 'per_shard'\)"),
    "loss_average_global_opaque": (lambda: _par(loss_fn=lambda o, y: CE(o, y), world=2,
                                                _raw=fxpar.Strategy(dp=2, loss_average="global")),
                                   fxpar.StrategyError, r"loss_average='global'\): fxpar cannot see into loss_fn=",
                                   r"or use loss_average='per_shard'"),
    "loss_average_global_async": (lambda: fxpar.parallelize(_net(), 2, (X, Y), CE, SGD, strategy=fxpar.Strategy(
        pp=2, schedule="pipedream", microbatches=2, loss_average="global")), fxpar.StrategyError,
        r"loss_average='global'\): an asynchronous schedule \(pipedream, 2bw\)", r"Use loss_average='per_shard'"),
    "example_rows_not_divisible": (lambda: _par(example=(X[:7], Y[:7]), world=2), fxpar.StrategyError,
                                   r"example_inputs\[0\] has batch 7 \(shape \(7, 6\)\), which dp=2 does not divide",
                                   r"use a global batch that is a multiple of 2"),
    "example_not_tensor": (lambda: _par(example=([1.0, 2.0], Y)), InputError,
                           r"example_inputs\[0\] is a list, not a tensor", r"torch.as_tensor"),
    "example_empty": (lambda: _par(example=(), loss_fn=None), InputError, r"example_inputs is empty",
                      r"pass one global batch"),
    "example_scalar_target": (lambda: _par(example=(X, torch.tensor(1))), fxpar.StrategyError,
                              r"example_inputs\[1\] \(the target\) has shape \(\): no batch dim 0",
                              r"give every tensor of the batch the batch on dim 0"),
    "example_rows_differ": (lambda: _par(example=(X, Y[:4])), fxpar.StrategyError,
                            r"different batch sizes \[4, 8\].*example_inputs\[1\] \(the target\): \(4,\)",
                            r"give them all the same number of rows on dim 0"),
    "example_only_keywords_with_loss_fn": (lambda: _par(KwModel(), example={"input_ids": IDS}, loss_fn=CE),
                                           InputError, r"example_inputs has only the keyword inputs \['input_ids'\], "
                                           r"but loss_fn=torch.nn.functional.cross_entropy needs the target",
                                           r"pass \(inputs..., target\), \(target, \{keywords\}\)"),
    "example_single_tensor_with_loss_fn": (lambda: _par(example=X), InputError,
                                           r"example_inputs has 1 tensor\(s\), but loss_fn=", r"or loss_fn=None"),
    "example_unknown_keyword": (lambda: _par(KwModel(), example={"input_idz": IDS, "labels": IDS}, loss_fn=None),
                                InputError, r"example_inputs\['input_idz'\]: KwModel.forward has no argument",
                                r"rename the key \(did you mean 'input_ids'\?\)"),
    "example_non_string_key": (lambda: _par(KwModel(), example={0: IDS}, loss_fn=None), InputError,
                               r"example_inputs has the dict key 0", r"named by strings"),
    "example_too_many_inputs": (lambda: _par(example=(X, X, Y)), InputError,
                                r"example_inputs has 2 model input\(s\) before the target .*Sequential.forward takes 1",
                                r"drop the extra tensor\(s\)"),
    "example_missing_forward_arg": (lambda: _par(Gate().double(), example=(X, Y)), InputError,
                                    r"Gate.forward needs 'mask', which example_inputs does not give",
                                    r"add the tensor\(s\) to example_inputs before the target"),
    "model_not_a_module": (lambda: _par(model=lambda x: x), TypeError, r"model is a function",
                           r"pass the module \(wrap a plain function in an nn.Module"),
    "model_nothing_trainable": (lambda: _par(model=Frozen().double()), fxpar.CaptureError,
                                r"Frozen has no parameter with requires_grad=True", r"Set requires_grad=True"),
    "model_output_without_loss": (lambda: _par(KwModel().double(), example={"input_ids": IDS, "attention_mask":
                                               DICT["attention_mask"]}, loss_fn=None), fxpar.CaptureError,
                                  r"KwModel must return its loss, but it returned a dict with keys \['logits'\]",
                                  r"Pass the labels the model computes its loss from .*or pass loss_fn="),
    "loss_not_scalar": (lambda: _par(loss_fn=functools.partial(F.mse_loss, reduction="none"),
                                     example=(X, torch.randn(8, 5, dtype=torch.float64))), fxpar.CaptureError,
                        r"the loss of Sequential is not a scalar: got \(8, 5\)", r"reduction='mean'"),
    "strategy_size_mismatch": (lambda: _par(world=2, _raw=fxpar.Strategy(dp=4)), fxpar.StrategyError,
                               r"Strategy\(dp=4, tp=1, pp=1\) uses dp\*tp\*pp = 4 ranks but the ClusterSpec has 2",
                               r"make them equal"),
    "strategy_tp_auto_not_power_of_two": (lambda: _par(world=3, _raw=fxpar.Strategy(tp=3)), fxpar.StrategyError,
                                          r"Strategy\(tp=3, sharding='auto'\): Tofu's search halves the device set",
                                          r"use sharding='megatron' or layouts for tp=3"),
    "lr_scheduler_lambda": (lambda: _run("lambda_sched", [(X, Y)]), TypeError,
                            r"lr_scheduler=<function .*<lambda>.* cannot be sent to the spawned ranks",
                            r"a module-level function instead of a lambda"),
    # ---- every Strategy option of every feature (fxpar.feature.option_defaults()) ----------------------
    "bucket_cap_negative": (lambda: fxpar.Strategy(dp=2, bucket_cap_mb=-1), fxpar.StrategyError,
                            r"Strategy\(bucket_cap_mb=-1\)", r"must be a number >= 0 .*or None \(DDP's 25 MiB\)"),
    "bucket_cap_string": (lambda: fxpar.Strategy(dp=2, bucket_cap_mb="25"), fxpar.StrategyError,
                          r"Strategy\(bucket_cap_mb='25'\)", r"must be a number >= 0"),
    "first_bucket_cap_negative": (lambda: fxpar.Strategy(dp=2, first_bucket_cap_mb=-1), fxpar.StrategyError,
                                  r"Strategy\(first_bucket_cap_mb=-1\)", r"a number of MiB >= 0 \(DDP's is 1.0"),
    "broadcast_buffers_string": (lambda: fxpar.Strategy(dp=2, broadcast_buffers="yes"), fxpar.StrategyError,
                                 r"Strategy\(broadcast_buffers='yes'\)", r"True \(dp-rank 0's buffers .*or False"),
    "comm_schedule_unknown": (lambda: fxpar.Strategy(dp=2, comm_schedule="lifo"), fxpar.StrategyError,
                              r"Strategy\(comm_schedule='lifo'\)", r"choose one of \('fifo', 'bytescheduler'\)"),
    "credit_negative": (lambda: fxpar.Strategy(dp=2, comm_schedule="bytescheduler", credit_mb=-2),
                        fxpar.StrategyError, r"Strategy\(credit_mb=-2\)", r"a positive number of MiB, or None"),
    "credit_without_bytescheduler": (lambda: _dp2(credit_mb=4), fxpar.StrategyError,
                                     r"Strategy\(credit_mb=4\) is a ByteScheduler setting",
                                     r"add comm_schedule='bytescheduler' or drop it"),
    "partition_without_bytescheduler": (lambda: _dp2(partition_mb=4), fxpar.StrategyError,
                                        r"Strategy\(partition_mb=4\) is a ByteScheduler setting",
                                        r"add comm_schedule='bytescheduler' or drop it"),
    "partition_negative": (lambda: fxpar.Strategy(dp=2, comm_schedule="bytescheduler", partition_mb=-1),
                           fxpar.StrategyError, r"Strategy\(partition_mb=-1\)", r"a positive number of MiB, or None"),
    "cross_iteration_string": (lambda: fxpar.Strategy(dp=2, comm_schedule="bytescheduler", cross_iteration="yes"),
                               fxpar.StrategyError, r"Strategy\(cross_iteration='yes'\)",
                               r"True, False, or None \(the cost model decides\)"),
    "cross_iteration_without_bytescheduler": (lambda: _dp2(cross_iteration=True), fxpar.StrategyError,
                                              r"Strategy\(cross_iteration=True\) is a ByteScheduler setting",
                                              r"add comm_schedule='bytescheduler' or drop it"),
    "compile_int": (lambda: fxpar.Strategy(dp=2, compile=1), fxpar.StrategyError,
                    r"Strategy\(compile=1\)", r"pass True .*False .*or 'auto'"),
    "compile_string": (lambda: fxpar.Strategy(dp=2, compile="inductor"), fxpar.StrategyError,
                       r"Strategy\(compile='inductor'\)", r"pass True .*False .*or 'auto'"),
    "compile_steps_without_auto": (lambda: fxpar.Strategy(dp=2, compile=True, compile_steps=10), fxpar.StrategyError,
                                   r"Strategy\(compile=True, compile_steps=10\)", r"pass compile='auto' or drop it"),
    "delayed_update_string": (lambda: fxpar.Strategy(dp=2, delayed_update="on"), fxpar.StrategyError,
                              r"Strategy\(delayed_update='on'\)", r"True \(each step's update .*or False"),
    "delayed_update_at_dp1": (lambda: _par(delayed_update=True), fxpar.StrategyError,
                              r"Strategy\(delayed_update=True\) with dp=1, pp=1, microbatches=1",
                              r"built for data parallelism \(dp > 1"),
    "delayed_update_with_a_pipeline": (lambda: _on2(fxpar.Strategy(pp=2, microbatches=2, delayed_update=True)),
                                       fxpar.StrategyError, r"Strategy\(delayed_update=True\) with dp=1, pp=2",
                                       r"one stage, one microbatch"),
    "grad_order_unknown": (lambda: fxpar.Strategy(dp=2, grad_order="random"), fxpar.StrategyError,
                           r"Strategy\(grad_order='random'\)", r"choose 'natural', 'priority', or None"),
    "grad_sync_unknown": (lambda: fxpar.Strategy(dp=2, grad_sync="ring"), fxpar.StrategyError,
                          r"Strategy\(grad_sync='ring'\)", r"choose 'allreduce' \(the default\) or a method .*'herring'"),
    "grad_sync_typo": (lambda: fxpar.Strategy(dp=2, grad_sync="f16"), fxpar.StrategyError,
                       r"Strategy\(grad_sync='f16'\)", r"'fp16', 'bf16'"),
    "grad_sync_a_class": (lambda: fxpar.Strategy(dp=2, grad_sync=C.TopK), fxpar.StrategyError,
                          r"TopK is a class", r"pass a setting of it, e.g. grad_sync=TopK\(\)"),
    "grad_sync_herring_with_a_pipeline": (lambda: _on2(fxpar.Strategy(pp=2, microbatches=2, grad_sync="herring")),
                                          fxpar.StrategyError, r"Strategy\(grad_sync='herring'\) with pp=2",
                                          r"drop pp or use grad_sync='allreduce'"),
    "memory_budget_negative": (lambda: fxpar.Strategy(dp=2, recompute="auto", memory_budget_gb=-1),
                               fxpar.StrategyError, r"Strategy\(memory_budget_gb=-1\)", r"a positive number of GB"),
    "memory_budget_string": (lambda: fxpar.Strategy(dp=2, recompute="auto", memory_budget_gb="1GB"),
                             fxpar.StrategyError, r"Strategy\(memory_budget_gb='1GB'\)", r"a positive number of GB"),
    "memory_budget_without_auto": (lambda: _dp2(memory_budget_gb=1.0), fxpar.StrategyError,
                                   r"Strategy\(memory_budget_gb=1.0, recompute='none'\)",
                                   r"Set recompute='auto' or drop memory_budget_gb"),
    "recompute_unknown": (lambda: fxpar.Strategy(dp=2, recompute="some"), fxpar.StrategyError,
                          r"Strategy\(recompute='some'\)", r"choose one of \('none', 'full', 'selective', 'auto'\)"),
    "recompute_a_number": (lambda: fxpar.Strategy(dp=2, recompute=1), fxpar.StrategyError,
                           r"Strategy\(recompute=1\)", r"or pass a policy: a callable node"),
    "offload_unknown": (lambda: fxpar.Strategy(dp=2, zero=3, offload=("gradients",)), fxpar.StrategyError,
                        r"Strategy\(offload=\('gradients',\)\): \['gradients'\] unknown",
                        r"offload any of 'params', 'optimizer'"),
    "offload_activations_in_offload": (lambda: fxpar.Strategy(dp=2, offload=("activations",)), fxpar.StrategyError,
                                       r"Strategy\(offload=\('activations',\)\)", r"Strategy\(offload_activations=True\)"),
    "offload_activations_string": (lambda: fxpar.Strategy(dp=2, offload_activations="yes"), fxpar.StrategyError,
                                   r"Strategy\(offload_activations='yes'\)", r"True \(saved activations .*or False"),
    "offload_to_unknown": (lambda: fxpar.Strategy(dp=2, zero=3, offload=("params",), offload_to="gpu"),
                           fxpar.StrategyError, r"Strategy\(offload_to='gpu'\)", r"choose 'cpu' or 'disk'"),
    "offload_dir_without_disk": (lambda: fxpar.Strategy(dp=2, zero=3, offload=("params",), offload_dir="/tmp/x"),
                                 fxpar.StrategyError, r"Strategy\(offload_dir='/tmp/x', offload_to='cpu'\)",
                                 r"add offload_to='disk' or drop offload_dir"),
    "offload_disk_without_dir": (lambda: fxpar.Strategy(dp=2, zero=3, offload=("params",), offload_to="disk"),
                                 fxpar.StrategyError, r"Strategy\(offload_to='disk'\) needs offload_dir",
                                 r"a directory each rank may write its files into"),
    "offload_disk_with_nothing": (lambda: fxpar.Strategy(dp=2, zero=3, offload_to="disk", offload_dir="/tmp/x"),
                                  fxpar.StrategyError, r"Strategy\(offload_to='disk'\) with nothing to offload",
                                  r"add offload=\('params', 'optimizer'\)"),
    "sharding_unknown": (lambda: fxpar.Strategy(tp=2, sharding="rows"), fxpar.StrategyError,
                         r"Strategy\(sharding='rows'\)",
                         r"choose one of \('auto', 'megatron', 'annotations'\) or pass Mesh-TensorFlow layouts"),
    "sharding_layout_unknown_parameter": (lambda: _on2(fxpar.Strategy(tp=2, sharding={"nope.weight": ("tp", None)})),
                                          PassError, r"layout pattern 'nope.weight' matches no parameter",
                                          r"parameter keys look like \['0.bias'.*fix the pattern"),
    "sharding_layout_over_dp": (lambda: _on2(fxpar.Strategy(tp=2, sharding={"0.weight": ("dp", None)})),
                                fxpar.StrategyError, r"mesh axis 'dp' is not a tensor-parallel axis",
                                r"layouts split over 'tp'"),
    "sharding_layout_too_short": (lambda: _on2(fxpar.Strategy(tp=2, sharding={"0.weight": ("tp",)})), PassError,
                                  r"parameter '0.weight' \(layout '0.weight': \('tp',\)\) has shape \[8, 6\]",
                                  r"give one entry \(a mesh axis or None\) per dim"),
    "zero_stage_four": (lambda: fxpar.Strategy(dp=2, zero=4), fxpar.StrategyError, r"Strategy\(zero=4\)",
                        r"choose 0 \(off\), 1 .*2 .*or 3"),
    "zero_stage_string": (lambda: fxpar.Strategy(dp=2, zero="3"), fxpar.StrategyError, r"Strategy\(zero='3'\)",
                          r"choose 0 \(off\)"),
    "zero_at_dp1": (lambda: _par(zero=2), fxpar.StrategyError, r"Strategy\(zero=2, dp=1\)",
                    r"set dp > 1 \(e.g. Strategy\(dp=4, zero=2\)\) or zero=0"),
    "zero_with_tp": (lambda: _on2(fxpar.Strategy(tp=2, zero=1)), fxpar.StrategyError,
                     r"feature 'tensor_parallel' \(tp=2\) conflicts with feature 'zero' \(zero=1\)",
                     r"drop one of them"),
    "dp_zero": (lambda: fxpar.Strategy(dp=0), fxpar.StrategyError, r"Strategy\(dp=0\)", r"must be a positive int"),
    "tp_negative": (lambda: fxpar.Strategy(tp=-2), fxpar.StrategyError, r"Strategy\(tp=-2\)",
                    r"must be a positive int"),
    "pp_a_float": (lambda: fxpar.Strategy(pp=2.0), fxpar.StrategyError, r"Strategy\(pp=2.0\)",
                   r"must be a positive int"),
    "microbatches_zero": (lambda: fxpar.Strategy(pp=2, microbatches=0), fxpar.StrategyError,
                          r"Strategy\(microbatches=0\)", r"must be a positive int"),
    "microbatches_not_dividing": (lambda: _on2(fxpar.Strategy(pp=2, microbatches=3)), fxpar.StrategyError,
                                  r"which dp=1 x microbatches=3 = 3 does not divide",
                                  r"use a global batch that is a multiple of 3"),
    "option_typo": (lambda: fxpar.Strategy(dp=2, buket_cap_mb=1), fxpar.StrategyError,
                    r"Strategy\(buket_cap_mb=...\)", r"did you mean 'bucket_cap_mb'\?"),
    # ---- the compression methods' settings (fxpar/compress) ----------------------------------------------
    "topk_ratio_zero": (lambda: _dp2(grad_sync=C.TopK(ratio=0)), fxpar.StrategyError, r"TopK\(ratio=0\)",
                        r"choose a number in \(0, 1\]"),
    "topk_ratio_above_one": (lambda: _dp2(grad_sync=C.TopK(ratio=2.0)), fxpar.StrategyError, r"TopK\(ratio=2.0\)",
                             r"choose a number in \(0, 1\]"),
    "topk_error_feedback_string": (lambda: _dp2(grad_sync=C.TopK(ratio=0.5, error_feedback="yes")),
                                   fxpar.StrategyError, r"TopK\(error_feedback='yes'\)",
                                   r"pass error_feedback=True or error_feedback=False"),
    "randomk_ratio_negative": (lambda: _dp2(grad_sync=C.RandomK(ratio=-0.1)), fxpar.StrategyError,
                               r"RandomK\(ratio=-0.1\)", r"choose a number in \(0, 1\]"),
    "randomk_unbiased_string": (lambda: _dp2(grad_sync=C.RandomK(ratio=0.5, unbiased="yes")), fxpar.StrategyError,
                                r"RandomK\(unbiased='yes'\)", r"pass unbiased=True or unbiased=False"),
    "randomk_seed_float": (lambda: _dp2(grad_sync=C.RandomK(ratio=0.5, seed=1.5)), fxpar.StrategyError,
                           r"RandomK\(seed=1.5\)", r"is an int"),
    "powersgd_rank_zero": (lambda: _dp2(grad_sync=C.PowerSGD(rank=0)), fxpar.StrategyError, r"PowerSGD\(rank=0\)",
                           r"must be an int >= 1 \(1 to 4 is usual"),
    "powersgd_rank_float": (lambda: _dp2(grad_sync=C.PowerSGD(rank=1.5)), fxpar.StrategyError,
                            r"PowerSGD\(rank=1.5\)", r"must be an int >= 1"),
    "powersgd_start_negative": (lambda: _dp2(grad_sync=C.PowerSGD(rank=1, start_iter=-1)), fxpar.StrategyError,
                                r"PowerSGD\(start_iter=-1\)", r"must be an int >= 0"),
    "qsgd_levels_too_many": (lambda: C.QSGD(levels=200), fxpar.StrategyError, r"QSGD\(levels=200\)",
                             r"an int from 1 to 127 .*pass e.g. levels=16"),
    "qsgd_bucket_zero": (lambda: C.QSGD(levels=16, bucket=0), fxpar.StrategyError, r"QSGD\(bucket=0\)",
                         r"pass e.g. bucket=1024"),
    "nuqsgd_one_bit": (lambda: C.NUQSGD(bits=1), fxpar.StrategyError, r"NUQSGD\(bits=1\)", r"pass e.g. bits=4"),
    "nuqsgd_nine_bits": (lambda: C.NUQSGD(bits=9), fxpar.StrategyError, r"NUQSGD\(bits=9\)",
                         r"an int from 2 to 8"),
    "alq_zero_bits": (lambda: C.ALQ(bits=0), fxpar.StrategyError, r"ALQ\(bits=0\)", r"pass e.g. bits=4"),
    "amq_bits_string": (lambda: C.AMQ(bits="3"), fxpar.StrategyError, r"AMQ\(bits='3'\)", r"pass e.g. bits=4"),
    "wangni_ratio_zero": (lambda: C.Wangni(ratio=0), fxpar.StrategyError, r"Wangni\(ratio=0\)",
                          r"must be in \(0, 1\]; pass e.g. ratio=0.01"),
    "accordion_not_powersgd": (lambda: _dp2(grad_sync=C.Accordion(low=C.PowerSGD(rank=1), high="x")),
                               fxpar.StrategyError, r"Accordion\(high='x'\)", r"give a PowerSGD\(...\) setting"),
    "accordion_ranks_swapped": (lambda: _dp2(grad_sync=C.Accordion(low=C.PowerSGD(rank=4), high=C.PowerSGD(rank=1))),
                                fxpar.StrategyError, r"Accordion\(low=PowerSGD\(rank=4\), high=PowerSGD\(rank=1\)\)",
                                r"the larger rank; swap them"),
    "ddp_hook_not_callable": (lambda: _dp2(grad_sync=C.DDPHook(3, None)), fxpar.StrategyError,
                              r"DDPHook\(hook=3\)", r"must be a function hook\(state, bucket\)"),
    "ddp_hook_lambda": (lambda: _dp2(grad_sync=C.DDPHook(lambda state, bucket: bucket, None)), fxpar.StrategyError,
                        r"DDPHook\(hook=.*<lambda>", r"define it at the top level of a module"),
    "qadam_warmup_negative": (lambda: C.QAdam(warmup_steps=-1), fxpar.StrategyError, r"QAdam\(warmup_steps=-1\)",
                              r"must be an int >= 1 .*pass e.g. warmup_steps=100"),
    "qadam_warmup_zero": (lambda: _dp2(grad_sync=C.QAdam(warmup_steps=0)), fxpar.StrategyError,
                          r"QAdam\(warmup_steps=0\).*frozen", r"pass e.g. warmup_steps=100"),
    "qadam_beta_one": (lambda: C.QAdam(betas=(0.9, 1.0)), fxpar.StrategyError, r"QAdam\(betas=\(0.9, 1.0\)\)",
                       r"each in \[0, 1\); pass e.g. betas=\(0.9, 0.999\)"),
    "qadam_with_adam": (lambda: _par(world=2, optimizer=(torch.optim.Adam, {"lr": 1e-3}), grad_sync=C.QAdam()),
                        fxpar.StrategyError, r"grad_sync=QAdam\(warmup_steps=100.* with optimizer Adam",
                        r"Pass optimizer=\(fxpar.compress.QAdamOptimizer, \{'lr': ...\}\)"),
    "qadam_optimizer_without_qadam": (lambda: _par(world=2, optimizer=(C.QAdamOptimizer, {"lr": 1e-3})),
                                      fxpar.StrategyError, r"optimizer QAdamOptimizer .* no grad_sync='qadam'",
                                      r"Pass Strategy\(grad_sync='qadam'\)"),
    "qadam_with_zero": (lambda: _dp2(zero=1, grad_sync=C.QAdam()), fxpar.StrategyError,
                        r"feature 'qadam' \(grad_sync=QAdam\(warmup_steps=100.*conflicts with feature 'zero' "
                        r"\(zero=1\)", r"drop one of them"),
    "qadam_with_tp": (lambda: _on2(fxpar.Strategy(dp=2, tp=2, grad_sync="qadam")), fxpar.StrategyError,
                      r"feature 'qadam' \(grad_sync='qadam'\) conflicts with feature 'tensor_parallel'",
                      r"drop one of them"),
    "compression_with_zero": (lambda: _dp2(zero=2, grad_sync=C.TopK(ratio=0.5)), fxpar.StrategyError,
                              r"feature 'topk' \(grad_sync=TopK\(ratio=0.5.*conflicts with feature 'zero' \(zero=2\)",
                              r"drop one of them"),
    "compression_without_dp": (lambda: _on2(fxpar.Strategy(tp=2, sharding="megatron", grad_sync=C.TopK(ratio=0.5))),
                               fxpar.StrategyError, r"Strategy\(grad_sync=TopK\(.*it needs dp >= 2 \(dp=1\)",
                               r"set dp or drop grad_sync"),
    # ---- a Plan JSON edited by hand -------------------------------------------------------------------
    "plan_json_broken": (lambda: fxpar.Plan.from_json('{"cuts": [}'), ValueError,
                         r"Plan.from_json: the text is not valid JSON: Expecting value at line 1, column 11",
                         r"Fix it there"),
    "plan_json_not_an_object": (lambda: fxpar.Plan.from_json("[1]"), ValueError, r"the JSON holds a list",
                                r"pass the text Plan.to_json\(\) wrote"),
    "plan_unknown_field": (lambda: fxpar.Plan.from_json(_plan_text(bucketz=1)), ValueError,
                           r"unknown field\(s\) \['bucketz'\]", r"a feature's decisions go under \"features\""),
    "plan_unknown_section": (lambda: fxpar.Plan.from_json(_plan_text(features={"nosuch": {}})), ValueError,
                             r"unknown feature section 'nosuch'", r"the sections that exist: \['accordion'"),
    "plan_unknown_section_field": (lambda: _edited_plan("dp2", lambda d: d["features"]["data_parallel"].update(
        bogus=1)), ValueError, r"section 'data_parallel' has unknown field\(s\) \['bogus'\]",
        r"its fields: \['broadcast_buffers'"),
    "plan_bucket_unknown_parameter": (lambda: _edited_plan("dp2", lambda d: d["features"]["data_parallel"]["buckets"][0]
                                                           .append(["nope.weight"])), fxpar.StrategyError,
                                      r"data_parallel section: buckets\[0\]\[\d\] names \['nope.weight'\]",
                                      r"fix the name, or set buckets to \[\] to have them planned again"),
    "plan_stage_params_unknown": (lambda: _edited_plan("dp2", lambda d: d["stage_params"][0].append("nope.weight")),
                                  fxpar.StrategyError, r"stage_params\[0\] names \['nope.weight'\]",
                                  r"fix the name, or plan again from the Strategy"),
    "plan_stage_count_mismatch": (lambda: _edited_plan("pp2", lambda d: d.update(stage_to_rank=[[0], [0], [1]])),
                                  fxpar.StrategyError, r"stage_to_rank lists 3 stage\(s\) but its stage_params 2",
                                  r"edit cuts \(or Strategy\(pp=...\)\)"),
    "plan_mesh_mismatch": (lambda: _edited_plan("dp2", lambda d: d.update(mesh_axes=[["pp", 1], ["dp", 4]])),
                           fxpar.StrategyError, r"mesh_axes \[\['pp', 1\], \['dp', 4\]\] give dp=4",
                           r"change dp/tp/pp in Strategy\(...\) and plan again"),
    "plan_microbatches_zero": (lambda: _edited_plan("dp2", lambda d: d.update(microbatches=0)), fxpar.StrategyError,
                               r"the Plan's microbatches=0", r"must be a positive int"),
    "plan_microbatches_string": (lambda: _edited_plan("pp2", lambda d: d.update(microbatches="2")),
                                 fxpar.StrategyError, r"the Plan's microbatches='2'", r"fix it in the Plan or its JSON"),
    "plan_schedule_unknown": (lambda: _edited_plan("pp2", lambda d: _set_schedule(d, "zigzag")), fxpar.StrategyError,
                              r"section names schedule 'zigzag'", r"it builds \['1f1b', 'gpipe'.*fix the section"),
    "plan_cut_unknown": (lambda: _edited_plan("pp2", lambda d: d.update(cuts=["nope"])), fxpar.StrategyError,
                         r"split point 'nope' is not a module the forward runs", r"candidates: \['1', '2'\]"),
    "plan_cut_too_many": (lambda: _edited_plan("pp2", lambda d: d.update(cuts=["1", "2"])), fxpar.StrategyError,
                          r"\['1', '2'\] gives 3 stages but the schedule needs 2", r"give 1 module paths"),
    "plan_not_a_plan": (lambda: fxpar.parallelize(_net(), 2, (X, Y), CE, SGD, plan={"cuts": []}), TypeError,
                        r"plan=\{'cuts': \[\]\}", r"pass a fxpar.Plan"),
    "plan_made_with_another_strategy": (
        lambda: fxpar.parallelize(_net(), 2, (X, Y), CE, SGD, strategy=fxpar.Strategy(dp=2, bucket_cap_mb=1),
                                  plan=fxpar.parallelize(_net(), 2, (X, Y), CE, SGD,
                                                         strategy=fxpar.Strategy(dp=2, bucket_cap_mb=0.001)).plan),
        fxpar.StrategyError, r"the Plan was made with bucket_cap_mb=0.001 but the Strategy passed with it has "
                             r"bucket_cap_mb=1.*would not run what the Strategy says",
        r"Pass the Plan's own strategy \(program.strategy\) and edit the Plan, or drop plan= to plan again"),
    # ---- offload to the CPU moves only what a ZeRO stage moves --------------------------------------------
    "offload_optimizer_without_zero": (lambda: fxpar.Strategy(dp=2, offload=("optimizer",)), fxpar.StrategyError,
                                       r"Strategy\(offload=\('optimizer',\), zero=0\).*no chunks",
                                       r"Set zero=1, 2 or 3.*or offload_to='disk' with offload_dir=.*or drop offload"),
    "offload_optimizer_dp1": (lambda: fxpar.Strategy(offload=("optimizer",)), fxpar.StrategyError,
                              r"offload=\('optimizer',\), zero=0", r"Set zero=1, 2 or 3 \(with dp > 1\)"),
    "offload_params_without_zero": (lambda: fxpar.Strategy(dp=2, offload=("params",)), fxpar.StrategyError,
                                    r"Strategy\(offload=\('params',\), zero=0\).*stay whole on the device",
                                    r"Set zero=3 \(with dp > 1\), or offload_to='disk'"),
    "offload_params_zero2": (lambda: fxpar.Strategy(dp=2, zero=2, offload=("params",)), fxpar.StrategyError,
                             r"Strategy\(offload=\('params',\), zero=2\)",
                             r"Set zero=3.*drop 'params' from offload.*offload=\('optimizer',\) already keeps"),
    "offload_both_zero1": (lambda: fxpar.Strategy(dp=2, zero=1, offload=("params", "optimizer")),
                           fxpar.StrategyError, r"Strategy\(offload=\('params', 'optimizer'\), zero=1\)",
                           r"drop 'params' from offload"),
    # ---- a handed-back Plan: an edit the run would not read is refused ------------------------------------
    "plan_cuts_without_pipeline": (lambda: _edited_plan("dp2", lambda d: d.update(cuts=["1"])), fxpar.StrategyError,
                                   r"the Plan's cuts \['1'\] cut a pipeline, but .*pp=1",
                                   r"Set cuts to \[\] for one stage, or ask for a pipeline"),
    "plan_cuts_and_split_points": (lambda: fxpar.parallelize(
        _net(), 2, (X, Y), CE, SGD, strategy=fxpar.Strategy(pp=2, microbatches=2, split_points=["1"]),
        plan=fxpar.Plan.from_json(_plan_json("pp2"))), fxpar.StrategyError,
        r"the Plan's cuts \['2'\] and Strategy\(split_points=\['1'\]\) disagree",
        r"drop split_points from the Strategy, or set the Plan's cuts to \[\]"),
    "plan_batch_dim": (lambda: _edited_plan("dp2", lambda d: d.update(batch_dim=1)), fxpar.StrategyError,
                       r"the Plan's batch_dim=1", r"Set batch_dim to 0 and put the batch on dim 0"),
    "plan_global_batch": (lambda: _edited_plan("dp2", lambda d: d.update(global_batch=16)), fxpar.StrategyError,
                          r"the Plan's global_batch gives 16, but this run derives 8 from the rows of example_inputs",
                          r"give example_inputs that many rows, or hand back global_batch as planned"),
    "plan_placement": (lambda: _edited_plan("pp2", lambda d: d.update(stage_to_rank=[[1], [0]])), fxpar.StrategyError,
                       r"the Plan's stage_to_rank gives \[\[1\], \[0\]\], but this run derives \[\[0\], \[1\]\]",
                       r"write the placement in a hand-written schedule"),
    "plan_stage_params_dropped": (lambda: _edited_plan("dp2", lambda d: d["stage_params"][0].remove("2.bias")),
                                  fxpar.StrategyError, r"the Plan's stage_params gives \['0.bias', '0.weight', "
                                  r"'2.weight'\]", r"freeze a parameter with requires_grad_\(False\)"),
    "plan_tied": (lambda: _edited_plan("pp2", lambda d: d.update(tied={"0.weight": [0, 1]})), fxpar.StrategyError,
                  r"the Plan's tied gives \['0.weight'\]", r"tie or untie them in the model"),
    "plan_grad_groups": (lambda: _edited_plan("pp2", lambda d: d["grad_groups"][0].update({"0.weight": "dp"})),
                         fxpar.StrategyError, r"the Plan's grad_groups gives \{'0.weight': \['dp'\]\}, but this run derives \{'0.weight': \[None\]\}",
                         r"change dp/tp/pp or the schedule"),
    "plan_groups": (lambda: _edited_plan("dp2", lambda d: d.update(groups={"mine": [[0, 1]]})), fxpar.StrategyError,
                    r"the Plan's groups gives \{'mine': \[\[0, 1\]\]\}", r"change dp/tp/pp or the schedule"),
    "plan_optimizer_kernel": (lambda: _edited_plan("dp2", lambda d: d["optimizer"].update(kernel="fused")),
                              fxpar.StrategyError, r"the Plan's optimizer gives \{'kernel': 'fused'\}",
                              r"pass that optimizer, or hand back optimizer as planned"),
    "plan_loss_average": (lambda: _edited_plan("dp2", lambda d: d.update(loss_average="per_shard")),
                          fxpar.StrategyError, r"the Plan's loss_average gives 'per_shard'",
                          r"set Strategy\(loss_average=...\)"),
    "plan_passes_reordered": (lambda: _edited_plan("dp2", lambda d: d["passes"].reverse()), fxpar.StrategyError,
                              r"the Plan's passes gives \['split_graphs'",
                              r"Strategy\(passes=\[...\]\); the order of the built-in passes is fixed"),
    "plan_custom_passes": (lambda: _edited_plan("dp2", lambda d: d.update(custom_passes=["mine"])),
                           fxpar.StrategyError, r"the Plan's custom_passes gives \['mine'\]",
                           r"pass them in Strategy\(passes=\[...\]\)"),
    "plan_candidates": (lambda: _edited_plan("pp2", lambda d: d.update(candidates=["2"])), fxpar.StrategyError,
                        r"the Plan's candidates gives \['2'\]", r"choose cuts among them"),
}


# ---- decentralized SGD (fxpar/compress/decentralized.py): its options and what it cannot run with ------------------
DECENTRALIZED_CASES = {
    "decentralized_peers_unknown": (lambda: C.Decentralized(peers="star"), fxpar.StrategyError,
                                    r"Decentralized\(peers='star'\)", r"one of \['all', 'ring', 'shift_one'\]"),
    "decentralized_interval_zero": (lambda: C.Decentralized(communication_interval=0), fxpar.StrategyError,
                                    r"Decentralized\(communication_interval=0\)", r"must be an int >= 1"),
    "decentralized_low_precision_all": (lambda: C.Decentralized(low_precision=True), fxpar.StrategyError,
                                        r"Decentralized\(low_precision=True, peers='all', communication_interval=1\)",
                                        r"pass peers='ring', communication_interval=1, or low_precision=False"),
    "decentralized_ring_of_two": (lambda: _dp2(grad_sync=C.Decentralized(peers="ring")), fxpar.StrategyError,
                                  r"Strategy\(dp=2, grad_sync=Decentralized\(peers='ring'\)\)",
                                  r"use peers='all' or 'shift_one', or dp >= 3"),
    "decentralized_shift_one_odd_dp": (lambda: _par(world=3, grad_sync=C.Decentralized(peers="shift_one")),
                                       fxpar.StrategyError, r"Decentralized\(peers='shift_one'\)\).*dp must be even",
                                       r"use an even dp"),
    "decentralized_with_pp": (lambda: _par(world=4, _raw=fxpar.Strategy(dp=2, pp=2, microbatches=2,
                                                                       grad_sync=C.Decentralized())),
                              fxpar.StrategyError, r"grad_sync=Decentralized\(.*with a pipeline \(pp > 1\)",
                              r"train with pp=1"),
    "decentralized_with_zero": (lambda: _dp2(zero=1, grad_sync=C.Decentralized()), fxpar.StrategyError,
                                r"feature 'decentralized' \(grad_sync=Decentralized\(.*conflicts with feature 'zero'",
                                r"drop one of them"),
    "decentralized_with_tp": (lambda: _par(world=4, _raw=fxpar.Strategy(dp=2, tp=2, grad_sync="decentralized")),
                              fxpar.StrategyError,
                              r"feature 'decentralized' \(grad_sync='decentralized'\) conflicts with feature "
                              r"'tensor_parallel'", r"drop one of them"),
    "decentralized_with_weight_decay": (lambda: _par(world=2, optimizer=(torch.optim.SGD, {"lr": 0.1,
                                                                                         "weight_decay": 1e-4}),
                                                     grad_sync=C.Decentralized()).run_local([(X, Y)]),
                                        fxpar.StrategyError, r"with optimizer SGD\(weight_decay=0.0001\)",
                                        r"Pass weight_decay=0 to SGD, or add the decay to the loss"),
    "decentralized_order_unknown": (lambda: C.Decentralized(order="atc"), fxpar.StrategyError,
                                    r"Decentralized\(order='atc'\)",
                                    r"one of \['combine_then_adapt', 'adapt_then_combine'\]"),
    "decentralized_low_precision_after": (lambda: C.Decentralized(peers="ring", low_precision=True,
                                                                  order="adapt_then_combine"), fxpar.StrategyError,
                                          r"Decentralized\(low_precision=True, order='adapt_then_combine'\)",
                                          r"pass order='combine_then_adapt', or low_precision=False"),
}


# ---- synchronisation methods (fxpar/sync/): their options and what they cannot run with -------------------------------
def _hierarchical(levels, dp: int = 4):
    return fxpar.parallelize(_net(), fxpar.ClusterSpec.local(dp), (X, Y), CE, SGD,
                             strategy=fxpar.Strategy(dp=dp, sync=S.LocalSGD(hierarchical=levels)))


SYNC_CASES = {
    "hierarchical_with_period": (lambda: S.LocalSGD(period=4, hierarchical={2: 2, 4: 4}), fxpar.StrategyError,
                                 r"LocalSGD\(period=4, hierarchical=\{2: 2, 4: 4\}\)", r"leave period at 1"),
    "hierarchical_named_wrong": (lambda: S.LocalSGD(hierarchical={"rack": 2, "global": 4}), fxpar.StrategyError,
                                 r"hierarchical=\{'rack': 2, 'global': 4\}", r"\{'node': period, 'global': period\}"),
    "hierarchical_group_not_dividing": (lambda: _hierarchical({2: 3, 4: 4}), fxpar.StrategyError,
                                        r"a group of 3 replica\(s\) \(period 2\) does not divide dp=4",
                                        r"use group sizes that divide it"),
    "hierarchical_last_not_every_replica": (lambda: _hierarchical({2: 4, 4: 2}), fxpar.StrategyError,
                                            r"the largest period's group \(2\) must be every replica \(dp=4\)",
                                            r"as torch's HierarchicalModelAverager requires"),
    "sync_period_zero": (lambda: S.LocalSGD(period=0), fxpar.StrategyError, r"LocalSGD\(period=0\)",
                         r"must be an int >= 1"),
    "sync_period_float": (lambda: S.SlowMo(period=2.5), fxpar.StrategyError, r"SlowMo\(period=2.5\)",
                          r"must be an int >= 1"),
    "sync_warmup_negative": (lambda: S.LocalSGD(period=2, warmup_steps=-1), fxpar.StrategyError,
                             r"LocalSGD\(warmup_steps=-1\)", r"an int >= 0"),
    "sync_not_a_method": (lambda: _dp2(sync="local_sgd"), fxpar.StrategyError, r"Strategy\(sync='local_sgd'\)",
                          r"pass a method of fxpar.sync \(S.LocalSGD\(period=8\)"),
    "sync_dp1": (lambda: _par(world=1, sync=S.LocalSGD(period=2)), fxpar.StrategyError,
                 r"Strategy\(sync=LocalSGD\(period=2, warmup_steps=0\)\).*needs dp >= 2", r"set dp or drop sync"),
    "sync_with_zero": (lambda: _dp2(zero=1, sync=S.LocalSGD(period=2)), fxpar.StrategyError,
                       r"feature 'sync' \(sync=LocalSGD\(.*conflicts with feature 'zero' \(zero=1\)",
                       r"drop one of them"),
    "async_timed_with_tp": (lambda: _par(world=4, _raw=fxpar.Strategy(dp=2, tp=2, sync=S.AsyncAveraging(
                                interval_s=0.5))), fxpar.StrategyError,
                            r"Strategy\(sync=AsyncAveraging\(.*interval_s=0.5.*\), tp=2\): each rank's background "
                            r"loop snapshots .* would drift apart",
                            r"Use S.AsyncAveraging\(every_steps=k, warmup_steps=0\)"),
    "diloco_quantized_with_tp": (lambda: _par(world=4, _raw=fxpar.Strategy(dp=2, tp=2, sync=S.DiLoCo(
                                     period=4, fragments=2, quantize="e3m0"))), fxpar.StrategyError,
                                 r"Strategy\(sync=DiLoCo\(.*quantize='e3m0'.*\), tp=2\): the E3M0 format scales each "
                                 r"tensor by its largest magnitude", r"drop quantize .* or train with tp=1"),
    "sync_with_grad_sync": (lambda: _dp2(grad_sync=C.TopK(ratio=0.5), sync=S.LocalSGD(period=2)), fxpar.StrategyError,
                            r"Strategy\(sync=LocalSGD\(period=2, warmup_steps=0\), grad_sync=TopK\(",
                            r"drop one of them"),
    "sync_with_herring": (lambda: _dp2(grad_sync="herring", sync=S.DiLoCo(period=2)), fxpar.StrategyError,
                          r"sync=DiLoCo\(.*(grad_sync='herring'|feature 'herring')", r"drop one of them"),
    "sync_with_bytescheduler": (lambda: _dp2(comm_schedule="bytescheduler", sync=S.LocalSGD(period=2)),
                                fxpar.StrategyError, r"feature 'sync' \(sync=LocalSGD\(.*feature 'bytescheduler'",
                                r"drop one of them"),
    "sync_with_pp": (lambda: _par(world=4, _raw=fxpar.Strategy(dp=2, pp=2, microbatches=2,
                                                               sync=S.LocalSGD(period=2))),
                     fxpar.StrategyError, r"Strategy\(sync=LocalSGD\(period=2, warmup_steps=0\), pp=2\)",
                     r"train with pp=1 or drop sync"),
    "diloco_outer_not_optimizer": (lambda: S.DiLoCo(period=2, outer=("sgd", {"lr": 0.7})), fxpar.StrategyError,
                                   r"DiLoCo\(outer=\('sgd'", r"pass \(torch optimizer class, its keyword arguments\)"),
    "diloco_outer_bad_kwargs": (lambda: S.DiLoCo(period=2, outer=(torch.optim.SGD, {"lr": 0.7, "nesterov": True})),
                                fxpar.StrategyError, r"DiLoCo\(outer=\(SGD, .*SGD refuses these arguments",
                                r"pass ones it takes"),
    "slowmo_momentum_one": (lambda: S.SlowMo(period=2, slow_momentum=1.0), fxpar.StrategyError,
                            r"SlowMo\(slow_momentum=1.0\)", r"a number in \[0, 1\)"),
    "slowmo_base_unknown": (lambda: S.SlowMo(period=2, base="sgp"), fxpar.StrategyError, r"SlowMo\(base='sgp'\)",
                            r"'localsgd' is the one built"),
    "dssp_low_above_high": (lambda: S.DSSP(low=5, high=2), fxpar.StrategyError, r"DSSP\(low=5, high=2\)",
                            r"low must be <= high.*DSSP\(low=2, high=5\)"),
    "ssp_staleness_negative": (lambda: S.SSP(staleness=-1), fxpar.StrategyError, r"SSP\(staleness=-1\)",
                               r"must be an int >= 0 \(0: synchronous SGD\)"),
    "ssp_period": (lambda: S.SSP(period=4), fxpar.StrategyError, r"SSP\(period=4, warmup_steps=0\)",
                   r"leave both out, e.g. SSP\(staleness=...\)"),
    "ssp_without_servers": (lambda: _servers(0, sync=S.SSP(staleness=2)), fxpar.StrategyError,
                            r"Strategy\(sync=SSP\(staleness=2\)\).*this ClusterSpec has none \(cpu_servers=0\)",
                            r"pass ClusterSpec.local\(2, cpu_servers=1\)"),
    "ssp_with_zero": (lambda: _servers(1, zero=1, sync=S.SSP(staleness=2)), fxpar.StrategyError,
                      r"Strategy\(sync=SSP\(staleness=2\), zero=1\): ZeRO shards the optimizer state",
                      r"drop zero .* or drop sync"),
    "dssp_with_tp": (lambda: _servers(1, world=4, tp=2, sync=S.DSSP(low=1, high=4)), fxpar.StrategyError,
                     r"Strategy\(sync=DSSP\(low=1, high=4\), tp=2\): each parameter server holds whole parameter "
                     r"tensors, and a worker is one rank", r"Train with tp=1, or use S.LocalSGD"),
    "ssp_with_pp": (lambda: _servers(1, world=4, pp=2, microbatches=2, sync=S.SSP(staleness=1)), fxpar.StrategyError,
                    r"pp=2.*sync=SSP\(staleness=1\).* with ClusterSpec\(cpu_servers=1\): each pipeline stage's "
                    r"parameters live on servers of their own", r"give cpu_servers a multiple of pp \(e.g. "
                    r"cpu_servers=2\)"),
    "local_sgd_with_pp": (lambda: _servers(0, world=4, pp=2, microbatches=2, sync=S.LocalSGD(period=2)),
                          fxpar.StrategyError, r"Strategy\(sync=LocalSGD\(period=2.*\), pp=2\)",
                          r"train with pp=1 or drop sync"),
    "cpu_servers_unused": (lambda: _servers(1), fxpar.StrategyError,
                           r"cpu_servers=1 CPU server rank\(s\), which no feature of this Strategy uses",
                           r"Strategy\(sync=S.SSP\(...\)\), or ClusterSpec\(cpu_servers=0\)"),
    "slowdown_below_one": (lambda: fxpar.ClusterSpec.local(2, slowdown={1: 0.5}), fxpar.errors.ClusterSpecError,
                           r"ClusterSpec\(slowdown=\{1: 0.5\}\): rank 1's factor 0.5", r"a factor >= 1 per slowed"),
}



def _pp2(optimizer=SGD, **options):
    """A pp=2 program of the two-stage net with these Strategy options (the plan-time checks: no rank starts)."""
    return fxpar.parallelize(_net(), 2, (X, Y), CE, optimizer, strategy=fxpar.Strategy(pp=2, microbatches=2, **options))


def _warned(fn):
    """Call ``fn`` with warnings raised as errors: the warning is the exception the case checks."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        return fn()


# ---- asynchronous pipelines without weight stashing (fxpar/features/pipeline_delayed.py) -------------------------
DELAYED_CASES = {
    "pbp_correction_unknown": (lambda: fxpar.Strategy(pp=2, schedule="pipelined_bp", correction="spike"),
                               fxpar.StrategyError, r"Strategy\(schedule='pipelined_bp', correction='spike'\): "
                               r"unknown correction", r"\[None, 'sc', 'lwp', 'sc\+lwp'\].*Pick one of them"),
    "pipemare_given_correction": (lambda: fxpar.Strategy(pp=2, schedule="pipemare", correction="sc"),
                                  fxpar.StrategyError, r"correction= belongs to schedule='pipelined_bp'",
                                  r"PipeMare corrects with lr_warmup= and discrepancy_correction=.*Drop correction= "
                                  r"or set schedule='pipelined_bp'"),
    "pbp_given_lr_warmup": (lambda: fxpar.Strategy(pp=2, schedule="pipelined_bp", lr_warmup=10),
                            fxpar.StrategyError, r"lr_warmup=10\): lr_warmup= belongs to schedule='pipemare'",
                            r"Drop lr_warmup= or set schedule='pipemare'"),
    "1f1b_given_discrepancy_correction": (lambda: fxpar.Strategy(pp=2, schedule="1f1b", discrepancy_correction=True),
                                         fxpar.StrategyError, r"Strategy\(schedule='1f1b', discrepancy_correction="
                                         r"True\): discrepancy_correction= belongs to schedule='pipemare'",
                                         r"Drop discrepancy_correction= or set schedule='pipemare'"),
    "pipemare_lr_warmup_negative": (lambda: fxpar.Strategy(pp=2, schedule="pipemare", lr_warmup=-1),
                                    fxpar.StrategyError, r"lr_warmup=-1\): the warm-up is a number of updates",
                                    r"pass lr_warmup=N"),
    "pbp_spike_compensation_with_adamw": (lambda: _pp2((torch.optim.AdamW, {"lr": 0.1}), schedule="pipelined_bp",
                                                       correction="sc"), fxpar.StrategyError,
                                          r"correction='sc'\) corrects SGD with momentum.*it is AdamW",
                                          r"Pass optimizer=\(torch.optim.SGD, \{'lr': ..., 'momentum': 0.9\}\), or "
                                          r"correction=None"),
    "pbp_weight_prediction_without_momentum": (lambda: _pp2(schedule="pipelined_bp", correction="lwp"),
                                               fxpar.StrategyError, r"correction='lwp'\).*its momentum is 0",
                                               r"'momentum': 0.9"),
    "pipemare_one_stage_is_sgd": (lambda: _warned(lambda: fxpar.Strategy(pp=1, schedule="pipemare", microbatches=2)),
                                  UserWarning, r"Strategy\(pp=1, schedule='pipemare'\): with one stage no gradient "
                                  r"is late", r"is plain SGD with an update per microbatch; use pp > 1"),
}

def _servers(k: int, world: int = 2, **options):
    """A program on ``world`` workers and ``k`` CPU server ranks with these Strategy options (dp: the rest)."""
    dp = world // (options.get("tp", 1) * options.get("pp", 1))
    return fxpar.parallelize(_net(), fxpar.ClusterSpec.local(world, cpu_servers=k), (X, Y), CE, SGD,
                             strategy=fxpar.Strategy(dp=dp, **options))


# ---- Distributed Any-Batch Mirror Descent (fxpar/sync/dabmd.py) --------------------------------------------------
def _simplex_net():
    """The net with its last bias on the probability simplex (5 entries of 1/5)."""
    net = _net()
    with torch.no_grad():
        net[2].bias.fill_(0.2)
    return net


def _dabmd(world: int = 2, optimizer=SGD, run: bool = False, model=None, **options):
    """A program of ``world`` dp ranks with ``sync=S.DABMD(**options)`` (microbatches=2); ``run``: also
    ``run_local``, whose checks before the ranks start are the ones under test."""
    prog = fxpar.parallelize(model or _net(), world, (X, Y), CE, optimizer,
                             strategy=fxpar.Strategy(dp=world, microbatches=2, sync=S.DABMD(**options)))
    return prog.run_local([(X, Y)]) if run else prog


def _dabmd_with(world: int = 2, **strategy):
    return fxpar.parallelize(_net(), world, (X, Y), CE, SGD,
                             strategy=fxpar.Strategy(sync=S.DABMD(round_time_s=0.1), **strategy))


DABMD_CASES = {
    "dabmd_round_time_zero": (lambda: S.DABMD(round_time_s=0), fxpar.StrategyError, r"DABMD\(round_time_s=0\)",
                              r"must be a number of seconds > 0 \(e.g. round_time_s=0.5\)"),
    "dabmd_round_time_negative": (lambda: S.DABMD(round_time_s=-1.5), fxpar.StrategyError,
                                  r"DABMD\(round_time_s=-1.5\)", r"or pass fixed_microbatches"),
    "dabmd_mirror_unknown": (lambda: S.DABMD(mirror="kl"), fxpar.StrategyError, r"DABMD\(mirror='kl'\)",
                             r"one of \['euclidean', 'entropic'\]"),
    "dabmd_mixing_unknown": (lambda: S.DABMD(mixing="star"), fxpar.StrategyError, r"DABMD\(mixing='star'\)",
                             r"one of \['full', 'ring'\]"),
    "dabmd_simplex_without_entropic": (lambda: S.DABMD(simplex=("w",)), fxpar.StrategyError,
                                       r"DABMD\(mirror='euclidean', simplex=\['w'\]\)",
                                       r"pass mirror='entropic' or drop simplex"),
    "dabmd_fixed_with_a_clock": (lambda: S.DABMD(round_time_s=0.5, fixed_microbatches=(1, 2)), fxpar.StrategyError,
                                 r"DABMD\(round_time_s=0.5, fixed_microbatches=\(1, 2\)\)",
                                 r"pass round_time_s=None with them"),
    "dabmd_fixed_count_per_rank": (lambda: _dabmd(round_time_s=None, fixed_microbatches=(1, 2, 2)),
                                   fxpar.StrategyError, r"fixed_microbatches has 3 count\(s\) for dp=2",
                                   r"give one count per dp rank"),
    "dabmd_one_microbatch": (lambda: _dabmd_with(dp=2), fxpar.StrategyError,
                             r"Strategy\(sync=DABMD\(round_time_s=0.1.*microbatches=1\)",
                             r"set microbatches to 2 or more"),
    "dabmd_ring_of_two": (lambda: _dabmd(mixing="ring", round_time_s=0.1), fxpar.StrategyError,
                          r"Strategy\(dp=2, sync=DABMD\(.*mixing='ring'\)\): a ring's two neighbours",
                          r"use mixing='full', or dp >= 3"),
    "dabmd_entropic_off_the_simplex": (lambda: _dabmd(mirror="entropic", round_time_s=0.1, run=True),
                                       fxpar.StrategyError, r"parameter '0.bias' is not on the probability simplex "
                                       r"\(its smallest entry is", r"list only the simplex parameters in "
                                       r"simplex=\(...\), or use mirror='euclidean'"),
    "dabmd_entropic_named_parameter_off_the_simplex": (lambda: _dabmd(mirror="entropic", simplex=("2.bias",),
                                                                      round_time_s=0.1, run=True),
                                                       fxpar.StrategyError,
                                                       r"parameter '2.bias' is not on the probability simplex",
                                                       r"initialise it on the simplex \(e.g. torch.softmax"),
    "dabmd_entropic_unknown_parameter": (lambda: _dabmd(mirror="entropic", simplex=("mixer",), round_time_s=0.1,
                                                        run=True), fxpar.StrategyError,
                                         r"simplex names \['mixer'\], which are not parameters of the model",
                                         r"name them as model.named_parameters\(\) does"),
    "dabmd_entropic_with_momentum": (lambda: _dabmd(optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                                    model=_simplex_net(), mirror="entropic", simplex=("2.bias",),
                                                    round_time_s=0.1, run=True), fxpar.StrategyError,
                                     r"with optimizer SGD\(\{'lr': 0.1, 'momentum': 0.9\}\)",
                                     r"pass optimizer=\(torch.optim.SGD, \{'lr': ...\}\) without momentum"),
    "dabmd_with_zero": (lambda: _dabmd_with(dp=2, microbatches=2, zero=1), fxpar.StrategyError,
                        r"Strategy\(sync=DABMD\(.*\), zero=1\): ZeRO shards one model's parameters",
                        r"drop zero or drop sync"),
    "dabmd_entropic_with_tp": (lambda: fxpar.parallelize(_net(), 4, (X, Y), CE, SGD, strategy=fxpar.Strategy(
                                   dp=2, tp=2, microbatches=2, sync=S.DABMD(round_time_s=0.1, mirror="entropic"))),
                               fxpar.StrategyError, r"Strategy\(sync=DABMD\(.*mirror='entropic'.*\), tp=2\): the "
                               r"entropic map normalises each simplex parameter over all its entries",
                               r"use mirror='euclidean' \(it composes with tp\) or train with tp=1"),
    "dabmd_with_pp": (lambda: _dabmd_with(world=4, dp=2, pp=2, microbatches=2), fxpar.StrategyError,
                      r"Strategy\(sync=DABMD\(.*\), pp=2\): the round's time budget",
                      r"train with pp=1 or drop sync"),
}


CASES.update(DECENTRALIZED_CASES)
CASES.update(SYNC_CASES)
CASES.update(DELAYED_CASES)
CASES.update(DABMD_CASES)

WAVELET_CASES = {
    "wavelet_chunks_over_pipeline_stages": (lambda: fxpar.Strategy(pp=2, schedule="wavelet", wave_chunks=3),
                                            fxpar.StrategyError, r"Strategy\(pp=2, wave_chunks=3\): with pp > 1 "
                                            r"schedule='wavelet' cuts the model into pp=2 stages",
                                            r"drop wave_chunks, or use pp=1"),
    "wavelet_odd_microbatches": (lambda: fxpar.Strategy(dp=2, schedule="wavelet", microbatches=3), fxpar.StrategyError,
                                 r"half the microbatches to each wave; microbatches=3 is odd",
                                 r"Use microbatches=2 or 4"),
    "wavelet_one_chunk": (lambda: fxpar.Strategy(dp=2, schedule="wavelet", wave_chunks=1), fxpar.StrategyError,
                          r"Strategy\(wave_chunks=1\).*the tock wave's forward cannot run beside the tick wave's "
                          r"backward", r"give an int >= 2"),
    "wave_chunks_without_wavelet": (lambda: fxpar.Strategy(dp=2, wave_chunks=3), fxpar.StrategyError,
                                    r"wave_chunks=3\): option\(s\) of feature 'wavelet'",
                                    r"schedule turns it on.*turn the feature on or drop them"),
    "wavelet_waves_do_not_fit": (lambda: _small_device(fxpar.Strategy(dp=2, schedule="wavelet")).run_local([(X, Y)]),
                                 fxpar.StrategyError, r"the two waves do not fit: rank 0's combined peak is "
                                 r"[0-9.]+ MiB .* against a budget of 0.00 MiB \(ClusterSpec.device.memory_bytes=1000\)",
                                 r"Use a smaller batch .*largest_batch"),
}


def _small_device(strategy, memory_bytes: int = 1000):
    """A program on 2 ranks whose devices hold ``memory_bytes``."""
    cluster = fxpar.ClusterSpec.local(2)
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=memory_bytes))
    return fxpar.parallelize(_net(), cluster, (X, Y), CE, SGD, strategy=strategy)


CASES.update(WAVELET_CASES)

# ---- asynchronous model averaging and streaming DiLoCo (fxpar/sync/async_avg.py, fxpar/sync/method.py) -------------
ASYNC_AVG_CASES = {
    "async_avg_interval_zero": (lambda: S.AsyncAveraging(interval_s=0), fxpar.StrategyError,
                                r"AsyncAveraging\(interval_s=0\)", r"must be a number > 0"),
    "async_avg_interval_negative": (lambda: S.AsyncAveraging(interval_s=-0.5), fxpar.StrategyError,
                                    r"AsyncAveraging\(interval_s=-0.5\)", r"must be a number > 0"),
    "async_avg_neither": (lambda: S.AsyncAveraging(), fxpar.StrategyError, r"AsyncAveraging\(\)",
                          r"interval_s=seconds .* or every_steps=k"),
    "async_avg_both": (lambda: S.AsyncAveraging(interval_s=0.5, every_steps=2), fxpar.StrategyError,
                       r"AsyncAveraging\(interval_s=0.5, every_steps=2\)", r"pass one of them"),
    "async_avg_every_zero": (lambda: S.AsyncAveraging(every_steps=0), fxpar.StrategyError,
                             r"AsyncAveraging\(every_steps=0\)", r"an int >= 1"),
    "async_avg_period": (lambda: S.AsyncAveraging(period=4, interval_s=0.5), fxpar.StrategyError,
                         r"AsyncAveraging\(period=4\)", r"pass interval_s=seconds .* or every_steps=k"),
    "async_avg_with_zero": (lambda: _dp2(zero=1, sync=S.AsyncAveraging(interval_s=0.5)), fxpar.StrategyError,
                            r"feature 'sync' \(sync=AsyncAveraging\(interval_s=0.5.*conflicts with feature 'zero'",
                            r"drop one of them"),
    "async_avg_with_pp": (lambda: _par(world=4, _raw=fxpar.Strategy(dp=2, pp=2, microbatches=2,
                                                                    sync=S.AsyncAveraging(interval_s=0.5))),
                          fxpar.StrategyError,
                          r"Strategy\(sync=AsyncAveraging\(interval_s=0.5, warmup_steps=0\), pp=2\)",
                          r"train with pp=1 or drop sync"),
    "diloco_fragments_zero": (lambda: S.DiLoCo(period=4, fragments=0), fxpar.StrategyError,
                              r"DiLoCo\(fragments=0\)", r"an int >= 1 \(1: plain DiLoCo"),
    "diloco_fragments_not_dividing_period": (lambda: S.DiLoCo(period=6, fragments=4), fxpar.StrategyError,
                                             r"DiLoCo\(period=6, fragments=4\)",
                                             r"use period=8 or fragments dividing 6"),
    "diloco_fragments_above_tensors": (lambda: _dp2(sync=S.DiLoCo(period=8, fragments=8)), fxpar.StrategyError,
                                       r"fragments=8 is more fragments than the model has parameter tensors \(4\)",
                                       r"use fragments <= 4"),
    "diloco_delay_past_the_fragment": (lambda: S.DiLoCo(period=4, fragments=2, delay=2), fxpar.StrategyError,
                                       r"DiLoCo\(delay=2\)", r"an int in \[0, period / fragments\) = \[0, 2\)"),
    "diloco_mix_without_delay": (lambda: S.DiLoCo(period=4, fragments=2, mix=0.5), fxpar.StrategyError,
                                 r"DiLoCo\(mix=0.5, delay=0\)", r"set delay >= 1 or leave mix at 0"),
    "diloco_fragments_with_zero": (lambda: _dp2(zero=1, sync=S.DiLoCo(period=4, fragments=2)), fxpar.StrategyError,
                                   r"feature 'sync' \(sync=DiLoCo\(.*fragments=2.*conflicts with feature 'zero'",
                                   r"drop one of them"),
    "diloco_pattern_unknown": (lambda: S.DiLoCo(period=4, fragments=2, pattern="interleaved"), fxpar.StrategyError,
                               r"DiLoCo\(pattern='interleaved'\)", r"must be 'sequential' \(consecutive tensors\) or "
                               r"'strided'"),
    "diloco_quantize_unknown_format": (lambda: S.DiLoCo(period=4, quantize="e2m1"), fxpar.StrategyError,
                                       r"DiLoCo\(quantize='e2m1'\)", r"the formats built: \['e3m0'\]"),
    "diloco_quantize_bits": (lambda: S.DiLoCo(period=4, quantize=4), fxpar.StrategyError, r"DiLoCo\(quantize=4\)",
                             r"the formats built: \['e3m0'\] \(4 bits: 1 sign, 3 exponent, 0 mantissa bits\)"),
    "diloco_strided_above_blocks": (lambda: _dp2(sync=S.DiLoCo(period=4, fragments=4, pattern="strided")),
                                    fxpar.StrategyError, r"fragments=4 is more fragments than the model has blocks "
                                    r"\(2: 0, 2\)", r"use fragments <= 2 or pattern='sequential'"),
}
CASES.update(ASYNC_AVG_CASES)


# ---- HetPipe and heterogeneous clusters (fxpar/features/pipeline_hetpipe.py, ClusterSpec.heterogeneous) ----------
_FAST = fxpar.DeviceSpec("cpu", "fast", 2**30, 100e9, 20e9)
_TINY = fxpar.DeviceSpec("cpu", "tiny", 1024, 50e9, 10e9)


def _hetpipe(cluster=None, **options):
    """A dp=2 x pp=2 HetPipe program of the two-stage net on ``cluster`` (default: 4 equal ranks, 2 servers)."""
    cluster = cluster or fxpar.ClusterSpec.local(4, cpu_servers=2)
    return fxpar.parallelize(_net(), cluster, (X, Y), CE, SGD,
                             strategy=fxpar.Strategy(dp=2, pp=2, microbatches=2, schedule="hetpipe", **options))


HETPIPE_CASES = {
    "hetpipe_device_too_small": (lambda: _hetpipe(fxpar.ClusterSpec.heterogeneous([_FAST, _FAST, _TINY, _TINY],
                                                                                  cpu_servers=2)),
                                 fxpar.StrategyError, r"stage 1's device tiny \(rank 2\) has 1024 bytes of memory, less "
                                 r"than the smallest stage any cut makes \(the one from .*\).* take \d+ bytes",
                                 r"give that stage a device with more memory.*use more stages \(pp\)"),
    "hetpipe_staleness_negative": (lambda: fxpar.Strategy(dp=2, pp=2, schedule="hetpipe", staleness=-1),
                                   fxpar.StrategyError, r"Strategy\(schedule='hetpipe', staleness=-1\): D, the most "
                                   r"waves", r"must be an int >= 0"),
    "heterogeneous_devices_not_the_world": (lambda: fxpar.ClusterSpec(device=_FAST, devices=(_FAST, _FAST, _TINY),
                                                                      devices_per_node=2),
                                            fxpar.errors.ClusterSpecError, r"devices: 3 DeviceSpec\(s\) for a world of "
                                            r"2 ranks", r"give one per worker rank"),
    "heterogeneous_nodes_not_dividing": (lambda: fxpar.ClusterSpec.heterogeneous([_FAST, _FAST, _TINY], nodes=2),
                                         fxpar.errors.ClusterSpecError, r"ClusterSpec.heterogeneous\(3 devices, "
                                         r"nodes=2\)", r"nodes must be a positive int dividing the 3 devices"),
    "hetpipe_one_virtual_worker": (lambda: fxpar.Strategy(pp=2, schedule="hetpipe"), fxpar.StrategyError,
                                   r"Strategy\(schedule='hetpipe', staleness=0\), dp=1: HetPipe's virtual workers are "
                                   r"the dp replicas", r"needs two or more \(dp >= 2\); with one, use schedule='1f1b'"),
    "hetpipe_with_zero": (lambda: fxpar.Strategy(dp=2, pp=2, schedule="hetpipe", zero=1), fxpar.StrategyError,
                          r"Strategy\(schedule='hetpipe', staleness=0\): feature\(s\) \['zero'\] do not compose with "
                          r"HetPipe", r"drop them"),
    "hetpipe_with_tp": (lambda: fxpar.Strategy(dp=2, pp=2, tp=2, schedule="hetpipe"), fxpar.StrategyError,
                        r"Strategy\(schedule='hetpipe', staleness=0\), tp=2: the parameter servers hold whole "
                        r"parameters", r"train with tp=1"),
    "hetpipe_with_sync": (lambda: fxpar.Strategy(dp=2, pp=2, schedule="hetpipe", sync=S.LocalSGD(period=2)),
                          fxpar.StrategyError, r"Strategy\(schedule='hetpipe', staleness=0\), sync=LocalSGD",
                          r"synchronises its virtual workers by wave synchronous parallel itself.*drop sync="),
    "hetpipe_servers_not_per_stage": (lambda: _hetpipe(fxpar.ClusterSpec.local(4, cpu_servers=3)),
                                      fxpar.StrategyError, r"schedule=hetpipe.* with ClusterSpec\(cpu_servers=3\): each "
                                      r"pipeline stage's parameters live on servers of their own",
                                      r"give cpu_servers a multiple of pp \(e.g. cpu_servers=2\)"),
    "ssp_pipeline_two_stages_per_rank": (lambda: _servers(2, world=4, pp=2, microbatches=2, schedule="chimera",
                                                          sync=S.SSP(staleness=1)), fxpar.StrategyError,
                                         r"Strategy\(sync=SSP\(staleness=1\)\) with schedule 'chimera': pipeline "
                                         r"rank 0 holds stages \[0, 1\]", r"use a schedule with one stage per rank"),
    "staleness_without_hetpipe": (lambda: fxpar.Strategy(dp=2, pp=2, staleness=2), fxpar.StrategyError,
                                  r"Strategy\(staleness=2\): option\(s\) of feature 'hetpipe'",
                                  r"turn the feature on or drop them"),
}
CASES.update(HETPIPE_CASES)


def _net4():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 5)).double()


def _fp16_pp2_plan_edited(edit) -> fxpar.Plan:
    strategy = fxpar.Strategy(pp=2, microbatches=2, precision="fp16")
    d = json.loads(_on2(strategy).plan.to_json())
    edit(d)
    return fxpar.parallelize(_net(), 2, (X, Y), CE, SGD, strategy=strategy, plan=fxpar.Plan.from_json(json.dumps(d)))


PRECISION_CASES = {
    "fp16_asynchronous_schedule": (lambda: _on2(fxpar.Strategy(pp=2, schedule="pipedream", microbatches=2,
                                                               precision="fp16")), fxpar.StrategyError,
                                   r"Strategy\(precision='fp16', schedule='pipedream'\): an asynchronous schedule",
                                   r"use a synchronous schedule with one stage per pipeline rank, or precision='bf16'"),
    "fp16_several_stages_per_rank": (lambda: fxpar.parallelize(_net4(), 2, (X, Y), CE, SGD, strategy=fxpar.Strategy(
        pp=2, schedule="interleaved", microbatches=2, precision="fp16")), fxpar.StrategyError,
        r"schedule='interleaved'\): pipeline rank\(s\) \[0, 1\] hold several stages",
        r"use a schedule with one stage per pipeline rank"),
    "fp16_found_over_edited": (lambda: _fp16_pp2_plan_edited(
        lambda d: d["features"]["precision"].update(found_over=[])), fxpar.StrategyError,
        r"the Plan's precision.found_over is \[\], but this run's mesh \(pp=2 x dp=1\)",
        r"hand back found_over as planned"),
    "fp16_with_error_feedback": (lambda: fxpar.Strategy(dp=2, precision="fp16", grad_sync="topk"), fxpar.StrategyError,
                                 r"feature\(s\) \['topk'\] change their per-rank state during that sum",
                                 r"Use precision='bf16'"),
}
CASES.update(PRECISION_CASES)


@pytest.mark.structure
@pytest.mark.parametrize("case", list(CASES))
def test_mistake_is_named_with_a_fix(case):
    fn, exc, names_it, says_fix = CASES[case]
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert re.search(names_it, msg, re.S), f"does not name the user's thing ({names_it!r}):\n{msg}"
    assert re.search(says_fix, msg, re.S), f"does not say what to do ({says_fix!r}):\n{msg}"


@pytest.mark.structure
def test_the_corpus_is_large():
    assert len(CASES) >= 100


@pytest.mark.numerics
def test_nan_loss_warns_by_default_and_ignore_is_silent(recwarn):
    res = _run("one", [(NAN_X, Y), (X, Y)])
    warns = [w for w in recwarn if issubclass(w.category, RuntimeWarning) and "loss is nan" in str(w.message)]
    assert len(warns) == 1 and "step 0 (batches[0])" in str(warns[0].message) and "rank(s) [0]" in str(warns[0].message)
    assert res.losses[0] != res.losses[0]
    recwarn.clear()
    _run("one", [(NAN_X, Y)], on_nonfinite="ignore")
    assert not [w for w in recwarn if "loss is nan" in str(w.message)]


@pytest.mark.structure
def test_many_ranks_on_few_cores_warns(monkeypatch):
    from fxpar.runtime import launch
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 1)
    with pytest.warns(UserWarning, match=r"5 ranks share 1 CPU core\(s\).*Use fewer ranks"):
        launch.check_local_capacity(5, 0, "fxpar.LocalCluster(5)")


_SCRIPT = """
import torch, fxpar
x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
program = fxpar.parallelize(torch.nn.Linear(4, 3), 2, (x, y), torch.nn.functional.cross_entropy)
program.run_local([(x, y)])
"""


@pytest.mark.slow
@pytest.mark.numerics
def test_a_script_without_main_guard_is_told_to_add_one(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "InputError: program.run_local (world_size=2) is called at line 5 of" in out.stderr, out.stderr[-2000:]
    assert "train.py, at the script's top level outside `if __name__ == \"__main__\":`" in out.stderr
    assert "Put the code that trains (from line 5) under `if __name__ == \"__main__\":`" in out.stderr
    assert "closed its pipe" not in out.stderr
    # from standard input there is no file to re-import
    out = subprocess.run([sys.executable, "-"], input=textwrap.dedent(_SCRIPT), capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert "the script comes from '<stdin>'" in out.stderr and "Save it to a file" in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.numerics
def test_a_guarded_script_runs(tmp_path):
    script = tmp_path / "train.py"
    body = textwrap.indent(textwrap.dedent(_SCRIPT).replace("program.run_local", "print(program.run_local")
                           .rstrip() + ".losses)\n", "    ")
    script.write_text("def main():\n" + body + "\n\nif __name__ == \"__main__\":\n    main()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]



@pytest.mark.structure
def test_sync_warmup_longer_than_the_run_warns():
    """A warm-up that covers the whole run trains plain data parallelism: run_local warns, naming the option, before
    any rank starts (the warning raised as an error here stops it there)."""
    prog = _dp2(sync=S.LocalSGD(period=2, warmup_steps=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(UserWarning, match=r"warmup_steps=3 covers the whole run of 3 step\(s\).*lower "
                                              r"warmup_steps or train longer"):
            prog.run_local([(X, Y)] * 3)
