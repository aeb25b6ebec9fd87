"""Quality suites: validation, expansion into points, the runner (local and on Ray replicas), resume, report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from scissorhands import POLICIES
from tests.ray_helpers import local_ray
from tests.suite_helpers import tiny_suite
from workloads.core import results as res
from workloads.core.suite import SuiteError
from workloads.kinds import load_suite, parse_suite
from workloads.quality import runner

SUITES = Path(__file__).resolve().parents[2] / "workloads" / "suites"
#: A Ray `runtime_env` whose workers import this checkout.
THIS_CHECKOUT = {"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}}

TINY = tiny_suite(
    "quality",
    name="tiny",
    compression_ratios=[1, 3],
    perplexity={"tokens": 48, "windows": 1},
    fewshot={"tasks": ["copa"], "docs": 2},
    persistence={"tokens": 32, "windows": 1},
    replicas=2,
)


def test_shipped_quality_suites_are_valid():
    files = sorted(SUITES.glob("quality*.yaml"))
    assert files, "no quality suite shipped"
    for f in files:
        suite = load_suite(str(f))
        ids = [p.point_id for p in suite.points()]
        assert len(ids) == len(set(ids)), f"{f.name}: duplicate point ids"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"kind": "throughput"}, "kind"),
        ({"policies": ["nope"]}, "policies[0]"),
        ({"policies": [{"name": "scissorhands", "params": {"history_window": 0}}]}, "policies[0].params"),
        ({"compression_ratios": [0.5]}, "compression_ratios[0]"),
        ({"quantized": [{"compression_ratio": 5}]}, "quantized[0]"),
        ({"perplexity": {"tokens": 1}}, "perplexity.tokens"),
        ({"perplexity": {"tokenz": 5}}, "perplexity"),
        ({"fewshot": {"tasks": ["mathqa"]}}, "fewshot.tasks[0]"),
        ({"persistence": {"split_fraction": 1.5}}, "persistence.split_fraction"),
        ({"fewshot": {"tasks": ["copa"], "docs": {"piqa": 3}}}, "fewshot.docs"),
        ({"fewshot": {"tasks": ["copa", "piqa"], "docs": {"copa": 3}}}, "fewshot.docs"),
        ({"batch_sizes": [1]}, "batch_sizes: unknown key"),
    ],
)
def test_invalid_suites_name_the_field(change, field):
    with pytest.raises(SuiteError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_suite({**TINY, **change})


def test_points_cover_every_policy_and_ratio():
    suite = parse_suite(
        {
            **TINY,
            "policies": "all",
            "compression_ratios": [1, 2, 5],
            "quantized": [{"compression_ratio": 5, "kv_bits": 4}],
        }
    )
    ppl = [p for p in suite.points() if p.kind == "perplexity"]
    evicting = [n for n in POLICIES if n != "full"]
    assert {(p.policy, p.compression_ratio, p.kv_bits) for p in ppl} == (
        {("full", 1.0, None), ("full", 1.0, 4)}
        | {(n, r, None) for n in evicting for r in (1.0, 2.0, 5.0)}
        | {(n, 5.0, 4) for n in evicting}
    )
    few = [p for p in suite.points() if p.kind == "fewshot"]
    assert len(few) == len(ppl) and {p.task for p in few} == {"copa"}
    assert [p.kind for p in suite.points()][len(ppl)] == "persistence"
    per_task = parse_suite(
        {**TINY, "fewshot": {"tasks": ["copa", "piqa"], "docs": {"copa": 20, "piqa": 8}, "compression_ratios": [3]}}
    )
    few = [p for p in per_task.points() if p.kind == "fewshot"]
    assert {(p.task, p.settings["docs"]) for p in few} == {("copa", 20), ("piqa", 8)}
    assert {(p.policy, p.compression_ratio) for p in few} == {("full", 1.0), ("scissorhands", 3.0)}


def _write(tmp_path, data) -> str:
    path = tmp_path / "suite.yaml"
    import yaml

    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_local_run_records_points_resumes_and_reports(tmp_path, monkeypatch):
    suite = _write(tmp_path, TINY)
    out = tmp_path / "results"
    assert runner.main([suite, "--local", "--pushgateway", "off", "--results-dir", str(out), "--run-id", "r1"]) == 0
    recs = res.read_records(str(out / "r1" / "points.jsonl"))
    assert len(recs) == 7 and all(r["status"] == "ok" for r in recs)  # 3 ppl + 3 fewshot + 1 persistence
    for r in recs:
        assert r["schema_version"] == res.SCHEMA_VERSION and r["git_commit"] and r["model_id"] == "tiny-llama"
    ppl = {(r["policy"], r["compression_ratio"]): r for r in recs if r["evaluation"] == "perplexity"}
    assert ppl[("scissorhands", 1.0)]["perplexity"] == pytest.approx(ppl[("full", 1.0)]["perplexity"], rel=1e-6)
    assert ppl[("scissorhands", 3.0)]["budget_tokens"] == 32  # ceil(48 / 3) = 16, raised to the budget floor
    assert ppl[("scissorhands", 3.0)]["policy_params"]["effective_drop_tokens"] == 16
    assert ppl[("scissorhands", 3.0)]["policy_params"]["min_budget_tokens"] == 32
    few = [r for r in recs if r["evaluation"] == "fewshot"]
    assert all(r["docs_scored"] == 2 for r in few)
    table = (out / "r1" / "table.md").read_text()
    assert "Perplexity" in table and "copa" in table and "Persistence ratio per layer" in table
    for png in ("perplexity.png", "accuracy.png", "persistence.png"):
        assert (out / "r1" / png).stat().st_size > 1000
    # resume: nothing left to run, the file is unchanged
    size = os.path.getsize(out / "r1" / "points.jsonl")
    assert runner.main([suite, "--local", "--pushgateway", "off", "--results-dir", str(out), "--resume", "r1"]) == 0
    assert os.path.getsize(out / "r1" / "points.jsonl") == size
    # a failed point is recorded as an error and the run exits 1 (injected: a ratio's budget is raised to what the
    # policy's windows need, so no suite setting fails at run time any more)
    real = runner.run_point

    def failing(model, tokenizer, point):
        if point.policy == "scissorhands":
            raise ValueError("recent_window: an injected failure")
        return real(model, tokenizer, point)

    monkeypatch.setattr(runner, "run_point", failing)
    bad = _write(
        tmp_path,
        {**TINY, "name": "bad", "fewshot": None, "persistence": None, "policies": [{"name": "scissorhands"}]},
    )
    assert runner.main([bad, "--local", "--pushgateway", "off", "--results-dir", str(out), "--run-id", "r2"]) == 1
    errors = [r for r in res.read_records(str(out / "r2" / "points.jsonl")) if r["status"] == "error"]
    assert errors and "recent_window" in errors[0]["error"]


def test_invalid_suite_exits_2_and_records_nothing(tmp_path, capsys):
    suite = _write(tmp_path, {**TINY, "compression_ratios": [0]})
    assert runner.main([suite, "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "out")]) == 2
    assert "compression_ratios[0]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.ray
def test_points_run_on_ray_replicas_and_match_local(tmp_path):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

    data = {**TINY, "fewshot": None, "persistence": None, "dtype": "float32"}  # each run resolves `auto` itself
    suite = _write(tmp_path, data)
    with local_ray(runtime_env=THIS_CHECKOUT):
        assert (
            runner.main(
                [
                    suite,
                    "--pushgateway",
                    "off",
                    "--results-dir",
                    str(tmp_path / "ray"),
                    "--run-id",
                    "d",
                    "--replicas",
                    "2",
                ]
            )
            == 0
        )
    assert (
        runner.main([suite, "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "loc"), "--run-id", "l"])
        == 0
    )
    dist = {r["point_id"]: r for r in res.read_records(str(tmp_path / "ray" / "d" / "points.jsonl"))}
    local = {r["point_id"]: r for r in res.read_records(str(tmp_path / "loc" / "l" / "points.jsonl"))}
    assert set(dist) == set(local) and len(dist) == 3
    assert all(r["replica_id"].startswith("quality-") and r["ray_nodes"] for r in dist.values())
    for pid, r in dist.items():
        assert r["perplexity"] == pytest.approx(local[pid]["perplexity"], rel=1e-6)
    json.dumps(list(dist.values()), allow_nan=False)


@pytest.mark.ray
def test_a_replica_that_dies_fails_its_point_and_is_replaced(tmp_path, monkeypatch):
    """The quality runner shares the sweep's dispatch loop (workloads.core.dispatch.dispatch_points): the replica
    running the first point dies (its process exits; no retry: max_task_retries 0), that point is recorded
    as `replica died`, Serve's new replica runs the other two points; exit 1 (a point failed).
    Before the shared loop the dead replica was never replaced and the run stopped with 2 points not run."""

    from workloads.quality import points as quality_points

    real_run_point = quality_points.run_point

    def dies_on_full(model, tokenizer, point):
        if point.policy == "full":
            os._exit(1)
        return real_run_point(model, tokenizer, point)

    monkeypatch.setattr(runner, "run_point", dies_on_full)
    suite = _write(
        tmp_path,
        {
            **TINY,
            "fewshot": None,
            "persistence": None,
            "replicas": 1,
            "placement": {"max_restarts": 0, "max_task_retries": 0, "ready_timeout_s": 120},
        },
    )
    with local_ray(runtime_env=THIS_CHECKOUT):
        rc = runner.main([suite, "--pushgateway", "off", "--results-dir", str(tmp_path), "--run-id", "dies"])
    recs = sorted(res.read_records(str(tmp_path / "dies" / "points.jsonl")), key=lambda r: r["point_index"])
    assert rc == 1
    assert [(r["policy"], r["status"]) for r in recs] == [
        ("full", "error"),
        ("scissorhands", "ok"),
        ("scissorhands", "ok"),
    ]
    assert recs[0]["error"].startswith("replica died: ") and recs[0]["replica_id"] is None  # its call died with it
    (new_replica,) = {r["replica_id"] for r in recs[1:]}
    assert new_replica.startswith("quality-") and all(r["perplexity"] > 1 for r in recs[1:])


def test_each_point_is_pushed_like_a_sweep_point(tmp_path, monkeypatch):
    import workloads.core.template

    pushed, progress = [], []

    class Recorder:
        def __init__(self, url, run_id):
            assert url == "127.0.0.1:1" and run_id == "p"

        def push_point(self, rec):
            pushed.append(rec)
            return True

        def push_progress(self, done, total):
            progress.append((done, total))
            return True

    monkeypatch.setattr(workloads.core.template, "SweepPusher", Recorder)
    suite = _write(tmp_path, {**TINY, "fewshot": None, "persistence": None})
    assert (
        runner.main([suite, "--local", "--pushgateway", "127.0.0.1:1", "--results-dir", str(tmp_path), "--run-id", "p"])
        == 0
    )
    assert [r["policy"] for r in pushed] == ["full", "scissorhands", "scissorhands"]
    assert all(r["perplexity"] > 1 for r in pushed) and progress == [
        (0, 3),
        (1, 3),
        (2, 3),
        (3, 3),
    ]  # 0 / planned before the first point
