"""Operations whose result depends on where a rank sits along a mesh axis, written rank-independently.

Tensor parallelism cuts a whole tensor into a rank's piece (``R -> S``: a local slice) and makes a
whole value a partial sum (``R -> P``: the first rank along the axis keeps it, the others hold
zeros). Both need the rank's coordinate along the axis. Written with that coordinate baked in,
every rank of a stage would need a graph of its own; written as these ops, the coordinate is read
at run time from the group the axis names (``"fxpar:tp"``, bound per rank by the runtime exactly as
a collective's group is), so the ranks of a stage share one graph, which is what
``program.graphs(rank)`` shows::

    chunk = fxpar.axis_chunk(view_3, 2, 2, 'fxpar:tp')     # this rank's half of dim 2 (a contiguous copy)
    keep = fxpar.first_on_axis(fc2_bias, 'fxpar:tp')        # fc2_bias on the axis's first rank, zeros elsewhere

Megatron's vocabulary-parallel embedding and its backward (below) read it the same way to find the
rows a rank holds. All are functional (a new tensor, no aliasing) and have fake-tensor rules, so
graphs holding them trace, propagate shapes and run under torch.compile's graph capture.
"""
from __future__ import annotations

import torch

__all__ = ["axis_chunk", "first_on_axis", "axis_index", "vocab_embedding", "vocab_embedding_backward", "rank_bernoulli",
           "seed_rank_stream", "rank_stream_state", "set_rank_stream_state", "RANK_STREAM_OFFSET"]

_LIB = torch.library.Library("fxpar", "FRAGMENT")
_LIB.define("axis_chunk(Tensor x, int dim, int n, str group) -> Tensor")
_LIB.define("first_on_axis(Tensor x, str group) -> Tensor")


def axis_index(group: str) -> int:
    """This rank's coordinate along the axis whose process group the runtime bound ``group`` to."""
    if group.startswith("fxpar:"):
        raise RuntimeError(f"a graph op names the mesh axis group {group!r}, which was never bound to a process "
                           "group: run the graph through fxpar's executor (program.run_local / program.runner), "
                           "or bind it with fxpar.runtime.executor.bind_groups(gm, {axis: group name})")
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group).rank()


def _chunk(x, dim, n, group):
    size = x.shape[dim] // n
    return x.narrow(dim, axis_index(group) * size, size).clone(memory_format=torch.contiguous_format)


def _chunk_fake(x, dim, n, group):
    shape = list(x.shape)
    shape[dim] //= n
    return x.new_empty(shape)


def _first(x, group):
    return x.clone() if axis_index(group) == 0 else torch.zeros_like(x)


_LIB.impl("axis_chunk", _chunk, "CompositeExplicitAutograd")
_LIB.impl("first_on_axis", _first, "CompositeExplicitAutograd")
torch.library.register_fake("fxpar::axis_chunk", _chunk_fake, lib=_LIB)
torch.library.register_fake("fxpar::first_on_axis", lambda x, group: torch.empty_like(x), lib=_LIB)

axis_chunk = torch.ops.fxpar.axis_chunk.default
first_on_axis = torch.ops.fxpar.first_on_axis.default


# --- vocabulary-parallel embedding (Shoeybi et al. 2019, Megatron-LM, §3) ---------------------------------
# The embedding weight [V, D] split over the vocabulary: a rank holds rows [c*V/n, (c+1)*V/n) for its
# coordinate c. The lookup of whole indices gives a partial sum over the axis (each index is found on
# exactly one rank; the others contribute zero rows), and the weight's gradient is split like the weight
# (each rank scatters only the rows it holds)::
#
#     emb = fxpar.vocab_embedding(wte_weight, idx, 'fxpar:tp')              # [B, T, D], a partial sum over tp
#     g = fxpar.vocab_embedding_backward(grad, idx, 32, -1, False, 'fxpar:tp')   # [32, D]: this rank's rows

_LIB.define("vocab_embedding(Tensor weight, Tensor indices, str group) -> Tensor")
_LIB.define("vocab_embedding_backward(Tensor grad, Tensor indices, int rows, int padding_idx, bool scale_grad_by_freq, "
            "str group) -> Tensor")


def _vocab_range(indices, rows, group):
    """This rank's indices shifted to its rows (0 where out of range) and the mask of those in range."""
    start = axis_index(group) * rows
    local = indices - start
    mine = (local >= 0) & (local < rows)
    return torch.where(mine, local, torch.zeros_like(local)), mine


def _vocab_embedding(weight, indices, group):
    local, mine = _vocab_range(indices, weight.shape[0], group)
    return torch.nn.functional.embedding(local, weight).masked_fill(~mine.unsqueeze(-1), 0)


def _vocab_embedding_backward(grad, indices, rows, padding_idx, scale_grad_by_freq, group):
    """``aten.embedding_dense_backward`` restricted to this rank's rows: positions whose index another rank holds
    contribute nothing; ``padding_idx`` (global) gets no gradient; ``scale_grad_by_freq`` divides by the count of
    each index over all the indices, as the whole op does."""
    local, mine = _vocab_range(indices, rows, group)
    keep = mine & (indices != padding_idx) if padding_idx >= 0 else mine
    g = grad.masked_fill(~keep.unsqueeze(-1), 0)
    if scale_grad_by_freq:
        counts = torch.bincount(indices.reshape(-1)).to(grad.dtype)
        g = g / counts[indices].unsqueeze(-1)
    return torch.ops.aten.embedding_dense_backward.default(g, local, rows, -1, False)


def _vocab_embedding_fake(weight, indices, group):
    return weight.new_empty(tuple(indices.shape) + (weight.shape[1],))


def _vocab_embedding_backward_fake(grad, indices, rows, padding_idx, scale_grad_by_freq, group):
    return grad.new_empty((rows, grad.shape[-1]))


_LIB.impl("vocab_embedding", _vocab_embedding, "CompositeExplicitAutograd")
_LIB.impl("vocab_embedding_backward", _vocab_embedding_backward, "CompositeExplicitAutograd")
torch.library.register_fake("fxpar::vocab_embedding", _vocab_embedding_fake, lib=_LIB)
torch.library.register_fake("fxpar::vocab_embedding_backward", _vocab_embedding_backward_fake, lib=_LIB)

vocab_embedding = torch.ops.fxpar.vocab_embedding.default
vocab_embedding_backward = torch.ops.fxpar.vocab_embedding_backward.default


# --- random numbers on split tensors (Megatron-LM's RNG tracker; Shoeybi et al. 2019, §3) --------------------
# A random op whose output tensor parallelism keeps whole draws from torch's default generator, which every rank
# of a tp group seeds alike (``fxpar.runtime.groups.seed_rank``): each draws the same mask. A dropout whose output
# is split draws its piece from this rank's own stream instead, so the tp ranks' pieces are independent draws:
#
#     bernoulli = fxpar.rank_bernoulli(expand, 0.9)     # this rank's piece of the mask, from its own stream
#
# The stream is one generator per device type, seeded ``RANK_STREAM_OFFSET + seed + rank`` (docs/semantics.md,
# "Random numbers under tensor parallelism").

_LIB.define("rank_bernoulli(Tensor self, float p) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))

RANK_STREAM_OFFSET = 1 << 32        # rank streams never share a seed with a default generator (seed + rank)
_STREAM: dict = {"seed": None, "gens": {}}   # this process's rank stream: its seed, {device type: generator}


def seed_rank_stream(seed: int) -> None:
    """Seed this process's rank stream with ``seed`` (every device's generator starts afresh from it)."""
    _STREAM["seed"], _STREAM["gens"] = int(seed), {}


def _generator(device: torch.device) -> torch.Generator:
    gens = _STREAM["gens"]
    if device.type not in gens:
        seed = _STREAM["seed"]
        if seed is None:                  # never seeded (a graph run outside fxpar's executor): from torch's seed
            seed = RANK_STREAM_OFFSET + torch.initial_seed()
        gens[device.type] = torch.Generator(device=device).manual_seed(seed)
    return gens[device.type]


def rank_stream_state() -> dict:
    """The rank stream's seed and each device generator's state (a checkpoint's ``extra["rng"]``)."""
    return {"seed": _STREAM["seed"], "states": {d: g.get_state() for d, g in _STREAM["gens"].items()}}


def set_rank_stream_state(state: dict) -> None:
    """Restore what :func:`rank_stream_state` returned."""
    _STREAM["seed"], _STREAM["gens"] = state["seed"], {}
    for d, st in state["states"].items():
        _generator(torch.device(d)).set_state(st)


def _rank_bernoulli(x, p):
    return torch.bernoulli(x, p, generator=_generator(x.device))


_LIB.impl("rank_bernoulli", _rank_bernoulli, "CompositeExplicitAutograd")
torch.library.register_fake("fxpar::rank_bernoulli", lambda x, p: torch.empty_like(x), lib=_LIB)

rank_bernoulli = torch.ops.fxpar.rank_bernoulli.default
