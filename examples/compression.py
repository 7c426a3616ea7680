"""Gradient compression: PowerSGD and TopK with error feedback beside plain data parallelism, on 2 CPU ranks.

    python3 examples/compression.py                  # add --steps N, --rank R, --ratio F

Each run trains the same small GPT on the same synthetic tokens at dp=2 (gloo), with one ``grad_sync`` setting:

* plain data parallelism (one all-reduce per gradient bucket),
* ``C.PowerSGD(rank=R, start_iter=3)``: plain all-reduces for 3 steps, then each matrix sent as two rank-R factors
  P and Q (Vogels et al. 2019, with the arithmetic of torch's ``powerSGD_hook``),
* ``C.TopK(ratio=F, error_feedback=True)``: the largest F of each bucket's values sent as (index, value) pairs in one
  all-gather, what is left kept on the rank and added to the next step's gradient (Stich et al. 2018).

It prints the lines of ``explain()`` that say what each bucket sends, the bytes each rank hands to collectives per
step (measured on the ranks), and the loss of each step beside plain data parallelism's. A compressed sum is an
estimate of the gradient's sum, so the losses differ from plain dp on purpose (docs/strategies/compression.md).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

import fxpar  # noqa: E402
from fxpar import compress as C  # noqa: E402
from fxpar.testing import GPT, gpt_loss  # noqa: E402


def compression_lines(text: str, section: str, tensors: int = 4) -> str:
    """The compression section of ``explain()``'s text (it starts at the line ``"<method name>:"``), with the first
    ``tensors`` of each bucket's per-tensor lines."""
    lines = text.splitlines()
    start = lines.index(f"{section}:")
    out, shown = [], 0
    for line in lines[start:]:
        if not line.strip():
            break
        if line.startswith("    ") and not line.strip().startswith("until"):     # one tensor of a bucket
            shown += 1
            if shown > tensors:
                continue
        else:
            if shown > tensors:
                out.append(f"    ... ({shown - tensors} more tensors)")
            shown = 0
        out.append(line)
    if shown > tensors:
        out.append(f"    ... ({shown - tensors} more tensors)")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rank", type=int, default=2, help="PowerSGD's rank")
    ap.add_argument("--ratio", type=float, default=0.05, help="TopK's share of each bucket's values")
    args = ap.parse_args()

    torch.manual_seed(0)
    vocab, seq = 64, 16
    model = GPT(vocab=vocab, d=32, layers=2, heads=2, max_seq=seq)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):       # counting sequences with random starts and strides: learnable
        start = torch.randint(0, vocab, (8, 1), generator=g)
        stride = torch.randint(1, 4, (8, 1), generator=g)
        tokens = (start + stride * torch.arange(seq + 1)) % vocab
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    optimizer = (torch.optim.AdamW, {"lr": 1e-2})

    settings = {"plain dp": None,
                "PowerSGD": C.PowerSGD(rank=args.rank, start_iter=3),
                "TopK": C.TopK(ratio=args.ratio, error_feedback=True)}
    results = {}
    with fxpar.LocalCluster(2) as cluster:
        for name, method in settings.items():
            strategy = fxpar.Strategy(dp=2) if method is None else fxpar.Strategy(dp=2, grad_sync=method)
            program = fxpar.parallelize(model, 2, batches[0], gpt_loss, optimizer, strategy=strategy)
            if method is not None:
                print(compression_lines(program.explain(), method.name))
            res = program.run_local(batches, cluster=cluster, measure_comm=True)
            sent = [sum(b for _, b in calls) for calls in res.comm_calls[0]]
            results[name] = (res.losses, sent)

    plain_losses, plain_sent = results["plain dp"]
    print(f"\n{'step':>4} | " + " | ".join(f"{name:>26}" for name in settings))
    print(f"{'':>4} | " + " | ".join(f"{'loss':>12} {'bytes/rank':>13}" for _ in settings))
    for i in range(args.steps):
        row = [f"{results[name][0][i]:12.4f} {results[name][1][i]:13,d}" for name in settings]
        print(f"{i:>4} | " + " | ".join(row))
    for name in settings:
        if name == "plain dp":
            continue
        losses, sent = results[name]
        print(f"{name}: final loss {losses[-1]:.4f} (plain dp {plain_losses[-1]:.4f}, "
              f"{losses[-1] - plain_losses[-1]:+.4f}); last step {sent[-1]:,d} bytes per rank instead of "
              f"{plain_sent[-1]:,d} ({plain_sent[-1] / sent[-1]:.1f}x fewer)")


if __name__ == "__main__":
    main()
