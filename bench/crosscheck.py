"""A peer load generator confirms our numbers: guidellm and our HTTP client on the same paired requests, repeated.

    python -m bench.crosscheck --target http://127.0.0.1:8000/v1 --guidellm .venv-crosscheck/bin/guidellm

(`make crosscheck` installs guidellm (pinned) in its own virtual environment and runs this; when nothing answers
at the target, this starts the service (`python -m cluster.serve_app`) on the server's CPUs and stops only it.)

The load: `--concurrency` 4 requests in flight, `--num-requests` 32, `--prompt-tokens` 256, `--new-tokens` 64,
fixed lengths, greedy, EOS ignored. Conditions made equal:

* **CPUs of their own** (`--affinity`, `bench.affinity`): the server's whole process tree (the service's
  process, its Ray processes, the Serve proxy, ingress and engine replicas) on the server's CPUs, and each
  client (our load generator, this process; guidellm and every process it starts) on the client's CPUs,
  the same set for both. Default `auto`: on 2 CPUs the server on CPU 1 and the clients on CPU 0. A client
  then takes no CPU from the CPU-bound server (the cause of the gap measured in
  results/2026-12-01-crosscheck-9ff24ee.md).
* **One paired request list** (`paired_requests`): both tools send the same prompts, with the same output
  lengths, in the same order. Ours sends each prompt's token ids; guidellm reads a JSONL dataset written
  from the same list (`guidellm_rows`: `prompt`, `prompt_tokens_count`, `output_tokens_count`) and sends
  the prompt as text, which the server tokenizes (`add_special_tokens=False`). Only prompts whose text
  tokenizes back to exactly their ids are used, so the server runs the same ids from both tools. Arrival
  is the same rule in both: closed loop, the next request of the list sent when one of the `--concurrency`
  in flight completes. Before the measured runs, `--warmup-runs` runs of our client that are not recorded
  (`WARMUP`): the first requests on a freshly started server are slow at their tail.
* **Repeats, interleaved** (`run_order`): `--repeats` runs of each tool, alternating as ours, guidellm,
  guidellm, ours, ours, guidellm, ... so a slow drift of the machine falls on both tools alike.

The report: for each figure, the median over each tool's runs, guidellm / ours (the medians' ratio), and each
tool's run-to-run spread, (max - min) / median (`spread`). Goals (`GOALS`): every figure
within 5% of guidellm's, and our own spread under 3%.

Definitions (each tool's own; where they differ, the table says so next to it):
* TTFT: request sent -> first streamed token (both tools: client clock, first SSE event with text).
* ITL: ours pools the gaps between successive tokens of each request; guidellm's
  `inter_token_latency_ms` is (e2e - TTFT) / (output tokens - 1) per request, i.e. our TPOT; the
  table compares guidellm's ITL with our TPOT p50 and also prints our pooled ITL p50.
* e2e: request sent -> last token.
* output tok/s: output tokens / the run's window (ours: first send -> last token; guidellm: its
  `output_token_count` total / benchmark `duration`).
* prompt tokens: the sum over the run's requests (ours: the ids sent; guidellm: the server's `usage`
  counts of its text prompts), equal when both sent the same prompts; "sent in the paired list's order":
  each tool's sends, by send time, are requests 0, 1, 2, ... of the list (guidellm's matched by prompt text).

Where a difference comes from (rows under the table, measured in the same runs):
* client CPU: user + system CPU seconds of each tool over its run (ours: this process; guidellm: its
  whole process tree), and that as a share of the client's CPUs (of the machine's without affinity).
* re-send delay p50: at a fixed concurrency C, the k-th send (k >= C) should follow the
  (k - C + 1)-th completion at once; this is the median of (k-th send - that completion), from each
  tool's own per-request times (ours: records; guidellm: its report's `request_start`/`request_end`).
  guidellm 0.8.1 runs one worker process per stream that gets each request through a multiprocessing
  queue from its main process; ours sends from one asyncio loop.
* server-side, from the service's live metrics in Prometheus (`--prometheus`, when one answers;
  `make dashboards-up`), counted over each run on the same server: TTFT mean (received -> first
  token, replica clock), prefill forwards and prompts per prefill forward.
* Both tools start TTFT when the request is sent: guidellm at the first write of the request's
  headers (httpx trace hook; module `guidellm.backends.openai.http`) and ends it at the first SSE line with
  text; ours at the send, ending at the first SSE event with token ids.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from bench.affinity import AffinityPlan, format_cpu_list, pin_threads, pin_tree, plan_affinity, preexec
from bench.conditions import REPO_ROOT, conditions_line, parser, require_positive
from replica.common.types import GenerationRequest
from scissorhands.models import EMBEDDED, convert_embedded_model, load_tokenizer
from workloads.load.driver import run_load
from workloads.load.http_client import OpenAIHTTPClient, env_api_key
from workloads.load.patterns import LoadConfig
from workloads.load.prompts import make_prompts

#: Goals: |guidellm / ours - 1| within `ratio` for every figure; our spread under `spread`.
GOALS = {"ratio": 0.05, "spread": 0.03}
#: Candidate windows drawn per request needed (`paired_requests`): prompts whose text does not tokenize back to
#: their ids are skipped, so draw more than needed.
CANDIDATES_PER_REQUEST = 4
TOOLS = ("ours", "guidellm")
#: A run of our client before the measured ones, not recorded (`run_order`).
WARMUP = "warm-up (ours, not recorded)"


# ---------------------------------------------------------------------------------------------- the paired list
def text_of(tokenizer, ids: list[int]) -> str | None:
    """The text of `ids` when the server's tokenization of it (``tokenizer(text, add_special_tokens=False)``,
    `replica.openai_api`) gives back exactly `ids`; else None."""
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    back = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if list(back) == list(ids) else None


def paired_requests(
    tokenizer, n: int, prompt_tokens: int, new_tokens: int, *, seed: int, prefix: str = "xc"
) -> tuple[list[GenerationRequest], list[str]]:
    """`n` requests of `prompt_tokens` real-text token ids (`make_prompts`) and `new_tokens` output tokens, and
    each prompt's text: the first `n` distinct windows of one seeded draw whose text tokenizes back to exactly
    their ids (`text_of`), in draw order. The same arguments give the same list.

    Raises:
        ValueError: fewer than `n` of the ``CANDIDATES_PER_REQUEST * n`` windows drawn round-trip.
    """
    draws = make_prompts(tokenizer, CANDIDATES_PER_REQUEST * n, prompt_tokens, seed=seed + prompt_tokens)
    requests, texts, seen = [], [], set()
    for ids in draws:
        ids = [int(i) for i in ids]
        if tuple(ids) in seen:
            continue
        text = text_of(tokenizer, ids)
        if text is None:
            continue
        seen.add(tuple(ids))
        requests.append(GenerationRequest(f"{prefix}-{len(requests)}", ids, new_tokens))
        texts.append(text)
        if len(requests) == n:
            return requests, texts
    raise ValueError(
        f"--num-requests: only {len(requests)} of {len(draws)} prompt windows of {prompt_tokens} tokens tokenize back "
        f"to their own ids; {n} are needed (try another --seed or --prompt-tokens)"
    )


def guidellm_rows(requests: list[GenerationRequest], texts: list[str]) -> list[dict]:
    """guidellm's dataset rows for `requests` in order: the prompt's text (its `text_column`), its token count
    and the output tokens to ask for (`prompt_tokens_count`, `output_tokens_count`: guidellm sends the latter
    as ``max_tokens`` with ``ignore_eos``)."""
    if len(requests) != len(texts):
        raise ValueError(f"texts: {len(texts)} texts for {len(requests)} requests")
    return [
        {"prompt": text, "prompt_tokens_count": len(r.prompt_ids), "output_tokens_count": r.max_new_tokens}
        for r, text in zip(requests, texts)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


# ---------------------------------------------------------------------------------------------- runs and figures
def run_order(repeats: int, warmup_runs: int = 0) -> list[str]:
    """The tools in the order they run: `warmup_runs` unrecorded runs of our client (`WARMUP`; a fresh server's
    first run had a TTFT p90 3.6x its later ones', docs/results/2026-12-04-crosscheck-idle.md), then pairs
    alternating ours-first and guidellm-first (ours, guidellm, guidellm, ours, ...), so a linear drift of the
    machine's speed falls on both tools alike.

    Raises:
        ValueError: `repeats` below 1 or `warmup_runs` below 0 (the message names the flag).
    """
    if repeats < 1:
        raise ValueError(f"--repeats: expected an integer >= 1, got {repeats}")
    if warmup_runs < 0:
        raise ValueError(f"--warmup-runs: expected an integer >= 0, got {warmup_runs}")
    return [WARMUP] * warmup_runs + [t for r in range(repeats) for t in (TOOLS if r % 2 == 0 else TOOLS[::-1])]


def median(values: list[float]) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def spread(values: list[float]) -> float | None:
    """Run-to-run spread: (max - min) / median of the values (None without two values or with a median of 0)."""
    vals = [v for v in values if v is not None]
    m = median(vals)
    if len(vals) < 2 or not m:
        return None
    return (max(vals) - min(vals)) / m


async def run_ours(target: str, model: str, requests: list[GenerationRequest], *, concurrency: int) -> dict:
    """Our load generator through the HTTP client on `requests`, in order: the table's metrics (seconds, tok/s)."""
    client = OpenAIHTTPClient(target, model)
    try:
        res = await run_load(
            client, requests, LoadConfig(mode="concurrency", concurrency=concurrency, num_requests=len(requests))
        )
    finally:
        await client.close()
    m = res.metrics
    sent = [r for r in res.records if r.send_time_s is not None and r.finish_time_s is not None]
    place = {r.request_id: i for i, r in enumerate(requests)}
    by_send = sorted((r for r in res.records if r.send_time_s is not None), key=lambda r: r.send_time_s)
    return {
        "in_list_order": in_list_order([place.get(r.request_id.split("#")[0], -1) for r in by_send]),
        "resend_delay_p50_s": resend_delay_p50_s(
            [r.send_time_s for r in sent], [r.finish_time_s for r in sent], concurrency
        ),
        "replica_ttft_p50_s": m.replica_ttft_s.p50_s if m.replica_ttft_s.n else None,
        "requests": m.completed_requests,
        "errors": m.failed_requests,
        "prompt_tokens": m.input_tokens,
        "ttft_p50_s": m.ttft_s.p50_s,
        "ttft_p90_s": m.ttft_s.p90_s,
        "itl_p50_s": m.tpot_s.p50_s,
        "pooled_itl_p50_s": m.itl_s.p50_s,
        "e2e_p50_s": m.e2e_latency_s.p50_s,
        "output_tok_per_s": m.output_throughput_tok_per_s,
        "output_tokens": m.output_tokens,
    }


def resend_delay_p50_s(starts: list[float], ends: list[float], concurrency: int) -> float | None:
    """Median delay between a completion and the send it frees in a closed loop of `concurrency`:
    sorted, the k-th send (k >= concurrency) follows the (k - concurrency + 1)-th completion, so the
    delay is ``starts[k] - ends[k - concurrency]`` (seconds). None with no such pair."""
    s, e = sorted(starts), sorted(ends)
    return median([s[k] - e[k - concurrency] for k in range(concurrency, min(len(s), len(e) + concurrency))])


def in_list_order(indices: list[int]) -> bool:
    """Whether requests were sent as the list orders them: `indices` (each request's place in the paired list,
    in the order of its send) is 0, 1, 2, ..."""
    return indices == list(range(len(indices)))


def _find(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def guidellm_send_order(report: dict, prompts: list[str]) -> list[int]:
    """Each successful request's place in the paired list (`prompts`, by its prompt text; -1 when not there), in
    the order guidellm sent them (its `request_start`)."""
    reqs = _find(report["benchmarks"][0], "requests", "successful") or []
    place = {p: i for i, p in enumerate(prompts)}
    out = []
    for r in sorted(reqs, key=lambda r: _find(r, "info", "timings", "request_start") or math.inf):
        args = r.get("request_args")
        args = json.loads(args) if isinstance(args, str) else args or {}
        out.append(place.get(_find(args, "body", "prompt"), -1))
    return out


def parse_guidellm(report: dict, prompts: list[str] | None = None) -> dict:
    """guidellm 0.8's JSON report -> the table's metrics (its `_ms` latencies converted to seconds); with the paired
    list's `prompts`, whether guidellm sent them in the list's order."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]

    def stat(name: str, which: str, scale: float = 1e-3):
        succ = _find(m, name, "successful")
        v = None if succ is None else succ.get("median") if which == "p50" else _find(succ, "percentiles", which)
        return None if v is None else float(v) * scale

    tokens = _find(m, "output_token_count", "successful", "total_sum")
    prompt_tokens = _find(m, "prompt_token_count", "successful", "total_sum")
    duration = bench.get("duration")
    timings = [(_find(r, "info", "timings") or {}) for r in _find(bench, "requests", "successful") or []]
    starts = [t["request_start"] for t in timings if t.get("request_start") is not None]
    ends = [t.get("request_end") or t.get("resolve_end") for t in timings]
    concurrency = _find(bench, "config", "strategy", "streams")
    return {
        "in_list_order": None if prompts is None else in_list_order(guidellm_send_order(report, prompts)),
        "resend_delay_p50_s": resend_delay_p50_s(starts, [e for e in ends if e is not None], int(concurrency))
        if concurrency and len(starts) == len(timings)
        else None,
        "replica_ttft_p50_s": None,
        "requests": _find(m, "request_totals", "successful"),
        "errors": _find(m, "request_totals", "errored"),
        "prompt_tokens": None if prompt_tokens is None else int(prompt_tokens),
        "ttft_p50_s": stat("time_to_first_token_ms", "p50"),
        "ttft_p90_s": stat("time_to_first_token_ms", "p90"),
        "itl_p50_s": stat("inter_token_latency_ms", "p50"),
        "pooled_itl_p50_s": None,
        "e2e_p50_s": stat("request_latency", "p50", 1.0),
        "output_tok_per_s": tokens / duration if tokens is not None and duration else None,
        "output_tokens": tokens,
    }


#: The compared figures: (label, key, format); each has the ratio and spread goals.
FIGURES = [
    ("TTFT p50 (s)", "ttft_p50_s", ".4f"),
    ("TTFT p90 (s)", "ttft_p90_s", ".4f"),
    ("ITL p50 (s) [ours: TPOT]", "itl_p50_s", ".4f"),
    ("e2e p50 (s)", "e2e_p50_s", ".3f"),
    ("output (tok/s)", "output_tok_per_s", ".2f"),
]
#: Counts that must be equal in every run (the same paired requests, all completed).
COUNTS = [
    ("requests (ok)", "requests", "d"),
    ("prompt tokens (sum)", "prompt_tokens", "d"),
    ("sent in the paired list's order", "in_list_order", ""),
]
DIAGNOSTIC_ROWS = [
    ("client CPU-s over the run [the tool's own processes]", "client_cpu_s", ".1f"),
    ("client CPU share [CPU-s / (wall x the client's CPUs)]", "client_cpu_share", ".2f"),
    ("re-send delay p50 (s) [client]", "resend_delay_p50_s", ".4f"),
    ("our pooled ITL p50 (s)", "pooled_itl_p50_s", ".4f"),
    ("replica TTFT p50 (s) [server's own figure, ours only]", "replica_ttft_p50_s", ".4f"),
    ("server TTFT mean (s) [Prometheus]", "server_ttft_mean_s", ".4f"),
    ("server prefill forwards [Prometheus]", "server_prefill_forwards", ".0f"),
    ("server prompts per prefill forward [Prometheus]", "server_prompts_per_prefill", ".2f"),
    ("wall time (s)", "wall_s", ".0f"),
]


def compare(runs: list[tuple[str, dict]]) -> list[dict]:
    """One dict per figure of `FIGURES` from `runs` ((tool, row) in run order): each tool's median and spread,
    guidellm / ours (the medians' ratio), and whether the ratio and our spread meet `GOALS` (None when unknown)."""
    out = []
    for label, key, fmt in FIGURES:
        vals = {t: [row.get(key) for tool, row in runs if tool == t] for t in TOOLS}
        med = {t: median(vals[t]) for t in TOOLS}
        ratio = med["guidellm"] / med["ours"] if med["guidellm"] is not None and med["ours"] else None
        ours_spread = spread(vals["ours"])
        out.append(
            {
                "label": label,
                "key": key,
                "format": fmt,
                "median": med,
                "spread": {t: spread(vals[t]) for t in TOOLS},
                "ratio": ratio,
                "ratio_ok": None if ratio is None else abs(ratio - 1) <= GOALS["ratio"] + 1e-12,
                "spread_ok": None if ours_spread is None else ours_spread < GOALS["spread"],
            }
        )
    return out


def verdict(rows: list[dict]) -> str:
    """One line: whether every figure met both goals, else which missed which."""
    far = [r["label"] for r in rows if r["ratio_ok"] is False]
    wide = [r["label"] for r in rows if r["spread_ok"] is False]
    no_ratio = [r["label"] for r in rows if r["ratio_ok"] is None]
    no_spread = [r["label"] for r in rows if r["spread_ok"] is None]
    if not far and not wide and not no_ratio and not no_spread:
        return f"Goal met: every figure within ±{GOALS['ratio']:.0%} of guidellm's, our spread under {GOALS['spread']:.0%}."
    parts = []
    if far:
        parts.append(f"outside ±{GOALS['ratio']:.0%}: {', '.join(far)}")
    if wide:
        parts.append(f"our spread {GOALS['spread']:.0%} or more: {', '.join(wide)}")
    if no_ratio:
        parts.append(f"ratio not judged (a figure missing): {', '.join(no_ratio)}")
    if no_spread:
        parts.append(f"our spread not judged (fewer than 2 runs, or a figure missing): {', '.join(no_spread)}")
    return "Goal missed: " + "; ".join(parts) + "."


def _f(v, fmt: str) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    return "-" if v is None else format(v, fmt)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def table(runs: list[tuple[str, dict]]) -> str:
    """Markdown: the comparison (medians, guidellm / ours, each tool's spread, the goals), the verdict, then
    every run's figures and diagnostics in run order."""
    rows = compare(runs)
    n = {t: sum(1 for tool, _ in runs if tool == t) for t in TOOLS}
    head = [
        "metric",
        f"guidellm (median of {n['guidellm']})",
        f"ours (median of {n['ours']})",
        "guidellm / ours",
        f"within ±{GOALS['ratio']:.0%}",
        "guidellm spread",
        "ours spread",
        f"ours < {GOALS['spread']:.0%}",
    ]
    ok = {True: "ok", False: "no", None: "-"}
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [
            r["label"],
            _f(r["median"]["guidellm"], r["format"]),
            _f(r["median"]["ours"], r["format"]),
            _f(r["ratio"], ".3f"),
            ok[r["ratio_ok"]],
            _pct(r["spread"]["guidellm"]),
            _pct(r["spread"]["ours"]),
            ok[r["spread_ok"]],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", verdict(rows), "", "Every run, in run order (spread = (max - min) / median over a tool's runs):", ""]
    counter = {t: 0 for t in TOOLS}
    run_head = ["metric"]
    for tool, _ in runs:
        counter[tool] += 1
        run_head.append(f"{len(run_head)}: {tool} #{counter[tool]}")
    lines += ["| " + " | ".join(run_head) + " |", "|" + "|".join("---" for _ in run_head) + "|"]
    for label, key, fmt in COUNTS + FIGURES + DIAGNOSTIC_ROWS:
        lines.append("| " + " | ".join([label] + [_f(row.get(key), fmt) for _, row in runs]) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- server-side rows
#: The service replicas' live counters the server-side rows are read from (`make serve` labels them
#: run_id="adhoc"; sweeps on the same machine carry their own run ids, so they do not mix in).
SERVER_COUNTERS = {
    "ttft_sum_s": 'sum(ray_scissorhands_ttft_seconds_exact_sum_total{run_id="adhoc", phase="measured"})',
    "ttft_count": 'sum(ray_scissorhands_ttft_seconds_count{run_id="adhoc", phase="measured"})',
    "prefill_forwards": 'sum(ray_scissorhands_prefill_seconds_count{run_id="adhoc"})',
    "prefill_tokens": 'sum(ray_scissorhands_prefill_tokens_total{run_id="adhoc"})',
}
#: Seconds to wait after a run before reading the counters: one export (5 s) + one scrape (5 s) + slack.
SETTLE_S = 12.0


def client_cpu_s() -> float:
    """User + system CPU seconds of this process and of its waited-for children (the peer tool), so far."""
    import resource

    return sum(
        u.ru_utime + u.ru_stime
        for u in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def server_counters(prometheus: str | None) -> dict | None:
    """The `SERVER_COUNTERS` now, from Prometheus' HTTP API; None when it does not answer."""
    if not prometheus:
        return None
    out = {}
    try:
        for key, expr in SERVER_COUNTERS.items():
            url = prometheus.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            with urllib.request.urlopen(url, timeout=5) as resp:
                result = json.load(resp)["data"]["result"]
            out[key] = float(result[0]["value"][1]) if result else 0.0
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return out


def server_side(before: dict | None, after: dict | None, prompt_tokens: int) -> dict:
    """The server-side rows of one run from the counters read before and after it (None when unread)."""
    if before is None or after is None:
        return {}
    d = {k: after[k] - before[k] for k in SERVER_COUNTERS}
    forwards = d["prefill_forwards"]
    return {
        "server_ttft_mean_s": d["ttft_sum_s"] / d["ttft_count"] if d["ttft_count"] > 0 else None,
        "server_prefill_forwards": forwards,
        "server_prompts_per_prefill": d["prefill_tokens"] / prompt_tokens / forwards if forwards > 0 else None,
    }


# ---------------------------------------------------------------------------------------------- guidellm
def guidellm_scenario(
    target: str, model: str, processor: str, *, concurrency: int, num_requests: int, dataset: Path, out: Path
) -> dict:
    """guidellm 0.8's scenario (the `run --scenario` file): `/v1/completions`, the paired requests from
    `dataset` (a JSONL file of `guidellm_rows`, read in order), `concurrency` streams, `num_requests`, greedy
    (temperature 0, as ours); its tokenizer is the embedded model's folder (no hub)."""
    base = target.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    return {
        "metadata": {"name": "scissorhands-crosscheck", "description": "make crosscheck: one fixed load"},
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": base,
                "model": model,
                "request_format": "/v1/completions",
                "extras": {"body": {"temperature": 0.0}},
            },
            "profile": {"kind": "concurrent", "streams": [concurrency]},
            "tokenizer": {"kind": "huggingface_auto", "model": processor},
            "data": [{"kind": "json_file", "path": str(dataset)}],
            "constraints": [{"kind": "max_requests", "count": num_requests}],
            "outputs": [{"kind": "json", "path": str(out)}, {"kind": "console"}],
        },
    }


def run_guidellm(guidellm: str, scenario: dict, out_dir: Path, index: int, cpus: frozenset[int] | None, log) -> dict:
    """Run guidellm once with `scenario` (its whole process tree on `cpus` when given); its parsed JSON report.
    With an API key (`env_api_key`, as our client), guidellm reads it from a copy of the scenario in a private
    temporary folder, removed after the run; the scenario kept beside the report has none, and the key is masked
    (``***``) wherever guidellm wrote it in its output or its report."""
    out = out_dir / f"guidellm-{index}.json"
    scenario["spec"]["outputs"][0]["path"] = str(out)
    path = out_dir / f"guidellm-scenario-{index}.json"
    path.write_text(json.dumps(scenario, indent=2))
    log.flush()
    start = log.tell()
    with tempfile.TemporaryDirectory() as private:  # mode 0700
        run_path, key = path, env_api_key()
        if key:
            run_path = Path(private) / path.name
            run_path.write_text(
                json.dumps(
                    {
                        **scenario,
                        "spec": {**scenario["spec"], "backend": {**scenario["spec"]["backend"], "api_key": key}},
                    }
                )
            )
        cmd = [guidellm, "run", "--scenario", str(run_path), "--disable-console-interactive"]
        print("crosscheck: " + " ".join(cmd), file=sys.stderr)
        done = subprocess.run(
            cmd,
            env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
            preexec_fn=None if cpus is None else preexec(cpus),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    log.flush()
    if key:  # guidellm may echo its arguments (its errors print inputs, its report its backend): never keep the key
        for path, at in ((Path(log.name), start), (out, 0)):
            if path.exists() and key in (text := path.read_text(errors="replace")):
                path.write_text(text[:at] + text[at:].replace(key, "***"))
        log.seek(0, os.SEEK_END)
    if done.returncode != 0:
        with open(log.name, errors="replace") as f:
            f.seek(start)
            tail = f.read()[-3000:]
        raise RuntimeError(f"guidellm exited with {done.returncode}; the end of its output ({log.name}):\n{tail}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------- the server
def health_url(target: str) -> str:
    """``http://host:port/health`` of an OpenAI base URL such as ``http://host:port/v1``."""
    base = target.rstrip("/")
    return (base[:-3] if base.endswith("/v1") else base) + "/health"


def answers(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


def serve_pid_of(pid_file: Path) -> int | None:
    """The pid in `pid_file` (`make serve`'s) when that process is alive and is the service; else None."""
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
        return None
    return pid if "cluster.serve_app" in cmdline else None


def start_server(target: str, cpus: frozenset[int] | None, dtype: str, log_path: Path) -> subprocess.Popen:
    """Start the service on the target's loopback port, its whole process tree on `cpus` (when given).

    Raises:
        ValueError: the target is not on loopback (this starts servers only there).
    """
    url = urllib.parse.urlparse(target)
    if url.hostname not in ("127.0.0.1", "localhost"):
        raise ValueError(f"--target: nothing answers at {target} and a server is started only on 127.0.0.1")
    cmd = [sys.executable, "-m", "cluster.serve_app", "--port", str(url.port or 80), "--dtype", dtype]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"crosscheck: starting {' '.join(cmd[1:])} (log {log_path})", file=sys.stderr)
    with open(log_path, "w") as log:
        return subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=None if cpus is None else preexec(cpus),
        )


def wait_for_server(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    t0 = time.time()
    while not answers(url):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering at {url}")
        if time.time() - t0 > timeout_s:
            raise RuntimeError(f"the server did not answer at {url} within {timeout_s:.0f} s")
        time.sleep(1.0)


def stop_server(proc: subprocess.Popen) -> None:
    print(f"crosscheck: stopping the server it started (pid {proc.pid})", file=sys.stderr)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = parser(
        "crosscheck",
        __doc__,
        "about 15 minutes on a quiet machine with the defaults (server start, 3 repeats of each tool of 1-2 "
        "minutes each, 12 s settling after each when Prometheus answers); more under load",
    )
    p.add_argument("--target", default="http://127.0.0.1:8000/v1", help="the OpenAI-compatible server's base URL")
    p.add_argument("--model", default="smollm2-135m-instruct:scissorhands-x5", help="the served model id")
    p.add_argument("--guidellm", default=".venv-crosscheck/bin/guidellm", help="the guidellm executable")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--num-requests", type=int, default=32, help="requests per run (the paired list)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens per prompt (fixed)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (fixed, greedy)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each tool, interleaved")
    p.add_argument("--warmup-runs", type=int, default=1, help="unrecorded runs of our client before the measured ones")
    p.add_argument("--seed", type=int, default=0, help="seed of the paired prompts")
    p.add_argument(
        "--affinity",
        default="auto",
        help="CPUs of their own: auto (clients on the lowest max(1, n/4) CPUs, the server on the rest; on 2 CPUs "
        "client 0, server 1), CLIENT:SERVER lists (e.g. 0:1, 0-1:2-7), or off (shared)",
    )
    p.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="the running server's root process (pinned with its whole tree); default: --server-pid-file's",
    )
    p.add_argument(
        "--server-pid-file", default=str(REPO_ROOT / ".serve.pid"), help="make serve's pid file, for a running server"
    )
    p.add_argument("--server-dtype", default="auto", help="--dtype of a server this starts")
    p.add_argument("--server-timeout-s", type=float, default=600.0, help="wait this long for a started server")
    p.add_argument("--out-dir", default="results/crosscheck", help="a dated folder under it gets table.md, runs.json")
    p.add_argument(
        "--prometheus",
        default="http://127.0.0.1:9090",
        help="Prometheus with the service's live metrics, for the server-side rows ('' skips them)",
    )
    args = p.parse_args(argv)
    try:
        order = run_order(args.repeats, args.warmup_runs)
        plan = plan_affinity(args.affinity, os.sched_getaffinity(0))
    except ValueError as e:
        p.error(str(e))
    require_positive(p, args, "concurrency", "num_requests", "prompt_tokens", "new_tokens")
    if args.server_timeout_s <= 0:
        p.error(f"--server-timeout-s: expected seconds > 0, got {args.server_timeout_s}")
    if not os.access(args.guidellm, os.X_OK):
        p.error(
            f"--guidellm: {args.guidellm} is not an executable; `make crosscheck` installs guidellm in .venv-crosscheck"
        )
    if plan is not None:
        pin_threads(os.getpid(), plan.client)  # this process (our client) and what it starts from here on

    tokenizer = load_tokenizer(EMBEDDED)
    try:  # before any server starts: a list that cannot be made ends the run at once
        paired = paired_requests(tokenizer, args.num_requests, args.prompt_tokens, args.new_tokens, seed=args.seed)
    except ValueError as e:
        p.error(str(e))
    if args.server_pid is not None and not os.path.exists(f"/proc/{args.server_pid}"):
        p.error(f"--server-pid: no process {args.server_pid} is running")
    health = health_url(args.target)
    server_root, started = None, None
    if answers(health):
        server_root = args.server_pid or serve_pid_of(Path(args.server_pid_file))
        if plan is not None and server_root is None:
            p.error(
                f"--affinity {args.affinity}: a server already answers at {args.target} but its process is not known: "
                f"pass --server-pid (the `python -m cluster.serve_app` process; make serve writes {args.server_pid_file}), "
                "stop it so that crosscheck starts its own, or pass --affinity off"
            )
    elif args.server_pid is not None:
        p.error(
            f"--server-pid: names a running server, but nothing answers at {health} (stop the flag to let crosscheck start one)"
        )
    out_dir = Path(args.out_dir) / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        if server_root is None and not answers(health):
            try:
                started = start_server(
                    args.target, None if plan is None else plan.server, args.server_dtype, out_dir / "serve.log"
                )
            except ValueError as e:
                p.error(str(e))
            wait_for_server(started, health, args.server_timeout_s)
            server_root = started.pid
        return _measure(args, order, plan, paired, server_root, started is not None, out_dir)
    finally:
        if started is not None:
            stop_server(started)


def _measure(
    args,
    order: list[str],
    plan: AffinityPlan | None,
    paired: tuple[list[GenerationRequest], list[str]],
    server_root: int | None,
    started: bool,
    out_dir: Path,
) -> int:
    """The interleaved runs on the paired list; writes table.md and runs.json; 0 when every run measured."""
    processor = str(convert_embedded_model())  # the tokenizer folder guidellm reads (no hub access)
    requests, texts = paired
    dataset = write_jsonl(out_dir / "requests.jsonl", guidellm_rows(requests, texts))
    scenario = guidellm_scenario(
        args.target,
        args.model,
        processor,
        concurrency=args.concurrency,
        num_requests=args.num_requests,
        dataset=dataset,
        out=out_dir / "guidellm.json",
    )
    prom = args.prometheus if server_counters(args.prometheus) is not None else None
    if prom is None:
        print(
            f"crosscheck: no Prometheus answers at {args.prometheus!r} (make dashboards-up): no server-side rows",
            file=sys.stderr,
        )
    client_cpus = len(plan.client) if plan is not None else (os.cpu_count() or 1)
    began = time.time()
    runs: list[tuple[str, dict]] = []
    pinned = None
    guidellm_log = open(out_dir / "guidellm.log", "w")
    try:
        for tool in order:
            if plan is not None:
                pin_threads(os.getpid(), plan.client)
                if server_root is not None:
                    pinned = pin_tree(server_root, plan.server)
                    print(f"crosscheck: server {pinned.describe()}", file=sys.stderr)
            t0, before, cpu0 = time.time(), server_counters(prom), client_cpu_s()
            if tool == WARMUP:
                asyncio.run(run_ours(args.target, args.model, requests, concurrency=args.concurrency))
                print(f"crosscheck: {tool} done in {time.time() - t0:.0f} s", file=sys.stderr)
                continue
            if tool == "ours":
                row = asyncio.run(run_ours(args.target, args.model, requests, concurrency=args.concurrency))
            else:
                index = sum(1 for t, _ in runs if t == "guidellm") + 1
                report = run_guidellm(
                    args.guidellm, scenario, out_dir, index, None if plan is None else plan.client, guidellm_log
                )
                row = parse_guidellm(report, texts)
            wall = time.time() - t0
            cpu = client_cpu_s() - cpu0
            row.update(client_cpu_s=cpu, client_cpu_share=cpu / (wall * client_cpus), wall_s=wall)
            if prom is not None:
                time.sleep(SETTLE_S)
            row.update(server_side(before, server_counters(prom), args.prompt_tokens))
            runs.append((tool, row))
            print(
                f"crosscheck: run {len(runs)}/{len(order) - args.warmup_runs} ({tool}) done in {wall:.0f} s",
                file=sys.stderr,
            )
    finally:
        guidellm_log.close()

    where = (
        "affinity off: the server and both clients share every CPU"
        if plan is None
        else f"{plan.describe()} (bench.affinity; server tree: "
        + (pinned.describe() if pinned is not None else "not pinned: its process is unknown")
        + ")"
    )
    conditions = conditions_line(
        model=f"{args.model} at {args.target}",
        dtype=(
            f"{args.server_dtype} (the server this started resolves it)"
            if started
            else "the running server's (not seen by the client)"
        ),
        extra=where
        + (
            "; the server started here: python -m cluster.serve_app, engines on 1 torch thread each (its default); "
            "'threads' above are the client process's"
            if started
            else "; 'threads' above are the client process's"
        ),
    )
    text = (
        f"{conditions}\n\nCross-check at {args.concurrency} in flight, {args.num_requests} paired requests (the same "
        f"prompts, output lengths and order for both tools: requests.jsonl), {args.prompt_tokens} + {args.new_tokens} "
        f"tokens (fixed, greedy), {args.warmup_runs} warm-up run(s) of our client (not recorded), then "
        f"{args.repeats} runs of each tool interleaved ({', '.join(t for t in order if t != WARMUP)}); "
        f"wall time {time.time() - began:.0f} s.\n\n" + table(runs) + "\n" + __doc__[__doc__.index("Definitions") :]
    )
    (out_dir / "table.md").write_text(text)
    (out_dir / "runs.json").write_text(
        json.dumps(
            {
                "runs": [{"tool": t, **row} for t, row in runs],
                "compare": compare(runs),
                "affinity": None
                if plan is None
                else {"client": format_cpu_list(plan.client), "server": format_cpu_list(plan.server)},
                "load": {
                    "concurrency": args.concurrency,
                    "num_requests": args.num_requests,
                    "prompt_tokens": args.prompt_tokens,
                    "new_tokens": args.new_tokens,
                    "repeats": args.repeats,
                    "seed": args.seed,
                },
            },
            indent=2,
        )
    )
    print(text)
    return 0 if all(math.isfinite(row.get("output_tok_per_s") or math.nan) for _, row in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
