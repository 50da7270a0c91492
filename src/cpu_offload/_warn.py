"""Warnings that point at the user's line, however deep inside the package they arise."""

from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["warn_at_caller"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# torch's own frames are skipped too: a warning raised in an autograd Function's forward
# (V1's commit) belongs to the line that called the function, not to torch's apply().
_SKIPPED = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__)
)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` with the stack level of the first frame outside this package and torch.

    A fixed ``stacklevel`` breaks as soon as a public function calls another one (the
    top-level dispatcher calling a backend, say); Python's default filters then hide
    ``DeprecationWarning``s attributed to the package instead of the user's script.
    """
    level = 2
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIPPED):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)
