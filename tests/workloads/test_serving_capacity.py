"""Capacity at an SLO (`mode: capacity`, workloads.serving.capacity): the bisection on a synthetic attainment
function, the grid and its pairing, a search run through the run template on a scripted fake replica (statuses,
records, table, plot, an errored probe, resume), one `--local` run on the tiny model, and the exit-2 bad inputs."""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import pytest
import yaml

from tests.serving_fakes import FakeReplica, OneReplicaPool, Script
from tests.suite_helpers import serving_suite, uniform
from workloads import sweep
from workloads.core.suite import SuiteError
from workloads.core.template import run_suite
from workloads.kinds import load_suite
from workloads.load import patterns
from workloads.serving.capacity import CapacitySearch, bisect, needed_probes, summaries, summary_fields
from workloads.serving.runner import ServingKind


# ----------------------------------------------------------------------------------------- the search, pure
def _search(n: int, passes, max_probes: int | None = None):
    """Run `bisect` to its end on a synthetic attainment: `passes(index)` -> bool; the probes in order too."""
    results: dict[int, bool] = {}
    while (s := bisect(n, results, max_probes or needed_probes(n))).next is not None:
        results[s.next] = passes(s.next)
    return s


@pytest.mark.parametrize("n", [2, 3, 5, 40])
def test_bisection_finds_every_capacity_of_a_monotone_attainment_within_the_probes_the_grid_needs(n):
    for k in range(n - 1):  # rates 0..k pass, k+1.. fail
        s = _search(n, lambda i: i <= k)
        assert (s.status, s.lo, s.hi, s.next, s.remaining) == ("ok", k, k + 1, None, 0)
        assert len(s.path) <= needed_probes(n) == (n).bit_length() and len(set(s.path)) == len(s.path)


def test_a_search_that_cannot_bracket_says_why_instead_of_giving_a_capacity():
    below = _search(40, lambda i: False)
    assert (below.status, below.lo, below.hi) == ("below_min_rate", None, 0)
    above = _search(40, lambda i: True)
    assert (above.status, above.lo, above.hi) == ("at_least_max_rate", 39, None)
    short = _search(40, lambda i: i <= 10, max_probes=2)
    assert (short.status, short.path, short.lo, short.hi) == ("not_converged", (19, 9), 9, 19)
    grid = CapacitySearch(min_rate_req_per_s=0.05, max_rate_req_per_s=2.0).grid()
    for s, fields in (
        (below, dict(capacity_req_per_s=None, capacity_lo_req_per_s=None, capacity_hi_req_per_s=0.05)),
        (above, dict(capacity_req_per_s=None, capacity_lo_req_per_s=2.0, capacity_hi_req_per_s=None)),
        (short, dict(capacity_req_per_s=None, capacity_lo_req_per_s=grid[9], capacity_hi_req_per_s=grid[19])),
    ):
        got = summary_fields(s, grid, 0.99)
        assert {k: got[k] for k in fields} == fields and got["capacity_status"] == s.status


def test_the_search_is_a_function_of_the_results_known_so_a_resume_continues_the_same_path():
    full = _search(40, lambda i: i <= 26)
    for cut in range(len(full.path)):
        known = {i: i <= 26 for i in full.path[:cut]}
        partial = bisect(40, known, needed_probes(40))
        assert partial.status == "searching" and partial.path == full.path[:cut] and partial.next == full.path[cut]
        assert partial.remaining >= len(full.path) - cut  # an upper bound of the probes still to run
    # results off the path (another target's probes) change nothing until the path reaches them
    assert bisect(40, {**{i: i <= 26 for i in full.path}, 0: False, 39: True}, 6) == full


def test_the_grid_is_geometric_within_the_resolution_with_exact_ends():
    spec = CapacitySearch(min_rate_req_per_s=0.05, max_rate_req_per_s=2.0, resolution=0.1)
    rates = spec.grid()
    assert (rates[0], rates[-1], len(rates)) == (0.05, 2.0, 40)  # ceil(ln 40 / ln 1.1) = 39 steps
    ratios = [b / a for a, b in zip(rates, rates[1:])]
    assert max(ratios) <= 1.1 and min(ratios) > 1.098  # one step fewer would not keep 10%
    assert spec.probes == 6 and CapacitySearch(min_rate_req_per_s=1, max_rate_req_per_s=2, resolution=1).grid() == (
        1,
        2,
    )


# ----------------------------------------------------------------------------------------- suites
BASE = serving_suite(
    name="cap",
    mode="capacity",
    dtype="float32",
    compression_ratios=[4],
    prompt_tokens=uniform(8, 24),
    new_tokens=uniform(2, 4),
    capacity={"min_rate_req_per_s": 10, "max_rate_req_per_s": 160, "resolution": 1.0},  # 10, 20, 40, 80, 160
    slo={"ttft_s": 0.1, "tpot_s": 1.0},
    num_requests=3,
)


def _suite(tmp: Path, **kw) -> str:
    path = tmp / "cap.yaml"
    path.write_text(yaml.safe_dump({**BASE, **kw}))
    return str(path)


def _args(suite: str, results: Path, resume=None, sets=()) -> argparse.Namespace:
    return argparse.Namespace(
        suite=suite,
        replicas=None,
        results_dir=str(results),
        run_id=None if resume else "run",
        resume=resume,
        address=None,
        pushgateway="off",
        set=list(sets),
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_every_series_probes_the_same_grid_with_the_same_requests_and_arrivals_at_one_rate(tmp_path):
    suite = load_suite(_suite(tmp_path))
    full, sh = (p for p in suite.points() if p.load == 40)
    assert (full.series, sh.series) == ("capacity-full", "capacity-scissorhands-r4")
    assert suite.load_config(full) == suite.load_config(sh)  # the same arrivals (rate, seed)
    # one seed at every rate (common random numbers): the same requests, the arrival pattern scaled to the rate
    assert {suite.workload_seed(p) for p in suite.points()} == {suite.workload_seed(full)}
    slow, fast = [suite.load_config(p) for p in suite.points() if p.policy == "full"][:2]
    gaps = [patterns.arrival_gaps_s(8, c.rate_req_per_s, c.burstiness, c.seed) for c in (slow, fast)]
    assert gaps[0] * slow.rate_req_per_s == pytest.approx(gaps[1] * fast.rate_req_per_s)
    # another bracket holding 40 req/s draws the same requests and keeps the probe's id (the search settings are
    # not part of it), so a resumed run reuses it
    other = load_suite(_suite(tmp_path, capacity={"min_rate_req_per_s": 40, "max_rate_req_per_s": 90, "max_probes": 2}))
    again = next(p for p in other.points() if p.load == 40 and p.policy == "full")
    assert other.workload_seed(again) == suite.workload_seed(full) and again.point_id == full.point_id


class BackPressureError(Exception):
    """Named as Ray Serve's: a deployment whose queue is full refuses the request."""


class RatePool(OneReplicaPool):
    """One scripted fake replica: a probe above its policy's `passes_up_to` rate (read from the request id, which
    names the point) answers after 0.3 s (over the SLO's 0.1 s TTFT), or with `above` "hangs" never answers in time,
    or with "refuses" refuses every request for load; else it answers after 1 ms; at `error_at` every request raises
    (the probe's status: error). `probes` lists the (policy, rate) of every probe configured."""

    def __init__(
        self,
        passes_up_to: dict[str, float],
        error_at: float | None = None,
        kill_at: int | None = None,
        above: str | None = None,
    ):
        self.passes_up_to, self.error_at, self.kill_at, self.above = passes_up_to, error_at, kill_at, above
        self.probes: list[tuple[str, float | None]] = []

    def configure(self, cfg, run_id=None):
        if len(self.probes) + 1 == self.kill_at:
            raise KeyboardInterrupt("killed during this probe")
        policy, limit = cfg.policy, self.passes_up_to[cfg.policy]
        self.probes.append((policy, None))

        def script(req):
            rate = float(re.search(r"-L([^-]+)-s\d+-", req.request_id).group(1))
            self.probes[-1] = (policy, rate)
            if rate == self.error_at:
                return Script(ttft_s=0.001, raises=RuntimeError("boom"))
            if rate > limit and self.above == "hangs":  # past the suite's request_timeout_s: every request times out
                return Script(ttft_s=30.0)
            if rate > limit and self.above == "refuses":  # Serve's back-pressure: a full queue refuses every request
                return Script(ttft_s=0.001, raises=BackPressureError("the queue is full"))
            return Script(ttft_s=0.001 if rate <= limit else 0.3, gap_s=0.0005)

        self.replica = FakeReplica(script=script, clock=time.time)


def test_a_capacity_run_records_every_probe_with_the_search_state_and_tables_and_plots_each_capacity(tmp_path):
    pool = RatePool({"full": 40, "scissorhands": 80})
    assert run_suite(_args(_suite(tmp_path), tmp_path / "r"), ServingKind(pool)) == 0
    # full: 40 passes, 80 fails; scissorhands: 40 and 80 pass, 160 fails (bisection from the grid's middle)
    assert pool.probes == [
        ("full", 40),
        ("full", 80),
        ("scissorhands", 40),
        ("scissorhands", 80),
        ("scissorhands", 160),
    ]
    recs = _lines(tmp_path / "r" / "run" / "points.jsonl")
    assert [(r["series"], r["load"], r["request_rate"], r["capacity_probe"], r["capacity_passed"]) for r in recs] == [
        ("capacity-full", 40, 40, 1, True),
        ("capacity-full", 80, 80, 2, False),
        ("capacity-scissorhands-r4", 40, 40, 1, True),
        ("capacity-scissorhands-r4", 80, 80, 2, True),
        ("capacity-scissorhands-r4", 160, 160, 3, False),
    ]
    assert all(r["status"] == "ok" and r["mode"] == "capacity" and r["slo_requests"] == 3 for r in recs)
    assert [r["slo_attainment"] for r in recs] == [1.0, 0.0, 1.0, 1.0, 0.0]
    keys = ("capacity_status", "capacity_req_per_s", "capacity_lo_req_per_s", "capacity_hi_req_per_s")
    assert [tuple(r[k] for k in keys) for r in recs] == [
        ("searching", None, 40, None),
        ("ok", 40, 40, 80),
        ("searching", None, 40, None),
        ("searching", None, 80, None),
        ("ok", 80, 80, 160),
    ]
    assert recs[1]["capacity_probes"] == 2 and recs[4]["capacity_probes"] == 3
    assert recs[4]["capacity_target_attainment"] == 0.99
    # paired: both series sent the same requests at the same times at 40 and 80 req/s
    for a, b in ((recs[0], recs[2]), (recs[1], recs[3])):
        assert (a["input_tokens"], a["scheduled_rate_req_per_s"]) == (b["input_tokens"], b["scheduled_rate_req_per_s"])
    table = (tmp_path / "r" / "run" / "table.md").read_text()
    assert re.search(r"\| capacity-full +\| +40 \| +40 / 80 \| +2 \| +0 \| +ok +\|", table)
    assert re.search(r"\| capacity-scissorhands-r4 +\| +80 \| +80 / 160 \| +3 \| +0 \| +ok +\|", table)
    assert table.index("Capacity at the SLO") < table.index("| series                   | load")
    assert (tmp_path / "r" / "run" / "attainment_vs_rate.png").stat().st_size > 1000


def test_an_interrupted_search_resumes_where_it_stopped_and_a_larger_max_probes_goes_on_without_rerunning_a_probe(
    tmp_path,
):
    suite = _suite(tmp_path)
    with pytest.raises(KeyboardInterrupt):  # killed during the full series' second probe
        run_suite(_args(suite, tmp_path / "r"), ServingKind(RatePool({"full": 40, "scissorhands": 80}, kill_at=2)))
    assert [(r["load"], r["capacity_status"]) for r in _lines(tmp_path / "r" / "run" / "points.jsonl")] == [
        (40, "searching")
    ]
    two = ["capacity.max_probes=2"]
    pool = RatePool({"full": 40, "scissorhands": 80})
    assert run_suite(_args(suite, tmp_path / "r", resume="run", sets=two), ServingKind(pool)) == 0
    assert pool.probes == [("full", 80), ("scissorhands", 40), ("scissorhands", 80)]  # 40 req/s of full: not again
    last = _lines(tmp_path / "r" / "run" / "points.jsonl")[-1]
    assert (last["capacity_status"], last["capacity_req_per_s"], last["capacity_lo_req_per_s"]) == (
        "not_converged",
        None,
        80,
    )
    pool = RatePool({"full": 40, "scissorhands": 80})  # resumed with the probes the grid needs (3)
    assert run_suite(_args(suite, tmp_path / "r", resume="run"), ServingKind(pool)) == 0
    assert pool.probes == [("scissorhands", 160)]
    recs = _lines(tmp_path / "r" / "run" / "points.jsonl")
    assert len({r["point_id"] for r in recs}) == len(recs) == 5  # no probe recorded twice
    assert (recs[-1]["capacity_status"], recs[-1]["capacity_req_per_s"], recs[-1]["capacity_probe"]) == ("ok", 80, 3)
    pool = RatePool({"full": 40, "scissorhands": 80})  # both searches ended: nothing runs
    assert run_suite(_args(suite, tmp_path / "r", resume="run"), ServingKind(pool)) == 0 and pool.probes == []


def test_an_errored_probe_stops_its_series_exits_1_and_runs_again_on_resume(tmp_path, capsys):
    """An error (a replica died) says nothing of the rate's attainment: the series waits, a resume probes it again."""
    suite = _suite(tmp_path, policies=["full"])
    pool = RatePool({"full": 80}, error_at=40)
    assert run_suite(_args(suite, tmp_path / "r"), ServingKind(pool)) == 1
    assert pool.probes == [("full", 40)]  # not run twice in one run, and no probe chosen on it
    (rec,) = _lines(tmp_path / "r" / "run" / "points.jsonl")
    assert (rec["status"], rec["capacity_status"], rec["capacity_req_per_s"]) == ("error", "searching", None)
    assert "1 point(s) failed" in capsys.readouterr().err
    table = (tmp_path / "r" / "run" / "table.md").read_text()
    assert re.search(r"\| capacity-full +\| +- \| +- / - \| +0 \| +1 \| +searching +\|", table)
    assert "errored: a probe errored, so its series stopped" in table
    pool = RatePool({"full": 80})
    assert run_suite(_args(suite, tmp_path / "r", resume="run"), ServingKind(pool)) == 0
    assert pool.probes == [("full", 40), ("full", 80), ("full", 160)]  # 40 again, then the search goes on
    recs = _lines(tmp_path / "r" / "run" / "points.jsonl")
    assert (recs[-1]["capacity_status"], recs[-1]["capacity_req_per_s"]) == ("ok", 80)


@pytest.mark.parametrize("above", ["hangs", "refuses"])
def test_a_rate_where_every_request_times_out_or_is_refused_fails_its_probe_and_the_search_converges(tmp_path, above):
    """Timeouts and refusals for load measure the rate (attainment 0), as in GuideLLM and inference-perf: the search
    moves down and ends, the run exits 0, and a resume has nothing left to probe (an error would be probed again)."""
    suite = _suite(tmp_path, policies=["full"], request_timeout_s=0.05)
    pool = RatePool({"full": 20}, above=above)
    assert run_suite(_args(suite, tmp_path / "r"), ServingKind(pool)) == 0
    assert pool.probes == [("full", 40), ("full", 10), ("full", 20)]  # 40 fails, then the search moves down
    first, _, last = _lines(tmp_path / "r" / "run" / "points.jsonl")
    kind = {"hangs": "timeout", "refuses": "overloaded"}[above]
    assert (first["status"], first["slo_attainment"], first["completed_requests"]) == ("ok", 0.0, 0)
    assert first["errors_by_kind"] == {kind: 3} and first["capacity_passed"] is False
    assert any("every request missed the SLO" in w for w in first["warnings"])
    assert (last["capacity_status"], last["capacity_req_per_s"], last["capacity_hi_req_per_s"]) == ("ok", 20, 40)
    pool = RatePool({"full": 20}, above=above)
    assert run_suite(_args(suite, tmp_path / "r", resume="run"), ServingKind(pool)) == 0 and pool.probes == []
    # every rate of the grid times out: the search ends below its bracket, no probe errored
    suite = _suite(tmp_path, policies=["full"], request_timeout_s=0.05)
    pool = RatePool({"full": 5}, above=above)
    assert run_suite(_args(suite, tmp_path / "s"), ServingKind(pool)) == 0
    assert pool.probes == [("full", 40), ("full", 10)]
    assert _lines(tmp_path / "s" / "run" / "points.jsonl")[-1]["capacity_status"] == "below_min_rate"


def test_the_summary_is_recomputed_from_the_records_so_another_bracket_reuses_the_recorded_probes(tmp_path):
    """A search's summary is a function of the suite's settings and the records (the table's, at the end of a run)."""
    suite_path = _suite(tmp_path, policies=["full"])
    run_suite(_args(suite_path, tmp_path / "r"), ServingKind(RatePool({"full": 40})))
    recs = _lines(tmp_path / "r" / "run" / "points.jsonl")
    suite = load_suite(suite_path)
    (row,) = summaries(suite.capacity, suite.points(), recs)
    assert (row["series"], row["capacity_status"], row["capacity_req_per_s"], row["capacity_probes"]) == (
        "capacity-full",
        "ok",
        40,
        2,
    )
    # the grid 40, 80, 160 probes 80 (failed) then 40 (passed): both recorded, nothing to run
    narrower = load_suite(suite_path, ["capacity.min_rate_req_per_s=40"])
    (row,) = summaries(narrower.capacity, narrower.points(), recs)
    assert (row["capacity_status"], row["capacity_req_per_s"], row["capacity_hi_req_per_s"]) == ("ok", 40, 80)
    pool = RatePool({"full": 40})
    assert (
        run_suite(
            _args(suite_path, tmp_path / "r", resume="run", sets=["capacity.min_rate_req_per_s=40"]), ServingKind(pool)
        )
        == 0
    )
    assert pool.probes == []


# ----------------------------------------------------------------------------------------- the tiny model, in process
def test_a_local_capacity_run_on_the_tiny_model_pairs_its_series_and_says_when_it_cannot_bracket(tmp_path):
    suite = _suite(
        tmp_path,
        capacity={"min_rate_req_per_s": 2, "max_rate_req_per_s": 8, "resolution": 1.0},  # 2, 4, 8 req/s
        slo={"ttft_s": 600, "tpot_s": 600},
        kv_layout="paged",
        block_tokens=4,
        budget="per_request",
        scheduler="mixed",
        max_num_batched_tokens=16,
        kv_memory_limit={"full_sequences": 2},
    )
    out = tmp_path / "r"
    common = ["--local", "--pushgateway", "off", "--results-dir", str(out)]
    assert sweep.main([suite, *common, "--run-id", "wide"]) == 0
    recs = _lines(out / "wide" / "points.jsonl")
    # every request meets a 600 s SLO: 4 then 8 req/s pass, the top of the bracket, no capacity inside it
    assert [(r["policy"], r["load"], r["slo_attainment"]) for r in recs] == [
        ("full", 4, 1.0),
        ("full", 8, 1.0),
        ("scissorhands", 4, 1.0),
        ("scissorhands", 8, 1.0),
    ]
    assert all(r["status"] == "ok" and r["kv_layout"] == "paged" and r["scheduler"] == "mixed" for r in recs)
    assert [(r["capacity_status"], r["capacity_req_per_s"], r["capacity_lo_req_per_s"]) for r in recs[1::2]] == [
        ("at_least_max_rate", None, 8)
    ] * 2
    for a, b in ((recs[0], recs[2]), (recs[1], recs[3])):  # the same requests and arrival times at one rate
        assert (a["input_tokens"], a["scheduled_rate_req_per_s"]) == (b["input_tokens"], b["scheduled_rate_req_per_s"])
    assert "at_least_max_rate" in (out / "wide" / "table.md").read_text()
    # an SLO no request meets: 4, then 2 req/s fail, below the bracket
    assert (
        sweep.main([suite, *common, "--run-id", "tight", "--set", "slo.ttft_s=0.000001", "--set", "policies=[full]"])
        == 0
    )
    recs = _lines(out / "tight" / "points.jsonl")
    assert [(r["load"], r["slo_attainment"], r["capacity_status"]) for r in recs] == [
        (4, 0.0, "searching"),
        (2, 0.0, "below_min_rate"),
    ]
    assert (recs[-1]["capacity_req_per_s"], recs[-1]["capacity_hi_req_per_s"]) == (None, 2)
    assert (out / "tight" / "attainment_vs_rate.png").exists()


# ----------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "sets, message",
    [
        (["capacity.target_attainment=1.5"], "capacity.target_attainment: a fraction of requests in (0, 1]"),
        (["capacity.target_attainment=0"], "capacity.target_attainment: a fraction of requests in (0, 1]"),
        (["capacity.min_rate_req_per_s=160"], "the rate bracket [160, 160] req/s is empty or inverted"),
        (["capacity.min_rate_req_per_s=200"], "capacity.min_rate_req_per_s, capacity.max_rate_req_per_s"),
        (["capacity.min_rate_req_per_s=-1"], "capacity.min_rate_req_per_s: Input should be greater than 0"),
        (["capacity.resolution=0"], "capacity.resolution: the relative step between adjacent rates"),
        (["capacity.resolution=0.01", "capacity.min_rate_req_per_s=0.0001"], "capacity.resolution: 0.01 over"),
        (["capacity.max_probes=1"], "capacity.max_probes: a bracket takes at least 2 probes"),
        (["capacity=null"], "capacity: mode capacity needs the rate bracket"),
        (["loads=[1, 2]"], "loads: not used in mode capacity"),
        (["saturation={max_error_rate: 0.1}"], "saturation: not used in mode capacity"),
        (["mode=rate", "loads=[1]"], "capacity: only used in mode capacity"),
    ],
)
def test_bad_capacity_input_exits_2_naming_the_field_and_records_nothing(tmp_path, capsys, sets, message):
    args = [_suite(tmp_path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r")]
    assert sweep.main(args + [a for s in sets for a in ("--set", s)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    with pytest.raises(SuiteError, match=re.escape(message)):
        load_suite(_suite(tmp_path), sets)
