"""How hf_accel objects show themselves: one line in a terminal (`repr`), a compact HTML table in Jupyter.

An object lists what it wants shown in `summary()` (label -> value, in display order); `RichDisplay` turns that
into both forms, so the two never disagree. `Table` does the same for a comparison (rows under named columns).
Values are shown as `str(value)`, floats with 3 significant digits (whole from 1000 up), sequences as `[a b c]`.
This module is hf_accel's one owner of byte sizes (`format_bytes`) and of text tables (`format_table`: aligned or
GitHub markdown; `Table` aligns its text form the same way), for reprs, `hf-accel bench` and benchmarks/ alike.
"""

from __future__ import annotations

import abc
import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields

_TABLE_STYLE = "border-collapse:collapse;font-size:0.9em"
_CELL_STYLE = "padding:1px 8px;text-align:left"


def format_bytes(num_bytes: float, decimals: int | None = None) -> str:
    """`1536` -> `'1.5 KiB'`, in binary units up to TiB; whole bytes below 1 KiB. `decimals=None` (compact, for
    reprs): one decimal below 100 of a unit, none from 100 up (`'200 KiB'`); a number: always that many
    (`decimals=1`: `'200.0 KiB'`, so a column of a table lines up)."""
    size, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            break
        size /= 1024
    if unit == "B":
        return f"{size:.0f} B"
    places = decimals if decimals is not None else 1 if abs(size) < 100 else 0
    return f"{size:.{places}f} {unit}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    """Aligned text table with a rule of dashes under the headers, or a GitHub markdown table."""
    if markdown:
        lines = [headers, ["---"] * len(headers), *rows]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
    widths = _column_widths([headers, *rows])
    return "\n".join(_aligned(cells, widths) for cells in [headers, ["-" * w for w in widths], *rows])


def _column_widths(lines: Sequence[Sequence[object]]) -> list[int]:
    return [max(len(str(cell)) for cell in column) for column in zip(*lines)]


def _aligned(cells: Sequence[object], widths: Sequence[int]) -> str:
    return "  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths)).rstrip()


def format_value(value: object) -> str:
    """A float with 3 significant digits (whole from 1000 up), a sequence as `[a b c]`, anything else as `str`."""
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[" + " ".join(format_value(item) for item in value) + "]"
    return str(value)


def one_line(name: str, fields: Mapping[str, object]) -> str:
    """`Name(label=value, ...)` on one line."""
    inner = ", ".join(f"{label}={format_value(value)}" for label, value in fields.items())
    return f"{name}({inner})"


def html_table(title: str, fields: Mapping[str, object]) -> str:
    """A two-column HTML table (label, value) under a bold `title`; every string is HTML-escaped."""
    rows = "".join(
        f"<tr><th style='{_CELL_STYLE}'>{html.escape(label)}</th>"
        f"<td style='{_CELL_STYLE}'>{html.escape(format_value(value))}</td></tr>"
        for label, value in fields.items()
    )
    return f"<table style='{_TABLE_STYLE}'><caption><b>{html.escape(title)}</b></caption>{rows}</table>"


def html_grid(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An HTML table with a header row of `columns` and one row per item of `rows`, under a bold `title`."""
    head = "".join(f"<th style='{_CELL_STYLE}'>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td style='{_CELL_STYLE}'>{html.escape(format_value(v))}</td>" for v in row) + "</tr>"
        for row in rows
    )
    return f"<table style='{_TABLE_STYLE}'><caption><b>{html.escape(title)}</b></caption><tr>{head}</tr>{body}</table>"


@dataclass(slots=True, repr=False)
class Table:
    """Rows under named columns: an HTML table in Jupyter, aligned text elsewhere (`str`), GitHub markdown for docs
    (`markdown()`); for comparisons.

    Example: `Table("decode", ["cache", "tokens/s"], [["DynamicCache", 210.0], ["paged", 205.3]])`.
    """

    title: str
    columns: list[str]
    rows: list[list[object]] = field(default_factory=list)

    def __post_init__(self) -> None:
        widths = {len(row) for row in self.rows}
        if widths - {len(self.columns)}:
            raise ValueError(f"every row of `rows` must have {len(self.columns)} values (one per column), got {widths}")

    def __str__(self) -> str:
        cells = [list(self.columns), *self._text_rows()]
        widths = _column_widths(cells)
        return "\n".join([self.title, *(_aligned(row, widths) for row in cells)])

    def markdown(self) -> str:
        """`title:`, a blank line, then the rows as a GitHub markdown table (values shown as in the text form)."""
        return f"{self.title}:\n\n" + format_table(self.columns, self._text_rows(), markdown=True)

    def _text_rows(self) -> list[list[str]]:
        return [[format_value(value) for value in row] for row in self.rows]

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        return html_grid(self.title, self.columns, self.rows)


class RichDisplay(abc.ABC):
    """Mixin: `repr` and Jupyter's `_repr_html_` from the object's `summary()` (abstract: a class cannot be
    instantiated without it).

    Put it first among the bases so it wins over `nn.Module.__repr__` / `Cache.__repr__`; dataclasses using it need
    `repr=False`.
    """

    __slots__ = ()

    @abc.abstractmethod
    def summary(self) -> dict[str, object]:
        """Label -> value of what the object shows, in order."""

    def __repr__(self) -> str:
        return one_line(type(self).__name__, self.summary())

    def _repr_html_(self) -> str:
        return html_table(type(self).__name__, self.summary())


class CacheDisplay(RichDisplay):
    """`RichDisplay` for hf_accel's caches: their settings (those not None), layers, tokens seen and bytes held.

    Relies on what every hf_accel cache has: a `settings` dataclass, `layers`, `get_seq_length()`, `memory_bytes()`.
    """

    __slots__ = ()

    def summary(self) -> dict[str, object]:
        """Settings, `layers`, `tokens` (seen by layer 0, as generate counts them) and `memory` (bytes held)."""
        settings = {f.name: getattr(self.settings, f.name) for f in dataclass_fields(self.settings)}
        shown = {name: value for name, value in settings.items() if value is not None}
        tokens = self.get_seq_length() if self.layers else 0
        return {**shown, "layers": len(self.layers), "tokens": tokens, "memory": format_bytes(self.memory_bytes())}
