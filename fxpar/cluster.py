"""ClusterSpec: the devices, how they are connected, and the backend that connects them.

A ClusterSpec is pure data with a JSON round-trip. The planner and the cost models read it;
the runtime reads only ``world_size`` and ``backend``.

    >>> spec = ClusterSpec.local(world_size=2)            # CPU processes over gloo
    >>> spec = ClusterSpec.preset("a100-80gb", nodes=4, gpus_per_node=8)
    >>> ClusterSpec.from_json(spec.to_json()) == spec
    True
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace

from .errors import ClusterSpecError

__all__ = ["DeviceSpec", "LinkSpec", "ClusterSpec", "PRESETS", "PRESET_ALIASES"]


@dataclass(frozen=True)
class DeviceSpec:
    """One device. Figures are peak (vendor) numbers; cost models apply measured efficiencies."""
    kind: str = "cpu"                     # "cpu" or "cuda"
    name: str = "cpu"
    memory_bytes: int = 16 * 2**30
    peak_flops: float = 50e9              # FLOP/s for the training dtype
    mem_bandwidth: float = 10e9           # bytes/s
    efficiency: dict = field(default_factory=dict)   # op class -> fraction of peak, from calibrate()
    op_overhead_s: float = 0.0            # fixed cost per aten op (dispatch / kernel launch), from calibrate()
    # seconds a point-to-point message takes beyond its transfer (alpha + n/beta) when the receive is posted
    # after the send and the sender has gone on computing (gloo finishes the write on the sender's CPU, which
    # must be scheduled beside the compute); the mean over repeats, from calibrate(). 0: not measured.
    late_recv_s: float = 0.0
    # CPU seconds a rank spends *issuing* one collective (the call that enqueues it and returns a handle: under
    # gloo the work's setup and its small copies run on the caller's thread), on top of the transfer; from
    # calibrate(). It adds to the compute lane once per collective a graph issues. 0: not measured.
    collective_issue_s: float = 0.0
    # how many of a rank's collectives progress at once (gloo: up to its two worker threads per group, when
    # their time is waiting rather than CPU work); from calibrate(). 0: the backend's (gloo 2, NCCL 1).
    collective_slots: int = 0
    # CPU seconds fxpar's runtime spends per graph it calls (an action: assembling the graph's arguments, reading
    # its results, the step's bookkeeping), on top of the graph's ops; from ClusterSpec.calibrate(). 0: not measured.
    action_overhead_s: float = 0.0
    # CPU that a collective takes from the rank's compute where the ranks' threads fill the cores: comm_cpu_s per
    # collective (gloo's threads) + comm_cpu_per_byte per byte of its buffer (gloo's threads and the kernel's network
    # path: what a transfer took from the compute it overlapped, measured), run beside the transfer once it is
    # issued; from calibrate() (0 where the cores are not full: the threads get cores of their own). 0: free.
    comm_cpu_s: float = 0.0
    comm_cpu_per_byte: float = 0.0
    # seconds an op costs more the first time its kind runs after the rank issued or waited on a communication (what
    # ran on the core meanwhile -- gloo's threads, the network path, others while it idled -- pushed the op's code and
    # data out of its caches): charged once per kind of op between two such events (a graph runs every step, so
    # from its last call too); from calibrate(). 0: not measured.
    cold_op_s: float = 0.0
    # seconds an ``index_add`` / ``index_add_`` costs per index beyond its bytes (ATen's CPU kernel adds the rows one at
    # a time, each a random access into a table larger than the caches: 20-40 ns a row here at alpha 1, 1.5-2x what
    # the bytes take at 32-wide rows); from calibrate(). 0: not measured (a GPU's kernel runs the rows in parallel).
    index_row_s: float = 0.0
    # the share of a core a rank's compute runs on while every rank computes (its process's CPU seconds over the wall
    # seconds, at most 1), where the ranks' threads outnumber the cores; from calibrate(). 1: a core of its own. A
    # straggler's sleep follows its compute's CPU seconds (ClusterSpec.slowdown), this share of its wall seconds.
    core_share: float = 1.0
    # the cores the ranks of this device's node share (os.sched_getaffinity at calibrate()); where the node's ranks
    # outnumber them, a rank computing while fewer of them compute runs faster than calibrated, at its share of the
    # cores among the ranks computing then and the other load core_share shows (cost_models.simulate.CoreSharing).
    # 0: not known (every compute step priced as calibrated).
    host_cores: int = 0

    def __hash__(self):
        return hash((self.kind, self.name, self.memory_bytes, self.peak_flops, self.mem_bandwidth))


@dataclass(frozen=True)
class LinkSpec:
    """A link class: bandwidth in bytes/s per direction, latency in seconds. Whose bandwidth: ``intra_node`` is
    each device's; ``inter_node`` is each device's under NCCL (a NIC per GPU) and each machine's under gloo (its
    processes share the machine's one TCP interface; ``cost_models.comm`` divides it among the flows)."""
    bandwidth: float
    latency: float


# Vendor figures. A100 SXM4 80GB: 312 TFLOP/s bf16 dense, 2.039 TB/s HBM2e, NVLink3 600 GB/s
# total (300 GB/s per direction); H100 SXM5: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink4
# 900 GB/s total. Inter-node: 8x 200 Gb/s HDR (A100, DGX A100) and 8x 400 Gb/s NDR (H100,
# DGX H100) InfiniBand, i.e. 25 GB/s and 50 GB/s per GPU.
# Vendor figures per GPU: dense bf16/fp16 tensor-core peak (no sparsity), HBM bandwidth, NVLink bandwidth per
# direction (half the datasheet's bidirectional figure), and one InfiniBand NIC per GPU across nodes (HDR 200 Gb/s =
# 25 GB/s; NDR 400 Gb/s = 50 GB/s; EDR 100 Gb/s = 12.5 GB/s). Sources: NVIDIA A100 Tensor Core GPU datasheet
# (312 TFLOPS bf16; 40GB 1,555 GB/s, 80GB 2,039 GB/s; NVLink 3 600 GB/s), NVIDIA H100 Tensor Core GPU datasheet
# (SXM 989 TFLOPS bf16, 3.35 TB/s, NVLink 4 900 GB/s; PCIe 756 TFLOPS, 2.0 TB/s, PCIe Gen5 x16 128 GB/s), NVIDIA H200
# Tensor Core GPU datasheet (SXM 141 GB, 989 TFLOPS bf16, 4.8 TB/s, NVLink 900 GB/s), NVIDIA Tesla V100 datasheet
# (SXM2 125 TFLOPS fp16 tensor core, 900 GB/s, NVLink 2 300 GB/s). Latencies are typical, not datasheet figures.
# Matmul efficiency: the largest share of the bf16 peak a matmul reaches, measured over many shapes (S. Bekman,
# "Machine Learning Engineering", compute/accelerator, Maximum Achievable Matmul FLOPS table: A100 SXM 267.9 of
# 312 TFLOPS, H100 SXM 792.1 of 989). V100: the most a mixed-precision (fp16) GEMM reached on its tensor cores,
# cuBLAS over a sweep of sizes, 83 of 125 TFLOPS (S. Markidis, S. W. D. Chien, E. Laure, I. B. Peng, J. S. Vetter,
# "NVIDIA Tensor Core Programmability, Performance & Precision", IPDPSW 2018, abstract).
_MAMF_A100, _MAMF_H100, _MAMF_V100 = {"matmul": 267.9 / 312}, {"matmul": 792.1 / 989}, {"matmul": 83 / 125}
# AWS p3.16xlarge (the machine of Alpa's benchmarks, Zheng et al., OSDI'22, Section 8): 8 V100-SXM2-16GB joined by
# NVLink 2.0 (300 GB/s in total per GPU, as the V100 preset), 25 Gbps of network per instance (J. Barr, "New - Amazon
# EC2 Instances with Up to 8 NVIDIA Tesla V100 GPUs (P3)", AWS News Blog, 2017-10-25: the P3 table, p3.16xlarge
# row: 8 GPUs, NVLink 300 GBps, network 25 Gbps). One network interface serves the 8 GPUs, and under SPMD they all
# cross at once (a dp group spanning nodes, or every tp rank sending at a stage boundary), so the preset gives each
# GPU its eighth: 25e9 / 8 bytes/s / 8 (``LinkSpec.inter_node`` under NCCL is each device's). TCP over the
# instance's ENA: latency typical (30 us), not measured.
_P3_NET = LinkSpec(25e9 / 8 / 8, 30e-6)
_NVLINK3, _NVLINK4, _NVLINK2 = LinkSpec(300e9, 3e-6), LinkSpec(450e9, 2.5e-6), LinkSpec(150e9, 3e-6)
_PCIE5 = LinkSpec(64e9, 4e-6)
_IB_EDR, _IB_HDR, _IB_NDR = LinkSpec(12.5e9, 5e-6), LinkSpec(25e9, 5e-6), LinkSpec(50e9, 5e-6)
PRESETS = {
    "a100-80gb": dict(device=DeviceSpec("cuda", "A100-SXM4-80GB", 80 * 2**30, 312e12, 2.039e12, _MAMF_A100),
                      intra=_NVLINK3, inter=_IB_HDR),
    "a100-40gb": dict(device=DeviceSpec("cuda", "A100-SXM4-40GB", 40 * 2**30, 312e12, 1.555e12, _MAMF_A100),
                      intra=_NVLINK3, inter=_IB_HDR),
    "h100-80gb": dict(device=DeviceSpec("cuda", "H100-SXM5-80GB", 80 * 2**30, 989e12, 3.35e12, _MAMF_H100),
                      intra=_NVLINK4, inter=_IB_NDR),
    "h100-pcie": dict(device=DeviceSpec("cuda", "H100-PCIe-80GB", 80 * 2**30, 756e12, 2.0e12),
                      intra=_PCIE5, inter=_IB_NDR),
    "h200": dict(device=DeviceSpec("cuda", "H200-SXM-141GB", 141 * 2**30, 989e12, 4.8e12, _MAMF_H100),
                 intra=_NVLINK4, inter=_IB_NDR),
    "v100-32gb": dict(device=DeviceSpec("cuda", "V100-SXM2-32GB", 32 * 2**30, 125e12, 0.9e12, _MAMF_V100),
                      intra=_NVLINK2, inter=_IB_EDR),
    "v100-16gb": dict(device=DeviceSpec("cuda", "V100-SXM2-16GB", 16 * 2**30, 125e12, 0.9e12, _MAMF_V100),
                      intra=_NVLINK2, inter=_IB_EDR),
    "p3.16xlarge": dict(device=DeviceSpec("cuda", "V100-SXM2-16GB", 16 * 2**30, 125e12, 0.9e12, _MAMF_V100),
                        intra=_NVLINK2, inter=_P3_NET),
}
# short names: the SXM part with the most memory
PRESET_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb", "h200-141gb": "h200",
                  "v100": "v100-32gb"}


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` machines of ``devices_per_node`` identical devices each.

    Ranks are numbered node-major: rank r lives on node ``r // devices_per_node``.
    ``cpu_servers``: CPU-only machines that only sum gradients (BytePS's summation servers,
    ``Strategy(grad_sync="byteps")``); they are ranks ``world_size .. world_size + cpu_servers - 1``
    of the process group, hold no parameters and take no batch. ``server_nodes``: where they sit, for the
    cost model: None (default) gives each server a machine and network card of its own; a tuple names, per
    server, the worker node it shares a machine (and card) with, so that node's workers reach it without
    crossing the network (``cost_models.comm``'s store-and-forward).

    ``comm_priority``: every rank runs gloo's communication threads (its TCP event loop and the process groups'
    workers) under ``SCHED_FIFO``, so that a message's arrival preempts compute instead of waiting for the
    running thread's time slice. It matters where ranks and their threads outnumber the cores (on this
    project's 2-core machine a 1 KiB all-reduce takes 0.14-0.35 ms with it, 0.9-1.2 ms on average without,
    with one in ten waiting a scheduler tick of 4 ms); it needs root or ``CAP_SYS_NICE`` (the runtime warns
    and runs without it otherwise). Plan such runs on ``ClusterSpec.calibrate(comm_priority=True)``, which
    measures the link the same way (:func:`fxpar.host.raise_comm_threads`).

    ``host_memory_reuse`` (default True): every rank keeps the memory a step frees for the next step instead of
    handing it back to the OS and faulting it in again (glibc's mmap and trim thresholds raised,
    :func:`fxpar.host.reuse_freed_memory`; where the C library is not glibc, nothing changes). A rank then holds
    its peak of freed host memory, as CUDA's caching allocator holds device memory. False: the C library's defaults.

    ``slowdown``: stragglers, ``{rank: factor}`` (a factor >= 1 per slowed worker rank; ``ClusterSpec.local(4,
    slowdown={1: 2.0})``), kept as sorted ``(rank, factor)`` pairs. A run's rank sleeps ``(factor - 1)`` times the
    compute seconds of each compute action it runs (the smaller of the action's wall time and its process CPU time,
    so a wait inside it does not count), so its compute takes ``factor`` times as long on a core of its own;
    ``estimate()`` adds ``factor - 1`` times that rank's compute seconds times its device's ``core_share`` (the CPU
    seconds per wall second where ranks share cores: :func:`cost_models.estimate.estimate`). :meth:`slowdown_of`
    reads it.

    ``devices``: a heterogeneous cluster (:meth:`heterogeneous`), one :class:`DeviceSpec` per worker rank, each with
    its own speed and memory (``device`` is then rank 0's); empty: every rank is a ``device``. :meth:`device_of`
    reads a rank's. ``estimate()`` costs each rank's graphs on its own device and checks its peak against its own
    memory; HetPipe's cut weighs each stage by its rank's speed (:meth:`speed_of`: the device's FLOP/s over the
    rank's ``slowdown``); a choice made once for several ranks (a bucket size, a sharding, a pipeline cut) is priced
    on the slowest of them (:meth:`slowest_device`, :meth:`devices_of`) and a memory limit on the smallest
    (:meth:`check_fits`). A run on this machine's CPU (``kind="cpu"`` devices) emulates the devices' speeds: each
    rank's compute takes as much longer as its device is slower than the fastest (:meth:`run_slowdown`), as a
    straggler's does. ``ClusterSpec.local(n, slowdown=...)`` is the same cluster as its :meth:`as_heterogeneous`.
    """
    device: DeviceSpec = field(default_factory=DeviceSpec)
    nodes: int = 1
    devices_per_node: int = 1
    intra_node: LinkSpec = field(default_factory=lambda: LinkSpec(1.5 * 2**30, 50e-6))
    inter_node: LinkSpec = field(default_factory=lambda: LinkSpec(1.25e9, 100e-6))
    backend: str = "gloo"
    cpu_servers: int = 0
    server_nodes: tuple | None = None
    comm_priority: bool = False
    host_memory_reuse: bool = True
    slowdown: tuple = ()
    devices: tuple = ()

    def __post_init__(self):
        if isinstance(self.devices, list):
            object.__setattr__(self, "devices", tuple(self.devices))
        if isinstance(self.slowdown, dict):       # {rank: factor} -> sorted (rank, factor) pairs: hashable, one order
            object.__setattr__(self, "slowdown", tuple(sorted(self.slowdown.items())))
        elif isinstance(self.slowdown, list):
            object.__setattr__(self, "slowdown", tuple(tuple(p) if isinstance(p, list) else p for p in self.slowdown))
        self.validate()

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def local(cls, world_size: int, **overrides) -> "ClusterSpec":
        """``world_size`` CPU processes on this machine, talking over gloo on 127.0.0.1.

        Loopback figures are measured on a 2-core machine (about 1.5 GiB/s for 128 MB
        all_reduce); run :meth:`calibrate` for this machine's own numbers.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ClusterSpecError(f"ClusterSpec.local(world_size={world_size!r}): world_size must be a positive int.")
        # ~8 us per aten op: eager dispatch of an FX graph on CPU, as calibrate() measures it here
        cpu = DeviceSpec("cpu", "cpu", _host_memory_bytes(), 50e9, 10e9, op_overhead_s=8e-6)
        return cls(**{"device": cpu, "nodes": 1, "devices_per_node": world_size, "backend": "gloo", **overrides})

    @classmethod
    def heterogeneous(cls, devices, nodes: int = 1, **overrides) -> "ClusterSpec":
        """A cluster whose worker ranks have devices of their own speed and memory: ``devices[r]`` is rank r's
        (:class:`DeviceSpec`), ``nodes`` machines of ``len(devices) // nodes`` ranks each (node-major, as every
        ClusterSpec); ``overrides`` are the other fields (links, backend, ``cpu_servers``, ``slowdown``)::

            fast = DeviceSpec("cpu", "fast", 8 * 2**30, 100e9, 20e9)
            slow = DeviceSpec("cpu", "slow", 4 * 2**30, 50e9, 10e9)
            ClusterSpec.heterogeneous([fast, slow, fast, slow])

        Links default to ``ClusterSpec.local``'s (gloo on this machine)."""
        devices = tuple(devices) if isinstance(devices, (list, tuple)) else devices
        if not isinstance(devices, tuple) or not devices or not all(isinstance(d, DeviceSpec) for d in devices):
            raise ClusterSpecError(f"ClusterSpec.heterogeneous({devices!r}): give a list of DeviceSpec, one per "
                                   "worker rank, e.g. [DeviceSpec('cpu', 'fast', 8 * 2**30, 100e9, 20e9), ...]")
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1 or len(devices) % nodes:
            raise ClusterSpecError(f"ClusterSpec.heterogeneous({len(devices)} devices, nodes={nodes!r}): nodes must be "
                                   f"a positive int dividing the {len(devices)} devices (the same number per node)")
        if "devices_per_node" in overrides or "device" in overrides:
            raise ClusterSpecError("ClusterSpec.heterogeneous(devices, nodes=...): the devices give each rank's device "
                                   "and, with nodes, the ranks per node; drop device= and devices_per_node=")
        base = cls.local(len(devices)) if "backend" not in overrides else cls(backend=overrides["backend"])
        kw = {"intra_node": base.intra_node, "inter_node": base.inter_node, **overrides}
        return cls(device=devices[0], nodes=nodes, devices_per_node=len(devices) // nodes, devices=devices, **kw)

    def as_heterogeneous(self) -> "ClusterSpec":
        """The same cluster with each straggler's slowdown folded into a device of its own (its FLOP/s and memory
        bandwidth divided by the factor, its fixed per-op and per-call seconds multiplied by it): ``estimate()``
        gives the same figures where each rank has a core of its own (``DeviceSpec.core_share`` 1; on shared cores
        a straggler's compute is priced at ``1 + (factor - 1) * core_share``, its devices here at ``factor``), the
        cut search the same cuts, and a CPU run emulates the same speeds while one rank
        is not slowed (:meth:`run_slowdown` is relative to the fastest device)."""
        if not self.slowdown:
            return self
        devices = tuple(_slowed_device(self.device_of(r), self.slowdown_of(r)) for r in range(self.world_size))
        return replace(self, device=devices[0], devices=devices, slowdown=())

    @classmethod
    def preset(cls, name: str, nodes: int = 1, gpus_per_node: int = 8) -> "ClusterSpec":
        """A cluster of well-known GPU nodes: ``"a100-80gb"``, ``"a100-40gb"``, ``"h100-80gb"`` (SXM), ``"h100-pcie"``,
        ``"h200"``, ``"v100-32gb"``, ``"v100-16gb"``, ``"p3.16xlarge"`` (AWS: 8 V100-16GB, 25 Gbps between
        machines) (vendor figures: the comment above ``PRESETS``), or a short name
        (``"a100"``, ``"h100"``, ``"v100"``: the SXM part with the most memory)."""
        key = PRESET_ALIASES.get(name, name)
        if key not in PRESETS:
            raise ClusterSpecError(f"unknown ClusterSpec preset {name!r}; choose one of "
                                   f"{sorted(PRESETS) + sorted(PRESET_ALIASES)}")
        p = PRESETS[key]
        return cls(device=p["device"], nodes=nodes, devices_per_node=gpus_per_node,
                   intra_node=p["intra"], inter_node=p["inter"], backend="nccl")

    @classmethod
    def calibrate(cls, world_size: int = 2, **kwargs) -> "ClusterSpec":
        """Measure this machine (collective bandwidth/latency by size, op throughput:
        :func:`fxpar.tools.calibrate.calibrate`, whose arguments it takes), and fxpar's runtime's own cost per
        graph it calls (``device.action_overhead_s``: :func:`fxpar.tools.runtime_cost.action_overhead_s` over one
        tiny op's cost in the same process, times the per-op cost the ranks measured, so that it scales as the ops
        do where ranks share cores). Runs :func:`fxpar.tools.runtime_cost.calibrate_cluster`."""
        # the one upward import of the floor: measuring needs the compiler and runtime, ClusterSpec is plain data
        from fxpar.tools.runtime_cost import calibrate_cluster
        return calibrate_cluster(world_size, **kwargs)

    # ---- queries ----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def link(self, a: int, b: int) -> LinkSpec:
        """The link class between ranks ``a`` and ``b``."""
        return self.intra_node if self.node_of(a) == self.node_of(b) else self.inter_node

    def slowdown_of(self, rank: int) -> float:
        """The factor rank ``rank``'s compute is slowed by (1.0: not a straggler)."""
        return float(dict(self.slowdown).get(rank, 1.0))

    def device_of(self, rank: int) -> DeviceSpec:
        """Rank ``rank``'s device: its own in a heterogeneous cluster, else ``device`` (server ranks: ``device``)."""
        return self.devices[rank] if self.devices and 0 <= rank < len(self.devices) else self.device

    def speed_of(self, rank: int) -> float:
        """Rank ``rank``'s compute speed, FLOP/s: its device's peak over its ``slowdown`` factor."""
        return self.device_of(rank).peak_flops / self.slowdown_of(rank)

    def devices_of(self, ranks=None) -> list:
        """The distinct devices of ``ranks`` (default: every worker rank) in rank order, each straggler's
        ``slowdown`` folded into its device (:meth:`as_heterogeneous`); ``[device]`` where every rank is one
        device and none is slowed. A choice made once for all of those ranks (a bucket size, a sharding) is priced on
        the slowest of them: synchronous training waits for it."""
        flat = self.as_heterogeneous()
        out: list = []
        for r in range(self.world_size) if ranks is None else ranks:
            d = flat.device_of(r)
            if d not in out:
                out.append(d)
        return out

    def slowest_device(self, ranks=None) -> DeviceSpec:
        """The device of the slowest of ``ranks`` (default: every worker rank) by :meth:`speed_of` (the lowest rank
        on a tie), a straggler's slowdown folded in (:meth:`as_heterogeneous`); ``device`` where every rank is one
        device and none is slowed."""
        ranks = range(self.world_size) if ranks is None else ranks
        return self.as_heterogeneous().device_of(min(ranks, key=lambda r: (self.speed_of(r), r)))

    def run_slowdown(self, rank: int) -> float:
        """How many times longer rank ``rank``'s compute takes in a run: its straggler factor, times, for CPU devices
        of a heterogeneous cluster (all emulated by this machine), the fastest device's FLOP/s over its own."""
        f = self.slowdown_of(rank)
        if self.devices and all(d.kind == "cpu" for d in self.devices):
            f *= max(d.peak_flops for d in self.devices) / self.device_of(rank).peak_flops
        return f

    def on_device(self, device: DeviceSpec) -> "ClusterSpec":
        """This cluster as if every rank were ``device`` (the cost models cost one rank's graphs on it)."""
        return replace(self, device=device, devices=())

    def with_world_size(self, world_size: int) -> "ClusterSpec":
        """The same machines, ``world_size`` ranks on one node (stragglers beyond them dropped; a heterogeneous
        cluster keeps its first ``world_size`` devices)."""
        if self.devices and world_size > len(self.devices):
            raise ClusterSpecError(f"ClusterSpec with {len(self.devices)} devices: cannot run {world_size} ranks on it; "
                                   "give one DeviceSpec per rank (ClusterSpec.heterogeneous)")
        return replace(self, nodes=1, devices_per_node=world_size, devices=self.devices[:world_size],
                       slowdown=tuple((r, f) for r, f in self.slowdown if r < world_size))

    # ---- checks -------------------------------------------------------------------------
    def validate(self) -> None:
        d = self.device
        problems = []
        for name in ("nodes", "devices_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ClusterSpecError(f"ClusterSpec({name}={v!r}): {name} must be a positive int.")
        _check_cpu_servers(self.cpu_servers, self.backend)
        _check_server_nodes(self.server_nodes, self.cpu_servers, self.nodes)
        _check_slowdown(self.slowdown, self.world_size)
        if not isinstance(self.comm_priority, bool):
            raise ClusterSpecError(f"ClusterSpec(comm_priority={self.comm_priority!r}): give True (gloo's "
                                   "communication threads under SCHED_FIFO on every rank) or False (as the OS "
                                   "schedules them).")
        if not isinstance(self.host_memory_reuse, bool):
            raise ClusterSpecError(f"ClusterSpec(host_memory_reuse={self.host_memory_reuse!r}): give True (every rank "
                                   "keeps the memory a step frees for the next, fxpar.host.reuse_freed_memory) or False "
                                   "(the C library's defaults).")
        if not isinstance(self.devices, tuple) or not all(isinstance(x, DeviceSpec) for x in self.devices):
            raise ClusterSpecError(f"ClusterSpec(devices={self.devices!r}): give a DeviceSpec per worker rank "
                                   "(ClusterSpec.heterogeneous([...])), or none (every rank a ClusterSpec.device)")
        for where, dev in [("device", d)] * (not self.devices) + [(f"devices[{r}]", x) for r, x in enumerate(self.devices)]:
            problems += _device_problems(dev, where)
        for lname in ("intra_node", "inter_node"):
            link = getattr(self, lname)
            for name in ("bandwidth", "latency"):
                v = getattr(link, name, None)
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    raise ClusterSpecError(f"ClusterSpec({lname}=LinkSpec({name}={v!r})): {name} must be a number "
                                           "(bandwidth in bytes/s, latency in seconds).")
        if self.nodes < 1 or self.devices_per_node < 1:
            problems.append(f"nodes={self.nodes}, devices_per_node={self.devices_per_node}: both must be >= 1")
        if self.devices and len(self.devices) != self.world_size:
            problems.append(f"devices: {len(self.devices)} DeviceSpec(s) for a world of {self.world_size} ranks "
                            f"({self.nodes} node(s) x {self.devices_per_node}); give one per worker rank")
        for name, link in (("intra_node", self.intra_node), ("inter_node", self.inter_node)):
            if link.bandwidth <= 0:
                problems.append(f"{name}.bandwidth={link.bandwidth}: a link needs a positive bandwidth (bytes/s)")
            if link.latency < 0:
                problems.append(f"{name}.latency={link.latency}: must be >= 0 seconds")
        if self.backend not in ("gloo", "nccl", "fake"):
            problems.append(f"backend={self.backend!r}: use 'gloo' (CPU), 'nccl' (GPU) or 'fake' (planning only)")
        if any(x.kind == "cpu" for x in (d, *self.devices)) and self.backend == "nccl":
            problems.append("backend='nccl' needs CUDA devices; use backend='gloo' for CPU devices")
        if problems:
            raise ClusterSpecError("invalid ClusterSpec:\n  - " + "\n  - ".join(problems))

    def check_fits(self, bytes_needed: int, what: str) -> None:
        """Raise if ``bytes_needed`` (e.g. one parameter) cannot fit in the memory of every worker rank's device (a
        heterogeneous cluster: its smallest)."""
        dev = min(self.devices or (self.device,), key=lambda d: d.memory_bytes)
        if bytes_needed > dev.memory_bytes:
            raise ClusterSpecError(
                f"{what} needs {bytes_needed} bytes but a {dev.name} has {dev.memory_bytes} bytes "
                "of memory; shard it (Strategy(tp=...) or zero=3) or use larger devices.")

    # ---- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["slowdown"] = [list(p) for p in self.slowdown]       # JSON's form: [[rank, factor], ...]
        d["devices"] = [asdict(x) for x in self.devices]
        return d

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_dict(cls, d: dict, source: str = "the ClusterSpec dict") -> "ClusterSpec":
        """Inverse of :meth:`to_dict`; every field is checked for presence and type, naming it and ``source``."""
        _check_fields(d, _TOP_FIELDS, "", source, required=("device", "nodes", "devices_per_node", "intra_node",
                                                            "inter_node"))
        _check_fields(d["device"], _DEVICE_FIELDS, "device.", source, required=())
        for link in ("intra_node", "inter_node"):
            _check_fields(d[link], _LINK_FIELDS, f"{link}.", source, required=("bandwidth", "latency"))
        for r, x in enumerate(d.get("devices", ())):
            _check_fields(x, _DEVICE_FIELDS, f"devices[{r}].", source, required=())
        return cls(device=DeviceSpec(**d["device"]), nodes=d["nodes"], devices_per_node=d["devices_per_node"],
                   intra_node=LinkSpec(**d["intra_node"]), inter_node=LinkSpec(**d["inter_node"]),
                   backend=d.get("backend", "gloo"), cpu_servers=int(d.get("cpu_servers", 0)),
                   server_nodes=None if d.get("server_nodes") is None else tuple(d["server_nodes"]),
                   comm_priority=d.get("comm_priority", False),
                   host_memory_reuse=d.get("host_memory_reuse", True),
                   slowdown=d.get("slowdown", ()),
                   devices=tuple(DeviceSpec(**x) for x in d.get("devices", ())))

    @classmethod
    def from_json(cls, text_or_path) -> "ClusterSpec":
        """A ClusterSpec from JSON text or the path of a file :meth:`to_json` wrote."""
        if isinstance(text_or_path, os.PathLike):
            text_or_path = os.fspath(text_or_path)
        if not isinstance(text_or_path, str):
            raise ClusterSpecError(f"ClusterSpec.from_json({text_or_path!r}): pass JSON text or the path of a file "
                                   "ClusterSpec.to_json(path) wrote.")
        text, source = text_or_path, "the JSON text"
        if not text_or_path.lstrip().startswith(("{", "[")):
            path = text_or_path
            if not os.path.isfile(path):
                where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
                raise ClusterSpecError(f"ClusterSpec.from_json({path!r}): there is no such file{where}. Pass the path of "
                                       "a file ClusterSpec.to_json(path) wrote, or the JSON text itself; "
                                       "ClusterSpec.local(n) or ClusterSpec.preset(...) make one from scratch.")
            with open(path) as f:
                text, source = f.read(), f"file {path!r}"
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            bad = text.splitlines()[e.lineno - 1].strip() if 0 < e.lineno <= len(text.splitlines()) else ""
            raise ClusterSpecError(f"ClusterSpec.from_json: {source} is not valid JSON: {e.msg} at line {e.lineno}, "
                                   f"column {e.colno} (`{bad}`). Fix it there, or write a fresh one with "
                                   "ClusterSpec.local(n).to_json(path).") from None
        return cls.from_dict(data, source)

    def __str__(self) -> str:
        d = self.device
        kinds = (" + ".join(f"{n} {x.name} ({x.memory_bytes / 2**30:.0f} GiB, {x.peak_flops / 1e12:.3g} TFLOP/s)"
                            for x, n in _counted(self.devices))
                 if self.devices else f"{d.name} ({d.memory_bytes / 2**30:.0f} GiB, {d.peak_flops / 1e12:.3g} TFLOP/s)")
        return (f"{self.nodes} node(s) x {self.devices_per_node} {kinds}, backend={self.backend}, intra {self.intra_node.bandwidth / 1e9:.3g} GB/s, "
                f"inter {self.inter_node.bandwidth / 1e9:.3g} GB/s"
                + (f", + {self.cpu_servers} CPU-only server rank(s) (parameter or summation servers)" if self.cpu_servers else "")
                + (", gloo's threads under SCHED_FIFO (comm_priority)" if self.comm_priority else "")
                + ("" if self.host_memory_reuse else ", freed host memory returned to the OS (host_memory_reuse=False)")
                + ("".join(f", rank {r} {f:g}x slower" for r, f in self.slowdown)))



def _counted(devices: tuple) -> list:
    """``[(device, how many)]`` in first-seen order."""
    out: dict = {}
    for x in devices:
        out[x] = out.get(x, 0) + 1
    return list(out.items())


def _device_problems(d: DeviceSpec, where: str) -> list:
    """What is wrong with device ``d`` (named ``where`` in the messages); a value of the wrong type raises."""
    problems = []
    for name in ("memory_bytes", "peak_flops", "mem_bandwidth", "op_overhead_s", "late_recv_s",
                 "collective_issue_s", "action_overhead_s", "comm_cpu_s", "comm_cpu_per_byte", "cold_op_s", "index_row_s",
                 "core_share"):
        v = getattr(d, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ClusterSpecError(f"{where}: DeviceSpec({name}={v!r}): {name} must be a number.")
    if d.memory_bytes <= 0:
        problems.append(f"{where}.memory_bytes={d.memory_bytes}: must be > 0")
    if d.peak_flops <= 0:
        problems.append(f"{where}.peak_flops={d.peak_flops}: must be > 0")
    if d.op_overhead_s < 0:
        problems.append(f"{where}.op_overhead_s={d.op_overhead_s}: must be >= 0 seconds")
    if d.late_recv_s < 0:
        problems.append(f"{where}.late_recv_s={d.late_recv_s}: must be >= 0 seconds")
    if d.collective_issue_s < 0:
        problems.append(f"{where}.collective_issue_s={d.collective_issue_s}: must be >= 0 seconds")
    if d.action_overhead_s < 0:
        problems.append(f"{where}.action_overhead_s={d.action_overhead_s}: must be >= 0 seconds")
    for name in ("comm_cpu_s", "comm_cpu_per_byte", "cold_op_s", "index_row_s"):
        if getattr(d, name) < 0:
            problems.append(f"{where}.{name}={getattr(d, name)}: must be >= 0 seconds")
    if not 0 < d.core_share <= 1:
        problems.append(f"{where}.core_share={d.core_share}: must be in (0, 1] (1: a core per rank)")
    if not isinstance(d.host_cores, int) or isinstance(d.host_cores, bool) or d.host_cores < 0:
        problems.append(f"{where}.host_cores={d.host_cores!r}: must be an int >= 0 (the cores the node's ranks share; "
                        "0: not known)")
    if not isinstance(d.collective_slots, int) or isinstance(d.collective_slots, bool) or d.collective_slots < 0:
        problems.append(f"{where}.collective_slots={d.collective_slots!r}: must be an int >= 0 (0: the backend's)")
    if d.mem_bandwidth <= 0:
        problems.append(f"{where}.mem_bandwidth={d.mem_bandwidth}: must be > 0")
    return problems


def _slowed_device(d: DeviceSpec, f: float) -> DeviceSpec:
    """``d`` ``f`` times slower: what a straggler of factor ``f`` costs (:func:`cost_models.simulate.slowed`)."""
    if f == 1:
        return d
    return replace(d, name=f"{d.name} /{f:g}", peak_flops=d.peak_flops / f, mem_bandwidth=d.mem_bandwidth / f,
                   op_overhead_s=d.op_overhead_s * f, action_overhead_s=d.action_overhead_s * f,
                   collective_issue_s=d.collective_issue_s * f, comm_cpu_s=d.comm_cpu_s * f,
                   comm_cpu_per_byte=d.comm_cpu_per_byte * f, cold_op_s=d.cold_op_s * f, index_row_s=d.index_row_s * f)


def _check_server_nodes(where, k: int, nodes: int) -> None:
    if where is None:
        return
    if not isinstance(where, (tuple, list)) or len(where) != k or any(
            not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < nodes for x in where):
        raise ClusterSpecError(f"ClusterSpec(server_nodes={where!r}, cpu_servers={k}, nodes={nodes}): give one worker "
                               f"node index in 0..{nodes - 1} per CPU server ({k} of them), or None for servers on "
                               "machines of their own.")


def _check_cpu_servers(k, backend: str) -> None:
    """BytePS's CPU summation servers: a count >= 0, on a backend that moves CPU tensors."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ClusterSpecError(f"ClusterSpec(cpu_servers={k!r}): the number of CPU-only summation servers must be an "
                               "int >= 0 (0: none; BytePS then sums by all-reduce among the workers).")
    if k and backend == "nccl":
        raise ClusterSpecError(f"ClusterSpec(cpu_servers={k}, backend='nccl'): NCCL moves CUDA tensors only, and a "
                               "CPU summation server holds none, so it cannot join the workers' NCCL group. Use "
                               "backend='gloo' (CPU tensors), or cpu_servers=0 (grad_sync='allreduce').")


def _check_slowdown(pairs, world_size: int) -> None:
    """Stragglers: ``(rank, factor)`` pairs, each rank a worker once, each factor a number >= 1."""
    fix = ("Give {rank: factor}, a factor >= 1 per slowed worker rank, e.g. ClusterSpec.local(4, slowdown={1: 2.0}) "
           "(rank 1's compute takes twice as long), or leave it out (no straggler).")
    ok = isinstance(pairs, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in pairs)
    if not ok:
        raise ClusterSpecError(f"ClusterSpec(slowdown={pairs!r}): {fix}")
    ranks = [r for r, _ in pairs]
    for r, f in pairs:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world_size:
            raise ClusterSpecError(f"ClusterSpec(slowdown={dict(pairs)!r}): rank {r!r} is not a worker rank "
                                   f"(0..{world_size - 1}). {fix}")
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not f >= 1:
            raise ClusterSpecError(f"ClusterSpec(slowdown={dict(pairs)!r}): rank {r}'s factor {f!r} must be a number "
                                   f">= 1 (1: as fast as the others). {fix}")
    if len(set(ranks)) != len(ranks):
        raise ClusterSpecError(f"ClusterSpec(slowdown={pairs!r}): a rank is named twice. {fix}")


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


_NUMBER = "a number"
_TOP_FIELDS = {"device": (dict, "an object {...} of DeviceSpec fields"), "nodes": (int, "a positive integer"),
               "devices_per_node": (int, "a positive integer"), "intra_node": (dict, "an object {bandwidth, latency}"),
               "inter_node": (dict, "an object {bandwidth, latency}"), "backend": (str, "'gloo', 'nccl' or 'fake'"),
               "cpu_servers": (int, "an integer >= 0 (CPU summation servers)"),
               "server_nodes": ((list, tuple, type(None)), "null or a list of node indices, one per CPU server"),
               "comm_priority": (bool, "true or false (gloo's threads under SCHED_FIFO)"),
               "host_memory_reuse": (bool, "true or false (ranks keep the memory a step frees)"),
               "slowdown": (list, "a list of [rank, factor] pairs (stragglers; a factor >= 1)"),
               "devices": (list, "a list of DeviceSpec objects, one per worker rank (empty: every rank is device)")}
_DEVICE_FIELDS = {"kind": (str, "'cpu' or 'cuda'"), "name": (str, "a string"), "memory_bytes": (int, "an integer (bytes)"),
                  "peak_flops": (float, _NUMBER + " (FLOP/s)"), "mem_bandwidth": (float, _NUMBER + " (bytes/s)"),
                  "efficiency": (dict, "an object {op class: fraction}"), "op_overhead_s": (float, _NUMBER + " (seconds)"),
                  "late_recv_s": (float, _NUMBER + " (seconds)"), "collective_issue_s": (float, _NUMBER + " (seconds)"),
                  "collective_slots": (int, "an integer >= 0 (0: the backend's)"),
                  "action_overhead_s": (float, _NUMBER + " (seconds)"), "comm_cpu_s": (float, _NUMBER + " (seconds)"),
                  "comm_cpu_per_byte": (float, _NUMBER + " (seconds per byte)"),
                  "cold_op_s": (float, _NUMBER + " (seconds)"), "index_row_s": (float, _NUMBER + " (seconds)"),
                  "core_share": (float, _NUMBER + " in (0, 1] (a rank's share of a core)"),
                  "host_cores": (int, "an integer >= 0 (the cores the node's ranks share; 0: not known)")}
_LINK_FIELDS = {"bandwidth": (float, _NUMBER + " (bytes/s)"), "latency": (float, _NUMBER + " (seconds)")}


def _check_fields(d, schema: dict, prefix: str, source: str, required: tuple) -> None:
    """Every key of ``d`` known, every required one present, each value of its type (ints where floats go)."""
    if not isinstance(d, dict):
        raise ClusterSpecError(f"ClusterSpec JSON ({source}): {prefix.rstrip('.') or 'the top level'} is "
                               f"{d!r}; it must be an object {{...}} with fields {sorted(schema)} "
                               "(ClusterSpec.to_json() writes them all).")
    unknown = sorted(set(d) - set(schema))
    if unknown:
        raise ClusterSpecError(f"ClusterSpec JSON ({source}): unknown field(s) {[prefix + k for k in unknown]}; the "
                               f"fields are {[prefix + k for k in schema]}. Fix the name or remove it.")
    missing = [prefix + k for k in required if k not in d]
    if missing:
        raise ClusterSpecError(f"ClusterSpec JSON ({source}) has no {', '.join(missing)}: add it (ClusterSpec.to_json() "
                               "writes every field; ClusterSpec.local(n).to_dict() shows the defaults).")
    for k, v in d.items():
        want, text = schema[k]
        if want is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        elif want is int:
            ok = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
        else:
            ok = isinstance(v, want)
        if not ok:
            raise ClusterSpecError(f"ClusterSpec JSON ({source}): {prefix}{k} is {v!r} (a {type(v).__name__}); it must "
                                   f"be {text}. Fix that field.")
