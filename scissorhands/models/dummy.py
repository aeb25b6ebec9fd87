"""Models of real architectures with dummy weights, built from the shipped ``configs/*.json``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel

from .loading import apply_attn_implementation

DUMMY_CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
"""Folder of the shipped ``config.json`` files (``<name>.json``), copied from the published model cards."""

DUMMY_MODEL_IDS = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "mistral-7b-v0.1": "mistralai/Mistral-7B-v0.1",
    "opt-6.7b": "facebook/opt-6.7b",
    "opt-125m": "facebook/opt-125m",
}
"""Name of each shipped config -> the Hugging Face model whose published ``config.json`` it is."""


def dummy_config(name: str, **overrides) -> transformers.PretrainedConfig:
    """The shipped config ``name`` (a key of ``DUMMY_MODEL_IDS``), with ``overrides`` set on it.

    Raises:
        ValueError: an unknown name (the message lists the shipped names), or an override that is
            not a field of that config.
    """
    if name not in DUMMY_MODEL_IDS:
        raise ValueError(f"dummy model: unknown name {name!r}; shipped configs: {', '.join(DUMMY_MODEL_IDS)}")
    fields = json.loads((DUMMY_CONFIG_DIR / f"{name}.json").read_text())
    known = transformers.AutoConfig.for_model(**fields)
    unknown = [key for key in overrides if key not in fields and not hasattr(known, key)]
    if unknown:
        raise ValueError(f"dummy model {name!r}: not a field of its config: {', '.join(map(repr, unknown))}")
    # built again from the merged fields, so derived fields (e.g. Llama's head_dim) follow the overrides
    return transformers.AutoConfig.for_model(**{**fields, **overrides})


def tiny_overrides(name: str) -> dict:
    """Config overrides that make a 2-layer, 64-wide copy of the shipped config ``name`` (4 heads of
    head_dim 16, 2 KV heads where the architecture groups them, vocabulary 256): a copy of the real
    architecture that runs in milliseconds on a CPU (tests, gpu-check's library phase).

    Raises:
        ValueError: as :func:`dummy_config` for an unknown name.
    """
    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)
    if dummy_config(name).model_type == "opt":
        return {**base, "ffn_dim": 128, "word_embed_proj_dim": 64}
    return {**base, "intermediate_size": 128, "num_key_value_heads": 2}


def load_dummy_model(
    name: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str | None = None,
    **overrides,
) -> PreTrainedModel:
    """A model of a real architecture with dummy weights (as vLLM's ``load_format="dummy"``): for speed
    and memory measurements only, never for quality.

    The model is built from :func:`dummy_config` under ``torch.device(device)`` in ``dtype``, so every
    parameter is created and initialised where it lives (transformers' own initialisation: normal with
    the config's ``initializer_range``/``init_std``, norms at one), with no float32 copy on the CPU:
    an 8B model in bfloat16 needs its 16 GB on the device and nothing more. Records of runs on it say
    ``weights: dummy``. Seeded with ``seed`` (the global RNG state is left as it was).

    Args:
        name: a key of ``DUMMY_MODEL_IDS``.
        dtype: parameter dtype.
        device: where the parameters are created.
        attn_implementation: as :func:`load_model` (None: ``scissorhands.ATTN_IMPLEMENTATION``).
        **overrides: config fields to replace (e.g. ``num_hidden_layers=2`` for a small test copy,
            ``sliding_window=None`` for Mistral when sequences stay inside its 4,096-token window).

    Returns:
        the model in eval mode (no tokenizer: prompts are token ids).

    Raises:
        ValueError: as :func:`dummy_config`.
    """
    config = dummy_config(name, **overrides)
    device = torch.device(device)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if device.type != "meta" else "cpu"):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return apply_attn_implementation(model, attn_implementation)
