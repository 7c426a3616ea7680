"""fxpar quickstart: a small GPT on synthetic tokens, data parallel over 2 local ranks.

    python examples/quickstart.py            # add --steps N, --world-size N, --show-graph

Prints the plan (what fxpar decided and what each rank will run), then trains and prints the
loss per step, and checks the result against plain single-process PyTorch training.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

import fxpar  # noqa: E402
from fxpar.testing import GPT, gpt_loss, max_abs_diff, reference_training  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--show-graph", action="store_true", help="print rank 0's step graph")
    args = ap.parse_args()

    torch.manual_seed(0)
    vocab, seq = 128, 32
    model = GPT(vocab=vocab, d=64, layers=2, heads=4, max_seq=seq, qkv_bias=False)
    def batch():   # synthetic "text": counting sequences with random starts and strides; learnable
        start = torch.randint(0, vocab, (args.batch, 1))
        stride = torch.randint(1, 4, (args.batch, 1))
        tokens = (start + stride * torch.arange(seq + 1)) % vocab
        return tokens[:, :-1], tokens[:, 1:]
    batches = [batch() for _ in range(args.steps)]
    optimizer = (torch.optim.AdamW, {"lr": 1e-2})

    t0 = time.perf_counter()
    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(args.world_size), example_inputs=batches[0],
                                loss_fn=gpt_loss, optimizer=optimizer,
                                strategy=fxpar.Strategy(dp=args.world_size, bucket_cap_mb=0.25))
    print(f"parallelize: {time.perf_counter() - t0:.2f}s\n")
    print(program.explain())
    if args.show_graph:
        print(program.graphs(rank=0)["step"].code)

    print(f"\ntraining {args.steps} steps on {args.world_size} gloo ranks ...", flush=True)
    result = program.run_local(batches)
    for i, (loss, t) in enumerate(zip(result.losses, result.step_times)):
        print(f"  step {i}: loss {loss:.4f}  ({t * 1000:.0f} ms)")

    ref_losses, ref_state = reference_training(model, batches, gpt_loss, optimizer)
    diff = max_abs_diff(result.state_dict(), ref_state)
    loss_diff = max(abs(a - b) for a, b in zip(result.losses, ref_losses))
    print(f"\nsingle-process PyTorch on the same global batches: final loss {ref_losses[-1]:.4f}; "
          f"largest loss difference {loss_diff:.1e}, largest parameter difference {diff:.1e} (float32 rounding)")


if __name__ == "__main__":
    main()
