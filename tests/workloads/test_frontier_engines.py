"""The frontier with an engine backend as a policy axis (``{name: full, engine: openvino}`` beside ours): the suite's
points and its refusals at load, the OpenVINO rows' capacity search on a stub backend (tests/peer_stub.py) on the same
requests as ours, with no perplexity (the backend gives no log-likelihoods), and the report's table, headline and plot
saying so instead of a number."""

from __future__ import annotations

import warnings

import pytest
import yaml

from replica.backends import openvino as ovb
from tests import peer_stub
from tests.suite_helpers import tiny_suite
from workloads.core import results as res
from workloads.core.suite import SuiteError
from workloads.frontier import runner
from workloads.frontier.report import NO_PERPLEXITY_GID, figure, frontier_rows, markdown
from workloads.frontier.suite import NO_PERPLEXITY
from workloads.kinds import parse_suite
from workloads.serving.suite import ServingSuite

OV_FULL = {"name": "full", "engine": "openvino"}
OV_EVICT = {"name": "openvino_eviction", "engine": "openvino", "params": {"start_size": 32, "recent_size": 32}}
BASE = tiny_suite(
    "frontier",
    name="peer",
    dtype="float32",
    compression_ratios=[4],
    prompt_tokens=24,
    new_tokens=8,
    replicas=1,
    seed=0,
    perplexity_windows=2,
    policies=["full", "scissorhands", OV_FULL, OV_EVICT],
    # 2 rates; an SLO the tiny model meets on any CPU, the stub misses above its rate by answering 2 s late
    capacity={"min_rate_req_per_s": 50.0, "max_rate_req_per_s": 100.0, "resolution": 1.0},
    slo={"ttft_s": 1.0, "tpot_s": 60.0},
    num_requests=4,
)


def test_an_engine_in_a_policy_entry_is_a_point_of_its_own_on_the_same_search_and_ours_keep_their_ids():
    suite = parse_suite(BASE)
    points = suite.points()
    assert [(p.policy, p.compression_ratio, p.engine, p.scores_perplexity) for p in points] == [
        ("full", None, "ours", True),
        ("scissorhands", 4.0, "ours", True),
        ("full", None, "openvino", False),
        ("openvino_eviction", 4.0, "openvino", False),
    ]
    ours_only = parse_suite({**BASE, "policies": ["full", "scissorhands"]}).points()
    assert [p.point_id for p in points[:2]] == [p.point_id for p in ours_only]
    assert points[2].point_id.startswith("frontier-openvino-full-p24-n8-f2-cap-w2-s0-")
    searches = [ServingSuite.model_validate(p.capacity_suite) for p in points]
    # one search for every row (grid, SLO, requests, limit), each on its own backend
    assert {s.capacity.grid() for s in searches} == {(50.0, 100.0)}
    assert {(s.num_requests, s.kv_limit.full_sequences, s.slo.ttft_s) for s in searches} == {(4, 2, 1.0)}
    configs = [s.engine_config(s.points()[0]) for s in searches]
    assert [(c.engine, c.policy, c.budget) for c in configs] == [
        ("ours", "full", "fixed"),
        ("ours", "scissorhands", "per_request"),
        ("openvino", "full", "fixed"),
        ("openvino", "openvino_eviction", "fixed"),  # one max_cache_size for every sequence
    ]
    assert configs[3].compression_ratio == 4.0 and configs[3].max_length_tokens == 32
    # the same requests and arrivals at a rate: the workload seed is the suite's, not the series'
    assert len({s.workload_seed(s.points()[0]) for s in searches}) == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"policies": [{"name": "scissorhands", "engine": "openvino"}]},
            r"^policies\[0\]\.name: engine 'openvino' runs full, openvino_eviction, not 'scissorhands' .*"
            r"\(row openvino-scissorhands\)",
        ),
        (
            {"policies": ["full", {"name": "openvino_eviction", "engine": "openvino", "params": {"window": 4}}]},
            r"^policies\[1\]\.params: openvino_eviction takes no window; accepted: aggregation_mode, "
            r"start_size, recent_size, max_cache_size",
        ),
        (
            {"policies": [{**OV_EVICT, "params": {"aggregation_mode": "MAX"}}]},
            r"^policies\[0\]\.params\.aggregation_mode: 'MAX'; accepted: SUM, NORM_SUM",
        ),
        (
            {"policies": [{**OV_EVICT, "params": {"max_cache_size": 100}}]},
            r"^policies\[0\]\.params\.max_cache_size: 100 is not a multiple of the KV block \(32 tokens\)",
        ),
        (
            {"policies": ["openvino_eviction"]},
            r"^policies\[0\]\.name: 'openvino_eviction' runs on engine: openvino only",
        ),
        (
            {"policies": [{"name": "full", "engine": "vllm"}]},
            r"policies\[0\]\.engine: expected one of ours, openvino, got 'vllm'",
        ),
        (
            {
                "throughput": "max_batch",
                "policies": ["full", OV_FULL],
                "capacity": None,
                "slo": None,
                "num_requests": None,
            },
            r"policies\[1\]\.engine: 'openvino' runs with throughput: capacity only .*accepted with throughput: "
            r"max_batch: ours",
        ),
        (  # the suite's engine runs every entry that names none
            {"engine": "openvino"},
            r"^policies\[1\]\.name: engine 'openvino' runs full, openvino_eviction, not 'scissorhands'",
        ),
        ({"openvino_kv_precision": "f16"}, r"openvino_kv_precision: expected one of u8, bf16, got 'f16'"),
    ],
)
def test_a_policy_or_parameter_the_backend_cannot_run_fails_the_frontier_suite_naming_the_field(change, message):
    doc = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(SuiteError, match=message):
        parse_suite(doc)


def test_make_frontier_exits_2_before_any_point_on_a_row_its_backend_cannot_run_or_without_the_runtime(
    tmp_path, monkeypatch, capsys
):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**BASE, "policies": ["full", {"name": "tova", "engine": "openvino"}]}))
    argv = ["--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r"), "--run-id", "run"]
    assert runner.main([str(bad), *argv]) == 2
    assert "policies[1].name: engine 'openvino' runs full, openvino_eviction, not 'tova'" in capsys.readouterr().err

    def absent(model):
        raise ovb.BackendUnavailable("engine: 'openvino' needs the openvino-genai runtime (make openvino-runtime)")

    monkeypatch.setattr("workloads.core.run.check_openvino", absent)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(BASE))
    assert runner.main([str(good), *argv]) == 2
    assert "make openvino-runtime" in capsys.readouterr().err and not (tmp_path / "r" / "run").exists()


def test_the_openvino_rows_search_the_same_requests_as_ours_and_are_reported_without_perplexity_or_gate(
    tmp_path, monkeypatch
):
    """``make frontier --local`` on the tiny model with the stub as OpenVINO's backend: it passes 50 req/s and misses
    100 (2 s late over a 1 s TTFT), so its rows have capacity 50; ours passes both (at least 100)."""
    stub = peer_stub.install(monkeypatch, passes_up_to=50.0)
    path = tmp_path / "peer.yaml"
    path.write_text(yaml.safe_dump(BASE))
    argv = [str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path), "--run-id", "run"]
    assert runner.main(argv) == 0
    recs = res.read_records(str(tmp_path / "run" / "points.jsonl"))
    by = {(r["engine"], r["policy"]): r for r in recs}
    assert [(r["engine"], r["policy_label"], r["status"]) for r in recs] == [
        ("ours", "full", "ok"),
        ("ours", "scissorhands", "ok"),
        ("openvino", "openvino full", "ok"),
        ("openvino", "openvino openvino_eviction (recent_size=32, start_size=32)", "ok"),
    ]
    for key in (("openvino", "full"), ("openvino", "openvino_eviction")):
        r = by[key]
        assert (r["capacity_status"], r["capacity_req_per_s"], r["capacity_hi_req_per_s"]) == ("ok", 50.0, 100.0)
        assert [(p["rate_req_per_s"], p["capacity_passed"]) for p in r["capacity_probe_results"]] == [
            (50.0, True),
            (100.0, False),
        ]
        assert r["perplexity"] is None and r["window_nll_per_token"] is None and r["quality_note"] == NO_PERPLEXITY
        assert r["preemptions"] is None and r["openvino_genai_version"] == "stub"
    for key in (("ours", "full"), ("ours", "scissorhands")):
        r = by[key]
        assert (r["capacity_status"], r["capacity_lo_req_per_s"]) == ("at_least_max_rate", 100.0)
        assert r["perplexity"] > 1 and r["quality_note"] is None and r["preemptions"] == 0
    # OpenVINO's max_cache_size at ratio 4: ceil(32 / 4) = 8, up to one evictable block above 32 + 32 -> 96
    evict = by[("openvino", "openvino_eviction")]
    assert evict["budget_tokens"] == 96
    assert evict["openvino_max_cache_size_rounding"] == "ceil(32 / 4) = 8 -> 96 (32-token blocks)"
    # 96 tokens hold every 32-token sequence: the x4 row ran the full cache, and its record and row say so
    why = "evicts nothing: max_cache_size 96 >= longest sequence 32"
    assert (evict["evicts"], evict["evicts_reason"]) == (False, why)
    assert "evicts" not in by[("openvino", "full")] and "evicts" not in by[("ours", "scissorhands")]
    assert by[("openvino", "full")]["budget_tokens"] is None and by[("ours", "scissorhands")]["budget_tokens"] == 32
    # one KV byte limit for every row
    assert len({r["kv_memory_limit_bytes"] for r in recs}) == 1
    # the stub saw the same prompts at each rate in both of its series (warm-up included), in the same order
    for rate in (50.0, 100.0):
        assert (
            stub.seen[("full", rate)] == stub.seen[("openvino_eviction", rate)] and len(stub.seen[("full", rate)]) == 5
        )
    table = (tmp_path / "run" / "table.md").read_text()
    assert "| openvino full | float32 | - | 50 |" in table
    assert "no gate (no perplexity)" in table and f"ok, {NO_PERPLEXITY}" in table
    assert table.splitlines()[0].endswith(
        f"Without a gate ({NO_PERPLEXITY}): openvino full 50; openvino openvino_eviction (recent_size=32, "
        "start_size=32) x4 50 req/s at the SLO."
    )
    assert "engines: ours and openvino (OpenVINO GenAI stub)" in table
    assert f"| openvino openvino_eviction (recent_size=32, start_size=32) x4 ({why}) |" in table
    assert (tmp_path / "run" / "frontier.png").stat().st_size > 10_000


def test_a_suite_whose_openvino_eviction_holds_its_longest_sequence_warns_at_load_and_a_larger_one_does_not():
    with pytest.warns(
        UserWarning,
        match=r"openvino_eviction@\w+-r4: OpenVINO's eviction evicts nothing: max_cache_size 96 >= longest sequence 32",
    ):
        parse_suite(BASE)
    longer = {**BASE, "prompt_tokens": 120, "new_tokens": 8}  # 128 tokens: x4 -> 32 -> 96 < 128, it evicts
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_suite(longer)


def _rec(pid, policy, ratio, capacity, ppl, engine="ours", **kw):
    return {
        "point_id": pid,
        "status": "ok",
        "throughput": "capacity",
        "policy": policy,
        "policy_label": policy if engine == "ours" else f"{engine} {policy}",
        "engine": engine,
        "compression_ratio": ratio,
        "capacity_status": "ok",
        "capacity_req_per_s": capacity,
        "capacity_lo_req_per_s": capacity,
        "capacity_hi_req_per_s": capacity * 1.2,
        "capacity_probes": 4,
        "capacity_target_attainment": 0.99,
        "slo_ttft_s": 2.0,
        "slo_tpot_s": 0.2,
        "num_requests": 16,
        "max_num_batched_tokens": 512,
        "perplexity": ppl,
        "quality_note": None if ppl is not None else NO_PERPLEXITY,
        "perplexity_windows": 4 if ppl is not None else None,
        "point_config": {"perplexity_windows": 4},
        "kv_memory_limit_bytes": 2 << 20,
        "prompt_tokens": 256,
        "new_tokens": 64,
        "perplexity_tokens_scored": 1280 if ppl is not None else None,
        "dtype": "bfloat16",
        **kw,
    }


def test_the_gate_is_judged_against_ours_full_and_a_row_without_perplexity_is_drawn_as_a_line_at_its_capacity():
    rows = frontier_rows(
        [
            _rec("ov-full", "full", None, 1.5, None, engine="openvino"),  # listed first: never the gate's reference
            _rec("full", "full", None, 0.7, 20.0),
            _rec("sh", "scissorhands", 5.0, 1.2, 20.1),
            _rec("ov-ev", "openvino_eviction", 5.0, 1.7, None, engine="openvino"),
        ]
    )
    assert [(r["label"], r["on_frontier"], r["quality_gate_passed"]) for r in rows] == [
        ("openvino openvino_eviction x5", None, None),
        ("openvino full", None, None),
        ("scissorhands x5", True, True),
        ("full", True, True),
    ]
    assert rows[0]["full_perplexity"] == 20.0 and rows[0]["perplexity_vs_full"] is None
    table = markdown(rows)
    assert table.startswith(
        "**Highest capacity within the quality gate: scissorhands x5** (policy scissorhands, compression ratio 5x) at "
        "1.2 req/s at the SLO, 1.71x the full cache's 0.7"
    )
    assert table.splitlines()[0].endswith(
        f"Without a gate ({NO_PERPLEXITY}): openvino openvino_eviction x5 1.7; openvino full 1.5 req/s at the SLO."
    )
    ov_row = next(line for line in table.splitlines() if line.startswith("| openvino full |"))
    assert "| 1.5 |" in ov_row and "no gate (no perplexity)" in ov_row and NO_PERPLEXITY in ov_row
    assert "Not one comparison" not in table  # the rows without windows are in their suite's group
    fig = figure(rows)
    lines = [ln for ln in fig.axes[0].get_lines() if ln.get_gid() == NO_PERPLEXITY_GID]
    assert sorted(ln.get_xdata()[0] for ln in lines) == [1.5, 1.7]
    legend = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert f"openvino full: 1.5, {NO_PERPLEXITY} (no gate)" in legend
    # only ours' rows are placed (and ringed) on the perplexity axis
    assert sorted(x for coll in fig.axes[0].collections for x, _ in coll.get_offsets() if len(coll.get_offsets())) == [
        0.7,
        0.7,
        1.2,
        1.2,
    ]


def test_without_ours_full_the_rows_without_perplexity_still_say_so():
    rows = frontier_rows([_rec("ov-full", "full", None, 1.5, None, engine="openvino")])
    table = markdown(rows)
    assert table.startswith("**No quality gate: no full-cache point finished to compare with**")
    assert f"Without a gate ({NO_PERPLEXITY}): openvino full 1.5 req/s at the SLO." in table.splitlines()[0]
    assert "no perplexity" in table.split("\n\n")[1]  # the conditions


@pytest.mark.slow
def test_make_frontier_local_runs_the_real_openvino_pipeline_beside_ours_on_the_embedded_model(tmp_path):
    """The real backend in a frontier (2 requests a probe at 2 rates, an SLO every engine meets): OpenVINO GenAI's full
    cache gets a capacity on ours' requests and no perplexity; ours gets both."""
    peer_stub.real_runtime_or_skip()
    doc = {
        **BASE,
        "model": "embedded",
        "policies": ["full", OV_FULL],
        "prompt_tokens": 64,
        "new_tokens": 8,
        "capacity": {"min_rate_req_per_s": 0.5, "max_rate_req_per_s": 1.0, "resolution": 1.0},
        "slo": {"ttft_s": 600.0, "tpot_s": 600.0},
        "num_requests": 2,
        "max_num_batched_tokens": 256,
    }
    path = tmp_path / "peer.yaml"
    path.write_text(yaml.safe_dump(doc))
    argv = [str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path), "--run-id", "run"]
    assert runner.main(argv) == 0
    ours, ov = res.read_records(str(tmp_path / "run" / "points.jsonl"))
    assert (ours["engine"], ov["engine"], ov["policy_label"]) == ("ours", "openvino", "openvino full")
    for r in (ours, ov):
        assert (r["status"], r["capacity_status"], r["capacity_lo_req_per_s"]) == ("ok", "at_least_max_rate", 1.0)
    assert ours["perplexity"] > 1 and ov["perplexity"] is None and ov["quality_note"] == NO_PERPLEXITY
    assert (
        ov["openvino_genai_version"].startswith("2026.")
        and ov["kv_memory_limit_bytes"] == ours["kv_memory_limit_bytes"]
    )
    table = (tmp_path / "run" / "table.md").read_text()
    assert f"Without a gate ({NO_PERPLEXITY}): openvino full ≥ 1 req/s at the SLO." in table.splitlines()[0]
