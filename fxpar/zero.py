"""The former name of :mod:`fxpar.zero_layout`, kept for the modules that still import it by this name."""
from fxpar.zero_layout import STAGES, chunk, chunk_numel, describe, unchunk, zero_keys

__all__ = ["chunk_numel", "chunk", "unchunk", "zero_keys", "STAGES", "describe"]
