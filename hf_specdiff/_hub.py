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
