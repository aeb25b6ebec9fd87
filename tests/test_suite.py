"""Suite validation and expansion; bad input exits 2 naming the field and records nothing. No Ray."""

import textwrap

import pytest
import yaml

import scissorhands
from workloads import sweep
from workloads.suite import SuiteError, load_suite, parse_suite

GOOD = dict(
    name="t", model="tiny-llama", policies=["full", "scissorhands"], compression_ratios=[2, 5],
    batch_sizes=[1, 4], prompt_tokens=[64], new_tokens=[16], seed=0, replicas=2,
)


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
    assert [p.point_id for p in points] == [
        "full-b1-p64-n16-s0", "scissorhands-r2-b1-p64-n16-s0", "scissorhands-r5-b1-p64-n16-s0",
        "scissorhands-B30-b1-p64-n16-s0",
        "full-b4-p64-n16-s0", "scissorhands-r2-b4-p64-n16-s0", "scissorhands-r5-b4-p64-n16-s0",
        "scissorhands-B30-b4-p64-n16-s0",
    ]
    assert [p.index for p in points] == list(range(8))
    assert points[1].as_dict()["compression_ratio"] == 2.0 and points[3].as_dict()["budget_tokens"] == 30


def test_policy_params_change_the_id():
    a = parse_suite(dict(GOOD, policies=[{"name": "scissorhands", "params": {"history_window": 200}}])).points()
    b = parse_suite(dict(GOOD, policies=["scissorhands"])).points()
    assert a[0].point_id != b[0].point_id and a[0].policy_params == {"history_window": 200}


BAD = [
    (dict(GOOD, batch_size=[1]), "batch_size"),                                  # unknown key
    (dict(GOOD, batch_sizes=["four"]), "batch_sizes[0]"),                        # wrong type
    (dict(GOOD, seed=True), "seed"),                                             # bool is not an int
    (dict(GOOD, compression_ratios=[0.5]), "compression_ratios[0]"),             # ratio < 1
    (dict(GOOD, policies=["full", "nope"]), "policies[1]"),                      # unknown policy
    (dict(GOOD, policies=[{"name": "scissorhands", "params": {"recent_window": 10}}], compression_ratios=[],
          budget_tokens=[8]), "budget_tokens[0]"),                               # budget < recent_window + 1
    (dict(GOOD, policies=[{"name": "scissorhands", "params": {"recent_window": 20}}]),
     "compression_ratios[1]"),                                                   # ratio 5 of 80 tokens -> B=16 < 21
    (dict(GOOD, policies=[{"name": "scissorhands", "params": {"windw": 3}}]), "policies[0].params"),
    (dict(GOOD, policies=["scissorhands"], compression_ratios=[]), "compression_ratios"),
    ({k: v for k, v in GOOD.items() if k != "new_tokens"}, "new_tokens"),
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
    path.write_text(textwrap.dedent("""\
        policies: [full
        batch_sizes: 1
    """))
    assert sweep.main([str(path), "--results-dir", str(tmp_path / "results")]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_cli_resume_of_unknown_run(tmp_path, capsys):
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    assert sweep.main([str(path), "--results-dir", str(tmp_path / "results"), "--resume", "nope"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_contention_warning(capsys):
    rows = [dict(status="ok", process_cpu_s=2.0, e2e_latency_s=10.0, torch_threads=1)]
    sweep._warn_contention(rows)
    err = capsys.readouterr().err
    assert "2 CPU-s in 10 s" in err and "20% of their torch threads" in err and "waited for cores" in err
    sweep._warn_contention([dict(status="ok", process_cpu_s=9.5, e2e_latency_s=10.0, torch_threads=1)])
    assert "warning" not in capsys.readouterr().err


def test_dtype_defaults_to_auto_and_rejects_unknown_values():
    from workloads.quality.suite import QualitySuiteError
    from workloads.quality.suite import parse_suite as parse_quality
    from workloads.serving_suite import parse_serving_suite

    assert parse_suite(GOOD).dtype == "auto" and parse_suite(dict(GOOD, dtype="bfloat16")).dtype == "bfloat16"
    with pytest.raises(SuiteError, match="dtype: expected one of auto, float32, bfloat16, float16, got 'fp16'"):
        parse_suite(dict(GOOD, dtype="fp16"))
    for path in ("workloads/suites/serving-rate.yaml", "workloads/suites/quality.yaml"):
        data = yaml.safe_load(open(path))
        assert data["dtype"] == "auto"
    serving = yaml.safe_load(open("workloads/suites/serving-rate.yaml"))
    assert parse_serving_suite({k: v for k, v in serving.items() if k != "dtype"}).dtype == "auto"
    with pytest.raises(SuiteError, match="dtype: expected one of"):
        parse_serving_suite(dict(serving, dtype="float64"))
    quality = yaml.safe_load(open("workloads/suites/quality.yaml"))
    assert parse_quality({k: v for k, v in quality.items() if k != "dtype"}).dtype == "auto"
    with pytest.raises(QualitySuiteError, match="dtype: expected one of"):
        parse_quality(dict(quality, dtype="f32"))
