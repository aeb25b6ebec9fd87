"""`bench.bench_scheduler`: every row on the same requests, prefill-first and mixed at each token budget."""

from __future__ import annotations

import json

import pytest
import torch

from bench import bench_scheduler


def test_bench_scheduler_runs_both_schedulers_on_the_same_requests(tmp_path, capsys):
    torch.set_num_threads(1)
    args = ["--model", "tiny-llama", "--prompt-tokens", "64", "--new-tokens", "24", "--requests", "8"]
    assert bench_scheduler.main(args + ["--budgets", "16,32", "--block-tokens", "4", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = data["rows"]
    assert list(rows) == [label for label, _ in bench_scheduler.rows(5.0, data["kv_memory_limit_bytes"], 4, [16, 32])]
    assert list(rows)[:3] == ["full, prefill_first", "scissorhands x5, prefill_first", "full, mixed 16"]
    planned = {r["output_tokens"] for r in rows.values()}
    assert len(planned) == 1 and all(r["completed_requests"] == 8 for r in rows.values())  # the same requests
    assert {label: r["scheduler"] for label, r in rows.items()} == {
        label: "prefill_first" if "prefill_first" in label else "mixed" for label in rows
    }
    assert all(r["itl_p99_s"] >= r["itl_p50_s"] > 0 for r in rows.values())
    assert data["full_outputs_match_prefill_first"] == {"mixed 16": True, "mixed 32": True}
    out = capsys.readouterr().out
    assert "| scissorhands x5, mixed 16 | " in out and "| mixed 32 | " in out


def test_bench_scheduler_refuses_a_budget_below_one_block(capsys):
    with pytest.raises(SystemExit) as e:
        bench_scheduler.parse_args(["--budgets", "8,512", "--block-tokens", "16"])
    assert e.value.code == 2
    assert "--budgets: [8] below one block" in capsys.readouterr().err
