"""make kvpress-parity's pieces (bench/kvpress_parity.py, bench/kvpress_peer.py) without kvpress: kvpress's kept-token
count, the comparison arithmetic on faked peer numbers, our side of the prompt-compression protocol against a plain
transformers cache compressed by hand as kvpress's presses compress it, and the peer script's protocol on our
transformers. The slow test compares the embedded model with kvpress's perplexities recorded on the results page."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from bench import baseline_defaults, kvpress_parity, kvpress_peer
from bench.kvpress_parity import GOAL_REL, compare, format_table, kept_tokens, main, perplexity_of, score_ours
from scissorhands.testing import tiny_llama

RECORDED_PEER = Path(__file__).with_name("data") / "kvpress_parity_peer.json"


def test_kept_tokens_is_kvpress_n_kept_for_compression_ratio_one_minus_one_over_ratio():
    assert kept_tokens(512, 5) == 102  # int(512 * 0.2 in floating point) = int(102.39...)
    assert kept_tokens(100, 2) == 50
    assert kept_tokens(3, 5) == 1  # never empty
    assert kept_tokens(64, 1) == 64


def _w(nll, n=10, kept=20):
    return {"nll_sum": nll, "tokens_scored": n, "kept_tokens": kept}


def test_compare_pools_nll_over_windows_and_marks_a_policy_beyond_one_percent():
    ours = {"full": [_w(20.0), _w(30.0)], "snapkv": [_w(22.0), _w(32.0)], "knorm": [_w(25.0), _w(35.0)]}
    peer = {"full": [_w(20.0), _w(30.0)], "snapkv": [_w(22.0), _w(31.9)], "knorm": [_w(25.0), _w(34.6)]}
    rows = {r["policy"]: r for r in compare(ours, peer)}
    assert rows["full"]["rel"] == 0.0 and rows["full"]["within"]
    assert rows["snapkv"]["perplexity_ours"] == pytest.approx(math.exp(54.0 / 20))
    assert rows["snapkv"]["rel"] == pytest.approx(math.exp(0.1 / 20) - 1)  # +0.501%
    assert rows["snapkv"]["within"]
    assert rows["knorm"]["rel"] == pytest.approx(math.exp(0.4 / 20) - 1)  # +2.02%
    assert not rows["knorm"]["within"]
    assert GOAL_REL == 0.01
    table = format_table(list(rows.values()))
    assert "| snapkv | SnapKVPress | 20, 20 |" in table and "+0.501% | yes |" in table and "+2.020% | NO |" in table


def test_compare_refuses_sides_that_scored_different_windows():
    with pytest.raises(ValueError, match="snapkv: the two sides scored different windows"):
        compare({"snapkv": [_w(1.0), _w(1.0)]}, {"snapkv": [_w(1.0)]})
    with pytest.raises(ValueError, match="different windows"):
        compare({"snapkv": [_w(1.0, n=10)]}, {"snapkv": [_w(1.0, n=9)]})
    with pytest.raises(ValueError, match="no tokens scored"):
        perplexity_of([])


@pytest.mark.parametrize("tool", [kvpress_parity, baseline_defaults], ids=["kvpress_parity", "baseline_defaults"])
def test_both_tools_help_gives_defaults_and_run_time(tool, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "(default:" in out and "Run time" in out and f"python -m {tool.__name__}" in out


def test_baseline_defaults_reads_a_run_as_policy_and_typed_fields():
    assert baseline_defaults.parse_run("snapkv:kernel_size=1, drop_tokens=1") == (
        "snapkv",
        {"kernel_size": 1, "drop_tokens": 1},
    )
    assert baseline_defaults.parse_run("scissorhands:threshold=0.5") == ("scissorhands", {"threshold": 0.5})
    assert baseline_defaults.parse_run("full") == ("full", {})
    with pytest.raises(ValueError, match="'drop_tokens' in 'h2o:drop_tokens' is not field=value"):
        baseline_defaults.parse_run("h2o:drop_tokens")


def test_parity_refuses_a_missing_peer_interpreter_before_loading_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        kvpress_parity.main(["--peer-python", str(tmp_path / "nope" / "python")])
    assert e.value.code == 2 and "--peer-python" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama(0)


def _by_hand(model, ids, prefix, keep) -> dict:
    """kvpress's protocol on a plain cache: prefix through the base model, each layer's keys and values cut to
    ``keep(layer_keys) -> (b, h, n_kept) indices``, tail at its true positions."""
    x = torch.tensor([ids])
    cache = DynamicCache()
    with torch.inference_mode():
        model.model(input_ids=x[:, :prefix], past_key_values=cache)
        for layer in cache.layers:
            idx = keep(layer.keys)[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
        pos = torch.arange(prefix, x.shape[1] - 1)[None]
        logits = model(input_ids=x[:, prefix:-1], past_key_values=cache, position_ids=pos).logits
    logp = torch.log_softmax(logits.float(), -1).gather(-1, x[:, prefix + 1 :, None])
    return {"nll_sum": float(-logp.double().sum()), "tokens_scored": x.shape[1] - 1 - prefix}


def test_our_prompt_compression_equals_a_cache_cut_by_hand_as_kvpress_cuts_it(model):
    ids = torch.randint(0, 128, (61,), generator=torch.Generator().manual_seed(3)).tolist()
    prefix, n_kept = 48, kept_tokens(48, 4)  # 12 of 48, tail of 12 scored

    def sliding(keys):  # StreamingLLMPress: 4 sinks + the newest
        kept = [*range(4), *range(prefix - (n_kept - 4), prefix)]
        return torch.tensor(kept).expand(keys.shape[0], keys.shape[1], -1)

    def lowest_norm(keys):  # KnormPress: top-k of -norm
        return (-keys.norm(dim=-1)).topk(n_kept, dim=-1).indices

    for policy, params, keep in [("streaming_llm", {}, sliding), ("knorm", {"recent_window": 0}, lowest_norm)]:
        ours = score_ours(model, policy, params, ids, prefix, n_kept)
        ref = _by_hand(model, ids, prefix, keep)
        assert ours["kept_tokens"] == n_kept and ours["tokens_scored"] == ref["tokens_scored"] == 12
        assert ours["nll_sum"] == pytest.approx(ref["nll_sum"], rel=1e-5), policy


def test_the_peer_script_protocol_without_a_press_equals_our_full_cache(model):
    ids = torch.randint(0, 128, (41,), generator=torch.Generator().manual_seed(4)).tolist()
    peer = kvpress_peer.score_window(model, None, ids, 30, torch, DynamicCache)
    ours = score_ours(model, "full", {}, ids, 30, 30)
    assert peer["tokens_scored"] == ours["tokens_scored"] == 10 and peer["kept_tokens"] == 30
    assert peer["nll_sum"] == pytest.approx(ours["nll_sum"], rel=1e-5)


@pytest.mark.slow
def test_embedded_model_stays_within_one_percent_of_kvpress_recorded_perplexities(tmp_path, capsys):
    """Our side of `make kvpress-parity` at its defaults against kvpress 0.5.5's numbers recorded on the results
    page (docs/results/2026-12-03-baseline-defaults.md): exit 0 means every policy within 1%."""
    rc = main(["--peer-json", str(RECORDED_PEER), "--out", str(tmp_path)])
    table = (tmp_path / "table.md").read_text()
    assert rc == 0, table
    assert json.loads((tmp_path / "ours.json").read_text()).keys() == {"full", "snapkv", "knorm", "streaming_llm"}
    assert table.count("| yes |") == 4
