"""What the automatic planner knows of a model before it builds any program: one eager forward and backward on
fake tensors (no memory, no values), at two microbatch sizes, under a dispatch mode that costs every aten op with
the rules of :mod:`cost_models.compute`.

    prof = profile_model(model, example, loss_fn, optimizer)
    prof.blocks            # the repeated blocks ("blocks", 12), or None
    prof.time(b, tp, device)        # forward / backward seconds per part at microbatch size b, tp-way split
    prof.saved(b, tp, policy)       # activation bytes a microbatch keeps for its backward, per part

Every figure is affine in the microbatch size (a FLOP or byte count of an op is a polynomial of degree one in the
rows it touches), so the two runs give it at every size. Ops inside a repeated block are attributed to the block;
what runs before the first block (embeddings) and after the last (final norm, head, loss) to ``pre`` / ``post``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from cost_models.compute import op_cost, tensor_bytes

__all__ = ["ModelProfile", "profile_model", "find_blocks", "find_heads", "PART_NAMES"]

PART_NAMES = ("pre", "block", "post")
SPLIT_CLASSES = ("matmul", "attention", "conv")      # op classes tensor parallelism divides among the tp ranks
_HEAD_ATTRS = ("heads", "num_heads", "n_head", "num_attention_heads", "n_heads")


def find_blocks(model: torch.nn.Module) -> tuple | None:
    """``(path, [child modules])`` of the longest run of repeated blocks: a ModuleList/Sequential whose children
    have one type and the same parameter shapes (at least two of them, each holding parameters); None without."""
    best = None
    for path, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        kids = list(mod.children())
        if len(kids) < 2 or len({type(k) for k in kids}) != 1:
            continue
        shapes = [tuple(tuple(p.shape) for p in k.parameters()) for k in kids]
        if not shapes[0] or len(set(shapes)) != 1:
            continue
        if best is None or len(kids) > len(best[1]):
            best = (path, kids)
    return best


def find_heads(model: torch.nn.Module) -> int | None:
    """The attention head count a module or a Hugging Face config declares, or None."""
    cfg = getattr(model, "config", None)
    for obj in [cfg] + [m for _, m in model.named_modules()]:
        for a in _HEAD_ATTRS:
            v = getattr(obj, a, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


@dataclass
class _Run:
    """One probe at microbatch size ``b``."""
    b: int
    flops: list = field(default_factory=list)
    bytes: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    cls: list = field(default_factory=list)
    part: list = field(default_factory=list)        # index into PART_NAMES
    bwd: list = field(default_factory=list)         # 1 if the op ran in backward
    sharded: list = field(default_factory=list)     # 1 if a forward op of a block works on tp-split tensors
    saved_kinds: dict = field(default_factory=dict)  # (part, a matmul made it?) -> bytes kept for backward
    block_in: float = 0.0                           # bytes of one block's input
    linear_out: list = field(default_factory=list)  # bytes of each nn.Linear's output, in forward order
    largest: float = 0.0                            # the largest tensor an op made


class _Counter(TorchDispatchMode):
    """Costs every aten op it sees; remembers which op class made each storage (selective recompute keeps the
    matmul outputs)."""

    def __init__(self, run: _Run, where: list):
        super().__init__()
        self.run, self.where = run, where
        self.made_by: dict = {}
        # Megatron's split inside a block: a Linear whose input is whole is column-parallel (its output is split
        # over the tp ranks), one whose input is split is row-parallel (its output is summed whole); every other
        # op on a split tensor (the heads' attention, the MLP's activation) works on the rank's share
        self.split_keys: set = set()
        self.split_held: list = []      # the split tensors themselves: a freed storage's key may come back on another
        self.linears: list = []         # the block Linears running now: True where row-parallel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        c = op_cost(func, list(args), out)
        run = self.run
        split = False
        if self.where[0] == 1 and not self.where[1] and not self.linears:
            split = any(_key(a) in self.split_keys for a in args if isinstance(a, torch.Tensor))
            if split:
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor):
                        self.split_keys.add(_key(t))
                        self.split_held.append(t)
        if func.namespace == "aten":      # every aten op pays the device's dispatch cost, a view too
            run.sharded.append(1 if split else 0)
            run.flops.append(float(c.flops))
            run.bytes.append(float(c.bytes))
            run.rows.append(float(c.rows))
            run.cls.append(c.op_class)
            run.part.append(self.where[0])
            run.bwd.append(self.where[1])
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                run.largest = max(run.largest, float(tensor_bytes(t)))
                self.made_by[_key(t)] = c.op_class
        return out


def _key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


class _Unpatch:
    """Removes the instance ``forward`` :func:`_probe` set on a block (a handle like a hook's)."""

    def __init__(self, mod):
        self.mod = mod

    def remove(self):
        self.mod.__dict__.pop("forward", None)


def _probe(model, example: tuple, b: int, loss_fn, blocks, params: dict, mode, once: bool) -> _Run:
    """One forward + backward of ``model`` at microbatch size ``b`` on fake (or meta) tensors. ``once``: the first
    block runs, every later one passes its input through (the blocks are alike: one is costed for all)."""
    run = _Run(b)
    where = [0, 0]                  # [part, in backward]
    counter = _Counter(run, where)
    param_keys = {_key(p) for p in params.values()}
    seen: set = set()
    handles = []

    def pre(mod, args):
        where[0] = 1
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if t is not None and not run.block_in:
            run.block_in = float(tensor_bytes(t))

    def post(mod, args, out):
        where[0] = 2
    first: list = []

    def keep_first(mod, args, out):
        first.append(out)

    def skip(*args, **kwargs):      # a later block: its input goes through, shaped as the first block's output
        x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        out = first[0]
        return x if isinstance(out, torch.Tensor) else type(out)((x, *out[1:]))
    for i, mod in enumerate(blocks[1] if blocks else ()):
        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        if once and i == 0:
            handles.append(mod.register_forward_hook(keep_first))
        elif once:
            mod.forward = skip
            handles.append(_Unpatch(mod))
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            handles.append(mod.register_forward_hook(
                lambda m, a, o: run.linear_out.append(float(tensor_bytes(o)))))

    def lin_pre(mod, args):
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        counter.linears.append(t is not None and _key(t) in counter.split_keys)

    def lin_post(mod, args, out):
        row = counter.linears.pop()
        if not row and isinstance(out, torch.Tensor) and where[0] == 1 and not where[1]:
            counter.split_keys.add(_key(out))
            counter.split_held.append(out)
    for blk in (blocks[1] if blocks else ()):
        for mod in blk.modules():
            if isinstance(mod, torch.nn.Linear):
                handles += [mod.register_forward_pre_hook(lin_pre), mod.register_forward_hook(lin_post)]

    def pack(t):
        k = _key(t)
        if k not in param_keys and k not in seen:
            seen.add(k)
            n = float(t.untyped_storage().nbytes()) if hasattr(t, "untyped_storage") else float(tensor_bytes(t))
            mm = counter.made_by.get(k) in SPLIT_CLASSES
            run.saved_kinds[(where[0], mm)] = run.saved_kinds.get((where[0], mm), 0.0) + n
        return t
    try:
        with mode:
            inputs = [torch.empty((b, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in example]
            with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                n_in = len(inputs) - (1 if loss_fn is not None else 0)
                out = torch.func.functional_call(model, params, tuple(inputs[:n_in]))
                loss = loss_fn(out, inputs[n_in]) if loss_fn is not None else _loss_of(out)
                where[1] = 1
                trainable = [p for p in params.values() if p.requires_grad]
                torch.autograd.grad(loss, trainable, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return run


def _loss_of(out):
    if isinstance(out, torch.Tensor):
        return out
    loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None:
        raise TypeError("the model returned no loss and no loss_fn was given")
    return loss


@dataclass
class ModelProfile:
    """The model's work and memory as affine functions of the microbatch size (see the module docstring)."""
    n_blocks: int
    block_path: str | None
    heads: int | None
    block_param_bytes: float          # one block's parameters
    rest_param_bytes: float           # the parameters outside the blocks
    param_bytes: float
    n_linear: int
    param_tensors: int
    leaf_modules: int                 # modules holding parameters directly (the finest a pipeline cut can go)
    b0: int
    b1: int
    block_runs: int                   # blocks the probe ran (1: the first stood for all; at least 1)
    f0: np.ndarray = None
    f1: np.ndarray = None
    y0: np.ndarray = None
    y1: np.ndarray = None
    rows: np.ndarray = None
    cls: list = None
    part: np.ndarray = None
    bwd: np.ndarray = None
    sharded: np.ndarray = None
    runs: tuple = ()
    _cache: dict = field(default_factory=dict)

    def _affine(self, a: float, c: float, b: float) -> float:
        return a + (c - a) * (b - self.b0) / (self.b1 - self.b0)

    def time(self, b: float, tp: int, device) -> dict:
        """Seconds of forward and backward per part at microbatch size ``b`` with the split ops divided ``tp``
        ways: ``{("pre"|"block"|"post", "fwd"|"bwd"): s}``; ``"block"`` is one block."""
        key = (b, tp, device)          # a DeviceSpec is frozen: equal devices price alike
        got = self._cache.get(key)
        if got is not None:
            return got
        eff = device.efficiency or {}
        t = (b - self.b0) / (self.b1 - self.b0)
        f = self.f0 + (self.f1 - self.f0) * t
        y = self.y0 + (self.y1 - self.y0) * t
        split = np.array([c in SPLIT_CLASSES for c in self.cls], dtype=float)
        shard = np.maximum(split, self.sharded) if self.sharded is not None else split
        peak = np.array([device.peak_flops * eff.get(c, eff.get("compute", 1.0)) for c in self.cls])
        roof = np.maximum(f / peak, y / (device.mem_bandwidth * eff.get("memory", 1.0)))
        roof_tp = roof / (1.0 + (tp - 1) * shard)
        if tp > 1:      # backward's other ops work on split tensors in the share its forward's other ops do
            fo = (self.bwd == 0) & (split == 0)
            whole = float(roof[fo].sum())
            share = float(roof_tp[fo].sum()) / whole if whole else 1.0
            roof_tp = np.where((self.bwd == 1) & (split == 0), roof * share, roof_tp)
        secs = roof_tp + self.rows * getattr(device, "index_row_s", 0.0) + getattr(device, "op_overhead_s", 0.0)
        out = {}
        for p, name in enumerate(PART_NAMES):
            for w, phase in ((0, "fwd"), (1, "bwd")):
                sel = (self.part == p) & (self.bwd == w)
                out[(name, phase)] = float(secs[sel].sum()) / (self.block_runs if name == "block" else 1)
        # backward ops run outside the module hooks: spread them over the parts as their forward is spread
        fwd = float(secs[self.bwd == 0].sum())
        bwd = float(secs[self.bwd == 1].sum())
        for n in PART_NAMES:
            out[(n, "bwd")] = out[(n, "fwd")] * (bwd / fwd if fwd else 2.0)
        matmul_fwd = {}
        for p, name in enumerate(PART_NAMES):
            sel = (self.part == p) & (self.bwd == 0) & (split > 0)
            matmul_fwd[name] = float(secs[sel].sum()) / (self.block_runs if name == "block" else 1)
        out["split_fwd"] = matmul_fwd
        self._cache[key] = out
        return out

    def saved(self, b: float, tp: int, policy: str) -> dict:
        """Activation bytes one microbatch keeps for its backward, per part (``"block"``: one block), under the
        recompute ``policy`` (``"full"``: a block keeps its input; ``"selective"``: the matmul outputs)."""
        r0, r1 = self.runs
        out = {}
        for p, name in enumerate(PART_NAMES):
            mm = self._affine(r0.saved_kinds.get((p, True), 0.0), r1.saved_kinds.get((p, True), 0.0), b) / tp
            other = self._affine(r0.saved_kinds.get((p, False), 0.0), r1.saved_kinds.get((p, False), 0.0), b)
            n = mm + other
            if name == "block":
                n /= self.block_runs
                if policy == "full":
                    n = self.block_input(b)
                elif policy == "selective":
                    n = mm / self.block_runs + self.block_input(b)
            out[name] = n
        out["one_block"] = (self._affine(r0.saved_kinds.get((1, True), 0.0), r1.saved_kinds.get((1, True), 0.0), b) / tp
                            + self._affine(r0.saved_kinds.get((1, False), 0.0), r1.saved_kinds.get((1, False), 0.0),
                                           b)) / self.block_runs
        return out

    def block_input(self, b: float) -> float:
        return self._affine(self.runs[0].block_in, self.runs[1].block_in, b)

    def linear_pairs(self, b: float) -> list:
        """Bytes of the output of the second Linear of each consecutive pair (where a row-parallel Linear sums)."""
        r0, r1 = self.runs
        return [self._affine(x, y, b) for x, y in zip(r0.linear_out[1::2], r1.linear_out[1::2])]

    def largest(self, b: float) -> float:
        return self._affine(self.runs[0].largest, self.runs[1].largest, b)


def _in_dtype(t: torch.Tensor, dtype) -> torch.Tensor:
    """``t`` in the compute dtype ``dtype`` where it holds floating point (a leaf again, with its requires_grad)."""
    if dtype is None or not t.is_floating_point() or t.dtype == dtype:
        return t
    return t.detach().to(dtype).requires_grad_(t.requires_grad)


def profile_model(model: torch.nn.Module, example: tuple, loss_fn, b0: int = 2, b1: int = 4,
                  dtype: torch.dtype | None = None) -> ModelProfile:
    """Run the model at microbatch sizes ``b0`` and ``b1`` on fake tensors (on the model's own device: a ``meta``
    model stays on ``meta``) and fit every figure. ``dtype``: the compute dtype of mixed precision (the floating
    parameters, buffers and inputs cast to it, as ``Strategy(precision=...)`` casts them at the start of a step);
    the parameter bytes stay the model's own (the master copy)."""
    blocks = find_blocks(model)
    named = dict(model.named_parameters(remove_duplicate=False))
    uniq = {}
    for k, v in named.items():
        uniq.setdefault(id(v), (k, v))
    if all(v.device.type == "meta" for _, v in uniq.values()):      # meta runs as it is, and faster than fake
        mode = contextlib.nullcontext()
        cast = {id(v): _in_dtype(v, dtype) for _, v in uniq.values()}
        params = {**{k: cast[id(v)] for k, v in named.items()},
                  **{k: _in_dtype(v, dtype) for k, v in model.named_buffers()}}
        example = [_in_dtype(t.to("meta"), dtype) for t in example]
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            fakes = {id(v): mode.from_tensor(v) for _, v in uniq.values()}
            for v, f in ((v, fakes[id(v)]) for _, v in uniq.values()):
                f.requires_grad_(v.requires_grad)
            fakes = {i: _in_dtype(f, dtype) for i, f in fakes.items()}
            params = {k: fakes[id(v)] for k, v in named.items()}
            params.update({k: _in_dtype(mode.from_tensor(v), dtype) for k, v in model.named_buffers()})
            example = [_in_dtype(mode.from_tensor(t), dtype) for t in example]
    once = blocks is not None
    try:
        runs = tuple(_probe(model, example, b, loss_fn, blocks, params, mode, once) for b in (b0, b1))
    except Exception:  # noqa: BLE001 - a block whose output the pass-through cannot stand in for: run them all
        if not once:
            raise
        once = False
        runs = tuple(_probe(model, example, b, loss_fn, blocks, params, mode, once) for b in (b0, b1))
    r0, r1 = runs
    if len(r0.flops) != len(r1.flops):
        raise RuntimeError(f"{type(model).__name__} runs {len(r0.flops)} ops at batch {b0} and {len(r1.flops)} at "
                           f"batch {b1}: its forward depends on the batch size")
    pbytes = {id(v): float(v.numel() * v.element_size()) for _, v in uniq.values()}
    block_ids = {id(p) for k in (blocks[1] if blocks else ()) for p in k.parameters()}
    n_blocks = len(blocks[1]) if blocks else 0
    block_bytes = sum(pbytes[i] for i in block_ids) / n_blocks if n_blocks else 0.0
    total = sum(pbytes.values())
    return ModelProfile(
        n_blocks=n_blocks, block_path=blocks[0] if blocks else None, heads=find_heads(model),
        block_param_bytes=block_bytes, rest_param_bytes=total - block_bytes * n_blocks, param_bytes=total,
        param_tensors=len(uniq), n_linear=sum(isinstance(m, torch.nn.Linear) for m in model.modules()),
        leaf_modules=sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False))),
        b0=b0, b1=b1, block_runs=1 if once else max(n_blocks, 1), f0=np.array(r0.flops), f1=np.array(r1.flops),
        y0=np.array(r0.bytes), y1=np.array(r1.bytes),
        rows=np.array(r0.rows), cls=r0.cls, part=np.array(r0.part), bwd=np.array(r0.bwd),
        sharded=np.array(r0.sharded, dtype=float), runs=runs)
