"""`make gpu-check` here, without a GPU: it must fail clearly on CUDA, and run end to end on the CPU with
a tiny dummy-weights model, without Ray, writing a report whose numbers hold together."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import gpu_bundle, gpu_check
from scissorhands import POLICIES

REPO = Path(__file__).resolve().parents[2]
EVICTING = [p for p, cls in POLICIES.items() if cls.evicts]
TINY_RUN = [
    "--device",
    "cpu",
    "--tiny",
    "--prompt-tokens",
    "32",
    "--new-tokens",
    "16",
    "--full-batch",
    "2",
    "--generate-new-tokens",
    "8",
    "--ratios",
    "5,2",
    "--kv4-ratio",
    "5",
    "--box-scale",
    "10",
    "--budget-s",
    "5000",
]  # a shared CPU can be 10x slower than an idle one


def _run_without_ray(tmp_path: Path, args: list[str], timeout: float = 540) -> tuple[subprocess.CompletedProcess, Path]:
    """`python -m bench.gpu_check ARGS` in a subprocess where `import ray` fails (and is logged)."""
    stub = tmp_path / "no_ray"
    (stub / "ray").mkdir(parents=True)
    log = tmp_path / "ray_imports.log"
    (stub / "ray" / "__init__.py").write_text(
        "import sys\n"
        f"open({str(log)!r}, 'a').write(repr(sys.argv) + '\\n')\n"
        "raise ImportError('ray is made unimportable by the test')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub), str(REPO)]))
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, log


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_stops_at_once_and_says_what_is_missing(capsys, tmp_path):
    t0 = time.monotonic()
    rc = gpu_check.main(["--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert time.monotonic() - t0 < 5
    assert "gpu-check: error: no CUDA GPU" in err
    assert ("CPU-only build" in err and "TORCH_SPEC" in err) or "sees no device" in err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


def test_whole_check_on_the_cpu_with_a_tiny_dummy_model_and_no_ray(tmp_path):
    out = tmp_path / "out"
    proc, ray_log = _run_without_ray(tmp_path, [*TINY_RUN, "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # nothing imported ray but the probe that asks whether it is importable (python -c "import ray")
    assert ray_log.read_text().splitlines() == ["['-c']"]
    report = json.loads((out / "gpu_check.json").read_text())
    assert (report["weights"], report["model"], report["model_id"]) == (
        "dummy",
        "llama-3.1-8b",
        "meta-llama/Llama-3.1-8B",
    )
    assert report["passed"] is True and report["schema_version"] == 1
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["transformers"] and env["cpu"]["torch_threads"] >= 1
    assert env["commit"] and len(env["commit"].split("+")[0]) == 40
    assert report["args"]["dtype"] == "bfloat16"
    phases = report["phases"]
    assert [phases[p]["status"] for p in gpu_check.PHASES] == ["ok", "ok", "ok", "ok", "skipped"]
    for p in ("library", "max_batch", "engine_vs_generate"):  # every record says what it ran on
        assert (phases[p]["result"]["weights"], phases[p]["result"]["dtype"]) == ("dummy", "bfloat16")
    assert phases["ray"]["reason"] == "Ray is not importable here"

    checks = phases["library"]["result"]["checks"]
    sims = {(c["model"], c["policy"], c["kv_bits"]) for c in checks if c["check"] == "real eviction = simulation"}
    assert sims == {(f"{m} (tiny)", p, kv) for m in gpu_check.LIBRARY_MODELS for p in EVICTING for kv in (None, 4)}
    assert sum(c["check"] == "explicit attention = sdpa" for c in checks) == len(gpu_check.LIBRARY_MODELS)
    assert all(c["passed"] and c["max_abs_logit_diff"] <= 0.05 * c["max_abs_logit"] for c in checks)
    assert all(c["max_slots"] <= 8 for c in checks if "max_slots" in c)

    paged = phases["paged"]["result"]
    assert paged["dtype"] == "float32"  # exactness, whatever --dtype says
    pairs = {(c["policy"], c["kv_bits"], c["run"]) for c in paged["checks"] if c["check"] == "paged = preallocated"}
    runs_of = ("paged, roomy pool", "paged, small pool")
    assert pairs == {(p, kv, run) for p in POLICIES for kv in (None, 4) for run in runs_of}
    mixed = {(c["policy"], c["kv_bits"]) for c in paged["checks"] if c["check"] == "mixed = prefill-first"}
    assert mixed == {("full", None), ("full", 4)}
    assert all(c["passed"] and c["equal_requests"] == paged["requests"] == 8 for c in paged["checks"])
    small_full = [c for c in paged["checks"] if c["policy"] == "full" and c["run"] == "paged, small pool"]
    assert len(small_full) == 2 and all(c["preemptions"] > 0 for c in small_full)  # the recompute path ran

    mb = phases["max_batch"]["result"]
    runs = {r["label"]: r for r in mb["runs"]}
    assert list(runs) == [
        "full (paged)",
        "scissorhands x5 (paged)",
        "full (preallocated)",
        "scissorhands x2 (paged)",
        "scissorhands x5, 4-bit KV (paged)",
    ]
    full = runs["full (paged)"]  # the denominator
    assert runs["full (preallocated)"]["max_batch"] == 2  # the limit is 2 full-cache sequences
    # full-cache rows preallocate prompt + new tokens (the engine's max_length_tokens)
    assert mb["kv_memory_limit_bytes"] == 2 * (32 + 16) * runs["full (preallocated)"]["slot_bytes"]
    assert runs["scissorhands x5 (paged)"]["budget_tokens"] is None  # per request: ceil(48 / 5) = 10 each
    assert {r["kv_layout"] for r in runs.values()} == {"paged", "preallocated"}
    assert (  # x2's 24 slots take 2 blocks of 16 a layer, as the 32-token prompt's prefill does: no gain at this size
        full["max_batch"]
        <= runs["scissorhands x2 (paged)"]["max_batch"]
        < runs["scissorhands x5 (paged)"]["max_batch"]
        < runs["scissorhands x5, 4-bit KV (paged)"]["max_batch"]
    )
    for r in runs.values():
        assert r["verified"] and r["finished"]
        assert r["output_tokens"] == r["max_batch"] * 16 and r["decode_tokens"] == r["max_batch"] * 15
        assert r["peak_running_sequences"] == r["max_batch"] and r["peak_kv_cache_bytes"] <= mb["kv_memory_limit_bytes"]
        assert r["output_ratio_to_full"] == pytest.approx(r["output_tok_per_s"] / full["output_tok_per_s"])
        assert r["decode_ratio_to_full"] == pytest.approx(r["decode_tok_per_s"] / full["decode_tok_per_s"])
    assert full["output_ratio_to_full"] == 1.0

    eg = phases["engine_vs_generate"]["result"]
    assert eg["batch"] == 2 and eg["requests"] == 4
    assert eg["generate"]["completed_requests"] == eg["engine"]["completed_requests"] == 4
    assert eg["generate"]["output_tokens"] == eg["engine"]["output_tokens"]
    assert eg["ratio_engine_to_generate"] == pytest.approx(
        eg["engine"]["output_tok_per_s"] / eg["generate"]["output_tok_per_s"]
    )
    assert 0 <= eg["identical_outputs"] <= 4

    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# GPU check: llama-3.1-8b (tiny copy")
    assert "weights: dummy" in md and f"commit: {env['commit']}" in md
    assert "| scissorhands x5 (paged) | " in md
    assert "| paged = preallocated | snapkv | 4-bit | paged, small pool | preallocated | 8 | 0 | True |" in md
    (row,) = [
        line
        for line in md.splitlines()
        if line.startswith("| real eviction = simulation | opt-125m (tiny) | random | 4-bit |")
    ]
    assert row.endswith("| True |")  # passed
    assert "## ray: skipped (Ray is not importable here)" in md
    assert md in proc.stdout


def _greedy_run(step_logits: list[list[list[float]]]):
    """A `generate` result of 1-token prompts whose greedy tokens are the argmax of `step_logits`
    (steps x batch x vocab)."""
    from types import SimpleNamespace

    logits = [torch.tensor(s) for s in step_logits]  # each (batch, vocab)
    tokens = torch.stack([x.argmax(-1) for x in logits], dim=1)  # (batch, steps)
    return SimpleNamespace(
        logits=logits, sequences=torch.cat([torch.zeros(len(step_logits[0]), 1, dtype=torch.long), tokens], dim=1)
    )


def test_compare_judges_teacher_forced_logits_and_counts_flips():
    """A bfloat16 dummy model on a CPU without bfloat16 units gave two exactly tied top logits: the forced
    run's argmax may take either (a flip, counted), while a logit off by more than 5% of the largest fails."""
    ref = _greedy_run([[[1.0, 0.5, 0.0]], [[2.0, 2.0, 0.0]]])  # step 1: tokens 0 and 1 tie
    flipped_at_tie = [torch.tensor([[1.0, 0.5, 0.0]]), torch.tensor([[1.99, 2.0, 0.0]])]
    c = gpu_check._compare(flipped_at_tie, ref, prompt=1)
    assert (c["token_flips"], c["passed"]) == (1, True)
    assert c["max_abs_logit_diff"] == pytest.approx(0.01) and c["max_abs_logit"] == 2.0
    same = [torch.tensor([[1.0, 0.5, 0.0]]), torch.tensor([[2.0, 1.98, 0.05]])]
    assert gpu_check._compare(same, ref, prompt=1)["token_flips"] == 0
    off = [torch.tensor([[1.0, 0.5, 0.0]]), torch.tensor([[2.0, 2.0, 0.11]])]  # 0.11 > 5% of 2.0
    c = gpu_check._compare(off, ref, prompt=1)
    assert (c["token_flips"], c["passed"], c["max_abs_logit_diff"]) == (0, False, pytest.approx(0.11))
    with pytest.raises(ValueError):  # a step missing
        gpu_check._compare(same[:1], ref, prompt=1)


def test_a_spent_budget_skips_the_phases_and_still_writes_the_report(tmp_path):
    out = tmp_path / "out"
    proc, _ = _run_without_ray(
        tmp_path, [*TINY_RUN, "--out", str(out), "--budget-s", "1", "--phases", "library,max_batch"], timeout=300
    )
    assert proc.returncode == 1
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["passed"] is False
    assert {p: r["status"] for p, r in report["phases"].items()} == {"library": "not run", "max_batch": "not run"}
    assert "## library: not run (the 1 s budget is spent)" in (out / "gpu_check.md").read_text()


def _report(phases: dict) -> dict:
    args = vars(gpu_check.parse_args(["--device", "cpu"]))
    return {
        "schema_version": 1,
        "weights": "dummy",
        "model": "llama-3.1-8b",
        "model_id": "meta-llama/Llama-3.1-8B",
        "args": args,
        "phases": phases,
        "elapsed_s": 9.0,
        "environment": {
            "python": "3.12.3",
            "torch": "2.11.0",
            "cuda": "13.0",
            "transformers": "5.24.0",
            "tokenizers": "0.23.2",
            "commit": "c" * 40,
            "time_utc": "2026-12-01T00:00:00Z",
            "gpu": {"name": "NVIDIA H200", "total_bytes": 150 * 2**30, "driver": "580.159.03", "capability": "9.0"},
        },
    }


def _run(label, batch, finished=True, tok_s=100.0):
    return {
        "label": label,
        "max_batch": batch,
        "verified": True,
        "finished": finished,
        "output_tokens": batch * 4,
        "wall_s": 2.0,
        "output_tok_per_s": tok_s,
        "decode_tok_per_s": tok_s * 1.5,
        "peak_kv_cache_bytes": 2**30,
        "peak_device_allocated_bytes": 20 * 2**30,
        "output_ratio_to_full": tok_s / 100.0,
        "decode_ratio_to_full": tok_s / 100.0,
    }


def test_a_phase_cut_short_fails_the_check_but_its_finished_runs_are_in_the_report():
    mb = {
        "kv_memory_limit_bytes": 8 * 2**30,
        "prompt_tokens": 1024,
        "new_tokens": 1024,
        "weight_bytes": 16 * 2**30,
        "runs": [_run("full", 32), _run("scissorhands x5", 160, finished=False, tok_s=290.0)],
        "cut_short": True,
    }
    report = _report({"max_batch": {"status": "timed out", "elapsed_s": 270.0, "box_s": 270.0, "result": mb}})
    assert gpu_check.checks_passed(report) is False
    md = gpu_check.render_markdown(report)
    assert md.startswith("# GPU check: llama-3.1-8b, dummy weights, bfloat16, NVIDIA H200")
    assert "NVIDIA H200 (150 GiB, driver 580.159.03, compute capability 9.0)" in md
    assert "## max_batch: timed out (270 s of a 270 s box)" in md
    assert (
        "| scissorhands x5 | 160 | True | False | 640 | 2.0 | 290.0 | 435.0 | 1024.0 | 20480.0 | 2.90x | 2.90x |" in md
    )
    assert "KV memory limit 8.00 GiB (8589934592 B = 32 full-cache sequences)" in md
    mb["runs"].append(
        {
            "label": "scissorhands x5, 4-bit KV",
            "max_batch": 570,
            "verified": False,
            "finished": False,
            "error": "OutOfMemoryError: CUDA out of memory",
            "output_ratio_to_full": None,
        }
    )
    assert (
        "| scissorhands x5, 4-bit KV | 570 | False | False | error: OutOfMemoryError: CUDA out of memory |"
        in gpu_check.render_markdown(report)
    )
    mb["runs"].pop()
    mb["runs"][1]["finished"] = True
    report["phases"]["max_batch"]["status"] = "ok"
    assert gpu_check.checks_passed(report) is True
    report["phases"]["library"] = {"status": "ok", "result": {"checks": [{"passed": False}]}}
    assert gpu_check.checks_passed(report) is False


def test_a_phase_past_its_box_is_killed_and_reported_as_timed_out(tmp_path):
    a = vars(gpu_check.parse_args(TINY_RUN))
    t0 = time.monotonic()
    record = gpu_check._phase_subprocess("library", tmp_path, a, box_s=0.5)
    assert time.monotonic() - t0 < 15
    assert (record["status"], record["result"], record["box_s"]) == ("timed out", None, 0.5)


@pytest.mark.parametrize(
    "argv,field",
    [
        (
            ["--model", "llama-2-7b"],
            "--model: unknown dummy-weights config 'llama-2-7b'; shipped: llama-3.1-8b, qwen2.5-7b",
        ),
        (["--phases", "library,warp"], "--phases: unknown phase(s) warp"),
        (["--ratios", "5,0.5"], "compression ratios must be >= 1"),
        (["--ratios", "five"], "--ratios: expected comma-separated numbers"),
        (["--generate-new-tokens", "2048"], "--generate-new-tokens (2048) must be <= --new-tokens (1024)"),
        (["--kv-limit-gib", "0"], "--kv-limit-gib: must be > 0"),
        (["--full-batch", "0"], "--full-batch: expected an integer >= 1, got 0"),
        (["--box-scale", "0"], "--box-scale: must be > 0"),
    ],
)
def test_bad_arguments_exit_2_naming_the_field(argv, field, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2
    assert field in capsys.readouterr().err


def test_a_mistral_run_longer_than_its_sliding_window_is_refused():
    a = vars(
        gpu_check.parse_args(
            [
                "--device",
                "cpu",
                "--model",
                "mistral-7b-v0.1",
                "--tiny",
                "--prompt-tokens",
                "4000",
                "--new-tokens",
                "100",
                "--generate-new-tokens",
                "50",
            ]
        )
    )
    with pytest.raises(ValueError, match=r"4100\) exceed mistral-7b-v0.1's sliding window \(4096\)"):
        gpu_check._load(a)
    a.update(prompt_tokens=1024, new_tokens=1024)
    assert gpu_check._load(a).config.sliding_window is None  # inside the window: no window needed


def test_gpu_suite_is_the_suite_on_one_gpu_in_bfloat16():
    suite = {
        "kind": "batch",
        "name": "smoke",
        "model": "embedded",
        "device": "cpu",
        "dtype": "float32",
        "replicas": 2,
        "policies": ["full"],
        "batch_sizes": [1],
        "prompt_tokens": [8],
        "new_tokens": [2],
    }
    out = gpu_check.gpu_suite(suite)
    assert (out["device"], out["dtype"], out["replicas"], out["name"]) == ("cuda", "bfloat16", 1, "smoke-gpu")
    assert out["placement"] == {"num_gpus": 1}
    assert "placement" not in gpu_check.gpu_suite(suite, "cpu", "float32")
    from workloads.kinds import parse_suite

    assert parse_suite(out).placement.num_gpus == 1  # still a valid suite


def test_bundle_pins_what_is_installed_here_for_cpython_3_12_without_dependencies(tmp_path):
    import importlib.metadata

    pins = gpu_bundle.bundle_requirements()
    assert pins == [
        f"transformers=={importlib.metadata.version('transformers')}",
        f"regex=={importlib.metadata.version('regex')}",
    ]
    cmd = gpu_bundle.download_command(tmp_path, pins)
    assert cmd[-2:] == pins
    assert {"--no-deps", "--only-binary=:all:"} <= set(cmd)
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("--dest") + 1] == str(tmp_path)
    (tmp_path / "a.whl").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    assert gpu_bundle.folder_bytes(tmp_path) == 1000
    assert ".gpu-bundle" in (REPO / ".gitignore").read_text()  # carried to the device, never committed


@pytest.mark.ray
def test_the_ray_phase_runs_the_suite_through_the_sweep(tmp_path):
    suite = tmp_path / "tiny.yaml"
    suite.write_text(
        "kind: batch\nname: tiny\nmodel: tiny-llama\npolicies: [full, scissorhands]\ncompression_ratios: [2]\n"
        "batch_sizes: [1]\nprompt_tokens: [8]\nnew_tokens: [3]\nreplicas: 1\n"
    )
    out = tmp_path / "out"
    rc = gpu_check.main(["--device", "cpu", "--phases", "ray", "--suite", str(suite), "--out", str(out)])
    report = json.loads((out / "gpu_check.json").read_text())
    assert rc == 0, report
    ray = report["phases"]["ray"]
    assert ray["status"] == "ok" and ray["result"]["suite"] == "tiny-gpu"
    assert [(p["policy"], p["compression_ratio"], p["status"]) for p in ray["result"]["points"]] == [
        ("full", None, "ok"),
        ("scissorhands", 2.0, "ok"),
    ]
