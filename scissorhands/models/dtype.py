"""Dtype names and ``dtype: auto`` resolution (CPU flags, the bfloat16 probe), CPU model name, device names."""

from __future__ import annotations

import platform
import re
import time
from functools import lru_cache

import torch

from .packed import PackedLinear

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""The values a ``dtype`` setting accepts (suites, the engine, the quality runner, the service)."""

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags (``/proc/cpuinfo``) under which ``dtype: auto`` considers bfloat16 on a CPU."""

BF16_MIN_SPEEDUP = 1.2
"""The probe's bfloat16 speedup (float32 time / bfloat16 time) at or above which ``dtype: auto`` picks
bfloat16 on a CPU with AVX512-BF16 but no AMX. Not 1.0: bfloat16 rounds every matmul input to 8 mantissa bits,
worth it only when clearly faster (docs/performance.md, "Measurements behind the library and cluster code")."""

AMX_MIN_HIDDEN = 256
"""On a CPU with AMX, ``dtype: auto`` picks bfloat16 by the flag for a model whose hidden size is at least this; a
narrower one (the tests' tiny models, 64 wide, probed 1.01-1.05x) runs float32. Both by shape, never by timing,
so one machine resolves one dtype for one model whatever else runs."""

BF16_NEAR_THRESHOLD = 0.15
"""A probe within this relative distance of :data:`BF16_MIN_SPEEDUP` (1.02x-1.38x) is reported as near its
threshold: the resolution says so and suggests a fixed ``dtype``, since such a CPU could resolve either way."""


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
    return platform.processor() or "unknown"


def _layer_shapes(model_config) -> tuple[int, int]:
    """(hidden_size, intermediate_size) of the model's MLP (SmolLM2-135M's 576 x 1536 when unknown)."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden = int(getattr(cfg, "hidden_size", 0) or 576)
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
    return hidden, inter


@lru_cache(maxsize=16)
def probe_bfloat16_speedup(
    hidden: int, intermediate: int, threads: int, rows: tuple[int, ...] = (1, 16), repeats: int = 15
) -> float:
    """Time of the model's linear layer in float32 over its time in bfloat16 on this CPU at the model's shapes.

    One up-projection ``(rows, hidden) @ (intermediate, hidden)^T`` per row count in ``rows``
    (a decode step at batch 1 and a batched one), run as :class:`PackedLinear` runs it in a loaded model
    (packed in oneDNN's layout where :func:`onednn_packs` says so, else ``F.linear``), float32 and bfloat16
    interleaved, ``repeats`` rounds after one warm-up; the result is sum over row counts of the *fastest* float32
    trial over the same sum for bfloat16 (> 1: bfloat16 faster). The minimum, not the median: another process
    only ever slows a trial, so the fastest of interleaved trials is what the CPU does when it runs them, the
    same whatever else runs (a median under load moved this CPU's probe from 3.2x idle to 1.04x).
    Short enough to run at every load; cached per shape and thread count for the process.
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
                    if rep:  # round 0 warms up (and packs)
                        times[dt][i].append(time.perf_counter() - t0)
    fastest = {dt: sum(min(ts) for ts in per) for dt, per in times.items()}
    return fastest[torch.float32] / fastest[torch.bfloat16]


def near_threshold(speedup: float) -> bool:
    """Whether a probe's `speedup` lies within :data:`BF16_NEAR_THRESHOLD` of :data:`BF16_MIN_SPEEDUP`."""
    return abs(speedup / BF16_MIN_SPEEDUP - 1) < BF16_NEAR_THRESHOLD


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


def resolve_dtype(
    requested="auto",
    model_config=None,
    device: str | torch.device = "cpu",
) -> tuple[torch.dtype, str]:
    """The parameter dtype to run in, and why: ``(torch.dtype, reason)``.

    ``float32``, ``bfloat16``, ``float16`` (or the ``torch.dtype``) force that dtype. ``auto``:

    * GPU: bfloat16 where ``torch.cuda.is_bf16_supported()``, else float16;
    * CPU with AMX (``amx_bf16``): bfloat16 for a model at least :data:`AMX_MIN_HIDDEN` wide, float32 for a
      narrower one, decided by the flag and the shape alone (bfloat16 matmuls run on AMX tiles, about 3x float32
      here at the embedded model's shape), so one machine resolves one dtype whatever else runs on it; the probe
      (:func:`probe_bfloat16_speedup`) still runs and its figure is in the reason, with a note when it came out
      below :data:`BF16_MIN_SPEEDUP` (a contended load, or a torch build without AMX kernels);
    * CPU with AVX512-BF16 but no AMX: the probe decides (bfloat16 at >= :data:`BF16_MIN_SPEEDUP`, fastest of
      interleaved trials, robust to load); a probe within :data:`BF16_NEAR_THRESHOLD` of the threshold says so
      in the reason (``near the 1.2x threshold``) and suggests setting ``dtype`` explicitly;
    * other CPUs: float32.

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
    probe = (
        f"probe linear layer {hidden}x{inter} at 1 and 16 rows, {threads} thread{'s' * (threads != 1)}, fastest of "
        f"interleaved trials: bfloat16 {speedup:.2f}x float32's speed"
    )
    near = (
        f"; near the {BF16_MIN_SPEEDUP}x threshold: this CPU could resolve either way, set dtype explicitly"
        if near_threshold(speedup)
        else ""
    )
    if "amx_bf16" in flags and hidden >= AMX_MIN_HIDDEN:
        low = "" if speedup >= BF16_MIN_SPEEDUP else f" (below {BF16_MIN_SPEEDUP}x: contended, or no AMX kernels?)"
        return torch.bfloat16, f"auto: CPU has {', '.join(flags)}: bfloat16 on AMX tiles; {probe}{low}"
    if "amx_bf16" in flags:
        return torch.float32, (
            f"auto: CPU has {', '.join(flags)}, but the model's layers ({hidden} wide) are narrower than the "
            f"{AMX_MIN_HIDDEN} at which AMX tiles pay: float32; {probe}"
        )
    if speedup >= BF16_MIN_SPEEDUP:
        return torch.bfloat16, f"auto: CPU has {', '.join(flags)}; {probe}{near}"
    return (
        torch.float32,
        f"auto: CPU has {', '.join(flags)} but {probe}, below the {BF16_MIN_SPEEDUP}x that picks it{near}",
    )
