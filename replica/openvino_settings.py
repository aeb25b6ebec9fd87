"""OpenVINO GenAI's KV settings as plain values: its eviction's parameters, its KV blocks under a byte limit, and a
compression ratio as its ``max_cache_size``. Standard library only: `replica.common.types` checks an ``engine: openvino``
config with it, `replica.backends.openvino` runs it, and ``bench/peer_openvino.py`` (a script in the peer's own
virtualenv, which imports no module of this repository's packages) loads this file by its path.

Source followed: OpenVINO GenAI 2026.4 ``SchedulerConfig`` / ``CacheEvictionConfig`` (``start_size``,
``recent_size``, ``max_cache_size`` in tokens, each a multiple of the CPU plugin's 32-token KV block;
``aggregation_mode`` SUM or NORM_SUM).
"""

from __future__ import annotations

import math

#: KV cache precisions the CPU plugin takes (``KV_CACHE_PRECISION``); u8 is its default.
KV_PRECISIONS = ("u8", "bf16", "f16", "f32")
#: Those a backend config accepts: u8 (the default, with per-block scales) and bf16 (twice the bytes a token).
BACKEND_KV_PRECISIONS = ("u8", "bf16")
AGGREGATION_MODES = ("SUM", "NORM_SUM")
#: Tokens per KV block of the CPU plugin (the peer probe's fact, docs/benchmarks.md).
BLOCK_TOKENS = 32
#: The policies an ``engine: openvino`` config runs: the full cache, and its own eviction (``CacheEvictionConfig``).
OPENVINO_POLICIES = ("full", "openvino_eviction")
#: ``openvino_eviction``'s parameters and defaults (tokens; ``max_cache_size`` None: from the compression ratio).
EVICTION_DEFAULTS = {"aggregation_mode": "SUM", "start_size": 32, "recent_size": 32, "max_cache_size": None}


def _int(where: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}: expected an integer >= {low}, got {value!r}")
    return value


def check_choice(where: str, value, accepted: tuple) -> str:
    """`value` when it is one of `accepted`.

    Raises:
        ValueError: ``<where>: 'x'; accepted: a, b``.
    """
    if value not in accepted:
        raise ValueError(f"{where}: {value!r}; accepted: {', '.join(accepted)}")
    return value


def check_eviction(where: str, ev, block_tokens: int = BLOCK_TOKENS) -> dict | None:
    """OpenVINO's eviction settings checked: None (the full cache) or ``{start_size, recent_size, max_cache_size,
    aggregation_mode}``, the sizes in tokens, each a multiple of `block_tokens`, ``max_cache_size`` above
    ``start_size + recent_size``.

    Raises:
        ValueError: a missing or bad value; the message names ``<where>.<key>`` and what it accepts.
    """
    if ev is None:
        return None
    if not isinstance(ev, dict):
        raise ValueError(f"{where}: expected null or a mapping, got {ev!r}")
    out = {}
    for key in ("start_size", "recent_size", "max_cache_size"):
        out[key] = _int(f"{where}.{key}", ev.get(key), 1)
        if out[key] % block_tokens:
            raise ValueError(f"{where}.{key}: {out[key]} is not a multiple of the KV block ({block_tokens} tokens)")
    if out["max_cache_size"] <= out["start_size"] + out["recent_size"]:
        raise ValueError(
            f"{where}.max_cache_size: {out['max_cache_size']} must exceed start_size + recent_size "
            f"({out['start_size'] + out['recent_size']}): nothing would be evictable"
        )
    out["aggregation_mode"] = check_choice(f"{where}.aggregation_mode", ev.get("aggregation_mode"), AGGREGATION_MODES)
    return out


def blocks_for(kv_limit_bytes: int, block_bytes: int) -> int:
    """KV blocks of ``block_bytes`` each that ``kv_limit_bytes`` holds (``num_kv_blocks``), rounded down.

    Raises:
        ValueError: the limit holds no block (the message names both numbers).
    """
    blocks = kv_limit_bytes // block_bytes
    if blocks < 1:
        raise ValueError(f"kv_limit_bytes: {kv_limit_bytes} B holds no KV block of {block_bytes} B")
    return blocks


def max_cache_size_for(
    max_length_tokens: int,
    compression_ratio: float,
    start_size: int,
    recent_size: int,
    block_tokens: int = BLOCK_TOKENS,
) -> tuple[int, str]:
    """A compression ratio as OpenVINO's ``max_cache_size`` (tokens), the way ours maps it to a budget
    (``B = ceil(max_length_tokens / ratio)``, `scissorhands.budget_from_ratio`), then rounded up to a whole
    `block_tokens` block and to at least one evictable block above ``start_size + recent_size``.

    Returns:
        (max_cache_size, the rounding in words, e.g. ``"ceil(544 / 5) = 109 -> 128 (32-token blocks)"``).
    """
    budget = math.ceil(max_length_tokens / compression_ratio)
    size = max(-(-budget // block_tokens) * block_tokens, start_size + recent_size + block_tokens)
    return size, f"ceil({max_length_tokens} / {compression_ratio:g}) = {budget} -> {size} ({block_tokens}-token blocks)"


def eviction_from_policy(
    params: dict, compression_ratio: float | None, max_length_tokens: int | None, block_tokens: int = BLOCK_TOKENS
) -> tuple[dict, str | None]:
    """``openvino_eviction``'s `params` (keys of `EVICTION_DEFAULTS`) and ratio as checked eviction settings.

    ``max_cache_size`` given wins over `compression_ratio` (as ``budget_tokens`` does in ours).

    Returns:
        (`check_eviction`'s mapping, the ratio's rounding in words or None when ``max_cache_size`` was given).

    Raises:
        ValueError: an unknown parameter (``policy_params: ...; accepted: ...``), a bad value, or neither a
            ``max_cache_size`` nor a ratio with ``max_length_tokens``; the message names the field.
    """
    unknown = sorted(set(params) - set(EVICTION_DEFAULTS))
    if unknown:
        raise ValueError(
            f"policy_params: openvino_eviction takes no {', '.join(unknown)}; accepted: {', '.join(EVICTION_DEFAULTS)}"
        )
    ev = {**EVICTION_DEFAULTS, **params}
    rounding = None
    if ev["max_cache_size"] is None:
        if compression_ratio is None or max_length_tokens is None:
            raise ValueError(
                "compression_ratio: openvino_eviction needs policy_params.max_cache_size (tokens) or a "
                "compression_ratio with max_length_tokens"
            )
        start = _int("policy_params.start_size", ev["start_size"], 1)
        recent = _int("policy_params.recent_size", ev["recent_size"], 1)
        ev["max_cache_size"], rounding = max_cache_size_for(
            max_length_tokens, compression_ratio, start, recent, block_tokens
        )
    return check_eviction("policy_params", ev, block_tokens), rounding


def evicts_nothing(max_cache_size: int, longest_sequence_tokens: int) -> str | None:
    """Why OpenVINO's eviction at `max_cache_size` (tokens) never evicts a sequence of at most
    `longest_sequence_tokens` (its cache holds the whole sequence, so the row runs the full cache under an
    eviction label, e.g. a ratio whose size was rounded up to the 96-token floor), or None when it may evict."""
    if max_cache_size < longest_sequence_tokens:
        return None
    return f"evicts nothing: max_cache_size {max_cache_size} >= longest sequence {longest_sequence_tokens}"


def eviction_reach(eviction: dict | None, longest_sequence_tokens: int) -> dict:
    """A point record's ``evicts`` (False: `evicts_nothing`) and ``evicts_reason`` for the
    eviction settings a replica ran (its stats' ``openvino_eviction``); {} for the full cache (None)."""
    if not eviction:
        return {}
    why = evicts_nothing(int(eviction["max_cache_size"]), longest_sequence_tokens)
    return {"evicts": why is None, "evicts_reason": why}
