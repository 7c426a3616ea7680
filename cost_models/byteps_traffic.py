"""BytePS's traffic split between GPU workers and CPU summation servers (Jiang et al., OSDI'20).

BytePS has every machine run a *summation service* (SS) and every GPU machine a *communication service*
that pushes each gradient partition to the SS that owns it and pulls the sum back. With ``n`` GPU workers and
``k`` CPU-only servers, a fraction ``x`` of every bucket of ``M`` bytes is owned by the servers (``x/k`` each)
and the rest, ``1 - x``, by the workers' own summation services (``(1-x)/n`` each; among the workers that part
moves exactly like a reduce-scatter + all-gather, i.e. a ring all-reduce). Bytes each machine sends per bucket
(received bytes are the same by symmetry):

    worker:  x·M  (push to the servers)  +  2(n-1)/n · (1-x)·M   (the workers' part)
    server:  n · (x/k)·M                 (the sums pulled back by the n workers)

Every machine has one NIC of the same bandwidth, so the step's communication time is the larger of the two.
It is smallest when they are equal, ``x + 2(n-1)(1-x)/n = n·x/k``, which gives the paper's optimum

    each server's share   x/k = 2(n-1) / (n² + kn - 2k)
    each worker's share (1-x)/n = (n-k) / (n² + kn - 2k)
    bytes per machine         = 2n(n-1) / (n² + kn - 2k) · M

At ``k = 0`` this is the ring all-reduce's ``2(n-1)/n · M``; at ``k = n`` it is the non-colocated parameter
server's ``M`` (``x = 1``). More servers than workers cannot help (the workers' ``M`` is the floor): ``x`` stays 1
and each server holds ``1/k``. The gain over all-reduce is ``(n² + kn - 2k) / n²`` for ``k <= n``.

The graph holds whole elements: each server's partition of a bucket of ``V`` elements is ``round(V·x/k)``
(:func:`split_bucket`), the workers keep the rest. Pure arithmetic: no fxpar, no torch.

:func:`predict` is the paper's model: every transfer pipelined, so a machine's time is its bytes over its NIC.
``estimate()`` costs what the graphs and ``fxpar.runtime.server`` do instead (``cost_models.comm.
server_exchange_cost``): per partition, all ``n`` pushes into the server, its sum, then ``n`` pulls out, one
partition after another, each worker's all-reduce part a ring of its own.
"""
from __future__ import annotations

__all__ = ["server_share", "worker_share", "split_bucket", "bytes_per_worker", "bytes_per_server",
           "allreduce_bytes", "gain_over_allreduce", "predict"]


def server_share(n: int, k: int) -> float:
    """The fraction of every bucket each of the ``k`` CPU servers sums: ``2(n-1)/(n²+kn-2k)`` (``1/k`` once
    ``k > n``; 0 without servers or with one worker, where there is nothing to sum)."""
    if k <= 0 or n <= 1:
        return 0.0
    if k >= n:
        return 1.0 / k
    return 2 * (n - 1) / (n * n + k * n - 2 * k)


def worker_share(n: int, k: int) -> float:
    """The fraction of every bucket each worker's own summation service sums: ``(n-k)/(n²+kn-2k)``."""
    if n <= 1:
        return 1.0
    return (1.0 - k * server_share(n, k)) / n


def split_bucket(numel: int, n: int, k: int) -> tuple:
    """``(worker elements, elements per server)`` of a bucket of ``numel`` elements: each server gets
    ``round(numel · server_share)`` (so ``k`` of them never exceed the bucket), the workers' all-reduce the rest."""
    if k <= 0:
        return numel, 0
    per = min(int(numel * server_share(n, k) + 0.5), numel // k)
    return numel - k * per, per


def bytes_per_worker(nbytes: float, n: int, k: int) -> float:
    """Bytes each worker sends (and receives) for a bucket of ``nbytes`` under the optimal split."""
    x = k * server_share(n, k)
    return x * nbytes + allreduce_bytes((1 - x) * nbytes, n)


def bytes_per_server(nbytes: float, n: int, k: int) -> float:
    """Bytes each CPU server sends (and receives) for a bucket of ``nbytes``: ``n`` pushes in, ``n`` sums out."""
    return n * server_share(n, k) * nbytes if k > 0 else 0.0


def allreduce_bytes(nbytes: float, n: int) -> float:
    """A ring all-reduce's bytes sent per rank: ``2(n-1)/n · nbytes``."""
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def gain_over_allreduce(n: int, k: int) -> float:
    """All-reduce's bytes per worker over BytePS's (the busiest machine's): ``(n²+kn-2k)/n²`` for ``k <= n``."""
    ar = allreduce_bytes(1.0, n)
    ps = max(bytes_per_worker(1.0, n, k), bytes_per_server(1.0, n, k))
    return ar / ps if ps else 1.0


def predict(bucket_bytes, n: int, k: int, bandwidth: float, latency: float = 0.0) -> dict:
    """Communication of one step whose buckets have ``bucket_bytes``, every machine on a NIC of ``bandwidth``
    bytes/s: bytes per worker and per server, and the time against a ring all-reduce of the same buckets (each
    bucket: the ring's ``2(n-1)`` latencies against a push and a pull)."""
    total = float(sum(bucket_bytes))
    w, s = bytes_per_worker(total, n, k), bytes_per_server(total, n, k)
    ar = allreduce_bytes(total, n)
    steps = len(bucket_bytes)
    t_ar = ar / bandwidth + steps * 2 * (n - 1) * latency
    x = k * server_share(n, k)
    lat = steps * (2 * latency + (2 * (n - 1) * latency if x < 1 else 0.0))
    t = max(w, s) / bandwidth + lat
    return {"worker_bytes": w, "server_bytes": s, "allreduce_bytes": ar, "time_s": t, "allreduce_time_s": t_ar,
            "gain": t_ar / t if t else 1.0, "server_share": server_share(n, k), "workers": n, "servers": k}
