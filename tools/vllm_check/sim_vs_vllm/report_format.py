"""Markdown cells: table rows, numbers, shortened JSON, block origins."""

from __future__ import annotations

import json
from typing import Any

from .blocks import Origin


def table_row(*cells: Any) -> str:
    """`| a | b |`; None prints as an empty cell."""
    return "| " + " | ".join("" if c is None else str(c) for c in cells) + " |"


def number(value: Any) -> str:
    """`-` for None, integral floats without `.0`."""
    if value is None:
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def short(value: Any, limit: int = 120) -> str:
    """A value as one table cell: JSON, lists past 3 items elided, at most `limit` chars."""
    if isinstance(value, list) and len(value) > 3:
        text = json.dumps(value[:3])[:-1] + f", … ({len(value)})]"
    else:
        text = json.dumps(value) if not isinstance(value, str) else value
    text = text.replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def origin_text(o: Origin) -> str:
    """`from block 1, 2 blk, output yes` for one stored block event."""
    if not o.get("matched"):
        return f"{o['blocks']} blk, not found in the prompt"
    output = "yes" if o["holds_output"] else "no"
    return f"from block {o['first_block']}, {o['blocks']} blk, output {output}"
