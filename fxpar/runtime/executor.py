"""The per-rank executor: holds a rank's state and runs its step graph on its batch shard.

The graph names process groups by mesh axis (``"fxpar:dp"``); :func:`bind_groups` creates every
group of every axis (all ranks create them in the same order, as torch.distributed requires)
and rewrites the names to this rank's groups.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx

from ..collectives import axis_of_tag

__all__ = ["RankPayload", "StepExecutor", "bind_groups", "make_scheduler", "seed_rank"]

_GROUPS: dict = {}   # ranks tuple -> ProcessGroup, per process (reused across programs)


@dataclass
class RankPayload:
    """Everything one rank needs, picklable: sent to spawned workers or built in place under torchrun."""
    rank: int
    gm: torch.fx.GraphModule
    signature: object
    mesh_axes: list
    batch_dim: int
    params: dict                  # key -> tensor (this rank's initial values)
    buffers: dict
    optimizer: object             # fxpar.optim.OptimizerSpec
    lr_scheduler: object = None   # (SchedulerClass, kwargs), callable(torch optimizer) -> scheduler, or None
    extra: dict = field(default_factory=dict)

    # the graph travels node by node: GraphModule's own pickling re-traces it (see .portable)
    def __getstate__(self):
        from .portable import pack_graph_module
        state = dict(self.__dict__)
        state["gm"] = pack_graph_module(self.gm)
        return state

    def __setstate__(self, state):
        from .portable import unpack_graph_module
        state = dict(state)
        state["gm"] = unpack_graph_module(state["gm"])
        self.__dict__.update(state)


def _group(ranks: tuple):
    ranks = tuple(ranks)
    if ranks not in _GROUPS:
        if len(ranks) == dist.get_world_size() and ranks == tuple(range(dist.get_world_size())):
            _GROUPS[ranks] = dist.group.WORLD
        else:
            _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


def bind_groups(gm: torch.fx.GraphModule, mesh, rank: int) -> torch.fx.GraphModule:
    """Create the mesh's process groups and point each collective at this rank's group."""
    names = {}
    for axis in mesh.names:
        for ranks in mesh.groups(axis):       # every rank creates every group, in one order
            pg = _group(ranks)
            if rank in ranks:
                names[axis] = pg.group_name
    changed = False
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        args = list(n.args)
        for i, a in enumerate(args):
            axis = axis_of_tag(a)
            if axis is not None:
                if axis not in names:
                    raise RuntimeError(f"node {n.name} names mesh axis '{axis}', which the mesh {mesh} does not have")
                args[i] = names[axis]
                changed = True
        n.args = tuple(args)
    if changed:
        gm.recompile()
    return gm


def seed_rank(extra: dict, rank: int) -> None:
    """``extra["rng_seed"]`` set: seed torch's generator with it + rank, so random ops (dropout) are
    reproducible and differ between ranks. None: leave the generator as the process has it."""
    if extra.get("rng_seed") is not None:
        torch.manual_seed(int(extra["rng_seed"]) + rank)


def make_scheduler(spec, optimizer):
    """``(SchedulerClass, kwargs)`` or ``callable(optimizer) -> scheduler`` or None."""
    if spec is None:
        return None
    if isinstance(spec, tuple):
        cls, kwargs = spec
        return cls(optimizer, **kwargs)
    return spec(optimizer)


class StepExecutor:
    """Runs one rank's training steps. ``step(global_batch)`` returns this rank's loss."""

    def __init__(self, payload: RankPayload):
        from ..mesh import Mesh
        self.p = payload
        self.rank = payload.rank
        seed_rank(payload.extra, self.rank)
        self.mesh = Mesh(tuple((n, int(s)) for n, s in payload.mesh_axes))
        self.gm = bind_groups(payload.gm, self.mesh, self.rank) if dist.is_initialized() else payload.gm
        sig = payload.signature
        self.sig = sig
        self.params = {k: payload.params[k].detach().clone() for k in sig.keys("param")}
        self.buffers = {k: payload.buffers[k].detach().clone() for k in sig.keys("buffer")}
        spec = payload.optimizer
        self.spec = spec
        self._leaves = {k: torch.nn.Parameter(v, requires_grad=True) for k, v in self.params.items()}
        self.torch_opt = spec.make_torch_optimizer(list(self._leaves.values()))
        self.scheduler = make_scheduler(payload.lr_scheduler, self.torch_opt)
        self.state = {k: torch.zeros_like(self.params[k.split(":", 1)[1]]) for k in sig.keys("opt_state")}
        self.step_count = 0
        coords = self.mesh.coords(self.rank)
        self.dp_index, self.dp = coords.get("dp", 0), self.mesh.axis_size("dp")
        self.losses, self.step_times = [], []
        self.measure_comm = bool(payload.extra.get("measure_comm"))
        self.comm_calls: list = []          # per step: [(kind, bytes handed to the collective), ...]

    def shard(self, batch) -> list:
        batch = batch if isinstance(batch, (tuple, list)) else (batch,)
        out = []
        for t in batch:
            n = t.shape[self.p.batch_dim] // self.dp
            out.append(t.narrow(self.p.batch_dim, self.dp_index * n, n))
        return out

    def step(self, batch) -> float:
        t0 = time.perf_counter()
        self.step_count += 1
        lr = torch.tensor(float(self.torch_opt.param_groups[0]["lr"]), dtype=torch.float64)
        step_t = torch.tensor(float(self.step_count), dtype=torch.float64)
        args = []
        for role, key in self.sig.inputs:
            if role == "param":
                args.append(self.params[key])
            elif role == "buffer":
                args.append(self.buffers[key])
            elif role == "opt_state":
                args.append(self.state[key])
            elif role == "lr":
                args.append(lr)
            elif role == "step":
                args.append(step_t)
        args += self.shard(batch)
        if self.measure_comm:
            from .measure import CommCounter
            with CommCounter() as counter:
                outs = self.gm(*args)
            self.comm_calls.append(counter.calls)
        else:
            outs = self.gm(*args)
        loss, grads = None, {}
        for (role, key), v in zip(self.sig.outputs, outs):
            if role == "loss":
                loss = v
            elif role == "new_param":
                self.params[key] = v
            elif role == "new_buffer":
                self.buffers[key] = v
            elif role == "new_opt_state":
                self.state[key] = v
            elif role == "grad":
                grads[key] = v
        if not self.spec.traced:
            self._eager_step(grads)
        if self.scheduler is not None:
            self.scheduler.step()
        loss_f = float(loss)
        self.losses.append(loss_f)
        self.step_times.append(time.perf_counter() - t0)
        return loss_f

    def _eager_step(self, grads: dict) -> None:
        """An optimizer fxpar does not trace: run torch's own on this rank's (synchronised) grads."""
        for k, leaf in self._leaves.items():
            with torch.no_grad():
                leaf.copy_(self.params[k])
            leaf.grad = grads[k].detach().clone()
        self.torch_opt.step()
        for k, leaf in self._leaves.items():
            self.params[k] = leaf.detach().clone()

    def state_dict(self) -> dict:
        return {**self.params, **self.buffers}

    def optimizer_state(self) -> dict:
        if self.spec.traced:
            return dict(self.state)
        return self.torch_opt.state_dict()
