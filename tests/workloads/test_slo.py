"""SLO attainment and goodput (`workloads.load.slo`, `workloads.load.metrics.summarize`), and the suite's `slo:`.

The expected numbers are computed by hand from a few synthetic request records whose times are exact in binary
(multiples of 1/16 s), so every comparison is exact.
"""

from __future__ import annotations

import pytest
import yaml

from tests.serving_fakes import FakeReplica, Script, requests, run_virtual, virtual_clock
from tests.suite_helpers import tiny_suite
from workloads import sweep
from workloads.core.suite import SuiteError
from workloads.kinds import parse_suite
from workloads.load.driver import run_load
from workloads.load.metrics import RequestRecord, summarize
from workloads.load.patterns import LoadConfig
from workloads.load.slo import DEFAULT_SLO, SLO, describe_slo

#: the window of `_records`: [0, 10] s
WINDOW = dict(mode="rate", window_start_s=0.0, window_end_s=10.0)


def _records() -> list[RequestRecord]:
    """Eight records, one of each case (TTFT, TPOT, e2e in seconds):

    w  warm-up (meets every SLO): excluded from everything
    a  ttft 0.5, tpot 0.0625, 3 tokens, e2e 0.625           meets
    b  ttft 2.0, tpot 0.0625, 2 tokens                       misses a TTFT limit below 2 s
    c  ttft 0.5, tpot 0.5, 3 tokens                          misses TPOT
    d  ttft 0.25, one token: no TPOT                         meets (TPOT vacuously)
    e  failed (an error)                                     misses
    f  dropped arrival (never sent)                          misses
    g  ttft 0.5, tpot 0.0625, 16 tokens from 9.5 to 10.4375  meets; finishes after the window (9 tokens inside)
    """
    t = 0.0625
    return [
        RequestRecord("w", 4, 2, send_time_s=-1.0, token_times_s=[-0.875, -0.8125], output_tokens=2, warmup=True),
        RequestRecord("a", 4, 3, send_time_s=0.0, token_times_s=[0.5, 0.5 + t, 0.5 + 2 * t], output_tokens=3),
        RequestRecord("b", 4, 2, send_time_s=1.0, token_times_s=[3.0, 3.0 + t], output_tokens=2),
        RequestRecord("c", 4, 3, send_time_s=2.0, token_times_s=[2.5, 3.0, 3.5], output_tokens=3),
        RequestRecord("d", 4, 1, send_time_s=3.0, token_times_s=[3.25], output_tokens=1),
        RequestRecord("e", 4, 2, send_time_s=4.0, error_kind="error", error="RuntimeError: boom"),
        RequestRecord("f", 4, 2, scheduled_time_s=5.0),
        RequestRecord("g", 4, 16, send_time_s=9.0, token_times_s=[9.5 + i * t for i in range(16)], output_tokens=16),
    ]


def test_attainment_counts_every_measured_arrival_and_failed_dropped_ones_miss():
    m = summarize(_records(), **WINDOW, slo=SLO(ttft_s=1.0, tpot_s=0.1))
    # measured arrivals: a b c d e f g (w is warm-up); meeting: a, d (one token), g
    assert (m.slo_requests, m.slo_met_requests) == (7, 3)
    assert m.slo_attainment == 3 / 7
    # goodput: a and d completed inside the window (g's last token is at 10.4375): 2 requests / 10 s
    assert m.goodput_req_per_s == 0.2
    # their output tokens inside the window: a 3 + d 1 + g's 9 (9.5 .. 10.0)
    assert m.goodput_tok_per_s == 13 / 10
    # never above the throughput over the same window (a b c d complete inside; a3 b2 c3 d1 g9 tokens)
    assert (m.request_throughput_req_per_s, m.output_throughput_tok_per_s) == (0.4, 1.8)
    assert (m.slo_ttft_s, m.slo_tpot_s, m.slo_e2e_latency_s) == (1.0, 0.1, None)


def test_an_e2e_limit_also_judges_each_request():
    m = summarize(_records(), **WINDOW, slo=SLO(ttft_s=1.0, tpot_s=0.1, e2e_latency_s=1.0))
    # g's e2e is 10.4375 - 9 = 1.4375 s > 1 s: only a (0.625 s) and d (0.25 s) remain
    assert (m.slo_met_requests, m.slo_attainment) == (2, 2 / 7)
    assert (m.goodput_req_per_s, m.goodput_tok_per_s) == (0.2, 0.4)
    assert m.slo_e2e_latency_s == 1.0


def test_a_latency_at_the_limit_meets_it_and_one_just_over_misses():
    at = summarize(_records(), **WINDOW, slo=SLO(ttft_s=0.5, tpot_s=0.0625))  # a's and g's TTFT and TPOT exactly
    assert at.slo_met_requests == 3  # a, d, g
    over = summarize(_records(), **WINDOW, slo=SLO(ttft_s=0.4375, tpot_s=0.0625))
    assert over.slo_met_requests == 1  # d only (TTFT 0.25)


def test_a_one_token_request_meets_the_tpot_limit_vacuously_but_not_the_ttft_limit():
    slo = SLO(ttft_s=1.0, tpot_s=1e-9)
    one = RequestRecord("x", 4, 1, send_time_s=0.0, token_times_s=[0.5], output_tokens=1)
    assert one.tpot_s is None and slo.met_by(one)
    late = RequestRecord("y", 4, 1, send_time_s=0.0, token_times_s=[1.5], output_tokens=1)
    assert not slo.met_by(late)
    two = RequestRecord("z", 4, 2, send_time_s=0.0, token_times_s=[0.5, 0.5625], output_tokens=2)
    assert not slo.met_by(two)  # a TPOT of 62.5 ms > 1 ns


def test_attainment_is_null_without_arrivals_and_zero_when_every_request_fails():
    none = summarize([], mode="rate", window_start_s=None, window_end_s=None)
    assert (none.slo_requests, none.slo_attainment, none.goodput_req_per_s, none.goodput_tok_per_s) == (
        0,
        None,
        None,
        None,
    )
    failed = [RequestRecord(f"e{i}", 4, 2, send_time_s=float(i), error_kind="oom") for i in range(3)]
    m = summarize(failed, mode="rate", window_start_s=0.0, window_end_s=4.0)
    assert (m.slo_requests, m.slo_attainment, m.goodput_req_per_s, m.goodput_tok_per_s) == (3, 0.0, 0.0, 0.0)


def test_the_default_slo_is_mlperfs_llama_3_1_8b_server_limits_and_the_record_keys_carry_it():
    assert (DEFAULT_SLO.ttft_s, DEFAULT_SLO.tpot_s, DEFAULT_SLO.e2e_latency_s) == (2.0, 0.1, None)
    flat = summarize(_records(), **WINDOW).flat()
    # by the default: b's TTFT (2.0 s) is at the limit (meets), c's TPOT (0.5 s) over it: a b d g meet
    assert (flat["slo_requests"], flat["slo_met_requests"], flat["slo_attainment"]) == (7, 4, 4 / 7)
    assert (flat["slo_ttft_s"], flat["slo_tpot_s"], flat["slo_e2e_latency_s"]) == (2.0, 0.1, None)
    assert (flat["goodput_req_per_s"], flat["goodput_tok_per_s"]) == (0.3, 1.5)  # a b d; a3 b2 d1 g9 tokens
    assert describe_slo(2.0, 0.1) == "TTFT <= 2000 ms, TPOT <= 100 ms"
    assert describe_slo(0.5, 0.03, 20.0) == "TTFT <= 500 ms, TPOT <= 30 ms, e2e <= 20000 ms"
    assert describe_slo(1000.0, 0.0012345) == "TTFT <= 1000000 ms, TPOT <= 1.2345 ms"  # plain, never 1e+06


def test_run_load_judges_its_requests_by_the_slo_it_is_given():
    fake = FakeReplica(script=lambda r: Script(ttft_s=0.5, gap_s=0.05))  # TTFT 500 ms, TPOT 50 ms
    cfg = LoadConfig(mode="concurrency", concurrency=2, num_requests=8)

    def run(**kw):
        async def go():
            return await run_load(fake, requests(8), cfg, clock=virtual_clock(), **kw)

        return run_virtual(go()).metrics

    assert run().slo_attainment == 1.0  # the default: 2 s and 100 ms
    tight = run(slo=SLO(ttft_s=0.25, tpot_s=0.1))
    assert (tight.slo_requests, tight.slo_attainment, tight.goodput_req_per_s) == (8, 0.0, 0.0)
    assert tight.slo_ttft_s == 0.25


# --------------------------------------------------------------------------- the suite's slo:
SUITE = tiny_suite(
    "serving", mode="concurrency", policies=["full"], loads=[1], prompt_tokens=8, new_tokens=4, num_requests=2
)


def test_a_suite_without_slo_gets_the_default_and_keeps_its_point_ids():
    plain, default = parse_suite(SUITE), parse_suite(dict(SUITE, slo={"ttft_s": 2, "tpot_s": 0.1}))
    assert plain.slo == default.slo == DEFAULT_SLO
    assert "slo" not in plain.points()[0].identity
    assert [p.point_id for p in plain.points()] == [p.point_id for p in default.points()]
    other = parse_suite(dict(SUITE, slo={"ttft_s": 0.5, "tpot_s": 0.03, "e2e_latency_s": 20}))
    assert other.slo == SLO(ttft_s=0.5, tpot_s=0.03, e2e_latency_s=20.0)
    assert other.points()[0].identity["slo"] == {"ttft_s": 0.5, "tpot_s": 0.03, "e2e_latency_s": 20.0}
    assert other.points()[0].point_id != plain.points()[0].point_id


BAD_SLOS = [
    ({"ttft_s": 0}, "slo.ttft_s"),
    ({"tpot_s": -0.1}, "slo.tpot_s"),
    ({"e2e_latency_s": "30s"}, "slo.e2e_latency_s"),
    ({"ttft_s": True}, "slo.ttft_s"),
    ({"tpot_s": float("inf")}, "slo.tpot_s"),
]


@pytest.mark.parametrize("slo, field", BAD_SLOS, ids=[f for _, f in BAD_SLOS])
def test_a_limit_that_is_not_a_positive_number_of_seconds_names_the_field(slo, field):
    with pytest.raises(SuiteError) as e:
        parse_suite(dict(SUITE, slo=slo))
    assert f"{field}: expected a positive number of seconds" in str(e.value)


def test_an_slo_that_is_not_a_mapping_or_has_an_unknown_key_names_slo():
    with pytest.raises(SuiteError, match=r"slo: expected a mapping \{ttft_s: S, tpot_s: S, e2e_latency_s: S\}"):
        parse_suite(dict(SUITE, slo=2.0))
    with pytest.raises(SuiteError, match=r"slo\.ttft: unknown key"):
        parse_suite(dict(SUITE, slo={"ttft": 2.0}))


def test_the_cli_exits_2_naming_the_slo_field_and_records_nothing(tmp_path, capsys):
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(dict(SUITE, slo={"ttft_s": 2.0, "tpot_s": 0})))
    rc = sweep.main([str(path), "--results-dir", str(tmp_path / "results"), "--run-id", "r"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "slo.tpot_s" in err and "positive number of seconds" in err
    assert not (tmp_path / "results").exists()


def test_resuming_a_run_with_a_changed_slo_is_refused_naming_slo(tmp_path):
    from workloads.core.results import append_record
    from workloads.core.run import SweepError, pending_points

    points_path = str(tmp_path / "points.jsonl")
    [old] = parse_suite(SUITE).points()
    append_record(points_path, {"point_id": old.point_id, "point_config": old.identity, "status": "ok"})
    assert pending_points(points_path, parse_suite(dict(SUITE, slo={"ttft_s": 2.0})).points()) == []  # default: done
    with pytest.raises(SweepError) as e:
        pending_points(points_path, parse_suite(dict(SUITE, slo={"ttft_s": 0.5, "tpot_s": 0.03})).points())
    assert e.value.code == 2 and "['slo']" in str(e.value)
