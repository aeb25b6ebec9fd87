"""The serving sweep's report: `table.md` (conditions line first, every numeric column with its unit) and the
PNG plots (`workloads.serving.plots`).

Latencies print in milliseconds (``(ms)`` in the header; the records keep seconds under ``_s`` keys), each
percentile marked ``*`` when it is low-confidence (`workloads.load.metrics.low_confidence`: p90 below 10 samples,
p95 below 20, p99 below 100). SLO attainment carries its sample count (``0.95 (n=64)``), and the footer states
the SLO the points were judged by. A capacity suite's table starts with each series' capacity at the SLO
(`CAPACITY_TABLE`, from `workloads.serving.capacity.summaries`), then lists every probe as a point.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cluster.connect import error_message
from replica import cpu_share
from workloads.core.results import MIB, conditions_line, format_value, markdown_table, write_atomic
from workloads.core.template import Report
from workloads.load.metrics import FLAGGED_PERCENTILES, RATE_SHORTFALL_FRACTION
from workloads.load.numbers import significant
from workloads.load.slo import describe_slo
from workloads.serving.capacity import RATE_UNITS, rate_of, rate_unit
from workloads.serving.plots import write_plots

#: The percentiles of the table's TTFT and TPOT columns.
TABLE_PERCENTILES = ("p50", "p90", "p95", "p99")

TABLE = [  # (header with unit, key, format)
    ("series", "series", "s"),
    ("load", "load", "g"),
    ("max batch", "max_batch_size", "d"),
    ("budget (tok)", "budget_tokens", "d"),
    ("ok/sent", "ok_sent", "s"),
    ("output (tok/s)", "output_throughput_tok_per_s", ".1f"),
    ("total (tok/s)", "total_throughput_tok_per_s", ".1f"),
    ("req/s", "request_throughput_req_per_s", ".3f"),
    ("rate target/scheduled/sent/completed (req/s)", "rate", "s"),
    ("conc. target/peak", "conc", "s"),
    ("TTFT p50/p90/p95/p99 (ms)", "ttft", "s"),
    ("TPOT p50/p90/p95/p99 (ms)", "tpot", "s"),
    ("e2e p99 (s)", "e2e_latency_p99_s", ".2f"),
    ("n", "e2e_latency_n", "d"),
    ("SLO attainment", "attainment", "s"),
    ("goodput (req/s)", "goodput_req_per_s", ".3f"),
    ("goodput (tok/s)", "goodput_tok_per_s", ".1f"),
    ("peak KV (MiB)", "kv_mib", ".1f"),
    ("peak held KV (MiB)", "held_kv_mib", ".2f"),  # kept session states / idle prefix-cache entries (optional)
    ("peak running", "peak_running", "s"),
    ("prefix cache hit rate", "prefix_cache_hit_rate", ".3f"),  # only when a point has it (`table_columns`)
    ("session reused tokens", "session_reused_tokens", "d"),  # kv_reuse: session_state (likewise)
    ("session affinity hits", "session_affinity_hits", "d"),  # several replicas keeping state (likewise)
    ("CPU share", "cpu", "s"),  # replica.cpu_share: ran / runnable of the replicas' threads, `!` contended
    ("status", "status", "s"),
    ("stop reason", "stop_reason", "s"),
]


CAPACITY_TABLE = [  # (header with unit, key, format): one row per series of a capacity suite
    ("series", "series", "s"),
    ("capacity (req/s)", "capacity", ".4g"),  # in sessions/s for a search over sessions
    ("passes / fails at (req/s)", "bracket", "s"),
    ("probes", "capacity_probes", "d"),
    ("errored probes", "capacity_errored_probes", "d"),
    ("status", "capacity_status", "s"),
]

SESSION_TABLE = [  # (header with unit, key, format): one row per point of a sessions suite
    ("series", "series", "s"),
    ("load (sessions/s)", "load", "g"),
    ("sessions", "sessions", "d"),
    ("met SLO", "sessions_slo_met", "d"),
    ("session SLO attainment", "session_slo_attainment", ".3f"),
    ("session goodput (sessions/s)", "session_goodput_per_s", ".3g"),
    ("expected reuse (tok)", "expected_reuse_tokens", "d"),
    ("cached prompt (tok)", "cached_prompt_tokens", "d"),
    ("session state reused/recomputed (tok)", "session_state_tokens", "s"),  # kv_reuse: session_state; else -
    ("session state hits/misses (turns)", "session_state_turns", "s"),
]

TURN_TABLE = [  # (header with unit, key, format): one row per turn index of each point of a sessions suite
    ("series", "series", "s"),
    ("load (sessions/s)", "load", "g"),
    ("turn", "turn", "d"),
    ("n", "n", "d"),
    ("TTFT p50/p99 (ms)", "ttft", "s"),
    ("TPOT p50/p99 (ms)", "tpot", "s"),
    ("SLO attainment", "slo_attainment", ".3f"),
    ("expected reuse mean (tok)", "expected_reuse_tokens_mean", ".1f"),
    ("cached prompt mean (tok)", "cached_prompt_tokens_mean", ".1f"),
]

#: What each status of a search means, for the capacity table's footer.
CAPACITY_STATUS_NOTES = {
    "ok": "ok: the highest rate that passed, next to one that failed",
    "below_min_rate": "below_min_rate: the lowest rate already failed (lower min_rate_req_per_s)",
    "at_least_max_rate": "at_least_max_rate: the highest rate passed (raise max_rate_req_per_s)",
    "not_converged": "not_converged: max_probes ran out before the resolution (resume with a larger capacity.max_probes)",
    "searching": "searching: the run stopped mid-search (resume it)",
}


def capacity_markdown(rows: list[dict]) -> str:
    """Each series' capacity at the SLO (`rows`: `workloads.serving.capacity.summaries`) as a Markdown table under
    a line naming the target, and a footer saying what its statuses mean; a search over sessions in sessions/s."""
    g = lambda v: format_value(v, ".4g")  # noqa: E731
    unit = rate_unit(rows[0]) if rows else "req/s"
    body = [{**r, "capacity": rate_of(r), "bracket": f"{g(rate_of(r, 'lo'))} / {g(rate_of(r, 'hi'))}"} for r in rows]
    columns = [(h.replace("req/s", unit), k, f) for h, k, f in CAPACITY_TABLE]
    targets = ", ".join(sorted({f"{r['capacity_target_attainment']:g}" for r in rows})) or "-"
    seen = [s for s in CAPACITY_STATUS_NOTES if any(r["capacity_status"] == s for r in rows)]
    notes = {k: v.replace("req_per_s", RATE_UNITS[unit][0]) for k, v in CAPACITY_STATUS_NOTES.items()}
    footer = "; ".join(notes[s] for s in seen) + (
        "; errored: a probe errored, so its series stopped (resume the run to probe it again)."
        if any(r.get("capacity_errored_probes") for r in rows)
        else "."
    )
    what = (
        "the highest session start rate of the grid whose session SLO attainment (a session meets the SLO when "
        "every one of its turns does) is"
        if unit == "sessions/s"
        else "the highest Poisson rate of the grid whose SLO attainment is"
    )
    return (
        f"Capacity at the SLO: per series, {what} >= {targets}"
        " (a bisection; every probe is a row of the table below).\n\n" + markdown_table(columns, body, footer=footer)
    )


def milliseconds(r: dict, base: str, percentiles=TABLE_PERCENTILES) -> str:
    """``12.3/45.6*/...``: the record's `base` percentiles (``ttft`` -> ``ttft_p50_s``, ...) in milliseconds, 3
    significant digits in plain notation (``42600``, never ``4.26e+04``: `workloads.load.numbers.significant`), each
    low-confidence one marked ``*``; ``-`` for a missing one."""
    out = []
    for p in percentiles:
        v = r.get(f"{base}_{p}_s")
        flagged = int(p[1:]) in FLAGGED_PERCENTILES and r.get(f"{base}_{p}_low_confidence")
        out.append(significant(None if v is None else v * 1000) + ("*" if v is not None and flagged else ""))
    return "/".join(out)


def table_rows(records: list[dict]) -> list[dict]:
    """The serving points in suite order, with the table's combined columns."""
    rows = []
    for r in sorted(records, key=lambda r: r.get("point_index", 0)):
        g = lambda k, f=".3g": format_value(r.get(k), f)  # noqa: E731
        d = dict(r)
        d["ok_sent"] = f"{r.get('completed_requests', '-')}/{r.get('sent_requests', '-')}"
        d["rate"] = (
            f"{g('target_rate_req_per_s')}/{g('scheduled_rate_req_per_s')}/{g('achieved_rate_req_per_s')}/"
            f"{g('completed_rate_req_per_s')}" + (" SHORTFALL" if r.get("rate_shortfall") else "")
            if r.get("target_rate_req_per_s")
            else "-"
        )  # scheduled: the arrival times the run drew; completed: the rate the replicas kept up
        d["conc"] = f"{g('target_concurrency', 'd')}/{g('achieved_peak_concurrency', 'd')}"
        d["ttft"] = milliseconds(r, "ttft")
        d["tpot"] = milliseconds(r, "tpot")
        d["attainment"] = (
            f"{r['slo_attainment']:.3f} (n={r.get('slo_requests')})" if r.get("slo_attainment") is not None else "-"
        )
        d["kv_mib"] = r["kv_cache_bytes"] / MIB if r.get("kv_cache_bytes") is not None else None
        d["held_kv_mib"] = r["peak_held_kv_bytes"] / MIB if r.get("peak_held_kv_bytes") is not None else None
        d["peak_running"] = ",".join(str(x) for x in r.get("peak_running_sequences_per_replica") or []) or "-"
        d["cpu"] = cpu_share.mark(r)
        if r.get("evicts") is False:  # an eviction label on a row that ran the full cache
            d["series"] = f"{r.get('series')} ({r.get('evicts_reason')})"
        rows.append(d)
    return rows


def sessions_markdown(records: list[dict]) -> str:
    """A sessions suite's per-session table (a session meets the SLO when every turn does) and per-turn table (TTFT,
    TPOT, attainment and reuse by turn index), or "" when no record has sessions."""
    points = [r for r in sorted(records, key=lambda r: r.get("point_index", 0)) if r.get("turns") is not None]
    if not points:
        return ""
    ms = lambda t, base: "/".join(  # noqa: E731 - seconds -> ms
        significant(None if t.get(f"{base}_{p}_s") is None else t[f"{base}_{p}_s"] * 1000) for p in ("p50", "p99")
    )
    turns = [
        {**t, "series": r.get("series"), "load": r.get("load"), "ttft": ms(t, "ttft"), "tpot": ms(t, "tpot")}
        for r in points
        for t in r["turns"]
    ]
    pair = lambda r, a, b: (  # noqa: E731 - "-" for a series that keeps no session state
        "-" if r.get(a) is None else f"{format_value(r.get(a), 'd')}/{format_value(r.get(b), 'd')}"
    )
    sessions = [
        {
            **r,
            "session_state_tokens": pair(r, "session_reused_tokens", "session_recomputed_tokens"),
            "session_state_turns": pair(r, "session_state_hits", "session_state_misses"),
        }
        for r in points
    ]
    note = (
        "A session meets the SLO when every one of its turns does (a failed turn ends its session, which misses). "
        "Expected reuse: the prompt tokens a turn shares with what was sent before it (token-level); cached prompt: "
        "what the engine reports it did not prefill (- where the backend does not report it). Cached is below "
        "expected by design where: the previous answer's last token was never fed back, so it has no KV (kept session "
        "state: expected - 1 from turn 1 on, and 0 at turn 0: it keeps a session's own turns, not a shared system "
        "prompt); a prefix cache shares whole blocks only; and a turn arriving while the one it shares a prefix with "
        "still prefills finds no blocks yet. Session state reused/recomputed: the "
        "prompt tokens taken from a session's kept cache, and those of its previous turn computed again (its state "
        "was reclaimed or the prompt did not extend it); hits/misses: turns that started from the kept state or not."
    )
    return (
        "Sessions\n\n"
        + markdown_table(SESSION_TABLE, sessions)
        + "\nPer turn\n\n"
        + markdown_table(TURN_TABLE, turns, footer=note)
        + "\n"
    )


def slo_line(records: list[dict]) -> str:
    """The SLOs the records were judged by (each distinct one, in milliseconds), or "" when none carries one."""
    slos = sorted(
        {
            (r.get("slo_ttft_s"), r.get("slo_tpot_s"), r.get("slo_e2e_latency_s"))
            for r in records
            if r.get("slo_ttft_s") is not None
        },
        key=str,
    )
    if not slos:
        return ""
    return (
        f"SLO per request: {'; '.join(describe_slo(*s) for s in slos)} (attainment: the share of measured requests "
        "meeting every limit, failed and dropped ones missing; goodput: those requests and their output tokens "
        "per second of the window)."
    )


#: Columns shown only when some record has a value for them (the prefix cache's and the session state's: null for
#: every point without them).
OPTIONAL_COLUMNS = frozenset({"prefix_cache_hit_rate", "session_reused_tokens", "session_affinity_hits", "held_kv_mib"})
#: The record key an optional column shows (its own key when not listed).
OPTIONAL_SOURCES = {"held_kv_mib": "peak_held_kv_bytes"}


def table_columns(records: list[dict]) -> list[tuple]:
    """`TABLE` less each of `OPTIONAL_COLUMNS` that no record has a value for."""
    has = lambda key: any(r.get(OPTIONAL_SOURCES.get(key, key)) is not None for r in records)  # noqa: E731
    return [c for c in TABLE if c[1] not in OPTIONAL_COLUMNS or has(c[1])]


def _said_evicting_nothing(capacity: list[dict], records: list[dict]) -> list[dict]:
    """`capacity`'s rows, the series of each whose every probe evicted nothing (``evicts`` false: an
    eviction row that ran the full cache, or our budget that held every token) followed by that reason, as the
    points' rows are."""
    why: dict = {}
    for r in records:
        quiet = r.get("evicts_reason") if r.get("evicts") is False else None
        why[r.get("series")] = quiet if why.get(r.get("series"), quiet) else None  # every probe, or no flag
    return [{**c, "series": f"{c['series']} ({why[c['series']]})"} if why.get(c["series"]) else c for c in capacity]


def table_markdown(records: list[dict], capacity: list[dict] | None = None) -> str:
    """The serving points as a Markdown table under their conditions line (after the capacity of each series when
    `capacity` gives it)."""
    footer = (
        "`*` a percentile p over fewer than 1 / (1 - p) samples (p90 below 10, p95 below 20, p99 below 100): "
        "low confidence."
    )
    if any(r.get("rate_shortfall") for r in records):
        footer += (
            " SHORTFALL: the point sent less than 95% of its scheduled rate, completed less than "
            f"{RATE_SHORTFALL_FRACTION:.0%} of it, or completed fewer than {RATE_SHORTFALL_FRACTION:.0%} of its "
            "arrivals (the record's rate_shortfall and warnings)."
        )
    slo = slo_line(records)
    footer += "".join(f"\n\n{line}" for line in cpu_share.contended_lines(records))
    head = capacity_markdown(_said_evicting_nothing(capacity, records)) + "\n" if capacity else ""
    return (
        conditions_line(records)
        + head
        + markdown_table(table_columns(records), table_rows(records), footer=footer + (f"\n\n{slo}" if slo else ""))
        + (f"\n{sessions}" if (sessions := sessions_markdown(records)) else "")
    )


def write_report(run_dir: Path, records: list[dict], capacity: list[dict] | None = None) -> Report:
    """Write ``table.md`` and the plots of `records` (the latest of each point) under `run_dir`; `capacity`: a
    capacity suite's searches (`workloads.serving.capacity.summaries`), tabled first and marked on a plot."""
    table = table_markdown(records, capacity)
    write_atomic(str(run_dir / "table.md"), table)
    try:
        plots = tuple(write_plots(records, run_dir, capacity=capacity))
    except Exception as e:  # noqa: BLE001 - a plot never fails a sweep
        print(f"serving: plots not written: {error_message(e)}", file=sys.stderr)
        plots = ()
    return Report(table, (run_dir / "table.md", *plots))
