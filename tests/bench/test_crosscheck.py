"""make crosscheck's pieces (bench/crosscheck.py) without running guidellm: the paired request list and the
dataset guidellm reads from it (exact against the server's tokenization, embedded tokenizer), its scenario, the
parse of its JSON report (the keys of guidellm 0.8.1's output), the run order, and the medians, ratios and
spreads of the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import crosscheck
from bench.crosscheck import (
    compare,
    guidellm_rows,
    guidellm_scenario,
    median,
    paired_requests,
    parse_guidellm,
    run_order,
    spread,
    table,
    text_of,
    verdict,
    write_jsonl,
)


def _stat(med, p90=None):
    return {"successful": {"median": med, "percentiles": {"p50": med, "p90": p90}}}


REPORT = {
    "benchmarks": [
        {
            "duration": 200.0,
            "metrics": {
                "request_totals": {"successful": 32, "errored": 0, "incomplete": 0, "total": 32},
                "prompt_token_count": {"successful": {"total_sum": 8192.0}},
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
    assert p["prompt_tokens"] == 8192  # the server's usage counts: 32 x 256 when guidellm sent our prompts


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


# ------------------------------------------------------------------------------------------- the paired list
@pytest.fixture(scope="module")
def tokenizer():
    from scissorhands.models import load_tokenizer

    return load_tokenizer("embedded")


def test_paired_list_is_the_same_prompts_lengths_and_order_for_guidellm(tokenizer, tmp_path):
    """What guidellm sends (each row's `prompt` text, tokenized by the server as `replica.openai_api` does) is
    exactly our request's ids, with the same output length, row i = request i."""
    requests, texts = paired_requests(tokenizer, 12, 128, 24, seed=3)
    assert [r.request_id for r in requests] == [f"xc-{i}" for i in range(12)]
    assert all(len(r.prompt_ids) == 128 and r.max_new_tokens == 24 and r.ignore_eos for r in requests)
    assert len({tuple(r.prompt_ids) for r in requests}) == 12  # no prompt twice
    rows = guidellm_rows(requests, texts)
    path = write_jsonl(tmp_path / "requests.jsonl", rows)
    read = [json.loads(line) for line in path.read_text().splitlines()]
    assert read == rows and len(read) == 12
    for r, row in zip(requests, read):
        assert tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] == r.prompt_ids
        assert row["prompt_tokens_count"] == 128 and row["output_tokens_count"] == 24
    again, _ = paired_requests(tokenizer, 12, 128, 24, seed=3)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in requests]  # the same arguments, the same list
    other, _ = paired_requests(tokenizer, 12, 128, 24, seed=4)
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in requests]


def test_paired_list_keeps_the_draws_order_and_skips_only_windows_text_cannot_carry(tokenizer):
    from bench.crosscheck import CANDIDATES_PER_REQUEST
    from workloads.load.prompts import make_prompts

    requests, _ = paired_requests(tokenizer, 6, 96, 8, seed=1)
    draws = [list(map(int, d)) for d in make_prompts(tokenizer, CANDIDATES_PER_REQUEST * 6, 96, seed=1 + 96)]
    kept = [d for d in draws if text_of(tokenizer, d) is not None]
    assert [r.prompt_ids for r in requests] == kept[:6]


def test_text_of_refuses_ids_the_server_would_tokenize_otherwise(tokenizer):
    merged = tokenizer(" hello world", add_special_tokens=False)["input_ids"]
    assert text_of(tokenizer, merged) == " hello world"
    split = tokenizer.convert_tokens_to_ids(list("hello"))  # one id per character: the server merges them
    assert tokenizer.decode(split) == "hello" and text_of(tokenizer, split) is None


def test_guidellm_rows_need_a_text_per_request(tokenizer):
    requests, texts = paired_requests(tokenizer, 2, 32, 4, seed=0)
    with pytest.raises(ValueError, match="texts: 1 texts for 2 requests"):
        guidellm_rows(requests, texts[:1])


# ------------------------------------------------------------------------------------------- order and figures
def test_runs_alternate_which_tool_goes_first():
    assert run_order(1) == ["ours", "guidellm"]
    assert run_order(3) == ["ours", "guidellm", "guidellm", "ours", "ours", "guidellm"]
    with pytest.raises(ValueError, match="--repeats: expected an integer >= 1, got 0"):
        run_order(0)


def test_warmup_runs_of_our_client_come_first_and_are_marked():
    assert run_order(1, warmup_runs=2) == [crosscheck.WARMUP, crosscheck.WARMUP, "ours", "guidellm"]
    with pytest.raises(ValueError, match="--warmup-runs: expected an integer >= 0, got -1"):
        run_order(1, warmup_runs=-1)


def test_spread_is_max_minus_min_over_the_median():
    assert spread([10.0, 10.5, 9.5]) == pytest.approx(0.1)
    assert spread([2.0, 4.0]) == pytest.approx(2.0 / 3.0)  # median of two: their mean
    assert spread([5.0, 5.0, 5.0]) == 0.0
    assert spread([5.0]) is None and spread([]) is None and spread([0.0, 0.0]) is None
    assert spread([1.0, None, 1.1]) == pytest.approx(0.1 / 1.05)  # a missing figure is left out
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0]) == 2.5 and median([]) is None


def _runs(ours_tok, peer_tok, ours_ttft=(0.40, 0.40, 0.40), peer_ttft=(0.41, 0.41, 0.41)):
    base = {"requests": 32, "prompt_tokens": 8192, "ttft_p90_s": 0.9, "itl_p50_s": 0.05, "e2e_p50_s": 3.6}
    runs = []
    for tool, i in zip(run_order(3), (0, 0, 1, 1, 2, 2)):
        tok, ttft = (ours_tok, ours_ttft) if tool == "ours" else (peer_tok, peer_ttft)
        runs.append((tool, dict(base, output_tok_per_s=tok[i], ttft_p50_s=ttft[i])))
    return runs


def test_compare_takes_each_tools_median_and_the_ratio_of_medians():
    rows = {r["key"]: r for r in compare(_runs((20.0, 20.2, 19.9), (19.0, 19.8, 19.4)))}
    tok = rows["output_tok_per_s"]
    assert tok["median"] == {"ours": 20.0, "guidellm": 19.4}
    assert tok["ratio"] == pytest.approx(19.4 / 20.0) and tok["ratio_ok"] is True  # 0.97
    assert tok["spread"]["ours"] == pytest.approx(0.3 / 20.0) and tok["spread_ok"] is True  # 1.5%
    assert tok["spread"]["guidellm"] == pytest.approx(0.8 / 19.4)
    assert rows["ttft_p50_s"]["ratio"] == pytest.approx(1.025) and rows["ttft_p50_s"]["spread"]["ours"] == 0.0
    assert verdict(compare(_runs((20.0, 20.2, 19.9), (19.0, 19.8, 19.4)))).startswith("Goal met")


def test_the_goals_judge_the_ratio_and_our_own_spread():
    rows = {r["key"]: r for r in compare(_runs((20.0, 21.0, 19.0), (18.0, 18.5, 18.9)))}
    assert rows["output_tok_per_s"]["ratio"] == pytest.approx(0.925) and rows["output_tok_per_s"]["ratio_ok"] is False
    assert rows["output_tok_per_s"]["spread_ok"] is False  # (21 - 19) / 20 = 10%
    text = verdict(list(rows.values()))
    assert text == "Goal missed: outside ±5%: output (tok/s); our spread 3% or more: output (tok/s)."
    exact = {r["key"]: r for r in compare(_runs((20.0,) * 3, (21.0,) * 3))}
    assert exact["output_tok_per_s"]["ratio_ok"] is True  # 1.05 is within 5%
    one = compare([("ours", {"output_tok_per_s": 20.0}), ("guidellm", {"output_tok_per_s": 20.0})])
    assert one[-1]["spread_ok"] is None and "our spread not judged (fewer than 2 runs" in verdict(one)


def test_table_shows_medians_ratios_spreads_and_every_run():
    text = table(_runs((20.0, 20.2, 19.9), (19.0, 19.8, 19.4)))
    assert "| output (tok/s) | 19.40 | 20.00 | 0.970 | ok | 4.1% | 1.5% | ok |" in text  # 0.8 / 19.4 and 0.3 / 20
    assert "| TTFT p50 (s) | 0.4100 | 0.4000 | 1.025 | ok | 0.0% | 0.0% | ok |" in text
    assert (
        "| metric | 1: ours #1 | 2: guidellm #1 | 3: guidellm #2 | 4: ours #2 | 5: ours #3 | 6: guidellm #3 |" in text
    )
    assert "| prompt tokens (sum) | 8192 | 8192 | 8192 | 8192 | 8192 | 8192 |" in text
    assert "| output (tok/s) | 20.00 | 19.00 | 19.80 | 20.20 | 19.90 | 19.40 |" in text
    assert "Goal met" in text


def test_scenario_reads_the_paired_dataset_at_the_fixed_load():
    sc = guidellm_scenario(
        "http://127.0.0.1:8000/v1",
        "m:x5",
        "/tok",
        concurrency=4,
        num_requests=32,
        dataset=Path("/run/requests.jsonl"),
        out=Path("/o.json"),
    )["spec"]
    assert sc["backend"] == {
        "kind": "openai_http",
        "target": "http://127.0.0.1:8000",
        "model": "m:x5",
        "request_format": "/v1/completions",
        "extras": {"body": {"temperature": 0.0}},
    }
    assert sc["profile"] == {"kind": "concurrent", "streams": [4]}  # no warm-up, as ours
    assert sc["constraints"] == [{"kind": "max_requests", "count": 32}]
    assert sc["data"] == [{"kind": "json_file", "path": "/run/requests.jsonl"}]
    assert sc["tokenizer"]["model"] == "/tok" and sc["outputs"][0] == {"kind": "json", "path": "/o.json"}


def test_guidellm_send_order_is_read_from_its_requests_by_prompt_text():
    from bench.crosscheck import guidellm_send_order, in_list_order

    def req(prompt, start):
        body = {"model": "m", "prompt": prompt, "max_tokens": 4}
        return {"request_args": json.dumps({"body": body}), "info": {"timings": {"request_start": start}}}

    report = {"benchmarks": [dict(REPORT["benchmarks"][0], requests={"successful": [req("b", 2.0), req("a", 1.0)]})]}
    assert guidellm_send_order(report, ["a", "b"]) == [0, 1] and parse_guidellm(report, ["a", "b"])["in_list_order"]
    assert guidellm_send_order(report, ["b", "a"]) == [1, 0] and not parse_guidellm(report, ["b", "a"])["in_list_order"]
    assert guidellm_send_order(report, ["a"]) == [0, -1]  # a prompt not in the list
    assert parse_guidellm(report)["in_list_order"] is None
    assert in_list_order([0, 1, 2]) and not in_list_order([1, 0, 2]) and in_list_order([])
    runs = [("ours", {"in_list_order": True}), ("guidellm", {"in_list_order": False})]
    assert "| sent in the paired list's order | yes | no |" in table(runs)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--prompt-tokens", "0"], "--prompt-tokens: expected an integer >= 1, got 0"),
        (["--new-tokens", "-1"], "--new-tokens: expected an integer >= 1, got -1"),
        (["--server-timeout-s", "0"], "--server-timeout-s: expected seconds > 0, got 0.0"),
    ],
)
def test_bad_lengths_and_timeout_exit_2_naming_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit) as e:
        crosscheck.main(["--affinity", "off", *flags])
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_guidellm_gets_the_api_key_from_a_private_copy_and_the_kept_scenario_has_none(tmp_path, monkeypatch):
    """With $SCISSORHANDS_API_KEY set (make serve's key), guidellm's backend gets it as `api_key` in a scenario copy
    that is removed after the run; the scenario kept beside the report, the command line and the log never hold it."""
    seen = tmp_path / "seen.json"
    fake = tmp_path / "guidellm"
    fake.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys, pathlib\n"
        "scenario = json.loads(pathlib.Path(sys.argv[sys.argv.index('--scenario') + 1]).read_text())\n"
        f"pathlib.Path({str(seen)!r}).write_text(json.dumps(scenario))\n"
        "key = scenario['spec']['backend'].get('api_key')\n"
        "print('backend args', key)\n"  # a tool that echoes its arguments
        "pathlib.Path(scenario['spec']['outputs'][0]['path']).write_text(json.dumps({'ok': 1, 'api_key': key}))\n"
    )
    fake.chmod(0o755)
    scenario = {"spec": {"backend": {"kind": "openai_http"}, "outputs": [{"kind": "json", "path": ""}]}}
    monkeypatch.setenv("SCISSORHANDS_API_KEY", "sk-secret-1")
    with open(tmp_path / "log.txt", "w+") as log:
        assert crosscheck.run_guidellm(str(fake), scenario, tmp_path, 0, None, log) == {"ok": 1, "api_key": "***"}
    got = json.loads(seen.read_text())
    assert got["spec"]["backend"]["api_key"] == "sk-secret-1"
    kept = (tmp_path / "guidellm-scenario-0.json").read_text()
    assert "sk-secret-1" not in kept and "api_key" not in json.loads(kept)["spec"]["backend"]
    assert "sk-secret-1" not in (tmp_path / "log.txt").read_text()
    monkeypatch.delenv("SCISSORHANDS_API_KEY")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with open(tmp_path / "log.txt", "w+") as log:
        crosscheck.run_guidellm(str(fake), scenario, tmp_path, 1, None, log)
    assert "api_key" not in json.loads(seen.read_text())["spec"]["backend"]  # no key: the scenario as kept
