"""make crosscheck's pieces (workloads/crosscheck.py) without running guidellm: its scenario, the parse
of its JSON report (the keys of guidellm 0.8.1's output), and the side-by-side table."""
from __future__ import annotations

from pathlib import Path

from workloads.crosscheck import guidellm_scenario, parse_guidellm, table


def _stat(median, p90=None):
    return {"successful": {"median": median, "percentiles": {"p50": median, "p90": p90}}}


REPORT = {"benchmarks": [{"duration": 200.0, "metrics": {
    "request_totals": {"successful": 32, "errored": 0, "incomplete": 0, "total": 32},
    "time_to_first_token_ms": _stat(400.0, 900.0), "inter_token_latency_ms": _stat(50.0),
    "request_latency": _stat(3.6), "output_token_count": {"successful": {"total_sum": 2048.0}}}}]}


def test_parse_guidellm_converts_ms_to_s_and_throughput_is_tokens_over_duration():
    p = parse_guidellm(REPORT)
    assert p["requests"] == 32 and p["errors"] == 0
    assert p["ttft_p50_s"] == 0.4 and p["ttft_p90_s"] == 0.9 and p["itl_p50_s"] == 0.05 and p["e2e_p50_s"] == 3.6
    assert p["output_tok_per_s"] == 2048 / 200


def test_table_ratios_against_the_mean_of_our_runs_and_the_goals():
    peer = parse_guidellm(REPORT)
    ours = [dict(peer, ttft_p50_s=0.5, output_tok_per_s=10.0, pooled_itl_p50_s=0.049),
            dict(peer, ttft_p50_s=0.3, output_tok_per_s=10.5, pooled_itl_p50_s=0.051)]
    rows = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ") for line in table(peer, ours).splitlines()
            if line.startswith("| ")}
    assert rows["TTFT p50 (s)"][4:6] == ["1.000", "ok"]                       # 0.4 / mean(0.5, 0.3)
    assert rows["output (tok/s)"][4] == "0.999" and rows["output (tok/s)"][5].startswith("ok")   # 10.24 / 10.25
    assert rows["ITL p50 (s) [ours: TPOT]"][4:6] == ["1.000", "ok"]
    worse = table(peer, [dict(peer, e2e_p50_s=3.0)])
    assert "| e2e p50 (s) | 3.600 | 3.000 | 1.200 | outside ±10% |" in worse


def test_scenario_names_the_fixed_load():
    sc = guidellm_scenario("http://127.0.0.1:8000/v1", "m:x5", "/tok", concurrency=4, num_requests=32,
                           prompt_tokens=256, output_tokens=64, out=Path("/o.json"))["spec"]
    assert sc["backend"] == {"kind": "openai_http", "target": "http://127.0.0.1:8000", "model": "m:x5",
                             "request_format": "/v1/completions"}
    assert sc["profile"]["streams"] == [4] and sc["constraints"] == [{"kind": "max_requests", "count": 32}]
    assert sc["data"] == [{"kind": "synthetic_text", "prompt_tokens": 256, "output_tokens": 64}]
    assert sc["tokenizer"]["model"] == "/tok"
