"""bench/bench_decode.py: what one timed step is, on both sides, and the argument checks (no timing asserted)."""

import pytest
import torch

from bench import bench_decode
from scissorhands.testing import tiny_llama


def test_each_side_times_exactly_the_decode_steps_asked_for():
    """Ours: the engine steps after the one that prefills (each a decode step of every row); transformers: the
    gaps between logits-processor calls of one generate. Both yield `steps` (wall_s, cpu_s) pairs, >= 0."""
    torch.manual_seed(0)
    model = tiny_llama(0)
    model.generation_config.eos_token_id = None
    rows = torch.randint(1, 128, (3, 11)).tolist()
    for fn in (bench_decode.ours_steps, bench_decode.generate_steps):
        steps = fn(model, rows, 4)
        assert len(steps) == 4 and all(w >= 0 and c >= 0 for w, c in steps)
    assert model.config._attn_implementation == "scissorhands"  # generate_steps puts the attention back


def test_the_packing_ab_baseline_runs_plain_f_linear_and_puts_the_packing_back(monkeypatch):
    import scissorhands.models as sh_models

    torch.manual_seed(0)
    model = sh_models.pack_linear_weights(tiny_llama(0))
    model.generation_config.eos_token_id = None
    real = sh_models.onednn_packs
    calls = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: calls.append(1) or real_linear(*a, **k))
    rows = torch.randint(1, 128, (2, 7)).tolist()
    steps = bench_decode.ours_steps_unpacked(model, rows, 3)
    assert len(steps) == 3 and sh_models.onednn_packs is real  # restored
    unpacked = len(calls)
    assert unpacked >= (1 + len(steps)) * 7 * model.config.num_hidden_layers  # every projection ran F.linear
    calls.clear()
    bench_decode.ours_steps(model, rows, 3)
    assert len(calls) == (0 if real(torch.float32) else unpacked)  # packed, where torch has oneDNN


def test_the_attention_ab_baseline_runs_the_grouped_query_kernel_and_puts_the_layout_back(monkeypatch):
    from scissorhands.cache import BudgetedLayer

    torch.manual_seed(0)
    model = tiny_llama(0).to(torch.bfloat16)  # 4 query heads over 2 KV heads
    model.generation_config.eos_token_id = None
    real = BudgetedLayer.__dict__["_sdpa_chunk"]
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda q, *a, **k: calls.append((q.shape[1], k.get("enable_gqa"))) or real_sdpa(q, *a, **k),
    )
    rows = torch.randint(1, 128, (2, 7)).tolist()
    steps = bench_decode.ours_steps_gqa_kernel(model, rows, 3)
    assert len(steps) == 3 and BudgetedLayer.__dict__["_sdpa_chunk"] is real  # restored
    layers, heads, kv_heads = (
        model.config.num_hidden_layers,
        model.config.num_attention_heads,
        model.config.num_key_value_heads,
    )
    n = len(calls)
    assert n >= len(steps) * layers and calls == [(heads, True)] * n  # every decode step, every layer
    calls.clear()
    bench_decode.ours_steps(model, rows, 3)
    assert calls == [(kv_heads, None)] * n  # grouped layout, no GQA flag
    calls.clear()
    bench_decode.ours_steps(model.float(), rows, 3)
    assert calls == [(heads, True)] * n  # float32: the GQA kernel


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--dtypes", "float64"], "--dtypes"),
        (["--new-tokens", "0"], "--new-tokens"),
        (["--batches", "0"], "--batches"),
        (["--batches", "1,x"], "--batches"),
        (["--batches", "1 4"], "--batches"),
        (["--packing-ab", "--attention-ab"], "--attention-ab"),
        (["--attention-ab"], "--dtypes"),
        (["--dtypes", ""], "--dtypes"),
        (["--dtypes", "bfloat16,"], "--dtypes"),
    ],
)
def test_bad_arguments_name_the_flag(argv, field, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_decode.main(argv)
    assert exc.value.code != 0 and field in capsys.readouterr().err
