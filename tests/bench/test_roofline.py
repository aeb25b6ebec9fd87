"""bench/roofline.py: the roofline arithmetic and the argument checks (no timing here)."""

import pytest

from bench import roofline
from scissorhands.testing import tiny_llama


def test_step_roofline_counts_weights_kv_and_flops():
    model = tiny_llama(seed=0)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    r = roofline.step_roofline(model, batch=4, context=10, bandwidth_gb_s=1.0, peak_gflop_s=1000.0)
    kv = 4 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 10 * 4  # float32
    assert r["bytes_per_step"] == params * 4 + kv
    matmul = params if cfg.tie_word_embeddings else params - cfg.vocab_size * cfg.hidden_size
    assert (
        r["flops_per_step"] == 2 * 4 * matmul + 4 * 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * 10
    )
    assert r["memory_s"] == pytest.approx(r["bytes_per_step"] / 1e9)
    assert r["compute_s"] == pytest.approx(r["flops_per_step"] / 1e12)
    assert r["bound"] == "memory"  # a few rows: reading the weights binds
    assert r["roofline_tok_per_s"] == pytest.approx(4 / max(r["memory_s"], r["compute_s"]))
    # many rows on a slow matmul unit: the FLOPs bind, and the roofline is rows over the compute time
    big = roofline.step_roofline(model, batch=4096, context=10, bandwidth_gb_s=1.0, peak_gflop_s=1.0)
    assert big["bound"] == "compute" and big["roofline_tok_per_s"] == pytest.approx(4096 / big["compute_s"])


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--dtypes", "fp8"], "--dtypes"),
        (["--rounds", "0"], "--rounds"),
        (["--batches", "0"], "--batches"),
        (["--ratio", "0.5"], "--ratio"),
        (["--prefill-batch", "0"], "--prefill-batch"),
        (["--dtypes", "float32,"], "--dtypes"),
        (["--batches", "1,four"], "--batches"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(argv, field, capsys):
    with pytest.raises(SystemExit) as e:
        roofline.parse_args(argv)
    assert e.value.code == 2 and field in capsys.readouterr().err


def test_lists_are_comma_separated_and_threads_default_to_one():
    args = roofline.parse_args(["--batches", "1,32", "--dtypes", "float32,bfloat16"])
    assert args.batches == [1, 32] and args.dtypes == ["float32", "bfloat16"] and args.threads == 1
    defaults = roofline.parse_args([])
    assert defaults.batches == [1, 4, 16, 32] and defaults.dtypes == ["float32", "bfloat16"]


def test_space_separated_dtypes_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        roofline.parse_args(["--dtypes", "float32", "bfloat16"])
    assert e.value.code == 2 and "bfloat16" in capsys.readouterr().err


def test_matmul_ceiling_times_the_packed_layer_the_model_runs(monkeypatch):
    import torch

    from scissorhands import models

    calls = []
    real = models.PackedLinear.forward
    monkeypatch.setattr(models.PackedLinear, "forward", lambda self, x: calls.append(x.shape) or real(self, x))
    assert roofline.matmul_gflop_s(torch.float32, rows=3, k=16, n=8, repeats=2, packed=True) > 0
    assert calls == [(3, 16)] * 8 * 3  # 8 calls: one warm-up, 2 timed
    calls.clear()
    assert roofline.matmul_gflop_s(torch.float32, rows=3, k=16, n=8, repeats=1) > 0 and not calls


def test_report_has_the_roofline_at_the_batch_rows(tmp_path):
    row = {
        "dtype": "bfloat16",
        "batch": 32,
        "engine_tok_per_s": 650.0,
        "generate_tok_per_s": 306.0,
        "wall_ratio": 2.12,
        "wall_min": 2.0,
        "wall_max": 2.15,
        "cpu_ratio": 2.1,
        "cpu_min": 2.0,
        "cpu_max": 2.2,
        "roofline_tok_per_s": 2984.0,
        "bound": "compute",
        "engine_share": 650 / 2984,
        "generate_share": 306 / 2984,
        "matmul_gflop_s_at_batch": 300.0,
        "roofline_at_batch_tok_per_s": 1000.0,
        "engine_share_at_batch": 0.65,
        "cpu_share": 0.42,
        "contended": True,
    }
    roofline._write(tmp_path, "c", 70.0, {"bfloat16": 831.0}, [], [row])
    md = (tmp_path / "roofline.md").read_text()
    assert "| matmul at batch rows (GFLOP/s) | roofline at batch rows (tok/s) | ours, share of it | CPU share |" in md
    assert (
        "| bfloat16 | 32 | 650.0 | 306.0 | 2.12x (2.00-2.15) | 2.10x (2.00-2.20) | 2984 | "
        "compute | 22% | 10% | 300 | 1000 | 65% | 0.42 ! |"
    ) in md
    assert md.rstrip().splitlines()[-1].startswith("`!` contended (") and "decode bfloat16, batch 32" in md
    assert "bfloat16 831 GFLOP/s (512x576 @ 576x1536, the faster of F.linear and the packed layer)" in md
