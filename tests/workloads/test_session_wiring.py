"""A session's id from the load generator to the engine (in process, over HTTP as OpenAI's `user` field), a serving
policy entry's own `kv_reuse`, the point's session reuse counts, and session affinity over several replicas of the
in-process pool (`workloads.serving.pools.LocalReplicaPool`; `replica.common.session_affinity`). Serve's routing
is checked in tests/cluster/test_serve_routing.py and, through real Serve, tests/cluster/test_serve_session_affinity.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import requests
import yaml

from replica.common.session_affinity import keeps_session_state, session_replica
from replica.common.types import GenerationRequest
from replica.continuous import ServingReplica
from replica.openai_api import ReplicaBackend, build_app, cache_metadata
from tests.http_fakes import ServerThread
from workloads import sweep
from workloads.load.http_client import OpenAIHTTPClient
from workloads.load.lengths import LengthDist
from workloads.load.sessions import SessionSource, SessionSpec, plan_sessions
from workloads.serving.pools import LocalReplicaPool
from workloads.serving.suite import ServingSuite

ROOT = Path(__file__).resolve().parents[2]

SUITE = """
kind: serving
name: reuse-tiny
mode: sessions
model: tiny-llama
dtype: float32
device: cpu
policies: [{name: scissorhands, kv_reuse: none}, {name: scissorhands, kv_reuse: session_state}]
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
#: Scissorhands with its session's state kept, the paged layout it needs.
KEEPS = dict(
    policy="scissorhands",
    budget_tokens=16,
    kv_layout="paged",
    block_tokens=4,
    kv_memory_limit_bytes=400_000,
    kv_reuse="session_state",
)


# ---------------------------------------------------------------------------- the hash
def test_session_replica_is_the_same_for_any_order_spreads_sessions_and_moves_only_a_gone_replicas():
    replicas = ["a", "b", "c"]
    picks = {f"s{i}": session_replica(f"s{i}", replicas) for i in range(60)}
    assert all(session_replica(s, ["c", "a", "b"]) == r for s, r in picks.items())
    assert {r: list(picks.values()).count(r) > 5 for r in replicas} == {"a": True, "b": True, "c": True}
    after = {s: session_replica(s, ["a", "c"]) for s in picks}  # b left
    assert all(after[s] == r for s, r in picks.items() if r != "b")
    assert {after[s] for s, r in picks.items() if r == "b"} <= {"a", "c"}
    with pytest.raises(ValueError, match="replicas: no replica"):
        session_replica("s0", [])
    assert (keeps_session_state("session_state", False), keeps_session_state("none", True)) == (True, True)
    assert keeps_session_state("shared_prefix", False) is True
    assert keeps_session_state("none", False) is False


# ---------------------------------------------------------------------------- in process
def test_each_turn_of_a_session_carries_the_same_session_id_distinct_per_session():
    spec = SessionSpec(users=2, turns=2, message_tokens=3, think_time_s=0.0)
    sessions = plan_sessions(spec, LengthDist.parse("new_tokens", 2), seed=0)
    source = SessionSource(sessions, spec, seed=0, vocab_size=50, prefix="pt-1")
    first = source.assign(0, sessions[0], 0, source.opening(sessions[0]))
    second = source.assign(1, sessions[0], 1, list(first.prompt_ids) + [7, 8])
    other = source.assign(2, sessions[1], 0, source.opening(sessions[1]))
    assert (first.session_id, second.session_id, other.session_id) == ("pt-1-s0", "pt-1-s0", "pt-1-s1")


def test_a_policy_entry_sets_its_series_kv_reuse_on_the_same_sessions():
    suite = ServingSuite(**yaml.safe_load(SUITE))
    points = suite.points()
    assert [p.series for p in points] == [
        "sessions-scissorhands+reuse-none-r2",
        "sessions-scissorhands+reuse-session_state-r2",
    ]
    assert [suite.engine_config(p).kv_reuse for p in points] == ["none", "session_state"]
    assert suite.workload_seed(points[0]) == suite.workload_seed(points[1])  # paired: the same sessions


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("budget: fixed", "budget: per_request"), "policies[1].kv_reuse: 'session_state' keeps a session's row"),
        (("kv_layout: paged", "kv_layout: preallocated"), "policies[1].kv_reuse: 'session_state' keeps"),
        (
            (
                "{name: scissorhands, kv_reuse: none}",
                "{name: full, kv_reuse: session_state, enable_prefix_caching: true}",
            ),
            "policies[0].kv_reuse: 'session_state' keeps",
        ),
        (("kv_reuse: none}", "kv_reuse: chain}"), "policies[0].kv_reuse: expected one of none, session_state"),
    ],
)
def test_a_kv_reuse_the_engine_refuses_exits_2_at_load_naming_the_policy_entry(tmp_path, capsys, change, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(SUITE.replace(*change))
    assert sweep.main([str(bad), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_a_shared_prefix_entry_turns_its_series_prefix_cache_on_and_is_refused_where_it_cannot_share(tmp_path, capsys):
    text = SUITE.replace("kv_reuse: session_state}", "kv_reuse: shared_prefix}")
    suite = ServingSuite(**yaml.safe_load(text))
    configs = [suite.engine_config(p) for p in suite.points()]
    assert [(c.kv_reuse, c.enable_prefix_caching) for c in configs] == [("none", False), ("shared_prefix", True)]
    for change, message in [
        (("kv_layout: paged", "kv_layout: preallocated"), "policies[1].kv_reuse: 'shared_prefix' shares"),
        (
            ("kv_reuse: shared_prefix}", "kv_reuse: shared_prefix, enable_prefix_caching: false}"),
            "policies[1].enable_prefix_caching: kv_reuse 'shared_prefix' shares prompt blocks",
        ),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text.replace(*change))
        assert sweep.main([str(bad), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r")]) == 2
        assert message in capsys.readouterr().err


def test_kv_reuse_per_policy_outside_a_serving_suite_exits_2(tmp_path, capsys):
    quality = tmp_path / "quality.yaml"
    quality.write_text(
        "kind: quality\nname: q\nmodel: tiny-llama\npolicies: [{name: full, kv_reuse: session_state}]\n"
        "task: perplexity\n"
    )
    assert sweep.main([str(quality), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r")]) == 2
    assert "policies[0].kv_reuse: only a serving suite" in capsys.readouterr().err


def test_the_session_state_series_reuses_each_sessions_kept_cache_and_the_other_series_none(tmp_path):
    path = tmp_path / "reuse.yaml"
    path.write_text(SUITE)
    args = [str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r"), "--run-id", "p"]
    assert sweep.main(args) == 0
    none, kept = [json.loads(line) for line in (tmp_path / "r" / "p" / "points.jsonl").read_text().splitlines()]
    assert none["status"] == kept["status"] == "ok" and none["completed_requests"] == kept["completed_requests"] == 6
    assert none["input_tokens"] == kept["input_tokens"]  # the same sessions
    for k in ("session_reused_tokens", "session_state_hits", "session_reused_tokens_sum", "session_affinity_hits"):
        assert none[k] is None, k
    # 2 sessions x 3 turns: every turn after the first starts from its session's kept state
    assert (kept["session_state_hits"], kept["session_state_misses"], kept["session_recomputed_tokens"]) == (4, 0, 0)
    (stats,) = kept["replica_stats"]
    assert kept["session_reused_tokens"] == stats["session_reused_tokens"] > 0
    assert kept["session_reused_tokens_sum"] == kept["session_reused_tokens"]  # each turn's own count sums to it
    assert kept["cached_prompt_tokens"] == kept["session_reused_tokens"]
    # kept state never holds more than the conversation so far (what the workload expects to be reusable)
    assert kept["session_reused_tokens"] <= kept["expected_reuse_tokens"]
    assert kept["session_affinity_hits"] is None  # one replica: no affinity to judge
    table = (tmp_path / "r" / "p" / "table.md").read_text()
    assert "| session reused tokens |" in table and "session affinity hits" not in table
    row = next(line for line in table.splitlines() if line.startswith("| sessions-scissorhands+reuse-session_state"))
    assert [c.strip() for c in row.split("|")].count(str(kept["session_reused_tokens"])) == 1


# ---------------------------------------------------------------------------- several replicas in process
def _turns(client, sessions: list[str], turns: int = 2):
    """Every session's `turns` turns (each prompt = the last prompt + its answer + 2 new tokens), all sessions at
    once; returns {session: [result per turn]}."""

    async def one(sid: str):
        prompt, out = [1 + (hash(sid) % 7), 2, 3, 4, 5, 6, 7, 8, 9], []
        for k in range(turns):
            res = await client.generate(GenerationRequest(f"{sid}-t{k}", prompt, 3, session_id=sid))
            assert res.error_kind is None, res.error
            out.append(res)
            prompt = prompt + list(res.output_ids) + [10 + k, 11 + k]
        return sid, out

    async def go():
        return dict(await asyncio.gather(*(one(s) for s in sessions)))

    return asyncio.run(go())


def test_a_local_pool_of_two_sends_each_turn_to_its_sessions_replica_when_the_engine_keeps_state(model):
    pool = LocalReplicaPool(2, "tiny-llama", model=model)
    pool.start()
    try:
        pool.configure(KEEPS)
        sessions = [f"conv-{i}" for i in range(6)]
        home = {s: session_replica(s, ["local-0", "local-1"]) for s in sessions}
        assert set(home.values()) == {"local-0", "local-1"}  # these sessions live on both replicas
        results = _turns(pool.client(), sessions)
        for s, rs in results.items():
            assert [r.replica_id for r in rs] == [home[s], home[s]]
            assert [r.session_affinity_hit for r in rs] == [True, True]
        assert all(rs[1].session_reused_tokens > 0 for rs in results.values())
        stats = pool.stats(reset=True)
        assert [s["replica_id"] for s in stats] == ["local-0", "local-1"]
        assert sum(s["session_state_hits"] for s in stats) == 6 and sum(s["session_state_misses"] for s in stats) == 0
        # the engine keeps nothing: no affinity, the least busy replica, both used
        pool.configure(dict(KEEPS, kv_reuse="none"))
        results = _turns(pool.client(), sessions)
        assert all(r.session_affinity_hit is None for rs in results.values() for r in rs)
        assert {r.replica_id for rs in results.values() for r in rs} == {"local-0", "local-1"}
    finally:
        pool.close()


# ---------------------------------------------------------------------------- HTTP
def test_the_http_client_sends_the_session_as_user_and_the_server_passes_it_to_the_engine(model):
    r = ServingReplica(model=model, replica_id="s", model_spec="tiny-llama")
    r.configure(KEEPS)
    # no tokenizer: prompts as ids (the model's whole vocabulary, its answers' ids included)
    app = build_app({"m": ReplicaBackend(r, cache_metadata(KEEPS, 16, "tiny-llama"))}, None, context_tokens=256)
    client = OpenAIHTTPClient("http://x/v1", "m", session_per_request=True)
    assert client.body(GenerationRequest("a", [1, 2], 3, session_id="conv-9"))[1]["user"] == "conv-9"
    assert "user" not in client.body(GenerationRequest("a", [1, 2], 3))[1]
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    try:
        with ServerThread(app) as url:

            def post(body):
                return requests.post(url + "/v1/completions", json=dict(model="m", max_tokens=3, **body), timeout=60)

            first = post(dict(prompt=prompt, user="conv-9")).json()
            assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            again = prompt + first["choices"][0]["token_ids"] + [20, 21]
            second = post(dict(prompt=again, user="conv-9")).json()
            # the kept state: the first request's prompt and answer but its last token (fed by this prefill)
            assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt) + 3 - 1}
            other = post(dict(prompt=again, user="conv-10")).json()  # another session: nothing of conv-9's
            assert other["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            bad = post(dict(prompt=prompt, user=""))
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "user"
            stats = asyncio.run(r.stats())
            assert (stats["session_state_hits"], stats["session_reused_tokens"]) == (1, len(prompt) + 3 - 1)
            meta = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["metadata"]
            assert meta["kv_reuse"] == "session_state"
    finally:
        r.shutdown()


def test_the_sessions_suite_pairs_five_series_of_the_three_reuse_ways():
    raw = yaml.safe_load((ROOT / "workloads" / "suites" / "sessions.yaml").read_text())
    suite = ServingSuite(**raw)
    points = suite.points()
    configs = [suite.engine_config(p) for p in points]
    assert [(c.policy, c.compression_ratio, c.enable_prefix_caching, c.kv_reuse) for c in configs] == [
        ("full", None, False, "none"),
        ("full", None, True, "none"),
        ("scissorhands", 5.0, False, "none"),
        ("scissorhands", 5.0, False, "session_state"),
        ("scissorhands", 5.0, True, "shared_prefix"),  # shared_prefix turns the series' prefix cache on
    ]
    assert all(c.kv_layout == "paged" and c.budget == "fixed" for c in configs)
    assert len({suite.workload_seed(p) for p in points}) == 1  # paired: the same sessions
