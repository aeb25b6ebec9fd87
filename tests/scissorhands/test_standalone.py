"""Standalone use as a transformers user expects (no Ray): the README example, both cache keyword
spellings, and the supported architectures (Llama, Mistral, Qwen2, OPT) with tiny random configs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import (
    DynamicCache,
    GPT2Config,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.tokenization_utils_base import BatchEncoding

import scissorhands
from scissorhands import POLICIES, make_cache
from scissorhands.testing import tiny_llama
from tests.generate_helpers import greedy_generate

README = Path(__file__).resolve().parents[2] / "README.md"


class TinyTokenizer:
    """Characters -> ids below 128 (the tiny model's vocabulary); enough for the README example."""

    def __call__(self, texts, return_tensors="pt"):
        texts = [texts] if isinstance(texts, str) else texts
        ids = torch.tensor([[ord(c) % 128 for c in t] for t in texts])
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids)


def _readme_library_example() -> str:
    text = README.read_text()
    section = text.split("## The library", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README '## The library' has no python example"
    return blocks[0]


def test_readme_example_runs_with_a_tiny_model(model, monkeypatch, capsys):
    code = _readme_library_example()
    assert 'load_model("embedded")' in code and "make_cache(" in code and "cache=cache" in code
    import scissorhands.models

    monkeypatch.setattr(scissorhands.models, "load_model", lambda *a, **k: (model, TinyTokenizer()))
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    cache, out = namespace["cache"], namespace["out"]
    assert isinstance(cache, scissorhands.BudgetedCache) and cache.policy.name == "scissorhands"
    prompt_len = namespace["inputs"]["input_ids"].shape[1]
    assert out.shape[1] == prompt_len + 64
    assert cache.budget_tokens == scissorhands.budget_from_ratio(
        prompt_len + 64, 5, cache.policy
    )  # ceil(L / 5), floored
    assert max(cache.num_slots()) <= cache.budget_tokens and cache.evicted_tokens > 0
    assert capsys.readouterr().out.strip()


def _generate(model, ids, **kw):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=0, **kw
    )


def test_cache_and_past_key_values_spellings_give_the_same_tokens(model):
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    caches = [make_cache("scissorhands", model, budget_tokens=12) for _ in range(3)]
    a = _generate(model, ids, cache=caches[0])
    b = _generate(model, ids, past_key_values=caches[1])
    assert torch.equal(a, b) and caches[1].get_seq_length() == 49 and caches[1].evicted_tokens > 0
    with torch.inference_mode():  # a direct forward call
        out = model(ids, cache=caches[2])
        assert out.past_key_values is caches[2] and max(caches[2].num_slots()) <= 12


def test_the_one_liner_with_a_ratio_and_no_max_length_budgets_from_the_prompt_and_the_floor(model):
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    cache = make_cache("scissorhands", model, compression_ratio=5)
    out = model.generate(**inputs, cache=cache, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 210) and cache.budget_tokens == 40  # ceil(200 / 5), above the floor
    short = make_cache("scissorhands", model, compression_ratio=5)  # 40 tokens: ceil(40 / 5) = 8, raised to the floor
    model.generate(**{k: v[:, :40] for k, v in inputs.items()}, cache=short, max_new_tokens=10, pad_token_id=0)
    assert short.budget_tokens == scissorhands.DEFAULT_MIN_BUDGET_TOKENS


def test_no_ray_in_the_library():
    src = Path(scissorhands.__file__).parent
    for path in src.rglob("*.py"):
        assert not re.search(r"^\s*(import ray|from ray)", path.read_text(), flags=re.M), path


# ----------------------------------------------------------------------------- architectures
def _tiny(kind: str):
    common = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "llama":
            m = tiny_llama(0)
        elif kind == "mistral":
            m = MistralForCausalLM(
                MistralConfig(intermediate_size=128, num_key_value_heads=2, sliding_window=None, **common)
            )
        elif kind == "qwen2":
            m = Qwen2ForCausalLM(Qwen2Config(intermediate_size=128, num_key_value_heads=2, **common))
        else:  # OPT: multi-head attention, learned positions
            m = OPTForCausalLM(OPTConfig(ffn_dim=128, word_embed_proj_dim=64, **common))
    m.eval()
    m.generation_config.eos_token_id = None
    return m


ARCHS = list(scissorhands.SUPPORTED_MODEL_TYPES)


def _run(m, cache, new=24):
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    return greedy_generate(m, ids, cache, new, mask=mask)


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_budget_above_length_equals_transformers_sdpa(arch):
    m = _tiny(arch)
    m.set_attn_implementation("sdpa")
    ref = _run(m, DynamicCache(config=m.config))
    for policy in POLICIES:
        kw = {} if policy == "full" else dict(budget_tokens=64)
        got = _run(m, make_cache(policy, m, **kw))
        assert torch.equal(ref.sequences, got.sequences), policy
        assert max(float((a - b).abs().max()) for a, b in zip(ref.logits, got.logits)) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_real_eviction_equals_simulation(arch):
    m = _tiny(arch)
    kv_heads = 4 if arch == "opt" else 2
    for policy in [p for p, cls in POLICIES.items() if cls.evicts]:
        real_cache = make_cache(policy, m, budget_tokens=8)
        real = _run(m, real_cache, new=30)
        sim = _run(m, make_cache(policy, m, budget_tokens=8, simulate=True), new=30)
        assert torch.equal(real.sequences, sim.sequences), policy
        assert max(float((a - b).abs().max()) for a, b in zip(real.logits, sim.logits)) < 1e-5
        assert max(real_cache.num_slots()) <= 8 and real_cache.layers[0].keys.shape[1] == kv_heads


def test_unsupported_architectures_raise_naming_the_type_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, mistral, qwen2, opt"):
        make_cache("scissorhands", GPT2Config(), budget_tokens=8)
    with pytest.raises(ValueError, match="sliding"):
        make_cache("scissorhands", MistralConfig(sliding_window=4096), budget_tokens=8)
    with pytest.raises(ValueError, match="sliding"):
        make_cache(
            "full", Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0, num_hidden_layers=2)
        )
