"""Model loading, split by job; every public name is re-exported here (``from scissorhands.models import X``).

- ``loading``: :func:`load_model`, :func:`load_tokenizer`, model ids, attention implementation, sources.
- ``embedded``: the embedded SmolLM2-135M-Instruct GGUF model: its paths, the one-time conversion, the cache dir.
- ``dtype``: dtype names and ``dtype: auto`` resolution (CPU flags, the bfloat16 probe), CPU model name,
  device names and checks.
- ``packed``: :class:`PackedLinear` (CPU weights packed once in oneDNN's layout), :func:`pack_linear_weights`.
- ``dummy``: models of real architectures with dummy weights from the shipped ``configs/*.json``.

A test that replaces a function must patch the submodule that reads it (e.g.
``scissorhands.models.dtype.cpu_flags``), not this package.
"""

from .dtype import (
    AMX_MIN_HIDDEN,
    BF16_CPU_FLAGS,
    BF16_MIN_SPEEDUP,
    BF16_NEAR_THRESHOLD,
    DEVICE_NAMES,
    DTYPE_CHOICES,
    check_device_name,
    check_dtype_name,
    cpu_flags,
    cpu_model_name,
    is_device_name,
    near_threshold,
    probe_bfloat16_speedup,
    resolve_dtype,
)
from .dummy import DUMMY_CONFIG_DIR, DUMMY_MODEL_IDS, dummy_config, load_dummy_model, tiny_overrides
from .embedded import (
    CACHE_DIR_ENV,
    EMBEDDED,
    EMBEDDED_GGUF_FILE,
    EMBEDDED_GGUF_PACKAGE,
    EMBEDDED_MODEL_ID,
    convert_embedded_model,
    embedded_cache_dir,
    embedded_cache_is_complete,
    embedded_gguf_path,
    load_embedded_from_gguf,
)
from .loading import (
    apply_attn_implementation,
    default_attn_implementation,
    load_model,
    load_tokenizer,
    model_id_of,
    prepare_tokenizer,
    resolve_source,
)
from .packed import PACKED_DTYPES, PackedLinear, onednn_packs, pack_linear_weights

__all__ = [
    "AMX_MIN_HIDDEN",
    "BF16_CPU_FLAGS",
    "BF16_MIN_SPEEDUP",
    "BF16_NEAR_THRESHOLD",
    "CACHE_DIR_ENV",
    "DEVICE_NAMES",
    "DTYPE_CHOICES",
    "DUMMY_CONFIG_DIR",
    "DUMMY_MODEL_IDS",
    "EMBEDDED",
    "EMBEDDED_GGUF_FILE",
    "EMBEDDED_GGUF_PACKAGE",
    "EMBEDDED_MODEL_ID",
    "PACKED_DTYPES",
    "PackedLinear",
    "apply_attn_implementation",
    "check_device_name",
    "check_dtype_name",
    "convert_embedded_model",
    "cpu_flags",
    "cpu_model_name",
    "default_attn_implementation",
    "dummy_config",
    "embedded_cache_dir",
    "embedded_cache_is_complete",
    "embedded_gguf_path",
    "is_device_name",
    "load_dummy_model",
    "load_embedded_from_gguf",
    "load_model",
    "load_tokenizer",
    "model_id_of",
    "onednn_packs",
    "pack_linear_weights",
    "prepare_tokenizer",
    "near_threshold",
    "probe_bfloat16_speedup",
    "resolve_dtype",
    "resolve_source",
    "tiny_overrides",
]
