"""Loading artifacts from a local folder or a Hub repo id."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


def can_only_be_a_path(text: str) -> bool:
    """Whether `text` cannot be a Hub repo id ('name' or 'namespace/name'), so that it can only mean a local path."""
    return (os.path.isabs(text) or text.startswith((".", "~")) or "\\" in text or text.count("/") > 1
            or text.endswith("/"))


def check_folder_or_repo_id(path_or_repo_id: str | os.PathLike, what: str) -> None:
    """Raise FileNotFoundError when `path_or_repo_id` can only mean a local path and nothing is there. Otherwise the
    Hub would be asked and answer that it is not a valid repo id, which hides the real mistake (a typo in a path)."""
    text = str(path_or_repo_id)
    if Path(text).exists():
        return
    if can_only_be_a_path(text):
        raise FileNotFoundError(
            f"No {what} at {text!r}: no such folder (a Hub repo id reads 'namespace/name'). Check the path."
        )


# what to do when a folder given for a saved artifact lacks its config.json
SAVED_FOLDER = "Point at the folder that save_pretrained wrote (config.json beside the weights)."


def find_file(path_or_repo_id: str, filename: str, what: str, remedy: str, **hub_kwargs) -> str:
    """The local path of `filename` in a folder or Hub repo (downloaded if need be), or an OSError that says no `what`
    is there and what to do (`remedy`). transformers' `cached_file` answers a local folder without config.json with
    None, not an error (its callers fall back on other files), so that case is caught here too."""
    from transformers.utils import cached_file

    folder = Path(path_or_repo_id, hub_kwargs.get("subfolder") or "")
    try:
        found = cached_file(path_or_repo_id, filename, **hub_kwargs)
    except OSError as error:
        if not Path(path_or_repo_id).is_dir():
            raise OSError(f"No {what} at {path_or_repo_id!r}: it is not a local folder, and the Hub repo could not be "
                          f"read (offline, it must already be in the local Hub cache). {error}") from error
        found = None
    if found is None:
        raise OSError(f"No {what} at {str(folder)!r}: the folder has no {filename}. {remedy}")
    return found


def check_model_folder(path_or_repo_id: str | os.PathLike, what: str, remedy: str) -> None:
    """find_file's error for a local folder without config.json, for the checks that run before the model loads (a
    tokenizer check would otherwise answer an empty folder with "holds no tokenizer" and ask to save one there). A Hub
    id or a folder holding config.json passes."""
    folder = Path(path_or_repo_id)
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise OSError(f"No {what} at {str(folder)!r}: the folder has no config.json. {remedy}")


# where `cached_file` looks for a file (the download options of transformers' `from_pretrained`)
HUB_OPTIONS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies", "subfolder")


def check_hub_options(kwargs: dict, what: str, also: str = "") -> None:
    """Refuse a `from_pretrained` keyword that is not a Hub option (`also`: the loader's own, for the message)."""
    if unknown := sorted(set(kwargs) - set(HUB_OPTIONS)):
        raise TypeError(f"from_pretrained of a {what} got unsupported arguments {unknown}; it takes {also}the Hub "
                        f"options {', '.join(HUB_OPTIONS)}.")


def take_dtype(dtype, hub_kwargs: dict, what: str, also: str):
    """`dtype`, or transformers' older spelling `torch_dtype` taken out of `hub_kwargs`, after refusing the other
    options of `hub_kwargs` that are not Hub options (`from_pretrained` of a `what` would drop them without a word)."""
    if "torch_dtype" in hub_kwargs:
        if dtype is not None:
            raise TypeError("Pass dtype= or torch_dtype=, not both.")
        dtype = hub_kwargs.pop("torch_dtype")
    check_hub_options(hub_kwargs, what, also)
    return dtype


# names of the files transformers reads a tokenizer from: tokenizers' JSON, its config, SentencePiece, tiktoken and BPE
# vocabularies (tokenizer.json, tokenizer_config.json, tokenizer.model, spiece.model, vocab.json, merges.txt, ...)
TOKENIZER_FILE_PATTERNS = ("tokenizer*", "vocab*", "merges*", "*.model", "*.tiktoken", "tekken.json", "spiece*")


def check_tokenizer_folder(path_or_repo_id: str | os.PathLike, what: str, remedy: str = "") -> None:
    """Raise OSError when `path_or_repo_id` is a local folder holding no tokenizer file. transformers would otherwise
    fall back on building one from the folder's config and fail with "Couldn't instantiate the backend tokenizer ...
    sentencepiece or tiktoken", which names neither the folder nor the fix. `remedy`: the command's own way out."""
    folder = Path(path_or_repo_id)
    if not folder.is_dir() or any(next(folder.glob(pattern), None) for pattern in TOKENIZER_FILE_PATTERNS):
        return
    raise OSError(f"{folder} holds no tokenizer (no tokenizer.json, tokenizer_config.json or vocabulary file), so the "
                  f"{what}'s prompts cannot be tokenized: save the model's tokenizer into that folder "
                  f"(tokenizer.save_pretrained({str(folder)!r})){remedy}.")


# transformers' `push_to_hub` options that shape the Hub commit (the others shape the saved files, or nothing here)
UPLOAD_OPTIONS = ("commit_message", "commit_description", "private", "token", "revision", "create_pr")


def check_repo_id(repo_id: str, what: str = "repo_id") -> None:
    """Refuse a `repo_id` the Hub would refuse, before anything is saved or created: the Hub client would only say so
    once the folder is written and being uploaded. `what`: where the id came from, for the message."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(
            f"{what}={repo_id!r} is not a Hub repo id ({error}). A repo id reads 'name' or 'namespace/name', e.g. "
            "'my-speculator' or 'your-username/my-speculator': letters, digits, '-', '_' and '.', not starting or "
            "ending with '-' or '.', at most 96 characters each."
        ) from error


def upload_folder(folder: Path, repo_id: str, commit_message: str, commit_description: str | None = None,
                  private: bool | None = None, token: str | bool | None = None, revision: str | None = None,
                  create_pr: bool = False, delete_patterns: list[str] | None = None):
    """Upload `folder` to the model repo `repo_id` as one commit, as transformers' `push_to_hub` does: the repo is
    created if need be, and a branch `revision` too (unless it names a pull request). `delete_patterns`: files of the
    repo the commit removes (a part an earlier push had and this artifact has not). Returns the commit info."""
    from huggingface_hub import HfApi

    check_repo_id(repo_id)
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message,
                             commit_description=commit_description, revision=revision, create_pr=create_pr,
                             delete_patterns=delete_patterns)


def split_push_options(kwargs: dict, save_options: tuple[str, ...], what: str) -> tuple[dict, dict]:
    """`push_to_hub`'s keyword arguments as (those of the commit, those of `save_pretrained`); any other is refused
    before anything is created on the Hub (a silently dropped `revision` would commit to main)."""
    if unknown := sorted(set(kwargs) - set(UPLOAD_OPTIONS) - set(save_options)):
        raise TypeError(f"push_to_hub of a {what} got unsupported arguments {unknown}; it takes repo_id, "
                        f"{', '.join(UPLOAD_OPTIONS)}{''.join(', ' + name for name in save_options)}.")
    return ({k: v for k, v in kwargs.items() if k in UPLOAD_OPTIONS},
            {k: v for k, v in kwargs.items() if k in save_options})


def umask_file_mode(folder: Path) -> int:
    """The mode a plain `open()` gives a new file in `folder`: 0o666 & ~umask, read by creating one (reading the umask
    means setting it, process-wide, which another thread's file could catch)."""
    probe = folder / ".umask-probe"
    probe.touch(mode=0o666)
    file_mode = probe.stat().st_mode & 0o777
    probe.unlink()
    return file_mode


@contextmanager
def usual_modes(folders: list[Path], pattern: str = "*.safetensors"):
    """Give the files matching `pattern` that the block writes in `folders` the mode the umask gives a new file, as
    other saved files have. safetensors (0.8) writes each file as a temporary file, created 0600, then renamed into
    place (safetensors/safetensors#782), which would lock other users out of a saved artifact; a file written so by an
    earlier save is repaired when saved again. Files the block leaves alone keep their mode."""
    before = {path: path.stat() for folder in folders for path in folder.glob(pattern)}
    yield
    for folder in folders:
        written = [path for path in folder.glob(pattern) if path not in before
                   or (before[path].st_ino, before[path].st_mtime_ns) != (path.stat().st_ino, path.stat().st_mtime_ns)]
        if written:
            file_mode = umask_file_mode(folder)
            for path in written:
                path.chmod(file_mode)


def share_like_umask(folder: Path) -> None:
    """Give `folder` and its files the modes a plain `open()` / `mkdir()` would: safetensors writes its files 0600 (and
    `mkdtemp` makes a folder 0700), which would lock other users out of a shared cache or an exported artifact."""
    file_mode = umask_file_mode(folder)
    folder_mode = file_mode | ((file_mode & 0o444) >> 2)  # searchable wherever readable
    for path in folder.rglob("*"):
        path.chmod(folder_mode if path.is_dir() else file_mode)
    folder.chmod(folder_mode)
