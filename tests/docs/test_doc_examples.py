"""Every YAML and Python example in README.md and docs/*.md runs (dated pages in docs/results/ are records, not
examples): YAML suites go through the one suite loader, Python blocks either run here or are listed in `ELSEWHERE`
/ `NOT_RUN` with the reason; a block that is neither fails, so a new example cannot go untested."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import yaml

from workloads.kinds import load_suite

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

# Python blocks another test runs, by their first line: (page, first line) -> the test that runs it.
ELSEWHERE = {
    ("README.md", "from scissorhands import make_cache"): "tests/scissorhands/test_standalone.py",
    ("docs/serving-http.md", "from openai import OpenAI"): "tests/cluster/test_serve_app_openai.py",
}
# Python blocks that cannot run in a test, by their first line -> why. Their syntax and imports are still checked.
NOT_RUN = {
    (
        "docs/gpu.md",
        "from scissorhands.models import load_dummy_model, tiny_overrides",
    ): "allocates an 8B-parameter model on a CUDA device",
}
# Python blocks run here as written (in a fresh folder, as a reader would), by their first line: each leaves the
# point's metrics in `m` (`workloads.load.metrics.PointMetrics`), every measured request completed.
RUN_HERE = {("docs/load-generation.md", "import asyncio")}
# YAML blocks that are a fragment of a suite: merged over this suite file before loading.
FRAGMENT_BASE = {("docs/cluster.md", "replicas: 4"): "workloads/suites/smoke.yaml"}


def _blocks(lang: str) -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m.group(1) == lang:
                found.append((str(page.relative_to(ROOT)), text[: m.start()].count("\n") + 1, m.group(2)))
    return found


def _first_line(code: str) -> str:
    return next(line for line in code.splitlines() if line.strip() and not line.startswith("#"))


def _load_suite():
    """The one front door of every suite kind."""
    return load_suite


PYTHON = _blocks("python")
YAML = _blocks("yaml")


def test_the_pages_have_examples_to_check():
    assert len(PYTHON) >= 4 and len(YAML) >= 3


@pytest.mark.parametrize("page,line,code", YAML, ids=[f"{p}:{n}" for p, n, _ in YAML])
def test_yaml_example_is_a_valid_suite(page, line, code, tmp_path, monkeypatch):
    data = yaml.safe_load(code)
    base = FRAGMENT_BASE.get((page, _first_line(code)))
    if base:
        data = {**yaml.safe_load((ROOT / base).read_text(encoding="utf-8")), **data}
    if data.get("trace_path"):
        # the trace a replay suite names, relative to the folder the sweep runs in: a small one in the Azure layout
        trace = tmp_path / data["trace_path"]
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text(
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,120,30\n"
            "2023-11-16 18:15:47.1000000,200,16\n2023-11-16 18:15:48.0000000,64,48\n"
        )
        monkeypatch.chdir(tmp_path)
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    suite = _load_suite()(str(path))
    assert suite.kind == data.get("kind", "batch")
    assert suite.name == data.get("name", suite.name)


@pytest.mark.parametrize("page,line,code", PYTHON, ids=[f"{p}:{n}" for p, n, _ in PYTHON])
def test_python_example_compiles_and_its_imports_resolve(page, line, code):
    tree = ast.parse(code, filename=f"{page}:{line}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] != "openai":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{page}:{line}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "openai":
                    importlib.import_module(alias.name)


@pytest.mark.parametrize("page,line,code", PYTHON, ids=[f"{p}:{n}" for p, n, _ in PYTHON])
def test_python_example_is_run_here_or_elsewhere_or_excluded_with_a_reason(page, line, code, tmp_path, monkeypatch):
    key = (page, _first_line(code))
    if key in RUN_HERE:
        monkeypatch.chdir(tmp_path)
        namespace: dict = {"__name__": "__main__"}
        exec(compile(code, f"{page}:{line}", "exec"), namespace)  # the page's own example, as written
        m = namespace["m"]
        assert m.completed_requests == m.sent_requests > 0 and m.failed_requests == 0, f"{page}:{line}"
        assert m.output_throughput_tok_per_s > 0 and m.stop_reason == "count"
        return
    if key in ELSEWHERE:
        test_file = ROOT / ELSEWHERE[key]
        assert test_file.is_file(), f"{page}:{line}: {ELSEWHERE[key]} is gone"
        return
    assert key in NOT_RUN, (
        f"{page}:{line}: a new Python example: run it in tests/docs/test_doc_examples.py, "
        f"or list it in ELSEWHERE or NOT_RUN with the reason"
    )
    assert NOT_RUN[key]
