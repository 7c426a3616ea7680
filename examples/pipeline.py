"""fxpar pipeline parallelism: a small GPT (LM head tied to the embedding) cut into 2 stages.

    python examples/pipeline.py                      # 1F1B, pp=2, 4 microbatches
    python examples/pipeline.py --schedule gpipe     # or interleaved, zb1p, chimera, pipedream, 2bw
    python examples/pipeline.py --pp 2 --dp 2        # 4 ranks: 2 pipeline replicas
    python examples/pipeline.py --show-graphs        # print stage 0's forward (F) and backward (B) graphs

Prints the plan (stage cuts, what each stage holds and sends, the schedule and its bubble), then
trains, prints the loss per step and compares with single-process PyTorch (synchronous schedules
match it to float64 rounding; asynchronous ones are compared with their papers' math).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

import fxpar  # noqa: E402
from fxpar.testing import GPT, gpt_loss, max_abs_diff, reference_training  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--split", nargs="*", default=None, help="module paths stages start at, e.g. blocks.2")
    ap.add_argument("--show-graphs", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(0)
    vocab, seq, batch = 64, 16, 8 * args.dp
    model = GPT(vocab=vocab, d=32, layers=4, heads=4, max_seq=seq).double()
    tokens = torch.randint(0, vocab, (args.steps, batch, seq + 1))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    optimizer = (torch.optim.AdamW, {"lr": 3e-3})
    strategy = fxpar.Strategy(pp=args.pp, dp=args.dp, schedule=args.schedule, microbatches=args.microbatches,
                              split_points=args.split)
    cluster = fxpar.ClusterSpec.local(strategy.size)
    program = fxpar.parallelize(model, cluster, batches[0], loss_fn=gpt_loss, optimizer=optimizer, strategy=strategy)
    print(program.explain())
    if args.show_graphs:
        for name, gm in program.graphs(0).items():
            if name in ("stage0.F", "stage0.B", "stage0.I", "stage0.W"):
                print(f"\n# ---- {name} (rank 0) ----\n{gm.code}")
    result = program.run_local(batches)
    for i, (loss, t) in enumerate(zip(result.losses, result.step_times)):
        print(f"step {i}: loss {loss:.6f}  ({t * 1e3:.1f} ms)")
    if program.asynchronous:
        print("asynchronous schedule: compare with fxpar.testing.async_reference for its paper's math")
        return
    ref_losses, ref_state = reference_training(model, batches, gpt_loss, optimizer)
    print(f"max |loss - single-process| = {max(abs(a - b) for a, b in zip(result.losses, ref_losses)):.2e}, "
          f"max |param - single-process| = {max_abs_diff(result.state_dict(), ref_state):.2e}")


if __name__ == "__main__":
    main()
