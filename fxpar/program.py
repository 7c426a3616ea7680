"""Program: what ``parallelize`` returns, for every strategy. The plan, the schedule, each stage's
graphs and their history, the cost models' estimate, and ways to run (``run_local``, ``runner``)."""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch

from . import inputs
from . import meta as M
from .collectives import collective_nodes
from .runtime.executor import Executor, RankPayload, train
from .runtime.settings import RunSettings
from .errors import InputError
from .feature import ExtraRank, Feature, get_feature, registered_features
from .host import HostSettings
from .runtime.launch import LocalCluster, check_local_capacity, check_main_guard, init_from_env
from .portable import pack_graph_module, packing_once, unpack_graph_module
from .runner import RankRunner, RunResult
from .roles import GraphKind, Role
from .schedule import Action, ActionKind, carried_versions
from .schedule.sends import send_releases, sent_until
from .sharding import ShardingMap
from .explain import explain_program
from .planner import build_schedule, check_batch
from .runtime.checkpoint import CheckpointError, incomplete_message, is_complete
from .errors import StrategyError
import cost_models
from cost_models import Item
from cost_models.compute import eager_step_compute, inner_time

__all__ = ["Program", "RunResult", "RankRunner", "Stage", "ActionList"]

_K = ActionKind
_NONFINITE = ("warn", "raise", "ignore")


@dataclass
class Stage:
    """One stage of a program: its captured joint step, its graphs after lowering, and what it sends."""
    index: int
    captured: object               # fxpar.capture.CapturedStep
    graphs: dict                   # kind -> passes.split_graphs.SplitGraph
    joint: torch.fx.GraphModule    # the joint graph after every pass, before the cut
    history: list
    notes: list
    messages: dict                 # "acts_in"/"acts_out"/"grads_in"/"grads_out" -> [(key, shape, dtype)]

    @property
    def param_keys(self) -> list:
        return list(self.captured.param_names)

    @property
    def saved_bytes(self) -> int:
        """Activation bytes one microbatch's ``F`` keeps for its backward (predicted from the graph), weights and
        what is made from the weights alone excluded, each storage counted once (a view keeps its base alive):
        what the runtime measures in ``RunResult.peak_activation_bytes`` per microbatch in flight."""
        sg = self.graphs.get(GraphKind.F)
        if sg is None:
            return 0
        g = sg.gm.graph
        weight_made = {ph for ph, (r, _) in zip(g.find_nodes(op="placeholder"), sg.inputs) if r == Role.PARAM}
        for n in g.nodes:
            if n.op == "call_function" and n.all_input_nodes and all(a in weight_made for a in n.all_input_nodes):
                weight_made.add(n)
        storages = {}
        for n, (role, _) in zip(g.find_nodes(op="output")[0].args[0], sg.outputs):
            v = n.meta.get("val")
            if role == Role.SAVED and n not in weight_made and isinstance(v, torch.Tensor):
                st = v.untyped_storage()
                storages[st._cdata] = int(st.nbytes())
        return sum(storages.values())

    # graphs travel node by node (torch.fx's own pickling re-traces them, running their collectives)
    def __getstate__(self):
        import copy as _copy
        state = dict(self.__dict__)
        state["joint"] = pack_graph_module(self.joint)
        cap = _copy.copy(self.captured)
        cap.gm = pack_graph_module(cap.gm)
        state["captured"] = cap
        return state

    def __setstate__(self, state):
        state = dict(state)
        state["joint"] = unpack_graph_module(state["joint"])
        state["captured"].gm = unpack_graph_module(state["captured"].gm)
        self.__dict__.update(state)


def run_rank(payload, batches, extras: list = ()) -> dict:
    """A rank's work in a run with ranks beside the workers: such a rank serves (:meth:`fxpar.feature.ExtraRank.serve`);
    a worker trains, then releases every one of them (:meth:`fxpar.feature.ExtraRank.release`)."""
    if isinstance(payload, ExtraRank):
        return payload.serve()
    out = train(payload, batches)
    for p in extras:
        p.release()
    return out


def _extra_counts(extras: list) -> list:
    """``(label, count, origin, (first rank, last rank))`` per kind of extra rank, in rank order."""
    out = {}
    for p in extras:
        label, n, origin, (lo, hi) = out.get(p.label, (p.label, 0, p.origin(), (p.rank, p.rank)))
        out[p.label] = (label, n + 1, origin, (min(lo, p.rank), max(hi, p.rank)))
    return list(out.values())


def is_compute_label(label: str) -> bool:
    """A ``Program._calls`` item label (``F0.3``, ``I1.2``, ``FULL0.0``, ``RG1``, ``STEP0`` ...) that is compute."""
    return label.startswith("FULL") or label[:1] in ("F", "B", "I", "W")


class ActionList(list):
    """One rank's actions in one step; ``str()`` prints them in the schedule IR's text form, then ``window``: the
    lines of the steps whose actions differ (a synchronisation method's averagings over one window of steps)."""

    def __init__(self, rank: int, actions, window: list | None = None):
        super().__init__(actions)
        self.rank = rank
        self.window = list(window or [])

    def __str__(self) -> str:
        return "\n".join([f"rank {self.rank}: " + " ".join(a.short() for a in self), *self.window])


def stage_messages(captured) -> dict:
    """The tensors a stage receives and sends, per direction, in the order both sides use."""
    gm, sig = captured.gm, captured.signature
    phs = gm.graph.find_nodes(op="placeholder")
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    meta = lambda n: (tuple(n.meta["val"].shape), n.meta["val"].dtype)   # noqa: E731
    acts_in = [(k, *meta(n)) for n, (r, k) in zip(phs, sig.inputs) if r == Role.ACT]
    acts_out = [(k, *meta(n)) for n, (r, k) in zip(outs, sig.outputs) if r == Role.ACT]
    tangents = {k for r, k in sig.inputs if r == Role.TANGENT}
    grads_out = {k for r, k in sig.outputs if r == Role.ACT_GRAD}
    return {"acts_in": acts_in, "acts_out": acts_out, "grads_in": [m for m in acts_out if m[0] in tangents],
            "grads_out": [m for m in acts_in if m[0] in grads_out]}


class Program:
    def __init__(self, *, model, plan, strategy, cluster, schedule, stages, split, trace, optimizer,
                 lr_scheduler, n_inputs, timings, layout=None, loss=None, example=None):
        self.model_name = type(model).__name__
        self.plan, self.strategy, self.cluster = plan, strategy, cluster
        self.pipe_schedule = schedule
        self.stages = stages
        self.split, self.trace = split, trace
        self.optimizer, self._lr_scheduler = optimizer, lr_scheduler
        self.n_inputs, self.timings = n_inputs, timings
        self.aliases = dict(stages[0].captured.aliases)
        self._params = {k: v.detach() for k, v in model.named_parameters()}
        self._buffers = {**{k: v.detach() for k, v in model.named_parameters() if not v.requires_grad},
                         **{k: v.detach() for k, v in model.named_buffers()}}
        self._model_keys = list(model.state_dict().keys())
        self._estimate = None
        self.auto_search = None        # the automatic planner's search (fxpar.auto.AutoSearch) that chose this plan
        # parameters no stage trains (the loss never reaches them): every rank holds them like buffers, so
        # they stay in state_dict() and checkpoints, unchanged (torch.optim skips a parameter without .grad)
        held = {k for st in stages for k in st.param_keys}
        for k, v in self._params.items():
            if k not in held:
                self._buffers.setdefault(k, v)
        self.layout, self.loss = layout, loss          # fxpar._tracing.BatchLayout, fxpar.losses.LossChoice
        self._example = None if example is None else [(tuple(t.shape), t.dtype) for t in example]

    @property
    def world_size(self) -> int:
        return self.plan.mesh.size

    @property
    def dp(self) -> int:
        return self.plan.dp

    @property
    def pp(self) -> int:
        return self.plan.pp

    @property
    def captured(self):
        """The first stage's captured step (the only one without a pipeline)."""
        return self.stages[0].captured

    @property
    def asynchronous(self) -> bool:
        """Whether the schedule keeps several weight versions per stage: a run covers all its batches in one window."""
        return self.plan.asynchronous

    def _check_rank(self, rank: int) -> tuple:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is outside this program's {self.world_size} ranks")
        return self.plan.coords(rank)

    # ---- inspection -----------------------------------------------------------------------
    def graphs(self, rank: int = 0) -> dict:
        """name -> GraphModule this rank runs (printable with ``.code``, runnable): ``"step"`` for a
        one-stage program's fused step, else ``"stage{s}.F"``, ``.B`` (or ``.I``/``.W``), ``.REDUCE_GRAD``,
        ``.STEP`` for every stage the rank holds."""
        self._check_rank(rank)
        out = {}
        for s in self.plan.rank_stages(rank):
            for kind, sg in self.stages[s].graphs.items():
                out["step" if kind == GraphKind.FULL else f"stage{s}.{kind}"] = sg.gm
        return out

    def compiled_code(self, rank: int = 0, graph: str | None = None, threads: int | None = None):
        """The code rank ``rank`` runs in place of its FX graphs, where a feature compiles them
        (``Strategy(compile=True)``: inductor's output, made here from the graphs' shapes): ``{label: code}`` with
        :meth:`graphs`' labels, or one graph's code (``graph="step"``, ``"stage0.F"``, ...). ``threads``: the CPU
        threads a rank runs with (the code depends on it; None: as ``run_local`` gives each rank, the machine's cores
        shared by the ranks)."""
        self._check_rank(rank)

        def no_graph(labels):
            return StrategyError(f"program.compiled_code(rank={rank}, graph={graph!r}): rank {rank} runs no graph "
                                 f"{graph!r}; its graphs: {', '.join(labels)}")
        labels = self.graphs(rank)
        compiling = any(type(get_feature(name)).code is not Feature.code for name in self.plan.features)
        if graph is not None and graph not in labels and compiling:     # said before any graph compiles (seconds)
            raise no_graph(labels)
        for name, section in self.plan.features.items():
            out = get_feature(name).code(section, self, rank, threads)
            if out is not None:
                break
        else:
            offer = [f.name for f in registered_features() if type(f).code is not Feature.code]
            raise StrategyError("program.compiled_code: no feature of this program compiles its graphs; each rank runs "
                                f"the FX graphs of program.graphs({rank}) op by op. Features that compile: "
                                f"{', '.join(offer) or 'none registered'} (e.g. Strategy(compile=True))")
        if graph is None:
            return out
        if graph not in out:
            raise no_graph(out)
        return out[graph]

    def history(self, rank: int = 0) -> list:
        """Per stage this rank holds, the joint graph after capture and after each pass, then each graph the
        split cut out (``HistoryEntry``: ``.pass_name``, ``.code``, ``.info['stage']``; ``str()`` is the code)."""
        self._check_rank(rank)
        return [e for s in self.plan.rank_stages(rank) for e in self.stages[s].history]

    def shardings(self, rank: int = 0):
        """Tensor parallelism: node -> ``fxpar.Sharding`` in the joint graph of every stage this rank holds, as
        decided before lowering (``fxpar.sharding.ShardingMap``; print it for the split nodes by module). The
        graphs themselves are the same on every tp rank. Empty without tensor parallelism."""
        self._check_rank(rank)
        held = self.plan.rank_stages(rank)
        out = ShardingMap()
        for s in held:
            meta = self.stages[s].joint.meta
            res, mods = meta.get(M.SHARDINGS.name), meta.get(M.TP_MODULES.name, {})
            pre = f"stage{s}." if len(held) > 1 else ""
            for name, outs in (res.out.items() if res is not None else ()):
                if outs:
                    out[pre + name] = outs[0]
                    out.modules[pre + name] = mods.get(name, "")
        return out

    def schedule(self, rank: int = 0) -> ActionList:
        """This rank's actions, peers as global ranks (``str()`` prints ``rank R: F0.0 SF0.0>1 ...``)."""
        pr, d = self._check_rank(rank)
        g = lambda r: None if r is None else r * self.dp + d   # noqa: E731
        window = [line for n, sec in self.plan.features.items() for line in get_feature(n).window(sec, self, rank)]
        return ActionList(rank, [Action(rank, a.kind, a.stage, a.microbatch, g(a.peer), a.version)
                                 for a in self.pipe_schedule.actions[pr]], window)

    def _calls(self, rank: int) -> list:
        """What the rank runs in one step, in order: ``cost_models.Item(graph, label, keep)`` per compute
        action (``keep``: F's saved tensors live until the microbatch's last backward) and a ``CommInfo`` per
        send/receive."""
        pr, d = self._check_rank(rank)
        acts = self.pipe_schedule.actions[pr]
        last_bw = {}
        for a in acts:
            if a.kind in (_K.B, _K.W):
                last_bw[(a.stage, a.microbatch)] = a.short()
        releases = send_releases(self.pipe_schedule.actions)[pr]
        ends = set(releases)
        sent = {j: "end" if r is None else acts[r].short() for j, r in sent_until(acts, releases).items()}
        out = []
        which = {_K.SEND_F: "acts_out", _K.SEND_B: "grads_out", _K.RECV_F: "acts_in", _K.RECV_B: "grads_in"}
        for j, a in enumerate(acts):
            if a.kind in which:
                peer = a.peer * self.plan.width + d
                nbytes = sum(int(torch.Size(sh).numel()) * torch.empty((), dtype=dt).element_size()
                             for _, sh, dt in self.stages[a.stage].messages[which[a.kind]])
                send = a.kind in (_K.SEND_F, _K.SEND_B)
                info = M.CommInfo("send" if send else "recv", "pp", (rank, peer) if send else (peer, rank), nbytes)
                out.append((a.short(), info) if j in ends else info)   # a RECV that lets go of sends: labelled
                continue
            sg = self.stages[a.stage].graphs.get(a.kind.name)
            if sg is None:
                continue
            keep = None
            if a.kind == _K.F and (a.stage, a.microbatch) in last_bw:
                until = last_bw[(a.stage, a.microbatch)]
                keep = {j: until for j, (role, _) in enumerate(sg.outputs) if role == Role.SAVED}
            if j in sent:                     # the message it sends: held until the runtime waits on the send
                role = Role.ACT if a.kind == _K.F else Role.ACT_GRAD
                keep = {**(keep or {}), **{k: sent[j] for k, (r, _) in enumerate(sg.outputs) if r == role}}
            out.append(Item(sg.gm, a.short(), keep, self._group_remap(a.stage, rank), self._beside(a, sg)))
        return out

    def _beside(self, action, sg) -> tuple:
        """What the features' state makes for ``action`` outside its graph ``sg`` (``Feature.action_bytes``)."""
        during = after = 0.0
        for name, section in self.plan.features.items():
            d, a = get_feature(name).action_bytes(section, self, action, sg)
            during, after = during + d, after + a
        return during, after

    def _group_remap(self, stage: int, rank: int) -> dict | None:
        """The stage's graphs name the groups of the rank they were lowered for (its first holder); for ``rank``:
        ``{(group name, those ranks): rank's ranks}`` (the cost models simulate each rank in its own groups)."""
        first = self.plan.stage_to_rank[stage][0] * self.plan.width
        if first == rank:
            return None
        out = {}
        for name in ["dp"] + self.plan.tp_axes + sorted(self.plan.groups):
            a, b = self.plan.group_of(name, first), self.plan.group_of(name, rank)
            if a is not None and b is not None and tuple(a) != tuple(b):
                out[(name, tuple(a))] = tuple(b)
        return out or None

    def collectives(self, rank: int = 0) -> list:
        """Everything this rank sends, receives and reduces in one step, in issue order, as
        ``fxpar.meta.CommInfo`` (send/recv: ``ranks=(src, dst)``, bytes of the whole message)."""
        out = []
        for item in self._calls(rank):
            if isinstance(item, tuple):               # a labelled message: (label, CommInfo)
                item = item[1]
            if isinstance(item, M.CommInfo):
                out.append(item)
            else:
                out += [M.get(n, M.COMM) for n in collective_nodes(item.gm)]
        return out

    def estimate(self):
        """Predicted step time, per-rank compute/comm time, bytes on the wire, idle fraction and peak memory,
        from the cost models over exactly what each rank runs. Starts no process. ``.bubble`` is the idle
        fraction as ``RunResult.bubble`` measures it (compute = F, B, I, W, FULL actions)."""
        if self._estimate is None:
            calls = {r: self._calls(r) for r in range(self.world_size)}
            if all(len(c) == 1 and not isinstance(c[0], M.CommInfo) and c[0].groups is None for c in calls.values()):
                est = cost_models.estimate({r: c[0].gm for r, c in calls.items()}, self.cluster,
                                           server_nodes=getattr(self.cluster, "server_nodes", None))
                est.bubble = est.idle_fraction          # one FULL graph per rank: all of it is compute
            else:
                est = cost_models.estimate(calls, self.cluster, server_nodes=getattr(self.cluster, "server_nodes", None))
                # the runtime's bubble (RunResult.bubble) counts the compute actions only: RG and STEP are not work
                est.bubble = est.idle_fraction_where(is_compute_label)
            for name, section in self.plan.features.items():     # a feature that changes the step at run time
                priced = get_feature(name).priced_calls(section, self, calls, est)
                if priced is not None:
                    calls, notes = priced
                    est = cost_models.estimate(calls, self.cluster, server_nodes=getattr(self.cluster, "server_nodes", None))
                    est.bubble = est.idle_fraction_where(is_compute_label)
                    est.notes += list(notes)
            if not self.optimizer.traced:
                self._price_eager_step(est)
            for r in est.ranks:      # what the features hold per rank beside the graphs (error-feedback residuals ...)
                for name, section in self.plan.features.items():
                    extra = get_feature(name).state_bytes(section, self, r.rank)
                    if extra:
                        r.peak_memory_bytes += extra
                        r.memory_breakdown[f"feature {name}"] = extra
            self._estimate = est
        return self._estimate

    def eager_step_compute(self, rank: int, unpriced: list | None = None) -> tuple:
        """``(ops, flops, bytes, classes)`` of the eager optimizer step rank ``rank`` runs after its graphs when fxpar
        does not trace the optimizer (:func:`cost_models.compute.eager_step_compute` over the parameters of its stages);
        ``(0, 0, 0, ())`` for a traced optimizer."""
        if self.optimizer.traced:
            return 0, 0, 0, ()
        params = {}
        for s in self.plan.rank_stages(rank):
            for k in self.stages[s].param_keys:
                shape = tuple(self._params[k].shape)
                for name, section in self.plan.features.items():    # the piece the rank holds (tp cuts some)
                    shape = tuple(get_feature(name).held_shape(section, self, rank, s, k, shape))
                params[(s, k)] = (shape, self._params[k].dtype)
        return eager_step_compute(self.optimizer, params, unpriced)

    def _price_eager_step(self, est) -> None:
        """Add to ``est`` the eager optimizer step each rank runs after its graphs (an optimizer fxpar does not
        trace): its compute at the rank's device rates, each aten op paying its dispatch, serial at the step's
        end."""
        worst, unpriced = 0.0, []
        for r in est.ranks:
            ops, flops, nbytes, classes = self.eager_step_compute(r.rank, unpriced)
            dev = self.cluster.device_of(r.rank)
            t = inner_time((ops, flops, nbytes, 0, classes), dev) + ops * getattr(dev, "op_overhead_s", 0.0)
            r.compute_time_s += t
            r.end_time_s += t
            worst = max(worst, t)
        est.step_time_s = max((r.end_time_s for r in est.ranks), default=0.0)
        for r in est.ranks:
            r.idle_fraction = 1 - r.compute_time_s / est.step_time_s if est.step_time_s > 0 else 0.0
        est.notes.append(f"optimizer {self.optimizer.name} is not traced: each rank steps it eagerly after its graphs "
                         f"(the weights copied into torch's parameters, the gradients cloned, torch's step, the new "
                         f"weights cloned out), priced at up to {worst * 1e3:.3f} ms per step, serial at the step's end"
                         + (f"; torch's step itself is not priced: {unpriced[0]}" if unpriced else ""))

    def explain(self) -> str:
        return explain_program(self)

    def __repr__(self) -> str:
        return f"<fxpar.Program {self.model_name} {self.strategy} on {self.world_size} ranks>"

    # ---- running ------------------------------------------------------------------------------
    def _host_settings(self) -> HostSettings:
        """The ClusterSpec's settings each rank's process applies to itself (``fxpar.host``)."""
        return HostSettings(comm_priority=bool(getattr(self.cluster, "comm_priority", False)),
                            host_memory_reuse=bool(getattr(self.cluster, "host_memory_reuse", True)))

    def initial_params(self) -> dict:
        """The parameters every run starts from, ``{key: tensor}`` (the program's own tensors: do not modify)."""
        return dict(self._params)

    def extra_ranks(self) -> list:
        """The ranks the enabled features run beside the workers (``fxpar.feature.ExtraRank``, ranks ``world_size ..``: e.g.
        CPU summation servers), none else."""
        return [p for _, p in self._extra_ranks()]

    def _extra_ranks(self) -> list:
        host = self._host_settings()
        return [(f, p) for f, section in ((get_feature(n), sec) for n, sec in self.plan.features.items())
                for p in f.extra_ranks(section, self, host)]

    def payload(self, rank: int, n_batches: int = 1, measure_comm: bool = False, record_weights: bool = False,
                seed: int | None = 0, save_to=None, resume_from=None, measure_memory: bool = False) -> RankPayload:
        """Rank ``rank``'s part, picklable. Asynchronous schedules cover all ``n_batches`` batches in one window."""
        pr, _ = self._check_rank(rank)
        sched = self.pipe_schedule
        settings = RunSettings(n_inputs=self.n_inputs, record_weights=record_weights, rng_seed=seed,
                               measure_comm=measure_comm, measure_memory=measure_memory, aliases=dict(self.aliases),
                               save_to=None if save_to is None else str(save_to),
                               resume_from=None if resume_from is None else str(resume_from),
                               host=self._host_settings(),
                               slowdown=self.cluster.run_slowdown(rank) if hasattr(self.cluster, "run_slowdown") else 1.0)
        if self.asynchronous:
            sched = build_schedule(self.plan, n_batches, resumed=resume_from is not None)
            # the window starts from the checkpoint's stashed versions where the schedule's generator says so
            settings.asynchronous, settings.resumed = True, "resumed" in sched.meta
            if settings.resumed or save_to is not None:     # the versions a checkpoint carries to the next window
                window = sched if settings.resumed else build_schedule(self.plan, 1, resumed=True)
                settings.carried = carried_versions(window) if "resumed" in window.meta else {}
        held = self.plan.rank_stages(rank)
        keys = {k for s in held for k in self.stages[s].param_keys}
        reduced_by = {}          # stage -> {tied key: the held stage that reduces it for this rank}
        for s in held:
            for k in self.stages[s].param_keys:
                if k in self.plan.tied and not self.plan.grad_groups[s].get(k):
                    by = [t for t in held if t != s and self.plan.grad_groups[t].get(k)]
                    if by:
                        reduced_by.setdefault(s, {})[k] = by[0]
        settings.reduced_by = reduced_by
        bindings = {}
        all_groups = self.plan.all_groups()
        for name, ranks in all_groups:       # only groups every rank creates (a process group is made by all)
            if rank in ranks:
                bindings[name] = tuple(ranks)
        features = {}                    # the enabled features' per-rank state: name -> (RankState class, its info)
        for name, section in self.plan.features.items():
            feat = get_feature(name)
            info = feat.rank_info(section, self, rank) if feat.state is not None else None
            if info is not None:
                features[name] = (feat.state, info)
        return RankPayload(rank=rank, dp=self.dp, tp=self.plan.tp, actions=list(sched.actions[pr]), features=features,
                           stage_to_rank=[tuple(r) for r in self.plan.stage_to_rank],
                           microbatches=self.plan.microbatches,
                           graphs={s: self.stages[s].graphs for s in held},
                           messages={s: self.stages[s].messages for s in held},
                           stage_params={s: self.stages[s].param_keys for s in held},
                           params={k: self._params[k] for k in keys}, buffers=dict(self._buffers),
                           optimizer=self.optimizer, groups=all_groups, bindings=bindings,
                           lr_scheduler=self._lr_scheduler, settings=settings,
                           releases=send_releases(sched.actions)[pr],
                           foreign_buffers=tuple(sorted(
                               k for s, st in enumerate(self.stages) if self.plan.stage_to_rank[s][0] != pr
                               for sg in st.graphs.values() for r, k in sg.outputs if r == Role.NEW_BUFFER)))

    def run_local(self, batches, cluster: LocalCluster | None = None, timeout_s: float = 600.0,
                  measure_comm: bool = False, record_weights: bool = False, seed: int | None = 0,
                  save_to=None, resume_from=None, on_nonfinite: str = "warn",
                  measure_memory: bool = False) -> RunResult:
        """Spawn (or reuse) ``world_size`` gloo ranks here, train one step per global batch, gather the result
        (:class:`RunResult`). ``measure_comm=True`` records every collective each rank runs;
        ``record_weights=True`` logs which weights every F and B computed with; ``measure_memory=True`` tracks
        every tensor each rank holds (``RunResult.peak_memory_bytes``; the tracker slows the ranks down).

        ``batches``: a list of global batches, each with the structure, shapes and dtypes of
        ``example_inputs`` (the step is compiled for them); every batch is checked before any rank starts.

        ``seed``: each rank seeds torch's generator with ``seed + rank`` before training, so random ops
        (dropout) are reproducible and dp ranks draw different masks for their shards -- what torch DDP
        does when each process calls ``torch.manual_seed(seed + rank)``. Under tensor parallelism the tp ranks
        of a replica share the first one's seed, and dropout on a split tensor draws each rank's piece from a
        stream of its own (docs/semantics.md, "Random numbers under tensor parallelism"). ``None`` leaves each
        process's generator as it is.

        Every call starts from the weights the program was built with (a second call does not continue
        the first), unless ``resume_from`` names a checkpoint directory: then parameters, optimizer state,
        step count, LR scheduler and RNG continue from it (saved under any strategy, see
        :mod:`fxpar.runtime.checkpoint`). ``save_to``: after the last step, write the whole training state
        there (model keys; write, then rename: a killed save leaves the previous checkpoint intact). To
        continue a run: ``run_local(b1, save_to=d)``, then ``run_local(b2, resume_from=d)``.

        ``on_nonfinite``: a step whose loss is NaN or infinite is reported naming the step and the ranks:
        ``"warn"`` (default, a RuntimeWarning), ``"raise"`` (:class:`fxpar.errors.NonFiniteLossError`, after the
        run) or ``"ignore"``."""
        if on_nonfinite not in _NONFINITE:
            raise InputError(f"run_local(on_nonfinite={on_nonfinite!r}): choose one of {_NONFINITE} ('warn' reports "
                             "a NaN/inf loss and goes on, 'raise' stops with an error, 'ignore' says nothing)")
        batches = self._batch_list(batches)
        self._check_materialized("run_local")
        if self.layout is None:                        # a Program built without a layout: tuples of tensors
            batches = [tuple(b) if isinstance(b, (tuple, list)) else (b,) for b in batches]
            for b in batches:
                check_batch(b, self.dp, self.plan.microbatches)
        else:
            batches = [self._prepare(b, f"batches[{i}]") for i, b in enumerate(batches)]
        if resume_from is not None:
            if not is_complete(resume_from):
                raise CheckpointError(incomplete_message(resume_from))
        for name, section in self.plan.features.items():
            get_feature(name).check_run(section, self, len(batches), resume_from)
        servers = self.extra_ranks()       # ranks beside the workers (the features')
        n_ranks = self.world_size + len(servers)
        if n_ranks > 1 and cluster is None:
            what = f"program.run_local (world_size={n_ranks})"
            check_main_guard(what)
            check_local_capacity(n_ranks, self._rank_state_bytes(), what)
        if cluster is not None and cluster.world_size != n_ranks:
            raise InputError(f"run_local(cluster=LocalCluster({cluster.world_size})): this program needs "
                             f"{n_ranks} ranks ({self.strategy}" + "".join(f" + {n} {what}(s)" for what, n, _, _ in
                                                                           _extra_counts(servers))
                             + f"); pass a LocalCluster({n_ranks}) or none (run_local then starts its own).")
        args = [(self.payload(r, len(batches), measure_comm, record_weights, seed, save_to, resume_from,
                              measure_memory), batches) for r in range(self.world_size)]
        fn = train
        if servers:                 # workers release the extra ranks after their last step
            fn = run_rank
            args = [(p, b, servers) for p, b in args] + [(sp, None) for sp in servers]
        if self.world_size == 1:
            with torch.random.fork_rng(devices=[]):      # the caller's generator is left as it was
                results = [train(*args[0])]
        else:
            self._check_picklable()
            own = cluster is None
            lc = cluster or LocalCluster(n_ranks, backend=self.cluster.backend)
            try:
                with packing_once():                  # the ranks' payloads share their graphs: packed once
                    results = lc.run(fn, args, timeout_s=timeout_s)
            finally:
                if own:
                    lc.close()
        res = self._gather(results[:self.world_size])
        res.servers = {r["rank"]: r for r in results[self.world_size:]}
        self._check_nonfinite(res, on_nonfinite)
        return res

    # ---- checks before a run --------------------------------------------------------------------
    def _batch_list(self, batches) -> list:
        return inputs.batch_list(batches, self.layout)

    def _check_materialized(self, what: str) -> None:
        """Refuse a model without values (built on the ``meta`` device): it plans and explains, it cannot train."""
        inputs.check_materialized(self.model_name, self._params, self._buffers, what)

    def _prepare(self, batch, where: str) -> tuple:
        """A global batch as the flat tuple the ranks take, checked against example_inputs; with the loss's
        extra columns (the global count of counted targets, docs/semantics.md)."""
        return inputs.prepare_batch(self, batch, where)

    def _rank_state_bytes(self) -> int:
        """Largest per-rank model state: held parameters with their gradient, update and optimizer state, buffers."""
        size = lambda t: t.numel() * t.element_size()    # noqa: E731
        copies = 3 + len(self.optimizer.state_names)
        buffers = sum(size(v) for v in self._buffers.values())
        best = 0
        for r in range(self.world_size):
            keys = {k for s in self.plan.rank_stages(r) for k in self.stages[s].param_keys}
            best = max(best, copies * sum(size(self._params[k]) for k in keys))
        return best + buffers

    def _check_nonfinite(self, res: "RunResult", mode: str) -> None:
        inputs.check_nonfinite(res, mode)

    def _check_picklable(self) -> None:
        import pickle
        try:
            pickle.dumps(self._lr_scheduler)
        except Exception as e:  # noqa: BLE001
            raise TypeError(
                f"lr_scheduler={self._lr_scheduler!r} cannot be sent to the spawned ranks ({e}). Pass "
                "(torch.optim.lr_scheduler.StepLR, {'step_size': 1}) or a module-level function instead of a "
                "lambda or a local function.") from None

    def _full_state(self, parts: list) -> dict:
        state = {}
        for part in parts:
            state.update(part)
        for k, v in self._buffers.items():
            state.setdefault(k, v)
        for alias, canon in self.aliases.items():
            state[alias] = state[canon]
        return {k: state[k] for k in self._model_keys if k in state}

    def _gather(self, results: list) -> RunResult:
        n = len(results[0]["loss_sums"])
        total_mb = self.plan.microbatches * self.dp
        tp = self.plan.tp                  # tp ranks compute the same loss: count it once, at tp index 0
        losses = [sum(r["loss_sums"][i] for j, r in enumerate(results) if j % tp == 0) / total_mb for i in range(n)]
        times = [max(r["step_times"][i] for r in results) for i in range(n)]
        res = RunResult(losses=losses, step_times=times,
                        per_rank_losses={i: r["loss_sums"] for i, r in enumerate(results)},
                        comm_calls={i: r["comm_calls"] for i, r in enumerate(results)},
                        comm_groups={i: r.get("comm_groups", []) for i, r in enumerate(results)},
                        _state=self._full_state([r.get("state", {}) for r in results]),
                        optimizer_state={k: v for r in results for k, v in r.get("optimizer_state", {}).items()})
        res.comm = {i: r["comm"] for i, r in enumerate(results)}
        res.state_bytes = {i: r.get("state_bytes", {}) for i, r in enumerate(results)}
        res.features = {i: r["features"] for i, r in enumerate(results) if r.get("features")}
        measured = {i: r["peak_memory"] for i, r in enumerate(results) if r.get("peak_memory")}
        res.peak_memory_bytes = {i: max(p for p, _ in m) for i, m in measured.items()}
        res.held_memory_bytes = {i: m[0][1] for i, m in measured.items()}
        for r in results:
            for s, held in r["peak_versions"].items():
                res.peak_versions[s] = max(res.peak_versions.get(s, 0), held)
            for s, held in r["act_peak"].items():
                res.peak_activations[s] = max(res.peak_activations.get(s, 0), held)
                res.peak_activation_bytes[s] = max(res.peak_activation_bytes.get(s, 0), r["act_peak_bytes"][s])
        res.peak_version_bytes = max(r["peak_version_bytes"] for r in results)
        res.action_times = {i: [{k: tuple(v) for k, v in w.items()} for w in r["action_times"]]
                            for i, r in enumerate(results)}
        res.weight_log = {i: r["weight_log"] for i, r in enumerate(results)}
        res.timelines = {i: r["timelines"] for i, r in enumerate(results)}
        if not self.asynchronous:      # the idle share of the ranks' time, 1 - sum(compute) / (ranks * step time)
            res.bubble = [1 - sum(r["busy"][i] for r in results) / (len(results) * times[i]) for i in range(n)]
        return res

    def runner(self, backend: str | None = None, seed: int | None = 0) -> "RankRunner":
        """Under torchrun (or on an initialised group): join the env:// group and run this rank's part,
        one ``step(global_batch)`` at a time (``seed`` as in :meth:`run_local`). With ``k`` ranks beside the workers
        (:meth:`extra_ranks`: CPU summation servers) the job has ``n + k`` processes: ranks ``n .. n+k-1`` get their
        feature's runner (same surface: the script's ``for b in batches: runner.step(b)`` runs unchanged on them)."""
        import os
        import torch.distributed as dist
        self._check_materialized("runner")
        extra = self._extra_ranks()        # ranks beside the workers (the features')
        servers = [p for _, p in extra]
        if not dist.is_initialized() and os.environ.get("WORLD_SIZE", "").isdigit():   # refused before the rendezvous
            self._check_world(int(os.environ["WORLD_SIZE"]), servers)
        init_from_env(backend or self.cluster.backend)
        self._check_world(dist.get_world_size(), servers)
        if self.asynchronous:
            raise StrategyError(f"schedule {self.plan.schedule!r} runs all batches in one window; use "
                                "run_local(batches), or a synchronous schedule with runner()")
        mine = [(f, sp) for f, sp in extra if sp.rank == dist.get_rank()]
        if mine:
            return mine[0][0].extra_runner(mine[0][1], self)
        payload = self.payload(dist.get_rank(), seed=seed)
        # the executor binds each graph to this rank's groups and backend (group names, gloo's gather): on copies,
        # as a rank of run_local gets them, so that program.graphs() keeps showing the program as planned
        payload.graphs = pickle.loads(pickle.dumps(payload.graphs))
        return RankRunner(Executor(payload), self)

    def _check_world(self, world: int, servers: list) -> None:
        """torchrun's process count against the program's: its workers, plus the ranks the features run beside them."""
        need = self.world_size + len(servers)
        if world != need:
            what = (f"{need} = {self.world_size} workers ({self.strategy})"
                    + "".join(f" + {n} {label}(s) ({origin + ', ' if origin else ''}ranks {lo}..{hi})"
                              for label, n, origin, (lo, hi) in _extra_counts(servers)) if servers else f"{need}")
            raise ValueError(f"torchrun started {world} processes but the program needs {what}: use "
                             f"--nproc-per-node {need} (or change the Strategy)")
