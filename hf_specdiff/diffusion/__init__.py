"""Masked diffusion LMs (LLaDA, Dream, SDAR, or a Llama turned into one) and their decoding.

`modeling`: one small implementation that loads and saves the published checkpoints; `adapter`: plug in your own
model; `decoding`: blocks, steps, remasking rules, threshold unmasking, caches, and Spiffy (`hf_specdiff.spiffy`).
Importing this package registers nothing anywhere."""

from .adapter import DiffusionAdapter
from .decoding import (
    CACHE_MODES,
    REMASKING_RULES,
    DiffusionGenerateOutput,
    DiffusionGenerationConfig,
    diffusion_generate,
)
from .modeling import (
    FAMILIES,
    AutoDiffusionLM,
    DiffusionLM,
    DiffusionLMConfig,
    DiffusionLMOutput,
    Family,
    load_tokenizer,
)

__all__ = [
    "CACHE_MODES",
    "FAMILIES",
    "REMASKING_RULES",
    "AutoDiffusionLM",
    "DiffusionAdapter",
    "DiffusionGenerateOutput",
    "DiffusionGenerationConfig",
    "DiffusionLM",
    "DiffusionLMConfig",
    "DiffusionLMOutput",
    "Family",
    "diffusion_generate",
    "load_tokenizer",
]
