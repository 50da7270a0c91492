"""The ``cpu-offload`` command line: ``compare`` and ``plan``.

Each command is a module of its own (:mod:`.compare`, :mod:`.plan`) with an
``add_parser`` and a ``run``; the options they share are in :mod:`._options` and
:mod:`._model`. Modules here import down (from the commands to what they share and to
the library), never back.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from . import compare, plan

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    """The ``cpu-offload`` parser, one subparser per command."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="cpu-offload",
        description="Offload activations to host memory; compare V1, V2 and the alternatives.",
    )
    parser.add_argument("--version", action="version", version=f"cpu-offload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    compare.add_parser(sub)
    plan.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``cpu-offload`` and ``python -m cpu_offload``.

    Args:
        argv: The arguments (``sys.argv[1:]`` when None).

    Returns:
        The exit status (0). Bad arguments exit with status 2 and a message naming them.

    Example:
        >>> main(["--version"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        SystemExit: 0
    """
    parser = _parser()
    # Unknown arguments come back to the command: compare takes Megatron Bridge
    # overrides anywhere among its options.
    args, extra = parser.parse_known_args(argv)
    code: int = args.run(parser, args, extra)
    return code
