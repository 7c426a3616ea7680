"""Train a Hugging Face GPT-2 (built from a config: nothing is downloaded) with fxpar: a 2-stage
pipeline on 2 local gloo ranks, checked against plain single-process PyTorch.

    python3 -m pip install "transformers==5.23.0"     # the version the tests pin
    python3 examples/hf_gpt2.py

Hugging Face models take keyword arguments and return a ModelOutput; a four-line wrapper gives
fxpar a module that takes the token tensor and returns the logits. Cut candidates include every
block of ``transformer.h``, so the pipeline cut is balanced automatically.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import fxpar


class CausalLM(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main():
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise SystemExit("this example needs transformers: python3 -m pip install 'transformers==5.23.0'") from None
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=4, n_head=2, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = CausalLM(GPT2LMHeadModel(config))
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        idx = torch.randint(0, 128, (8, 17), generator=g)
        batches.append((idx[:, :-1], idx[:, 1:]))
    optimizer = (torch.optim.AdamW, {"lr": 1e-3})
    program = fxpar.parallelize(model, fxpar.ClusterSpec.local(2), batches[0], lm_loss, optimizer,
                                strategy=fxpar.Strategy(pp=2, schedule="1f1b", microbatches=4))
    print(program.plan)
    print(program.schedule(0))
    result = program.run_local(batches)

    ref = copy.deepcopy(model)                 # the same steps in one process, plain PyTorch
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = lm_loss(ref(x), y)
        loss.backward()
        opt.step()
        print(f"step {step}: fxpar loss {result.losses[step]:.6f}   single-process loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
