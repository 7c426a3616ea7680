"""The pass API: ordering constraints, checks between passes, history, custom passes."""
import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.testing import MLP


def _batch():
    return (torch.randn(4, 16), torch.randn(4, 8))


class CountMatmuls(fxpar.Pass):
    name = "count_matmuls"

    def run(self, gm, ctx):
        n = sum(n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) for n in gm.graph.nodes)
        ctx.notes.append(f"count_matmuls: {n}")
        return fxpar.PassResult(gm, modified=False, info={"matmuls": n})


@pytest.mark.structure
def test_custom_pass_runs_last_and_history_is_kept():
    p = fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(2), _batch(), loss_fn=F.mse_loss,
                          strategy=fxpar.Strategy(dp=2, passes=[CountMatmuls()]))
    names = [h.pass_name for h in p.history(0)]
    # the user's pass runs after every pass of fxpar's that rewrites the graph; only split_graphs, which cuts
    # the finished joint graph into the graphs the schedule calls (here: keeps it whole), comes after it
    assert names == ["capture", "data_parallel", "bucket", "sync_buffers", "reinplace_optimizer", "count_matmuls",
                     "split_graphs"]
    assert p.history(0)[-2].info["matmuls"] == 8      # 3 forward addmm + 5 backward mm (no grad for the input)
    assert "all_reduce" not in p.history(0)[0].code and "all_reduce" in p.history(0)[1].code
    assert "count_matmuls: 8" in p.explain()
    assert "# after bucket" in str(p.history(0)[2])


@pytest.mark.structure
def test_new_nodes_record_the_pass_that_made_them():
    p = fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(2), _batch(), loss_fn=F.mse_loss)
    gm = p.graphs(0)["step"]
    made = {n.meta.get("fxpar_pass") for n in gm.graph.nodes}
    # data_parallel's per-gradient nodes were all fused away by bucket (its 1/dp backward seed remains);
    # reinplace_optimizer made the in-place step
    assert made == {None, "data_parallel", "bucket", "reinplace_optimizer"}
    assert [n.target for n in gm.graph.nodes if n.meta.get("fxpar_pass") == "data_parallel"] == \
        [torch.ops.aten.full_like.default]
    assert all(n.meta.get("fxpar_pass") == "bucket" for n in gm.graph.nodes if "c10d" in str(n.target))


@pytest.mark.numerics
def test_function_pass_that_edits_the_graph():
    @fxpar.graph_pass("double_lr")
    def double_lr(gm, ctx):
        """Scale the learning rate by 2 inside the graph."""
        lr = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "lr")
        users = list(lr.users)
        with gm.graph.inserting_after(lr):
            twice = gm.graph.call_function(torch.ops.aten.mul.Tensor, (lr, 2.0))
        for u in users:
            u.replace_input_with(lr, twice)
        return True

    model = MLP().double()
    batches = [tuple(t.double() for t in _batch())]
    base = fxpar.parallelize(model, 1, batches[0], loss_fn=F.mse_loss, optimizer=(torch.optim.SGD, {"lr": 0.1}))
    fast = fxpar.parallelize(model, 1, batches[0], loss_fn=F.mse_loss, optimizer=(torch.optim.SGD, {"lr": 0.05}),
                             strategy=[double_lr])
    a, b = base.run_local(batches).state_dict(), fast.run_local(batches).state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-14, rtol=0) for k in a)


@pytest.mark.structure
def test_order_constraints_are_checked_before_running():
    class NeedsBucket(fxpar.Pass):
        name = "needs_bucket"
        requires = ("bucket",)

        def run(self, gm, ctx):
            return fxpar.PassResult(gm, False)

    with pytest.raises(fxpar.PassError, match=r"'needs_bucket' requires 'bucket'.*not in the pipeline"):
        fxpar.PassManager([NeedsBucket()])


@pytest.mark.structure
def test_a_pass_that_breaks_the_signature_is_named():
    @fxpar.graph_pass("drop_output")
    def drop_output(gm, ctx):
        out = gm.graph.find_nodes(op="output")[0]
        out.args = (out.args[0][:-1],)
        return True

    with pytest.raises(fxpar.PassError, match=r"after pass 'drop_output'.*signature"):
        fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(2), _batch(), loss_fn=F.mse_loss,
                          strategy=fxpar.Strategy(dp=2, passes=[drop_output]))


@pytest.mark.structure
def test_a_failing_pass_names_itself_and_the_passes_before():
    @fxpar.graph_pass("boom")
    def boom(gm, ctx):
        raise ValueError("no good")

    with pytest.raises(fxpar.PassError, match=r"pass 'boom' failed.*no good.*\['data_parallel', 'bucket', 'sync_buffers', 'reinplace_optimizer'\]"):
        fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(2), _batch(), loss_fn=F.mse_loss,
                          strategy=fxpar.Strategy(dp=2, passes=[boom]))


@pytest.mark.structure
def test_plan_round_trips_and_an_edited_plan_is_used():
    p = fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(2), _batch(), loss_fn=F.mse_loss)
    plan = fxpar.Plan.from_json(p.plan.to_json())
    assert plan == p.plan
    keys = [k for b in plan.section("data_parallel").buckets[0] for k in b]     # buckets are per stage: stage 0's
    assert len(plan.section("data_parallel").buckets[0]) == 1 < len(keys)        # the default cap: one bucket (so the edit below shows)
    plan.section("data_parallel").buckets[0] = [[k] for k in keys]
    q = fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(2), _batch(), loss_fn=F.mse_loss, plan=plan)
    assert len(q.collectives(0)) == len(keys)


@pytest.mark.structure
def test_every_graph_level_meta_key_written_is_declared():
    """``gm.meta[M.SIGNATURE.name] = ...`` (or a literal ``gm.meta["fxpar_..."] = ...``) anywhere in the library
    names a key of ``fxpar.meta.GRAPH_KEYS`` (or a node key of ``fxpar.meta.KEYS``)."""
    import importlib
    import re
    from pathlib import Path

    from fxpar import meta as M
    written = set()
    for pkg in ("fxpar", "passes", "cost_models"):          # where they are imported from (the wheel, under CI)
        for p in Path(importlib.import_module(pkg).__file__).parent.rglob("*.py"):
            text = p.read_text()
            written |= set(re.findall(r"\.meta\[\"(fxpar_[a-z_]+)\"\]\s*=", text))
            written |= {getattr(M, c, M.MetaKey(f"M.{c}", None, "", "")).name
                        for c in re.findall(r"\.meta\[M\.([A-Z_]+)\.name\]\s*=", text)}
    assert written, "no graph-level key found: the scan is broken"
    assert written <= set(M.GRAPH_KEYS) | set(M.KEYS), sorted(written - set(M.GRAPH_KEYS) - set(M.KEYS))


@pytest.mark.structure
def test_history_code_is_the_graph_as_each_pass_left_it():
    """Each entry's code is printed when first read; it is the graph as it stood after its pass, however later
    passes rewired, erased or renamed its nodes."""
    seen = {}

    def probe(name, before=()):
        @fxpar.graph_pass(name, before=before)
        def run(gm, ctx):
            seen[name] = gm.graph.python_code(root_module="self").src
            return False
        return run

    @fxpar.graph_pass("rename_lr")
    def rename_lr(gm, ctx):
        lr = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "lr")
        lr._rename("learning_rate")
        lr.target = lr.name                    # a placeholder prints as its target
        return True

    p = fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(2), _batch(), loss_fn=F.mse_loss,
                          strategy=fxpar.Strategy(dp=2, passes=[probe("at_capture", before=("data_parallel",)),
                                                                 probe("at_end"), rename_lr]))
    hist = {h.pass_name: h for h in p.history(0)}
    assert list(hist) == ["capture", "at_capture", "data_parallel", "bucket", "sync_buffers", "reinplace_optimizer",
                          "at_end", "rename_lr", "split_graphs"]
    assert hist["capture"].code == hist["at_capture"].code == seen["at_capture"]
    assert hist["reinplace_optimizer"].code == hist["at_end"].code == seen["at_end"]
    assert " lr," in seen["at_end"] and " learning_rate," not in seen["at_end"]
    assert " learning_rate," in hist["rename_lr"].code and hist["split_graphs"].code == hist["rename_lr"].code
    assert hist["rename_lr"].code == p.stages[0].joint.graph.python_code(root_module="self").src
    assert "all_reduce" not in hist["capture"].code and "all_reduce" in hist["data_parallel"].code


@pytest.mark.structure
def test_history_pickles_and_copies_as_text():
    import copy
    import pickle
    p = fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(2), _batch(), loss_fn=F.mse_loss)
    hist = p.history(0)
    again = pickle.loads(pickle.dumps(hist))
    assert again == hist and [h.code for h in again] == [h.code for h in hist]
    assert copy.deepcopy(hist[0]) == hist[0] and str(copy.deepcopy(hist[1])) == str(hist[1])
    assert repr(hist[1]).startswith("HistoryEntry(pass_name='data_parallel', modified=True")
