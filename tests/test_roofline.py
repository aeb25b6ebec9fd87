"""bench/roofline.py: the roofline arithmetic and the argument checks (no timing here)."""
import importlib.util
import sys
from pathlib import Path

import pytest

from scissorhands.testing import tiny_llama

_bench = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(_bench))                                  # roofline runs bench_prefill's and bench_decode's timings
_spec = importlib.util.spec_from_file_location("roofline", _bench / "roofline.py")
roofline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roofline)


def test_step_roofline_counts_weights_kv_and_flops():
    model = tiny_llama(seed=0)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    r = roofline.step_roofline(model, batch=4, context=10, bandwidth_gb_s=1.0, peak_gflop_s=1000.0)
    kv = 4 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 10 * 4      # float32
    assert r["bytes_per_step"] == params * 4 + kv
    matmul = params if cfg.tie_word_embeddings else params - cfg.vocab_size * cfg.hidden_size
    assert r["flops_per_step"] == 2 * 4 * matmul + 4 * 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * 10
    assert r["memory_s"] == pytest.approx(r["bytes_per_step"] / 1e9)
    assert r["compute_s"] == pytest.approx(r["flops_per_step"] / 1e12)
    assert r["bound"] == "memory"                     # a few rows: reading the weights binds
    assert r["roofline_tok_per_s"] == pytest.approx(4 / max(r["memory_s"], r["compute_s"]))
    # many rows on a slow matmul unit: the FLOPs bind, and the roofline is rows over the compute time
    big = roofline.step_roofline(model, batch=4096, context=10, bandwidth_gb_s=1.0, peak_gflop_s=1.0)
    assert big["bound"] == "compute" and big["roofline_tok_per_s"] == pytest.approx(4096 / big["compute_s"])


@pytest.mark.parametrize("argv,field", [(["--dtypes", "fp8"], "--dtypes"), (["--rounds", "0"], "--rounds"),
                                        (["--batches", "0"], "--batches"),
                                        (["--ratio", "0.5"], "--ratio"), (["--prefill-batch", "0"], "--prefill-batch")])
def test_bad_arguments_exit_2_naming_the_flag(argv, field, capsys):
    with pytest.raises(SystemExit) as e:
        roofline.parse_args(argv)
    assert e.value.code == 2 and field in capsys.readouterr().err
