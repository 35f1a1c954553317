"""The benchmarks' tables: printed as GitHub markdown, ready to paste into benchmarks/RESULTS.md."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """header and rows as a markdown table; numbers should arrive formatted as the reader wants."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)
