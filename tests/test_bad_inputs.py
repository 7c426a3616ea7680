"""A corpus of common mistakes. Each must raise a clear fxpar error before any rank
starts, whose message names the user's object (the batch and tensor, the module, the setting, the file)
AND says what to do. Each case asserts both, as two patterns."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.errors import InputError, NonFiniteLossError

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
}


@pytest.mark.structure
@pytest.mark.parametrize("case", list(CASES))
def test_mistake_is_named_with_a_fix(case):
    fn, exc, names_it, says_fix = CASES[case]
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    import re
    assert re.search(names_it, msg, re.S), f"does not name the user's thing ({names_it!r}):\n{msg}"
    assert re.search(says_fix, msg, re.S), f"does not say what to do ({says_fix!r}):\n{msg}"


@pytest.mark.structure
def test_the_corpus_is_large():
    assert len(CASES) >= 40


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
