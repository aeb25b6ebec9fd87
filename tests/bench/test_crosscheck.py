"""make crosscheck's pieces (bench/crosscheck.py) without running guidellm: its scenario, the parse
of its JSON report (the keys of guidellm 0.8.1's output), and the side-by-side table."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.crosscheck import guidellm_scenario, parse_guidellm, table


def _stat(median, p90=None):
    return {"successful": {"median": median, "percentiles": {"p50": median, "p90": p90}}}


REPORT = {
    "benchmarks": [
        {
            "duration": 200.0,
            "metrics": {
                "request_totals": {"successful": 32, "errored": 0, "incomplete": 0, "total": 32},
                "time_to_first_token_ms": _stat(400.0, 900.0),
                "inter_token_latency_ms": _stat(50.0),
                "request_latency": _stat(3.6),
                "output_token_count": {"successful": {"total_sum": 2048.0}},
            },
        }
    ]
}


def test_parse_guidellm_converts_ms_to_s_and_throughput_is_tokens_over_duration():
    p = parse_guidellm(REPORT)
    assert p["requests"] == 32 and p["errors"] == 0
    assert p["ttft_p50_s"] == 0.4 and p["ttft_p90_s"] == 0.9 and p["itl_p50_s"] == 0.05 and p["e2e_p50_s"] == 3.6
    assert p["output_tok_per_s"] == 2048 / 200


def test_table_ratios_against_the_mean_of_our_runs_and_the_goals():
    peer = parse_guidellm(REPORT)
    ours = [
        dict(peer, ttft_p50_s=0.5, output_tok_per_s=10.0, pooled_itl_p50_s=0.049),
        dict(peer, ttft_p50_s=0.3, output_tok_per_s=10.5, pooled_itl_p50_s=0.051),
    ]
    rows = {
        line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")
        for line in table(peer, ours).splitlines()
        if line.startswith("| ")
    }
    assert rows["TTFT p50 (s)"][4:6] == ["1.000", "ok"]  # 0.4 / mean(0.5, 0.3)
    assert rows["output (tok/s)"][4] == "0.999" and rows["output (tok/s)"][5].startswith("ok")  # 10.24 / 10.25
    assert rows["ITL p50 (s) [ours: TPOT]"][4:6] == ["1.000", "ok"]
    worse = table(peer, [dict(peer, e2e_p50_s=3.0)])
    assert "| e2e p50 (s) | 3.600 | 3.000 | 1.200 | outside ±10% |" in worse


def test_scenario_names_the_fixed_load():
    sc = guidellm_scenario(
        "http://127.0.0.1:8000/v1",
        "m:x5",
        "/tok",
        concurrency=4,
        num_requests=32,
        prompt_tokens=256,
        output_tokens=64,
        out=Path("/o.json"),
    )["spec"]
    assert sc["backend"] == {
        "kind": "openai_http",
        "target": "http://127.0.0.1:8000",
        "model": "m:x5",
        "request_format": "/v1/completions",
    }
    assert sc["profile"]["streams"] == [4] and sc["constraints"] == [{"kind": "max_requests", "count": 32}]
    assert sc["data"] == [{"kind": "synthetic_text", "prompt_tokens": 256, "output_tokens": 64}]
    assert sc["tokenizer"]["model"] == "/tok"


def test_resend_delay_is_send_minus_the_completion_that_freed_the_slot():
    from bench.crosscheck import resend_delay_p50_s

    # concurrency 2: sends at 0, 0 | ends at 10, 11 -> sends at 10.1 and 11.5 (delays 0.1 and 0.5)
    assert resend_delay_p50_s([0.0, 0.0, 10.1, 11.5], [10.0, 11.0, 20.0, 21.0], 2) == pytest.approx(0.3)
    assert resend_delay_p50_s([0.0, 0.0], [1.0, 1.0], 2) is None  # no send waited on a completion


def test_parse_guidellm_reads_per_request_times_for_the_resend_delay():
    report = {
        "benchmarks": [
            dict(
                REPORT["benchmarks"][0],
                config={"strategy": {"type_": "concurrent", "streams": 2}},
                requests={
                    "successful": [
                        {"info": {"timings": {"request_start": s, "request_end": e}}}
                        for s, e in ((0.0, 10.0), (0.0, 11.0), (10.1, 20.0), (11.5, 21.0))
                    ]
                },
            )
        ]
    }
    p = parse_guidellm(report)
    assert p["resend_delay_p50_s"] == pytest.approx(0.3) and p["replica_ttft_p50_s"] is None
    assert parse_guidellm(REPORT)["resend_delay_p50_s"] is None  # a report without per-request times


def test_server_side_rows_are_counter_differences_over_the_run():
    from bench.crosscheck import SERVER_COUNTERS, server_side

    before = {"ttft_sum_s": 10.0, "ttft_count": 4, "prefill_forwards": 2, "prefill_tokens": 1024}
    after = {"ttft_sum_s": 42.0, "ttft_count": 12, "prefill_forwards": 10, "prefill_tokens": 3072}
    assert set(before) == set(SERVER_COUNTERS)
    rows = server_side(before, after, prompt_tokens=256)
    assert rows == {"server_ttft_mean_s": 4.0, "server_prefill_forwards": 8, "server_prompts_per_prefill": 1.0}
    assert server_side(None, after, 256) == {}


def test_table_prints_the_diagnostic_rows_per_run():
    peer = dict(
        parse_guidellm(REPORT),
        resend_delay_p50_s=0.25,
        server_ttft_mean_s=9.5,
        server_prefill_forwards=32,
        server_prompts_per_prefill=1.0,
    )
    peer.update(client_cpu_s=61.25, client_cpu_share=0.25)
    ours = [
        dict(
            peer,
            resend_delay_p50_s=0.002,
            replica_ttft_p50_s=2.5,
            server_ttft_mean_s=2.6,
            server_prefill_forwards=8,
            server_prompts_per_prefill=4.0,
            client_cpu_s=12.0,
            client_cpu_share=0.05,
        )
    ]
    text = table(peer, ours)
    assert "| client CPU-s over the run [the tool's own processes] | 61.2 | 12.0 |" in text
    assert "| client CPU share of the machine [CPU-s / (wall x cores)] | 0.25 | 0.05 |" in text
    assert "| re-send delay p50 (s) [client] | 0.2500 | 0.0020 |" in text
    assert "| server prefill forwards [Prometheus] | 32 | 8 |" in text
    assert "| server prompts per prefill forward [Prometheus] | 1.00 | 4.00 |" in text
    assert "| replica TTFT p50 (s) [server's own figure, ours only] | - | 2.5000 |" in text


def test_client_cpu_counts_a_waited_child_process_tree():
    """The peer's CPU (a child process we wait for, with children of its own) is in `client_cpu_s`,
    so the table can say how much of a shared machine each client took from the server."""
    import subprocess
    import sys

    from bench.crosscheck import client_cpu_s

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    before = client_cpu_s()
    subprocess.run(
        [sys.executable, "-c", f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn!r}])\n{burn}"],
        check=True,
    )
    assert client_cpu_s() - before >= 0.6  # the child's 0.3 s and its own child's 0.3 s
