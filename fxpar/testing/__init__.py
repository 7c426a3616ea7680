"""Small models and single-process references, shared by tests, examples and benchmarks."""
from .models import CNN, GPT, MLP, BNConvNet, EncoderModel, MegatronBlock, SkipMLP, gpt_loss, token_batches
from .reference import ddp_reference, ddp_worker, max_abs_diff, reference_training

__all__ = ["MLP", "CNN", "BNConvNet", "GPT", "MegatronBlock", "EncoderModel", "SkipMLP", "gpt_loss", "token_batches", "reference_training",
           "ddp_reference", "ddp_worker", "max_abs_diff"]
