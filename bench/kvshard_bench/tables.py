"""Plain-text tables for the benchmarks' terminal output: one layout, so every bench reads alike.

The JSON rows carry the exact numbers; these tables are for people, so cells are short (three
decimals, big values without any) and columns are padded to their widest cell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def cell(value: Any) -> str:
    """A short printed form: ``-`` for missing, three decimals for floats below 1,000."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def format_cells(headers: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """A header line and one line per row, every column as wide as its widest cell."""
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def format_rows(headers: Sequence[str], columns: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows (mappings) as a table: ``columns[i]`` of each row under ``headers[i]``."""
    return format_cells(headers, [[cell(row.get(c)) for c in columns] for row in rows])
