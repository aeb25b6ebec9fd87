"""`replica.common.types.EngineConfig` declared once: the serving and frontier suites and `make serve` take its knobs from
it (types, checks, defaults), the KV limit is one typed value (`replica.common.types.KVMemoryLimit`) resolved to bytes in
one place, and a bad combination fails the whole suite when it loads (exit 2, naming the field), not a point.

Sizes on the tiny model (tests/workloads/test_kv_memory_limit.py): a full-cache slot is 520 B in float32.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from ray import cloudpickle

from cluster import serve_app
from cluster.serve_app import SERVE_SETS, engine_knob_flags, main
from replica import engine
from replica.common.types import (
    KV_LIMIT_FIELDS,
    PER_POINT_FIELDS,
    ConfigError,
    EngineConfig,
    KVMemoryLimit,
    device_memory_bytes,
    full_rows_kv_bytes,
)
from replica.engine import ContinuousBatchingEngine
from scissorhands.testing import tiny_llama
from tests.suite_helpers import serving_suite, tiny_suite
from workloads import sweep
from workloads.core.suite import SuiteError
from workloads.frontier.suite import FrontierSuite
from workloads.kinds import load_suite
from workloads.serving.suite import ServingSuite

KNOBS = [k for k in EngineConfig.model_fields if k not in PER_POINT_FIELDS]
PAGED = serving_suite(
    name="knobs",
    dtype="float32",
    mode="concurrency",
    loads=[2],
    num_requests=2,
    compression_ratios=[5],
    prompt_tokens=40,
    new_tokens=10,
    kv_layout="paged",
    kv_memory_limit={"full_sequences": 3},
)


def _write(tmp_path: Path, data: dict) -> str:
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if v is not None}))
    return str(path)


# ----------------------------------------------------------------------------------------------- declared once
def test_every_engine_knob_is_a_suite_field_and_a_serve_flag_with_the_engines_default():
    """The knobs the front doors offer are EngineConfig's, not copies: a knob added to EngineConfig appears in each."""
    assert KNOBS == [
        "kv_memory_limit_bytes",
        "kv_memory_fraction",
        "kv_limit_full_sequences",
        "max_batch",
        "max_prefill_tokens",
        "kv_layout",
        "budget",
        "block_tokens",
        "scheduler",
        "max_num_batched_tokens",
        "engine",
        "openvino_kv_precision",
        "enable_prefix_caching",
        "kv_reuse",
    ]
    serving = {k for k in KNOBS if k in ServingSuite.model_fields}
    assert serving == set(KNOBS) - {"kv_limit_full_sequences"}  # spelled kv_memory_limit: {full_sequences: N}
    frontier = {k for k in KNOBS if k in FrontierSuite.model_fields}
    assert frontier == {
        "max_batch",
        "max_prefill_tokens",
        "block_tokens",
        "max_num_batched_tokens",
        "engine",
        "openvino_kv_precision",
    }
    flags = engine_knob_flags(argparse.ArgumentParser())
    assert set(flags) == set(KNOBS) - set(SERVE_SETS) == frontier | {"enable_prefix_caching", "kv_reuse"}
    for k in serving | frontier:
        suite_kind = ServingSuite if k in serving else FrontierSuite
        assert suite_kind.model_fields[k].default == EngineConfig.model_fields[k].default, k


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(kv_layout="blocks"), "kv_layout: expected one of preallocated, paged, got 'blocks'"),
        (dict(scheduler="fifo"), "scheduler: expected one of prefill_first, mixed, got 'fifo'"),
        (dict(block_tokens=0), "block_tokens: expected an integer >= 1, got 0"),
        (dict(max_num_batched_tokens=2.5), "max_num_batched_tokens: expected an integer >= 1, got 2.5"),
    ],
)
def test_a_bad_knob_in_a_suite_reads_as_the_engine_config_reads_it(tmp_path, change, message):
    with pytest.raises(SuiteError) as suite_error:
        load_suite(_write(tmp_path, {**PAGED, **change}))
    with pytest.raises(ConfigError) as config_error:
        EngineConfig(**change)
    assert message in str(suite_error.value) and message in str(config_error.value)


# ----------------------------------------------------------------------------------------------- at load, exit 2
@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(scheduler="mixed", kv_layout="preallocated"),
            "scheduler: 'mixed' feeds prompts in chunks that take KV blocks as they arrive; it needs kv_layout: "
            "'paged' (got 'preallocated')",
        ),
        (
            dict(scheduler="mixed", max_num_batched_tokens=8),
            "max_num_batched_tokens: 8 is below one block (block_tokens: 16); give at least 16",
        ),
        (dict(kv_memory_limit=None), "kv_layout: 'paged' sizes its block pool from kv_memory_limit"),
    ],
    ids=["mixed-preallocated", "budget-below-a-block", "paged-without-a-limit"],
)
def test_a_bad_combination_fails_the_whole_suite_at_load_with_exit_2(tmp_path, capsys, change, message):
    path = _write(tmp_path, {**PAGED, **change})
    assert sweep.main([path, "--results-dir", str(tmp_path / "results"), "--run-id", "r"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results").exists()  # no point ran, nothing recorded


def test_every_point_gets_a_typed_engine_config_read_by_attribute_and_dumped_as_a_mapping(tmp_path):
    suite = load_suite(_write(tmp_path, {**PAGED, "scheduler": "mixed", "max_num_batched_tokens": 64}))
    cfgs = [suite.engine_config(p) for p in suite.points()]
    assert all(isinstance(c, EngineConfig) for c in cfgs)
    assert [(c.policy, c.budget, c.scheduler, c.max_num_batched_tokens) for c in cfgs] == [
        ("full", "fixed", "mixed", 64),
        ("scissorhands", "fixed", "mixed", 64),
    ]
    assert cfgs[1].compression_ratio == 5 and EngineConfig(**cfgs[1].model_dump()) == cfgs[1]
    with pytest.raises(TypeError):  # not a mapping: a field is an attribute, `model_dump()` the mapping
        cfgs[0]["policy"]
    # what Ray does to a call's arguments: the same typed config arrives
    assert cloudpickle.loads(cloudpickle.dumps(cfgs[1])) == cfgs[1]


def test_a_generated_serve_flag_reaches_every_engine_and_a_bad_one_exits_2(monkeypatch, capsys):
    seen: dict = {}

    def fake(model, caches, **kw):
        seen.update(kw)
        raise ValueError("--cache: stopped here by the test")

    assert main(["--max-num-batched-tokens", "8"]) == 2  # the real app: refused before any model loads
    assert "max_num_batched_tokens: 8 is below one block (block_tokens: 16)" in capsys.readouterr().err
    monkeypatch.setattr(serve_app, "build_serve_app", fake)
    assert main(["--block-tokens", "32", "--max-num-batched-tokens", "64"]) == 2
    assert (seen["block_tokens"], seen["max_num_batched_tokens"], seen["max_batch"]) == (32, 64, None)


# ----------------------------------------------------------------------------------------------- the KV limit
@pytest.mark.parametrize(
    "limit, accepted",
    [
        ({}, "give exactly one of full_sequences"),
        ({"bytes": 10, "fraction": 0.5}, "give exactly one of full_sequences"),
        ({"fraction": 1.5}, "Input should be less than or equal to 1"),
        ({"fraction": 0}, "Input should be greater than 0"),
    ],
)
def test_a_bad_kv_limit_names_the_field_and_what_it_accepts(tmp_path, limit, accepted):
    with pytest.raises(SuiteError) as e:
        load_suite(_write(tmp_path, {**PAGED, "kv_memory_limit": limit}))
    assert str(e.value).startswith("kv_memory_limit") and accepted in str(e.value)


def test_a_fraction_limit_is_the_older_kv_memory_fraction_with_its_ids(tmp_path):
    older = load_suite(_write(tmp_path, {**PAGED, "kv_memory_limit": None, "kv_memory_fraction": 0.25}))
    typed = load_suite(_write(tmp_path, {**PAGED, "kv_memory_limit": {"fraction": 0.25}}))
    assert [p.point_id for p in older.points()] == [p.point_id for p in typed.points()]
    assert older.kv_limit == typed.kv_limit == KVMemoryLimit(fraction=0.25)
    for suite in (older, typed):
        cfg = suite.engine_config(suite.points()[0])
        assert [getattr(cfg, k) for k in KV_LIMIT_FIELDS] == [None, 0.25, None] and cfg.kv_limit == KVMemoryLimit(
            fraction=0.25
        )


def test_a_frontier_refuses_a_fraction_of_device_memory(tmp_path):
    data = tiny_suite("frontier", name="fr", compression_ratios=[4], prompt_tokens=24, new_tokens=8, replicas=1)
    with pytest.raises(SuiteError, match=r"kv_memory_limit: a frontier point states its limit as \{full_sequences"):
        load_suite(_write(tmp_path, {**data, "kv_memory_limit": {"fraction": 0.5}}))


@pytest.mark.parametrize(
    "limit, expected",
    [
        (dict(kv_memory_limit_bytes=100_000), lambda: 100_000),
        (dict(kv_memory_fraction=0.001), lambda: int(0.001 * psutil.virtual_memory().total)),
        (dict(kv_limit_full_sequences=3), lambda: 3 * 50 * 520),  # 3 rows x 50 slots x 520 B (float32)
    ],
    ids=["bytes", "fraction", "full_sequences"],
)
def test_each_form_of_the_limit_resolves_to_the_bytes_the_engine_uses(limit, expected):
    model = tiny_llama(0).to(torch.float32)
    cfg = EngineConfig(kv_layout="paged", max_length_tokens=50, **limit)
    resolved = cfg.kv_memory_limit_bytes_on(model, torch.device("cpu"))
    assert resolved == expected() == ContinuousBatchingEngine(model, cfg).kv_memory_limit_bytes  # the engine's
    assert EngineConfig(max_length_tokens=50).kv_memory_limit_bytes_on(model, torch.device("cpu")) is None


def test_the_kv_limit_helpers_the_engine_package_exports_are_the_typed_ones_with_known_values():
    model = tiny_llama(0).to(torch.float32)
    assert (engine.device_memory_bytes, engine.full_rows_kv_bytes) == (device_memory_bytes, full_rows_kv_bytes)
    assert device_memory_bytes(torch.device("cpu")) == psutil.virtual_memory().total
    assert full_rows_kv_bytes(model, 3, 50) == 3 * 50 * 520  # 520 B a float32 slot of the tiny model
    assert engine.full_batch_kv_limit_bytes(model, 3, 40, 10) == 3 * 50 * 520
    with pytest.raises(ValueError, match="length_tokens"):
        full_rows_kv_bytes(model, 3, 0)


def test_the_prefix_caching_serve_flag_reads_true_or_false_and_refuses_anything_else_naming_the_field(capsys):
    """`make serve` runs Scissorhands caches beside the full one, so prefix caching on is refused by the engine
    config before any model loads (exit 2, naming the field); a word that is no bool is refused the same way."""
    assert main(["--enable-prefix-caching", "yes"]) == 2
    assert "enable_prefix_caching: expected true or false, got 'yes'" in capsys.readouterr().err
    assert main(["--enable-prefix-caching", "TRUE"]) == 2
    assert "enable_prefix_caching: true shares the full cache's prompt blocks" in capsys.readouterr().err
