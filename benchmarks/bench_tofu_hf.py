"""Planning time of ``Strategy(tp=2, sharding="auto")`` (Tofu's search) for tiny Hugging Face decoders with dropout.

Phi and GPT-J run attention and MLP side by side from one LayerNorm; with dropout their joint step also saves the
masks for backward. Eliminating block by block keeps each block's boundary, which there spans many tensors; the
search then takes one flat elimination instead (``passes.sharding.search``: both orders dry-run, scopes only).
Reports per model: ``parallelize`` wall and CPU seconds (CPU is the fair figure on a loaded machine), Tofu's
search CPU seconds, its largest DP table and whether the level ran flat.

    python benchmarks/bench_tofu_hf.py [--models phi,gptj] [--dropout 0.1]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpar  # noqa: E402
import fxpar.features.tensor_parallel as tp_feature  # noqa: E402
from fxpar.testing.hf import VOCAB, CausalLM, hf_batches, lm_loss  # noqa: E402


def build(name: str, p: float):
    import transformers as tf
    tf.logging.set_verbosity_error()
    special = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if name == "phi":
        m = tf.PhiForCausalLM(tf.PhiConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4,
                                           intermediate_size=64, num_hidden_layers=2, max_position_embeddings=32,
                                           partial_rotary_factor=0.5, resid_pdrop=p, embd_pdrop=p,
                                           attention_dropout=p, use_cache=False, **special))
    elif name == "gptj":
        m = tf.GPTJForCausalLM(tf.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=2, n_positions=32,
                                             rotary_dim=4, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, use_cache=False,
                                             **special))
    else:
        raise SystemExit(f"unknown model {name!r}: phi or gptj")
    return CausalLM(m).double()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="phi,gptj")
    ap.add_argument("--dropout", type=float, default=0.1)
    args = ap.parse_args()
    search, found = tp_feature.tofu.tofu_search, []

    def timed(*a, **kw):
        t = time.process_time()
        r = search(*a, **kw)
        found.append((time.process_time() - t, r))
        return r
    tp_feature.tofu.tofu_search = timed
    for name in args.models.split(","):
        model, batch = build(name, args.dropout), hf_batches("llama", 1, batch=4)[0]
        found.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batch, lm_loss, (torch.optim.SGD, {"lr": 0.1}),
                          strategy=fxpar.Strategy(tp=2, sharding="auto"))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        s, r = found[0]
        flat = any(b.get("flat") for b in r.blocks)
        print(f"{name} dropout={args.dropout}: parallelize {wall:.1f} s wall, {cpu:.1f} s CPU; tofu {s:.2f} s CPU, "
              f"largest DP table {r.max_table:,}{', flat' if flat else ''}; predicted {r.predicted:.4g} s")


if __name__ == "__main__":
    main()
