"""How far one step moves along the gradient when error-feedback-compressed gradients feed Adam, against SGD.

One process, no model: each step's gradient is a fixed vector ``mu`` plus Gaussian noise (``d`` values); a
compressor with error feedback (``p = g + e; s = C(p); e = p - s``, Stich et al., NeurIPS 2018) passes ``s`` to
Adam (beta 0.9 / 0.999, lr 1) or to SGD with Nesterov momentum 0.9 (lr 1). Printed: the mean progress per step
along ``sign(mu)`` over the second half of ``--steps``, compressed against uncompressed. Under SGD error feedback
sends every value eventually and the ratio is 1; under Adam each coordinate arrives in bursts (about every
``1 / ratio`` steps, ``1 / ratio`` times larger), which raise ``sqrt(v)`` by about ``sqrt(1 / ratio)`` while the
mean of ``m`` stays the gradient: the step shrinks by about ``sqrt(ratio)``.

    python benchmarks/compression_adam_step.py [--d 20000] [--steps 3000]
"""
from __future__ import annotations

import argparse

import torch


def progress(compress, optimizer: str, mu: torch.Tensor, steps: int, noise: float) -> float:
    d = mu.numel()
    gen = torch.Generator().manual_seed(0)             # the same gradients for every run
    e, m, v, mom, total = (torch.zeros(d) for _ in range(5))
    for t in range(1, steps + 1):
        p = mu + noise * torch.randn(d, generator=gen) + e
        s = compress(p)
        e = p - s
        if optimizer == "adam":
            m = 0.9 * m + 0.1 * s
            v = 0.999 * v + 0.001 * s * s
            u = (m / (1 - 0.9 ** t)) / ((v / (1 - 0.999 ** t)).sqrt() + 1e-8)
        else:
            mom = 0.9 * mom + s
            u = s + 0.9 * mom
        if t > steps // 2:
            total += u * mu.sign()
    return (total / (steps - steps // 2)).mean().item()


def top_k(ratio: float):
    def f(p):
        i = p.abs().topk(max(1, int(ratio * p.numel()))).indices
        return torch.zeros_like(p).index_copy(0, i, p[i])
    return f


def random_k(ratio: float):
    gen = torch.Generator().manual_seed(1)

    def f(p):
        i = torch.randperm(p.numel(), generator=gen)[:max(1, int(ratio * p.numel()))]
        return torch.zeros_like(p).index_copy(0, i, p[i])
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--noise", type=float, default=0.5)
    args = ap.parse_args(argv)
    mu = torch.randn(args.d, generator=torch.Generator().manual_seed(2))
    print("| optimizer | compressor | progress per step | uncompressed | ratio | sqrt(ratio of values sent) |")
    print("|---|---|---|---|---|---|")
    for opt in ("adam", "sgd"):
        base = progress(lambda p: p, opt, mu, args.steps, args.noise)
        for name, ratio, comp in (("TopK 1%", 0.01, top_k(0.01)), ("RandomK 10%", 0.1, random_k(0.1))):
            got = progress(comp, opt, mu, args.steps, args.noise)
            print(f"| {opt} | {name} | {got:.4f} | {base:.4f} | {got / base:.3f} | {ratio ** 0.5:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
