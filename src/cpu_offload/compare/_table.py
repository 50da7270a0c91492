"""Text for a terminal within a width: tables with two-line headers, and wrapped lines.

A table wider than the width is split into tables of fewer columns, each beginning with
the first column (the row's name); ``width=None`` keeps every table in one piece with
one-line headers, and lines unbroken.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_WIDTH", "Column", "table", "wrap"]

#: Columns of the text ``cpu-offload compare`` prints, unless ``--wide``.
DEFAULT_WIDTH = 100

_GAP = "  "


@dataclass(frozen=True)
class Column:
    """A column's header: ``top`` above ``bottom`` (``top`` may be empty).

    Example:
        >>> Column("peak", "x none").name
        'peak x none'
    """

    top: str
    bottom: str

    @property
    def name(self) -> str:
        """The header on one line: what tells it from the other columns."""
        return f"{self.top} {self.bottom}".strip()


def _aligned(rows: Sequence[Sequence[str]], header_rows: int) -> list[str]:
    """Rows of cells as aligned lines, the first column left, the others right; a rule
    under the header rows."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        _GAP.join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    lines.insert(header_rows, "-" * sum(widths) + "-" * len(_GAP) * (len(widths) - 1))
    return lines


def _groups(widths: Sequence[int], width: int) -> list[list[int]]:
    """Column indices per table: the first column in each, then as many as fit."""
    groups: list[list[int]] = []
    for i in range(1, len(widths)):
        used = sum(widths[j] + len(_GAP) for j in groups[-1]) if groups else 0
        if not groups or widths[0] + used + len(_GAP) + widths[i] > width:
            groups.append([i])
        else:
            groups[-1].append(i)
    return [[0, *g] for g in groups] or [[0]]


def table(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int | None) -> list[str]:
    """The rows under the columns' headers, as lines of at most ``width`` characters.

    Args:
        columns: The headers; their names must differ.
        rows: One list of cells per row, as many as ``columns``.
        width: The most characters a line may have (None: one table, one-line headers).

    Returns:
        The lines; tables split to the width are separated by an empty line.

    Raises:
        ValueError: If two columns have the same name.

    Example:
        >>> cols = [Column("", "name"), Column("peak", "MiB"), Column("step", "ms")]
        >>> print("\\n".join(table(cols, [["none", "24.1", "3.10"]], width=None)))
        name  peak MiB  step ms
        -----------------------
        none      24.1     3.10
    """
    names = [c.name for c in columns]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"column headers must differ; repeated: {', '.join(repeated)}")
    if width is None:
        return _aligned([names, *rows], header_rows=1)
    heads = [[c.top for c in columns], [c.bottom for c in columns]]
    all_rows = [*heads, *rows]
    widths = [max(len(row[i]) for row in all_rows) for i in range(len(columns))]
    out: list[str] = []
    for group in _groups(widths, width):
        if out:
            out.append("")
        out += _aligned([[row[i] for i in group] for row in all_rows], header_rows=2)
    return out


def wrap(lines: Sequence[str], width: int | None) -> list[str]:
    """Each line longer than ``width`` broken at spaces, the rest indented by two.

    Example:
        >>> wrap(["a line of text that is too long"], 16)
        ['a line of text', '  that is too', '  long']
    """
    if width is None:
        return list(lines)
    out: list[str] = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
        else:
            out += textwrap.wrap(
                line,
                width,
                subsequent_indent="  ",
                break_long_words=False,
                break_on_hyphens=False,
            )
    return out
