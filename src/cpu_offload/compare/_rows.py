"""Lookup of report rows by name, shared by the activation and optimizer reports."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class _Named(Protocol):
    @property
    def name(self) -> str: ...


_RowT = TypeVar("_RowT", bound=_Named)


def row_by_name(rows: Iterable[_RowT], name: str) -> _RowT:
    """The first row called ``name``.

    Raises:
        KeyError: If no row has that name; the message lists the names there are.
    """
    rows = list(rows)
    for row in rows:
        if row.name == name:
            return row
    raise KeyError(f"no row named {name!r}; rows: {', '.join(r.name for r in rows)}")
