"""Greedy generation through an engine backend (`replica.backends`), for the quality evaluations that score generated
text (passkey retrieval) on a backend that exposes no log-likelihoods (``engine: openvino``).

A backend point's prompts go to one engine built by `replica.backends.make_engine` from `backend_config` (paged, mixed
scheduler, greedy, EOS ignored: exactly ``new_tokens`` ids per prompt, as our own greedy decoding of a quality point
gives), with a KV memory limit of `MAX_CONCURRENT` full-cache sequences of the point's longest prompt + answer (in the
model's dtype; OpenVINO's u8 blocks hold about twice the tokens of bf16), and stepped until every prompt is answered.
"""

from __future__ import annotations

from replica.backends import make_engine
from replica.common.types import EngineConfig, GenerationRequest

#: Prompts a backend point runs at once (its KV memory limit is this many full-cache sequences).
MAX_CONCURRENT = 8
#: `stats()` keys of the backend carried into the point's record (what it ran: version, precisions, eviction, pool).
RECORD_KEYS = (
    "kv_memory_limit_bytes",
    "kv_pool_blocks",
    "peak_kv_cache_bytes",
    "openvino_genai_version",
    "openvino_kv_precision",
    "openvino_inference_precision",
    "openvino_threads",
    "openvino_eviction",
    "openvino_max_cache_size_rounding",
)


def backend_config(
    engine: str,
    policy: str,
    policy_params: dict | None,
    compression_ratio: float | None,
    max_length_tokens: int,
    prompts: int = MAX_CONCURRENT,
) -> EngineConfig:
    """The `EngineConfig` a quality point of `engine` runs: the policy at its ratio (none for ``full``) over
    ``max_length_tokens`` (the longest prompt + answer), room for ``min(prompts, MAX_CONCURRENT)`` full sequences.

    Raises:
        ConfigError (a ValueError): a policy, parameter or ratio the engine cannot run (the message names the field
            and the accepted values).
    """
    return EngineConfig(
        engine=engine,
        policy=policy,
        policy_params=dict(policy_params or {}),
        compression_ratio=None if policy == "full" else compression_ratio,
        max_length_tokens=max_length_tokens,
        kv_limit_full_sequences=max(1, min(prompts, MAX_CONCURRENT)),
        kv_layout="paged",
        scheduler="mixed",
    )


def generate_on_backend(model, config: EngineConfig, prompts: list[list[int]], new_tokens: int) -> tuple[list, dict]:
    """Greedy ids for every prompt from the backend `config.engine` names, built on `model`.

    Args:
        model: the replica's torch model (its dtype is the backend's compute precision; the KV limit resolves on it).
        config: from `backend_config`.
        prompts: token-id lists; new_tokens: ids to generate for each (EOS ignored).

    Returns:
        (``[ids of prompt i]`` in order, the backend's `RECORD_KEYS` from its ``stats()`` plus ``engine`` and
        ``budget_tokens``).

    Raises:
        RuntimeError: a request failed (the message names it and carries the backend's message), or the backend went
            idle with prompts unanswered; the point fails, the run goes on.
        BackendUnavailable / ValueError: from `make_engine`.
    """
    engine = make_engine(model, config, eos_token_id=None, replica_id="quality")
    results: dict[str, object] = {}
    for i, ids in enumerate(prompts):
        engine.submit(GenerationRequest(f"q{i}", list(ids), new_tokens), lambda r: results.setdefault(r.request_id, r))
    while len(results) < len(prompts):
        if not engine.step() and len(results) < len(prompts):
            raise RuntimeError(
                f"engine {config.engine!r} went idle with {len(prompts) - len(results)} prompts unanswered"
            )
    out = []
    for i in range(len(prompts)):
        r = results[f"q{i}"]
        if r.error is not None:
            raise RuntimeError(f"engine {config.engine!r}: request {i} failed ({r.error_kind}): {r.error}")
        out.append(list(r.output_ids))
    stats = engine.stats()
    return out, {
        "engine": config.engine,
        "budget_tokens": stats.get("budget_tokens"),
        **{k: stats.get(k) for k in RECORD_KEYS},
    }
