"""Tick-tock waves: ``Strategy(dp=n, schedule="wavelet")``, over pipeline stages with ``pp > 1`` (Wang et al.,
MLSys'21).

Wavelet (Guanhua Wang, Kehan Wang, Kenan Jiang, Xiangjun Li, Ion Stoica, "Wavelet: Efficient DNN Training with
Tick-Tock Scheduling", MLSys'21) runs two waves of training on the same data-parallel ranks, the tock wave half a
forward-backward cycle after the tick wave, so that one wave's memory peak (the end of its forward) falls in the
other's valley (its backward). Its memory condition: max over t of M(t) + M(t + T/2) fits the device.

What fxpar builds (the generator is ``fxpar/schedule/wavelet.py``):

* each rank holds the whole model, cut into ``wave_chunks`` chunks (stages on the one pipeline rank, cut by the
  pipelines' balanced search); the step's ``microbatches`` (2 if not given: one per wave) are half the tick wave's,
  half the tock wave's; the tock wave's actions run ``wave_chunks`` actions -- half a cycle -- after the tick
  wave's, interleaved on the rank;
* with ``pp > 1`` (the paper's tick-tock over model-parallel stages) the model is cut into ``pp`` stages; the tick
  wave runs stage s on pipeline rank s, the tock wave on rank pp-1-s, in reverse, half a cycle (pp slots) later:
  on each rank the tock wave's forward runs where the tick wave's backward frees memory. Each rank holds two
  stages (one per wave), each stage two copies;
* gradient synchronisation across the waves: both waves add into the rank's one accumulator per parameter; each
  chunk's sum is all-reduced over dp (and, with pp > 1, with the stage's other copy) and the chunk updates once,
  with the mean over both waves' microbatches. Both waves compute with the same weights, so the step is
  synchronous training on the global batch (both waves' samples over every rank):
  ``fxpar.testing.reference_training`` to 1e-10. The paper's text could not be read (docs/strategies/pipelines.md,
  "Checked against the papers"); a reader's notes of it give its "Model synchronization between waves" the same
  math, synchronising "over 2*N data parallel tasks on 2*N GPUs" (``ruipeterpan/paper_notes``), not the
  asynchronous data parallelism of the Papers with Code summary;
* the memory model: :func:`wave_peak` combines one wave's per-action timeline with itself half a cycle later
  (with pp > 1: rank r's tick timeline with rank pp-1-r's, ``cost_models.wave_memory``); ``program.estimate()``'s
  per-rank peak walks the interleaved step as the rank runs it (the two waves together, which the tracker
  measures); :meth:`WaveletSchedule.check_run` refuses a run whose waves do not fit a
  rank's device's ``memory_bytes``; :func:`largest_batch` finds the largest batch under a budget, for Wavelet
  and for plain dp alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import cost_models
from cost_models.wave_memory import WavePeak, waves_peak
from fxpar.errors import StrategyError
from fxpar.feature import Option, register_feature
from fxpar.roles import Role
from fxpar.schedule import ActionKind
from fxpar.schedule.sends import send_releases, sent_until
from fxpar.schedule.wavelet import WAVES, wavelet

from .pipeline import PipelineSchedule, PipelineSection

__all__ = ["WaveletSection", "WaveletSchedule", "wave_peak", "largest_batch"]

_K = ActionKind


@dataclass
class WaveletSection(PipelineSection):
    """``schedule``: ``"wavelet"``; ``chunks``: the stages the model is cut into (a wave's half cycle, in slots);
    ``ranks``: the pipeline ranks the waves run over (1: every chunk on each rank; more: the tock wave's stages in
    reverse rank order)."""
    chunks: int = 2
    ranks: int = 1

    def lines(self) -> list:
        if self.ranks > 1:
            return [f"wavelet over {self.ranks} pipeline ranks: the tick wave's stage s on rank s, the tock wave's on "
                    f"rank {self.ranks - 1}-s, {self.chunks} slots (half a cycle) late; synchronous: each stage's two "
                    "copies sum both waves' gradients before one update per step"]
        return [f"wavelet, two waves (tick, tock) per rank, the tock wave {self.chunks} actions (half a cycle) late; "
                "synchronous: both waves' gradients summed before one update per step"]


@register_feature
class WaveletSchedule(PipelineSchedule):
    name = "wavelet"
    doc = "tick-tock waves on each data-parallel rank, half a cycle apart (Wang et al., MLSys'21)"
    section = WaveletSection
    schedules = {"wavelet": wavelet}
    papers = {"wavelet": "Wavelet (Wang et al., MLSys'21): two waves of the same ranks, the tock wave half a "
                         "forward-backward cycle late, so that one wave's memory peak falls in the other's valley"}
    options = {"wave_chunks": Option(None, "Wavelet (schedule='wavelet', pp=1): the chunks each rank's model is cut "
                                           "into (default 2); the tock wave runs that many actions (half a "
                                           "forward-backward cycle) after the tick wave. With pp > 1 the model is in "
                                           "pp stages and wave_chunks is not taken")}

    def settle(self, strategy) -> None:
        if strategy.microbatches == 1:          # one microbatch per wave
            strategy.microbatches = WAVES
        if strategy.wave_chunks is None and strategy.pp == 1:
            strategy.wave_chunks = 2

    def validate(self, strategy) -> None:
        m = strategy.microbatches
        if m % WAVES:
            raise StrategyError(f"{strategy}: schedule='wavelet' gives half the microbatches to each wave; "
                                f"microbatches={m} is odd. Use microbatches={m - 1 or 2} or {m + 1}.")
        v = strategy.wave_chunks
        if strategy.pp > 1:
            if v is not None:
                raise StrategyError(f"Strategy(pp={strategy.pp}, wave_chunks={v!r}): with pp > 1 schedule='wavelet' "
                                    f"cuts the model into pp={strategy.pp} stages, one per pipeline rank in each wave "
                                    "(the tock wave's in reverse rank order); drop wave_chunks, or use pp=1 to cut "
                                    "each rank's whole model into wave_chunks chunks.")
            return
        if not isinstance(v, int) or isinstance(v, bool) or v < 2:
            raise StrategyError(f"Strategy(wave_chunks={v!r}): give an int >= 2 -- the chunks each rank's model is "
                                "cut into; with one chunk the tock wave's forward cannot run beside the tick wave's "
                                "backward.")

    def plan(self, strategy, plan, cluster):
        pp = strategy.pp
        return self.section(schedule="wavelet", chunks=strategy.wave_chunks if pp == 1 else pp, ranks=pp)

    def make_schedule(self, section, plan, n_batches: int = 2, resumed: bool = False):
        return wavelet(plan.pp, plan.microbatches, v=section.chunks)

    def check_run(self, section, program, n_batches: int, resume_from) -> None:
        """Refuse a run whose two waves do not fit a rank's device (its ``memory_bytes``: ``ClusterSpec.device_of``,
        each rank's own on a heterogeneous cluster)."""
        cluster = program.cluster
        est = program.estimate()
        over = [r for r in est.ranks if r.peak_memory_bytes > cluster.device_of(r.rank).memory_bytes]
        if over:
            worst = max(over, key=lambda r: r.peak_memory_bytes - cluster.device_of(r.rank).memory_bytes)
            dev = cluster.device_of(worst.rank)
            budget = dev.memory_bytes
            one = wave_peak(program, worst.rank)
            where = "ClusterSpec.device" if not cluster.devices else f"ClusterSpec.devices[{worst.rank}], {dev.name}"
            raise StrategyError(
                f"{program.strategy}: the two waves do not fit: rank {worst.rank}'s combined peak is "
                f"{worst.peak_memory_bytes / 2**20:.2f} MiB (max over t of M(t) + M(t+T/2); one wave alone "
                f"{one.one_wave / 2**20:.2f} MiB) against a budget of {budget / 2**20:.2f} MiB "
                f"({where}.memory_bytes={budget}). Use a smaller batch (fxpar.features.wavelet."
                "largest_batch finds the largest that fits), more microbatches per wave, more wave_chunks, or more "
                "dp ranks.")

    def explain(self, section, program) -> list:
        peak = wave_peak(program, 0)
        mib = 2**20
        return super().explain(section, program) + [
            f"memory per rank: one wave {peak.one_wave / mib:.2f} MiB, two waves half a cycle apart "
            f"{peak.combined / mib:.2f} MiB (max over t of M(t) + M(t+T/2); state and batch "
            f"{peak.shared / mib:.2f} MiB counted once), budget {program.cluster.device_of(0).memory_bytes / mib:.0f} "
            "MiB" + (" (rank 0's device)" if program.cluster.devices else "")]


def _tick_runs(program, pr: int) -> tuple:
    """The tick wave's items on pipeline rank ``pr`` in order (``(Liveness or None, label, keep)``: a graph, F's saved
    values kept until their backward and a sent output until the runtime lets go of it, or a message), then the step's tail (RG, STEP) of the stages the tick wave runs
    there; returns ``(runs, number of tail graphs)``."""
    acts = program.pipe_schedule.actions[pr]
    half = program.plan.microbatches // WAVES
    wave = [(j, a) for j, a in enumerate(acts) if a.kind not in (_K.REDUCE_GRAD, _K.STEP)
            and a.microbatch is not None and a.microbatch < half]
    mine = {a.stage for _, a in wave if a.kind in (_K.F, _K.B)}
    tail = [(j, a) for j, a in enumerate(acts) if a.kind in (_K.REDUCE_GRAD, _K.STEP) and a.stage in mine]
    # what the wave sends is held until the step's RECV after which the runtime waits on it (either wave's RECV):
    # in the wave's own timeline, until its last item before that RECV
    sent = {}
    for j, r in sent_until(acts, send_releases(program.pipe_schedule.actions)[pr]).items():
        before = [a for k, a in wave if k < r] if r is not None else []
        sent[j] = before[-1].short() if before else "end"
    runs, cache, n_tail = [], {}, 0
    for j, a in wave + tail:
        if a.kind not in (_K.F, _K.B, _K.REDUCE_GRAD, _K.STEP):
            runs.append((None, a.short(), None))            # a message
            continue
        sg = program.stages[a.stage].graphs.get(a.kind.name)
        if sg is None:
            continue
        lv = cache.get(id(sg.gm))
        if lv is None:
            lv = cache[id(sg.gm)] = cost_models.liveness(sg.gm)
        keep = None
        if a.kind == _K.F:
            keep = {k: f"B{a.stage}.{a.microbatch}" for k, (role, _) in enumerate(sg.outputs) if role == Role.SAVED}
        if j in sent:
            role = Role.ACT if a.kind == _K.F else Role.ACT_GRAD
            keep = {**(keep or {}), **{k: sent[j] for k, (r, _) in enumerate(sg.outputs) if r == role}}
        runs.append((lv, a.short(), keep))
        n_tail += a.kind in (_K.REDUCE_GRAD, _K.STEP)
    return runs, n_tail


def wave_peak(program, rank: int = 0) -> WavePeak:
    """Rank ``rank``'s memory under Wavelet from the tick wave's per-action timelines: that wave alone, and the two
    waves half a cycle apart, max over t of M(t) + M(t + T/2); the step's tail (RG, STEP) after both.

    With pp = 1 the tock wave is the rank's tick timeline again, ``wave_chunks`` actions later. With pp > 1 the tock
    wave's stage on pipeline rank r is the tick wave's stage of rank q = pp-1-r: its memory is rank q's tick timeline
    half a cycle (one action of each wave on the rank) later, M_r(t) + M_q(t + T/2)."""
    section = program.plan.section(WaveletSchedule.name)
    pr, pp = rank // program.plan.width, program.plan.pp
    runs, n_tail = _tick_runs(program, pr)
    mirror = pp - 1 - pr
    if pp == 1 or mirror == pr:         # one timeline: the whole model (pp=1), or the middle stage of an odd pp
        return waves_peak(runs, section.chunks if pp == 1 else 1, tail=n_tail)
    other, other_tail = _tick_runs(program, mirror)
    return waves_peak(runs, 1, tail=n_tail, other=other, other_tail=other_tail)


def largest_batch(peak_of, budget: float, sizes) -> tuple:
    """The largest of ``sizes`` (ascending) whose predicted peak ``peak_of(size)`` (bytes) fits ``budget``, and its
    peak: ``(size, peak)``, or ``(None, peak of the smallest)`` when none fits. Peaks grow with the batch, so the
    search stops at the first size that does not fit."""
    best = (None, None)
    for b in sizes:
        peak = peak_of(b)
        if peak > budget:
            return best if best[0] is not None else (None, peak)
        best = (b, peak)
    return best
