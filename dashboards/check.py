#!/usr/bin/env python3
"""List the Grafana panels and their PromQL, and check every query against a live Prometheus.

    python3 dashboards/check.py list                                  # Markdown: dashboard, panel, query
    python3 dashboards/check.py query [--prometheus http://127.0.0.1:9090] [--run-id ID]

`query` substitutes the dashboards' template variables the way Grafana does (``$run_id`` ->
the run, the newest by default; multi-value ``All`` -> ``.*``; ``$__rate_interval`` -> 30s),
asks Prometheus' HTTP API for every target of every panel, and prints which return data. A query without data
is told apart (`classify`): ``N/A`` (the run exported none of the metrics it reads: a panel of another suite
kind, or a feature the run did not use), ``GONE`` (its metrics had samples within ``--lookback`` but none now:
the replicas that exported those live gauges have ended) and ``BROKEN`` (every metric it reads has samples for
the run now, and the panel's expression still returns nothing). Exit status 1 only when a query is ``BROKEN``.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
DASHBOARD_DIR = HERE / "grafana" / "dashboards"

PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
    "atan2",
}


def load_dashboards(folder: Path = DASHBOARD_DIR) -> dict[str, dict]:
    """{file name: dashboard JSON} of every ``*.json`` in `folder`, sorted by name."""
    return {p.name: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))}


def iter_panels(dashboard: dict) -> Iterator[dict]:
    """Every panel that is not a row, including the panels of collapsed rows."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from (p for p in panel.get("panels", []) if p.get("type") != "row")
        else:
            yield panel


def iter_targets(dashboard: dict) -> Iterator[tuple[dict, dict]]:
    """(panel, target) for every query target of every panel."""
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            yield panel, target


def variable_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(variable name, query) of the dashboard's query variables (e.g. ``label_values(...)``)."""
    out = []
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var.get("query")
            out.append((var["name"], q.get("query") if isinstance(q, dict) else q))
    return out


def substitute(expr: str, values: dict[str, str], rate_interval: str = "30s") -> str:
    """Replace Grafana variables in `expr`: ``$__rate_interval``/``$__interval``/``$__range``,
    then ``${name}``/``${name:fmt}``/``$name`` from `values`; ``$1``-style regex groups stay.
    KeyError for an unknown variable."""
    builtins = {"__rate_interval": rate_interval, "__interval": "15s", "__range": "1h", "__range_s": "3600"}

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name.isdigit():
            return m.group(0)  # a regex group of label_replace ("$1"): Grafana leaves it alone
        if name in builtins:
            return builtins[name]
        if name not in values:
            raise KeyError(f"template variable ${name} has no value (known: {sorted(values)})")
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords, labels and numbers dropped)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    text = re.sub(r"\boffset\s+-?[\w.$]+", " ", text)  # offset durations
    text = re.sub(r"(?<![\w:])\d+(\.\d*)?([eE][+-]?\d+)?", " ", text)  # numbers
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word = m.group(0)
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or word.lower() in PROMQL_KEYWORDS:
            continue  # a function or an aggregation, or a keyword
        names.add(word)
    return names


def dashboard_metric_names(dashboards: dict[str, dict]) -> set[str]:
    """Every metric name in every panel target and variable query of `dashboards`."""
    names: set[str] = set()
    for board in dashboards.values():
        for _, target in iter_targets(board):
            names |= metric_names(target.get("expr", ""))
        for _, query in variable_queries(board):
            inner = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query or "")
            if inner:
                names |= metric_names(inner.group(1))
    return names


def inexact_sums(dashboards: dict[str, dict], histograms: set[str]) -> list[str]:
    """Targets that read a histogram's ``_sum`` (``<file> / <panel>: <name>``), given the exported
    names of the histograms. Ray's exporter writes that ``_sum`` from bucket midpoints, so a mean
    taken from it is not the mean observed; means use ``<histogram>_exact_sum_total``."""
    bad = []
    for file, board in dashboards.items():
        for panel, target in iter_targets(board):
            for name in sorted(metric_names(target.get("expr", ""))):
                if name.endswith("_sum") and name.removesuffix("_sum") in histograms:
                    bad.append(f"{file} / {panel.get('title')}: {name}")
    return bad


def quantile_calls(expr: str) -> list[str]:
    """Every ``histogram_quantile(...)`` call in a PromQL expression, as written (balanced parentheses).
    ValueError for a call whose parentheses do not close."""
    calls, start = [], 0
    while (i := expr.find("histogram_quantile(", start)) >= 0:
        depth, j = 0, i + len("histogram_quantile")
        for j in range(j, len(expr)):
            depth += {"(": 1, ")": -1}.get(expr[j], 0)
            if depth == 0:
                break
        if depth:
            raise ValueError(f"unbalanced parentheses after histogram_quantile in {expr!r}")
        calls.append(expr[i : j + 1])
        start = j + 1
    return calls


def guard_quantile(call: str, top: float) -> str:
    """`call` (a ``histogram_quantile(...)``) guarded against the +Inf bucket: its value where it lies below
    the histogram's top finite bound `top`, NaN where it does not, nothing where there were no observations.

    Prometheus answers a quantile that falls in the +Inf bucket with the top finite bound, which a panel
    would plot as if it were measured; the panel maps the NaN to the text `above_top_text` instead.
    """
    bound = f"{top:g}"
    return f"({call} < {bound} or ({call} >= {bound}) * NaN)"


def above_top_text(top: float, unit: str) -> str:
    """What a panel shows for a quantile above the top bucket (`top` in the histogram's `unit`, s or ms)."""
    seconds = top / 1000 if unit == "ms" else top
    return f"above the top bucket ({seconds:,g} s)"


def above_top_override(ref_id: str, top: float, unit: str) -> dict:
    """The Grafana field override that shows target `ref_id`'s NaN (a guarded quantile above the top bucket)
    as `above_top_text`."""
    result = {"text": above_top_text(top, unit), "color": "red", "index": 0}
    return {
        "matcher": {"id": "byFrameRefID", "options": ref_id},
        "properties": [
            {"id": "mappings", "value": [{"type": "special", "options": {"match": "nan", "result": result}}]}
        ],
    }


def unguarded_quantiles(dashboards: dict[str, dict], tops: dict[str, float]) -> list[str]:
    """Quantile targets that could show the +Inf bucket's stand-in as a number (``<file> / <panel> [<ref>]: why``).

    `tops` maps each histogram's exported name to its top finite bucket bound (in its own unit). Every
    ``histogram_quantile`` call must be written as `guard_quantile` of that bound, and its panel must map the
    target's NaN to `above_top_text` (`above_top_override`).
    """
    bad = []
    for file, board in dashboards.items():
        for panel, target in iter_targets(board):
            expr = target.get("expr", "")
            where = f"{file} / {panel.get('title')} [{target.get('refId')}]"
            for call in quantile_calls(expr):
                buckets = [n for n in metric_names(call) if n.endswith("_bucket")]
                if len(buckets) != 1 or buckets[0].removesuffix("_bucket") not in tops:
                    bad.append(f"{where}: no known histogram in {call}")
                    continue
                name = buckets[0].removesuffix("_bucket")
                top = tops[name]
                if guard_quantile(call, top) not in expr:
                    bad.append(f"{where}: {call} is not guarded by its top bucket {top:g}")
                unit = "ms" if name.endswith("_ms") else "s"
                if above_top_override(target.get("refId"), top, unit) not in panel.get("fieldConfig", {}).get(
                    "overrides", []
                ):
                    bad.append(f"{where}: no override showing NaN as {above_top_text(top, unit)!r}")
    return bad


def prom_get(prometheus: str, path: str, params: dict) -> dict:
    """GET `path` of Prometheus' HTTP API; returns the ``data`` field. RuntimeError on an API error."""
    url = prometheus.rstrip("/") + path + "?" + urllib.parse.urlencode(params, doseq=True)
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read() or b"{}")
        raise RuntimeError(f"{path} {params}: {body.get('error', exc)}") from None
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {body.get('error')}")
    return body["data"]


def query(prometheus: str, expr: str, at: float | None = None) -> list[dict]:
    """Instant query (now, or at unix time `at`); the result list (``[{"metric": {...}, "value": [t, "v"]}]``)."""
    params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    data = prom_get(prometheus, "/api/v1/query", params)
    if data["resultType"] == "scalar":
        return [{"metric": {}, "value": data["result"]}]
    return data["result"]


def finite_values(result: list[dict]) -> list[float]:
    out = []
    for series in result:
        v = float(series["value"][1])
        if math.isfinite(v):
            out.append(v)
    return out


def label_values(prometheus: str, query_text: str) -> list[str]:
    """Values of a ``label_values(selector, label)`` variable query, asked of Prometheus."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query_text)
    if not m:
        raise ValueError(f"not a label_values(selector, label) query: {query_text!r}")
    return prom_get(prometheus, f"/api/v1/label/{m.group(2)}/values", {"match[]": m.group(1)})


def default_values(dashboard: dict, prometheus: str | None, run_id: str | None) -> dict[str, str]:
    """Variable values as Grafana would pick them: `run_id` given, or the newest run; All -> ``.*``."""
    values: dict[str, str] = {}
    for var in dashboard.get("templating", {}).get("list", []):
        name = var["name"]
        if var.get("type") == "datasource":
            values[name] = "prometheus"
        elif name == "run_id" and run_id:
            values[name] = run_id  # run ids are [A-Za-z0-9_.:-]: the same as a string and as a regex
        elif var.get("includeAll"):
            values[name] = var.get("allValue") or ".*"
        elif prometheus is not None:
            q = var.get("query")
            q = substitute(q.get("query") if isinstance(q, dict) else q, values)
            found = sorted(label_values(prometheus, q), reverse=var.get("sort") in (2, 4, 6))
            values[name] = found[0] if found else ""
    return values


def check(
    prometheus: str,
    run_id: str | None = None,
    folder: Path = DASHBOARD_DIR,
    rate_interval: str = "30s",
    at: dict[str, float] | None = None,
):
    """[(dashboard file, panel title, refId, expr as sent, finite values)] for every target.

    `at` maps a dashboard file to the unix time to evaluate its queries at (default: now).
    """
    rows = []
    for file, board in load_dashboards(folder).items():
        values = default_values(board, prometheus, run_id)
        when = (at or {}).get(file)
        for panel, target in iter_targets(board):
            expr = substitute(target["expr"], values, rate_interval)
            rows.append((file, panel["title"], target["refId"], expr, finite_values(query(prometheus, expr, when))))
    return rows


def markdown(folder: Path = DASHBOARD_DIR) -> str:
    """The panel list of every dashboard as Markdown (what docs/monitoring.md shows)."""
    lines = []
    for file, board in load_dashboards(folder).items():
        lines += [f"**{board['title']}** (`dashboards/grafana/dashboards/{file}`)", ""]
        lines += ["| panel | query |", "|---|---|"]
        for panel in iter_panels(board):
            exprs = "<br>".join(f"`{t['expr'].replace('|', chr(92) + '|')}`" for t in panel.get("targets", []))
            lines.append(f"| {panel['title']} | {exprs} |")
        lines.append("")
    return "\n".join(lines)


#: What a query without data is (`classify`), and what each says on the query's line.
NO_DATA = {
    "N/A": "the run exported none of the metrics it reads (another suite kind, or a feature it did not use)",
    "GONE": "its metrics had samples within the lookback, none now: the replicas that exported them have ended",
    "BROKEN": "every metric it reads has samples for this run now, yet the expression returns none",
}


def classify(expr: str, run_id: str | None, ask, lookback: str = "1h") -> str:
    """Why `expr` (a panel query, variables substituted) returned no data: ``N/A``, ``GONE`` or ``BROKEN``
    (`NO_DATA`). `ask(promql)` returns the finite values of an instant query; `run_id` narrows the check to the
    run's series where the metric carries that label."""
    names = sorted(metric_names(expr))
    if not names:
        return "BROKEN"  # a query reading no metric should have returned its constant

    run = f'{{run_id="{run_id}"}}' if run_id and "run_id" in expr else ""
    if all(ask(f"count({n}{run})") for n in names):
        return "BROKEN"
    if any(ask(f"count(last_over_time({n}{run}[{lookback}]))") for n in names):
        return "GONE"
    return "N/A"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("list", "query"))
    p.add_argument("--prometheus", default="http://127.0.0.1:9090")
    p.add_argument("--run-id", default=None, help="sweep run to check (default: the newest)")
    p.add_argument("--rate-interval", default="30s")
    p.add_argument("--lookback", default="1h", help="how far back a GONE metric's last sample may be (PromQL range)")
    args = p.parse_args(argv)
    if args.command == "list":
        print(markdown())
        return 0
    counts = dict.fromkeys(NO_DATA, 0)
    ask = lambda promql: finite_values(query(args.prometheus, promql))  # noqa: E731
    for file, title, ref, expr, values in check(args.prometheus, args.run_id, rate_interval=args.rate_interval):
        if values:
            print(f"{len(values):>4} series  {file}  {title} [{ref}]\n            {expr}")
            continue
        kind = classify(expr, args.run_id, ask, args.lookback)
        counts[kind] += 1
        print(f"{kind:>11}  {file}  {title} [{ref}]: {NO_DATA[kind]}\n            {expr}")
    print(
        f"without data: {counts['BROKEN']} broken, {counts['GONE']} gone (their replicas ended), "
        f"{counts['N/A']} not applicable to this run"
    )
    return 1 if counts["BROKEN"] else 0


if __name__ == "__main__":
    sys.exit(main())
