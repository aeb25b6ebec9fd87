"""bench/conditions.py: the conditions line every bench table starts with, and the flag vocabulary every bench
tool shares (comma-separated lists, one threads rule, defaults and run time in --help)."""

import argparse
import importlib
import re

import pytest
import torch

from bench import conditions

TOOLS = [
    "bench_cache",
    "bench_decode",
    "bench_prefill",
    "bench_quant",
    "bench_serving",
    "crosscheck",
    "gpu_bundle",
    "gpu_check",
    "roofline",
]


def test_conditions_line_names_date_commit_model_dtype_cpu_and_threads(monkeypatch):
    monkeypatch.setattr(conditions, "git_commit", lambda: "abc1234")
    torch.set_num_threads(1)
    line = conditions.conditions_line(model="embedded", dtype="float32 (no bfloat16 support)", extra="batch 8")
    assert re.match(
        r"Conditions: \d{4}-\d\d-\d\d \d\d:\d\d UTC, commit abc1234, model embedded, "
        r"dtype float32 \(no bfloat16 support\), CPU .+ \| \d+ CPUs \| flags: .* \| torch .+ \| threads: 1; "
        r"batch 8\.$",
        line,
    ), line


def test_git_commit_is_this_checkouts_short_hash_or_the_environment(monkeypatch, tmp_path):
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?|unknown", conditions.git_commit())
    monkeypatch.setattr(conditions, "REPO_ROOT", tmp_path)  # not a git checkout
    monkeypatch.setenv("SCISSORHANDS_GIT_COMMIT", "feedbee")
    assert conditions.git_commit() == "feedbee"


def _parser():
    return argparse.ArgumentParser(prog="tool")


def test_comma_list_casts_and_checks_each_item():
    assert conditions.comma_list(_parser(), "--batches", "1,4,16", cast=int) == [1, 4, 16]
    assert conditions.comma_list(_parser(), "--dtypes", "float32", valid=["float32", "bfloat16"]) == ["float32"]


@pytest.mark.parametrize(
    "text,cast,valid,says",
    [
        ("", str, None, "without empty items"),
        ("1,,2", int, None, "without empty items"),
        ("1,x", int, None, "'x' is not a valid int"),
        ("float64", str, ["float32"], "'float64'; valid: float32"),
    ],
)
def test_comma_list_errors_exit_2_naming_the_flag(text, cast, valid, says, capsys):
    with pytest.raises(SystemExit) as e:
        conditions.comma_list(_parser(), "--flag", text, cast=cast, valid=valid)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--flag" in err and says in err


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_help_gives_its_defaults_and_run_time(tool, capsys):
    module = importlib.import_module(f"bench.{tool}")
    entry = getattr(module, "parse_args", None) or module.main
    with pytest.raises(SystemExit) as e:
        entry(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "(default:" in out and "Run time" in out and f"python -m bench.{tool}" in out


@pytest.mark.parametrize(
    "tool", ["bench_cache", "bench_decode", "bench_prefill", "bench_quant", "bench_serving", "roofline"]
)
def test_threads_default_to_one_in_every_tool(tool, capsys):
    module = importlib.import_module(f"bench.{tool}")
    entry = getattr(module, "parse_args", None) or module.main
    with pytest.raises(SystemExit):
        entry(["--help"])
    assert re.search(r"--threads THREADS\s+torch threads; one rule for every bench tool", capsys.readouterr().out)
