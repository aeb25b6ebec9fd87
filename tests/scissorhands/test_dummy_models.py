"""Dummy weights of real architectures (`scissorhands.models.load_dummy_model`): every shipped config
loads (on the meta device: nothing allocated) with its published size, and a tiny copy of each runs
with a budgeted cache."""

import json

import pytest
import torch

from scissorhands import make_cache
from scissorhands.models import DUMMY_CONFIG_DIR, DUMMY_MODEL_IDS, dummy_config, load_dummy_model, tiny_overrides

# parameters of each published model (embeddings included; OPT ties its output layer)
PUBLISHED_PARAMETERS = {
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b-v0.1": 7_241_732_096,
    "opt-6.7b": 6_658_473_984,
    "opt-125m": 125_239_296,
}


def test_every_shipped_config_is_listed_and_no_listed_one_is_missing():
    assert (
        sorted(p.stem for p in DUMMY_CONFIG_DIR.glob("*.json"))
        == sorted(DUMMY_MODEL_IDS)
        == sorted(PUBLISHED_PARAMETERS)
    )


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_shipped_config_loads_on_meta_with_its_published_size(name):
    model = load_dummy_model(name, device="meta", dtype=torch.bfloat16)
    published = json.loads((DUMMY_CONFIG_DIR / f"{name}.json").read_text())
    assert type(model).__name__ == published["architectures"][0]
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert getattr(model.config, key) == published[key]


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_tiny_copy_runs_with_a_budgeted_cache_in_bfloat16(name):
    tiny = tiny_overrides(name)
    if name.startswith("mistral"):
        tiny["sliding_window"] = None  # the budgeted cache refuses sliding-window layers
    model = load_dummy_model(name, seed=3, **tiny)
    # derived from the overridden sizes: 64 / 4 heads (Qwen2's config has no head_dim field)
    assert (
        model.model.layers[0].self_attn.head_dim == 16
        if not name.startswith("opt")
        else model.model.decoder.layers[0].self_attn.head_dim == 16
    )
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (2, 64, 256)
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    cache = make_cache("scissorhands", model, budget_tokens=8)
    with torch.inference_mode():
        out = model.generate(
            torch.arange(1, 21)[None], cache=cache, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert out.shape == (1, 24)
    assert max(cache.num_slots()) <= 8
    again = load_dummy_model(name, seed=3, **tiny)
    other = load_dummy_model(name, seed=4, **tiny)
    first = next(model.parameters()).detach()
    assert torch.equal(first, next(again.parameters()))
    assert not torch.equal(first, next(other.parameters()))
    assert 0 < float(first.float().std()) < 0.1  # small random values, not zeros or garbage


def test_loading_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    load_dummy_model("opt-125m", **tiny_overrides("opt-125m"))
    assert torch.equal(torch.rand(3), expected)


def test_unknown_name_lists_the_shipped_ones():
    with pytest.raises(
        ValueError, match=r"'llama-2-7b'.*llama-3\.1-8b, qwen2\.5-7b, mistral-7b-v0\.1, opt-6\.7b, opt-125m"
    ):
        load_dummy_model("llama-2-7b", device="meta")


def test_an_override_that_is_not_a_field_is_refused_naming_it():
    with pytest.raises(ValueError, match="'ffn_dim'"):
        dummy_config("llama-3.1-8b", ffn_dim=64)
    assert dummy_config("llama-3.1-8b", num_hidden_layers=2, hidden_size=64).head_dim == 2  # derived fields follow
