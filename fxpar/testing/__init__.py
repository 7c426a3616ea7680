"""Small models, seeded batches and single-process references, shared by tests, examples and benchmarks."""
from .batches import bag_batches, class_batches, regression_batches, token_batches, token_pairs
from .models import CNN, GPT, MLP, Bag, BNConvNet, EncoderModel, MegatronBlock, SkipMLP, gpt_loss, tiny_gpt
from .pipeline_models import SkipNet, TinyGPT, flat_gpt_loss, tiny_gpt_batches
from .reference import ddp_reference, ddp_worker, max_abs_diff, reference_training, tp_streams_reference

__all__ = ["MLP", "CNN", "BNConvNet", "GPT", "MegatronBlock", "EncoderModel", "SkipMLP", "Bag", "TinyGPT", "SkipNet",
           "gpt_loss", "flat_gpt_loss", "tiny_gpt", "token_batches", "tiny_gpt_batches", "token_pairs",
           "regression_batches", "class_batches", "bag_batches", "reference_training", "tp_streams_reference", "ddp_reference", "ddp_worker",
           "max_abs_diff"]
