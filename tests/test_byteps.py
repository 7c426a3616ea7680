"""BytePS: k CPU summation servers take a 2(n-1)/(n²+kn-2k) share of every bucket."""
from __future__ import annotations

import pytest
import torch

import fxpar
from cost_models import byteps_traffic as B
from fxpar.collectives import collective_nodes
from fxpar.testing import gpt_loss, max_abs_diff, reference_training, tiny_gpt, token_batches

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
TOL = 1e-10
F64 = 8


def _share(n, k):
    """The paper's optimum, written out here: each server's share of a bucket."""
    return 2 * (n - 1) / (n * n + k * n - 2 * k)


def _build(dp, k, batches, model, **kw):
    return fxpar.parallelize(model, fxpar.ClusterSpec.local(dp, cpu_servers=k), batches[0], gpt_loss, ADAMW,
                             strategy=fxpar.Strategy(dp=dp, grad_sync="byteps", bucket_cap_mb=0.01, **kw))


def _buckets(prog, model):
    sizes = {key: p.numel() for key, p in model.named_parameters()}
    return [sum(sizes[key] for key in b) for b in prog.plan.section("data_parallel").buckets[0]]


def _expected_split(v, n, k):
    """Whole elements: each server's share rounded to the nearest (halves up), k partitions within the bucket."""
    p = min(int(v * _share(n, k) + 0.5), v // k) if k else 0
    return v - k * p, p


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("dp,k", [(2, 0), (2, 1), (2, 2), (4, 2)])
def test_byteps_matches_single_process_and_the_formula(clusters, dp, k):
    model, batches = tiny_gpt(), token_batches(2, batch=8)
    prog = _build(dp, k, batches, model)
    res = prog.run_local(batches, cluster=clusters.get(dp + k), measure_comm=True)
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, ADAMW)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < TOL
    assert max_abs_diff(res.state_dict(), ref_state) < TOL

    vs = _buckets(prog, model)
    assert len(vs) > 1
    if k == 0:             # the formula's limit: one all-reduce of each whole bucket, no server
        assert not res.servers
        for r in range(dp):
            for calls in res.comm_calls[r]:
                assert calls == [("all_reduce", v * F64) for v in vs]
        return
    assert prog.plan.section("byteps").server_share == pytest.approx(_share(dp, k), abs=1e-15)
    split = [_expected_split(v, dp, k) for v in vs]
    assert all(abs(p - v * _share(dp, k)) <= 0.5 for v, (_, p) in zip(vs, split))
    # measured on each worker, per step and bucket: the workers' all-reduce of W, then per server (its go first,
    # once a step) a push of P elements and a pull that hands over nothing (the sum comes back into it)
    want = []
    for i, (w, p) in enumerate(split):
        want += [("all_reduce", w * F64)] if w else []
        for _ in range(k):
            want += ([("all_to_all", F64)] if i == 0 else []) + [("all_to_all", p * F64), ("all_to_all", 0)]
    for r in range(dp):
        assert len(res.comm_calls[r]) == len(batches)
        for calls in res.comm_calls[r]:
            assert calls == want
    # measured on each server, per step: the n pushes of every partition in, the sum out to every worker
    total_p = sum(p for _, p in split)
    assert sorted(res.servers) == list(range(dp, dp + k))
    for s in res.servers.values():
        assert s["steps"] == len(batches)
        for st in s["per_step"]:
            assert st == {"recv_bytes": dp * (total_p + 1) * F64, "sent_bytes": dp * total_p * F64,
                          "pushes": len(vs), "pulls": len(vs)}
    # bytes on the wire per step against the paper's closed form for the whole model (M bytes): a worker sends its
    # pushes and 2(n-1)/n of its all-reduced part; a server sends n sums. Rounding: half an element per partition.
    m = sum(vs) * F64
    worker = sum(p * F64 * k + B.allreduce_bytes(w * F64, dp) for w, p in split)
    server = res.servers[dp]["per_step"][0]["sent_bytes"]
    slack = len(vs) * dp * k * F64 / 2
    assert abs(worker - 2 * dp * (dp - 1) / (dp * dp + k * dp - 2 * k) * m) <= slack
    assert abs(server - 2 * dp * (dp - 1) / (dp * dp + k * dp - 2 * k) * m) <= slack
    assert worker == pytest.approx(B.bytes_per_worker(m, dp, k), abs=slack)
    assert server == pytest.approx(B.bytes_per_server(m, dp, k), abs=slack)


@pytest.mark.structure
def test_byteps_structure_pushes_and_pulls_per_bucket_in_order():
    """dp=4, k=2, no processes: per bucket the all-reduce of the workers' part over dp, then for each server its
    push and its pull over that server's group (go first, once per step and server); the bucket's result
    concatenates the all-reduced part and the servers' sums in server order."""
    model, batches = tiny_gpt(), token_batches(1, batch=8)
    n, k = 4, 2
    prog = _build(n, k, batches, model)
    gm = prog.graphs(0)["step"]
    vs = _buckets(prog, model)
    seq = []
    for x in collective_nodes(gm):
        c = x.meta["fxpar_comm"]
        what = x.name.split("_")[1] if x.name.startswith("byteps_") else x.name
        seq.append((what, c.axis, c.nbytes))
    want = []
    for i, v in enumerate(vs):
        w, p = _expected_split(v, n, k)
        assert w > 0 and p > 0
        want.append(("ar", "dp", w * F64))
        for j in range(k):
            want += ([("go", f"server{j}", F64)] if i == 0 else []) + [("push", f"server{j}", p * F64),
                                                                      ("pull", f"server{j}", p * F64)]
    assert seq == want
    # each push/pull names its server's group; the worker sends P to the server (the group's last rank) and nothing
    # to the other worker; the pull takes P from the server
    pushes = [x for x in collective_nodes(gm) if x.name.startswith("byteps_push")]
    pulls = [x for x in collective_nodes(gm) if x.name.startswith("byteps_pull")]
    assert len(pushes) == len(pulls) == k * len(vs)
    for x, y in zip(pushes, pulls):
        (_, out_x, in_x, tag_x), (_, out_y, in_y, tag_y) = x.args, y.args
        assert tag_x == tag_y and tag_x.startswith("fxpar:server")
        assert out_x == [0] * (n + 1) and in_x[:n] == [0] * n and in_x[n] > 0
        assert in_y == [0] * (n + 1) and out_y == [0] * n + [in_x[n]]
    # every pull's sum lands in its bucket's result (a cat) in server order, after the all-reduced part
    for x in pulls[::2]:
        cat = next(u for w in x.users for u in w.users)
        parts = [a.args[0].name for a in cat.args[0]]
        assert parts[0].startswith("byteps_ar") and parts[1] == x.name
        assert parts[2].startswith("byteps_pull") and parts[2] != x.name
    assert prog.plan.groups["server0"] == [[0, 1, 2, 3, 4]] and prog.plan.groups["server1"] == [[0, 1, 2, 3, 5]]


@pytest.mark.structure
def test_byteps_cost_model_closed_forms():
    # k=0 is the ring all-reduce; k=n the non-colocated parameter server (M per worker); in between both sides equal
    for n in (2, 4, 8, 16):
        assert B.bytes_per_worker(1.0, n, 0) == pytest.approx(2 * (n - 1) / n)
        assert B.bytes_per_worker(1.0, n, n) == pytest.approx(1.0)
        for k in range(1, n + 1):
            assert B.server_share(n, k) == pytest.approx(_share(n, k))
            assert B.bytes_per_worker(1.0, n, k) == pytest.approx(B.bytes_per_server(1.0, n, k))
            assert B.gain_over_allreduce(n, k) == pytest.approx((n * n + k * n - 2 * k) / n ** 2)
    assert B.gain_over_allreduce(2, 1) == pytest.approx(1.0)      # two workers: all-reduce already sends M
    assert B.gain_over_allreduce(8, 8) == pytest.approx(2 * 7 / 8)
    assert B.server_share(4, 6) == pytest.approx(1 / 6)            # more servers than workers: all on servers
    assert B.split_bucket(1000, 4, 2) == (400, 300) and B.split_bucket(10, 4, 0) == (10, 0)
    assert B.split_bucket(1, 2, 2) == (1, 0)                       # no whole element per server: all-reduced
    pred = B.predict([4 * 2**20] * 3, 4, 2, bandwidth=1.25e8)
    assert pred["gain"] == pytest.approx(1.25) and pred["worker_bytes"] == pytest.approx(pred["server_bytes"])


@pytest.mark.structure
def test_byteps_bad_input():
    model, batches = tiny_gpt(), token_batches(1, batch=8)
    with pytest.raises(fxpar.ClusterSpecError, match=r"cpu_servers=-1.*int >= 0"):
        fxpar.ClusterSpec.local(2, cpu_servers=-1)
    with pytest.raises(fxpar.ClusterSpecError, match=r"cpu_servers=2, backend='nccl'.*CUDA tensors only.*gloo"):
        import dataclasses
        dataclasses.replace(fxpar.ClusterSpec.preset("a100-80gb", nodes=1, gpus_per_node=4), cpu_servers=2)
    spec = fxpar.ClusterSpec.local(2, cpu_servers=3)
    assert fxpar.ClusterSpec.from_json(spec.to_json()) == spec and "+ 3 CPU-only server rank(s)" in str(spec)
    with pytest.raises(fxpar.StrategyError, match="byteps is built for data parallelism alone"):
        fxpar.Strategy(dp=2, grad_sync="byteps", pp=2)
    with pytest.raises(fxpar.StrategyError, match=r"feature 'byteps' \(grad_sync='byteps'\) conflicts with feature "
                                                  r"'zero' \(zero=1\): they do not compose; drop one of them"):
        fxpar.Strategy(dp=2, grad_sync="byteps", zero=1)
    with pytest.raises(fxpar.StrategyError, match=r"cpu_servers=1 .*grad_sync='byteps'"):
        fxpar.parallelize(model, fxpar.ClusterSpec.local(2, cpu_servers=1), batches[0], gpt_loss, ADAMW,
                          strategy=fxpar.Strategy(dp=2))
    with pytest.raises(fxpar.StrategyError, match="dp=1 has nothing to sum"):
        fxpar.parallelize(model, fxpar.ClusterSpec.local(1, cpu_servers=1), batches[0], gpt_loss, ADAMW,
                          strategy=fxpar.Strategy(dp=1, grad_sync="byteps"))


@pytest.mark.structure
def test_byteps_runner_on_the_wrong_world_size_names_workers_and_servers(monkeypatch):
    """torchrun with n processes for n workers + k servers: refused before the rendezvous, naming n + k."""
    import torch.distributed as dist
    model, batches = tiny_gpt(), token_batches(1, batch=8)
    prog = _build(2, 1, batches, model)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not dist.is_initialized()            # the check runs before any group is joined
    with pytest.raises(ValueError, match=r"started 2 processes but the program needs 3 = 2 workers .*\+ 1 BytePS CPU "
                                         r"server.*cpu_servers=1.*ranks 2\.\.2.*--nproc-per-node 3"):
        prog.runner()
    assert not dist.is_initialized()


def _checkpoint_values(path) -> dict:
    """Every tensor of a checkpoint, read in this process alone."""
    from fxpar.runtime.checkpoint import load_checkpoint, read_manifest
    saved = read_manifest(path)["tensors"]
    templates = {k: torch.empty(m["shape"], dtype=getattr(torch, m["dtype"])) for k, m in saved.items()}
    return load_checkpoint(path, templates, rank=0, world_size=1)[0]


@pytest.mark.slow
@pytest.mark.numerics
def test_byteps_checkpoint_is_the_workers_and_resumes_under_any_grad_sync(clusters, tmp_path):
    """dp=2 + 1 server: save after one step, resume for two more == one process on all three batches; the
    checkpoint equals the one grad_sync='allreduce' writes (same keys, world 2, same values), and each resumes
    under the other."""
    from fxpar.runtime.checkpoint import read_manifest
    model, batches = tiny_gpt(), token_batches(3, batch=8)
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, ADAMW)
    bps = _build(2, 1, batches, model)
    ar = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], gpt_loss, ADAMW,
                           strategy=fxpar.Strategy(dp=2, bucket_cap_mb=0.01))
    runs = {"byteps": (bps, clusters.get(3)), "allreduce": (ar, clusters.get(2))}
    first = {}
    for name, (prog, lc) in runs.items():
        first[name] = prog.run_local(batches[:1], cluster=lc, save_to=tmp_path / name)
        assert abs(first[name].losses[0] - ref_losses[0]) < TOL
    assert first["byteps"].servers[2]["steps"] == 1
    m_bps, m_ar = read_manifest(tmp_path / "byteps"), read_manifest(tmp_path / "allreduce")
    assert m_bps["world_size"] == m_ar["world_size"] == 2 and m_bps["tensors"] == m_ar["tensors"]
    v_bps, v_ar = _checkpoint_values(tmp_path / "byteps"), _checkpoint_values(tmp_path / "allreduce")
    assert v_bps.keys() == v_ar.keys() and max_abs_diff(v_bps, v_ar) < TOL
    for saved_by in runs:                    # each checkpoint resumes under both programs
        for name, (prog, lc) in runs.items():
            res = prog.run_local(batches[1:], cluster=lc, resume_from=tmp_path / saved_by)
            assert max(abs(a - b) for a, b in zip(res.losses, ref_losses[1:])) < TOL, (saved_by, name)
            assert max_abs_diff(res.state_dict(), ref_state) < TOL, (saved_by, name)
            if name == "byteps":
                assert res.servers[2]["steps"] == 2 and res.servers[2]["per_step"][0]["pushes"] > 0
