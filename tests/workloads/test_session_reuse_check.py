"""A sessions point's reuse check (`workloads.serving.reuse`): a turn whose engine reported more cached prompt tokens
than it shares with earlier prompts and answers fails the point, as does a turn short of what its way of reuse holds
when nothing was reclaimed; the real engines (tiny model) pass, planted faults fail naming series, session and turn."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from replica.common.types import EngineConfig
from workloads import sweep
from workloads.load.metrics import RequestRecord
from workloads.serving import runner
from workloads.serving.pools import LocalReplicaPool
from workloads.serving.reuse import check_reuse, demanded_reuse_tokens


def _turn(session: int, turn: int, prompt: int, expected: int, cached: int | None, affinity=None) -> RequestRecord:
    rec = RequestRecord(f"p-s{session}-t{turn}", prompt, 2, send_time_s=0.0)
    rec.output_tokens, rec.token_times_s, rec.output_ids = 2, [0.1, 0.2], [5, 5]
    rec.session_id, rec.turn, rec.session_turns, rec.expected_reuse_tokens = session, turn, 2, expected
    rec.cached_prompt_tokens, rec.session_affinity_hit = cached, affinity
    return rec


PAGED = dict(kv_layout="paged", block_tokens=4, kv_memory_limit_bytes=400_000)
PREFIX = EngineConfig(policy="full", enable_prefix_caching=True, **PAGED)
STATE = EngineConfig(policy="scissorhands", budget_tokens=16, kv_reuse="session_state", **PAGED)
SHARED = EngineConfig(policy="scissorhands", budget_tokens=16, kv_reuse="shared_prefix", **PAGED)
FULL_SHARED = EngineConfig(policy="full", kv_reuse="shared_prefix", **PAGED)
STATS = [{"block_tokens": 4, "preemptions": 0, "prefix_cache_reclaimed_blocks": 0}]


def test_a_turn_cached_beyond_what_it_shares_fails_naming_series_session_and_turn():
    # session 1's turn 0 shares the 12-token system prompt with session 0; a reported 16 is 4 tokens it never shared
    turns = [_turn(0, 0, 20, 0, 0), _turn(1, 0, 20, 12, 16)]
    fields, error, _ = check_reuse(turns, STATS, PREFIX, "sessions-full+prefix")
    assert fields["reuse_check"] == "failed" and fields["reuse_over_turns"] == 1
    assert "series sessions-full+prefix, session 1 turn 0 (request p-s1-t0)" in error
    assert "reported 16 cached prompt tokens, more than the 12" in error
    # the whole prompt cached is a fault too: one token is always computed (its logits give the first token)
    _, error, _ = check_reuse([_turn(0, 1, 20, 20, 20)], STATS, STATE, "x")
    assert "more than the 19" in error
    # our engine keeping nothing may report nothing cached, even of what the sessions share
    _, error, _ = check_reuse([_turn(1, 0, 20, 12, 4)], [{}], EngineConfig(policy="full"), "sessions-full")
    assert "session 1 turn 0" in error and "more than the 0" in error
    # a kept session state is its own session's: a first turn finds none of it (another session's would be a fault)
    _, error, _ = check_reuse([_turn(1, 0, 20, 12, 4)], STATS, STATE, "s")
    assert "more than the 0" in error
    # another backend (OpenVINO's) is held to what the workload shares
    openvino = SimpleNamespace(engine="openvino", kv_reuse="none", enable_prefix_caching=False)
    assert check_reuse([_turn(1, 0, 20, 12, 12)], [{}], openvino, "s")[1] is None


def test_a_prefix_cache_must_hit_the_previous_prompt_in_whole_blocks_unless_it_reclaimed():
    prev, nxt = _turn(0, 0, 18, 0, 0), _turn(0, 1, 26, 20, 16)  # previous prompt 18 tokens: 4 whole blocks of 4
    assert demanded_reuse_tokens(nxt, prev, "prefix_cache", 4) == 16
    fields, error, _ = check_reuse([prev, nxt], STATS, PREFIX, "s")
    assert error is None and fields == {
        "reuse_check": "passed",
        "reuse_over_turns": 0,
        "reuse_short_turns": 0,
        "reuse_short_explained": None,
    }
    short = _turn(0, 1, 26, 20, 12)
    fields, error, _ = check_reuse([prev, short], STATS, PREFIX, "s")
    assert fields["reuse_short_turns"] == 1 and fields["reuse_short_explained"] is False
    assert "fewer than the 16 its prefix cache must reuse" in error and "reported no reclaimed block or state" in error
    for why in ({"prefix_cache_reclaimed_blocks": 30}, {"preemptions": 1}):  # memory pressure explains it
        fields, error, notes = check_reuse([prev, short], [{**STATS[0], **why}], PREFIX, "s")
        assert error is None and fields["reuse_short_explained"] is True and "reclaimed" in notes[0]


def test_a_shared_prefix_row_must_hit_the_previous_prompts_pinned_blocks_unless_it_reclaimed():
    # previous prompt 17 tokens: it pinned (and registered) floor(16 / 4) = 4 blocks; the next prompt may take 6
    prev, nxt = _turn(0, 0, 17, 0, 0), _turn(0, 1, 26, 20, 16)
    assert demanded_reuse_tokens(nxt, prev, "shared_prefix", 4) == 16
    # a prompt of 16 pins only 3 whole blocks (its last token is computed), where the full cache registers 4
    prev16, nxt16 = _turn(0, 0, 16, 0, 0), _turn(0, 1, 26, 20, 12)
    assert demanded_reuse_tokens(nxt16, prev16, "shared_prefix", 4) == 12
    assert demanded_reuse_tokens(nxt16, prev16, "prefix_cache", 4) == 16
    fields, error, _ = check_reuse([prev16, nxt16], STATS, SHARED, "s")
    assert error is None and fields["reuse_short_turns"] == 0
    fields, error, _ = check_reuse([prev, _turn(0, 1, 26, 20, 8)], STATS, SHARED, "sp")
    assert fields["reuse_check"] == "failed" and fields["reuse_short_turns"] == 1
    assert "series sp, session 0 turn 1" in error and "fewer than the 16 its shared prefix must reuse" in error
    # the full cache under shared_prefix is the prefix-cached full cache: whole blocks of the previous prompt
    _, error, _ = check_reuse([prev16, nxt16], STATS, FULL_SHARED, "f")
    assert "fewer than the 16 its prefix cache must reuse" in error


def test_a_shortfall_is_explained_only_by_the_replica_that_served_it_or_a_state_it_failed_to_keep():
    prev, short = _turn(0, 0, 18, 0, 0), _turn(0, 1, 26, 20, 12)
    prev.replica_id = short.replica_id = "a"
    quiet = {**STATS[0], "replica_id": "a"}
    busy = {**STATS[0], "replica_id": "b", "prefix_cache_reclaimed_blocks": 30}
    fields, error, _ = check_reuse([prev, short], [quiet, busy], PREFIX, "s")
    assert fields["reuse_short_explained"] is False and "fewer than the 16" in error
    fields, error, _ = check_reuse([prev, short], [{**quiet, "preemptions": 2}, busy], PREFIX, "s")
    assert error is None and fields["reuse_short_explained"] is True
    # a record naming no replica falls back to every replica of the point
    short.replica_id = None
    assert check_reuse([prev, short], [quiet, busy], PREFIX, "s")[1] is None
    # a session state the replica failed to keep explains its next turn's recompute
    state_prev, state_short = _turn(0, 0, 18, 0, 0), _turn(0, 1, 26, 22, 0)
    state_prev.replica_id = state_short.replica_id = "a"
    fields, error, _ = check_reuse([state_prev, state_short], [quiet], STATE, "k")
    assert fields["reuse_short_explained"] is False and error is not None
    fields, error, _ = check_reuse([state_prev, state_short], [{**quiet, "session_state_keep_failures": 1}], STATE, "k")
    assert error is None and fields["reuse_short_explained"] is True


def test_turn_zero_layers_and_a_turn_off_its_sessions_replica_are_not_demanded():
    # turn 0 found nothing of the system prompt (the earlier session had not finished its prefill): timing, no fault
    fields, error, _ = check_reuse([_turn(0, 0, 20, 0, 0), _turn(1, 0, 20, 12, 0)], STATS, PREFIX, "s")
    assert error is None and fields["reuse_short_turns"] == 0
    # served by another replica than its session's: its state is elsewhere
    prev, other = _turn(0, 0, 18, 0, 0), _turn(0, 1, 26, 20, 0, affinity=False)
    assert check_reuse([prev, other], STATS, PREFIX, "s")[1] is None


def test_a_kept_session_state_must_give_the_previous_prompt_and_answer_but_the_last_token():
    prev, nxt = _turn(0, 0, 18, 0, 0), _turn(0, 1, 26, 20, 19)
    assert demanded_reuse_tokens(nxt, prev, "session_state", 4) == 19
    stats = [{"block_tokens": 4, "session_states_reclaimed": 0, "preemptions": 0}]
    assert check_reuse([prev, nxt], stats, STATE, "s")[1] is None
    _, error, _ = check_reuse([prev, _turn(0, 1, 26, 20, 0)], stats, STATE, "s")
    assert "fewer than the 19 its session state must reuse" in error
    stats[0]["session_states_reclaimed"] = 1
    assert check_reuse([prev, _turn(0, 1, 26, 20, 0)], stats, STATE, "s")[1] is None


def test_a_server_whose_cache_outlives_the_point_is_warned_not_failed_and_unreported_counts_are_not_checked():
    turns = [_turn(0, 0, 20, 0, 16)]  # an earlier point sent the same system prompt to the server
    fields, error, notes = check_reuse(turns, STATS, PREFIX, "s", caches_outlive_points=True)
    assert error is None and fields["reuse_check"] == "not_checked" and "not a fault" in notes[0]
    fields, error, _ = check_reuse([_turn(0, 0, 20, 0, None)], STATS, PREFIX, "s")
    assert error is None and fields["reuse_check"] == "not_checked"


# ---------------------------------------------------------------------------- real engines, and planted faults
SUITE = """
kind: serving
name: reuse-check-tiny
mode: sessions
model: tiny-llama
dtype: float32
device: cpu
policies:
  - full
  - {name: full, enable_prefix_caching: true}
  - {name: scissorhands, kv_reuse: session_state}
  - {name: scissorhands, kv_reuse: shared_prefix}
compression_ratios: [2]
budget: fixed
kv_layout: paged
block_tokens: 4
kv_memory_limit_bytes: 400000
sessions: {users: 2, turns: 3, message_tokens: 6, think_time_s: 0.05, system_prompt_tokens: 12}
new_tokens: 3
loads: [4]
warmup_requests: 0
seed: 0
replicas: 1
"""


def _run(tmp_path: Path, pool=None, suite: str = SUITE) -> tuple[int, list[dict]]:
    path = tmp_path / "reuse.yaml"
    path.write_text(suite)
    args = [str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r"), "--run-id", "p"]
    if pool is None:
        rc = sweep.main(args)
    else:
        rc = runner.kind_main(runner.ServingKind(pool), args, runner.__doc__)
    lines = (tmp_path / "r" / "p" / "points.jsonl").read_text().splitlines()
    return rc, [json.loads(x) for x in lines]


def test_the_real_engines_reuse_what_the_sessions_share_pass_and_record_the_kv_they_held(tmp_path):
    rc, (full, prefix, kept, shared) = _run(tmp_path)
    assert rc == 0 and [r["status"] for r in (full, prefix, kept, shared)] == ["ok"] * 4
    assert [r["reuse_check"] for r in (full, prefix, kept, shared)] == ["passed"] * 4
    assert [r["reuse_over_turns"] for r in (full, prefix, kept, shared)] == [0, 0, 0, 0]
    assert [r["reuse_short_turns"] for r in (full, prefix, kept, shared)] == [None, 0, 0, 0]
    # a pass that reused something
    assert (
        prefix["cached_prompt_tokens"] > 0 and kept["cached_prompt_tokens"] > 0 and shared["cached_prompt_tokens"] > 0
    )
    # the KV kept between turns, beside the live peaks: none without state; pool bytes for both ways, bookkeeping
    # (outside the pool) only for the kept states
    assert (full["peak_held_kv_bytes"], full["peak_held_bookkeeping_bytes"]) == (None, None)
    for r in (prefix, kept):
        (stats,) = r["replica_stats"]
        assert r["peak_held_kv_bytes"] == stats["peak_held_kv_bytes"] > 0
        assert r["peak_held_kv_bytes_per_replica"] == [stats["peak_held_kv_bytes"]]
        assert r["peak_held_kv_bytes"] <= r["kv_memory_limit_bytes"]
    assert prefix["peak_held_bookkeeping_bytes"] == 0 and kept["peak_held_bookkeeping_bytes"] > 0
    assert "| peak held KV (MiB) |" in (tmp_path / "r" / "p" / "table.md").read_text()


def test_under_memory_pressure_the_real_engines_reclaim_and_their_shortfalls_pass_as_explained(tmp_path):
    tight = SUITE.replace("kv_memory_limit_bytes: 400000", "kv_memory_limit_bytes: 40000")
    tight = tight.replace("users: 2, turns: 3", "users: 4, turns: 3").replace("loads: [4]", "loads: [8]")
    rc, (full, prefix, kept, _) = _run(tmp_path, suite=tight)
    assert rc == 0 and [r["status"] for r in (full, prefix, kept)] == ["ok"] * 3
    reclaimed = 0
    for r, key in ((prefix, "prefix_cache_reclaimed_blocks"), (kept, "session_states_reclaimed")):
        assert r["reuse_check"] == "passed" and r["reuse_over_turns"] == 0
        (stats,) = r["replica_stats"]
        reclaimed += stats[key]
        # a turn short of its history passes only because the engine said it reclaimed (or preempted)
        assert r["reuse_short_turns"] == 0 or (r["reuse_short_explained"] is True and stats[key] + r["preemptions"] > 0)
    assert reclaimed > 0  # the limit is tight enough to take kept KV away


class Tampering:
    """A replica's client whose reply for request `request_id` reports `cached` prompt tokens (a planted fault)."""

    def __init__(self, replica, request_id: str, cached):
        self.replica, self.request_id, self.cached = replica, request_id, cached

    async def generate(self, req):
        res = await self.replica.generate(req)
        if req.request_id.endswith(self.request_id):
            res.cached_prompt_tokens = self.cached(res)
        return res


class TamperingPool(LocalReplicaPool):
    """The in-process tiny model whose reply for one turn lies about its cached prompt tokens."""

    def __init__(self, request_id: str, cached):
        super().__init__(1, "tiny-llama", device="cpu", dtype="float32")
        self.request_id, self.cached = request_id, cached

    def client(self):
        return Tampering(self.replica, self.request_id, self.cached)


ALL = (
    "sessions-full",
    "sessions-full+prefix",
    "sessions-scissorhands+reuse-session_state-r2",
    "sessions-scissorhands+reuse-shared_prefix-r2",
)


@pytest.mark.parametrize(
    "request_id, cached, message, faulty",
    [
        # over: more than the conversation so far, on every engine
        ("s1-t1", lambda res: res.prompt_tokens - 1, "session 1 turn 1 (request", ALL),
        # within the 12 shared system prompt tokens, but the plain full cache keeps nothing and a session state is
        # its own session's: only the prefix cache (and the shared prefix's pinned blocks) may have found them
        ("s1-t0", lambda res: 4, "session 1 turn 0", (ALL[0], ALL[2])),
        # short: the prefix cache, the kept state and the pinned prefix hold the history, and nothing was reclaimed
        ("s0-t2", lambda res: 0, "session 0 turn 2", ALL[1:]),
    ],
)
def test_a_planted_cached_count_fails_the_point_naming_the_series_session_and_turn(
    tmp_path, capsys, request_id, cached, message, faulty
):
    rc, records = _run(tmp_path, TamperingPool(request_id, cached))
    assert rc == 1
    by_series = {r["series"]: r for r in records}
    assert set(by_series) == set(ALL)
    for series, r in by_series.items():
        faulty_here = series in faulty
        assert r["status"] == ("error" if faulty_here else "ok"), series
        assert r["reuse_check"] == ("failed" if faulty_here else "passed"), series
        if faulty_here:
            assert r["stop_reason"] == "reuse mismatch"
            assert f"reuse mismatch: series {series}, {message}" in r["error"]
            assert r["completed_requests"] == 6  # the point's measurements are still recorded
    assert "reuse mismatch" in capsys.readouterr().out + (tmp_path / "r" / "p" / "table.md").read_text()
