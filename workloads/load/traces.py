"""Trace files: `read_trace` reads a CSV or JSONL trace of arrival times and prompt/output lengths
into `TraceRow`s (arrival offsets in seconds from the first row), in the column layout of the public
Azure LLM inference traces or ours (`TRACE_LAYOUTS`).
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

#: Accepted trace column layouts: (arrival time, prompt tokens, output tokens).
TRACE_LAYOUTS: tuple[tuple[str, str, str], ...] = (
    ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),  # Azure LLM inference traces (2023, 2024)
    ("arrival_time_s", "prompt_tokens", "output_tokens"),  # ours
)
_TIMESTAMP = re.compile(r"(?P<base>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(?P<frac>\d+))?(?P<tz>Z|[+-]\d\d:?\d\d)?")


@dataclass(frozen=True)
class TraceRow:
    """One trace request: `arrival_s` after the trace's first arrival, its prompt and output lengths (tokens)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def timestamp_s(value: Any) -> tuple[int, float]:
    """A trace time as (whole seconds, fraction): a number of seconds, or an ISO date-time such as
    the Azure traces' ``2023-11-16 18:15:46.6805900`` (every fractional digit kept). ValueError otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        whole = math.floor(value)
        return int(whole), float(value) - whole
    text = str(value).strip()
    try:
        x = float(text)
        return int(math.floor(x)), x - math.floor(x)
    except ValueError:
        pass
    m = _TIMESTAMP.fullmatch(text)
    if not m:
        raise ValueError(f"not a number of seconds or an ISO date-time: {text!r}")
    tz = m["tz"] or ""
    base = datetime.fromisoformat(m["base"] + ("+00:00" if tz in ("", "Z") else tz))
    return int(base.timestamp()), float("0." + m["frac"]) if m["frac"] else 0.0


def read_trace(path: str | Path) -> list[TraceRow]:
    """The rows of a trace file, arrival times relative to the first row (seconds).

    `.csv` with a header row, or `.jsonl` (one object per line); the columns of one of
    `TRACE_LAYOUTS`. Rows must be in arrival order. ValueError naming `trace_path` for a missing
    file, and the file, row and column for a missing column, an unreadable time, a length below 1
    or an arrival earlier than the row before.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace_path: no such file {str(path)!r}")
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    elif path.suffix.lower() in (".jsonl", ".json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        raise ValueError(f"trace_path: {str(path)!r} is neither .csv nor .jsonl")
    if not rows:
        raise ValueError(f"trace_path: {str(path)!r} has no rows")
    keys = set(rows[0])
    layout = next((lay for lay in TRACE_LAYOUTS if set(lay) <= keys), None)
    if layout is None:
        raise ValueError(
            f"trace_path: {str(path)!r} has columns {sorted(keys)}; expected one of "
            + " or ".join("(" + ", ".join(lay) + ")" for lay in TRACE_LAYOUTS)
        )
    t_col, p_col, o_col = layout
    out: list[TraceRow] = []
    first: tuple[int, float] | None = None
    prev = -math.inf
    for i, row in enumerate(rows, 1):
        where = f"trace {path.name}, row {i}"
        try:
            whole, frac = timestamp_s(row[t_col])
        except ValueError as e:
            raise ValueError(f"{where}, {t_col}: {e}") from None
        first = first or (whole, frac)
        arrival = (whole - first[0]) + (frac - first[1])
        if arrival < prev:
            raise ValueError(f"{where}, {t_col}: earlier than the row before (rows must be in arrival order)")
        prev = arrival
        lengths = []
        for col in (p_col, o_col):
            try:
                v = float(row[col])
            except (TypeError, ValueError):
                v = math.nan
            if not (math.isfinite(v) and v == int(v) and v >= 1):
                raise ValueError(f"{where}, {col}: expected an integer >= 1, got {row[col]!r}")
            lengths.append(int(v))
        out.append(TraceRow(arrival, lengths[0], lengths[1]))
    return out
