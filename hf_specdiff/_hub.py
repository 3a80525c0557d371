"""Loading artifacts from a local folder or a Hub repo id."""

from __future__ import annotations

import os
from pathlib import Path


def can_only_be_a_path(text: str) -> bool:
    """Whether `text` cannot be a Hub repo id ('name' or 'namespace/name'), so that it can only mean a local path."""
    return os.path.isabs(text) or text.startswith((".", "~")) or "\\" in text or text.count("/") > 1 or text.endswith("/")


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


def share_like_umask(folder: Path) -> None:
    """Give `folder` and its files the modes a plain `open()` / `mkdir()` would: safetensors writes its files 0600 (and
    `mkdtemp` makes a folder 0700), which would lock other users out of a shared cache or an exported artifact."""
    probe = folder / ".umask-probe"
    probe.touch(mode=0o666)  # the mode it gets is 0o666 & ~umask, read without changing the process-wide umask
    file_mode = probe.stat().st_mode & 0o777
    probe.unlink()
    folder_mode = file_mode | ((file_mode & 0o444) >> 2)  # searchable wherever readable
    for path in folder.rglob("*"):
        path.chmod(folder_mode if path.is_dir() else file_mode)
    folder.chmod(folder_mode)
