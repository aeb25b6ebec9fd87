"""The batch sweep's report: `table.md` (conditions line first) and `points.csv`, one row per point.

`kv_saved_vs_full_x` divides the `full` point's KV bytes (same batch, prompt, new tokens and seed) by each point's.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Iterable

from replica import cpu_share
from workloads.core.results import MIB, conditions_line, latest_by_point, markdown_table, write_atomic
from workloads.core.template import Report

COLUMNS = [  # (header with unit, record key, format)
    ("policy", "policy", "s"),
    ("params", "params_given", "s"),
    ("ratio (x)", "compression_ratio", "g"),
    ("batch", "batch_size", "d"),
    ("prompt (tok)", "prompt_tokens", "d"),
    ("new (tok)", "new_tokens", "d"),
    ("budget (tok)", "budget_tokens", "d"),
    ("prefill (s)", "prefill_s", ".3f"),
    ("TTFT (s)", "ttft_s", ".3f"),
    ("decode (tok/s)", "decode_tokens_per_s", ".1f"),
    ("output (tok/s)", "output_throughput_tok_per_s", ".1f"),
    ("KV cache (MiB)", "kv_cache_mib", ".2f"),
    ("KV saved vs full (x)", "kv_saved_vs_full_x", ".2f"),
    ("peak RSS (MiB)", "peak_rss_mib", ".0f"),
    ("replica", "replica_id", "s"),
    ("CPU share", "cpu", "s"),  # replica.cpu_share: ran / runnable of the replica's threads, `!` contended
    ("status", "status", "s"),
]

CSV_FIELDS = [
    "schema_version",
    "run_id",
    "point_index",
    "point_id",
    "status",
    "error",
    "git_commit",
    "suite",
    "model_id",
    "dtype",
    "device",
    "policy",
    "policy_params",
    "compression_ratio",
    "budget_tokens_requested",
    "budget_tokens",
    "batch_size",
    "prompt_tokens",
    "new_tokens",
    "seed",
    "prefill_s",
    "ttft_s",
    "decode_s",
    "tpot_s",
    "e2e_latency_s",
    "process_cpu_s",
    "cpu_share",
    "cpu_busy_share",
    "contended",
    "decode_tokens_per_s",
    "output_throughput_tok_per_s",
    "total_throughput_tok_per_s",
    "input_tokens",
    "output_tokens",
    "kv_cache_bytes",
    "kv_cache_bytes_final",
    "kv_saved_vs_full_x",
    "peak_rss_bytes",
    "process_max_rss_bytes",
    "replica_id",
    "node_id",
    "hostname",
    "torch_threads",
    "started_at_unix_s",
    "finished_at_unix_s",
]


def _sort_key(rec: dict):
    return (
        rec.get("batch_size", 0),
        rec.get("prompt_tokens", 0),
        rec.get("new_tokens", 0),
        rec.get("policy") != "full",
        rec.get("policy", ""),
        -(rec.get("compression_ratio") or 0),
        rec.get("budget_tokens_requested") or 0,
    )


def table_rows(records: Iterable[dict]) -> list[dict]:
    """One row per point (latest record), sorted, with derived MiB and 'KV saved vs full' columns.

    `kv_saved_vs_full_x` = kv_cache_bytes of the `full` point with the same batch, prompt,
    new tokens and seed divided by this point's kv_cache_bytes (None without a full point).
    """
    latest = list(latest_by_point(records).values())
    full = {
        (r["batch_size"], r["prompt_tokens"], r["new_tokens"], r.get("seed")): r["kv_cache_bytes"]
        for r in latest
        if r.get("policy") == "full" and r.get("status") == "ok" and r.get("kv_cache_bytes")
    }
    rows = []
    for r in sorted(latest, key=_sort_key):
        row = dict(r)
        kv = r.get("kv_cache_bytes")
        ref = full.get((r.get("batch_size"), r.get("prompt_tokens"), r.get("new_tokens"), r.get("seed")))
        row["kv_cache_mib"] = kv / MIB if kv is not None else None
        row["kv_saved_vs_full_x"] = ref / kv if (ref and kv) else None
        given = (r.get("point_config") or {}).get("policy_params") or {}
        row["params_given"] = ", ".join(f"{k}={v}" for k, v in sorted(given.items())) or None
        rss = r.get("peak_rss_bytes")
        row["peak_rss_mib"] = rss / MIB if rss is not None else None
        row["cpu"] = cpu_share.mark(r)
        rows.append(row)
    return rows


def csv_text(rows: list[dict]) -> str:
    """The points as CSV (fields in `CSV_FIELDS`; policy_params as JSON)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        row = dict(r)
        row["policy_params"] = json.dumps(r.get("policy_params") or {}, sort_keys=True)
        w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})
    return buf.getvalue()


def write_report(run_dir: Path, records: list[dict]) -> Report:
    """Write ``table.md`` and ``points.csv`` of `records` (the latest of each point) under `run_dir`."""
    rows = table_rows(records)
    table = conditions_line(rows) + markdown_table(COLUMNS, rows, footer="\n\n".join(cpu_share.contended_lines(rows)))
    files = (run_dir / "table.md", run_dir / "points.csv")
    write_atomic(str(files[0]), table)
    write_atomic(str(files[1]), csv_text(rows))
    warn_contention(rows)
    return Report(table, files)


def warn_contention(rows: list[dict]) -> None:
    """Say on stderr which points' replicas waited for cores (`replica.cpu_share`: shared or busy machine): their
    timings are slower than the hardware allows."""
    ok = [r for r in rows if r.get("status") == "ok"]
    hit = [r for r in ok if r.get("contended")]
    if hit:
        print(
            f"batch: warning: {len(hit)} of {len(ok)} point(s) contended (their replicas waited for cores: "
            f"{cpu_share.CONTENDED_RULE}); their timings are pessimistic, marked ! in the table",
            file=sys.stderr,
        )
