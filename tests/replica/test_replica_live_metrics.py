"""ModelReplica feeds the live replica metrics (replica.metrics.ReplicaMetrics, in memory, no Ray).

Tier (b): the tiny random-weight model, a few forwards per test.
"""

import pytest

from replica.metrics import ReplicaMetrics, _LocalRecorder
from replica.static_batch import BatchSpec, ModelReplica
from scissorhands.testing import tiny_llama


class _Trace(_LocalRecorder):
    """The in-memory recorder, plus every (metric, value, labels) in the order recorded."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, float, dict]] = []

    def record(self, spec, value, tags):
        self.calls.append((spec.name.removeprefix("scissorhands_"), value, dict(tags)))
        super().record(spec, value, tags)

    def values_of(self, name: str) -> list[float]:
        return [v for n, v, _ in self.calls if n == name]


@pytest.fixture(scope="module")
def replica():
    metrics = ReplicaMetrics("full", None, "replica-7", "tiny-llama", "run-live", use_ray=False)
    metrics._recorder = _Trace()
    return ModelReplica(model=tiny_llama(seed=0), model_spec="tiny-llama", num_threads=1, metrics=metrics)


@pytest.fixture
def trace(replica):
    replica.live_metrics._recorder = trace = _Trace()  # shared by every point's child recorder
    return trace


def _snapshot(replica, policy, ratio):
    return {
        k.removeprefix("scissorhands_"): v for k, v in replica.live_metrics.for_point(policy, ratio).snapshot().items()
    }


def test_warmup_and_an_injected_model_record_nothing():
    metrics = ReplicaMetrics("full", None, "r", "tiny-llama", "run", use_ray=False)
    ModelReplica(model=tiny_llama(seed=0), model_spec="tiny-llama", num_threads=1, metrics=metrics, warmup=True)
    assert metrics._recorder.values == {}


def test_loading_the_model_records_its_load_time():
    metrics = ReplicaMetrics("full", None, "r", "tiny-llama", "run", use_ray=False)
    ModelReplica(model_spec="tiny-llama", num_threads=1, metrics=metrics, warmup=False)
    [load_s] = metrics._recorder.values["scissorhands_model_load_seconds"].values()
    assert 0 < load_s < 120


def test_run_batch_records_counts_per_sequence_and_per_step(replica, trace):
    batch, prompt, new = 3, 32, 8
    out = replica.run_batch(BatchSpec(policy="full", batch_size=batch, prompt_tokens=prompt, new_tokens=new, seed=0))
    snap = _snapshot(replica, "full", None)
    assert snap["generated_tokens_total"] == batch * new == out["output_tokens"]
    assert snap["prefill_tokens_total"] == batch * prompt
    assert snap["prefill_seconds"] == (1, pytest.approx(out["prefill_s"]))
    assert snap["ttft_seconds"] == (batch, pytest.approx(batch * out["ttft_s"]))  # one per sequence
    assert snap["decode_step_seconds"] == (new - 1, pytest.approx(sum(out["decode_step_s"])))  # one per step
    assert snap["decode_batch_size"] == (new - 1, batch * (new - 1))
    assert snap["tpot_seconds"] == (batch, pytest.approx(batch * out["tpot_s"]))
    assert "evicted_tokens_total" not in snap  # the full cache never evicts
    # gauges: the batch while it runs, nothing queued, then 0 and an empty cache at the end
    assert trace.values_of("running_sequences") == [batch, 0]
    assert trace.values_of("queued_sequences") == [0]
    # after the prefill and every decode step: slots = tokens fed so far, per KV head, summed over sequences
    assert trace.values_of("kv_cache_slots") == [batch * (prompt + i) for i in range(new)] + [0]
    kv_bytes = trace.values_of("kv_cache_bytes")
    assert kv_bytes[-1] == 0 and max(kv_bytes) == out["kv_cache_bytes"] and all(b > 0 for b in kv_bytes[:-1])
    assert {
        (t["policy"], t["compression_ratio"], t["replica"], t["model"], t["run_id"]) for _, _, t in trace.calls
    } == {("full", "1", "replica-7", "tiny-llama", "run-live")}


def test_evictions_and_slots_of_a_budgeted_cache(replica, trace):
    batch, prompt, new, ratio = 2, 32, 8, 2
    out = replica.run_batch(
        BatchSpec(
            policy="h2o",
            compression_ratio=ratio,
            policy_params={"min_budget_tokens": 0},  # the bare ratio: 40 tokens would keep the floor's 32
            batch_size=batch,
            prompt_tokens=prompt,
            new_tokens=new,
            seed=1,
        )
    )
    budget = out["budget_tokens"]
    assert budget == (prompt + new) // ratio == 20
    snap = _snapshot(replica, "h2o", ratio)
    # H2O keeps exactly B slots: every token seen past B is evicted once, per sequence
    assert snap["evicted_tokens_total"] == batch * (out["cache_seq_length"] - budget) == 2 * (39 - 20)
    assert trace.values_of("kv_cache_slots") == [batch * budget] * new + [0]
    assert sum(trace.values_of("evicted_tokens_total")) == snap["evicted_tokens_total"]
    assert len(trace.values_of("evicted_tokens_total")) == new  # after the prefill and after every step
    assert {t["compression_ratio"] for _, _, t in trace.calls} == {"2"}


def test_a_failing_point_leaves_the_gauges_at_zero(replica, trace, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("decode failed")

    monkeypatch.setattr(replica, "decode_step", boom)
    with pytest.raises(RuntimeError, match="decode failed"):
        replica.run_batch(BatchSpec(policy="full", batch_size=2, prompt_tokens=16, new_tokens=4, seed=0))
    assert trace.values_of("running_sequences") == [2, 0]
    assert trace.values_of("kv_cache_slots")[-1] == 0 and trace.values_of("kv_cache_bytes")[-1] == 0


def test_generate_ids_records_nothing(replica, trace):
    replica.generate_ids(BatchSpec(policy="full", batch_size=1, prompt_tokens=8, new_tokens=3, seed=0))
    assert trace.calls == []
