"""ZeRO-Offload (Ren et al., ATC'21) and ZeRO-Infinity (Rajbhandari et al., SC'21) as one Feature:
``Strategy(dp=N, [zero=1 | 2 | 3,] offload=("params", "optimizer"), offload_to="cpu" | "disk", offload_dir=d)``.

* options ``offload``, ``offload_to``, ``offload_dir``, validated here (the directory must be writable);
* its Plan section :class:`OffloadSection` (what, where, the directory, whether the state is ZeRO's chunks);
* its planning (:meth:`ZeroOffload.plan`: what it refuses, the Plan's note);
* its pass ``passes.zero_offload.ZeroOffload`` in the ``SHARD_OFFLOAD`` slot, on ZeRO's chunks: the update on the
  host, and with ``offload_to="disk"`` each layer's file read ahead (``fxpar::prefetch``, ``fxpar.prefetch``);
* its per-rank state :class:`OffloadState`: with ``offload_to="disk"`` every offloaded tensor (parameters,
  optimizer state; ZeRO's chunks where ZeRO is on) is a memory-mapped file under ``offload_dir/rank<r>/`` that the
  graphs read and the update writes back, tracked so that ``fxpar::prefetch`` can read a file ahead.

Without ZeRO the offloaded state is each rank's whole parameters and optimizer state (no pass runs).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import torch

from fxpar import prefetch
from fxpar.errors import StrategyError
from fxpar.feature import Feature, Option, PlanSection, RankState, Slot, register_feature
from passes.zero_offload import ZeroOffload as ZeroOffloadPass

__all__ = ["ZeroOffload", "OffloadSection", "OffloadState"]

_WHAT = ("params", "optimizer")
_TO = ("cpu", "disk")


@dataclass
class OffloadSection(PlanSection):
    """The decision: what of each rank's model state lives off the device, where, and in which directory."""
    what: list = field(default_factory=list)
    to: str = "cpu"
    dir: str | None = None
    chunks: bool = False            # the state is ZeRO's chunks: the zero_offload pass streams them

    def lines(self) -> list:
        return [f"offload {' and '.join(self.what)} to {self.to}" + (f" (files under {self.dir})" if self.to == "disk"
                                                                     else "")]


class OffloadState(RankState):
    """``offload_to="disk"``: the rank's offloaded tensors as memory-mapped files. ``info``: the section's fields."""

    def __init__(self, info, rank):
        super().__init__(info, rank)
        self.on_disk: dict = {}          # (stage, "param" | "optim", key) -> the file-backed tensor

    def _map(self, ex) -> None:
        """Each offloaded tensor becomes a memory-mapped file under ``offload_dir/rank<r>/``: read in as a layer uses
        it, written back in place by the update."""
        if self.info["to"] != "disk":
            return
        root = os.path.join(self.info["dir"], f"rank{self.rank}")
        os.makedirs(root, exist_ok=True)
        prefetch.reset()             # fxpar::prefetch (passes.zero_offload) reads ahead in the files tracked below
        self.on_disk = {}
        what = self.info["what"]
        for s in sorted(ex.params):
            groups = ([("param", ex.params[s])] if "params" in what else []) + \
                     ([("optim", ex.state[s])] if "optimizer" in what else [])
            for kind, store in groups:
                for k, t in store.items():
                    path = os.path.join(root, f"{kind}.{k.replace(':', '.')}.bin")
                    f = torch.from_file(path, shared=True, size=t.numel(), dtype=t.dtype).view(t.shape)
                    f.copy_(t)
                    store[k] = f
                    self.on_disk[(s, kind, k)] = f
                    prefetch.track(f, path)

    def _to_host(self, ex) -> None:
        """``offload_to="cpu"`` on a rank that computes on a device: the offloaded state moves to host memory, where
        the zero_offload pass's update reads it -- the optimizer state, and the parameter chunks under ZeRO-3 (the
        chunk is the host master the update writes) or when parameters are offloaded."""
        if self.info["to"] != "cpu" or ex.device.type == "cpu":
            return
        what, zero = self.info["what"], ex.features.get("zero")
        for s in sorted(ex.params):
            stage3 = zero is not None and zero.stages.get(s, {}).get("stage") == 3
            if "params" in what or (stage3 and "optimizer" in what):
                ex.params[s] = {k: v.cpu() for k, v in ex.params[s].items()}
            if "optimizer" in what:
                ex.state[s] = {k: v.cpu() for k, v in ex.state[s].items()}

    def setup(self, ex) -> None:
        self._to_host(ex)
        self._map(ex)

    def after_load(self, ex) -> None:
        self._to_host(ex)
        self._map(ex)

    def after_update(self, ex, stage) -> None:
        """A new tensor the graph made for an offloaded one is written into its file (an update made in place
        already is)."""
        if self.info["to"] != "disk":
            return
        for (st, kind, k), f in self.on_disk.items():
            store = ex.params[st] if kind == "param" else ex.state[st]
            if st == stage and store[k] is not f:
                f.copy_(store[k])
                store[k] = f
        ex.state_bytes["prefetched"] = prefetch.STATS["bytes"]    # read ahead so far (RunResult.state_bytes)
        ex.state_bytes["on_disk"] = sum(f.numel() * f.element_size() for f in self.on_disk.values())

    def whole(self, ex, params, state):
        """Plain copies of the files: memory-mapped tensors do not travel (results, checkpoints)."""
        mapped = {id(f) for f in self.on_disk.values()}
        for store in (*params.values(), *state.values()):
            for k, t in store.items():
                if id(t) in mapped:
                    store[k] = t.clone()
        return params, state

    def save(self) -> dict:
        return {}            # the checkpoint holds the tensors themselves (whole()); the files are made again on load


@register_feature
class ZeroOffload(Feature):
    name = "zero_offload"
    doc = "ZeRO-Offload / ZeRO-Infinity: model state in host memory or memory-mapped files (Ren et al. ATC'21; " \
          "Rajbhandari et al. SC'21)"
    options = {
        "offload": Option((), (
            "ZeRO-Infinity (Rajbhandari et al., SC'21): what of each rank's model state lives off the compute "
            "device: ``('params', 'optimizer')`` or either. With ``zero=3`` the parameters off the device are this "
            "rank's chunks.")),
        "offload_to": Option("cpu", (
            "where the offloaded state lives: ``'cpu'`` in host memory (where it already is on a CPU backend), "
            "``'disk'`` in files under ``offload_dir`` (memory-mapped: read into memory as each layer uses it, "
            "written back by the update).")),
        "offload_dir": Option(None, "with ``offload_to='disk'``: the directory each rank writes its files into "
                                    "(local, fast disk)"),
    }
    section = OffloadSection
    passes = ((Slot.SHARD_OFFLOAD, ZeroOffloadPass),)
    state = OffloadState

    def enabled(self, strategy) -> bool:
        off = strategy.offload
        return (bool((off,) if isinstance(off, str) else tuple(off)) or strategy.offload_to != "cpu"
                or strategy.offload_dir is not None)

    def validate(self, strategy) -> None:
        if isinstance(strategy.offload, str):
            strategy.offload = (strategy.offload,)
        strategy.offload = tuple(strategy.offload)
        if "activations" in strategy.offload:
            rest = tuple(x for x in strategy.offload if x != "activations")
            raise StrategyError(f"Strategy(offload={strategy.offload!r}): offload= moves ZeRO's parameters and "
                                "optimizer state ('params', 'optimizer'); saved activations have their own option: "
                                f"Strategy(offload_activations=True{f', offload={rest!r}' if rest else ''})")
        bad = [x for x in strategy.offload if x not in _WHAT]
        if bad:
            raise StrategyError(f"Strategy(offload={strategy.offload!r}): {bad} unknown; offload any of 'params', "
                                "'optimizer'")
        if strategy.offload_to not in _TO:
            raise StrategyError(f"Strategy(offload_to={strategy.offload_to!r}): choose 'cpu' or 'disk'")
        if strategy.offload_dir is not None and strategy.offload_to != "disk":
            raise StrategyError(f"Strategy(offload_dir={strategy.offload_dir!r}, offload_to={strategy.offload_to!r}): "
                                "offload_dir is where offload_to='disk' writes its files; add offload_to='disk' or "
                                "drop offload_dir")
        if strategy.offload_to == "disk":
            if not strategy.offload:
                raise StrategyError("Strategy(offload_to='disk') with nothing to offload: add offload=('params', "
                                    "'optimizer') (or one of them)")
            if not strategy.offload_dir:
                raise StrategyError("Strategy(offload_to='disk') needs offload_dir=...: a directory each rank may "
                                    "write its files into (local, fast disk)")
            d = os.path.abspath(str(strategy.offload_dir))
            try:
                os.makedirs(d, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=d):
                    pass
            except OSError as e:
                raise StrategyError(f"Strategy(offload_dir={strategy.offload_dir!r}): cannot write there ({e.strerror}); "
                                    "give a directory this user can create files in") from None
            strategy.offload_dir = d
        self._check_zero(strategy)

    @staticmethod
    def _check_zero(strategy) -> None:
        """``offload_to='cpu'`` moves only what ZeRO's pass moves: refuse what would stay where it is.
        (``offload_to='disk'`` keeps any stage's tensors in files, ZeRO or not.)"""
        z = strategy.zero
        if strategy.offload_to != "cpu" or isinstance(z, bool) or z not in (0, 1, 2, 3):
            return                                  # the zero feature refuses a zero that is not a stage
        disk = (f"offload_to='disk' with offload_dir=... to keep each rank's whole {{what}} in memory-mapped files")
        if "optimizer" in strategy.offload and z == 0:
            raise StrategyError(
                f"Strategy(offload={strategy.offload!r}, zero=0): offload 'optimizer' to the CPU is ZeRO-Offload -- "
                "the host holds each rank's ZeRO chunks of optimizer state and runs their update there -- and with "
                "zero=0 there are no chunks, so the optimizer state would stay where it is. Set zero=1, 2 or 3 "
                f"(with dp > 1), or {disk.format(what='optimizer state')}, or drop offload.")
        if "params" in strategy.offload and z in (0, 1, 2):
            keep = (" (with zero=1 or 2, offload=('optimizer',) already keeps the master copy of each rank's "
                    "parameter chunks on the host)") if z else ""
            raise StrategyError(
                f"Strategy(offload={strategy.offload!r}, zero={z}): offload 'params' to the CPU keeps each rank's "
                "ZeRO-3 parameter chunks on the host (each gather copies one to the device); with "
                f"zero={z} the parameters stay whole on the device for forward and backward, so nothing would move. "
                f"Set zero=3 (with dp > 1), or {disk.format(what='parameters')}, or drop 'params' from offload"
                f"{keep}.")

    def plan(self, strategy, plan, cluster):
        what, to = list(strategy.offload), strategy.offload_to
        opt = plan.optimizer or {}
        if "optimizer" in what and opt and not opt.get("traced"):
            raise StrategyError(f"{strategy}: offload=('optimizer',) keeps the traced optimizer's state in files; "
                                f"{opt.get('name')} is not traced ({opt.get('why_not_traced')}). Use SGD, Adam or "
                                "AdamW, or offload only 'params'.")
        if plan.asynchronous:
            raise StrategyError(f"{strategy}: schedule {plan.schedule!r} keeps several weight versions; offload is built "
                                "for synchronous schedules.")
        chunks = plan.section("zero") is not None
        where = (f"files under {strategy.offload_dir} (memory-mapped)" if to == "disk" else
                 "host memory (on a CPU backend, where it already is)")
        how = [("streams each gradient chunk to the host and updates there" if "optimizer" in what else ""),
               "reads the files ahead (fxpar::prefetch)" if to == "disk" else ""]
        how = f"; the zero_offload pass {' and '.join(h for h in how if h)}" if chunks and any(how) else ""
        plan.notes.append(f"offload: {' and '.join(what)} of each rank live in {where}{how}")
        return OffloadSection(what=what, to=to, dir=strategy.offload_dir, chunks=chunks)

    def make_passes(self, section) -> list:
        return super().make_passes(section) if section.chunks else []     # the pass works on ZeRO's chunks

    def rank_info(self, section, program, rank):
        # every rank gets the state: on a device, host offload places tensors in host memory; on disk, in files
        return {"what": list(section.what), "to": section.to, "dir": section.dir}
