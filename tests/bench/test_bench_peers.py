"""`make bench-peers`'s pieces (bench/bench_peers.py, bench/peer_openvino.py): the ratio table and the token comparison
on known values, one request set for both sides, the eviction cap nearest our budgets, bad flags, the peer's job
parsing and its failures (a missing or broken virtualenv or export, a run that raises, a process that dies), and, in
the slow tier, a real run beside OpenVINO GenAI when its virtualenv exists."""

from __future__ import annotations

import json
import stat
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import bench_peers, peer_openvino
from bench.bench_peers import (
    DEFAULT_PEER_MODEL,
    DEFAULT_PEER_PYTHON,
    PeerUnavailable,
    check_peer,
    compare_tokens,
    eviction_cache_tokens,
    format_table,
    lengths,
    our_requests,
    parse_args,
    peer_job,
    request_set,
    summarize,
)
from bench.peer_openvino import Peer, blocks_for, parse_job
from replica.common.types import EngineConfig
from replica.engine import ContinuousBatchingEngine
from scissorhands import cache_policy
from scissorhands.models import load_tokenizer
from scissorhands.testing import tiny_llama

TINY = ["--model", "tiny-llama", "--requests", "4", "--prompt-tokens", "16,32", "--new-tokens", "4,8"]


def test_compare_tokens_counts_identical_requests_and_the_share_before_the_first_difference():
    ref = {"0": [1, 2, 3, 4], "1": [5, 6, 7, 8], "2": [9, 9], "3": [1]}
    other = {"0": [1, 2, 3, 4], "1": [5, 6, 0, 8], "2": [0, 9]}  # "3" failed on that side: not compared
    got = compare_tokens(ref, other)
    assert got == {
        "compared": 3,
        "identical": 1,
        "first_token_agreed": 2,  # "2" differs at its first token
        "mean_prefix_share": pytest.approx((1.0 + 0.5 + 0.0) / 3),
    }
    assert compare_tokens(ref, {})["mean_prefix_share"] is None
    # a shorter output that agrees as far as it goes parts where it ends
    assert compare_tokens({"0": [1, 2, 3, 4]}, {"0": [1, 2, 3]})["mean_prefix_share"] == 0.75


def _row(key, limit, tok_s, outputs=None, ok=True, label=None):
    return {
        "key": key,
        "label": label or key,
        "limit": limit,
        "kv_limit_bytes": 1000 if limit == "limit" else 5000,
        "kv_token_slots": 40,
        "ok": ok,
        "error": None if ok else "RuntimeError: Total number of aggregated SnapKV scores ...",
        "output_tok_per_s": tok_s if ok else None,
        "outputs": outputs or {},
    }


def test_summarize_gives_ratios_to_openvino_bf16_at_the_same_limit_and_tokens_for_the_full_rows():
    ours = {"0": [1, 2, 3, 4], "1": [5, 6, 7, 8]}
    rows = [
        _row("ours-full", "none", 150.0, ours),
        _row("ours-sh", "none", 120.0, {"0": [1, 2, 0, 0], "1": [5, 6, 7, 8]}),
        _row("ov-u8", "none", 390.0, {"0": [1, 2, 3, 4], "1": [5, 0, 7, 8]}),
        _row("ov-bf16", "none", 375.0, {"0": [1, 2, 3, 4], "1": [5, 6, 7, 8]}),
        _row("ours-full", "limit", 66.0, ours),
        _row("ov-bf16", "limit", 160.0, ours),
        _row("ov-evict", "limit", 0.0, ok=False),
    ]
    got = {(r["key"], r["limit"]): r for r in summarize(rows)}
    assert got["ours-full", "none"]["ratio"] == pytest.approx(0.4)
    assert got["ours-sh", "none"]["ratio"] == pytest.approx(0.32)
    assert got["ov-bf16", "none"]["ratio"] == pytest.approx(1.0)
    assert got["ours-full", "limit"]["ratio"] == pytest.approx(66 / 160)  # the denominator of its own limit
    assert got["ov-evict", "limit"]["ratio"] is None  # failed
    assert got["ours-full", "none"]["tokens"] == "reference"
    assert got["ours-sh", "none"]["tokens"] is None  # not a full row: its tokens differ by design
    assert got["ov-u8", "none"]["tokens"] == {
        "compared": 2,
        "identical": 1,
        "first_token_agreed": 2,
        "mean_prefix_share": 0.625,
    }
    assert got["ov-bf16", "limit"]["tokens"] == {
        "compared": 2,
        "identical": 2,
        "first_token_agreed": 2,
        "mean_prefix_share": 1.0,
    }
    table = format_table(list(got.values()))
    assert "| ours-full | none: 5,000 B | 40 | 150.0 | 0.40x | (reference) | (reference) |" in table
    assert "| ov-u8 | none: 5,000 B | 40 | 390.0 | 1.04x | 1/2 | 62.5% |" in table
    assert "| ov-evict | limit: 1,000 B | 40 | FAILED | - | - | - |" in table


def test_summarize_without_the_denominator_gives_no_ratio():
    got = summarize([_row("ours-full", "limit", 66.0), _row("ov-bf16", "limit", 0.0, ok=False)])
    assert [r["ratio"] for r in got] == [None, None]


def test_eviction_cache_picks_the_block_multiple_whose_held_tokens_are_nearest_our_budgets():
    totals = [100, 200, 300, 500]
    ours = [20, 40, 60, 100]  # ratio 5: 220 tokens held in all
    # caps of 16: 16 -> 64, 32 -> 128, 48 -> 192 (|-28|), 64 -> 256 (|+36|)
    assert eviction_cache_tokens(totals, ours, 16, 16) == 48
    assert eviction_cache_tokens(totals, ours, 32, 96) == 96  # the smallest valid cap already holds more
    assert eviction_cache_tokens([40, 40], [40, 40], 32, 32) == 64  # no eviction at all is nearest


def test_our_budgets_for_the_eviction_cap_are_the_ones_our_engine_runs_with_the_policys_floor():
    args = parse_args(["--ratio", "5"])
    policy = cache_policy(bench_peers.OURS_SH_POLICY)
    reqs = [{"prompt_ids": [1] * p, "max_new_tokens": n} for p, n in [(101, 100), (60, 40), (20, 10)]]
    # 201 -> ceil(201/5) = 41; 100 -> ceil = 20, raised to the floor of 32; 30 -> the floor capped at L = 30
    assert bench_peers.budgets(reqs, args.ratio, policy) == [41, 32, 30]
    engine = ContinuousBatchingEngine(
        tiny_llama(0),
        EngineConfig(policy=bench_peers.OURS_SH_POLICY, compression_ratio=5, budget="per_request"),
    )
    assert [engine.kv.budget_of(len(r["prompt_ids"]), r["max_new_tokens"]) for r in reqs] == [41, 32, 30]


def test_the_request_set_is_the_same_token_ids_for_both_sides():
    shape = lengths(16, (64, 256), (16, 256), seed=0)
    assert all(64 <= p <= 256 and 16 <= n <= 256 for p, n in shape)
    assert shape == lengths(16, (64, 256), (16, 256), seed=0) != lengths(16, (64, 256), (16, 256), seed=1)
    requests = request_set(load_tokenizer(), 49152, shape, seed=0)
    assert [len(r["prompt_ids"]) for r in requests] == [p for p, _ in shape]
    assert len({tuple(r["prompt_ids"]) for r in requests}) == 16  # each its own text
    args = parse_args([])
    peer_side = parse_job(
        peer_job(
            args,
            requests,
            [{"label": "x", "kv_precision": "bf16", "kv_limit_bytes": 10**8, "max_num_batched_tokens": 512}],
        )
    )
    ours = our_requests(requests)
    assert [(r.request_id, r.prompt_ids, r.max_new_tokens) for r in ours] == [
        (r["id"], r["prompt_ids"], r["max_new_tokens"]) for r in peer_side["requests"]
    ]
    assert (
        peer_side["threads"] == args.threads
        and peer_side["inference_precision"] == {"float32": "f32", "bfloat16": "bf16"}[args.dtype]
    )


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--rows", "ours-full,ov-fast"], "--rows"),
        (["--limits", "none,"], "--limits"),
        (["--prompt-tokens", "256,64"], "--prompt-tokens"),
        (["--new-tokens", "16"], "--new-tokens"),
        (["--requests", "0"], "--requests"),
        (["--ratio", "0.5"], "--ratio"),
        (["--eviction-start-tokens", "33"], "--eviction-start-tokens"),
        (["--eviction-cache-tokens", "64"], "--eviction-cache-tokens"),
        (["--dtype", "float16"], "--dtype"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_a_missing_peer_venv_exits_2_with_the_redo_step_and_our_rows_still_print(tmp_path, capsys):
    torch.set_num_threads(1)
    argv = TINY + ["--rows", "ours-full,ours-sh,ov-bf16", "--kv-limit-slots", "64", "--step-tokens", "64"]
    rc = bench_peers.main(argv + ["--peer-python", str(tmp_path / "nope" / "bin" / "python"), "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "step 'venv'" in err and "redo: make openvino-peer" in err
    ours = [line for line in out.splitlines() if line.startswith("| ours, ")]
    assert len(ours) == 8 and not any("FAILED" in line or "not run" in line for line in ours)  # table and schedule
    assert sum(line.startswith("| ours, ") for line in out.split("Our rows' schedule")[1].splitlines()) == 4
    assert out.count("| OpenVINO GenAI, full, bf16 KV | ") == 2 and out.count("| not run |") == 2
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [r["ok"] for r in doc["rows"]] == [True, True, False, True, True, False]
    assert len(json.loads((tmp_path / "requests.json").read_text())) == 4


def _fake_venv(tmp_path: Path, script: str | None, installed: bool = True) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    cfg = Path(sys.prefix) / "pyvenv.cfg"  # the python the symlink below runs reads it: keep its home
    (venv / "pyvenv.cfg").write_text(cfg.read_text() if cfg.exists() else "home = /usr/bin\n")
    if installed:
        (venv / ".installed").touch()
    py = venv / "bin" / "python"
    if script is None:
        py.symlink_to(sys.executable)  # a python without openvino_genai
    else:
        py.write_text("#!/bin/sh\n" + script)
        py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return py


def test_check_peer_names_the_failed_step_and_its_redo(tmp_path):
    py = _fake_venv(tmp_path, None, installed=False)
    with pytest.raises(
        PeerUnavailable,
        match=r"step 'venv': the build of .* did not finish \(no .installed\); redo: make openvino-peer",
    ):
        check_peer(str(py), str(tmp_path))
    (tmp_path / "venv" / ".installed").touch()
    with pytest.raises(
        PeerUnavailable,
        match=r"step 'venv': cannot import openvino_genai.*redo: rm -f .*venv/.installed && make openvino-peer",
    ):
        check_peer(str(py), str(tmp_path))


def test_check_peer_refuses_a_python_outside_a_virtualenv(tmp_path):
    py = tmp_path / "bin" / "python"
    py.parent.mkdir()
    py.symlink_to(sys.executable)
    with pytest.raises(
        PeerUnavailable, match=r"step 'venv': .* is not the python of a virtualenv; redo: make openvino"
    ):
        check_peer(str(py), "/m")


def test_check_peer_blames_the_export_when_the_model_folder_is_incomplete(tmp_path):
    py = _fake_venv(tmp_path / "a", 'echo "the exported model folder $4 lacks openvino_model.xml" >&2; exit 3\n')
    with pytest.raises(
        PeerUnavailable,
        match=r"step 'export': .*lacks openvino_model.xml; redo: rm -f /m/.exported && make openvino-peer",
    ):
        check_peer(str(py), "/m")
    ok = _fake_venv(tmp_path / "b", 'echo \'{"versions": {"openvino-genai": "9"}}\'\n')
    assert check_peer(str(ok), "/m") == {"openvino-genai": "9"}


def test_the_probe_reports_a_missing_export(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "openvino_genai", types.ModuleType("openvino_genai"))
    (tmp_path / "config.json").write_text("{}")
    assert peer_openvino.probe(str(tmp_path)) == 3
    assert "lacks openvino_model.xml, openvino_model.bin" in capsys.readouterr().err


def _job(**run) -> dict:
    return {
        "model_dir": "/m",
        "threads": 2,
        "inference_precision": "bf16",
        "block_tokens": 32,
        "requests": [
            {"id": "a", "prompt_ids": [1, 2, 3], "max_new_tokens": 4},
            {"id": "b", "prompt_ids": [4], "max_new_tokens": 2},
        ],
        "runs": [{"label": "r", "kv_precision": "u8", "kv_limit_bytes": 10**6, "max_num_batched_tokens": 512, **run}],
    }


def test_the_peer_script_parses_its_job_and_names_a_bad_field():
    job = parse_job(
        _job(eviction={"start_size": 32, "recent_size": 64, "max_cache_size": 160, "aggregation_mode": "SUM"})
    )
    run = job["runs"][0]
    assert run["dynamic_split_fuse"] is True and run["max_num_seqs"] == 256  # the peer's defaults
    assert run["eviction"] == {"start_size": 32, "recent_size": 64, "max_cache_size": 160, "aggregation_mode": "SUM"}
    assert [r["id"] for r in job["requests"]] == ["a", "b"]
    bad = [
        (_job(kv_precision="i4"), r"runs\[0\].kv_precision: 'i4'; accepted: u8, bf16, f16, f32"),
        (_job(kv_limit_bytes=0), r"runs\[0\].kv_limit_bytes: expected an integer >= 1, got 0"),
        (_job(dynamic_split_fuse="no"), r"runs\[0\].dynamic_split_fuse: expected true or false"),
        (
            _job(eviction={"start_size": 32, "recent_size": 48, "max_cache_size": 160, "aggregation_mode": "SUM"}),
            r"runs\[0\].eviction.recent_size: 48 is not a multiple of the KV block \(32 tokens\)",
        ),
        (
            _job(eviction={"start_size": 32, "recent_size": 32, "max_cache_size": 64, "aggregation_mode": "SUM"}),
            r"max_cache_size: 64 must exceed start_size \+ recent_size \(64\)",
        ),
        (
            _job(eviction={"start_size": 32, "recent_size": 32, "max_cache_size": 96, "aggregation_mode": "MAX"}),
            r"aggregation_mode: 'MAX'; accepted: SUM, NORM_SUM",
        ),
        ({**_job(), "inference_precision": "int8"}, r"inference_precision: 'int8'; accepted: f32, bf16, f16"),
        ({**_job(), "requests": [{"id": "a", "prompt_ids": [], "max_new_tokens": 1}]}, r"requests\[0\].prompt_ids"),
        ({**_job(), "requests": [{"id": "a", "prompt_ids": [1], "max_new_tokens": 1}] * 2}, "the ids repeat"),
        ({k: v for k, v in _job().items() if k != "threads"}, "job: missing 'threads'"),
    ]
    for doc, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_job(doc)


def test_blocks_for_rounds_the_byte_limit_down_to_whole_blocks():
    assert blocks_for(23_592_960, 737_280) == 32  # 1,024 slots of bf16 KV, SmolLM2-135M: 32 blocks of 32 tokens
    assert blocks_for(23_592_960 + 737_279, 737_280) == 32
    with pytest.raises(ValueError, match="kv_limit_bytes: 1000 B holds no KV block of 737280 B"):
        blocks_for(1000, 737_280)


def test_the_peer_script_refuses_a_bad_job_with_exit_2(tmp_path, capsys):
    (tmp_path / "job.json").write_text(json.dumps(_job(kv_precision="i4")))
    assert peer_openvino.main([str(tmp_path / "job.json"), str(tmp_path / "out.json")]) == 2
    assert "runs[0].kv_precision" in capsys.readouterr().err and not (tmp_path / "out.json").exists()


class _Status:
    def __init__(self, name):
        self.name = name


class _FakeGenai:
    """Just enough of openvino_genai's API for `Peer`: a pipeline that emits one token a step per request and, when
    told, raises mid-run as OpenVINO GenAI 2026.4 does with eviction and split-fuse on."""

    GenerationStatus = types.SimpleNamespace(FINISHED=_Status("FINISHED"), RUNNING=_Status("RUNNING"))
    AggregationMode = types.SimpleNamespace(SUM=0, NORM_SUM=1)
    raise_at_step = None

    class SchedulerConfig(types.SimpleNamespace):
        pass

    class GenerationConfig(types.SimpleNamespace):
        pass

    @staticmethod
    def CacheEvictionConfig(*args):
        return args

    def ContinuousBatchingPipeline(self, model_dir, sc, device, props):
        genai = self

        class Handle:
            def __init__(self, n):
                self.left, self.new = n, []

            def can_read(self):
                return bool(self.new)

            def read(self):
                out, self.new = types.SimpleNamespace(generated_ids=self.new), []
                return {0: out}

            def read_all(self):
                return [self.read()[0]]

            def get_status(self):
                return genai.GenerationStatus.FINISHED if self.left == 0 else genai.GenerationStatus.RUNNING

        class Pipe:
            steps = 0

            def __init__(self):
                self.handles = []

            def add_request(self, rid, ids, gc):
                self.handles.append(Handle(gc.max_new_tokens))
                return self.handles[-1]

            def has_non_finished_requests(self):
                return any(h.left for h in self.handles)

            def step(self):
                Pipe.steps += 1
                if genai.raise_at_step is not None and Pipe.steps == genai.raise_at_step:
                    raise RuntimeError(
                        "Total number of aggregated SnapKV scores during prefill phase may not be larger"
                    )
                for h in self.handles:
                    if h.left:
                        h.left -= 1
                        h.new.append(7)

            def get_metrics(self):
                return types.SimpleNamespace(kv_cache_size_in_bytes=2 * 1000, cache_usage=12.5)

        return Pipe()


def test_a_peer_run_that_raises_fails_its_requests_with_the_peers_message_and_the_next_run_still_runs():
    job = parse_job({**_job(), "runs": [_job()["runs"][0], {**_job()["runs"][0], "label": "s"}]})
    fake = _FakeGenai()
    fake.raise_at_step = 4  # steps 1-2: the block probe and the warm-up (1 and 2 tokens) take 1 + 2 steps
    peer = Peer(job, fake, types.SimpleNamespace(Tensor=lambda a: a), np)
    failed = peer.run(job["runs"][0])
    assert not failed["ok"] and failed["error"].startswith("RuntimeError: Total number of aggregated SnapKV scores")
    assert {k: v["error"] for k, v in failed["requests"].items()} == {"a": failed["error"], "b": failed["error"]}
    assert failed["num_kv_blocks"] == 10**6 // 1000 and failed["kv_token_slots"] == 1000 * 32
    fake.raise_at_step = None
    ok = peer.run(job["runs"][1])
    assert ok["ok"] and ok["output_tokens"] == 6 and ok["max_cache_usage"] == 12.5
    assert {k: v["output_ids"] for k, v in ok["requests"].items()} == {"a": [7] * 4, "b": [7] * 2}


def test_a_peer_process_that_dies_leaves_its_unreported_runs_failed_with_its_last_words(tmp_path):
    done = {"versions": {"openvino-genai": "9"}, "runs": {"one": {"ok": True, "requests": {}}}}
    py = _fake_venv(tmp_path, f"echo '{json.dumps(done)}' > $3; echo 'Segmentation fault' >&2; exit 139\n")
    args = parse_args(["--peer-python", str(py), "--peer-timeout-s", "60"])
    got = bench_peers.run_peer(args, {"runs": [{"label": "one"}, {"label": "two"}]})
    assert got["versions"] == {"openvino-genai": "9"} and got["runs"]["one"]["ok"]
    assert not got["runs"]["two"]["ok"]
    assert got["runs"]["two"]["error"] == "the peer process exited 139 before this run: Segmentation fault"


@pytest.mark.slow
@pytest.mark.skipif(
    not (DEFAULT_PEER_PYTHON.exists() and (DEFAULT_PEER_MODEL / "openvino_model.xml").exists()),
    reason="the peer's virtualenv or export is absent (.cache/venv-openvino, made by `make openvino-peer`)",
)
def test_ours_and_openvino_genai_run_the_same_requests_to_the_same_first_tokens(tmp_path, capsys):
    """The embedded model on both sides, 4 short requests under the 1,024-slot limit: every row measured, the same
    ids in, and our paged full's greedy tokens agree with OpenVINO's bf16-KV ones on at least the first token."""
    argv = ["--requests", "4", "--new-tokens", "8,16", "--threads", "2", "--limits", "limit"]
    rc = bench_peers.main(argv + ["--rows", "ours-full,ov-bf16,ov-evict", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 0, capsys.readouterr().out
    rows = {r["key"]: r for r in doc["rows"]}
    assert rows["ov-bf16"]["ratio"] == 1.0 and rows["ours-full"]["ratio"] > 0
    assert rows["ov-bf16"]["num_kv_blocks"] == 32  # 1,024 bf16 slots of 23,220 B hold 32 of its 737,280-B blocks
    tokens = rows["ov-bf16"]["tokens"]
    assert tokens["compared"] == tokens["first_token_agreed"] == 4  # every request's first token agrees
    assert doc["peer_versions"]["openvino-genai"].startswith("2026.")


def test_a_silent_peer_past_its_timeout_is_killed_and_its_runs_fail_saying_so(tmp_path):
    py = _fake_venv(tmp_path, "exec sleep 60\n")
    args = parse_args(["--peer-python", str(py), "--peer-timeout-s", "1"])
    got = bench_peers.run_peer(args, {"runs": [{"label": "one"}]})
    assert got["runs"]["one"]["error"] == "the peer process exited -9 before this run: killed after --peer-timeout-s 1"


def test_the_peer_rows_share_the_limit_and_step_and_eviction_runs_without_split_fuse_unless_asked():
    ev = {"start_size": 32, "recent_size": 32, "max_cache_size": 128, "aggregation_mode": "NORM_SUM"}
    runs = bench_peers.peer_runs(parse_args(["--step-tokens", "256"]), 123_456, ev)
    assert {k: (r["kv_precision"], r["kv_limit_bytes"], r["max_num_batched_tokens"]) for k, r in runs.items()} == {
        "ov-u8": ("u8", 123_456, 256),
        "ov-bf16": ("bf16", 123_456, 256),
        "ov-evict": ("bf16", 123_456, 256),
    }
    assert runs["ov-evict"]["dynamic_split_fuse"] is False and "max_cache_size 128" in runs["ov-evict"]["label"]
    assert "dynamic_split_fuse" not in runs["ov-bf16"]  # the peer's default: on
    on = bench_peers.peer_runs(parse_args(["--eviction-split-fuse"]), 123_456, ev)["ov-evict"]
    assert on["dynamic_split_fuse"] is True and "no split-fuse" not in on["label"]
    assert parse_job(
        peer_job(parse_args([]), [{"id": "0", "prompt_ids": [1], "max_new_tokens": 1}], list(runs.values()))
    )


def _our_row(argv: list[str], key: str, limit: str) -> dict:
    """`run_ours` of row `key` under `limit` on the tiny random model, as `measure_ours` runs it."""
    args = parse_args(TINY + argv)
    model, tokenizer = bench_peers.load_ours(args)
    model.generation_config.eos_token_id = None
    the = bench_peers.plan(args, model, tokenizer)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    _, fields = bench_peers.our_configs(args, the["limit_bytes"][limit], head_dim)[key]
    return bench_peers.run_ours(model, fields, our_requests(the["requests"]))


def test_our_rows_record_their_schedule_without_the_warm_up():
    """4 requests of 4, 4, 7 and 8 new tokens (prompts 20-30: all admitted in the first step, 512 tokens a step): each
    prompt its own prefill call, a prefill's rows decode in its step (2 tokens), so the longest ends after 8 - 1 = 7
    steps; rows in flight after steps 1-7: 4, 4, 2, 2, 2, 1, 0. The warm-up's step is not counted."""
    row = _our_row([], "ours-full", "none")
    assert row["ok"] and row["output_tokens"] == 4 + 4 + 7 + 8
    s = row["schedule"]
    assert (s["steps"], s["decode_steps"], s["prefill_calls"], s["peak_rows_in_flight"]) == (7, 7, 4, 4)
    assert s["mean_rows_in_flight"] == pytest.approx(15 / 7) and s["output_tokens_per_step"] == pytest.approx(23 / 7)
    assert (s["preemptions"], s["recomputed_tokens"]) == (0, 0)
    assert s["kv_pool_blocks"] > 0 and 0 < s["peak_kv_blocks_in_use"] <= s["kv_pool_blocks"]


@pytest.mark.parametrize("key", ["ours-full", "ours-sh"])
def test_a_rows_schedule_under_the_limit_is_the_same_at_every_run_and_printed_under_the_table(key):
    """The schedule separates admission from step time: under a limit that holds fewer rows than requests (64
    full-cache slots), two runs of one row give the same schedule, and the report's schedule table says it."""
    first, second = (_our_row(["--kv-limit-slots", "64"], key, "limit") for _ in range(2))
    assert first["ok"] and second["ok"]
    assert first["schedule"] == second["schedule"]
    assert first["schedule"]["peak_rows_in_flight"] < 4  # the limit binds
    table = bench_peers.format_schedule([{"label": key, "limit": "limit", **first}, {"label": "peer", "limit": "x"}])
    assert table.count("\n") == 2  # header, rule and this row: a peer row has no schedule
    assert f"| {key} | limit | {first['schedule']['steps']} |" in table
