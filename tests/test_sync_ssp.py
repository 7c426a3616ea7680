"""Stale synchronous parallel (``S.SSP``) and its dynamic variant (``S.DSSP``) on parameter-server ranks.

Reductions: a bound of 0 is synchronous SGD on the global batch (to 1e-10, SGD-momentum, one and two servers).
Against the one-process reference of SSP's read rule (``fxpar.testing.sync.ssp_reference``), replaying the servers'
logs of a run with a straggler: every loss and the final parameters to 1e-10. Invariants measured on the ranks: no
read is more than its bound behind (the worker's clock minus the clocks every worker had pushed), the servers' clock
spread stays within the bound, DSSP's chosen bounds stay in [low, high]. Checkpoints: at bound 0 a resumed run is
the uninterrupted one bitwise; at bound > 0 the servers resume from the clock table saved, bitwise, and the run equals
the replay of its own logs from the checkpoint. Under torchrun, with the server as the last rank, bound 0 equals
run_local bitwise, a save and a load on the way.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import sync as S
from fxpar.testing import MLP, max_abs_diff, reference_training
from fxpar.testing.compress import mlp_batches
from fxpar.testing.resume import assert_resume_is_exact
from fxpar.testing.sync import ssp_reference

SGD_M = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


def _model():
    torch.manual_seed(0)
    return MLP(layers=2).double()


def _program(model, batches, method, dp=2, servers=1, slowdown=None, optimizer=SGD_M):
    cluster = fxpar.ClusterSpec.local(dp, cpu_servers=servers, slowdown=slowdown or {})
    return fxpar.parallelize(model, cluster, batches[0], loss_fn=F.mse_loss, optimizer=optimizer,
                             strategy=fxpar.Strategy(dp=dp, sync=method))


def _close(got: dict, want: dict, msg=""):
    assert got and sorted(want) == sorted(got)
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-10, atol=1e-10, msg=f"{msg} {k}")


def _servers(res) -> list:
    return [res.servers[r] for r in sorted(res.servers)]


@pytest.mark.numerics
@pytest.mark.parametrize("method,servers", [(S.SSP(staleness=0), 1), (S.DSSP(low=0, high=0), 2)],
                         ids=["SSP-s0", "DSSP-0-0-two-servers"])
def test_bound_zero_is_synchronous_sgd(clusters, method, servers):
    """Every read waits for every worker's previous clock: the losses and the parameters are synchronous SGD-momentum
    on the global batch, on every worker, to 1e-10."""
    model, batches = _model(), mlp_batches(5)
    res = _program(model, batches, method, servers=servers).run_local(batches, cluster=clusters.get(2 + servers))
    losses, state = reference_training(model, batches, F.mse_loss, SGD_M)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    _close({k: v for k, v in res.state_dict().items()}, state)
    for r in range(2):
        _close(res.features[r]["sync"]["replica"], state, f"worker {r}")
        assert all(c == fresh for c, fresh, _, _ in res.features[r]["sync"]["reads"])
    assert _servers(res)[0]["clock_table"]["max_spread"] == 0


@pytest.mark.numerics
def test_stale_reads_equal_the_read_rule_replayed(clusters):
    """dp=2, SSP(staleness=2), worker 1 three times slower, two servers: the run's losses and final parameters equal
    the one-process replay of the servers' logs; some read was stale (the fast worker ran ahead), none beyond 2."""
    model, batches = _model(), mlp_batches(8)
    prog = _program(model, batches, S.SSP(staleness=2), servers=2, slowdown={1: 3.0})
    res = prog.run_local(batches, cluster=clusters.get(4))
    servers = _servers(res)
    ref = ssp_reference(model, batches, F.mse_loss, SGD_M, 2, [s["log"] for s in servers],
                        [s["keys"] for s in servers])
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref["losses"]), rtol=1e-10, atol=1e-10)
    _close(res.state_dict(), ref["final"])
    reads = [r for w in range(2) for r in res.features[w]["sync"]["reads"]]
    assert len(reads) == 16 and all(s == 2 and c - fresh <= 2 for c, fresh, s, _ in reads)
    assert max(res.features[w]["sync"]["max_lead"] for w in range(2)) <= 2
    assert servers[0]["clock_table"]["max_spread"] <= 2
    assert any(c - fresh > 0 for c, fresh, _, _ in reads), "no read was stale: the straggler did not slow worker 1"


@pytest.mark.numerics
def test_dssp_bounds_stay_in_range(clusters):
    """dp=2, DSSP(low=1, high=3), worker 1 three times slower: every bound the first server chose is in [1, 3], every
    read within the bound it was given; the run matches the replay of its logs."""
    model, batches = _model(), mlp_batches(8)
    prog = _program(model, batches, S.DSSP(low=1, high=3), dp=2, slowdown={1: 3.0})
    res = prog.run_local(batches, cluster=clusters.get(3))
    table = _servers(res)[0]["clock_table"]
    chosen = [s for _, _, s in table["staleness"]]
    assert chosen and all(1 <= s <= 3 for s in chosen)
    for w in range(2):
        assert all(c - fresh <= s for c, fresh, s, _ in res.features[w]["sync"]["reads"])
    assert table["max_spread"] <= 3
    ref = ssp_reference(model, batches, F.mse_loss, SGD_M, 2, [_servers(res)[0]["log"]], [_servers(res)[0]["keys"]])
    _close(res.state_dict(), ref["final"])


@pytest.mark.structure
def test_extra_clocks_picks_the_push_nearest_the_slowest():
    """The controller: the fast worker's r-th next push nearest the slowest's next push, in [0, r_max]."""
    from fxpar.sync.ssp import extra_clocks
    assert extra_clocks(10.0, 1.0, 9.0, 4.0, 5) == 3          # 13 = 9 + 4
    assert extra_clocks(10.0, 1.0, 9.0, 40.0, 5) == 5         # capped at r_max
    assert extra_clocks(10.0, 1.0, 9.0, 0.5, 5) == 0          # the slowest pushes before the next one
    assert extra_clocks(10.0, None, 9.0, 4.0, 5) == 0         # not measured yet
    assert extra_clocks(10.0, 1.0, 9.0, 4.0, 0) == 0          # low == high


@pytest.mark.structure
def test_plan_json_and_explain():
    """The section names the servers and their shards, round-trips through JSON, and explain() says the rule."""
    model, batches = _model(), mlp_batches(1)
    prog = _program(model, batches, S.DSSP(low=1, high=4), servers=2)
    sec = prog.plan.section("sync")
    assert sec.servers == [2, 3] and sorted(k for sh in sec.shards for k in sh) == sorted(dict(model.named_parameters()))
    again = fxpar.Plan.from_json(prog.plan.to_json())
    assert again.section("sync").shards == sec.shards
    assert again.section("sync").method == {"method": "dssp", "low": 1, "high": 4}
    text = prog.explain()
    assert "parameter server 1 (rank 3)" in text and "s chosen per read in [1, 4]" in text
    assert [type(p).__name__ for p in prog.extra_ranks()] == ["SSPServer", "SSPServer"]


SGD = (torch.optim.SGD, {"lr": 0.1})


@pytest.mark.slow
@pytest.mark.numerics
def test_resume_at_bound_zero_is_bitwise(clusters, tmp_path):
    """SSP(staleness=0), two servers, SGD-momentum: 3 steps, save, resume, 3 steps equals 6 steps bitwise (losses,
    parameters, every worker's own replica); the resumed servers' clock table goes on from the saved one."""
    model, batches = _model(), mlp_batches(6)
    prog = _program(model, batches, S.SSP(staleness=0), servers=2)
    lc = clusters.get(4)
    whole, first, second = assert_resume_is_exact(prog, batches, 3, lc, tmp_path / "ck")
    for w in range(2):
        assert max_abs_diff(second.features[w]["sync"]["replica"], whole.features[w]["sync"]["replica"]) == 0
        assert second.features[w]["sync"]["steps"] == 6 and len(second.features[w]["sync"]["reads"]) == 6
    before, after = _servers(first)[0]["clock_table"], _servers(second)[0]["clock_table"]
    assert after["clocks"] == [6, 6] and after["staleness"][:6] == before["staleness"]
    assert [t[:3] for t in after["push_times"]] == before["push_times"]         # the saved table, bitwise
    assert [s["start_clock"] for s in _servers(second)] == [3, 3]
    assert [s["resumed_from"] for s in _servers(second)] == [s["table_state"] for s in _servers(first)]
    assert all(e[2] >= 3 for s in _servers(second) for e in s["log"])            # the run went on from clock 3


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("method", [S.SSP(staleness=2), S.DSSP(low=1, high=3)], ids=["SSP-s2", "DSSP-1-3"])
def test_stale_resume_goes_on_from_the_saved_servers(clusters, tmp_path, method):
    """Worker 1 three times slower, 4 steps, save, resume for 4 more: the servers restart from the checkpoint's
    parameters at clock 4 with the saved clock table, bitwise (DSSP's grants included), and the resumed run equals the
    one-process replay of its logs from there (SGD: a worker's optimizer holds no state the replay would lack); every
    read within its bound."""
    model, batches = _model(), mlp_batches(8)
    prog = _program(model, batches, method, slowdown={1: 3.0}, optimizer=SGD)
    lc = clusters.get(3)
    first = prog.run_local(batches[:4], cluster=lc, save_to=tmp_path / "ck")
    second = prog.run_local(batches[4:], cluster=lc, resume_from=tmp_path / "ck")
    for saved, resumed in zip(_servers(first), _servers(second)):
        assert resumed["resumed_from"] == saved["table_state"] and resumed["start_clock"] == 4
    before, after = _servers(first)[0]["clock_table"], _servers(second)[0]["clock_table"]
    n = len(before["staleness"])
    assert after["staleness"][:n] == before["staleness"] and after["max_spread"] >= before["max_spread"]
    assert [t[:len(b)] for t, b in zip(after["push_times"], before["push_times"])] == before["push_times"]
    assert after["clocks"] == [8, 8]
    lo, hi = method.bounds()
    assert all(lo <= s <= hi for _, _, s in after["staleness"])
    start = _model()
    start.load_state_dict(first.state_dict())
    ref = ssp_reference(start, batches, F.mse_loss, SGD, 2, [_servers(second)[0]["log"]],
                        [_servers(second)[0]["keys"]], start=4)
    torch.testing.assert_close(torch.tensor(second.losses), torch.tensor(ref["losses"]), rtol=1e-10, atol=1e-10)
    _close(second.state_dict(), ref["final"])
    for w in range(2):
        reads = second.features[w]["sync"]["reads"]
        assert len(reads) == 8 and [r[0] for r in reads] == list(range(1, 9))
        assert all(c - fresh <= s for c, fresh, s, _ in reads)


def torchrun_ssp(tmp_path, nproc: int, *args) -> tuple:
    """``examples/torchrun_ssp.py`` under torchrun on ``nproc`` processes, saving and loading a checkpoint on the
    way: what rank 0 wrote (losses, the losses again after the load, the state), and the example's module."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "out.pt"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                          str(root / "examples" / "torchrun_ssp.py"), "--save", str(tmp_path / "ck"), "--out",
                          str(out), *args], capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("torchrun_ssp", root / "examples" / "torchrun_ssp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return torch.load(out), example


@pytest.mark.slow
@pytest.mark.numerics
def test_torchrun_workers_and_a_server_rank_equal_run_local(clusters, tmp_path):
    """SSP(staleness=0) under torchrun, 2 workers + the parameter server as rank 2: 4 steps equal run_local's 4
    bitwise (losses, state); after loading the checkpoint of step 2, steps 3 and 4 again give the same losses."""
    got, example = torchrun_ssp(tmp_path, 3, "--method", "ssp", "--staleness", "0")
    batches = mlp_batches(4)
    _, prog = example.program_for("ssp", 0, 3, batches[0])
    res = prog.run_local(batches, cluster=clusters.get(3))
    assert got["losses"] == res.losses and got["again"] == res.losses[2:]
    assert max_abs_diff(got["state"], res.state_dict()) == 0


@pytest.mark.slow
@pytest.mark.structure
def test_resume_with_other_servers_is_refused_by_name(clusters, tmp_path):
    """A checkpoint whose servers held other shards (one server, resumed on two) is refused at the load, naming the
    shards and the setting."""
    model, batches = _model(), mlp_batches(2)
    _program(model, batches, S.SSP(staleness=0), servers=1).run_local(batches[:1], cluster=clusters.get(3),
                                                                       save_to=tmp_path / "ck")
    two = _program(model, batches, S.SSP(staleness=0), servers=2)
    with pytest.raises(fxpar.RankFailedError, match=r"the checkpoint's parameter servers held the shards .*"
                                                     r"ClusterSpec\(cpu_servers=\.\.\.\)"):
        two.run_local(batches[1:], cluster=clusters.get(4), resume_from=tmp_path / "ck")


@pytest.mark.slow
@pytest.mark.numerics
def test_resume_from_a_checkpoint_saved_without_servers(clusters, tmp_path):
    """Plain dp=2 saves after 3 steps; SSP(staleness=0) resumes from it: the servers start from its parameters at
    clock 0, the workers from its optimizer state, and the 6 steps are synchronous SGD-momentum to 1e-10."""
    model, batches = _model(), mlp_batches(6)
    plain = fxpar.parallelize(model, 2, batches[0], loss_fn=F.mse_loss, optimizer=SGD_M, strategy=fxpar.Strategy(dp=2))
    first = plain.run_local(batches[:3], cluster=clusters.get(2), save_to=tmp_path / "ck")
    res = _program(model, batches, S.SSP(staleness=0)).run_local(batches[3:], cluster=clusters.get(3),
                                                                  resume_from=tmp_path / "ck")
    losses, state = reference_training(model, batches, F.mse_loss, SGD_M)
    torch.testing.assert_close(torch.tensor(first.losses + res.losses), torch.tensor(losses), rtol=1e-10, atol=1e-10)
    _close(res.state_dict(), state)
    assert _servers(res)[0]["start_clock"] == 0 and _servers(res)[0]["resumed_from"] is None
