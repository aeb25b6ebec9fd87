"""The serving sweep's report: `table.md` (conditions line first, every numeric column with its unit) and the
PNG plots (`workloads.serving.plots`)."""

from __future__ import annotations

import sys
from pathlib import Path

from cluster.connect import error_message
from workloads.core.results import MIB, conditions_line, format_value, markdown_table, write_atomic
from workloads.core.template import Report
from workloads.serving.plots import write_plots

TABLE = [  # (header with unit, key, format)
    ("series", "series", "s"),
    ("load", "load", "g"),
    ("max batch", "max_batch_size", "d"),
    ("budget (tok)", "budget_tokens", "d"),
    ("ok/sent", "ok_sent", "s"),
    ("output (tok/s)", "output_throughput_tok_per_s", ".1f"),
    ("total (tok/s)", "total_throughput_tok_per_s", ".1f"),
    ("req/s", "request_throughput_req_per_s", ".3f"),
    ("rate target/scheduled/achieved (req/s)", "rate", "s"),
    ("conc. target/peak", "conc", "s"),
    ("TTFT p50/p99 (s)", "ttft", "s"),
    ("TPOT p50 (s)", "tpot_p50_s", ".4f"),
    ("e2e p99 (s)", "e2e_latency_p99_s", ".2f"),
    ("n", "e2e_latency_n", "d"),
    ("peak KV (MiB)", "kv_mib", ".1f"),
    ("peak running", "peak_running", "s"),
    ("status", "status", "s"),
    ("stop reason", "stop_reason", "s"),
]


def table_rows(records: list[dict]) -> list[dict]:
    """The serving points in suite order, with the table's combined columns."""
    rows = []
    for r in sorted(records, key=lambda r: r.get("point_index", 0)):
        g = lambda k, f=".3g": format_value(r.get(k), f)  # noqa: E731
        d = dict(r)
        d["ok_sent"] = f"{r.get('completed_requests', '-')}/{r.get('sent_requests', '-')}"
        d["rate"] = (
            f"{g('target_rate_req_per_s')}/{g('scheduled_rate_req_per_s')}/{g('achieved_rate_req_per_s')}"
            if r.get("target_rate_req_per_s")
            else "-"
        )  # scheduled: the arrival times the run drew
        d["conc"] = f"{g('target_concurrency', 'd')}/{g('achieved_peak_concurrency', 'd')}"
        d["ttft"] = f"{g('ttft_p50_s')}/{g('ttft_p99_s')}" + ("*" if r.get("ttft_p99_low_confidence") else "")
        d["kv_mib"] = r["kv_cache_bytes"] / MIB if r.get("kv_cache_bytes") is not None else None
        d["peak_running"] = ",".join(str(x) for x in r.get("peak_running_sequences_per_replica") or []) or "-"
        rows.append(d)
    return rows


def table_markdown(records: list[dict]) -> str:
    """The serving points as a Markdown table under their conditions line."""
    return conditions_line(records) + markdown_table(
        TABLE, table_rows(records), footer="`*` p99 over fewer than 100 samples (low confidence)."
    )


def write_report(run_dir: Path, records: list[dict]) -> Report:
    """Write ``table.md`` and the plots of `records` (the latest of each point) under `run_dir`."""
    table = table_markdown(records)
    write_atomic(str(run_dir / "table.md"), table)
    try:
        plots = tuple(write_plots(records, run_dir))
    except Exception as e:  # noqa: BLE001 - a plot never fails a sweep
        print(f"serving: plots not written: {error_message(e)}", file=sys.stderr)
        plots = ()
    return Report(table, (run_dir / "table.md", *plots))
