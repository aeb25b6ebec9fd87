"""Numbers as the serving reports print them (`workloads.load.numbers.significant`, `workloads.serving.report`,
the serving sweep's progress line, `workloads.load.slo.describe_slo`): milliseconds in plain notation."""

import pytest

from workloads.load.numbers import significant
from workloads.load.slo import describe_slo
from workloads.serving.point import eviction_count_fields
from workloads.serving.report import _said_evicting_nothing, milliseconds, table_markdown
from workloads.serving.runner import ServingKind


@pytest.mark.parametrize(
    "value, text",
    [
        (42612.3, "42600"),
        (53300.0, "53300"),
        (188.04, "188"),
        (12.34, "12.3"),
        (0.5, "0.5"),
        (0.001234, "0.00123"),
        (999.6, "1000"),
        (-3.456, "-3.46"),
        (123456789.0, "123000000"),
        (0.0, "0"),
        (None, "-"),
    ],
)
def test_three_significant_digits_never_in_scientific_notation(value, text):
    assert significant(value) == text


def _contended_record(**kw):
    rec = {
        "point_id": "p0",
        "status": "ok",
        "series": "full",
        "load": 0.3,
        "ttft_p50_s": 42.6,
        "ttft_p90_s": 50.1,
        "ttft_p95_s": 52.0,
        "ttft_p99_s": 53.3,
        "ttft_p99_low_confidence": True,
        "tpot_p50_s": 0.0004567,
        "tpot_p99_s": 1234.5,
        "ttft_n": 8,
        "completed_requests": 8,
        "sent_requests": 8,
        "slo_attainment": 0.0,
        "slo_requests": 8,
    }
    return {**rec, **kw}


def test_millisecond_columns_and_the_progress_line_print_seconds_of_latency_without_an_exponent():
    rec = _contended_record()
    assert milliseconds(rec, "ttft") == "42600/50100/52000/53300*"
    assert milliseconds(rec, "tpot") == "0.457/-/-/1230000"
    line = ServingKind().one_line(rec)
    assert "TTFT p50/p99 42600/53300 ms" in line and "TPOT p50/p99 0.457/1230000 ms" in line
    table = table_markdown([rec])
    assert "e+" not in table and "42600/50100/52000/53300*" in table
    assert describe_slo(1000.0, 0.0005, 3600.0) == "TTFT <= 1000000 ms, TPOT <= 0.5 ms, e2e <= 3600000 ms"


def test_an_openvino_eviction_row_that_evicts_nothing_says_so_in_the_serving_table():
    why = "evicts nothing: max_cache_size 96 >= longest sequence 80"
    quiet = _contended_record(series="rate-openvino-openvino_eviction-x2", evicts=False, evicts_reason=why)
    evicting = _contended_record(series="rate-openvino-openvino_eviction-x5", evicts=True, point_index=1)
    table = table_markdown([quiet, evicting])
    rows = [ln.split("|")[1].strip() for ln in table.splitlines() if ln.startswith("| rate-")]
    assert rows == [f"rate-openvino-openvino_eviction-x2 ({why})", "rate-openvino-openvino_eviction-x5"]


def test_our_budgeted_row_that_evicted_no_token_says_evicts_nothing_in_the_serving_table():
    # a budget raised to the policy's floor held every token: the point ran the (prefix-cached) full cache
    quiet = eviction_count_fields([{"evicted_tokens": 0}, {"evicted_tokens": 0}])
    assert quiet["evicted_tokens"] == 0 and quiet["evicts"] is False
    assert quiet["evicts_reason"].startswith("evicts nothing: ")
    assert eviction_count_fields([{"evicted_tokens": 0}, {"evicted_tokens": 7}]) == {"evicted_tokens": 7}
    # the full cache (None: it keeps every token) and another backend (no key) flag nothing
    assert eviction_count_fields([{"evicted_tokens": None}]) == {} and eviction_count_fields([{}]) == {}
    rec = _contended_record(series="sessions-scissorhands+reuse-shared_prefix-r5", **quiet)
    table = table_markdown([rec])
    rows = [ln.split("|")[1].strip() for ln in table.splitlines() if ln.startswith("| sessions-")]
    assert rows == [f"sessions-scissorhands+reuse-shared_prefix-r5 ({quiet['evicts_reason']})"]


def test_a_capacity_row_whose_every_probe_evicted_nothing_says_so():
    quiet = eviction_count_fields([{"evicted_tokens": 0}])
    why = quiet["evicts_reason"]
    recs = [
        _contended_record(series="a", point_index=0, **quiet),
        _contended_record(series="a", point_index=1, **quiet),
        _contended_record(series="b", point_index=2, **quiet),
        _contended_record(series="b", point_index=3, evicted_tokens=5),
    ]
    capacity = [{"series": "a", "x": 1}, {"series": "b", "x": 2}]
    assert _said_evicting_nothing(capacity, recs) == [{"series": f"a ({why})", "x": 1}, {"series": "b", "x": 2}]
