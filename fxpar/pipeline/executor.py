"""The pipeline runtime: one rank runs its action list with point-to-point sends over gloo.

Semantics are those of :mod:`fxpar.schedule.simulate`: actions run strictly in list order; a SEND
posts ``isend`` and goes on (every outstanding send is waited for at the end of the step); a RECV
posts ``irecv`` and blocks until the tensors are there. A message of a boundary is several tensors,
sent back to back on one tag per (direction, consuming stage), so the n-th send of a channel meets
the n-th receive, as the schedule validator checks.

Mesh: ``pp × dp``, global rank = pipeline rank · dp + dp index. Each pipeline replica (one dp
index) runs the schedule on its share of the global batch, cut into m microbatches; the last
stage seeds each microbatch's backward with 1/(m·dp), so the summed gradients are those of the
global-batch mean loss. Before the first STEP of a step, gradients are summed over dp (one
all-reduce per stage, flattened) and a parameter used by several stages (a tied embedding) gets
the sum of their gradients (an all-reduce over the ranks holding those stages; one replica of each
stage contributes). ``SYNC s`` sums stage s's gradients over its replicas (Chimera).

Besides the math each rank measures, per window: per stage the most microbatches whose saved tensors are
alive at once and their bytes (``act_peak``, ``act_peak_bytes``; see :func:`.tracking.activation_bytes`),
the seconds of every action (``action_times``, ``timelines``) and, with ``extra['record_weights']``, a
fingerprint of the weights every F and B computes with (``weight_log``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..runtime.executor import _group, seed_rank
from ..schedule import ActionKind
from .tracking import VersionStore, activation_bytes, digest, weight_storages

__all__ = ["PipelinePayload", "PipelineExecutor", "VersionStore"]

_K = ActionKind


@dataclass
class PipelinePayload:
    """What one rank needs, picklable."""
    rank: int
    dp: int
    pp: int
    actions: list                  # this pipeline rank's Actions
    stage_to_rank: dict            # stage -> pipeline ranks holding it
    n_stages: int
    microbatches: int
    stages: dict                   # stage -> fxpar.pipeline.autodiff.StageProgram (held stages only)
    params: dict                   # key -> initial tensor (the held stages' parameters)
    buffers: dict
    optimizer: object              # OptimizerSpec
    shared: dict                   # param key -> stages using it (only those with > 1)
    groups: list                   # every process group of the program, in creation order
    lr_scheduler: object = None
    extra: dict = field(default_factory=dict)


def _tag(channel: str, consumer_stage: int) -> int:
    return 2 * consumer_stage + (0 if channel == "F" else 1)


class PipelineExecutor:
    def __init__(self, p: PipelinePayload):
        self.p = p
        self.rank = p.rank
        self.pipe_rank, self.dp_index = divmod(p.rank, p.dp)
        seed_rank(p.extra, p.rank)
        if dist.is_initialized():
            for ranks in p.groups:            # every rank creates every group, in one order
                _group(ranks)
        self.params = {s: {k: p.params[k].detach().clone() for k in sp.param_keys} for s, sp in p.stages.items()}
        spec = p.optimizer
        self.spec = spec
        self.state = {s: {k: spec.init_state(v) for k, v in ps.items()} for s, ps in self.params.items()}
        self._leaves = {(s, k): torch.nn.Parameter(v.clone()) for s, ps in self.params.items() for k, v in ps.items()}
        self.torch_opt = spec.make_torch_optimizer(list(self._leaves.values()))
        self.scheduler = p.lr_scheduler(self.torch_opt) if p.lr_scheduler else None
        self.step_count = {s: 0 for s in p.stages}
        self.loss_sums, self.step_times, self.comm = [], [], {"sent_bytes": 0, "sends": 0, "recvs": 0}
        self.peak_versions: dict = {}
        self.peak_version_bytes = 0
        self.busy: list = []             # seconds of F/B compute per window
        # measured activation memory per stage: most microbatches whose saved tensors were alive at once,
        # and most bytes those saved tensors held (weights excluded, each storage counted once)
        self.act_peak = {s: 0 for s in p.stages}
        self.act_peak_bytes = {s: 0 for s in p.stages}
        self.action_times: list = []     # per window: (kind, stage) -> [total seconds, count]
        self._times: dict = {}
        self.timelines: list = []        # per window: (kind, stage, microbatch, start, end), perf_counter seconds
        self.record_weights = bool(p.extra.get("record_weights"))
        self._in_place = self._in_place_steps(p.actions)
        self.weight_log: list = []       # with record_weights: one entry per F and B, see _fingerprint

    @staticmethod
    def _in_place_steps(actions: list) -> dict:
        """stage -> True where its STEPs may update weights in place: synchronous STEPs (no version) that
        come after every F and B of the stage in the action list, so no saved tensor still needs the old
        weights. Weight-stashing schedules keep the functional update: their stashed versions are the old
        tensors."""
        steps = [i for i, a in enumerate(actions) if a.kind == _K.STEP]
        if any(actions[i].version is not None for i in steps):
            return {}
        first_step = {}
        for i in steps:
            first_step.setdefault(actions[i].stage, i)
        last_use = {}
        for i, a in enumerate(actions):
            if a.kind in (_K.F, _K.B):
                last_use[a.stage] = i
        return {st: last_use.get(st, -1) < i for st, i in first_step.items()}

    def _global(self, pipe_rank: int) -> int:
        return pipe_rank * self.p.dp + self.dp_index

    # ---- one training step --------------------------------------------------------------------
    def microbatches(self, batch) -> list:
        m, dp = self.p.microbatches, self.p.dp
        out = []
        for t in batch:
            n = t.shape[0] // dp
            if t.shape[0] % dp or n % m:
                raise ValueError(f"a batch of {t.shape[0]} does not split into dp={dp} x microbatches={m} equal parts")
            out.append(t.narrow(0, self.dp_index * n, n).split(n // m))
        return [tuple(parts[i] for parts in out) for i in range(m)]

    def step(self, batch) -> float:
        """One synchronous training step on one global batch; returns this rank's sum of microbatch losses."""
        t0 = time.perf_counter()
        loss = self.run_window(self.microbatches(batch), self.p.actions)[0]
        if self.scheduler is not None:
            self.scheduler.step()
        self.loss_sums.append(loss)
        self.step_times.append(time.perf_counter() - t0)
        return loss

    def run_async(self, batches: list) -> None:
        """An asynchronous schedule: one window over every microbatch of every batch, no flush between."""
        t0 = time.perf_counter()
        micro = [mb for b in batches for mb in self.microbatches(b)]
        sums = self.run_window(micro, self.p.actions, per_batch=self.p.microbatches)
        self.loss_sums += sums
        self.step_times += [(time.perf_counter() - t0) / len(batches)] * len(batches)

    def run_window(self, micro: list, actions: list, per_batch: int | None = None) -> list:
        """Run ``actions`` over microbatches ``micro``; loss sums per group of ``per_batch`` microbatches."""
        p = self.p
        seed = torch.tensor(p.extra.get("seed", 1.0 / (p.microbatches * p.dp)), dtype=torch.float64)
        fwd_msg, bwd_msg, saved, sends = {}, {}, {}, []
        # gradient accumulators, filled by the backwards: the first microbatch's gradient is kept as is
        # (no zeros, no add), the second makes a tensor this loop owns, later ones add into it in place
        grads = {s: {} for s in self.params}
        owned: set = set()
        per_batch = per_batch or len(micro)
        loss_sums = [0.0] * (len(micro) // per_batch)
        synced = False
        store = VersionStore(self.params, actions)
        live = {s: {} for s in p.stages}          # stage -> {microbatch: bytes of its saved activations}
        wptrs: dict = {}                          # stage -> (the weights dict last used, its storage addresses)
        self._times, timeline = {}, []
        busy = 0.0
        for idx, a in enumerate(actions):
            s, i = a.stage, a.microbatch
            tc = time.perf_counter()
            if a.kind == _K.F:
                sp = p.stages[s]
                acts = iter(fwd_msg.pop((s, i), ()))
                weights = self.params[s] if a.version is None else store.get(s, a.version)
                args = [weights[key] if role == "param" else self._input(sp, role, key, s, micro[i], acts)
                        for role, key in sp.inputs]
                res = sp.forward(*args)
                n_out = len(sp.outputs)
                saved[(s, i)] = res[n_out:]      # holds the weights the backward needs: weight stashing
                cached = wptrs.get(s)
                if cached is None or cached[0] is not weights:     # another weight version: look it up once
                    cached = wptrs[s] = (weights, weight_storages(weights))
                live[s][i] = activation_bytes(res[n_out:], args, weights, cached[1])
                self.act_peak[s] = max(self.act_peak[s], len(live[s]))
                self.act_peak_bytes[s] = max(self.act_peak_bytes[s], sum(live[s].values()))
                if self.record_weights:
                    self._fingerprint("F", s, i, a.version, res[n_out:], weights)
                if s == p.n_stages - 1:
                    loss_sums[i // per_batch] += float(res[0])
                else:
                    fwd_msg[(s + 1, i)] = list(res[:n_out])
            elif a.kind == _K.B:
                sp = p.stages[s]
                tangents = [seed.to(sp.output_meta[0][1])] if s == p.n_stages - 1 else bwd_msg.pop((s, i))
                held = saved.pop((s, i))
                if self.record_weights:        # the weights this B differentiates through: those its F saved
                    self._fingerprint("B", s, i, a.version, held, store.get(s, a.version) if a.version is not None
                                      else self.params[s], versions_held=len(store.versions.get(s, {})))
                res = sp.backward(*held, *tangents)
                del live[s][i]
                act_grads = []
                for j, g in zip(sp.diff_inputs, res):
                    role, key = sp.inputs[j]
                    if role == "param":
                        cur = grads[s].get(key)
                        if cur is None:
                            grads[s][key] = g              # not ours: never written to
                        elif (s, key) in owned:
                            cur.add_(g)
                        else:
                            grads[s][key] = cur + g
                            owned.add((s, key))
                    else:
                        act_grads.append(g)
                if s > 0:
                    bwd_msg[(s - 1, i)] = act_grads
            if a.kind in (_K.F, _K.B):       # (computed above) count its time; the other kinds follow
                busy += time.perf_counter() - tc
                self._timed(a, tc)
            elif a.kind in (_K.SEND_F, _K.SEND_B):
                key = (s + 1, i) if a.kind == _K.SEND_F else (s - 1, i)
                box = fwd_msg if a.kind == _K.SEND_F else bwd_msg
                tag = _tag("F" if a.kind == _K.SEND_F else "B", key[0])
                for t in box.pop(key):
                    t = t.contiguous()
                    sends.append((dist.isend(t, self._global(a.peer), tag=tag), t))
                    self.comm["sent_bytes"] += t.numel() * t.element_size()
                self.comm["sends"] += 1
                self._timed(a, tc)
            elif a.kind in (_K.RECV_F, _K.RECV_B):
                self._recv(a, fwd_msg, bwd_msg)
                self._timed(a, tc)
            elif a.kind == _K.SYNC:
                self._complete(grads, s)
                self._all_reduce_stage(grads, s, tuple(self._global(r) for r in p.stage_to_rank[s]))
                self._timed(a, tc)
            elif a.kind == _K.STEP:
                if a.version is not None:          # asynchronous: this stage alone, then a fresh accumulator
                    self._complete(grads, s)
                    if p.dp > 1:
                        self._all_reduce_stage(grads, s, tuple(self.pipe_rank * p.dp + d for d in range(p.dp)))
                    self._step_stage(s, grads[s])
                    grads[s] = {}
                    owned = {o for o in owned if o[0] != s}
                    store.created(s, a.version, self.params[s], idx)
                    self._timed(a, tc)
                    timeline.append((a.kind.value, s, i, tc, time.perf_counter()))
                    continue
                if not synced:
                    for st in grads:
                        self._complete(grads, st)
                    self._sync_before_step(grads)
                    self._timed(("allreduce", -1), tc)      # dp and tied-weight all-reduces, timed apart
                    tc = time.perf_counter()
                    synced = True
                self._step_stage(s, grads[s], in_place=self._in_place.get(s, False))
                self._timed(a, tc)
            else:
                raise NotImplementedError(f"action {a} ({a.kind.name}) is not run by this executor")
            timeline.append((a.kind.value, s, i, tc, time.perf_counter()))
        for w, _ in sends:
            w.wait()
        self.busy.append(busy)
        self.action_times.append(self._times)
        self.timelines.append(timeline)
        self.peak_versions = {s: max(self.peak_versions.get(s, 0), n) for s, n in store.peak.items()}
        self.peak_version_bytes = max(self.peak_version_bytes, store.peak_bytes)
        return loss_sums

    def _complete(self, grads, s) -> None:
        """Zeros for the parameters of stage s no backward gave a gradient, in the stage's key order."""
        have = grads[s]
        grads[s] = {k: have[k] if k in have else torch.zeros_like(v) for k, v in self.params[s].items()}

    def _timed(self, a, t0: float) -> None:
        key = a if isinstance(a, tuple) else (a.kind.value, a.stage)
        rec = self._times.setdefault(key, [0.0, 0])
        rec[0] += time.perf_counter() - t0
        rec[1] += 1

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

    def _input(self, sp, role, key, s, mb, acts):
        if role == "param":
            return self.params[s][key]
        if role == "buffer":
            return self.p.buffers[key]
        if role == "input":
            return mb[int(key)]
        if role == "target":
            return mb[self.p.extra["n_inputs"] + int(key)]
        return next(acts)

    def _recv(self, a, fwd_msg, bwd_msg):
        p = self.p
        s, i = a.stage, a.microbatch
        sp = p.stages[s]
        if a.kind == _K.RECV_F:
            metas = [sp.input_meta[j] for j, (r, _) in enumerate(sp.inputs) if r == "act"]
        else:
            metas = [sp.output_meta[j] for j in sp.diff_outputs]
        bufs = [torch.empty(shape, dtype=dt) for shape, dt in metas]
        tag = _tag("F" if a.kind == _K.RECV_F else "B", s)
        works = [dist.irecv(b, self._global(a.peer), tag=tag) for b in bufs]
        for w in works:
            w.wait()
        self.comm["recvs"] += 1
        (fwd_msg if a.kind == _K.RECV_F else bwd_msg)[(s, i)] = bufs

    # ---- gradient synchronisation and the update ---------------------------------------------
    def _all_reduce_stage(self, grads, s, ranks):
        if len(ranks) < 2:
            return
        keys = list(self.params[s])             # one order on every rank
        flat = torch.cat([grads[s][k].reshape(-1) for k in keys])
        dist.all_reduce(flat, group=_group(tuple(sorted(ranks))))
        off = 0
        for k in keys:
            n = grads[s][k].numel()
            grads[s][k] = flat[off:off + n].view_as(grads[s][k])
            off += n

    def _sync_before_step(self, grads):
        p = self.p
        if p.dp > 1:
            for s in sorted(grads):
                self._all_reduce_stage(grads, s, tuple(self.pipe_rank * p.dp + d for d in range(p.dp)))
        for key in sorted(p.shared):
            stages = p.shared[key]
            holders = sorted({r for s in stages for r in p.stage_to_rank[s]})
            mine = [s for s in stages if s in grads]
            if not mine:
                continue
            # one replica of each stage contributes: the first rank listed for it
            total = sum((grads[s][key] for s in mine if p.stage_to_rank[s][0] == self.pipe_rank),
                        torch.zeros_like(grads[mine[0]][key]))
            if len(holders) > 1:
                dist.all_reduce(total, group=_group(tuple(self._global(r) for r in holders)))
            for s in mine:
                grads[s][key] = total

    def _step_stage(self, s, g, in_place: bool = False):
        sp = self.p.stages[s]
        self.step_count[s] += 1
        keys = sp.param_keys
        if sp.step is not None:
            lr = torch.tensor(float(self.torch_opt.param_groups[0]["lr"]), dtype=torch.float64)
            cnt = torch.tensor(float(self.step_count[s]), dtype=torch.float64)
            st = [x for k in keys for x in self.state[s][k]]
            # in place (the update written into the parameter and moment buffers, as torch.optim does) only
            # where nothing holds the old weights: synchronous schedules, whose backwards all ran before
            fn = sp.step_inplace if in_place and sp.step_inplace is not None else sp.step
            out = fn(*[self.params[s][k] for k in keys], *[g[k] for k in keys], *st, lr, cnt)
            n, ns = len(keys), len(self.spec.state_names)
            self.params[s] = dict(self.params[s])    # a new version: the old dict may be held by the VersionStore
            for j, k in enumerate(keys):
                self.params[s][k] = out[j]
                self.state[s][k] = list(out[n + j * ns:n + (j + 1) * ns])
            return
        for k in keys:                       # an optimizer fxpar does not trace: torch's own, eagerly
            leaf = self._leaves[(s, k)]
            with torch.no_grad():
                leaf.copy_(self.params[s][k])
            leaf.grad = g[k].detach().clone()
        others = [(key, leaf) for key, leaf in self._leaves.items() if key[0] != s]
        for _, leaf in others:
            leaf.grad = None                  # torch skips parameters without a gradient
        self.torch_opt.step()
        self.params[s] = dict(self.params[s])
        for k in keys:
            self.params[s][k] = self._leaves[(s, k)].detach().clone()

    def state_dict(self) -> dict:
        out = {}
        for s in sorted(self.params):
            if self.p.stage_to_rank[s][0] != self.pipe_rank:
                continue
            for k, v in self.params[s].items():
                out.setdefault(k, v)
        return out


def train(payload: PipelinePayload, batches: list) -> dict:
    """Worker entry: run every step, return loss sums, times and (dp index 0) the stages' parameters."""
    ex = PipelineExecutor(payload)
    if payload.extra.get("asynchronous"):
        ex.run_async(batches)
    else:
        for b in batches:
            ex.step(b)
    out = {"loss_sums": ex.loss_sums, "step_times": ex.step_times, "comm": ex.comm, "busy": ex.busy,
           "peak_versions": ex.peak_versions, "peak_version_bytes": ex.peak_version_bytes,
           "act_peak": ex.act_peak, "act_peak_bytes": ex.act_peak_bytes, "action_times": ex.action_times,
           "weight_log": ex.weight_log, "timelines": ex.timelines}
    if ex.dp_index == 0:
        out["state"] = ex.state_dict()
    return out
