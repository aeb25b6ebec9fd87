"""`make bench-serving` end to end on the tiny model (numbers mean nothing; the wiring is checked)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from bench import bench_serving


def test_bench_serving_runs_every_row_on_the_same_requests_and_part_2(tmp_path, capsys):
    torch.set_num_threads(1)
    args = ["--model", "tiny-llama", "--prompt-tokens", "64", "--new-tokens", "24", "--full-batch", "2"]
    args += ["--block-tokens", "4", "--generate-new-tokens", "8", "--out", str(tmp_path)]
    assert bench_serving.main(args) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert list(data["workloads"]) == ["equal", "mix"] and data["args"]["requests"] == 12
    limit = data["kv_memory_limit_bytes"]
    for name, w in data["workloads"].items():
        rows = w["rows"]
        assert list(rows) == [label for label, _ in bench_serving.part1_rows(64, 24, 5.0, limit, 4, 16, 512)]
        assert rows["full, paged, mixed"]["scheduler"] == rows["scissorhands x5, paged, mixed"]["scheduler"] == "mixed"
        assert rows["full, paged"]["scheduler"] == "prefill_first" and rows["full, paged"]["itl_p99_s"] > 0
        planned = sum(w["new_tokens"])
        assert all(r["output_tokens"] == planned and r["completed_requests"] == 12 for r in rows.values())
        for label, r in rows.items():
            # a paged row's blocks stay within the limit; its bookkeeping (slot times, policy statistics: at
            # most 16 bytes a slot, KV head and layer) is dense per row, padded to the longest row, outside the
            # pool: at most running rows x (64 + 24) slots x 2 KV heads x 2 layers x 16 B beyond the limit
            padded = 0 if r["kv_layout"] == "preallocated" else r["peak_running_sequences"] * 88 * 2 * 2 * 16
            assert r["peak_kv_cache_bytes"] <= limit + padded, label
        peer = w["peer_generate_batch"]  # transformers' continuous batching, its paged cache of the same bytes
        assert peer["output_tokens"] == planned and peer["completed_requests"] == 12 and peer["kv_cache_bytes"] <= limit
        assert 0 <= peer["identical_tokens"] <= 12 and "outputs" not in peer
        pre, paged = rows["full, preallocated"], rows["full, paged"]
        assert pre["kv_layout"] == "preallocated" and paged["kv_layout"] == "paged"
        assert pre["peak_running_sequences"] == 2  # the limit holds two preallocated rows
        assert rows["scissorhands x5, paged"]["peak_running_sequences"] > pre["peak_running_sequences"]
    mix = data["workloads"]["mix"]
    assert min(mix["new_tokens"]) >= 16 and max(mix["new_tokens"]) <= 24 and 16 <= min(mix["prompt_tokens"])
    # outputs shorter than the longest: the paged full cache runs more rows than the preallocated one reserves
    assert mix["rows"]["full, paged"]["peak_running_sequences"] > 2
    assert data["identical_tokens"] == 4 * 2 and data["ratio_engine_vs_generate"] > 0
    out = capsys.readouterr().out
    assert "| scissorhands x5, paged | " in out and "| our engine / transformers generate, output tok/s |" in out
    assert f"| {bench_serving.PEER_LABEL} | " in out and "Identical tokens vs paged full: " in out
    assert "Mixed scheduler (512 tokens a step): Scissorhands x5 / full, output tok/s **" in out


def test_bench_serving_leaves_the_peer_out_on_request_and_checks_its_page_size(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        bench_serving.main(["--model", "tiny-llama", "--block-tokens", "3"])
    assert e.value.code == 2 and "--block-tokens 3: transformers' paged cache" in capsys.readouterr().err
    args = ["--model", "tiny-llama", "--prompt-tokens", "16", "--new-tokens", "4", "--full-batch", "2"]
    args += ["--block-tokens", "3", "--workloads", "equal", "--generate-new-tokens", "4", "--skip-generate"]
    args += ["--no-peer-generate-batch"]
    assert bench_serving.main([*args, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["workloads"]["equal"]["peer_generate_batch"] is None
    assert bench_serving.PEER_LABEL not in capsys.readouterr().out


def test_bench_serving_names_an_unknown_workload(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        bench_serving.main(["--model", "tiny-llama", "--workloads", "equal,azure"])
    assert e.value.code == 2
    assert "--workloads: expected a comma-separated list of equal, mix, got 'equal,azure'" in capsys.readouterr().err


def test_bench_serving_rejects_a_part_2_longer_than_the_limit_allows(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        bench_serving.main(["--model", "tiny-llama", "--new-tokens", "12", "--generate-new-tokens", "13"])
    assert e.value.code == 2
    assert "--generate-new-tokens (13) must be <= --new-tokens (12)" in capsys.readouterr().err


def test_part_1_runs_the_engines_interleaved_and_times_each_over_its_own_steps(monkeypatch):
    from replica.common.types import EngineConfig, GenerationRequest
    from replica.engine import ContinuousBatchingEngine
    from replica.model_loading import load_replica_model

    torch.set_num_threads(1)
    model, _ = load_replica_model("tiny-llama")
    log = []
    step = ContinuousBatchingEngine.step

    def logged(self):
        busy = step(self)
        log.append((self.config.policy, busy))
        return busy

    monkeypatch.setattr(ContinuousBatchingEngine, "step", logged)
    reqs = [GenerationRequest(f"r{i}", list(range(1, 9)), n) for i, n in enumerate((3, 6))]
    full, sh = bench_serving.run_engines(
        model,
        [
            (EngineConfig(policy="full", max_batch=1), reqs[:1]),
            (EngineConfig(policy="scissorhands", budget_tokens=4), reqs),
        ],
    )
    # after each engine's warm-up (one step, one idle step): a step makes a prompt's first token and a
    # decode token, so full takes 2 busy steps and 1 idle one, Scissorhands (6 tokens) 5 and 1; the
    # engines alternate until full is idle, then Scissorhands goes on alone
    run = log[-9:]
    assert [p for p, _ in run] == ["full", "scissorhands"] * 3 + ["scissorhands"] * 3
    assert [b for p, b in run] == [True] * 4 + [False] + [True] * 3 + [False]
    assert full["output_tokens"] == 3 and sh["output_tokens"] == 9
    assert 0 < full["wall_s"] < sh["wall_s"] and full["cpu_s"] > 0


def test_the_progress_bar_counts_every_generated_token(monkeypatch):
    """The bar reads the engine's public `generated_tokens` after each step: it ends at the planned total."""
    from replica import generate_baseline
    from replica.common.types import EngineConfig, GenerationRequest
    from replica.model_loading import load_replica_model

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.updates = total, []
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            self.updates.append(n)

    bars: list = []
    monkeypatch.setattr(generate_baseline, "MeasuredEtaBar", Bar)
    torch.set_num_threads(1)
    model, _ = load_replica_model("tiny-llama")
    reqs = [GenerationRequest(f"r{i}", list(range(1, 9)), n) for i, n in enumerate((3, 6))]
    bench_serving.run_engines(
        model,
        [
            (EngineConfig(policy="full", max_batch=1), reqs[:1]),
            (EngineConfig(policy="scissorhands", budget_tokens=4), reqs),
        ],
    )
    [bar] = bars
    assert bar.total == sum(bar.updates) == 3 + 3 + 6  # the warm-up request is not counted
    # per step, engines alternating (full, Scissorhands): a step makes each new prompt's first token and
    # a decode token of every running row; full ends after 2 busy steps, Scissorhands after 5
    assert bar.updates == [2, 4, 1, 2, 0, 1, 1, 1, 0]


def test_part_1_is_printed_and_written_before_part_2_runs(tmp_path, monkeypatch, capsys):
    import pytest

    def stopped(*a, **k):
        raise KeyboardInterrupt("stopped during part 2")

    monkeypatch.setattr(bench_serving, "_part2", stopped)
    torch.set_num_threads(1)
    with pytest.raises(KeyboardInterrupt):
        bench_serving.main(
            [
                "--model",
                "tiny-llama",
                "--prompt-tokens",
                "32",
                "--new-tokens",
                "6",
                "--full-batch",
                "2",
                "--generate-new-tokens",
                "4",
                "--dtype",
                "float32",
                "--out",
                str(tmp_path),
            ]
        )
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["workloads"]["mix"]["rows"]["full, paged"]["completed_requests"] == 12 and "generate" not in data
    assert data["dtype"] == "float32" and data["dtype_reason"] == "forced"
    md = (tmp_path / "bench.md").read_text()
    assert "**Workload equal**" in md and "**Workload mix**" in md and "Engine vs transformers generate" not in md
    captured = capsys.readouterr()
    assert md in captured.out
    assert "part 1, mix" in captured.err and "tok" in captured.err  # the progress bar


def test_latency_percentiles_are_taken_on_the_runs_own_clock():
    from replica.generate_baseline import _latency_percentiles

    # [first token s, last token s, tokens]: TPOT = (last - first) / (tokens - 1); a 1-token request has none
    # ITL: every gap between two tokens of one request, pooled over the requests
    got = _latency_percentiles({"a": [1.0, 3.0, 5], "b": [2.0, 2.0, 1], "c": [3.0, 7.0, 3]}, [0.5] * 4 + [2.0, 2.0])
    assert got["ttft_p50_s"] == 2.0 and abs(got["ttft_p99_s"] - 2.98) < 1e-9
    assert got["tpot_p50_s"] == 1.25 and abs(got["tpot_p99_s"] - 1.985) < 1e-9
    assert got["itl_p50_s"] == 0.5 and got["itl_p99_s"] == 2.0
    assert _latency_percentiles({}, []) == {f"{m}_p{q}_s": None for m in ("ttft", "tpot", "itl") for q in (50, 99)}


def test_a_queued_requests_ttft_includes_its_wait_for_the_one_running_before_it():
    from replica.common.types import EngineConfig, GenerationRequest
    from replica.model_loading import load_replica_model

    torch.set_num_threads(1)
    model, _ = load_replica_model("tiny-llama")
    reqs = [GenerationRequest(f"r{i}", list(range(1, 9)), 6) for i in range(2)]
    (r,) = bench_serving.run_engines(model, [(EngineConfig(policy="full", max_batch=1), reqs)], desc=None)
    # one row at a time: the second request's first token comes after the first's last, on the run's own
    # clock (never past its wall seconds); the p50 interpolates between the two
    assert 0 < r["ttft_p50_s"] < r["ttft_p99_s"] <= r["wall_s"]
    assert r["tpot_p50_s"] > 0


def test_part_2_lengths_are_checked_only_when_part_2_runs(capsys):
    args = bench_serving.parse_args(["--new-tokens", "8", "--generate-new-tokens", "512", "--skip-generate"])
    assert args.skip_generate and args.new_tokens == 8
    with pytest.raises(SystemExit) as e:
        bench_serving.parse_args(["--new-tokens", "8", "--generate-new-tokens", "512"])
    assert e.value.code == 2 and "--generate-new-tokens (512) must be <= --new-tokens (8)" in capsys.readouterr().err


@pytest.fixture
def scripted_openvino(monkeypatch, tmp_path):
    """OpenVINO's backend on the scripted pipeline of tests/replica/test_engine_openvino.py (one token per request a
    step), its export folder present; the tool's availability check passes for the tiny model."""
    from replica.backends import openvino as ovb
    from tests.replica.test_engine_openvino import _fake_genai, _Pipeline

    _Pipeline.built, _Pipeline.fail_at_step, _Pipeline.read_fails_at_step = [], None, None
    _Pipeline.metrics_fail_at_step, _Pipeline.stop_after, _Pipeline.builds_failing = None, None, 0
    _Pipeline.schedule_at_most = None
    fake_np = SimpleNamespace(array=lambda x, dtype=None: x, int64=int)
    monkeypatch.setattr(ovb, "runtime", lambda: (_fake_genai(), SimpleNamespace(Tensor=lambda x: x), fake_np))
    monkeypatch.setattr(ovb, "measured_block_bytes", lambda *a: 1000)
    monkeypatch.setattr(ovb, "_version", lambda name: "2026.4.1.0-scripted")  # with or without the runtime installed
    for f in ("openvino_model.xml", "openvino_model.bin"):
        (tmp_path / f).write_text("")
    monkeypatch.setattr(ovb, "EXPORT_DIR", tmp_path)
    monkeypatch.setattr(bench_serving, "check_available", lambda model: None)
    return _Pipeline


def test_the_engine_axis_runs_each_engines_rows_on_the_same_requests_and_names_the_engine(
    tmp_path, scripted_openvino, capsys
):
    torch.set_num_threads(1)
    args = ["--model", "tiny-llama", "--prompt-tokens", "40", "--new-tokens", "6", "--full-batch", "2"]
    args += ["--block-tokens", "4", "--workloads", "equal", "--skip-generate", "--no-peer-generate-batch"]
    args += ["--engines", "ours,openvino", "--openvino-kv-precision", "bf16", "--out", str(tmp_path / "out")]
    assert bench_serving.main(args) == 0
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = data["workloads"]["equal"]["rows"]
    ours = [label for label, _ in bench_serving.part1_rows(40, 6, 5.0, data["kv_memory_limit_bytes"], 4, 16, 512)]
    assert list(rows) == ours + ["openvino full, paged, mixed", "openvino_eviction x5, paged, mixed"]
    assert {rows[label]["engine"] for label in ours} == {"ours"}
    for label in ("openvino full, paged, mixed", "openvino_eviction x5, paged, mixed"):
        r = rows[label]
        # the same 12 requests of 40 + 6 tokens as every other row, all answered; what it does not count is null
        assert r["engine"] == "openvino" and r["completed_requests"] == 12 and r["output_tokens"] == 12 * 6
        assert r["openvino_kv_precision"] == "bf16" and r["preemptions"] is None and r["decode_tok_per_s"] is None
        assert r["openvino_genai_version"] == "2026.4.1.0-scripted" and "preemptions" in r["not_reported"]
    # ceil(46 / 5) = 10 tokens, raised to start 32 + recent 32 + one evictable 32-token block
    assert rows["openvino_eviction x5, paged, mixed"]["budget_tokens"] == 96
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "; engines ours, openvino." in md.splitlines()[0]
    assert md.splitlines()[1].startswith("Engines: ours (this repository's engine at commit ")
    assert "; openvino (OpenVINO GenAI " in md and ", KV precision bf16, inference precision f32, " in md
    ov_row = next(x for x in md.splitlines() if x.startswith("| openvino full, paged, mixed | openvino | "))
    assert " | n/r | n/r | " in ov_row  # preemptions and recomputed tokens: not reported, never a zero
    assert "| full, paged | ours | 1.00x |" in md


@pytest.mark.parametrize(
    "engines, message",
    [
        ("ours,vllm", "--engines: expected a comma-separated list of ours, openvino, got 'ours,vllm'"),
        ("ours,ours", "--engines: expected a comma-separated list of ours, openvino, got 'ours,ours'"),
    ],
)
def test_an_unknown_or_repeated_engine_is_refused_by_name(engines, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_serving.main(["--model", "tiny-llama", "--engines", engines])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_openvino_without_its_runtime_exits_2_naming_the_make_targets(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # `import openvino_genai` raises ImportError
    with pytest.raises(SystemExit) as e:
        bench_serving.main(["--engines", "ours,openvino"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "make openvino-runtime openvino-peer" in err and "openvino-genai runtime" in err


@pytest.mark.slow
def test_the_real_openvino_pipeline_runs_its_rows_beside_ours_on_the_embedded_model(tmp_path):
    from replica.backends import openvino as ovb

    try:
        ovb.check_available("embedded")
    except ovb.BackendUnavailable as e:
        pytest.skip(str(e))
    torch.set_num_threads(1)
    args = ["--prompt-tokens", "48", "--new-tokens", "8", "--full-batch", "2", "--requests", "4"]
    args += ["--workloads", "equal", "--skip-generate", "--no-peer-generate-batch", "--no-mixed"]
    args += ["--dtype", "float32", "--engines", "ours,openvino", "--out", str(tmp_path)]
    assert bench_serving.main(args) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = data["workloads"]["equal"]["rows"]
    for label in ("openvino full, paged, mixed", "openvino_eviction x5, paged, mixed"):
        r = rows[label]
        assert r["engine"] == "openvino" and r["completed_requests"] == 4 and r["output_tokens"] == 4 * 8, label
        assert r["openvino_genai_version"].startswith("2026.4") and r["openvino_kv_precision"] == "u8"
        assert 0 < r["peak_kv_cache_bytes"] <= data["kv_memory_limit_bytes"] and r["peak_running_sequences"] >= 1
    assert rows["full, paged"]["engine"] == "ours" and rows["full, paged"]["output_tokens"] == 4 * 8


def test_openvino_alone_is_its_own_denominator_and_skips_the_comparisons_of_ours(tmp_path, scripted_openvino, capsys):
    torch.set_num_threads(1)
    args = ["--model", "tiny-llama", "--prompt-tokens", "40", "--new-tokens", "6", "--full-batch", "2"]
    args += ["--workloads", "equal", "--engines", "openvino", "--out", str(tmp_path)]
    assert bench_serving.main(args) == 0  # part 2 and generate_batch compare ours: left out, not failed
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = data["workloads"]["equal"]["rows"]
    assert list(rows) == ["openvino full, paged, mixed", "openvino_eviction x5, paged, mixed"]
    assert "generate" not in data and data["workloads"]["equal"]["peer_generate_batch"] is None
    md = (tmp_path / "bench.md").read_text()
    assert "| row | engine | x of openvino full, paged, mixed, output tok/s |" in md
    assert "Engines: openvino (OpenVINO GenAI " in md and "ours (" not in md and "Mixed scheduler" not in md


def test_a_peer_pipeline_that_fails_fails_its_rows_requests_and_the_other_rows_are_kept(
    tmp_path, scripted_openvino, capsys
):
    """OpenVINO 2026.4.1's SnapKV failure, scripted at every pipeline's second step: its rows' 12 requests fail with
    its message, counted and named under the table; ours' rows on the same requests complete and are written."""
    from tests.replica.test_engine_openvino import SNAPKV

    scripted_openvino.fail_at_step = 2
    torch.set_num_threads(1)
    args = ["--model", "tiny-llama", "--prompt-tokens", "40", "--new-tokens", "6", "--full-batch", "2"]
    args += ["--block-tokens", "4", "--workloads", "equal", "--skip-generate", "--no-peer-generate-batch", "--no-mixed"]
    args += ["--engines", "ours,openvino", "--out", str(tmp_path)]
    assert bench_serving.main(args) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["workloads"]["equal"]["rows"]
    for label in ("openvino full, paged, mixed", "openvino_eviction x5, paged, mixed"):
        r = rows[label]
        assert r["failed_requests"] == 12 and r["completed_requests"] == 0 and r["output_tokens"] == 12
        assert r["errors"] == [f"OpenVINO GenAI failed the step: RuntimeError: {SNAPKV}"]
    assert rows["full, paged"]["completed_requests"] == 12 and rows["full, paged"]["failed_requests"] == 0
    md = (tmp_path / "bench.md").read_text()
    assert "openvino full, paged, mixed (openvino): 12 of 12 requests failed (OpenVINO GenAI failed the step: " in md
