"""Plain-text tables for the terminal and for Markdown artifacts: one formatter for
`kiln runs`, `kiln plan` and a sweep's ranking."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    markdown: bool = False,
    right: bool = False,
    rule: bool = True,
) -> str:
    """Columns as wide as their widest cell. `markdown`: `| a | b |` with a `|---|` rule (for
    MLflow artifacts); else two spaces between columns and, with `rule`, dashes under the
    header. `right` right-aligns every column (numbers)."""
    cells = [[str(x) for x in row] for row in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *cells)]

    def line(row: Sequence[str]) -> str:
        padded = [x.rjust(w) if right else x.ljust(w) for x, w in zip(row, widths)]
        return "| " + " | ".join(padded) + " |" if markdown else "  ".join(padded)

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|" if markdown else "  ".join("-" * w for w in widths)
    return "\n".join([line(header), *([sep] if rule else []), *(line(r) for r in cells)])
