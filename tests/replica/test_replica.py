"""ModelReplica as a plain class (no Ray): phases, counts, budgets, errors. Tier (b): tiny model."""

import pytest
import torch

from replica.model_loading import load_replica_model
from replica.static_batch import BatchSpec, ModelReplica
from scissorhands.testing import tiny_llama


@pytest.fixture(scope="module")
def replica():
    return ModelReplica(model=tiny_llama(seed=0), model_spec="tiny-llama", num_threads=1)


def point(**kw):
    base = dict(policy="full", batch_size=2, prompt_tokens=32, new_tokens=8, seed=0)
    base.update(kw)
    return BatchSpec(**base)


def test_greedy_ids_match_generate(replica):
    """The own prefill/decode loop produces the same greedy ids as transformers' generate."""
    p = point(batch_size=3, prompt_tokens=24, new_tokens=12, seed=3)
    ids = replica.generate_ids(p)
    prompts = replica._prompt_ids(p)
    assert prompts.shape == (3, 24)
    ref = replica.model.generate(
        prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12, min_new_tokens=12, do_sample=False
    )
    assert torch.equal(ids, ref[:, 24:])


def test_metrics_counts_and_units(replica):
    m = replica.run_batch(point(batch_size=4, prompt_tokens=40, new_tokens=10))
    assert m["input_tokens"] == 4 * 40
    assert m["output_tokens"] == 4 * 10
    assert len(m["decode_step_s"]) == 9
    assert m["ttft_s"] == m["prefill_s"] > 0
    assert m["decode_s"] == pytest.approx(sum(m["decode_step_s"]))
    assert m["e2e_latency_s"] == pytest.approx(m["prefill_s"] + m["decode_s"])
    assert m["decode_tokens_per_s"] == pytest.approx(4 * 9 / m["decode_s"])
    assert m["output_throughput_tok_per_s"] == pytest.approx(40 / m["e2e_latency_s"])
    assert m["total_throughput_tok_per_s"] == pytest.approx((160 + 40) / m["e2e_latency_s"])
    assert m["tpot_s"] == pytest.approx(m["decode_s"] / 9)
    assert 0 < m["process_cpu_s"] < 60
    assert m["budget_tokens"] is None
    assert m["cache_seq_length"] == 40 + 9  # the last generated token is never fed back
    # full cache, float32: 2 layers x 2 KV heads x head_dim 16 x (K and V) x 4 bytes per token and sequence
    assert m["kv_cache_bytes"] >= 4 * 49 * 2 * 2 * 16 * 2 * 4
    assert m["peak_rss_bytes"] > 50 * 2**20
    assert m["torch_threads"] == 1 and m["replica_id"] == "replica-0" and m["model_id"] == "tiny-llama"


def test_one_new_token_has_no_decode_rate(replica):
    m = replica.run_batch(point(new_tokens=1))
    assert m["decode_step_s"] == [] and m["decode_tokens_per_s"] is None and m["tpot_s"] is None
    assert m["output_tokens"] == 2


def test_budget_from_ratio_and_absolute(replica):
    full = replica.run_batch(point(batch_size=2, prompt_tokens=64, new_tokens=16))
    r5 = replica.run_batch(
        point(
            policy="scissorhands",
            compression_ratio=5,
            policy_params={"min_budget_tokens": 0},  # the bare ratio: the floor (32) would hold 2.5x
            batch_size=2,
            prompt_tokens=64,
            new_tokens=16,
        )
    )
    assert r5["budget_tokens"] == 16  # ceil((64 + 16) / 5)
    # 1/5 of full plus the stated bookkeeping (slot times + uint8 count buckets: 12 B per 128 B slot here)
    assert r5["kv_cache_bytes"] <= full["kv_cache_bytes"] / 5 * 1.15
    b = replica.run_batch(point(policy="scissorhands", budget_tokens=24, batch_size=2, prompt_tokens=64, new_tokens=4))
    assert b["budget_tokens"] == 24


def test_prompt_ids_are_used_and_checked(replica):
    ids = [[1, 2, 3, 4], [5, 6, 7, 8]]
    m = replica.run_batch(point(prompt_tokens=4, new_tokens=2, prompt_ids=ids))
    assert m["input_tokens"] == 8
    with pytest.raises(ValueError, match="prompt_ids"):
        replica.run_batch(point(prompt_tokens=5, new_tokens=2, prompt_ids=ids))


def test_prompt_fn_gets_tokenizer_and_seed():
    calls = []

    def prompt_fn(tokenizer, n, prompt_tokens, seed):
        calls.append((tokenizer, n, prompt_tokens, seed))
        return [[7] * prompt_tokens for _ in range(n)]

    r = ModelReplica(
        model=tiny_llama(seed=0), tokenizer="TOK", model_spec="tiny-llama", prompt_fn=prompt_fn, warmup=False
    )
    r.run_batch(point(batch_size=3, prompt_tokens=5, new_tokens=2, seed=11))
    assert calls == [("TOK", 3, 5, 11)]


def test_invalid_policy_raises_naming_it(replica):
    with pytest.raises(ValueError, match="nonsense"):
        replica.run_batch(point(policy="nonsense", compression_ratio=2))


def test_missing_model_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_replica_model(str(missing))


def test_replica_dtype_auto_is_resolved_and_recorded(monkeypatch):
    from scissorhands import models as sh_models

    monkeypatch.setattr(sh_models.dtype, "cpu_flags", lambda: frozenset({"avx512_bf16"}))  # the probe decides
    monkeypatch.setattr(sh_models.dtype, "probe_bfloat16_speedup", lambda *a: 2.0)
    r = ModelReplica(model_spec="tiny-llama", num_threads=1, warmup=False)  # dtype defaults to "auto"
    info = r.info()
    assert info["dtype"] == "bfloat16" and "avx512_bf16" in info["dtype_reason"] and "2.00x" in info["dtype_reason"]
    assert (
        ModelReplica(model_spec="tiny-llama", dtype="float32", num_threads=1, warmup=False).info()["dtype"] == "float32"
    )
    with pytest.raises(ValueError, match="dtype: expected one of auto, float32, bfloat16, float16"):
        load_replica_model("tiny-llama", dtype="int8")


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu", ""])
def test_a_bad_device_is_refused_naming_the_field_before_any_load(device):
    """One check (`scissorhands.models.check_device_name`) for the loader and the run's dtype resolution, which
    the suites and `make serve` go through; a bad device failed inside torch after Ray had started before."""
    from cluster.dtype_probe import resolve_run_dtype
    from cluster.serve_app import main as serve_main

    msg = f"device: expected cpu, cuda or cuda:<index>, got '{device}'"
    with pytest.raises(ValueError) as e:
        load_replica_model("tiny-llama", dtype="float32", device=device)
    assert str(e.value) == msg
    with pytest.raises(ValueError) as e:
        resolve_run_dtype("tiny-llama", "auto", device)
    assert str(e.value) == msg
    assert serve_main(["--model", "tiny-llama", "--device", device]) == 2


def test_good_devices_pass_the_check():
    from scissorhands.models import is_device_name

    assert all(is_device_name(d) for d in ("cpu", "cuda", "cuda:0", "cuda:12", torch.device("cpu")))
    assert not any(is_device_name(d) for d in ("CPU", "cuda:", "mps", "cuda:0:1", "cpu "))
