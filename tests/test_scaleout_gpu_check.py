"""`make gpu-check` where there is no GPU (it must fail clearly), and its max-batch search."""

import time

import pytest
import torch

from cluster import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_stops_at_once_and_says_what_is_missing(capsys, tmp_path):
    t0 = time.monotonic()
    rc = gpu_check.main(["--results-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert time.monotonic() - t0 < 5
    assert "gpu-check: error: no CUDA GPU" in err
    assert ("CPU-only build" in err and "TORCH_SPEC" in err) or "sees no device" in err
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


@pytest.mark.parametrize("threshold", [1, 2, 3, 37, 64, 100, 4095, 4096])
def test_max_fitting_batch_finds_the_threshold(threshold):
    tried = []

    def fits(b):
        tried.append(b)
        return b <= threshold

    best, probes, finished = gpu_check.max_fitting_batch(fits, limit=4096)
    assert (best, finished) == (threshold, True)
    assert probes == len(tried) <= 2 * 13  # doubling + bisection, never a linear scan
    assert max(tried) <= 4096


def test_max_fitting_batch_edge_cases():
    assert gpu_check.max_fitting_batch(lambda b: False, limit=64)[:1] == (0,)  # not even batch 1
    assert gpu_check.max_fitting_batch(lambda b: True, limit=100)[0] == 100  # a limit between powers of two
    # a deadline already passed: nothing probed, reported as unfinished
    assert gpu_check.max_fitting_batch(lambda b: True, limit=64, deadline=time.monotonic() - 1) == (0, 0, False)


def test_gpu_suite_is_the_suite_on_one_gpu_in_bfloat16():
    suite = {"name": "smoke", "model": "embedded", "device": "cpu", "dtype": "float32", "replicas": 2,
             "policies": ["full"], "batch_sizes": [1], "prompt_tokens": [8], "new_tokens": [2]}
    out = gpu_check.gpu_suite(suite)
    assert (out["device"], out["dtype"], out["replicas"], out["name"]) == ("cuda", "bfloat16", 1, "smoke-gpu")
    assert out["placement"] == {"num_gpus": 1}
    from workloads.suite import parse_suite

    assert parse_suite(out).placement.num_gpus == 1  # still a valid suite


@pytest.mark.ray
def test_whole_flow_with_a_stand_in_gpu(tmp_path, monkeypatch, capsys):
    """main() end to end on the CPU: the real sweep (tiny model), a stand-in memory probe."""
    suite = tmp_path / "tiny.yaml"
    suite.write_text("name: tiny\nmodel: tiny-llama\npolicies: [full, scissorhands]\ncompression_ratios: [2]\n"
                     "batch_sizes: [1]\nprompt_tokens: [8]\nnew_tokens: [3]\nreplicas: 1\n")
    monkeypatch.setattr(gpu_check, "require_cuda", lambda: {"name": "stand-in", "total_bytes": 80 * 2**30,
                                                            "torch": torch.__version__, "cuda": "n/a"})
    monkeypatch.setattr(gpu_check, "gpu_suite", lambda s: {**s, "placement": {"num_cpus": 1}})  # stays on the CPU

    class Probe:
        def __init__(self, model_spec, limit_bytes):
            self.limit_bytes, self.weight_bytes, self.last = limit_bytes, 1000, None

        def fits(self, point):  # the "memory" holds 40 sequences of full, 80 at 2x
            cap = 40 if point["policy"] == "full" else 80
            ok = point["batch_size"] <= cap
            self.last = {"decode_tokens_per_s": 10.0 * point["batch_size"], "kv_cache_bytes": 100 * point["batch_size"],
                         "peak_allocated_bytes": 5000} if ok else None
            return ok

    monkeypatch.setattr(gpu_check, "MemoryProbe", Probe)
    rc = gpu_check.main(["--suite", str(suite), "--results-dir", str(tmp_path / "results"), "--run-id", "g1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = __import__("json").loads((tmp_path / "results" / "g1" / "gpu_check.json").read_text())
    assert report["points"] == 2 and report["sweep_exit_code"] == 0
    rows = {(r["policy"], r["compression_ratio"]): r for r in report["max_batch"]}
    assert rows[("full", None)]["max_batch"] == 40 and rows[("scissorhands", 2.0)]["max_batch"] == 80
    assert rows[("scissorhands", 2.0)]["decode_tokens_per_s"] == 800.0
    assert rows[("full", None)]["kv_bytes_per_sequence"] == 100.0
    assert "| full | - | 40 |" in out and "| scissorhands | 2 | 80 |" in out
    assert (tmp_path / "results" / "g1" / "gpu_check.md").exists()
