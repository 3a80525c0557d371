"""hf_specdiff: diffusion-drafter speculative decoding for plain transformers `generate()`.

    import hf_specdiff
    hf_specdiff.enable(target)
    speculator = hf_specdiff.AutoSpeculator.from_pretrained(path)
    target.generate(**inputs, assistant_model=speculator, speculation="xpress")

Masked diffusion LMs (LLaDA, Dream, SDAR layouts, or your own through `DiffusionAdapter`) decode with Spiffy:

    dlm = hf_specdiff.enable(hf_specdiff.AutoDiffusionLM.from_pretrained(path))
    dlm.generate(input_ids, max_new_tokens=256, speculation="spiffy", draft_graph=graph_path)

Importing the package changes nothing in transformers; `enable(model)` opts a single model in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Each public name and the module that defines it. They are imported on first use (PEP 562), so `import hf_specdiff`
# and the `hf-specdiff` command line do not load torch and transformers before they need them (`hf-specdiff --help`
# answers in a fraction of a second).
_EXPORTS = {
    "candidates": ["BlockDiffusionCandidateGenerator", "SpeculationStats"],
    "dflash": ["DFlashConfig", "DFlashDraftModel"],
    "draft_vocab": ["top_tokens"],
    "diffusion": ["AutoDiffusionLM", "DiffusionAdapter", "DiffusionGenerationConfig", "DiffusionLM",
                  "DiffusionLMConfig"],
    "embedded": ["default_diffusion_lm_path", "default_speculator_path", "load_default_target"],
    "generation": ["SPECULATION_METHODS", "SpeculativeDecoderOnlyOutput", "disable", "enable", "is_enabled"],
    "markov": ["MarkovConfig", "MarkovHead"],
    "speculator": ["AutoSpeculator", "Speculator"],
    "spiffy": ["DraftGraph"],
    "xpress": ["XPressConfig", "XPressRefiner"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_specdiff' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from .candidates import BlockDiffusionCandidateGenerator, SpeculationStats
    from .dflash import DFlashConfig, DFlashDraftModel
    from .draft_vocab import top_tokens
    from .diffusion import AutoDiffusionLM, DiffusionAdapter, DiffusionGenerationConfig, DiffusionLM, DiffusionLMConfig
    from .embedded import default_diffusion_lm_path, default_speculator_path, load_default_target
    from .generation import SPECULATION_METHODS, SpeculativeDecoderOnlyOutput, disable, enable, is_enabled
    from .markov import MarkovConfig, MarkovHead
    from .speculator import AutoSpeculator, Speculator
    from .spiffy import DraftGraph
    from .xpress import XPressConfig, XPressRefiner

__all__ = [
    "AutoDiffusionLM",
    "AutoSpeculator",
    "BlockDiffusionCandidateGenerator",
    "DFlashConfig",
    "DFlashDraftModel",
    "DiffusionAdapter",
    "DiffusionGenerationConfig",
    "DiffusionLM",
    "DiffusionLMConfig",
    "DraftGraph",
    "MarkovConfig",
    "MarkovHead",
    "SPECULATION_METHODS",
    "SpeculationStats",
    "SpeculativeDecoderOnlyOutput",
    "Speculator",
    "XPressConfig",
    "XPressRefiner",
    "default_diffusion_lm_path",
    "default_speculator_path",
    "disable",
    "enable",
    "is_enabled",
    "load_default_target",
    "top_tokens",
]
