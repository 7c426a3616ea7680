"""Structure tier: the collectives data parallelism inserts, in number, order and size."""
import json

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import meta as M
from fxpar.collectives import C10D, collective_nodes, is_wait
from fxpar.testing import GPT, BNConvNet, MLP, gpt_loss, max_abs_diff, reference_training, tiny_gpt, token_batches

ADAMW = (torch.optim.AdamW, {"lr": 1e-3})


def _gpt_program(dp=2, cap_mb=0.02):
    x = torch.randint(0, 64, (4, 16))
    return fxpar.parallelize(GPT(), fxpar.ClusterSpec.local(dp), (x, x), loss_fn=gpt_loss, optimizer=ADAMW,
                             strategy=fxpar.Strategy(dp=dp, bucket_cap_mb=cap_mb))


def _nbytes(key, cap):
    shape = cap.param_shapes[key]
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=cap.param_dtypes[key]).element_size()


@pytest.mark.structure
def test_collectives_match_bucket_plan():
    p = _gpt_program()
    gm = p.graphs(0)["step"]
    colls = collective_nodes(gm)
    ar = [c for c in colls if c.target is C10D.all_reduce_.default]   # in place on the bucket
    dps = p.plan.section("data_parallel")
    buckets = dps.buckets[0]          # the Plan holds buckets per stage; a dp program is one stage
    assert len(ar) == len(buckets) > 1
    # order: bucket i is issued i-th; size: the bucket's gradient bytes
    for i, (node, keys) in enumerate(zip(ar, buckets)):
        assert M.get(node, M.BUCKET) == i
        assert M.get(node, M.COMM).nbytes == sum(_nbytes(k, p.captured) for k in keys)
        assert M.get(node, M.COMM).ranks == (0, 1)
        assert node.args[1:] == ("sum", "fxpar:dp")
    # every bucket respects the cap unless it holds one gradient; the first one DDP's 1 MiB-style first cap
    for i, keys in enumerate(buckets):
        cap = min(dps.bucket_cap_bytes, dps.first_bucket_cap_bytes) if i == 0 else dps.bucket_cap_bytes
        assert len(keys) == 1 or sum(_nbytes(k, p.captured) for k in keys) <= cap
    # each trainable parameter synchronised exactly once
    flat = [k for b in buckets for k in b]
    assert sorted(flat) == sorted(p.captured.param_names)


@pytest.mark.structure
def test_buckets_follow_backward_order_and_waits_are_late():
    p = _gpt_program()
    gm = p.graphs(0)["step"]
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    ar = [c for c in collective_nodes(gm) if c.target is C10D.all_reduce_.default]
    # issued in backward: each all_reduce sits before the last backward node
    last_backward = max(i for i, n in enumerate(nodes) if M.get(n, M.PHASE) == "backward" and not is_wait(n)
                        and M.PASS.name not in n.meta)
    assert all(pos[a] < last_backward for a in ar[:-1])
    assert [pos[a] for a in ar] == sorted(pos[a] for a in ar)
    # the first bucket holds the first gradients backward produces: the LM head / final LayerNorm
    first = p.plan.section("data_parallel").buckets[0][0]                 # stage 0, bucket 0
    assert "ln_f.weight" in first or "ln_f.bias" in first
    # waits: after every backward op that is not part of the sync, i.e. just before the optimizer uses them
    waits = [n for n in nodes if is_wait(n)]
    assert len(waits) == len(ar) + 0
    for w in waits:
        first_user = min(pos[u] for u in w.users)
        assert pos[w] < first_user
        between = nodes[pos[w] + 1:first_user]
        assert all(M.PASS.name in n.meta or is_wait(n) for n in between)


@pytest.mark.structure
def test_zero_cap_means_one_collective_per_gradient():
    p = _gpt_program(cap_mb=0)
    assert len(p.collectives(0)) == len(p.captured.param_names)
    assert [c.nbytes for c in p.collectives(0)] == [_nbytes(b[0], p.captured) for b in p.plan.section("data_parallel").buckets[0]]


@pytest.mark.structure
def test_ddp_default_bucket_is_one_for_a_small_model():
    p = _gpt_program(cap_mb=25)
    assert len(p.plan.section("data_parallel").buckets[0]) == 1 and len(p.collectives(0)) == 1


@pytest.mark.structure
def test_first_bucket_is_small_like_ddp():
    """DDP caps the first bucket backward fills at 1 MiB (its rebuilt buckets), so that all_reduce
    starts early; fxpar's planner does the same by default, and the cap is a Strategy setting."""
    x = torch.randint(0, 512, (4, 16))
    model = GPT(vocab=512, d=128, layers=2, heads=2, max_seq=16)          # ~0.7M params, 2.8 MB of fp32 grads
    prog = lambda **kw: fxpar.parallelize(model, fxpar.ClusterSpec.local(2), (x, x), loss_fn=gpt_loss,
                                          strategy=fxpar.Strategy(dp=2, **kw))
    default, one = prog(), prog(first_bucket_cap_mb=25)
    sizes = [c.nbytes for c in default.collectives(0)]
    assert len(sizes) == 2 and sizes[0] <= 2**20 < sizes[1] and sum(sizes) == 4 * sum(p.numel() for p in model.parameters())
    assert len(one.collectives(0)) == 1
    assert "the first 1 MiB" in str(default.plan)


@pytest.mark.structure
def test_buffers_broadcast_from_rank0():
    x = torch.randn(4, 3, 8, 8)
    p = fxpar.parallelize(BNConvNet(), fxpar.ClusterSpec.local(2), (x, torch.zeros(4, dtype=torch.long)),
                          loss_fn=F.cross_entropy, strategy=fxpar.Strategy(dp=2))
    kinds = [c.kind for c in p.collectives(0)]
    assert kinds.count("broadcast") == 2          # running_mean, running_var (not num_batches_tracked)
    assert kinds[-2:] == ["broadcast", "broadcast"]


@pytest.mark.structure
def test_dp1_inserts_nothing_and_ranks_share_graphs():
    x = torch.randn(4, 16)
    p1 = fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(1), (x, torch.randn(4, 8)), loss_fn=F.mse_loss)
    assert p1.collectives(0) == []
    p4 = fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(4), (x, torch.randn(4, 8)), loss_fn=F.mse_loss)
    assert p4.graphs(0)["step"] is p4.graphs(3)["step"]   # collectives name the axis; runtime binds the group


@pytest.mark.numerics
def test_measured_collectives_equal_the_graphs(clusters):
    """What ranks run (recorded at dispatch) is exactly what the graph's collectives say."""
    x = torch.randint(0, 64, (8, 16))
    p = fxpar.parallelize(GPT(), fxpar.ClusterSpec.local(4), (x, x), loss_fn=gpt_loss, optimizer=ADAMW,
                          strategy=fxpar.Strategy(dp=4, bucket_cap_mb=0.02))
    res = p.run_local([(x, x)] * 2, cluster=clusters.get(4), measure_comm=True)
    for r in range(4):
        expected = [(c.kind, c.nbytes) for c in p.collectives(r)]
        assert res.comm_calls[r] == [expected, expected]


@pytest.mark.structure
@pytest.mark.parametrize("fused", [False, None])
def test_optimizer_runs_in_place_on_its_own_buffers(fused):
    """reinplace_optimizer: parameters and moments are updated in place (the outputs *are* the input
    buffers). As torch._foreach_* ops (``fused=False``) the step is bitwise identical to the functional graph
    capture produced; by default on CPU the AdamW chain is one ``_fused_adamw_`` call (passes.fuse_optimizer),
    the same update rounded once per element instead of once per op: equal to 1e-15 in float64."""
    x = torch.randint(0, 64, (4, 16))
    torch.manual_seed(0)
    kw = {"lr": 1e-2, "weight_decay": 0.1} if fused is None else {"lr": 1e-2, "weight_decay": 0.1, "fused": fused}
    p = fxpar.parallelize(GPT().double(), 1, (x, x), loss_fn=gpt_loss, optimizer=(torch.optim.AdamW, kw))
    gm, functional = p.graphs(0)["step"], p.captured.gm
    # split_graphs always ends the pass list; a one-stage one-microbatch program keeps the joint graph whole
    assert [h.pass_name for h in p.history(0)] == ["capture", "reinplace_optimizer", "split_graphs"]
    ops = [str(n.target) for n in gm.graph.nodes if n.meta.get("fxpar_phase") == "optimizer" and n.op == "call_function"
           and ("_foreach_" in str(n.target) or "_fused_" in str(n.target))]
    assert ops == (["aten._fused_adamw_.tensor_lr"] if fused is None else
                   [o for o in ops if "_foreach_" in o]) and len(ops) == (1 if fused is None else 10), ops
    assert p.plan.optimizer["kernel"] == ("fused" if fused is None else "foreach")
    sig = gm.meta["fxpar_signature"]
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    for i in sig.index("new_param", outputs=True) + sig.index("new_opt_state", outputs=True):
        assert outs[i].op == "placeholder"
    payload = p.payload(0)

    def inputs():
        torch.manual_seed(1)
        args = []
        for role, key in sig.inputs:
            if role == "param":
                args.append(payload.params[key].clone())
            elif role == "opt_state":
                args.append(torch.rand_like(payload.params[key.split(":", 1)[1]]))
            elif role == "lr":
                args.append(torch.tensor(1e-2, dtype=torch.float64))
            elif role == "step":
                args.append(torch.tensor(3.0, dtype=torch.float64))
        return args + [x, x]

    a, b = gm(*inputs()), functional(*inputs())
    assert len(a) == len(b)
    if fused is False:
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    else:
        worst = max(((u - v).abs() / (v.abs() + 1)).max().item() for u, v in zip(a, b))
        assert worst < 1e-15 and not all(torch.equal(u, v) for u, v in zip(a, b)), worst


@pytest.mark.structure
def test_gradient_sync_is_one_copy_like_ddp():
    """Per bucket: one flat buffer, one copy_ of each gradient into its slot (the only pass over
    the gradients, whatever their layout), an in-place all_reduce_, its wait, then views. The 1/dp
    is folded into backward's seed, so no division runs at all."""
    p = _gpt_program(dp=4, cap_mb=0.02)
    gm = p.graphs(0)["step"]
    added = [n for n in gm.graph.nodes if M.PASS.name in n.meta and M.get(n, M.PASS) in ("data_parallel", "bucket")]
    targets = [n.target for n in added]
    n_buckets = len(p.plan.section("data_parallel").buckets[0])
    assert targets.count(torch.ops.aten.empty.memory_format) == n_buckets
    assert targets.count(torch.ops.aten.copy_.default) == len(p.captured.param_names)
    assert not any(t in (torch.ops.aten.cat.default, torch.ops.aten.reshape.default, torch.ops.aten.clone.default)
                   for t in targets)
    copies = [n for n in added if n.target is torch.ops.aten.copy_.default]
    grads = {n for n in gm.graph.nodes if n.op == "call_function"} - set(added)
    assert all(c.args[1] in grads for c in copies)       # straight from backward's own result
    assert targets.count(C10D.all_reduce_.default) == n_buckets
    assert targets.count(C10D.all_reduce.default) == 0
    assert not any(t in (torch.ops.aten.div.Tensor, torch.ops.aten.div_.Tensor) for t in targets)
    assert not any(n.target in (torch.ops.aten.div.Tensor, torch.ops.aten.div_.Tensor) and
                   isinstance(n.args[1], int) and n.args[1] == 4 for n in gm.graph.nodes)
    seeds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.full_like.default and M.get(n, M.PHASE) == "backward"]
    assert len(seeds) == 1 and seeds[0].args[1] == 0.25
    assert not any(n.target is torch.ops.aten.ones_like.default for n in gm.graph.nodes)
    assert gm.meta["fxpar_grad_prescale"] == 4


@pytest.mark.slow
@pytest.mark.numerics
def test_graph_without_a_loss_seed_divides_the_bucket_in_place(clusters):
    """A graph whose backward is not seeded by ones_like(loss) (here: the seed removed by a user
    pass before data_parallel) still averages, with one in-place div_ per bucket."""
    from fxpar.pass_manager import graph_pass

    @graph_pass(name="unseed", before=("data_parallel",))
    def unseed(gm, ctx):
        # capture seeds backward with full_like(loss, 1/m) (or ones_like); data_parallel
        # recognises both, so the seed is rewritten into a form it does not: new_full(loss, [], c)
        seeds = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.ones_like.default,
                                                            torch.ops.aten.full_like.default)
                 and n.meta.get("fxpar_phase") == "backward"]
        assert len(seeds) == 1
        for n in seeds:
            value = 1.0 if n.target is torch.ops.aten.ones_like.default else n.args[1]
            with gm.graph.inserting_after(n):
                new = gm.graph.call_function(torch.ops.aten.new_full.default, (n.args[0], [], value))
            new.meta.update(n.meta)
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)
        return True

    torch.manual_seed(0)
    model = GPT().double()
    batches = [(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))) for _ in range(2)]
    p = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], loss_fn=gpt_loss, optimizer=ADAMW,
                          strategy=fxpar.Strategy(dp=2, bucket_cap_mb=0.02, passes=[unseed]))
    gm = p.graphs(0)["step"]
    assert [h.pass_name for h in p.history(0)][:3] == ["capture", "unseed", "data_parallel"]
    divs = [n for n in gm.graph.nodes if n.target is torch.ops.aten.div_.Tensor and M.get(n, M.PASS) == "bucket"]
    assert len(divs) == len(p.plan.section("data_parallel").buckets[0]) > 1 and all(d.args[1] == 2 for d in divs)
    assert "fxpar_grad_prescale" not in gm.meta
    res = p.run_local(batches, cluster=clusters.get(2))
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, ADAMW)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) <= 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) <= 1e-10


@pytest.mark.structure
def test_buckets_hold_one_dtype():
    """As DDP, a bucket never mixes dtypes (its gradients share one flat buffer)."""
    from types import SimpleNamespace
    from fxpar.planner_comm import plan_buckets
    cap = SimpleNamespace(gm=torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()),
                          param_names=["a", "b", "c", "d"],
                          param_shapes={k: (4,) for k in "abcd"},
                          param_dtypes={"a": torch.float32, "b": torch.float32, "c": torch.bfloat16, "d": torch.float32})
    assert plan_buckets(cap, 2**20) == [["a", "b"], ["c"], ["d"]]
    assert plan_buckets(cap, 2**20, first_cap_bytes=16) == [["a"], ["b"], ["c"], ["d"]]


# ---- the data_parallel feature: its Plan section, its passes ------------------------------------------------
@pytest.mark.structure
def test_data_parallel_section_round_trips_and_prints_its_buckets():
    p = _gpt_program(cap_mb=0.02)
    sec = p.plan.section("data_parallel")
    assert json.loads(p.plan.to_json())["features"]["data_parallel"] == {
        "bucket_cap_bytes": int(0.02 * 2**20), "first_bucket_cap_bytes": 2**20, "broadcast_buffers": True,
        "buckets": sec.buckets}
    again = fxpar.Plan.from_json(p.plan.to_json())
    assert again == p.plan and again.section("data_parallel") == sec and len(sec.buckets[0]) > 1
    text = str(p.plan)
    assert (f"data_parallel: gradient sync: sum over each gradient's group in {len(sec.buckets[0])} bucket(s) "
            "(cap 0.02 MiB, the first 0.02 MiB), issued in backward order") in text
    assert "data_parallel: buffers: dp-rank 0's broadcast after each step" in text
    assert "gradient sync: sum over each gradient's group" in p.explain()


@pytest.mark.structure
def test_a_data_parallel_section_with_an_unknown_field_is_refused():
    data = json.loads(_gpt_program().plan.to_json())
    data["features"]["data_parallel"]["bucket_cap_mb"] = 5
    with pytest.raises(ValueError, match=r"section 'data_parallel' has unknown field\(s\) \['bucket_cap_mb'\]"):
        fxpar.Plan.from_json(json.dumps(data))
    del data["features"]["data_parallel"]["bucket_cap_mb"]
    data["buckets"] = data["features"]["data_parallel"]["buckets"]       # the buckets live in the section only
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['buckets'\]"):
        fxpar.Plan.from_json(json.dumps(data))


@pytest.mark.slow
@pytest.mark.structure
def test_no_gradient_sync_pass_where_no_gradient_is_summed():
    """dp=1, and a pipeline with no tied parameter: no data_parallel section, no gradient-sync pass."""
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    one = fxpar.parallelize(MLP(), 1, (x, y), loss_fn=F.mse_loss)
    pipe = fxpar.parallelize(MLP(), 2, (x, y), loss_fn=F.mse_loss, strategy=fxpar.Strategy(pp=2, microbatches=2))
    for p in (one, pipe):
        assert p.plan.section("data_parallel") is None and "gradient sync" not in str(p.plan)
        for r in range(p.world_size):
            assert not {"data_parallel", "bucket", "sync_buffers"} & {h.pass_name for h in p.history(r)}
            assert not [c for c in p.collectives(r) if c.kind not in ("send", "recv")]
    two = _gpt_program(dp=2)
    assert [h.pass_name for h in two.history(0)][:4] == ["capture", "data_parallel", "bucket", "sync_buffers"]
    # dp=1 with a parameter tied across pipeline stages: its gradient is summed over the stages' ranks
    tied = fxpar.parallelize(tiny_gpt(layers=4), 2, token_batches(1)[0], gpt_loss,
                             strategy=fxpar.Strategy(pp=2, microbatches=2))
    assert tied.plan.section("data_parallel").buckets == [[["wte.weight"]], [["wte.weight"]]]
    assert [h.pass_name for h in tied.history(0)][:4] == ["capture", "data_parallel", "bucket", "sync_buffers"]


@pytest.mark.structure
def test_inplace_update_only_for_a_traced_optimizer_on_a_synchronous_schedule():
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    build = lambda opt, **kw: fxpar.parallelize(MLP(), fxpar.ClusterSpec.local(kw.get("pp", 1)), (x, y),  # noqa: E731
                                                loss_fn=F.mse_loss, optimizer=opt, strategy=fxpar.Strategy(**kw))
    on = build((torch.optim.SGD, {"lr": 0.1}))
    eager = build((torch.optim.Adagrad, {"lr": 0.1}))
    stashed = build((torch.optim.SGD, {"lr": 0.1}), pp=2, schedule="pipedream", microbatches=2)
    assert on.plan.section("inplace_update") is not None and "reinplace_optimizer" in on.plan.passes
    for p in (eager, stashed):
        assert p.plan.section("inplace_update") is None and "reinplace_optimizer" not in p.plan.passes
    assert fxpar.Plan.from_json(on.plan.to_json()) == on.plan
