"""Suite validation and expansion; bad input exits 2 naming the field and records nothing. No Ray."""

import json
import textwrap

import pytest
import yaml

import scissorhands
from replica import cpu_share
from tests.suite_helpers import tiny_batch
from workloads import sweep
from workloads.batch.report import COLUMNS, table_rows, warn_contention
from workloads.core.suite import SuiteError, tag_of
from workloads.kinds import KINDS, load_suite, parse_suite

GOOD = tiny_batch(name="t")


def test_smoke_suite_is_valid_and_expands():
    suite = load_suite("workloads/suites/smoke.yaml")
    points = suite.points()
    assert suite.model == "embedded" and suite.replicas >= 1
    assert {p.policy for p in points} == {"full", "scissorhands"}
    # full once per batch/prompt/new, scissorhands once per ratio
    per_shape = len(suite.batch_sizes) * len(suite.prompt_tokens) * len(suite.new_tokens)
    assert len(points) == per_shape * (1 + len(suite.compression_ratios))
    assert len({p.point_id for p in points}) == len(points)


def test_expansion_order_and_ids():
    points = parse_suite(dict(GOOD, budget_tokens=[30])).points()
    assert [tag_of(p.point_id) for p in points] == [
        "full-b1-p64-n16-s0",
        "scissorhands-r2-b1-p64-n16-s0",
        "scissorhands-r5-b1-p64-n16-s0",
        "scissorhands-B30-b1-p64-n16-s0",
        "full-b4-p64-n16-s0",
        "scissorhands-r2-b4-p64-n16-s0",
        "scissorhands-r5-b4-p64-n16-s0",
        "scissorhands-B30-b4-p64-n16-s0",
    ]
    assert [p.index for p in points] == list(range(8))
    assert points[1].spec().compression_ratio == 2.0 and points[3].spec().budget_tokens == 30


def test_policy_params_change_the_id():
    a = parse_suite(dict(GOOD, policies=[{"name": "scissorhands", "params": {"history_window": 200}}])).points()
    b = parse_suite(dict(GOOD, policies=["scissorhands"])).points()
    assert a[0].point_id != b[0].point_id and a[0].policy_params == {"history_window": 200}


BAD = [
    ({k: v for k, v in GOOD.items() if k != "kind"}, "kind"),  # every suite names its kind
    (dict(GOOD, kind="batches"), "kind"),  # ... one of the accepted ones
    (dict(GOOD, batch_size=[1]), "batch_size"),  # unknown key
    (dict(GOOD, batch_sizes=["four"]), "batch_sizes[0]"),  # wrong type
    (dict(GOOD, seed=True), "seed"),  # bool is not an int
    (dict(GOOD, compression_ratios=[0.5]), "compression_ratios[0]"),  # ratio < 1
    (dict(GOOD, policies=["full", "nope"]), "policies[1]"),  # unknown policy
    (
        dict(
            GOOD,
            policies=[{"name": "scissorhands", "params": {"recent_window": 10}}],
            compression_ratios=[],
            budget_tokens=[8],
        ),
        "budget_tokens[0]",
    ),  # budget < recent_window + 1
    (dict(GOOD, policies=[{"name": "scissorhands", "params": {"windw": 3}}]), "policies[0].params"),
    (dict(GOOD, policies=["scissorhands"], compression_ratios=[]), "compression_ratios"),
    ({k: v for k, v in GOOD.items() if k != "new_tokens"}, "new_tokens"),
    (dict(GOOD, device="tpu"), "device"),  # cpu, cuda or cuda:N
]


@pytest.mark.parametrize("data,field", BAD, ids=[b[1] for b in BAD])
def test_bad_suite_raises_naming_the_field(data, field):
    with pytest.raises(SuiteError) as e:
        parse_suite(data)
    assert field in str(e.value)


def test_unknown_policy_lists_valid_names():
    with pytest.raises(SuiteError) as e:
        parse_suite(dict(GOOD, policies=["nope"]))
    for name in scissorhands.POLICIES:
        assert name in str(e.value)


@pytest.mark.parametrize("data,field", BAD[:6], ids=[b[1] for b in BAD[:6]])
def test_cli_exits_2_and_records_nothing(tmp_path, capsys, data, field):
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(data))
    rc = sweep.main([str(path), "--results-dir", str(tmp_path / "results"), "--run-id", "r"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "error" in err and field in err
    assert not (tmp_path / "results").exists()


def test_cli_missing_suite_file(tmp_path, capsys):
    rc = sweep.main([str(tmp_path / "nowhere.yaml"), "--results-dir", str(tmp_path / "results")])
    assert rc == 2
    assert "suite: file not found" in capsys.readouterr().err and not (tmp_path / "results").exists()


def test_cli_invalid_yaml(tmp_path, capsys):
    path = tmp_path / "suite.yaml"
    path.write_text(
        textwrap.dedent("""\
        policies: [full
        batch_sizes: 1
    """)
    )
    assert sweep.main([str(path), "--results-dir", str(tmp_path / "results")]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_cli_resume_of_unknown_run(tmp_path, capsys):
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    assert sweep.main([str(path), "--results-dir", str(tmp_path / "results"), "--resume", "nope"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_contention_warning(capsys):
    """The batch sweep's warning reads the points' measured CPU share (`replica.cpu_share`: `contended`)."""
    rows = [dict(status="ok", contended=True, cpu_share=0.2), dict(status="ok", contended=False, cpu_share=0.95)]
    warn_contention(rows)
    err = capsys.readouterr().err
    assert "1 of 2 point(s) contended" in err and "waited for cores" in err and cpu_share.CONTENDED_RULE in err
    warn_contention([dict(status="ok", contended=False, cpu_share=0.95)])
    assert "warning" not in capsys.readouterr().err


def test_dtype_defaults_to_auto_and_rejects_unknown_values():

    assert parse_suite(GOOD).dtype == "auto" and parse_suite(dict(GOOD, dtype="bfloat16")).dtype == "bfloat16"
    with pytest.raises(SuiteError, match="dtype: expected one of auto, float32, bfloat16, float16, got 'fp16'"):
        parse_suite(dict(GOOD, dtype="fp16"))
    for path in ("workloads/suites/serving-rate.yaml", "workloads/suites/quality.yaml"):
        data = yaml.safe_load(open(path))
        assert data["dtype"] == "auto"
    serving = yaml.safe_load(open("workloads/suites/serving-rate.yaml"))
    assert parse_suite({k: v for k, v in serving.items() if k != "dtype"}).dtype == "auto"
    with pytest.raises(SuiteError, match="dtype: expected one of"):
        parse_suite(dict(serving, dtype="float64"))
    quality = yaml.safe_load(open("workloads/suites/quality.yaml"))
    assert parse_suite({k: v for k, v in quality.items() if k != "dtype"}).dtype == "auto"
    with pytest.raises(SuiteError, match="dtype: expected one of"):
        parse_suite(dict(quality, dtype="f32"))


def test_missing_or_unknown_kind_names_the_accepted_values():
    for data in ({k: v for k, v in GOOD.items() if k != "kind"}, dict(GOOD, kind="sweep")):
        with pytest.raises(SuiteError, match=rf"kind: .*\(accepted: {', '.join(KINDS)}\)"):
            parse_suite(data)


def test_every_shipped_suite_names_its_kind_and_loads(tmp_path):
    from pathlib import Path

    kinds = {}
    for path in sorted(Path("workloads/suites").glob("*.yaml")):
        kinds[path.name] = load_suite(str(path)).kind
        assert yaml.safe_load(path.read_text())["kind"] == kinds[path.name]
    assert kinds["smoke.yaml"] == "batch" and kinds["serving-rate.yaml"] == "serving"
    assert kinds["quality.yaml"] == "quality" and kinds["frontier.yaml"] == "frontier"


def test_point_id_covers_every_setting_that_changes_the_numbers():
    """two points differing only in one policy parameter, or only in dtype, differ in id."""
    base = parse_suite(dict(GOOD, policies=["scissorhands"], compression_ratios=[2], batch_sizes=[1])).points()
    window = parse_suite(
        dict(
            GOOD,
            policies=[{"name": "scissorhands", "params": {"recent_window": 4}}],
            compression_ratios=[2],
            batch_sizes=[1],
        )
    ).points()
    bf16 = parse_suite(
        dict(GOOD, dtype="bfloat16", policies=["scissorhands"], compression_ratios=[2], batch_sizes=[1])
    ).points()
    assert len({base[0].point_id, window[0].point_id, bf16[0].point_id}) == 3
    assert tag_of(base[0].point_id) == tag_of(bf16[0].point_id) == "scissorhands-r2-b1-p64-n16-s0"
    assert window[0].identity["policy_params"] == {"recent_window": 4} and bf16[0].identity["dtype"] == "bfloat16"
    # the same settings give the same id in every run (what --resume matches on)
    assert parse_suite(dict(GOOD, policies=["scissorhands"], compression_ratios=[2], batch_sizes=[1])).points() == base


def test_budget_formula_is_the_librarys():
    """B = ceil(L / r) is computed once, in the library; the suite checks use it with the policy, so a ratio's
    budget is raised to what an explicit window needs (ratio 5 of 80 tokens, recent_window 20: 21, not 16) and the
    suite is accepted, where an absolute budget below it is refused (BAD above)."""
    assert scissorhands.budget_from_ratio(80, 5) == 16 and scissorhands.budget_from_ratio(81, 5) == 17
    assert scissorhands.budget_from_ratio(3, 5) == 1
    params = {"recent_window": 20, "min_budget_tokens": 0}
    suite = parse_suite(dict(GOOD, policies=[{"name": "scissorhands", "params": params}]))
    assert scissorhands.budget_from_ratio(80, 5, suite.policies[0].policy) == 21


def _record_of(suite, point, status="ok"):
    from workloads.core import results

    return results.build_record(
        kind="batch", run_id="r", commit="c", suite=suite, point=point, status=status, metrics={"budget_tokens": 16}
    )


def test_resume_with_a_changed_dtype_exits_2_naming_the_field(tmp_path, capsys):
    """--resume of a batch suite whose dtype changed from float32 to bfloat16 refuses
    with exit status 2 naming the changed field, and runs nothing (no Ray is started)."""
    from workloads.core import results

    data = dict(GOOD, dtype="float32", policies=["full"], batch_sizes=[1])
    suite = parse_suite(data)
    run_dir = tmp_path / "results" / "r"
    run_dir.mkdir(parents=True)
    for point in suite.points():
        results.append_record(str(run_dir / "points.jsonl"), _record_of(suite, point))
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(dict(data, dtype="bfloat16")))
    rc = sweep.main([str(path), "--results-dir", str(tmp_path / "results"), "--resume", "r"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "changed field(s) ['dtype']" in err and "'float32' -> 'bfloat16'" in err
    assert len(results.read_records(str(run_dir / "points.jsonl"))) == 1  # nothing new recorded
    # the unchanged suite resumes: its one point is done, nothing to run
    path.write_text(yaml.safe_dump(data))
    assert sweep.main([str(path), "--results-dir", str(tmp_path / "results"), "--resume", "r"]) == 0
    assert "1 already done, 0 to run" in capsys.readouterr().err


def test_resume_of_points_recorded_without_the_budget_floor_exits_2_naming_the_parameter(tmp_path, capsys):
    """a point recorded before `min_budget_tokens` existed (its resolved params lack it) has the same id
    as today's point, so `changed_settings` sees nothing; the resume compares the recorded resolved policy
    parameters with this code's and refuses (exit 2, naming `min_budget_tokens`) rather than mix B formulas."""
    from workloads.core import results

    data = dict(GOOD, policies=["scissorhands"], batch_sizes=[1])
    suite = parse_suite(data)
    run_dir = tmp_path / "results" / "r"
    run_dir.mkdir(parents=True)
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(data))
    points_file = str(run_dir / "points.jsonl")
    for point in suite.points():
        record = _record_of(suite, point)
        assert record["policy_params"]["min_budget_tokens"] == 32
        results.append_record(points_file, record)
    # today's records resume: every point done, nothing to run
    assert sweep.main([str(path), "--results-dir", str(tmp_path / "results"), "--resume", "r"]) == 0
    assert "0 to run" in capsys.readouterr().err
    old = [
        dict(r, policy_params={k: v for k, v in r["policy_params"].items() if k != "min_budget_tokens"})
        for r in results.read_records(points_file)
    ]
    (run_dir / "points.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    rc = sweep.main([str(path), "--results-dir", str(tmp_path / "results"), "--resume", "r"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "policy_params" in err and "['min_budget_tokens']" in err and "None -> 32" in err
    assert len(results.read_records(points_file)) == len(old)  # nothing new recorded


def test_resume_where_auto_resolves_to_another_dtype_is_refused_naming_dtype(tmp_path):
    """a point's id covers the requested dtype, so a resumed run whose
    replicas now resolve auto to float32 while its recorded points ran in bfloat16 would mix the two:
    the record is refused (exit 2, naming dtype) and nothing is written; the same resolved dtype goes on."""
    from workloads.core import results
    from workloads.core.push import PointPublisher, SweepPusher
    from workloads.core.run import SweepError

    suite = parse_suite(dict(GOOD, dtype="auto", policies=["full"], batch_sizes=[1, 2]))
    first, second = suite.points()
    assert first.identity["dtype"] == second.identity["dtype"] == "auto"
    bf16 = {
        "dtype": "bfloat16",
        "dtype_reason": "auto: CPU has amx_bf16; bfloat16 1.40x float32's speed",
        "replica_id": "replica-0",
    }
    f32 = {
        "dtype": "float32",
        "dtype_reason": "auto: CPU has neither amx_bf16 nor avx512_bf16",
        "replica_id": "replica-1",
    }

    def record(point, replica, status="ok"):
        return results.build_record(
            kind="batch",
            run_id="r",
            commit="c",
            suite=suite,
            point=point,
            status=status,
            replica=replica,
            metrics={"budget_tokens": None},
        )

    path = str(tmp_path / "points.jsonl")
    results.append_record(path, record(first, bf16))
    publish = PointPublisher(path, SweepPusher("off", "r"), done=1, planned=2)
    with pytest.raises(SweepError) as refused:
        publish(record(second, f32))
    assert refused.value.code == 2
    assert "dtype: the suite's dtype 'auto' resolved to 'bfloat16'" in str(refused.value)
    assert "to 'float32' on replica replica-1" in str(refused.value)
    assert len(results.read_records(path)) == 1  # nothing written
    publish(record(second, None, status="error"))  # never reached a replica: nothing resolved, recorded
    publish(record(second, bf16))
    assert [(r["status"], r["dtype"]) for r in results.read_records(path)] == [
        ("ok", "bfloat16"),
        ("error", "auto"),
        ("ok", "bfloat16"),
    ]


def test_points_differing_in_one_parameter_have_their_own_table_rows():
    """the table tells apart two points that differ only in `recent_window: 4`."""
    from workloads.core import results

    data = dict(
        GOOD,
        policies=["scissorhands", {"name": "scissorhands", "params": {"recent_window": 4}}],
        compression_ratios=[2],
        batch_sizes=[1],
    )
    suite = parse_suite(data)
    records = [_record_of(suite, p) for p in suite.points()]
    rows = table_rows(records)
    assert [r["params_given"] for r in rows] == [None, "recent_window=4"]
    table = results.markdown_table(COLUMNS, rows).splitlines()
    assert len(table) == 4 and "recent_window=4" in table[3] and "recent_window" not in table[2]
    assert records[1]["policy_params"]["recent_window"] == 4 and records[0]["policy_params"]["recent_window"] is None


def test_a_trace_suite_takes_its_lengths_and_arrivals_from_the_trace(tmp_path):
    import json

    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"arrival_time_s": 0.5 * i, "prompt_tokens": 4 + i, "output_tokens": 2 + i}) + "\n"
            for i in range(3)
        )
    )
    data = dict(
        kind="serving", mode="trace", model="tiny-llama", policies=["full"], trace_path=str(trace), trace_time_scale=0.5
    )
    suite = parse_suite(data)
    assert (suite.prompt_tokens.min, suite.prompt_tokens.max, suite.new_tokens.max) == (4, 6, 4)
    [point] = suite.points()
    assert point.load == 0.5 and suite.load_config(point).trace_time_scale == 0.5
    with pytest.raises(SuiteError, match="loads: not used in mode trace"):
        parse_suite(dict(data, loads=[1]))
    with pytest.raises(SuiteError, match="trace_path"):
        parse_suite(dict(data, trace_path=str(tmp_path / "missing.csv")))


def test_save_figure_writes_a_whole_png_and_closes_the_figure(tmp_path):
    """One figure writer for the quality report and the serving plots: PNG via a temporary file and rename."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from workloads.core import results

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = results.save_figure(fig, tmp_path / "line.png", dpi=50)
    assert path == tmp_path / "line.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig.number not in plt.get_fignums()  # closed
    assert [p.name for p in tmp_path.iterdir()] == ["line.png"]  # no temporary file left


def test_policies_all_is_every_registered_policy_in_every_kind():
    """`policies: all` is read once (SuiteBase): every key of scissorhands.POLICIES; quality and frontier
    suites default to it, a batch suite must still name its policies."""
    from workloads.frontier.suite import FrontierSuite
    from workloads.quality.suite import QualitySuite

    batch = parse_suite(dict(GOOD, policies="all", compression_ratios=[2]))
    assert [p.name for p in batch.policies] == list(scissorhands.POLICIES)
    no_policies = {k: v for k, v in GOOD.items() if k != "policies"}
    with pytest.raises(SuiteError, match="policies"):
        parse_suite(no_policies)
    quality = QualitySuite.model_validate(
        dict(kind="quality", name="q", model="tiny-llama", compression_ratios=[2], perplexity={"windows": 1})
    )
    frontier = FrontierSuite.model_validate(dict(kind="frontier", name="f", model="tiny-llama", compression_ratios=[2]))
    assert [p.name for p in quality.policies] == [p.name for p in frontier.policies] == list(scissorhands.POLICIES)


def test_a_report_command_line_reads_the_run_and_prints_its_table(tmp_path, capsys):
    """The quality and frontier reports share one command line (workloads.core.results.report_main)."""
    from workloads.core import results
    from workloads.frontier import report as frontier_report
    from workloads.quality import report as quality_report

    assert quality_report.main([]) == 2 and "usage: python -m workloads.quality.report" in capsys.readouterr().err
    assert frontier_report.main([str(tmp_path)]) == 2
    assert f"workloads.frontier.report: no records in {tmp_path / 'points.jsonl'}" in capsys.readouterr().err
    suite = parse_suite(dict(GOOD, policies=["full"], batch_sizes=[1]))
    results.append_record(str(tmp_path / "points.jsonl"), _record_of(suite, suite.points()[0]))
    seen = []

    def write_report(run_dir, records):
        seen.append((run_dir, [r["point_id"] for r in records]))
        (run_dir / "table.md").write_text("| policy |\n|---|\n| full |\n")
        return results.Report("| policy |\n|---|\n| full |\n", (run_dir / "table.md",))

    assert results.report_main("x.report", write_report, [str(tmp_path)]) == 0
    assert seen == [(tmp_path, [suite.points()[0].point_id])]
    out, err = capsys.readouterr()
    assert out == "| policy |\n|---|\n| full |\n" and f"x.report: wrote {tmp_path / 'table.md'}" in err


def test_resume_with_a_suite_of_another_kind_or_name_exits_2_and_records_nothing(tmp_path, capsys):
    """A run folder holds one suite's points: resuming it with another kind's (or another name's) suite would
    mix two suites' points, table and plots."""
    run_dir = tmp_path / "results" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "points.jsonl").write_text("")
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r", "suite": {"kind": "quality", "name": "t"}}))
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    assert sweep.main([str(path), "--results-dir", str(tmp_path / "results"), "--resume", "r", "--local"]) == 2
    assert "--resume: kind: run 'r' was made by a 'quality' suite, not 'batch'" in capsys.readouterr().err
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r", "suite": {"kind": "batch", "name": "other"}}))
    assert sweep.main([str(path), "--results-dir", str(tmp_path / "results"), "--resume", "r", "--local"]) == 2
    assert "--resume: name: run 'r' was made by a 'other' suite, not 't'" in capsys.readouterr().err
    assert (run_dir / "points.jsonl").read_text() == "" and not (run_dir / "table.md").exists()
