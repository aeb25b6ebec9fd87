"""`make bench-serving` end to end on the tiny model (numbers mean nothing; the wiring is checked)."""

from __future__ import annotations

import json

import torch

from bench import bench_serving


def test_bench_serving_runs_both_parts_and_records_verified_max_batches(tmp_path, capsys):
    torch.set_num_threads(1)
    rc = bench_serving.main(
        [
            "--model",
            "tiny-llama",
            "--prompt-tokens",
            "64",
            "--new-tokens",
            "12",
            "--full-batch",
            "2",
            "--generate-new-tokens",
            "8",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    full, sh = data["max_batch"]["full"], data["max_batch"]["scissorhands"]
    assert full["max_batch"] == 2 and full["verified"] is True
    assert sh["max_batch"] >= 3 * full["max_batch"] and sh["verified"] is True  # (2 layers: big prefill transient)
    assert sh["peak_kv_cache_bytes"] <= data["kv_memory_limit_bytes"] >= full["peak_kv_cache_bytes"]
    assert full["output_tokens"] == 2 * 12 and sh["output_tokens"] == sh["max_batch"] * 12
    assert data["generate"]["output_tokens"] == data["engine"]["output_tokens"] <= 4 * 2 * 8  # part 2: outputs <= 8
    assert data["identical_tokens"] == 4 * 2  # 4 x batch requests: engine == generate, token for token
    assert data["ratio_max_batch_output"] > 0 and data["ratio_engine_vs_generate"] > 0
    # the ceiling divides by Scissorhands' prefill time only, a part of its wall time
    assert data["ratio_max_batch_output_ceiling"] >= data["ratio_max_batch_output"]
    out = capsys.readouterr().out
    assert "| Scissorhands x5 / full, output tok/s at own max batch |" in out
    assert "| our engine / transformers generate, full cache, batch 2 |" in out


def test_bench_serving_rejects_a_part_2_longer_than_the_limit_allows(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        bench_serving.main(["--model", "tiny-llama", "--new-tokens", "12", "--generate-new-tokens", "13"])
    assert e.value.code == 2
    assert "--generate-new-tokens (13) must be <= --new-tokens (12)" in capsys.readouterr().err


def test_part_1_runs_the_engines_interleaved_and_times_each_over_its_own_steps(monkeypatch):
    from replica.engine import ContinuousBatchingEngine
    from replica.static_batch import load_replica_model
    from replica.types import EngineConfig, GenerationRequest

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
    from replica.static_batch import load_replica_model
    from replica.types import EngineConfig, GenerationRequest

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
    monkeypatch.setattr(generate_baseline, "tqdm", Bar)
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
    assert data["max_batch"]["full"]["output_tokens"] == 2 * 6 and data["generate"] is None
    assert data["dtype"] == "float32" and data["dtype_reason"] == "forced"
    md = (tmp_path / "bench.md").read_text()
    assert "| Scissorhands x5 / full, output tok/s at own max batch |" in md and "generate" not in md
    captured = capsys.readouterr()
    assert md in captured.out
    assert "part 1 (both, interleaved)" in captured.err and "tok" in captured.err  # the progress bar
