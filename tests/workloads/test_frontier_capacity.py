"""The frontier on capacity at the SLO (`throughput: capacity`, the default of frontier suites): the suite's fields
and ids, one point's search (`workloads.frontier.point.capacity_at_slo`), and the report's axis, table and
headline on capacity records."""

import re
import time
from types import SimpleNamespace

import pytest

from tests.serving_fakes import FakeReplica, OneReplicaPool, Script
from tests.suite_helpers import tiny_suite
from workloads.core.suite import SuiteError
from workloads.frontier import point as frontier_point
from workloads.frontier.report import frontier_rows, markdown, throughput_value
from workloads.kinds import parse_suite
from workloads.serving.suite import ServingSuite

BASE = tiny_suite("frontier", dtype="float32", compression_ratios=[4], prompt_tokens=24, new_tokens=8, replicas=1)
# 4 rates 1-8 req/s (x2 a step): 3 probes a point
GRID = {"min_rate_req_per_s": 1.0, "max_rate_req_per_s": 8.0, "resolution": 1.0}


def test_capacity_is_the_default_axis_and_each_point_carries_its_one_series_search():
    suite = parse_suite({**BASE, "capacity": GRID, "slo": {"ttft_s": 2.0, "tpot_s": 0.2}, "num_requests": 16})
    full, sh = suite.points()
    assert suite.throughput == "capacity"
    serving = ServingSuite.model_validate(sh.capacity_suite)  # a valid serving suite of one series
    assert (serving.mode, serving.kv_layout, serving.scheduler, serving.budget) == (
        "capacity",
        "paged",
        "mixed",
        "per_request",
    )
    assert [p.name for p in serving.policies] == ["scissorhands"] and serving.compression_ratios == (4.0,)
    assert serving.capacity.grid() == (1.0, 2.0, 4.0, 8.0) and serving.num_requests == 16
    assert (serving.prompt_tokens.upper, serving.new_tokens.upper, serving.kv_limit.full_sequences) == (24, 8, 2)
    assert ServingSuite.model_validate(full.capacity_suite).compression_ratios == ()
    assert "-cap-" in sh.point_id and sh.identity["capacity_search"]["slo"] == {"ttft_s": 2.0, "tpot_s": 0.2}


def test_the_search_the_slo_and_the_request_count_change_a_capacity_points_id_and_max_batch_ids_stay():
    ids = {
        parse_suite({**BASE, **change}).points()[1].point_id
        for change in (
            {},
            {"capacity": GRID},
            {"slo": {"ttft_s": 1.0, "tpot_s": 0.1}},
            {"num_requests": 8},
            {"max_num_batched_tokens": 64},
        )
    }
    assert len(ids) == 5
    # the max-batch axis keeps the ids its runs were recorded under (no capacity settings in its identity)
    (full,) = parse_suite({**BASE, "throughput": "max_batch", "policies": ["full"]}).points()
    assert "capacity_search" not in full.identity and full.capacity_suite is None
    assert full.point_id == "frontier-full-p24-n8-f2-w4-s0-9f3bb4d6"  # the id it had before the capacity axis


@pytest.mark.parametrize(
    "change, message",
    [
        ({"throughput": "latency"}, r"throughput: expected one of capacity, max_batch, got 'latency'"),
        ({"throughput": "max_batch", "slo": {"ttft_s": 1.0}}, r"slo: only used with throughput: capacity"),
        ({"throughput": "max_batch", "capacity": GRID}, r"capacity: only used with throughput: capacity"),
        ({"slo": {"ttft_s": 0}}, r"slo.ttft_s: .*expected a positive number of seconds"),
        (
            {"capacity": {"min_rate_req_per_s": 4.0, "max_rate_req_per_s": 2.0}},
            r"capacity.min_rate_req_per_s, capacity.max_rate_req_per_s: the rate bracket \[4, 2\] req/s is empty",
        ),
        ({"capacity": {**GRID, "target_attainment": 1.5}}, r"capacity.target_attainment: .*in \(0, 1\]"),
        ({"max_num_batched_tokens": 8}, r"max_num_batched_tokens: 8 is below one block \(block_tokens: 16\)"),
        ({"num_requests": 0}, r"num_requests: Input should be greater than or equal to 1"),
    ],
)
def test_bad_capacity_fields_name_the_field(change, message):
    with pytest.raises(SuiteError, match=message):
        parse_suite({**BASE, **change})


def _fake_probe(capacity_req_per_s: float, calls: list):
    """A `run_point` stand-in: a probe passes (attainment 1) up to `capacity_req_per_s`, misses (0.5) above."""

    def run_point(pool, suite, point, tokenizer=None, vocab_size=None):
        calls.append(point.load)
        good = point.load <= capacity_req_per_s
        return {
            "status": "ok",
            "error": None,
            "load": point.load,
            "slo_attainment": 1.0 if good else 0.5,
            "goodput_tok_per_s": 10.0 * point.load * (1.0 if good else 0.5),
            "goodput_req_per_s": point.load * (1.0 if good else 0.5),
            "ttft_p99_s": 0.1 * point.load,
            "tpot_p99_s": 0.01,
            "kv_cache_bytes": int(100 * point.load),
            "kv_memory_limit_bytes": 4096,
            "slot_bytes": 64,
            "scheduler": "mixed",
            "preemptions": 1,
        }

    return run_point


def test_one_capacity_point_bisects_its_grid_and_keeps_every_probe(model, monkeypatch):
    calls: list = []
    monkeypatch.setattr(frontier_point, "run_point", _fake_probe(2.5, calls))
    suite = parse_suite({**BASE, "capacity": GRID, "slo": {"ttft_s": 2.0, "tpot_s": 0.2}, "num_requests": 16})
    rec = frontier_point.capacity_at_slo(model, None, suite.points()[1].capacity_suite)
    # grid 1, 2, 4, 8: the middle (2) passes, then 4 fails: capacity 2, bracketed by 4
    assert calls == [2.0, 4.0]
    assert (rec["throughput"], rec["capacity_status"], rec["capacity_req_per_s"]) == ("capacity", "ok", 2.0)
    assert (rec["capacity_lo_req_per_s"], rec["capacity_hi_req_per_s"], rec["capacity_probes"]) == (2.0, 4.0, 2)
    assert [
        (p["rate_req_per_s"], p["capacity_passed"], p["slo_attainment"]) for p in rec["capacity_probe_results"]
    ] == [
        (2.0, True, 1.0),
        (4.0, False, 0.5),
    ]
    # at the capacity: the passing probe's latency and goodput; over the search: the peak KV and the preemptions
    assert (rec["goodput_tok_per_s"], rec["ttft_p99_s"]) == (20.0, pytest.approx(0.2))
    assert (rec["kv_cache_bytes"], rec["preemptions"], rec["budget_tokens"]) == (400, 2, 32)  # 8, floored
    assert (rec["slo_ttft_s"], rec["slo_tpot_s"], rec["num_requests"], rec["capacity_target_attainment"]) == (
        2.0,
        0.2,
        16,
        0.99,
    )


def test_a_capacity_point_whose_probe_errors_fails_naming_the_rate(model, monkeypatch):
    def run_point(pool, suite, point, tokenizer=None, vocab_size=None):  # as a failed configure answers: no load
        return {"status": "error", "stop_reason": "configure failed", "error": "replica died"}

    monkeypatch.setattr(frontier_point, "run_point", run_point)
    suite = parse_suite({**BASE, "capacity": GRID})
    with pytest.raises(RuntimeError, match=r"capacity probe at 2 req/s errored: replica died"):
        frontier_point.capacity_at_slo(model, None, suite.points()[0].capacity_suite)


class HangsAbove(OneReplicaPool):
    """Stands in for the frontier's `LocalReplicaPool`: a fake replica that answers at once up to `limit` req/s (the
    rate read from the request id, which names the probe) and never answers in time above it."""

    limit = 2.0
    rates: list = []

    def __init__(self, *args, **kwargs):
        pass

    def configure(self, cfg, run_id=None):
        def script(req):
            rate = float(re.search(r"-L([^-]+)-s\d+-", req.request_id).group(1))
            if not self.rates or self.rates[-1] != rate:
                self.rates.append(rate)
            return Script(ttft_s=0.001, gap_s=0.0005) if rate <= self.limit else Script(ttft_s=30.0)

        self.replica = FakeReplica(script=script, clock=time.time)


def test_a_capacity_point_whose_higher_rates_time_out_every_request_still_finds_its_capacity(monkeypatch):
    """A probe where every request times out is a measurement of attainment 0, not an error: the search moves down."""
    HangsAbove.rates = []
    monkeypatch.setattr(frontier_point, "LocalReplicaPool", HangsAbove)
    suite = parse_suite({**BASE, "capacity": {**GRID, "max_rate_req_per_s": 16.0}, "num_requests": 3})
    capacity_suite = {**suite.points()[0].capacity_suite, "request_timeout_s": 0.05}
    rec = frontier_point.capacity_at_slo(SimpleNamespace(config=SimpleNamespace(vocab_size=128)), None, capacity_suite)
    # grid 1, 2, 4, 8, 16: 4 times out (fails), 1 and 2 pass
    assert HangsAbove.rates == [4.0, 1.0, 2.0]
    assert (rec["capacity_status"], rec["capacity_req_per_s"], rec["capacity_hi_req_per_s"]) == ("ok", 2.0, 4.0)
    timed_out = rec["capacity_probe_results"][0]
    assert (timed_out["status"], timed_out["slo_attainment"], timed_out["capacity_passed"]) == ("ok", 0.0, False)


def test_a_capacity_point_on_the_tiny_model_measures_both_numbers(model):
    """The real path: the serving search on the engine in this process, then perplexity. An SLO no CPU misses
    (60 s) passes every rate, so the capacity is a lower bound: at least the grid's highest rate."""
    suite = parse_suite(
        {
            **BASE,
            "policies": [{"name": "scissorhands", "params": {"min_budget_tokens": 0}}],  # B = ceil(32 / 4), no floor
            "capacity": {"min_rate_req_per_s": 50.0, "max_rate_req_per_s": 100.0, "resolution": 1.0},
            "slo": {"ttft_s": 60.0, "tpot_s": 60.0},
            "num_requests": 4,
            "perplexity_windows": 2,
        }
    )
    (point,) = suite.points()
    rec = frontier_point.run_frontier_point(model, None, point)
    assert (rec["capacity_status"], rec["capacity_req_per_s"], rec["capacity_lo_req_per_s"]) == (
        "at_least_max_rate",
        None,
        100.0,
    )
    assert [p["rate_req_per_s"] for p in rec["capacity_probe_results"]] == [50.0, 100.0]
    assert all(p["status"] == "ok" and p["slo_attainment"] == 1.0 for p in rec["capacity_probe_results"])
    assert rec["kv_cache_bytes"] <= rec["kv_memory_limit_bytes"] and rec["budget_tokens"] == 8
    assert rec["perplexity_windows"] == 2 and rec["perplexity_budget_tokens"] == 8 and rec["perplexity"] > 1
    assert throughput_value(rec) == (100.0, True)


def _capacity_rec(pid, policy, ratio, status, lo, hi, ppl, **kw):
    return {
        "point_id": pid,
        "status": "ok",
        "throughput": "capacity",
        "policy": policy,
        "compression_ratio": ratio,
        "capacity_status": status,
        "capacity_req_per_s": lo if status == "ok" else None,
        "capacity_lo_req_per_s": lo,
        "capacity_hi_req_per_s": hi,
        "capacity_probes": 3,
        "capacity_target_attainment": 0.99,
        "goodput_tok_per_s": 7.5,
        "slo_ttft_s": 2.0,
        "slo_tpot_s": 0.2,
        "num_requests": 32,
        "max_num_batched_tokens": 512,
        "perplexity": ppl,
        "kv_memory_limit_bytes": 2 << 20,
        "prompt_tokens": 24,
        "new_tokens": 8,
        "perplexity_tokens_scored": 32,
        "dtype": "bfloat16",
        **kw,
    }


def test_the_report_ranks_capacity_and_lists_a_point_below_its_lowest_rate():
    rows = frontier_rows(
        [
            _capacity_rec("a", "full", None, "ok", 0.5, 0.7, 20.0),
            _capacity_rec("b", "scissorhands", 5.0, "ok", 1.5, 2.0, 20.1),
            _capacity_rec("c", "h2o", 5.0, "at_least_max_rate", 8.0, None, 30.0),
            _capacity_rec("d", "tova", 2.0, "below_min_rate", None, 0.25, 21.0),
        ]
    )
    assert [(r["label"], r["throughput_value"], r["on_frontier"]) for r in rows] == [
        ("h2o x5", 8.0, True),
        ("scissorhands x5", 1.5, True),
        ("full", 0.5, True),
        ("tova x2", None, None),
    ]
    table = markdown(rows)
    first = table.split("\n\n")[0]
    assert first.startswith(
        "**Highest capacity within the quality gate: scissorhands x5** (policy scissorhands, compression ratio 5x) at 1.5 "
        "req/s at the SLO, 3.00x the full cache's 0.5 (SLO TTFT <= 2 s, TPOT <= 0.2 s for >= 0.99 of 32 requests)"
    )
    assert "| h2o x5 | bfloat16 | - | ≥ 8 | 7.5 |" in table and "fail" in table
    assert "| tova x2 | bfloat16 | - | < 0.25 | 7.5 |" in table and "ok, no capacity: below_min_rate" in table
    assert "Throughput: capacity at the SLO" in table


def test_capacity_and_max_batch_records_are_never_ranked_together():
    max_batch = {
        **_capacity_rec("m", "full", None, "ok", 1.0, 2.0, 20.0),
        "throughput": "max_batch",
        "output_throughput_tok_per_s": 50.0,
    }
    rows = frontier_rows([_capacity_rec("a", "full", None, "ok", 0.5, 0.7, 20.0), max_batch])
    assert [(r["point_id"], r["throughput_value"], r["on_frontier"]) for r in rows] == [
        ("m", 50.0, True),
        ("a", 0.5, True),
    ]
    assert "Not one comparison" in markdown(rows)


def test_a_compressed_capacity_that_only_ties_the_full_cache_is_no_gain():
    rows = frontier_rows(
        [
            _capacity_rec("a", "full", None, "ok", 1.41, 2.06, 20.0),
            _capacity_rec("b", "scissorhands", 2.0, "ok", 1.41, 2.06, 20.1),
        ]
    )
    assert markdown(rows).startswith(
        "**No compressed configuration beats the full cache within the quality gate** (perplexity at most 1% above "
        "the full cache's 20.000, i.e. <= 20.200): 1 of 1 passed, none faster than the full cache at 1.41 req/s at "
        "the SLO."
    )


def test_a_max_batch_suite_loads_from_its_own_dump_and_refuses_a_changed_capacity_setting():
    """A run's suite is written whole (every field, defaults included) and read back on resume."""
    suite = parse_suite({**BASE, "throughput": "max_batch"})
    assert parse_suite(suite.model_dump(mode="json")).points()[0].point_id == suite.points()[0].point_id
    with pytest.raises(SuiteError, match=r"max_num_batched_tokens, num_requests: only used with throughput: capacity"):
        parse_suite({**BASE, "throughput": "max_batch", "num_requests": 8, "max_num_batched_tokens": 64})


def test_a_full_cache_below_the_grid_still_judges_the_gate_and_loses_to_a_passing_capacity():
    rows = frontier_rows(
        [
            _capacity_rec("a", "full", None, "below_min_rate", None, 0.25, 20.0),
            _capacity_rec("b", "tova", 2.0, "ok", 0.5, 0.7, 20.1),
            _capacity_rec("c", "h2o", 5.0, "ok", 2.0, 3.0, 25.0),
        ]
    )
    assert [(r["label"], r["on_frontier"], r["quality_gate_passed"]) for r in rows] == [
        ("h2o x5", True, False),
        ("tova x2", True, True),
        ("full", None, True),
    ]
    assert markdown(rows).startswith(
        "**Highest capacity within the quality gate: tova x2** (policy tova, compression ratio 2x) at 0.5 req/s at "
        "the SLO, the full cache's below 0.25 (the search's lowest rate)"
    )
    assert "| full | bfloat16 | - | < 0.25 |" in markdown(rows)


def test_a_tie_at_the_top_of_the_grid_is_undecided():
    rows = frontier_rows(
        [
            _capacity_rec("a", "full", None, "at_least_max_rate", 8.0, None, 20.0),
            _capacity_rec("b", "tova", 2.0, "at_least_max_rate", 8.0, None, 20.1),
        ]
    )
    assert markdown(rows).startswith(
        "**Undecided within the quality gate**: the full cache passed the grid's highest rate (≥ 8 req/s at the SLO) "
        "and so did tova x2 (≥ 8); raise `capacity.max_rate_req_per_s` to tell them apart."
    )


def test_a_failed_capacity_point_keeps_the_capacity_columns():
    failed = {"point_id": "f", "status": "error", "error": "capacity probe at 2 req/s errored: boom", "policy": "h2o"}
    table = markdown(
        frontier_rows([_capacity_rec("a", "full", None, "ok", 0.5, 0.7, 20.0), dict(failed, throughput="capacity")])
    )
    head = table.split("\n\n")[2].splitlines()[0]
    assert "capacity (req/s)" in head and "max batch" not in head and "output (tok/s)" not in head
    assert "error: capacity probe at 2 req/s errored: boom" in table


def test_every_frontier_record_names_its_axis_a_failed_ones_too():
    from workloads.frontier.runner import KIND

    suite = parse_suite(BASE)
    assert KIND.record_fields(suite, suite.points()[0], None)["throughput"] == "capacity"
