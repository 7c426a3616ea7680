"""The one executor: a rank runs its list of schedule actions, each by a handler looked up in a table.

Every program is a schedule of stages (a program without a pipeline is one stage), so one
executor runs them all. A compute action calls one graph the split pass made (``F``, ``B``,
``I``, ``W``, ``REDUCE_GRAD``, ``STEP``, or the fused one-stage ``FULL``); each graph comes with
the role of each input and output (:class:`passes.split_graphs.SplitGraph`), which is all the
runtime reads: it never looks at ``node.meta``.

Semantics (those of :func:`fxpar.schedule.simulate`): actions run strictly in list order; a SEND
posts ``isend`` and goes on; a RECV blocks until the tensors are there. A sent tensor is held until its send is
waited: right after the RECV that :func:`fxpar.schedule.sends.send_releases` names for it (the receiver is known to
have its message: the wait cannot block), else at the end of the window. A message is several tensors sent back to back on one tag per
(direction, consuming stage), so the n-th send of a channel meets the n-th receive.

State a rank keeps: per held stage its parameters (one dict per weight version for asynchronous
schedules, :class:`~fxpar.runtime.tracking.VersionStore`), optimizer state and step count; the
buffers; per microbatch the values ``F`` saved for the backward; per parameter key one gradient
accumulator (the sum over the step's microbatches and over the rank's stages that share the
parameter); the collectives ``REDUCE_GRAD`` started, until ``STEP`` waits on them.

Besides the math each rank measures, per window: per stage the most microbatches whose saved
tensors were alive at once and their bytes (``act_peak``, ``act_peak_bytes``), the seconds of every
action (``action_times``, ``timelines``), with ``settings.record_weights`` a fingerprint of the
weights every F and B computes with (``weight_log``), and with ``settings.measure_memory`` the most tensor bytes
alive at once and those held at the start (``peak_memory``, :class:`~fxpar.runtime.measure.MemoryTracker`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import prefetch  # noqa: F401  registers fxpar::prefetch before any graph holding it is unpacked on a rank
from ..collectives import gloo_group, in_flight_across_graphs, lower_for_backend, stage_through_host
from ..feature import NEW_STATE_ROLE, STATE_ROLE, split_state_key
from ..host import reuse_freed_memory
from ..roles import GraphKind, Role
from ..schedule import ActionKind
from .launch import note_step
from .measure import CommCounter, MemoryTracker
from .settings import RunSettings
from .groups import bind_groups, comm_priority, group, seed_rank
from .state import eager_optimizer_state, load_rank_state, save_rank_state
from .tracking import VersionStore, activation_bytes, digest, weight_storages

__all__ = ["RankPayload", "RunSettings", "Executor", "bind_groups", "make_scheduler", "seed_rank", "group", "straggle"]

_K = ActionKind


@dataclass
class RankPayload:
    """Everything one rank needs, picklable: sent to spawned workers or built in place under torchrun."""
    rank: int
    dp: int
    actions: list                  # this rank's Actions (peers are pipeline ranks)
    stage_to_rank: list            # per stage: the pipeline ranks holding it
    microbatches: int
    graphs: dict                   # held stage -> {kind: SplitGraph}
    messages: dict                 # held stage -> {"acts_in", "acts_out", "grads_in", "grads_out": [(key, shape, dtype)]}
    stage_params: dict             # held stage -> its trainable parameter keys
    params: dict                   # key -> initial tensor (the held stages' parameters)
    buffers: dict
    optimizer: object              # fxpar.optim.OptimizerSpec
    groups: list                   # every process group of the program, (name, ranks), in creation order
    bindings: dict                 # group name -> this rank's ranks in it
    lr_scheduler: object = None    # (SchedulerClass, kwargs), callable(torch optimizer) -> scheduler, or None
    settings: RunSettings = field(default_factory=RunSettings)   # the run's settings (n_inputs, seed, measuring ...)
    features: dict = field(default_factory=dict)   # feature name -> (its RankState class, the rank's info)
    tp: int = 1                    # tensor-parallel ranks per dp replica: rank = (pipe rank * dp + dp index) * tp + tp index
    foreign_buffers: tuple = ()    # buffers a stage's forward updates whose first holder is another pipeline rank
    releases: dict = field(default_factory=dict)   # index of a RECV -> indices of the SENDs waited right after it


def make_scheduler(spec, optimizer):
    """``(SchedulerClass, kwargs)`` or ``callable(optimizer) -> scheduler`` or None."""
    if spec is None:
        return None
    if isinstance(spec, tuple):
        cls, kwargs = spec
        return cls(optimizer, **kwargs)
    return spec(optimizer)


def _tag(channel: str, consumer_stage: int) -> int:
    return 2 * consumer_stage + (0 if channel == "F" else 1)


def straggle(factor: float, wall_s: float, cpu_s: float) -> float:
    """A straggler's compute action took ``wall_s`` (``cpu_s`` of the process's CPU): sleep ``(factor - 1)`` times
    its compute seconds, the smaller of the two (a wait inside it costs no CPU; ops on several threads cost more
    CPU than wall time), so the action takes ``factor`` times as long. Returns the time after the sleep."""
    time.sleep((factor - 1) * max(0.0, min(wall_s, cpu_s)))
    return time.perf_counter()


def _wait_sends(sends: list) -> None:
    """Wait on one message's sends, binding no tensor of it to a name that outlives the call (the tensors die with
    the list)."""
    for pair in sends:
        pair[0].wait()


class _Window:
    """What lives for one run of the action list: messages, saved values, gradient sums, timings."""

    def __init__(self, micro, n_groups: int, store):
        self.micro = micro
        self.fwd, self.bwd, self.saved, self.sends = {}, {}, {}, {}     # sends: SEND index -> [(work, tensor)]
        self.acc, self.owned, self.synced, self.pending = {}, set(), {}, {}
        self.loss_sums = [0.0] * n_groups
        self.store = store
        self.live: dict = {}
        self.wptrs: dict = {}
        self.times: dict = {}
        self.timeline: list = []
        self.busy = 0.0


class Executor:
    """Runs one rank's part of a program: ``step(global_batch)`` trains one step, ``run_async(batches)``
    runs an asynchronous schedule's one window over all batches."""

    def __init__(self, p: RankPayload):
        self.p = p
        self.rank = p.rank
        self.width = p.dp * p.tp                          # ranks per pipeline rank
        self.pipe_rank, self.inner = divmod(p.rank, self.width)
        # the compute device: where the program's parameters are (a model moved to CUDA before parallelize)
        self.device = next((t.device for t in p.params.values()), torch.device("cpu"))
        self.p2p_staged = False
        self.dp_index, self.tp_index = divmod(self.inner, p.tp)
        seed_rank(p.settings.rng_seed, p.rank, self.tp_index)
        if p.settings.host.host_memory_reuse:     # ClusterSpec.host_memory_reuse: before the first allocation
            reuse_freed_memory()
        if dist.is_initialized():
            for name, ranks in p.groups:      # every rank creates every group, in one order
                group(ranks, name)
            names = {name: group(ranks, name).group_name for name, ranks in p.bindings.items() if len(ranks) > 1}
            gms = [sg.gm for parts in p.graphs.values() for sg in parts.values()]
            across = in_flight_across_graphs(gms)
            for gm in gms:
                bind_groups(gm, names)
                lower_for_backend(gm, anywhere=across)   # gloo: a gather beside another collective, through dist
                if self.device.type != "cpu":
                    stage_through_host(gm)               # device tensors over a gloo group: through the host
            # point-to-point (pipelines) over gloo moves host memory: device tensors go through the host
            self.p2p_staged = self.device.type != "cpu" and gloo_group(dist.group.WORLD)
            if p.settings.host.comm_priority:
                dist.barrier()                    # every group's threads up (and named) before they are raised
                comm_priority(p.rank)
        self.params = {s: {k: p.params[k].detach().clone() for k in keys} for s, keys in p.stage_params.items()}
        # the enabled features' per-rank state (fxpar.feature.RankState): graph inputs of role "state"
        self.features = {name: cls(info, p.rank) for name, (cls, info) in p.features.items()}
        # the graph inputs the features provide: their own state, and the roles their RankStates declare
        self.feature_roles = {STATE_ROLE} | {r for st in self.features.values() for r in st.input_roles}
        self.buffers = {k: v.detach().clone() for k, v in p.buffers.items()}
        spec = p.optimizer
        self.spec = spec
        self.state = {s: {f"{n}:{k}": torch.zeros_like(v) for k, v in ps.items() for n in spec.state_names}
                      for s, ps in self.params.items()}
        for st in self.features.values():        # the features' state: chunks, pieces, files, residuals
            st.setup(self)
        for st in self.features.values():        # then what runs the graphs (a compiler's callables)
            st.after_setup(self)
        # torch's optimizer: it steps an untraced optimizer; for a traced one it only holds the LR the scheduler
        # moves, so its parameters are empty placeholders (a copy of every weight would cost Ψ per rank)
        self._leaves = {(s, k): torch.nn.Parameter(v.clone() if not spec.traced else v.new_empty(0))
                        for s, ps in self.params.items() for k, v in ps.items()}
        self.torch_opt = spec.make_torch_optimizer(list(self._leaves.values()))
        self.scheduler = make_scheduler(p.lr_scheduler, self.torch_opt)
        if spec.traced:           # the traced graph steps; torch's optimizer only holds the LR for the scheduler
            self.torch_opt._opt_called = True
        self.step_count = {s: 0 for s in p.stage_params}
        self.last_stage = len(p.stage_to_rank) - 1
        self.n_inputs = p.settings.n_inputs
        self.loss_sums, self.step_times = [], []
        # held_sends / held_send_bytes: the most messages (and their bytes) sent and not yet waited, at once
        self.comm = {"sent_bytes": 0, "sends": 0, "recvs": 0, "held_sends": 0, "held_send_bytes": 0}
        self.comm_calls: list = []
        self.comm_groups: list = []       # per step, per call: the global ranks of its group
        self.measure_comm = p.settings.measure_comm
        self.measure_memory = p.settings.measure_memory
        self.peak_memory: list = []          # measure_memory: per window (most live tensor bytes, bytes at its start)
        self.peak_versions: dict = {}
        self.peak_version_bytes = 0
        self.busy: list = []
        self.act_peak = {s: 0 for s in p.stage_params}
        self.act_peak_bytes = {s: 0 for s in p.stage_params}
        self.action_times: list = []
        self.timelines: list = []
        self.record_weights = p.settings.record_weights
        self.weight_log: list = []
        # asynchronous schedules: per stage the versions before the newest, oldest first, that a checkpoint carries
        # to the next window (``settings.carried``: 2BW's W(t-1), PipeDream's last p-s-1)
        self.prev_params: dict = {}
        self.state_bytes: dict = {}          # most model-state bytes held at an update: params, grads, optimizer
        self.handlers = {_K.F: self._forward, _K.B: self._backward, _K.I: self._backward, _K.W: self._backward,
                         _K.SEND_F: self._send, _K.SEND_B: self._send, _K.RECV_F: self._recv, _K.RECV_B: self._recv,
                         _K.REDUCE_GRAD: self._reduce_grad, _K.STEP: self._step, _K.FULL: self._full}
        for st in self.features.values():        # actions a feature's state runs itself
            self.handlers.update(st.handlers(self))

    # ---- running ---------------------------------------------------------------------------------
    def microbatches(self, batch) -> list:
        """This rank's dp shard of a global batch, cut into the schedule's microbatches (dim 0)."""
        batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        m, dp = self.p.microbatches, self.p.dp
        out = []
        for t in batch:
            n = t.shape[0] // dp
            out.append(t.narrow(0, self.dp_index * n, n).chunk(m))
        return [tuple(parts[i] for parts in out) for i in range(m)]

    def step(self, batch) -> float:
        """One synchronous training step on one global batch; returns this rank's sum of microbatch losses."""
        t0 = time.perf_counter()
        loss = self._measured(self.microbatches(batch), None)[0]
        if self.scheduler is not None:
            self.scheduler.step()
        self.loss_sums.append(loss)
        self.step_times.append(time.perf_counter() - t0)
        return loss

    def run_async(self, batches: list) -> None:
        """An asynchronous schedule: one window over every microbatch of every batch, no flush between."""
        t0 = time.perf_counter()
        micro = [mb for b in batches for mb in self.microbatches(b)]
        self.loss_sums += self._measured(micro, self.p.microbatches)
        self.step_times += [(time.perf_counter() - t0) / len(batches)] * len(batches)

    def _measured(self, micro, per_batch):
        if self.measure_memory:      # live tensor bytes; the rank's state and its microbatches count from the start
            held = [self.params, self.state, self.buffers, self.prev_params,
                    *(dict(vars(st)) for st in self.features.values())]     # what the features hold
            with MemoryTracker(held, inputs=micro) as mem:
                out = self._counted(micro, per_batch)
            self.peak_memory.append((mem.peak_bytes, mem.held_bytes))
            return out
        return self._counted(micro, per_batch)

    def _counted(self, micro, per_batch):
        if not self.measure_comm:
            return self.run_window(micro, per_batch)
        with CommCounter() as counter:
            out = self.run_window(micro, per_batch)
        self.comm_calls.append(counter.calls)
        self.comm_groups.append(counter.groups)
        return out

    def run_window(self, micro: list, per_batch: int | None = None) -> list:
        """Run this rank's actions over ``micro``; loss sums per group of ``per_batch`` microbatches."""
        per_batch = per_batch or len(micro)
        actions = self.p.actions
        previous = self.prev_params if self.p.settings.resumed else None
        w = _Window(micro, len(micro) // per_batch, VersionStore(self.params, actions, previous))
        if not self.p.settings.save_to:
            self.prev_params = {}            # the store holds them while the window reads them, no longer
        w.per_batch = per_batch
        releases = self.p.releases
        for idx, a in enumerate(actions):
            tc, cpu = time.perf_counter(), time.process_time()
            self.handlers[a.kind](a, w, idx)
            for k in releases.get(idx, ()):     # sends the peer is known to have received: wait, let go
                _wait_sends(w.sends.pop(k, ()))
            end = time.perf_counter()
            if self.p.settings.slowdown > 1 and a.is_compute:      # a straggler (ClusterSpec.slowdown)
                end = straggle(self.p.settings.slowdown, end - tc, time.process_time() - cpu)
            if a.is_compute:
                w.busy += end - tc
            key = (a.kind.value, a.stage)
            rec = w.times.setdefault(key, [0.0, 0])
            rec[0] += end - tc
            rec[1] += 1
            w.timeline.append((a.kind.value, a.stage, a.microbatch, tc, end))
        for k in list(w.sends):
            _wait_sends(w.sends.pop(k))
        self.busy.append(w.busy)
        self.action_times.append(w.times)
        self.timelines.append(w.timeline)
        self.peak_versions = {s: max(self.peak_versions.get(s, 0), n) for s, n in w.store.peak.items()}
        self.peak_version_bytes = max(self.peak_version_bytes, w.store.peak_bytes)
        return w.loss_sums

    # ---- handlers ------------------------------------------------------------------------------
    def _forward(self, a, w, idx):
        s, i = a.stage, a.microbatch
        sg = self.p.graphs[s][GraphKind.F]
        mb = w.micro[i]
        weights = self.params[s] if a.version is None else w.store.get(s, a.version)
        acts = {k: v.contiguous() for k, v in w.fwd.pop((s, i), {}).items()}   # as traced (and as received)
        args = [self._input(role, key, s, weights, mb, acts) for role, key in sg.inputs]
        self._forward_outputs(a, w, sg, args, sg.gm(*args), weights)

    def _forward_outputs(self, a, w, sg, args, res, weights):
        """What a forward graph ``sg`` of action ``a`` returned (``res``, from ``args`` on ``weights``): the loss, the
        activations for the next stage, the values saved for the backward, the measurements."""
        s, i = a.stage, a.microbatch
        saved, out = {}, {}
        for (role, key), v in zip(sg.outputs, res):
            if role == Role.LOSS:
                w.loss_sums[i // w.per_batch] += float(v)
            elif role == Role.ACT:
                out[key] = v
            elif role == Role.SAVED:
                saved[key] = v
            elif role == Role.NEW_BUFFER:
                self.buffers[key] = v
        w.saved[(s, i)] = saved
        if s < self.last_stage:
            w.fwd[(s + 1, i)] = out
        cached = w.wptrs.get(s)
        if cached is None or cached[0] is not weights:       # another weight version: look it up once
            cached = w.wptrs[s] = (weights, weight_storages(weights))
        live = w.live.setdefault(s, {})
        live[i] = activation_bytes(list(saved.values()), args, weights, cached[1])
        self.act_peak[s] = max(self.act_peak[s], len(live))
        self.act_peak_bytes[s] = max(self.act_peak_bytes[s], sum(live.values()))
        if self.record_weights:
            self._fingerprint("F", s, i, a.version, list(saved.values()), weights)

    def _backward(self, a, w, idx):
        """B (whole backward), I (input gradients; keeps what W needs) or W (weight gradients)."""
        s, i = a.stage, a.microbatch
        kind = GraphKind(a.kind.value)
        sg = self.p.graphs[s][kind]
        saved = w.saved[(s, i)]
        tangents = w.bwd.get((s, i), {})
        if (s, i) in w.bwd and kind in (GraphKind.B, GraphKind.I):   # as traced (and as received): contiguous
            tangents = w.bwd[(s, i)] = {k: v.contiguous() for k, v in tangents.items()}
        if self.record_weights and kind in (GraphKind.B, GraphKind.I):
            weights = w.store.get(s, a.version) if a.version is not None else self.params[s]
            self._fingerprint("B", s, i, a.version, list(saved.values()), weights,
                              versions_held=len(w.store.versions.get(s, {})))
        args = [saved[key] if role == Role.SAVED else tangents[key] if role not in self.feature_roles
                else self._input(role, key, s, None, None, None) for role, key in sg.inputs]
        res = sg.gm(*args)
        out = {}
        for (role, key), v in zip(sg.outputs, res):
            if role == Role.GRAD:
                self._accumulate(w, key, v)
            elif role == Role.ACT_GRAD:
                out[key] = v
            elif role == Role.SAVED:
                saved[key] = v
        if kind in (GraphKind.B, GraphKind.I) and s > 0:
            w.bwd[(s - 1, i)] = out
        if kind in (GraphKind.B, GraphKind.W):   # the microbatch is done on this stage
            del w.saved[(s, i)]
            w.bwd.pop((s, i), None)
            w.live.get(s, {}).pop(i, None)

    def _accumulate(self, w, key, g):
        """Sum a gradient over microbatches (and the rank's stages sharing the parameter): the first is kept
        as is (no zeros, no add), the second makes a tensor this window owns, later ones add in place."""
        cur = w.acc.get(key)
        if cur is None:
            w.acc[key] = g
        elif key in w.owned:
            cur.add_(g)
        else:
            w.acc[key] = cur + g
            w.owned.add(key)

    def _grad(self, w, s, key):
        if key in w.synced:
            return w.synced[key]
        if key not in w.acc:              # no backward produced it (an unused parameter): zeros
            w.acc[key] = torch.zeros_like(self.params[s][key])
        return w.acc[key]

    def _step_grad(self, w, s, key):
        """The gradient STEP s updates ``key`` with. A parameter this rank shares between stages is reduced by one
        of them (``settings.reduced_by``): its result must exist before another stage steps with it."""
        reducer = self.p.settings.reduced_by.get(s, {}).get(key)
        if reducer is not None and key not in w.synced:
            raise RuntimeError(
                f"rank {self.rank}: STEP{s} needs the reduced gradient of {key!r}, which stage {reducer} reduces for "
                f"this rank (RG{reducer} then STEP{reducer}), but STEP{reducer} has not run yet in this step. In the "
                f"schedule, put RG{reducer} after every backward of the stages sharing {key!r} on this rank, and "
                f"STEP{reducer} before STEP{s}.")
        return self._grad(w, s, key)

    def _reduce_grad(self, a, w, idx):
        s = a.stage
        sg = self.p.graphs[s].get(GraphKind.REDUCE_GRAD)
        if sg is None:
            return
        res = sg.gm(*[self._feature_state(key, s) if role == STATE_ROLE else self._grad(w, s, key)
                      for role, key in sg.inputs])
        pend = w.pending.setdefault(s, {})
        for (role, key), v in zip(sg.outputs, res):
            if role == Role.PENDING:
                pend[key] = v
            elif role == Role.GRAD:
                w.synced[key] = v
            elif role == NEW_STATE_ROLE:
                self._take_feature_state(key, v, s)

    def _step(self, a, w, idx):
        s = a.stage
        sg = self.p.graphs[s][GraphKind.STEP]
        self.step_count[s] += 1
        lr = torch.tensor(float(self.torch_opt.param_groups[0]["lr"]), dtype=torch.float64)
        cnt = torch.tensor(float(self.step_count[s]), dtype=torch.float64)
        pend = w.pending.pop(s, {})
        args = []
        for role, key in sg.inputs:
            if role == Role.PARAM or role in self.feature_roles:
                args.append(self._input(role, key, s, self.params[s], None, None))
            elif role == Role.OPT_STATE:
                args.append(self.state[s][key])
            elif role == Role.BUFFER:
                args.append(self.buffers[key])
            elif role == Role.LR:
                args.append(lr)
            elif role == Role.STEP:
                args.append(cnt)
            elif role == Role.GRAD:
                args.append(self._step_grad(w, s, key))
            elif role == STATE_ROLE:
                args.append(self._feature_state(key, s))
            elif key in pend:
                args.append(pend[key])
            else:
                raise RuntimeError(f"rank {self.rank}: STEP{s} waits on a gradient collective ({key}) that no RG{s} "
                                   f"started in this step: put RG{s} after the stage's last backward and before STEP{s} "
                                   "in the schedule (fxpar.schedule.ensure_reduce_grad adds it).")
        self._note_state_bytes(w, s)
        res = sg.gm(*args)
        new = dict(self.params[s])             # a new version: the old dict may be held by the VersionStore
        for (role, key), v in zip(sg.outputs, res):
            if role == Role.NEW_PARAM:
                new[key] = v
            elif role == Role.NEW_OPT_STATE:
                self.state[s][key] = v
            elif role == Role.GRAD:
                w.synced[key] = v
            elif role == Role.NEW_BUFFER:
                self.buffers[key] = v
            elif role == NEW_STATE_ROLE:
                self._take_feature_state(key, v, s)
        keep = self.p.settings.carried.get(s, 0) if a.version is not None and self.p.settings.save_to else 0
        if keep:                               # the last ``keep`` versions before the newest, for the checkpoint
            self.prev_params[s] = (self.prev_params.get(s, []) + [self.params[s]])[-keep:]
        self.params[s] = new
        if not self.spec.traced:
            self._eager_step(s, {k: self._step_grad(w, s, k) for k in self.p.stage_params[s]})
        self._settle(s)
        if a.version is not None:              # asynchronous: this stage alone, then fresh accumulators
            for k in self.p.stage_params[s]:
                w.acc.pop(k, None)
                w.synced.pop(k, None)
                w.owned.discard(k)
            w.store.created(s, a.version, self.params[s], idx)

    def _full(self, a, w, idx):
        """The fused one-stage step: forward, backward, gradient collectives and update in one graph."""
        s, i = a.stage, a.microbatch
        sg = self.p.graphs[s][GraphKind.FULL]
        self.step_count[s] += 1
        lr = torch.tensor(float(self.torch_opt.param_groups[0]["lr"]), dtype=torch.float64)
        cnt = torch.tensor(float(self.step_count[s]), dtype=torch.float64)
        mb = w.micro[i]
        args = []
        for role, key in sg.inputs:
            if role == Role.OPT_STATE:
                args.append(self.state[s][key])
            elif role == Role.LR:
                args.append(lr)
            elif role == Role.STEP:
                args.append(cnt)
            else:
                args.append(self._input(role, key, s, self.params[s], mb, {}))
        self._note_state_bytes(w, s)
        res = sg.gm(*args)
        grads = {}
        for (role, key), v in zip(sg.outputs, res):
            if role == Role.LOSS:
                w.loss_sums[i // w.per_batch] += float(v)
            elif role == Role.GRAD:
                grads[key] = v
            else:
                self.take_output(s, role, key, v)
        if not self.spec.traced:
            self._eager_step(s, grads)
        self._settle(s)

    def _input(self, role, key, s, weights, mb, acts):
        if role == Role.PARAM:
            return weights[key]
        if role == Role.BUFFER:
            return self.buffers[key]
        if role == Role.INPUT:
            return mb[int(key)]
        if role == Role.TARGET:
            return mb[self.n_inputs + int(key)]
        if role == Role.ACT:
            return acts[key]
        if role == STATE_ROLE:
            return self._feature_state(key, s)
        for st in self.features.values():
            if role in st.input_roles:
                return st.provide_role(self, role, key, s, weights)
        raise RuntimeError(f"stage {s}: no value for graph input ({role}, {key})")

    def take_output(self, s, role, key, v) -> None:
        """A graph output that updates what the rank holds: a parameter, a buffer, optimizer state or a feature's
        state, in place in stage ``s``'s dicts."""
        if role == Role.NEW_PARAM:
            self.params[s][key] = v
        elif role == Role.NEW_BUFFER:
            self.buffers[key] = v
        elif role == Role.NEW_OPT_STATE:
            self.state[s][key] = v
        elif role == NEW_STATE_ROLE:
            self._take_feature_state(key, v, s)

    def _feature_state(self, key, s):
        """Graph input ``("state", "<feature>.<name>")``: from that feature's RankState."""
        feature, name = split_state_key(key)
        if feature not in self.features:
            raise RuntimeError(f"rank {self.rank}: a graph of stage {s} reads state {key!r} of feature {feature!r}, "
                               f"which keeps no state on this rank (features with state: {sorted(self.features)})")
        return self.features[feature].provide(name, s)

    def _take_feature_state(self, key, v, s) -> None:
        """Graph output ``("new_state", "<feature>.<name>")``: back to that feature's RankState."""
        feature, name = split_state_key(key)
        self.features[feature].take(name, v, s)

    def _send(self, a, w, idx):
        s, i = a.stage, a.microbatch
        if a.kind == _K.SEND_F:
            box, order, tag = w.fwd.pop((s + 1, i)), self.p.messages[s]["acts_out"], _tag("F", s + 1)
        else:
            box, order, tag = w.bwd.pop((s - 1, i)), self.p.messages[s]["grads_out"], _tag("B", s - 1)
        peer = a.peer * self.width + self.inner
        for key, _, _ in order:
            t = box[key].contiguous()
            if self.p2p_staged:
                t = t.cpu()
            w.sends.setdefault(idx, []).append((dist.isend(t, peer, tag=tag), t))
            self.comm["sent_bytes"] += t.numel() * t.element_size()
        self.comm["sends"] += 1
        held = sum(t.numel() * t.element_size() for sends in w.sends.values() for _, t in sends)
        self.comm["held_sends"] = max(self.comm["held_sends"], len(w.sends))
        self.comm["held_send_bytes"] = max(self.comm["held_send_bytes"], held)

    def _recv(self, a, w, idx):
        s, i = a.stage, a.microbatch
        fwd = a.kind == _K.RECV_F
        metas = self.p.messages[s]["acts_in" if fwd else "grads_in"]
        on = torch.device("cpu") if self.p2p_staged else self.device        # gloo receives into host memory
        bufs = {key: torch.empty(shape, dtype=dt, device=on) for key, shape, dt in metas}
        peer = a.peer * self.width + self.inner
        works = [dist.irecv(bufs[key], peer, tag=_tag("F" if fwd else "B", s)) for key, _, _ in metas]
        for work in works:
            work.wait()
        if self.p2p_staged:
            bufs = {key: t.to(self.device) for key, t in bufs.items()}
        self.comm["recvs"] += 1
        (w.fwd if fwd else w.bwd)[(s, i)] = bufs

    # ---- an optimizer fxpar does not trace: torch's own, eagerly -------------------------------
    def _eager_step(self, s, grads: dict) -> None:
        keys = self.p.stage_params[s]
        for k in keys:
            leaf = self._leaves[(s, k)]
            with torch.no_grad():
                leaf.copy_(self.params[s][k])
            leaf.grad = grads[k].detach().clone()
        for key, leaf in self._leaves.items():
            if key[0] != s:
                leaf.grad = None                  # torch skips parameters without a gradient
        self.torch_opt.step()
        self.params[s] = dict(self.params[s])
        for k in keys:
            self.params[s][k] = self._leaves[(s, k)].detach().clone()

    # ---- what the rank holds ---------------------------------------------------------------------
    def drain(self) -> None:
        """Collective: each feature finishes what it has in flight (a step's update carried into the next), before
        results, ``state_dict()`` and checkpoints."""
        for st in self.features.values():
            st.drain(self)

    def carried(self) -> dict:
        """Stage -> the ``settings.carried[stage]`` versions before the newest, oldest first, for a checkpoint: the
        weights a resumed window's first forwards read. A stage that stepped fewer times repeats its first version
        (a version before the first is the first, as at the start of a run)."""
        out = {}
        for s, n in self.p.settings.carried.items():
            if s not in self.params or not n:
                continue
            held = self.prev_params.get(s, [])[-n:]
            out[s] = [held[0] if held else self.params[s]] * (n - len(held)) + held
        return out

    def save(self, path) -> None:
        """Collective: write this rank's part of the training state to the checkpoint ``path`` (DCP)."""
        self.drain()
        save_rank_state(self, path, self.p.settings.aliases)

    def load(self, path) -> None:
        """Collective: restore the training state from the checkpoint ``path``, saved under any strategy."""
        self.drain()                    # a step in flight finishes before the state is replaced
        load_rank_state(self, path, self.p.settings.aliases, need_stash=self.p.settings.resumed)

    def collective(self) -> bool:
        """Whether whole tensors come from a collective (a feature's state is spread over ranks): then every rank
        calls ``state_dict()``, ``optimizer_state()`` and ``whole()``."""
        return any(st.collective for st in self.features.values())

    def whole(self) -> tuple:
        """``(params, state)`` per held stage with whole tensors. Collective where a feature's state is: every rank
        calls it."""
        params = {s: dict(ps) for s, ps in self.params.items()}
        state = {s: dict(st) for s, st in self.state.items()}
        for st in self.features.values():                   # the features' own whole tensors
            params, state = st.whole(self, params, state)
        return params, state

    def _settle(self, s: int) -> None:
        """After stage ``s``'s update: the features' own hook (write back files, ...)."""
        for st in self.features.values():
            st.after_update(self, s)

    def _note_state_bytes(self, w, s) -> None:
        """Model-state bytes this rank holds when a step updates (the paper's accounting): parameters, gradient
        accumulators handed to the update (none for a fused step: its gradients live inside the graph), state."""
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)       # noqa: E731
        grads = [w.acc[k] for k in self.p.stage_params[s] if k in w.acc]
        now = {"params": nbytes(v for ps in self.params.values() for v in ps.values()), "grads": nbytes(grads),
               "optimizer": nbytes(v for st in self.state.values() for v in st.values())}
        self.state_bytes = {**self.state_bytes, **{k: max(v, self.state_bytes.get(k, 0)) for k, v in now.items()}}

    def state_dict(self) -> dict:
        """Parameters of the stages this rank is the first holder of, and the buffers (whole tensors; collective
        where a feature's state is: every rank calls it)."""
        params = self.whole()[0] if self.features else self.params
        out = {}
        for s in sorted(params):
            if self.p.stage_to_rank[s][0] != self.pipe_rank:
                continue
            for k, v in params[s].items():
                out.setdefault(k, v)
        out.update(self.own_buffers())
        return out

    def own_buffers(self) -> dict:
        """The buffers of the stages this rank is the first holder of: a stage's forward may update them (BatchNorm's
        running statistics), and another pipeline rank holds only their initial values."""
        return {k: v for k, v in self.buffers.items() if k not in self.p.foreign_buffers}

    def optimizer_state(self) -> dict:
        """Optimizer state of the stages this rank holds under ``<state>:<key>``, traced or untraced (torch's
        per-parameter state: ``"sum:fc1.weight"``), whole tensors; collective where a feature's state is."""
        if self.spec.traced:
            state = self.whole()[1] if self.features else self.state
            return {k: v for st in state.values() for k, v in st.items()}
        return eager_optimizer_state(self)

    def _fingerprint(self, kind: str, s: int, i: int, version, saved, weights: dict, versions_held=None):
        """Log which weights an F or B of stage s, microbatch i computes with. ``saved``: the forward's saved
        tensors (what the backward reads); ``weights``: the version the action names (the store's tensors).

        ``saved_digest`` hashes the bytes of the saved tensors that are weights or views of them (found by
        storage); ``digest`` hashes those weights' whole tensors in ``weights``, ``newest`` the stage's newest
        weights under the same keys; ``same_storage`` says the saved views sit on ``weights``' storages."""
        by_ptr = {t.untyped_storage().data_ptr(): k for k, t in weights.items()}
        views = {j: by_ptr[t.untyped_storage().data_ptr()] for j, t in enumerate(saved)
                 if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in by_ptr}
        keys = sorted(set(views.values()))
        self.weight_log.append({
            "kind": kind, "stage": s, "mb": i, "version": version, "keys": keys,
            "saved_digest": digest({f"{j}:{k}": saved[j] for j, k in views.items()}),
            "digest": digest({k: weights[k] for k in keys}),
            "newest": digest({k: self.params[s][k] for k in keys}),
            "same_storage": bool(views), "steps": self.step_count[s], "versions_held": versions_held})


def train(payload: RankPayload, batches: list) -> dict:
    """Worker entry: run every step; return loss sums, times, measurements and (dp index 0) the state."""
    note_step("before")        # where this rank is, for the launcher's report if it fails or dies
    ex = Executor(payload)
    if payload.settings.resume_from:
        ex.load(payload.settings.resume_from)
    if payload.settings.asynchronous:
        note_step("window")    # one window over every batch: no step boundary to name
        ex.run_async(batches)
    else:
        for i, b in enumerate(batches):
            note_step(i)
            ex.step(b)
        note_step("after")
        ex.drain()             # what the features hold in flight, before results and checkpoints
    out = {"loss_sums": ex.loss_sums, "step_times": ex.step_times, "comm": ex.comm, "busy": ex.busy,
           "comm_calls": ex.comm_calls, "comm_groups": ex.comm_groups, "peak_versions": ex.peak_versions,
           "peak_version_bytes": ex.peak_version_bytes, "act_peak": ex.act_peak,
           "act_peak_bytes": ex.act_peak_bytes, "action_times": ex.action_times,
           "weight_log": ex.weight_log, "timelines": ex.timelines}
    out["state_bytes"] = {"on_disk": 0, **ex.state_bytes}
    reports = {name: st.report() for name, st in ex.features.items()}
    out["features"] = {name: r for name, r in reports.items() if r is not None}
    out["peak_memory"] = ex.peak_memory
    if payload.settings.save_to:
        ex.save(payload.settings.save_to)
    collective = ex.collective()
    state = ex.state_dict() if ex.dp_index == 0 or collective else None
    if ex.dp_index == 0:
        out["state"] = state
    first = ex.dp_index == 0 and ex.tp_index == 0        # one rank per pipeline rank returns its stages' state
    opt = ex.optimizer_state() if first or collective else None     # collective over a feature's group
    if first:
        out["optimizer_state"] = opt
    return out
