"""Every suite kind refuses, when it loads for a run, sequences (prompt + output) longer than the model's context:
exit 2 naming the fields, their total and the context, before a run folder exists."""

from __future__ import annotations

import pytest
import yaml

from workloads import sweep
from workloads.core.run import SweepError, check_model_context, model_context_tokens
from workloads.kinds import parse_suite

SUITES = {
    "batch": dict(batch_sizes=[1], prompt_tokens=[500], new_tokens=[20], compression_ratios=[2]),
    "serving": dict(
        mode="serving-batch",
        loads=[1],
        prompt_tokens={"dist": "uniform", "min": 100, "max": 500},
        new_tokens=20,
        num_requests=2,
        compression_ratios=[2],
    ),
    "frontier": dict(prompt_tokens=500, new_tokens=20, kv_memory_limit={"full_sequences": 2}, compression_ratios=[4]),
}


@pytest.mark.parametrize("kind", list(SUITES))
def test_a_suite_longer_than_the_models_context_exits_2_naming_the_fields_and_the_context(kind, tmp_path, capsys):
    path = tmp_path / "long.yaml"
    data = dict(kind=kind, name="long", model="tiny-llama", policies=["full", "scissorhands"], replicas=1)
    path.write_text(yaml.safe_dump({**data, **SUITES[kind]}))
    results = tmp_path / "r"
    assert sweep.main([str(path), "--local", "--results-dir", str(results), "--pushgateway", "off"]) == 2
    err = capsys.readouterr().err
    assert "prompt_tokens" in err and "new_tokens" in err and "520 tokens" in err and "(512 tokens)" in err
    assert not results.exists() or not any(results.iterdir())  # nothing recorded


def test_a_suite_that_fits_the_context_or_drives_a_server_passes():
    fits = parse_suite(
        dict(kind="batch", name="b", model="tiny-llama", policies=["full"], batch_sizes=[1], prompt_tokens=[492],
             new_tokens=[20])
    )  # fmt: skip
    check_model_context(fits)  # 512 tokens: exactly the context
    served = parse_suite(
        dict(kind="serving", name="s", model="served-id", target="http://127.0.0.1:1/v1", policies=["full"],
             mode="concurrency", loads=[1], prompt_tokens=5000, new_tokens=20, num_requests=1)
    )  # fmt: skip
    check_model_context(served)  # the server applies its own context (a 400 per request)
    with pytest.raises(SweepError, match="exceeds the context") as e:
        check_model_context(fits.model_copy(update={"new_tokens": (21,)}))
    assert e.value.code == 2
    assert model_context_tokens("/no/such/model") is None  # the replicas name the missing path themselves


@pytest.mark.slow
def test_the_embedded_models_context_is_read_from_its_config():
    assert model_context_tokens("embedded") == 8192


def test_a_quality_suite_longer_than_the_models_context_exits_2_naming_the_section(tmp_path, capsys):
    path = tmp_path / "long-quality.yaml"
    data = dict(kind="quality", name="q", model="tiny-llama", policies=["full"], replicas=1, compression_ratios=[1])
    path.write_text(yaml.safe_dump({**data, "passkey": {"lengths": [256, 600], "depths": [0.5], "trials": 1}}))
    assert sweep.main([str(path), "--local", "--results-dir", str(tmp_path / "r"), "--pushgateway", "off"]) == 2
    err = capsys.readouterr().err
    assert "passkey.lengths (at most 600) + its answer" in err and "606 tokens" in err and "(512 tokens)" in err
    ok = parse_suite(
        {**data, "perplexity": {"tokens": 256}, "passkey": {"lengths": [256], "depths": [0.5], "trials": 1}}
    )
    assert ok.context_lengths() == [
        ("perplexity.tokens (256)", 256),
        ("passkey.lengths (at most 256) + its answer", 262),
    ]
