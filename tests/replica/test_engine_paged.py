"""The engine on the paged KV layout: blocks taken as sequences grow, preemption and recompute, the same tokens
as the preallocated layout."""

from __future__ import annotations

import pytest
import torch

from replica.common.types import ConfigError, EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine, full_batch_kv_limit_bytes
from replica.metrics import PAGED_LAYOUT_METRICS, ReplicaMetrics

SH = dict(policy="scissorhands", budget_tokens=16, policy_params=dict(history_window=20, count_chunk_steps=5))


def _requests(n: int, seed: int = 0) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(5, 40, (1,), generator=g))
        prompt = torch.randint(0, 128, (length,), generator=g).tolist()
        out.append(GenerationRequest(f"r{i}", prompt, int(torch.randint(1, 40, (1,), generator=g)), ignore_eos=True))
    return out


def _submit(model, cfg: EngineConfig, requests):
    """An engine with `requests` submitted, and the dict their results fill (by request id) as they finish."""
    engine = ContinuousBatchingEngine(model, cfg)
    results = {}
    for r in requests:
        engine.submit(r, lambda res: results.__setitem__(res.request_id, res))
    return results, engine


def _serve(model, cfg: EngineConfig, requests):
    results, engine = _submit(model, cfg, requests)
    engine.run_until_idle()
    return results, engine


@pytest.mark.parametrize("policy", [{}, SH], ids=["full", "scissorhands-B16"])
@pytest.mark.parametrize("limit", [10**7, 60_000], ids=["roomy", "preempting"])
def test_paged_engine_gives_the_preallocated_tokens_and_returns_every_block(model, policy, limit):
    requests = _requests(12)
    want, _ = _serve(model, EngineConfig(**policy), requests)
    got, engine = _serve(
        model, EngineConfig(kv_layout="paged", kv_memory_limit_bytes=limit, block_tokens=4, **policy), requests
    )
    assert {k: r.output_ids for k, r in got.items()} == {k: r.output_ids for k, r in want.items()}
    assert all(r.error is None for r in got.values())
    stats = engine.stats()
    assert engine.pool.blocks_in_use == 0 and stats["kv_layout"] == "paged" and stats["block_tokens"] == 4
    assert 0 < stats["mean_kv_blocks_in_use"] <= stats["peak_kv_blocks_in_use"] <= stats["kv_pool_blocks"]
    if limit == 60_000 and not policy:  # the full cache outgrows 57 blocks: the newest rows are preempted
        assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0
    if policy:  # 12 rows of at most 16 slots, 4 blocks a layer each: never preempted
        assert stats["preemptions"] == 0


def test_paged_admission_counts_what_a_request_holds_now_not_at_its_end(model):
    """Eight requests of 8 + 56 tokens: preallocated full rows reserve 63 slots each, paged rows start at 2
    blocks of 4 a layer, so under one limit the paged engine runs more of them at once."""
    requests = [GenerationRequest(f"r{i}", list(range(i, i + 8)), 56, ignore_eos=True) for i in range(8)]
    limit = full_batch_kv_limit_bytes(model, 3, 8, 56)  # three preallocated full rows
    _, pre = _serve(model, EngineConfig(kv_memory_limit_bytes=limit, max_length_tokens=64), requests)
    _, paged = _serve(model, EngineConfig(kv_layout="paged", kv_memory_limit_bytes=limit, block_tokens=4), requests)
    assert pre.stats()["peak_running_sequences"] == 3
    assert paged.stats()["peak_running_sequences"] >= 6


def test_a_request_larger_than_the_pool_is_rejected_and_the_others_run(model):
    cfg = EngineConfig(kv_layout="paged", kv_memory_limit_bytes=20_000, block_tokens=4)
    big = GenerationRequest("big", list(range(100)), 50, ignore_eos=True)
    small = GenerationRequest("small", list(range(6)), 4, ignore_eos=True)
    results, engine = _serve(model, cfg, [big, small])
    assert results["big"].error_kind == "rejected" and "KV blocks alone" in results["big"].error
    assert results["small"].error is None and len(results["small"].output_ids) == 4
    assert engine.pool.blocks_in_use == 0


def test_an_aborted_paged_row_returns_its_blocks(model):
    cfg = EngineConfig(kv_layout="paged", kv_memory_limit_bytes=10**6, block_tokens=4)
    requests = [GenerationRequest(r.request_id, r.prompt_ids, 30, ignore_eos=True) for r in _requests(3)]
    results, engine = _submit(model, cfg, requests)
    engine.step()
    engine.step()
    held = engine.pool.blocks_in_use
    engine.abort("r1")
    engine.step()
    assert results["r1"].error_kind == "aborted"
    assert engine.pool.blocks_in_use < held
    engine.run_until_idle()
    assert engine.pool.blocks_in_use == 0


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(kv_layout="blocks"), "kv_layout"),
        (dict(kv_layout="paged"), "kv_layout"),
        (dict(kv_layout="paged", kv_memory_limit_bytes=10**6, block_tokens=0), "block_tokens"),
        (dict(kv_layout="paged", kv_memory_limit_bytes=10**6, block_tokens="16"), "block_tokens"),
    ],
)
def test_paged_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**kw)


def test_a_pool_smaller_than_one_block_per_layer_is_refused(model):
    with pytest.raises(ValueError, match="kv_memory_limit_bytes: .* at least one block per layer"):
        ContinuousBatchingEngine(model, EngineConfig(kv_layout="paged", kv_memory_limit_bytes=100, block_tokens=16))


@pytest.mark.parametrize(
    "layout", [{}, dict(kv_layout="paged", kv_memory_limit_bytes=10**6, block_tokens=4)], ids=["preallocated", "paged"]
)
def test_per_request_budgets_give_each_request_its_own_ceil_of_length_over_ratio(model, layout):
    """Under budget: per_request, every request runs as it would alone with B = ceil((prompt + max_new) / 2) (no
    floor here: tests/replica/test_request_budgets.py has it)."""
    params = dict(history_window=4, count_chunk_steps=2, min_budget_tokens=0)
    cfg = EngineConfig(policy="scissorhands", compression_ratio=2, budget="per_request", policy_params=params, **layout)
    requests = _requests(8, seed=3)
    got, engine = _serve(model, cfg, requests)
    assert engine.stats()["budget"] == "per_request" and engine.budget_tokens is None
    for r in requests:
        budget = -(-(len(r.prompt_ids) + r.max_new_tokens) // 2)
        assert engine.budget_of(len(r.prompt_ids), r.max_new_tokens) == budget
        alone, _ = _serve(model, EngineConfig(policy="scissorhands", budget_tokens=budget, policy_params=params), [r])
        assert got[r.request_id].output_ids == alone[r.request_id].output_ids, r.request_id


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(policy="full", budget="per_request", compression_ratio=2),
            "budget: 'per_request' needs a policy that evicts",
        ),
        (dict(policy="h2o", budget="per_request", budget_tokens=8), "give compression_ratio and no budget_tokens"),
        (dict(policy="h2o", budget="per_request"), "give compression_ratio and no budget_tokens"),
        (
            dict(policy="h2o", budget="each", compression_ratio=2, max_length_tokens=64),
            "budget: expected one of fixed, per_request",
        ),
    ],
)
def test_per_request_budget_errors_name_the_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kw)


def test_budgeted_rows_preempted_and_recomputed_all_finish_and_return_their_blocks(model):
    """Scissorhands with per-request budgets on a pool too small for every row at once: rows are preempted,
    recomputed from prompt + outputs, never rejected after they started, and finish whole; a preempted request
    keeps its first admission time and its token times never go back."""
    params = dict(history_window=4, count_chunk_steps=2)
    cfg = EngineConfig(
        policy="scissorhands",
        compression_ratio=2,
        budget="per_request",
        policy_params=params,
        kv_layout="paged",
        kv_memory_limit_bytes=30_000,
        block_tokens=4,
    )
    requests = [GenerationRequest(f"r{i}", list(range(i, i + 12)), 40, ignore_eos=True) for i in range(8)]
    got, engine = _serve(model, cfg, requests)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0
    assert all(r.error is None and len(r.output_ids) == 40 for r in got.values())
    for r in got.values():
        assert r.received_time_s <= r.admitted_time_s <= r.token_times_s[0]
        assert r.token_times_s == sorted(r.token_times_s)
    assert engine.pool.blocks_in_use == 0


def test_failed_stopped_and_aborted_paged_rows_return_every_block(model):
    cfg = EngineConfig(kv_layout="paged", kv_memory_limit_bytes=10**6, block_tokens=4)
    requests = [GenerationRequest(f"r{i}", list(range(i, i + 9)), 30, ignore_eos=True) for i in range(3)]
    results, engine = _submit(model, cfg, requests)
    engine.step()
    layers = engine.num_layers
    assert engine.pool.blocks_in_use == 3 * layers * 3  # 10 tokens held: ceil(10 / 4) blocks per layer and row
    engine.abort("r1")
    engine.step()  # r1 leaves; r0 and r2 hold 11 tokens, still 3 blocks a layer
    assert results["r1"].error_kind == "aborted" and engine.pool.blocks_in_use == 2 * layers * 3
    assert engine.abort_all("stopped") == 2
    assert engine.pool.blocks_in_use == 0 and results["r0"].error_kind == "error"


def test_a_paged_request_is_refused_at_submission_when_even_its_recompute_cannot_fit(model):
    """The pool's fit rule counts a prefill of prompt + all outputs but the last, so a request admitted once is
    never refused after a preemption; one that could not be recomputed is refused before it starts."""
    cfg = EngineConfig(kv_layout="paged", kv_memory_limit_bytes=20_000, block_tokens=4)
    engine = ContinuousBatchingEngine(model, cfg)
    usable = engine.pool.usable_blocks
    per_token_layer = engine.num_layers
    longest = usable // per_token_layer * 4  # tokens a lone row can hold in every layer
    assert engine.fits_alone(longest - 10, 11) is None
    assert "KV blocks alone" in engine.fits_alone(longest - 10, 20)


# --------------------------------------------------------------------------- live metrics of the paged layout
class _BlockSpy(ReplicaMetrics):
    """`ReplicaMetrics` in memory that also keeps every (used, free) pair the engine records."""

    def __init__(self, *args):
        super().__init__(*args, use_ray=False)
        self.block_log: list[tuple[int, int]] = []

    def set_kv_blocks(self, used: int, free: int) -> None:
        self.block_log.append((used, free))
        super().set_kv_blocks(used, free)


def _blocks_and_preemptions(snap: dict) -> dict:
    return {k: v for k, v in snap.items() if k in PAGED_LAYOUT_METRICS}


def test_a_paged_engine_that_preempts_records_its_stats_counts_and_its_pool(model):
    """The live series of a run that preempts: the counters equal the engine's `preemptions` and
    `recomputed_tokens`, every block reading sums to the pool, and the last one shows every block returned."""
    metrics = _BlockSpy("full", None, "r0", "tiny-llama", "run")
    cfg = EngineConfig(kv_layout="paged", kv_memory_limit_bytes=60_000, block_tokens=4)
    engine = ContinuousBatchingEngine(model, cfg, metrics=metrics)
    for r in _requests(12):
        engine.submit(r, lambda res: None)
    engine.run_until_idle()
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > stats["preemptions"]
    assert _blocks_and_preemptions(metrics.snapshot()) == {
        "scissorhands_preemptions_total": stats["preemptions"],
        "scissorhands_recomputed_tokens_total": stats["recomputed_tokens"],
        "scissorhands_kv_used_blocks": 0,  # every block returned at the end
        "scissorhands_kv_free_blocks": stats["kv_pool_blocks"],
    }
    assert len(metrics.block_log) >= stats["decode_steps"]  # once per step
    assert all(used + free == stats["kv_pool_blocks"] for used, free in metrics.block_log)
    assert 0 < max(used for used, _ in metrics.block_log) <= stats["peak_kv_blocks_in_use"]


def test_the_preallocated_layout_reports_no_blocks_and_clears_a_paged_engines(model):
    """No pool, no block series: a preallocated engine records none, and one built on the labels a paged engine
    used drops that engine's last pool (never a stale reading); it never preempts, so no preemption series."""
    metrics = ReplicaMetrics("full", None, "r0", "tiny-llama", "run", use_ray=False)
    paged = ContinuousBatchingEngine(
        model, EngineConfig(kv_layout="paged", kv_memory_limit_bytes=10**6, block_tokens=4), metrics=metrics
    )
    paged.submit(GenerationRequest("p", list(range(1, 9)), 3, ignore_eos=True), lambda r: None)
    paged.run_until_idle()
    assert set(_blocks_and_preemptions(metrics.snapshot())) == {
        "scissorhands_kv_used_blocks",
        "scissorhands_kv_free_blocks",
    }
    limit = full_batch_kv_limit_bytes(model, 2, 8, 40)  # a preallocated engine under a limit: it queues
    pre = ContinuousBatchingEngine(
        model, EngineConfig(kv_memory_limit_bytes=limit, max_length_tokens=48), metrics=metrics
    )
    for r in [GenerationRequest(f"r{i}", list(range(i, i + 8)), 40, ignore_eos=True) for i in range(5)]:
        pre.submit(r, lambda r: None)
    pre.run_until_idle()
    snap = metrics.snapshot()
    assert pre.stats()["peak_running_sequences"] == 2 and snap["scissorhands_generated_tokens_total"] == 3 + 5 * 40
    assert _blocks_and_preemptions(snap) == {}


def test_an_abort_that_empties_the_engine_shows_its_blocks_free(model):
    """The step that applies an abort and then finds nothing to run still records the gauges: the aborted row's
    blocks read free, not held."""
    metrics = ReplicaMetrics("full", None, "r0", "tiny-llama", "run", use_ray=False)
    engine = ContinuousBatchingEngine(
        model, EngineConfig(kv_layout="paged", kv_memory_limit_bytes=10**6, block_tokens=4), metrics=metrics
    )
    engine.submit(GenerationRequest("r0", list(range(1, 10)), 30, ignore_eos=True), lambda r: None)
    engine.step()
    assert metrics.snapshot()["scissorhands_kv_used_blocks"] == 3 * engine.num_layers > 0
    engine.abort("r0")
    assert engine.step() is False
    snap = metrics.snapshot()
    assert snap["scissorhands_kv_used_blocks"] == 0
    assert snap["scissorhands_kv_free_blocks"] == engine.pool.usable_blocks
    assert snap["scissorhands_running_sequences"] == 0


@pytest.mark.parametrize("limit", [60_000, 100_000])
@pytest.mark.parametrize("scheduler", ["prefill_first", "mixed"])
def test_the_live_caches_never_hold_more_than_the_limit_bookkeeping_padding_included(model, scheduler, limit):
    """Per-request budgets of 5 and 50 slots in one batch: the short rows' dense bookkeeping (slot times and
    40 counters a slot, 168 bytes a slot here against 1,024 bytes of keys and values a block) is padded to the
    long rows' 50 slots, outside the pool. Admission charges that padding as blocks and a decode step that
    would pass the limit preempts first, so the measured peak stays within it (it reached 1.21x and 1.33x of
    the limit when admission counted blocks alone)."""
    cfg = EngineConfig(
        policy="scissorhands",
        compression_ratio=2,
        budget="per_request",
        policy_params=dict(history_window=40, count_chunk_steps=1),
        kv_layout="paged",
        kv_memory_limit_bytes=limit,
        block_tokens=4,
        scheduler=scheduler,
        max_num_batched_tokens=16,
    )
    lengths = [(60, 40) if i % 4 == 0 else (6, 4) for i in range(16)]
    requests = [
        GenerationRequest(f"r{i}", [(7 * i + j) % 128 for j in range(p)], n) for i, (p, n) in enumerate(lengths)
    ]
    got, engine = _serve(model, cfg, requests)
    stats = engine.stats()
    assert engine.bookkeeping_slot_bytes == 2 * 2 * (2 + 40)  # 2 layers x 2 KV heads x (slot time + counters)
    assert all(
        got[r.request_id].error is None and len(got[r.request_id].output_ids) == r.max_new_tokens for r in requests
    )
    assert stats["peak_running_sequences"] >= 2  # long and short rows ran together
    assert stats["peak_kv_cache_bytes"] <= limit
    assert engine.pool.blocks_in_use == 0


@pytest.mark.parametrize("scheduler", ["prefill_first", "mixed"])
@pytest.mark.parametrize(
    "cache",
    [
        dict(policy="full", max_length_tokens=400, block_tokens=8),  # bookkeeping once grew to max_length a row
        dict(policy="h2o", budget_tokens=32, block_tokens=4),  # ... or to the largest budget a row, short rows too
    ],
    ids=["full-max-length-400", "h2o-B32"],
)
def test_the_bookkeeping_grows_a_block_at_a_time_with_the_widest_row_and_stays_within_the_limit(
    model, cache, scheduler
):
    """The paged layout's dense bookkeeping follows the widest row a block at a time (not a maximum length or
    the largest budget), so the measured peak stays within the limit while long and short rows share a batch
    and rows are preempted and recomputed (a recomputed row's width counts its outputs). Before, the full cache
    peaked at 1.16x and 1.06x of its limit and h2o at 1.008x."""
    limit = 40_000 if cache["policy"] == "full" else 80_000
    cfg = EngineConfig(
        **cache, kv_layout="paged", kv_memory_limit_bytes=limit, scheduler=scheduler,
        max_num_batched_tokens=16,
    )  # fmt: skip
    lengths = [(40, 30) if i % 3 == 0 else (5, 8) for i in range(12 if cache["policy"] == "full" else 24)]
    requests = [
        GenerationRequest(f"r{i}", [(5 * i + j) % 128 for j in range(p)], n) for i, (p, n) in enumerate(lengths)
    ]
    got, engine = _serve(model, cfg, requests)
    stats = engine.stats()
    assert all(
        got[r.request_id].error is None and len(got[r.request_id].output_ids) == r.max_new_tokens for r in requests
    )
    assert stats["peak_running_sequences"] >= 2
    assert stats["peak_kv_cache_bytes"] <= limit
    assert stats["preemptions"] <= len(requests)  # no row preempted over and over
    assert engine.pool.blocks_in_use == 0
