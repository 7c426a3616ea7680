"""What parallelize builds, to prove a change to the compiler leaves it as it was: for a spread of strategies (dp,
ZeRO-1/2/3, bf16/fp16, Megatron's and Tofu's tp, 1F1B and ZB1P pipelines, gradient compression, strategy="auto") on
a small GPT, each graph's code and every node's fake value (shape, stride, dtype, device, storage offset), the Plan's
JSON and the pass history of the first and last rank.

    PYTHONPATH=<tree A> python benchmarks/build_identity.py dump a.json [case ...]
    PYTHONPATH=<tree B> python benchmarks/build_identity.py dump b.json [case ...]
    python benchmarks/build_identity.py diff a.json b.json
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fxpar  # noqa: E402
from fxpar import compress as C  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402

def vmeta(v):
    if isinstance(v, torch.Tensor):
        return ["T", list(v.shape), list(v.stride()), str(v.dtype), str(v.device), v.storage_offset(), v.requires_grad]
    if isinstance(v, (list, tuple)):
        return [vmeta(x) for x in v]
    return repr(v)

CASES = {
    "dp2": dict(dp=2),
    "dp2_z1": dict(dp=2, zero=1), "dp2_z2": dict(dp=2, zero=2), "dp2_z3": dict(dp=2, zero=3),
    "dp2_bf16": dict(dp=2, precision="bf16"), "dp2_fp16": dict(dp=2, precision="fp16"),
    "dp2_z3_bf16": dict(dp=2, zero=3, precision="bf16"), "dp2_z2_fp16": dict(dp=2, zero=2, precision="fp16"),
    "tp2_meg": dict(tp=2, sharding="megatron"), "tp2_tofu": dict(tp=2, sharding="auto"),
    "dp2tp2_bf16": dict(dp=2, tp=2, sharding="megatron", precision="bf16"),
    "tp2_fp16": dict(tp=2, sharding="megatron", precision="fp16"),
    "pp2_1f1b": dict(pp=2, microbatches=2, schedule="1f1b"),
    "pp2_zb": dict(pp=2, microbatches=2, schedule="zb1p"),
    "pp2_fp16": dict(pp=2, microbatches=2, schedule="1f1b", precision="fp16"),
    "pp2dp2_z3": dict(pp=2, dp=2, microbatches=2, zero=3),
    "dp2_fp16comp": dict(dp=2, grad_sync=C.FP16()),
    "dp2_powersgd": dict(dp=2, grad_sync="powersgd"),
    "auto4": "auto",
}

def main(out, only=None):
    torch.manual_seed(0)
    res = {}
    for name, st in CASES.items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        model = GPT(vocab=64, d=32, layers=2, heads=2, max_seq=16, dropout=0.1)
        x = torch.randint(0, 64, (8, 16))
        world = 4 if st == "auto" else max(1, st.get("dp", 1) * st.get("tp", 1) * st.get("pp", 1))
        try:
            p = fxpar.parallelize(model, fxpar.ClusterSpec.local(world), (x, x), loss_fn=gpt_loss,
                                  optimizer=(torch.optim.AdamW, {"lr": 1e-3}),
                                  strategy="auto" if st == "auto" else fxpar.Strategy(**st))
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}"}
            print(name, "ERROR", e, flush=True)
            continue
        d = {"strategy": str(p.strategy), "plan": json.loads(p.plan.to_json()), "ranks": {}}
        for r in sorted({0, p.world_size - 1}):
            d["ranks"][r] = {
                "graphs": {k: {"code": gm.code, "vals": {n.name: vmeta(n.meta.get("val")) for n in gm.graph.nodes}}
                           for k, gm in p.graphs(r).items()},
                "history": [[e.pass_name, e.modified, e.nodes, e.code, repr(sorted(e.info.items(), key=str))]
                            for e in p.history(r)]}
        res[name] = d
        print(name, "ok", p.strategy, flush=True)
    json.dump(res, open(out, "w"), indent=0, sort_keys=True, default=str)


def _walk(x, y, path, out):
    if type(x) != type(y):
        out.append((path, str(x)[:150], str(y)[:150])); return
    if isinstance(x, dict):
        for k in sorted(set(x) | set(y)):
            if k not in x or k not in y:
                out.append((path + "/" + k, "missing" if k not in x else "", "missing" if k not in y else ""))
                continue
            _walk(x[k], y[k], path + "/" + k, out)
    elif isinstance(x, list):
        if len(x) != len(y): out.append((path, f"len {len(x)}", f"len {len(y)}")); return
        for i, (p, q) in enumerate(zip(x, y)): _walk(p, q, f"{path}[{i}]", out)
    elif x != y:
        if isinstance(x, str) and "\n" in x:
            xl, yl = x.splitlines(), y.splitlines()
            d = next((i for i, (p, q) in enumerate(zip(xl, yl)) if p != q), min(len(xl), len(yl)))
            out.append((path, xl[d:d+1], yl[d:d+1]))
        else: out.append((path, str(x)[:150], str(y)[:150]))
def diff(a, b):
    """Print, per case, IDENTICAL or the first differences (a note's search time differs from run to run)."""
    for case in sorted(set(a) | set(b)):
        if case not in a or case not in b: print(case, "only in one"); continue
        out = []
        _walk(a[case], b[case], case, out)
        print(f"{case}: {'IDENTICAL' if not out else f'{len(out)} differences'}")
        for o in out[:6]: print("   ", o)


if __name__ == "__main__":
    if sys.argv[1] == "diff":
        diff(json.load(open(sys.argv[2])), json.load(open(sys.argv[3])))
    else:
        main(sys.argv[2], sys.argv[3:])
