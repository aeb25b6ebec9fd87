"""A suite's KV memory limit (`replica.common.types.KVMemoryLimit`, serving and frontier suites alike): bytes, or
full-cache rows of the suite's lengths resolved on the replica in the run's dtype, on the tiny model.

tiny-llama: 2 layers x 2 KV heads; a full-cache slot is K + V of head_dim 16 plus an int16 slot time per head:
2 x 2 x (2 x 16 x 4 + 2) = 520 B in float32, 2 x 2 x (2 x 16 x 2 + 2) = 264 B in bfloat16 (the K and V bytes
halve, the bookkeeping does not).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from replica.common.types import EngineConfig
from replica.engine import ContinuousBatchingEngine, full_batch_kv_limit_bytes
from scissorhands.testing import tiny_llama
from tests.suite_helpers import serving_suite, tiny_suite
from workloads import sweep
from workloads.core.suite import SuiteError
from workloads.kinds import load_suite

SLOT_BYTES = {torch.float32: 520, torch.bfloat16: 264}

SERVING = serving_suite(
    name="limit",
    dtype="float32",
    mode="max_batch",
    compression_ratios=[5],
    prompt_tokens=40,
    new_tokens=10,
    kv_memory_limit={"full_sequences": 3},
    rounds=1,
)
FRONTIER = tiny_suite(
    "frontier", throughput="max_batch", name="limit", compression_ratios=[4], prompt_tokens=24, new_tokens=8, replicas=1
)


def _write(tmp_path: Path, data: dict) -> str:
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _load(tmp_path: Path, base: dict, **change):
    data = {**base, **change}
    return load_suite(_write(tmp_path, {k: v for k, v in data.items() if v is not None}))


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def typed_model(request):
    torch.set_num_threads(1)
    m = tiny_llama(0).to(request.param)
    m.generation_config.eos_token_id = None
    return m


# ----------------------------------------------------------------------------------------------- resolution
@pytest.mark.parametrize(
    "lengths, length",
    [
        (dict(prompt_tokens=40, new_tokens=10), 50),
        # a length mix: rows of the longest prompt + the longest output
        (
            dict(
                mode="concurrency",
                loads=[2],
                num_requests=2,
                prompt_tokens={"dist": "uniform", "min": 8, "max": 24},
                new_tokens={"dist": "uniform", "min": 2, "max": 8},
            ),
            32,
        ),
    ],
    ids=["fixed", "distributions"],
)
def test_full_sequences_resolve_on_the_engine_in_the_models_dtype(tmp_path, typed_model, lengths, length):
    """Three full rows of the suite's longest sequence: 3 x length x 520 B in float32, x 264 B in bfloat16; the full
    cache then fits exactly 3 rows in both dtypes, and every policy of the suite gets the same bytes."""
    suite = _load(tmp_path, SERVING, **lengths)
    slot = SLOT_BYTES[next(typed_model.parameters()).dtype]
    engines = [ContinuousBatchingEngine(typed_model, suite.engine_config(p)) for p in suite.points()]
    assert {e.kv_memory_limit_bytes for e in engines} == {3 * length * slot}
    assert engines[0].config.kv_limit_full_sequences == 3 and engines[0].config.kv_memory_limit_bytes is None
    assert engines[0].kv_memory_limit_bytes == full_batch_kv_limit_bytes(typed_model, 3, length - 1, 1)
    if lengths["prompt_tokens"] == 40:
        full, sh = engines
        assert full.max_batch_for(40, 10) == 3 and sh.max_batch_for(40, 10) > 3


def test_float32_rows_hold_about_twice_the_bytes_of_bfloat16_rows():
    f32, bf16 = tiny_llama(0), tiny_llama(0).to(torch.bfloat16)
    cfg = EngineConfig(kv_limit_full_sequences=4, max_length_tokens=64)
    a, b = (ContinuousBatchingEngine(m, cfg).kv_memory_limit_bytes for m in (f32, bf16))
    assert (a, b) == (4 * 64 * 520, 4 * 64 * 264) and 1.9 < a / b <= 2
    # the same bytes (the older form) hold about twice the rows in bfloat16: what full_sequences corrects
    in_bytes = EngineConfig(kv_memory_limit_bytes=a, max_length_tokens=64)
    assert [ContinuousBatchingEngine(m, in_bytes).max_batch_for(32, 32) for m in (f32, bf16)] == [4, 7]


def test_the_paged_pool_is_sized_from_full_sequences_too(typed_model):
    slot = SLOT_BYTES[next(typed_model.parameters()).dtype]
    cfg = EngineConfig(kv_layout="paged", block_tokens=4, kv_limit_full_sequences=2, max_length_tokens=48)
    engine = ContinuousBatchingEngine(typed_model, cfg)
    assert engine.kv_memory_limit_bytes == 2 * 48 * slot
    assert engine.pool.usable_blocks == 48  # 2 rows x 48 slots / 4 slots a block x 2 layers


# ----------------------------------------------------------------------------------------------- records
@pytest.mark.parametrize("dtype, slot", [("float32", 520), ("bfloat16", 264)])
def test_a_serving_run_records_the_resolved_bytes_and_the_full_sequences(tmp_path, dtype, slot):
    """End to end (`--local`): the replica loads the model in the suite's dtype and resolves the rows there; the
    record carries both figures, and the full cache's max batch is the suite's 3 rows in either dtype."""
    path = _write(tmp_path, {**SERVING, "dtype": dtype, "policies": ["full"]})
    out = tmp_path / "r"
    assert sweep.main([path, "--local", "--pushgateway", "off", "--results-dir", str(out), "--run-id", "run"]) == 0
    (rec,) = [json.loads(x) for x in (out / "run" / "points.jsonl").read_text().splitlines()]
    assert rec["status"] == "ok" and rec["dtype"] == dtype
    assert (rec["kv_memory_limit_bytes"], rec["kv_limit_full_sequences"]) == (3 * 50 * slot, 3)
    assert rec["max_batch_size"] == 3 and rec["max_batch_verified"] is True
    assert rec["point_config"]["kv_limit_full_sequences"] == 3


def test_a_frontier_point_resolves_its_rows_in_the_models_dtype(tmp_path):
    """The frontier's limit is the same model, resolved by the same engine: 2 rows of 24 + 8 in bfloat16."""
    from workloads.frontier.point import run_frontier_point

    bf16 = tiny_llama(0).to(torch.bfloat16)
    bf16.generation_config.eos_token_id = None
    (point,) = _load(tmp_path, FRONTIER, policies=["full"]).points()
    rec = run_frontier_point(bf16, None, point)
    assert (rec["kv_memory_limit_bytes"], rec["kv_limit_full_sequences"], rec["batch_size"]) == (2 * 32 * 264, 2, 2)


# ----------------------------------------------------------------------------------------------- older suites
def test_kv_memory_limit_bytes_still_loads_as_bytes_with_the_ids_it_had(tmp_path):
    """An older suite's `kv_memory_limit_bytes: N` is `kv_memory_limit: {bytes: N}`: the same engine config and the
    same point ids, the ones it had before `kv_memory_limit` existed (so its runs resume; ids from commit be809cf)."""
    old = _load(tmp_path, SERVING, kv_memory_limit=None, kv_memory_limit_bytes=78_000)
    new = _load(tmp_path, SERVING, kv_memory_limit={"bytes": 78_000})
    assert (
        [p.point_id for p in old.points()]
        == [p.point_id for p in new.points()]
        == [
            "max_batch-full-Lmax-s0-8237530f",
            "max_batch-scissorhands-r5-Lmax-s0-80e4fb50",
        ]
    )
    for suite in (old, new):
        cfg = suite.engine_config(suite.points()[0])
        assert (cfg.kv_memory_limit_bytes, cfg.kv_limit_full_sequences) == (78_000, None)
        assert "kv_memory_limit" not in suite.points()[0].identity
    rows = _load(tmp_path, SERVING)
    assert rows.points()[0].identity["kv_limit_full_sequences"] == 3
    assert rows.points()[0].point_id != old.points()[0].point_id


# ----------------------------------------------------------------------------------------------- bad input
LIMIT_ERRORS = [
    ({"full_sequences": 2, "bytes": 1000}, r"kv_memory_limit: give exactly one of full_sequences .* or bytes"),
    ({}, r"kv_memory_limit: give exactly one of full_sequences .* got neither"),
    ({"full_sequences": 0}, r"kv_memory_limit.full_sequences: Input should be greater than or equal to 1, got 0"),
    ({"full_sequences": -2}, r"kv_memory_limit.full_sequences: Input should be greater than or equal to 1, got -2"),
    ({"bytes": 0}, r"kv_memory_limit.bytes: Input should be greater than or equal to 1, got 0"),
    ({"full_sequences": 2.5}, r"kv_memory_limit.full_sequences: Input should be a valid integer"),
    ({"rows": 4}, r"kv_memory_limit.rows: unknown key"),
    (
        4,
        r"kv_memory_limit: expected \{full_sequences: N\} or \{bytes: N\} \(N a whole number >= 1\), or \{fraction: F\} .*got 4",
    ),
]


@pytest.mark.parametrize("base", [SERVING, FRONTIER], ids=["serving", "frontier"])
@pytest.mark.parametrize("limit, message", LIMIT_ERRORS, ids=[str(e[0]) for e in LIMIT_ERRORS])
def test_a_bad_kv_memory_limit_names_the_field_and_what_it_accepts(tmp_path, base, limit, message):
    with pytest.raises(SuiteError, match=message):
        _load(tmp_path, base, kv_memory_limit=limit)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(kv_memory_limit_bytes=10**6), r"kv_memory_limit, kv_memory_limit_bytes: give one KV memory limit"),
        (dict(kv_memory_fraction=0.5), r"kv_memory_limit, kv_memory_fraction: give one KV memory limit"),
    ],
)
def test_a_serving_suite_takes_one_limit(tmp_path, change, message):
    with pytest.raises(SuiteError, match=message):
        _load(tmp_path, SERVING, **change)


def test_paged_and_max_batch_suites_name_kv_memory_limit_when_none_is_given(tmp_path):
    with pytest.raises(SuiteError, match=r"kv_memory_limit, kv_memory_limit_bytes, kv_memory_fraction: mode max_batch"):
        _load(tmp_path, SERVING, kv_memory_limit=None)
    paged = dict(mode="concurrency", loads=[2], num_requests=2, kv_layout="paged", kv_memory_limit=None)
    with pytest.raises(SuiteError, match=r"kv_layout: 'paged' sizes its block pool from kv_memory_limit"):
        _load(tmp_path, SERVING, **paged)
    assert _load(tmp_path, SERVING, **{**paged, "kv_memory_limit": {"full_sequences": 1}}).kv_limit.full_sequences == 1


@pytest.mark.parametrize("base", [SERVING, FRONTIER], ids=["serving", "frontier"])
def test_the_sweep_exits_2_naming_kv_memory_limit_and_records_nothing(tmp_path, capsys, base):
    path = _write(tmp_path, {**base, "kv_memory_limit": {"full_sequences": 0}})
    assert sweep.main([path, "--results-dir", str(tmp_path / "results"), "--run-id", "r"]) == 2
    err = capsys.readouterr().err
    assert "kv_memory_limit.full_sequences" in err and "greater than or equal to 1" in err
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(kv_limit_full_sequences=2), r"max_length_tokens: kv_limit_full_sequences sizes the limit"),
        (dict(kv_limit_full_sequences=0, max_length_tokens=8), r"kv_limit_full_sequences: expected an integer >= 1"),
        (
            dict(kv_limit_full_sequences=2, kv_memory_limit_bytes=10, max_length_tokens=8),
            r"kv_memory_limit_bytes, kv_limit_full_sequences: give one KV memory limit",
        ),
    ],
)
def test_engine_config_names_a_bad_full_sequences_limit(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


# ----------------------------------------------------------------------------------------------- shipped suites
def test_the_shipped_suites_state_their_limits_in_full_rows():
    """Their descriptions say "N full sequences": true in every dtype only as `full_sequences` (no shipped suite
    gives bytes sized for one dtype)."""
    rows = {}
    for path in sorted(Path("workloads/suites").glob("*.yaml")):
        assert "kv_memory_limit_bytes" not in yaml.safe_load(path.read_text()), path
        suite = load_suite(str(path))
        limit = getattr(suite, "kv_limit", None) or getattr(suite, "kv_memory_limit", None)
        if limit is not None:
            rows[path.name] = limit.full_sequences
    assert rows == {
        "frontier-quick.yaml": 2,
        "frontier.yaml": 4,
        "memory-limit-cpu.yaml": 4,
        "memory-limit.yaml": 4,
        "serving-bursty.yaml": 4,
        "serving-capacity-peer-quick.yaml": 2,
        "serving-capacity.yaml": 2,
        "serving-concurrency.yaml": 4,
        "serving-mixed.yaml": 2,
        "serving-paged.yaml": 2,
        "serving-peer.yaml": 4,
        "serving-prefix.yaml": 4,
        "serving-rate.yaml": 4,
        "sessions.yaml": 4,
        "sessions-capacity.yaml": 2,
    }
    memory_limit = load_suite("workloads/suites/memory-limit.yaml")
    cfg = memory_limit.engine_config(memory_limit.points()[0])
    assert (cfg.kv_limit_full_sequences, cfg.max_length_tokens, cfg.kv_memory_limit_bytes) == (4, 1088, None)
