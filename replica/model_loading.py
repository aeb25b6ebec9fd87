"""Model loading and the run's dtype decision, shared by both replicas (static batches, `replica.static_batch`;
continuous batching, `replica.continuous`), the HTTP service and the bench tools.

* `load_replica_model`: ``(model, tokenizer)`` for a model spec (``"embedded"``, a Hugging Face id, a folder, or a
  test-only name of `TEST_MODEL_NAMES`), in the dtype asked.
* `model_config`, `model_context_tokens`: what a model is, read without its weights.
* `resolve_dtype_here`: a run's ``dtype`` resolved once in this process (``auto``'s bfloat16 probe at the model's
  own layer shapes) for every replica of the run; `cluster.dtype_probe.resolve_run_dtype` runs it as a Ray task
  on a node of the cluster (Ray only in cluster/).
"""

from __future__ import annotations

import os
import socket

import torch
from transformers import AutoConfig

from scissorhands.models import (
    check_device_name,
    check_dtype_name,
    load_model,
    resolve_dtype,
    resolve_source,
)
from scissorhands.testing import tiny_llama

#: Test-only model names a suite may use instead of a real model (tiny random weights, no
#: tokenizer: prompts are random ids drawn with the point's seed). Not for benchmarking.
TEST_MODEL_NAMES = ("tiny-llama",)


def load_replica_model(model_spec: str, dtype: str | torch.dtype = "auto", device: str = "cpu"):
    """Load `(model, tokenizer)` for a model spec, in `dtype` (`scissorhands.models.DTYPE_CHOICES`;
    `"auto"` resolved by `scissorhands.models.resolve_dtype`, its reason kept as
    `model.scissorhands_dtype_reason`).

    `model_spec` is `"embedded"`, a Hugging Face model id, a local folder, or a test-only name
    from `TEST_MODEL_NAMES` (tokenizer is then None). Raises FileNotFoundError naming the path
    when `model_spec` is a filesystem path (absolute, or starting with `.` or `~`) that does
    not exist.
    """
    check_dtype_name(dtype)
    check_device_name(device)
    if model_spec == "tiny-llama":
        model = tiny_llama(seed=0)
        torch_dtype, reason = resolve_dtype(dtype, model.config, device)
        model = model.to(device=device, dtype=torch_dtype)
        model.scissorhands_dtype_reason = reason
        model.eval()
        return model, None
    expanded = os.path.expanduser(model_spec)
    if model_spec.startswith((os.sep, ".", "~")) and not os.path.exists(expanded):
        raise FileNotFoundError(f"model: path does not exist: {expanded}")
    model, tokenizer = load_model(expanded, dtype=dtype, device=device)
    model.eval()
    return model, tokenizer


def model_config(model_spec: str):
    """The config of the model `model_spec` names (as `load_replica_model` takes it), read without its weights;
    None where it cannot be read here (`resolve_dtype`'s probe then uses SmolLM2-135M's shapes; a replica that
    loads the model reports the model's own error, naming its path)."""
    if model_spec in TEST_MODEL_NAMES:
        return tiny_llama(seed=0).config
    try:
        source, kwargs = resolve_source(os.path.expanduser(model_spec))
        return AutoConfig.from_pretrained(source, local_files_only=True, **kwargs)
    except Exception:  # noqa: BLE001 - any unreadable model: whoever loads it reports its own error
        return None


def model_context_tokens(model_spec: str) -> int | None:
    """The model's context (``max_position_embeddings`` of its text config, tokens), read without its weights
    (`model_config`); None when unknown. The one source of a model's context for the suites' checks
    (`workloads.core.run.check_model_context`) and the HTTP service (`cluster.serve_app`)."""
    config = model_config(model_spec)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(text, "max_position_embeddings", None)
    return int(context) if context else None


def resolve_dtype_here(
    model_spec: str, dtype: str, device: str = "cpu", num_threads: int | None = None, where: str | None = None
) -> dict:
    """Resolve a run's `dtype` once, in this process, for every replica of the run.

    `"auto"` runs `scissorhands.models.resolve_dtype` (its bfloat16 probe at the model's own layer shapes,
    on `num_threads` torch threads: a replica's share; torch's thread count is restored after). The probe is
    noisy under load, so a run must not let each replica resolve `auto` on its own (replicas of one run could
    differ in dtype): it resolves here once and hands every replica the result.

    Returns:
        ``{"dtype": concrete name}`` plus ``"dtype_reason"`` (resolve_dtype's reason, ending
        "resolved once for the run on <where>", default this host) for `"auto"`; ``{"dtype": dtype}`` for a
        forced dtype (the replicas record "forced" as before).
    Raises:
        ValueError: naming ``dtype`` or ``device`` and the accepted values (`scissorhands.models.check_dtype_name`,
            `check_device_name`).
    """
    check_dtype_name(dtype)
    check_device_name(device)
    if dtype != "auto":
        return {"dtype": dtype}
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(int(num_threads))
    try:
        torch_dtype, reason = resolve_dtype("auto", model_config(model_spec), device)
    finally:
        torch.set_num_threads(before)
    where = where or f"host {socket.gethostname()}"
    return {
        "dtype": str(torch_dtype).removeprefix("torch."),
        "dtype_reason": f"{reason}; resolved once for the run on {where}",
    }
