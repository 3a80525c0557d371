"""Warnings that point at the user's line, not at the library's."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent)
# torch.no_grad() as a decorator wraps a library function in a frame of torch's own: that frame is no user code either
_TORCH_WRAPPER = ("torch", "utils", "_contextlib.py")


def _library_frame(filename: str) -> bool:
    path = Path(filename)
    return str(path.resolve()).startswith(_PACKAGE) or path.parts[-3:] == _TORCH_WRAPPER


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn` attributed to the first frame outside hf_specdiff: the user's `model.generate(...)` or
    `diffusion_generate(...)` line, however many library frames lie between it and the check (`enable`'s generate,
    the decoding loop, torch.no_grad's wrapper). A fixed `stacklevel` points into the library when a path is one frame
    longer or shorter; Python 3.12's `skip_file_prefixes` would do this, and 3.10 is supported."""
    frame, level = sys._getframe(1), 2  # warnings.warn's level 1 is this function, 2 the one that calls it
    while frame is not None and _library_frame(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
