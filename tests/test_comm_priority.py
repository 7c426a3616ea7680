"""``ClusterSpec.comm_priority``: every rank's gloo threads under SCHED_FIFO (``raise_comm_threads``), the math
unchanged; and ``DeviceSpec.collective_slots``, which ``calibrate`` picks from how two small collectives in
flight together cost."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.tools.calibrate import in_step_slots
from fxpar.host import COMM_THREAD_NAMES, HostSettings
from fxpar.errors import ClusterSpecError
from fxpar.testing import max_abs_diff, reference_training


@pytest.mark.structure
def test_comm_priority_round_trips_and_is_checked():
    spec = fxpar.ClusterSpec.local(2, comm_priority=True)
    assert fxpar.ClusterSpec.from_json(spec.to_json()).comm_priority is True
    assert fxpar.ClusterSpec.from_json(fxpar.ClusterSpec.local(2).to_json()).comm_priority is False
    with pytest.raises(ClusterSpecError, match=r"comm_priority='yes'.*True"):
        fxpar.ClusterSpec.local(2, comm_priority="yes")
    from dataclasses import replace
    with pytest.raises(ClusterSpecError, match="collective_slots"):
        replace(spec, device=replace(spec.device, collective_slots=-1))
    slotted = replace(spec, device=replace(spec.device, collective_slots=1))
    assert fxpar.ClusterSpec.from_json(slotted.to_json()).device.collective_slots == 1


@pytest.mark.cost
def test_in_step_slots_is_the_model_nearer_the_pair():
    """With issue i, two slots put the pair at max(ar, i + ag), one at max(2i, ar) + ag - i; ``calibrate`` keeps
    the nearer. Figures measured on this project's 2-core machine (seconds): gloo's threads raised, 0.365 /
    0.311 / 0.743 ms, issue 0.118 -- one slot (the collectives' CPU work shares the cores); as the OS schedules
    them, 1.479 / 0.894 / 1.428 ms, issue 0.080 -- two (their time is mostly waiting, which overlaps)."""
    assert in_step_slots({"all_reduce": 365e-6, "all_gather": 311e-6, "pair": 743e-6}, 118e-6) == 1
    assert in_step_slots({"all_reduce": 1.479e-3, "all_gather": 0.894e-3, "pair": 1.428e-3}, 80e-6) == 2
    assert in_step_slots({"all_reduce": 200e-6, "all_gather": 100e-6, "pair": 290e-6}, 150e-6) == 2   # a tie: two
    assert in_step_slots({"all_reduce": 200e-6, "all_gather": 180e-6}, 100e-6) is None     # pair not measured


class _Table(torch.nn.Module):
    def __init__(self, vocab=500, d=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.head = torch.nn.Linear(d, 3)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def _policies():
    """This rank: whether it may use SCHED_FIFO at all, and the policy of each of its gloo threads."""
    try:                                   # on a thread of our own, which we put back
        import threading
        out = {}

        def probe():
            tid = threading.get_native_id()
            try:
                os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
                out["may"] = True
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except PermissionError:
                out["may"] = False
        t = threading.Thread(target=probe)
        t.start()
        t.join()
        may = out["may"]
    except AttributeError:                 # not Linux
        may = False
    pol = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() in COMM_THREAD_NAMES:
                    pol.append(os.sched_getscheduler(int(tid)))
        except (FileNotFoundError, ProcessLookupError):     # a thread (not gloo's: those live with their group) ended
            continue
    return may, pol


def _train_raised(spec, grad_sync, n_batches, seed):
    """Train the table model on ``spec`` (comm_priority=True) on ranks of its own (the raised threads stay raised
    for the ranks' life); check it equals single-process training (float64, 1e-10); return each rank's
    :func:`_policies` and the program."""
    torch.manual_seed(0)
    model = _Table().double()
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randint(0, 500, (8, 4), generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(n_batches)]
    opt = (torch.optim.SGD, {"lr": 0.5})
    prog = fxpar.parallelize(model, spec, batches[0], F.cross_entropy, opt,
                             strategy=fxpar.Strategy(dp=2, grad_sync=grad_sync))
    n = spec.world_size + spec.cpu_servers
    lc = fxpar.LocalCluster(n)
    try:
        res = prog.run_local(batches, cluster=lc)
        probes = lc.run(_policies, [()] * n)
    finally:
        lc.close()
    ref_losses, ref_state = reference_training(model, batches, F.cross_entropy, opt)
    assert max(abs(a - b) for a, b in zip(res.losses, ref_losses)) < 1e-10
    assert max_abs_diff(res.state_dict(), ref_state) < 1e-10
    return probes, prog


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="SCHED_FIFO is Linux's")
def test_comm_priority_raises_every_gloo_thread_and_matches_single_process():
    """A program planned on ``ClusterSpec(comm_priority=True)``: each rank's Executor puts all of its gloo threads
    (the world group's and the program's own groups') under SCHED_FIFO -- all or none: one left behind makes the
    raised ones spin (``raise_comm_threads``) -- and training equals single-process training (float64)."""
    probes, _ = _train_raised(fxpar.ClusterSpec.local(2, comm_priority=True), "parallax", 3, seed=1)
    for may, pol in probes:
        assert len(pol) >= 3                                    # the TCP loop and the world group's two workers
        assert set(pol) == ({os.SCHED_FIFO} if may else {os.SCHED_OTHER})


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="SCHED_FIFO is Linux's")
def test_comm_priority_with_a_byteps_server_raises_its_threads_too():
    """BytePS's CPU summation server joins the program's groups and raises its gloo threads as the workers do
    (one world barrier on every rank, workers and server alike), and training still equals single-process."""
    spec = fxpar.ClusterSpec.local(2, cpu_servers=1, comm_priority=True)
    probes, prog = _train_raised(spec, "byteps", 2, seed=2)
    assert all(s.host == HostSettings(comm_priority=True, host_memory_reuse=True) for s in prog.extra_ranks())
    assert len(probes) == 3
    for may, pol in probes:                        # the server's own group's threads too (two workers per group)
        assert len(pol) >= 5 and set(pol) == ({os.SCHED_FIFO} if may else {os.SCHED_OTHER})
