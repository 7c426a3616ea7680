"""Graphs sent to ranks arrive node for node (fxpar.portable).

torch.fx's own GraphModule pickling re-traces the code, which runs every call without graph
inputs once and freezes its result: dropout's mask would be drawn once, at unpickling, and reused
in every step. These tests pin the fix down.
"""
import pytest
import pickle

import torch

import fxpar
from fxpar.portable import pack_graph_module, unpack_graph_module
from fxpar.testing import GPT, gpt_loss


def _dropout_program(**strategy):
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 16))
    world = strategy.get("dp", 1) * strategy.get("pp", 1)
    return fxpar.parallelize(GPT(dropout=0.2), fxpar.ClusterSpec.local(world), (x, x), loss_fn=gpt_loss,
                             strategy=fxpar.Strategy(**strategy)), x


def _random_ops(gm):
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and "bernoulli" in str(n.target)]


@pytest.mark.structure
def test_torch_fx_pickling_would_freeze_dropout():
    """The failure this module exists for: plain pickle drops the random op from the graph (a
    single-rank graph here: a dp graph does not even unpickle, since the re-trace runs the bucket's
    all_reduce_ on a buffer with no graph inputs, outside any process group)."""
    p, _ = _dropout_program()
    gm = p.graphs(0)["step"]
    assert _random_ops(gm) and not _random_ops(pickle.loads(pickle.dumps(gm)))


@pytest.mark.structure
def test_round_trip_keeps_every_node_and_the_code():
    p, x = _dropout_program(dp=2)
    gm = p.graphs(0)["step"]
    back = unpack_graph_module(pickle.loads(pickle.dumps(pack_graph_module(gm))))
    assert [(n.op, n.name, str(n.target)) for n in back.graph.nodes] == \
        [(n.op, n.name, str(n.target)) for n in gm.graph.nodes]
    assert back.code == gm.code
    assert back.meta["fxpar_signature"].inputs == gm.meta["fxpar_signature"].inputs
    comm = [n.meta["fxpar_comm"] for n in back.graph.nodes if "fxpar_comm" in n.meta]
    assert comm == p.collectives(0) and comm


@pytest.mark.structure
def test_payloads_send_their_graphs_node_by_node():
    p, _ = _dropout_program(dp=2)
    payload = pickle.loads(pickle.dumps(p.payload(0)))
    # one executor: a payload carries per held stage {kind: SplitGraph}; a dp program runs the fused FULL graph
    assert _random_ops(payload.graphs[0]["FULL"].gm) == _random_ops(p.graphs(0)["step"])
    q, _ = _dropout_program(pp=2, microbatches=2)
    stage = pickle.loads(pickle.dumps(q.payload(0))).graphs[0]
    assert _random_ops(stage["F"].gm) == _random_ops(q.stages[0].graphs["F"].gm) != []
    # the in-place optimizer step (was StageProgram.step_inplace; now the STEP graph cut from the joint graph
    # after reinplace_optimizer) arrives node for node, still in place
    step = stage["STEP"].gm
    assert step.code == q.stages[0].graphs["STEP"].gm.code
    assert any(n.op == "call_function" and str(n.target).startswith("aten._foreach_") and
               str(n.target).split(".")[1].endswith("_") for n in step.graph.nodes)


@pytest.mark.numerics
def test_dropout_masks_change_every_step_on_spawned_ranks(clusters):
    """Same batch, same weights (lr 0): with a frozen mask every step's loss would be equal."""
    x = torch.randint(0, 64, (4, 16))
    p = fxpar.parallelize(GPT(dropout=0.2), fxpar.ClusterSpec.local(2), (x, x), loss_fn=gpt_loss,
                          optimizer=(torch.optim.SGD, {"lr": 0.0}), strategy=fxpar.Strategy(dp=2))
    res = p.run_local([(x, x)] * 3, cluster=clusters.get(2))
    assert len(set(res.losses)) == 3


@pytest.mark.numerics
def test_pipeline_dropout_is_seeded_and_redrawn(clusters):
    """pp=2 with dropout: the same seed gives the same run, another seed another one, and with a
    zero learning rate every step still draws new masks (the graph kept its random op)."""
    x = torch.randint(0, 64, (4, 16))
    torch.manual_seed(0)
    p = fxpar.parallelize(GPT(dropout=0.2), fxpar.ClusterSpec.local(2), (x, x), loss_fn=gpt_loss,
                          optimizer=(torch.optim.SGD, {"lr": 0.0}),
                          strategy=fxpar.Strategy(pp=2, schedule="1f1b", microbatches=2))
    a = p.run_local([(x, x)] * 3, cluster=clusters.get(2), seed=3)
    b = p.run_local([(x, x)] * 3, cluster=clusters.get(2), seed=3)
    c = p.run_local([(x, x)] * 3, cluster=clusters.get(2), seed=4)
    assert a.losses == b.losses and a.losses != c.losses
    assert len(set(a.losses)) == 3


@pytest.mark.structure
def test_a_runs_graphs_are_packed_once_and_unpacked_lazily():
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from fxpar.portable import packing_once
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU()))
    with packing_once():
        a, b = pack_graph_module(gm), pack_graph_module(gm)
    assert a is b                                          # every rank's payload pickles the one packed form
    assert pack_graph_module(gm) is not a                  # outside: packed again (the graph may have changed)
    back = unpack_graph_module(pickle.loads(pickle.dumps(a)))
    assert isinstance(back, _LazyGraphModule) and back.code == gm.code
    x = torch.randn(2, 3)
    assert torch.equal(back(x), gm(x))


@pytest.mark.structure
def test_the_ranks_pipe_carries_tensors_by_value():
    import multiprocessing
    from fxpar.runtime.launch import send
    a, b = multiprocessing.Pipe()
    t = torch.arange(4.0)
    send(a, ("ok", {"w": t}))
    kind, got = pickle.loads(b.recv_bytes())
    assert kind == "ok" and torch.equal(got["w"], t) and not t.is_shared()
    got["w"].add_(1)                                       # the receiver's copy is its own
    assert torch.equal(t, torch.arange(4.0))
    a.send(("ready", None))                                # what conn.send sent reads the same way
    assert pickle.loads(b.recv_bytes()) == ("ready", None)
