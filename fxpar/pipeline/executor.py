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
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..runtime.executor import _group
from ..schedule import ActionKind

__all__ = ["PipelinePayload", "PipelineExecutor"]

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
        t0 = time.perf_counter()
        p = self.p
        micro = self.microbatches(batch)
        seed = torch.tensor(1.0 / (p.microbatches * p.dp), dtype=torch.float64)
        fwd_msg, bwd_msg, saved, sends = {}, {}, {}, []
        grads = {s: {k: torch.zeros_like(v) for k, v in ps.items()} for s, ps in self.params.items()}
        loss_sum, synced = 0.0, False
        for a in p.actions:
            s, i = a.stage, a.microbatch
            if a.kind == _K.F:
                sp = p.stages[s]
                acts = iter(fwd_msg.pop((s, i), ()))
                args = [self._input(sp, role, key, s, micro[i], acts) for role, key in sp.inputs]
                res = sp.forward(*args)
                n_out = len(sp.outputs)
                saved[(s, i)] = res[n_out:]
                if s == p.n_stages - 1:
                    loss_sum += float(res[0])
                else:
                    fwd_msg[(s + 1, i)] = list(res[:n_out])
            elif a.kind == _K.B:
                sp = p.stages[s]
                tangents = [seed.to(sp.output_meta[0][1])] if s == p.n_stages - 1 else bwd_msg.pop((s, i))
                res = sp.backward(*saved.pop((s, i)), *tangents)
                act_grads = []
                for j, g in zip(sp.diff_inputs, res):
                    role, key = sp.inputs[j]
                    if role == "param":
                        grads[s][key] = grads[s][key] + g
                    else:
                        act_grads.append(g)
                if s > 0:
                    bwd_msg[(s - 1, i)] = act_grads
            elif a.kind in (_K.SEND_F, _K.SEND_B):
                key = (s + 1, i) if a.kind == _K.SEND_F else (s - 1, i)
                box = fwd_msg if a.kind == _K.SEND_F else bwd_msg
                tag = _tag("F" if a.kind == _K.SEND_F else "B", key[0])
                for t in box.pop(key):
                    t = t.contiguous()
                    sends.append((dist.isend(t, self._global(a.peer), tag=tag), t))
                    self.comm["sent_bytes"] += t.numel() * t.element_size()
                self.comm["sends"] += 1
            elif a.kind in (_K.RECV_F, _K.RECV_B):
                self._recv(a, fwd_msg, bwd_msg)
            elif a.kind == _K.SYNC:
                self._all_reduce_stage(grads, s, tuple(self._global(r) for r in p.stage_to_rank[s]))
            elif a.kind == _K.STEP:
                if not synced:
                    self._sync_before_step(grads)
                    synced = True
                self._step_stage(s, grads[s])
            else:
                raise NotImplementedError(f"action {a} ({a.kind.name}) is not run by this executor")
        for w, _ in sends:
            w.wait()
        if self.scheduler is not None:
            self.scheduler.step()
        self.loss_sums.append(loss_sum)
        self.step_times.append(time.perf_counter() - t0)
        return loss_sum

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
        keys = list(grads[s])
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

    def _step_stage(self, s, g):
        sp = self.p.stages[s]
        self.step_count[s] += 1
        keys = sp.param_keys
        if sp.step is not None:
            lr = torch.tensor(float(self.torch_opt.param_groups[0]["lr"]), dtype=torch.float64)
            cnt = torch.tensor(float(self.step_count[s]), dtype=torch.float64)
            st = [x for k in keys for x in self.state[s][k]]
            out = sp.step(*[self.params[s][k] for k in keys], *[g[k] for k in keys], *st, lr, cnt)
            n, ns = len(keys), len(self.spec.state_names)
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
    for b in batches:
        ex.step(b)
    out = {"loss_sums": ex.loss_sums, "step_times": ex.step_times, "comm": ex.comm}
    if ex.dp_index == 0:
        out["state"] = ex.state_dict()
    return out
