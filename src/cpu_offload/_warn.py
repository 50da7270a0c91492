"""Warnings that point at the user's line, however deep inside the package they arise."""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn_at_caller"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` with the stack level of the first frame outside this package.

    A fixed ``stacklevel`` breaks as soon as a public function calls another one (the
    top-level dispatcher calling a backend, say); Python's default filters then hide
    ``DeprecationWarning``s attributed to the package instead of the user's script.
    """
    level = 2
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        _PACKAGE_DIR + os.sep
    ):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)
