"""Capacity at the SLO in sessions per second (`mode: capacity` with a `sessions:` block, workloads.serving.capacity):
the suite's session start rates on one grid, probes judged by the session SLO attainment (a session meets the SLO
when every one of its turns does), records and tables in sessions/s, resume, and the contradictions refused (exit 2)."""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import pytest
import yaml

from tests.serving_fakes import FakeReplica, OneReplicaPool, Script
from tests.suite_helpers import serving_suite
from workloads import sweep
from workloads.core.template import run_suite
from workloads.kinds import load_suite
from workloads.load import patterns
from workloads.serving.capacity import CapacitySearch
from workloads.serving.runner import ServingKind

SESSIONS = dict(users=4, turns=2, message_tokens=4, think_time_s=0.0, system_prompt_tokens=3)
BASE = serving_suite(
    name="cap-sessions",
    mode="capacity",
    dtype="float32",
    compression_ratios=[4],
    new_tokens=2,
    sessions=SESSIONS,
    capacity={
        "min_rate_sessions_per_s": 10,
        "max_rate_sessions_per_s": 160,
        "resolution": 1.0,
        "target_attainment": 0.5,
    },
    slo={"ttft_s": 0.1, "tpot_s": 1.0},
)


def _suite(tmp: Path, **kw) -> str:
    path = tmp / "cap.yaml"
    path.write_text(yaml.safe_dump({**BASE, **kw}))
    return str(path)


def _args(suite: str, results: Path, resume=None) -> argparse.Namespace:
    return argparse.Namespace(
        suite=suite,
        replicas=None,
        results_dir=str(results),
        run_id=None if resume else "run",
        resume=resume,
        address=None,
        pushgateway="off",
        set=[],
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_capacity_suite_with_sessions_probes_session_start_rates_of_one_grid_with_the_same_sessions(tmp_path):
    suite = load_suite(_suite(tmp_path))
    assert suite.pattern is patterns.SessionsLoad and suite.capacity.unit == "sessions/s"
    full = [p for p in suite.points() if p.policy == "full"]
    assert [p.load for p in full] == [10, 20, 40, 80, 160]
    slow, fast = (suite.load_config(p) for p in full[:2])
    assert (slow.mode, slow.session_rate_per_s, fast.session_rate_per_s) == ("sessions", 10, 20)
    assert slow.seed == fast.seed  # common random numbers: the same sessions, starts scaled to the rate
    sessions = patterns.SessionsLoad(slow).plan(suite.new_tokens)
    starts = [patterns.SessionsLoad(c).start_times_s(sessions) for c in (slow, fast)]
    assert [t * 10 for t in starts[0]] == pytest.approx([t * 20 for t in starts[1]])
    assert suite.record_columns(full[0])["session_rate"] == 10
    assert "session start rates from 10 to 160 sessions/s" in suite.capacity.describe()


class SessionRatePool(OneReplicaPool):
    """One scripted fake replica: above its policy's `passes_up_to` session rate (read from the request id, which
    names the point) every turn 1 answers after 0.3 s (over the SLO's 0.1 s TTFT) and every turn 0 at once, so half
    the requests meet the SLO and no session does. `kill_at`: the probe (1-based) whose configure is interrupted."""

    def __init__(self, passes_up_to: dict[str, float], kill_at: int | None = None):
        self.passes_up_to, self.kill_at = passes_up_to, kill_at
        self.probes: list[tuple[str, float | None]] = []

    def configure(self, cfg, run_id=None):
        if len(self.probes) + 1 == self.kill_at:
            raise KeyboardInterrupt("killed during this probe")
        policy, limit = cfg.policy, self.passes_up_to[cfg.policy]
        self.probes.append((policy, None))

        def script(req):
            rate = float(re.search(r"-L([^-]+)-s\d+-", req.request_id).group(1))
            self.probes[-1] = (policy, rate)
            late = rate > limit and req.request_id.endswith("-t1")
            return Script(ttft_s=0.3 if late else 0.001, gap_s=0.0005)

        self.replica = FakeReplica(script=script, clock=time.time)


def test_a_session_capacity_run_is_judged_by_the_session_attainment_and_recorded_in_sessions_per_s(tmp_path):
    pool = SessionRatePool({"full": 40, "scissorhands": 80})
    assert run_suite(_args(_suite(tmp_path), tmp_path / "r"), ServingKind(pool)) == 0
    assert pool.probes == [
        ("full", 40),
        ("full", 80),
        ("scissorhands", 40),
        ("scissorhands", 80),
        ("scissorhands", 160),
    ]
    recs = _lines(tmp_path / "r" / "run" / "points.jsonl")
    # above the limit half the requests meet the SLO (>= the 0.5 target) but no session does: the probe fails
    above = recs[1]
    assert (above["slo_attainment"], above["session_slo_attainment"], above["capacity_passed"]) == (0.5, 0.0, False)
    assert [(r["session_rate"], r["sessions"], r["capacity_passed"]) for r in recs] == [
        (40, 4, True),
        (80, 4, False),
        (40, 4, True),
        (80, 4, True),
        (160, 4, False),
    ]
    keys = ("capacity_status", "capacity_sessions_per_s", "capacity_lo_sessions_per_s", "capacity_hi_sessions_per_s")
    assert tuple(recs[1][k] for k in keys) == ("ok", 40, 40, 80)
    assert tuple(recs[4][k] for k in keys) == ("ok", 80, 80, 160)
    assert not any("capacity_req_per_s" in r for r in recs)  # the unit is in the keys
    table = (tmp_path / "r" / "run" / "table.md").read_text()
    assert "| capacity (sessions/s) |" in table and "passes / fails at (sessions/s)" in table
    assert re.search(r"\| capacity-full +\| +40 \| +40 / 80 \| +2 \| +0 \| +ok +\|", table)
    assert "session SLO attainment (a session meets the SLO when every one of its turns does)" in table
    assert (tmp_path / "r" / "run" / "attainment_vs_rate.png").stat().st_size > 1000


def test_an_interrupted_session_capacity_search_resumes_without_running_a_recorded_probe_again(tmp_path):
    suite = _suite(tmp_path)
    with pytest.raises(KeyboardInterrupt):  # killed during the full series' second probe
        run_suite(_args(suite, tmp_path / "r"), ServingKind(SessionRatePool({"full": 40, "scissorhands": 80}, 2)))
    assert [(r["load"], r["capacity_status"]) for r in _lines(tmp_path / "r" / "run" / "points.jsonl")] == [
        (40, "searching")
    ]
    pool = SessionRatePool({"full": 40, "scissorhands": 80})
    assert run_suite(_args(suite, tmp_path / "r", resume="run"), ServingKind(pool)) == 0
    assert pool.probes == [("full", 80), ("scissorhands", 40), ("scissorhands", 80), ("scissorhands", 160)]
    recs = _lines(tmp_path / "r" / "run" / "points.jsonl")
    assert len({r["point_id"] for r in recs}) == len(recs) == 5
    assert (recs[-1]["capacity_status"], recs[-1]["capacity_sessions_per_s"]) == ("ok", 80)


@pytest.mark.parametrize(
    "change, message",
    [
        (  # a session bracket without sessions
            {"sessions": None, "prompt_tokens": 8, "new_tokens": 2},
            "capacity.min_rate_sessions_per_s, capacity.max_rate_sessions_per_s: a search over session start rates "
            "needs a sessions: block",
        ),
        (  # a request bracket with sessions
            {"capacity": {"min_rate_req_per_s": 1, "max_rate_req_per_s": 2}},
            "with a sessions: block mode capacity searches session start rates: give min_rate_sessions_per_s",
        ),
        (  # both brackets
            {"capacity": {**BASE["capacity"], "min_rate_req_per_s": 1, "max_rate_req_per_s": 2}},
            "capacity: give one rate bracket",
        ),
        ({"capacity": {"min_rate_sessions_per_s": 1}}, "capacity: give one rate bracket"),
        ({"loads": [1.0]}, "loads: not used in mode capacity"),
        ({"capacity": None}, "capacity: mode capacity needs the rate bracket to search, e.g. capacity: "),
        (
            {"capacity": {"min_rate_sessions_per_s": 2, "max_rate_sessions_per_s": 1}},
            "the rate bracket [2, 1] sessions/s is empty or inverted",
        ),
    ],
)
def test_a_contradictory_session_capacity_suite_exits_2_naming_the_field(tmp_path, capsys, change, message):
    raw = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert sweep.main([str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").rglob("points.jsonl"))


def test_a_session_trace_cannot_be_searched_over_rates(tmp_path, capsys):
    trace = Path(__file__).parent / "data" / "sessions_trace.jsonl"
    path = tmp_path / "bad.yaml"
    raw = {**BASE, "sessions": {"trace_path": str(trace)}}
    raw.pop("new_tokens")
    path.write_text(yaml.safe_dump(raw))
    assert sweep.main([str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r")]) == 2
    assert "sessions.trace_path: a capacity search varies the session start rate" in capsys.readouterr().err


def test_a_request_capacity_search_keeps_its_keys_and_fields():
    spec = CapacitySearch(min_rate_req_per_s=1, max_rate_req_per_s=4, resolution=1)
    assert (spec.unit, spec.attainment_key, spec.grid()) == ("req/s", "slo_attainment", (1, 2, 4))


def test_the_sessions_capacity_suite_searches_the_series_of_the_sessions_suite_under_one_limit():
    root = Path(__file__).resolve().parents[2]
    raw = yaml.safe_load((root / "workloads" / "suites" / "sessions-capacity.yaml").read_text())
    suite = load_suite(str(root / "workloads" / "suites" / "sessions-capacity.yaml"))
    sessions = load_suite(str(root / "workloads" / "suites" / "sessions.yaml"))
    assert suite.pattern is patterns.SessionsLoad and suite.capacity.unit == "sessions/s"
    series = lambda s: list(  # noqa: E731
        dict.fromkeys(
            (c.policy, c.compression_ratio, c.enable_prefix_caching, c.kv_reuse)
            for c in (s.engine_config(p) for p in s.points())
        )
    )
    assert series(suite) == series(sessions)  # the same four series
    assert suite.sessions == sessions.sessions and raw["kv_memory_limit"] == {"full_sequences": 2}
    assert suite.capacity.grid() == (0.25, 0.5, 1, 2, 4) and suite.capacity.probes == 3
    assert len({suite.workload_seed(p) for p in suite.points()}) == 1  # paired at every rate
