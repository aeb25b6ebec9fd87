"""Every registered policy: validated parameters, documented sources, and selections equal to a slow
pure-python reference of its rule.

The reference replays the same forward calls: it takes the attention probabilities the layer handed
to the policy (recorded on layer 0) and decides, with plain lists and dicts, which tokens each row
and KV head keeps (Algorithm 1's schedule, Algorithm 2's protections and ties, each policy's score).
After every call the layer's kept tokens must be exactly the reference's.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import pytest
import torch

from scissorhands import POLICIES, make_cache
from scissorhands.models import load_model
from scissorhands.policies.random import _MASK62
from scissorhands.testing import tiny_llama
from workloads.quality.perplexity import heldout_windows, perplexity

EVICTING = [name for name, cls in POLICIES.items() if cls.evicts]
SOURCES = {
    "scissorhands": "2305.17118",
    "streaming_llm": "2309.17453",
    "h2o": "2306.14048",
    "tova": "2401.06104",
    "knorm": "2406.11430",
    "snapkv": "2404.14469",
}


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama(0)


# ----------------------------------------------------------------------------- parameters and docs
def test_registry_holds_scissorhands_and_every_baseline():
    assert set(POLICIES) >= {"full", "scissorhands", "streaming_llm", "h2o", "tova", "random", "knorm", "snapkv"}
    for name, cls in POLICIES.items():
        assert cls.name == name
        assert dataclasses.is_dataclass(cls)


@pytest.mark.parametrize("name", list(POLICIES))
def test_docstring_says_what_it_keeps_and_cites_the_paper(name):
    import importlib

    module = importlib.import_module(POLICIES[name].__module__)
    doc = (module.__doc__ or "") + (POLICIES[name].__doc__ or "")
    assert "keep" in doc.lower()
    if name in SOURCES:
        assert f"arXiv {SOURCES[name]}" in doc


@pytest.mark.parametrize("name", EVICTING)
@pytest.mark.parametrize(
    "field,bad", [("recent_window", -1), ("recent_window", 1.5), ("drop_tokens", 0), ("drop_tokens", True)]
)
def test_shared_fields_are_validated_and_named(name, field, bad):
    with pytest.raises(ValueError, match=field):
        POLICIES[name](**{field: bad})


@pytest.mark.parametrize(
    "name,field,bad",
    [
        ("scissorhands", "history_window", 0),
        ("scissorhands", "threshold", 0.0),
        ("scissorhands", "count_chunk_steps", 7),
        ("scissorhands", "count_chunk_steps", 400),
        ("streaming_llm", "n_sink", -1),
        ("random", "seed", -3),
        ("random", "seed", "a"),
        ("snapkv", "window_size", 0),
        ("snapkv", "kernel_size", 4),
        ("snapkv", "kernel_size", True),
    ],
)
def test_policy_fields_are_validated_and_named(name, field, bad):
    with pytest.raises(ValueError, match=field):
        POLICIES[name](**{field: bad})


def test_unknown_policy_and_parameter_name_the_valid_ones(model):
    with pytest.raises(ValueError, match="valid policies: full, scissorhands"):
        make_cache("nope", model, budget_tokens=8)
    with pytest.raises(ValueError, match="n_sink"):
        make_cache("h2o", model, budget_tokens=8, n_sink=2)


@pytest.mark.parametrize(
    "name,budget,expect",
    [
        ("scissorhands", 64, (10, 32)),
        ("scissorhands", 8, (4, 4)),
        ("random", 64, (10, 32)),
        ("h2o", 64, (32, 1)),
        ("tova", 64, (0, 1)),
        ("streaming_llm", 64, (10, 1)),
        ("streaming_llm", 8, (2, 1)),
        ("snapkv", 39, (19, 1)),  # one token per decode step: B // 2 left one slot outside the window at 5x of 192
        ("snapkv", 128, (32, 1)),
        ("knorm", 64, (10, 32)),
    ],
)
def test_default_recent_window_and_drop_tokens(name, budget, expect):
    assert POLICIES[name]().resolve(budget) == expect


def test_streaming_sinks_shrink_to_fit_a_tiny_budget_and_explicit_windows_are_checked():
    p = POLICIES["streaming_llm"]()
    assert p.sink_tokens(64) == 4 and p.sink_tokens(3) == 2 and p.resolve(1) == (0, 1)
    with pytest.raises(ValueError, match="budget_tokens"):
        POLICIES["streaming_llm"](recent_window=5).resolve(9)  # 5 + 4 sinks + 1 > 9
    with pytest.raises(ValueError, match="drop_tokens"):
        POLICIES["scissorhands"](recent_window=4, drop_tokens=5).resolve(8)


def test_state_dtypes_counts_are_integers_and_attention_sums_float32():
    assert POLICIES["scissorhands"].state_dtype == torch.uint8
    assert POLICIES["h2o"].state_dtype == torch.float32 and POLICIES["tova"].state_dtype == torch.float32


def test_random_scores_are_seeded_uniform_and_fresh_per_eviction():
    p = POLICIES["random"](seed=1)
    idx = torch.arange(4000).view(1, 1, -1).expand(2, 2, -1)  # (b, h, S) token indices
    a = p.keep_score(None, idx, layer_idx=0, budget_tokens=8)
    assert torch.equal(a, p.keep_score(None, idx, layer_idx=0, budget_tokens=8))  # deterministic
    assert torch.equal(a[0], a[1])  # a row's draw depends on its tokens only
    assert not torch.equal(a[:, 0], a[:, 1])  # heads differ
    assert not torch.equal(a, POLICIES["random"](seed=2).keep_score(None, idx, layer_idx=0, budget_tokens=8))
    assert not torch.equal(a, p.keep_score(None, idx, layer_idx=1, budget_tokens=8))
    later = p.keep_score(None, torch.cat([idx, idx[..., :1] + 4000], -1), layer_idx=0, budget_tokens=8)
    assert not torch.equal(a, later[..., :-1])  # a new eviction draws anew
    assert 0 <= float(a.min()) and float(a.max()) < 1
    hist = torch.histc(a[0, 0].float(), bins=10, min=0, max=1)  # 4000 draws, 400 expected per bin
    assert int(hist.min()) > 300 and int(hist.max()) < 500


# ----------------------------------------------------------------------------- the pure-python reference
def _py_mix(x: int) -> int:
    for mul in (0x2545F4914F6CDD1D & _MASK62, 0x1B873593):
        x = (x ^ (x >> 29)) & _MASK62
        x = (x * mul) & _MASK62
    return x ^ (x >> 31)


def _py_random(seed: int, token: int, seen: int, head: int, layer: int) -> float:
    x = token + (seen << 20) + (head << 44) + (layer << 50)
    x = _py_mix(_py_mix(x ^ (seed & 0xFFFFFFFF)) + seed)
    return (x & ((1 << 53) - 1)) / float(1 << 53)


class Recorder:
    """Stands in for layer 0's policy: records what ``init_state`` and ``observe`` get, then delegates."""

    def __init__(self, policy, layer):
        self._policy, self._layer, self.log, self.keys = policy, layer, [], []

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def init_state(self, keys, values):
        self.keys.append(keys.clone())
        return self._policy.init_state(keys, values)

    def observe(self, state, probs, visible, first_query):
        self.log.append(
            (
                probs.clone(),
                None if visible is None else visible.expand(probs.shape).clone(),
                first_query,
                self._layer.slot_time.clone(),
            )
        )
        self._policy.observe(state, probs, visible, first_query)


class Reference:
    """The policy's rule on plain lists: kept[row][head] = sorted token times (padding-inclusive clock)."""

    def __init__(self, cache, batch: int, heads: int):
        self.policy, self.budget = cache.policy, cache.budget
        self.kept = [[[] for _ in range(heads)] for _ in range(batch)]
        self.obs = [[defaultdict(dict) for _ in range(heads)] for _ in range(batch)]  # t -> {slot time: (p, n_t)}
        self.key_norm = [[{} for _ in range(heads)] for _ in range(batch)]  # slot time -> L2 norm
        self.pads = [0] * batch
        self.heads = heads

    def record(self, log):
        for probs, visible, first, slot_time in log:
            b, h, q, s = probs.shape
            p, st = probs.tolist(), slot_time.tolist()
            vis = visible.tolist() if visible is not None else None
            for i in range(b):
                for j in range(h):
                    for k in range(q):
                        seen = [x for x in range(s) if (vis[i][j][k][x] if vis is not None else True)]
                        for x in seen:
                            self.obs[i][j][first + k][st[i][j][x]] = (p[i][j][k][x], len(seen))

    def record_keys(self, keys, times: list[int]):
        # float32 norms as the policy rounds them: in layer 0 a repeated token's keys differ only by RoPE,
        # which keeps the norm, so their norms tie up to rounding and a float64 sum could order them otherwise
        norms = torch.linalg.vector_norm(keys.float(), dim=-1).tolist()  # (b, h, q)
        for i, row in enumerate(norms):
            for j, head in enumerate(row):
                for t, norm in zip(times, head):
                    self.key_norm[i][j][t] = norm

    def append(self, times: list[int], valid: list[list[bool]]):
        for i, row in enumerate(valid):
            for t, ok in zip(times, row):
                if ok:
                    for j in range(self.heads):
                        self.kept[i][j].append(t)
                else:
                    self.pads[i] += 1

    def held(self, i: int) -> int:
        return len(self.kept[i][0])

    def score(self, i: int, j: int, t: int, t_last: int) -> float:
        pol, name = self.policy, self.policy.name
        if name == "scissorhands":
            w, c = pol.history_window, pol.count_chunk_steps
            in_window = (lambda q: q > t_last - w) if c == 1 else (lambda q: q // c > t_last // c - w // c)
            count = sum(
                1
                for q, row in self.obs[i][j].items()
                if in_window(q) and t in row and row[t][0] * row[t][1] < pol.threshold
            )
            return -count
        if name == "h2o":
            return sum(row[t][0] for row in self.obs[i][j].values() if t in row)
        if name == "tova":
            return sum(self.obs[i][h][t_last].get(t, (0.0, 0))[0] for h in range(self.heads)) / self.heads
        if name == "streaming_llm":
            return t - self.pads[i]
        if name == "knorm":
            return -self.key_norm[i][j][t]
        if (
            name == "snapkv"
        ):  # votes averaged over the neighbouring candidates (outside the recent window) in time order
            r, k = self.budget.recent_window, pol.kernel_size
            cands = self.kept[i][j][: len(self.kept[i][j]) - r] if r else self.kept[i][j]
            at = cands.index(t)
            near = cands[max(0, at - k // 2) : at + k // 2 + 1]
            return sum(sum(row[u][0] for row in self.obs[i][j].values() if u in row) for u in near) / k
        if name == "random":
            seen = max(self.kept[i][j]) - self.pads[i] + 1
            return _py_random(pol.seed, t - self.pads[i], seen, j, 0)
        raise AssertionError(name)

    def drop(self, i: int, n: int, t_last: int):
        r, b = self.budget.recent_window, self.budget.tokens
        sinks = self.policy.sink_tokens(b)
        for j in range(self.heads):
            kept = self.kept[i][j]
            protected = set(kept[len(kept) - r :]) if r else set()
            protected |= {t for t in kept if t - self.pads[i] < sinks}
            cands = [t for t in kept if t not in protected]
            assert len(cands) >= n
            order = sorted(cands, key=lambda t: (self.score(i, j, t, t_last), t))  # ties: the older first
            gone = set(order[:n])
            self.kept[i][j] = [t for t in kept if t not in gone]


def _kept_by_layer(layer) -> list[list[list[int]]]:
    st = layer.slot_time
    return [[sorted(x for x in st[i, j].tolist() if x >= 0) for j in range(st.shape[1])] for i in range(st.shape[0])]


def _run_against_reference(model, policy, budget, prompt_ids, prompt_mask, chunk, decode_steps, **params):
    """Feed the prompt in calls of ``chunk`` tokens, then decode greedily; compare after every call."""
    cache = make_cache(policy, model, budget_tokens=budget, **params)
    batch = prompt_ids.shape[0]
    layer = cache.layers[0]
    rec = layer.policy = Recorder(layer.policy, layer)
    ref = Reference(cache, batch, model.config.num_key_value_heads)
    pieces = [
        (prompt_ids[:, s : s + chunk], prompt_mask[:, s : s + chunk]) for s in range(0, prompt_ids.shape[1], chunk)
    ]
    pieces += [None] * decode_steps
    mask, seen, nxt = prompt_mask[:, :0], 0, None  # nxt: the token picked after each call, fed to the next
    with torch.inference_mode():
        for call, piece in enumerate(pieces):
            ids, piece_mask = piece if piece is not None else (nxt, torch.ones(batch, 1, dtype=torch.long))
            q = ids.shape[1]
            mask = torch.cat([mask, piece_mask], 1)  # (batch, tokens seen)
            if q == 1:  # Algorithm 1: drop, then append
                for i in range(batch):
                    if ref.held(i) >= budget:
                        ref.drop(i, cache.budget.drop_tokens, seen - 1)
            rec.log.clear()
            rec.keys.clear()
            out = model(ids, attention_mask=mask, cache=cache)
            ref.append(list(range(seen, seen + q)), piece_mask.bool().tolist())
            ref.record(rec.log)
            for keys in rec.keys:
                ref.record_keys(keys, list(range(seen, seen + q)))
            if q > 1:  # a multi-token call: compress
                for i in range(batch):
                    if ref.held(i) > budget:
                        ref.drop(i, ref.held(i) - budget, seen + q - 1)
            seen += q
            assert _kept_by_layer(layer) == ref.kept, f"call {call}"
            assert layer.held.tolist() == [ref.held(i) for i in range(batch)]
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return cache, len(pieces)


CASES = [
    ("scissorhands", {}),
    ("scissorhands", dict(history_window=8, count_chunk_steps=1)),  # exact window, expires often
    ("scissorhands", dict(history_window=12, count_chunk_steps=4)),  # chunked window, expires often
    ("scissorhands", dict(recent_window=3, drop_tokens=2, threshold=0.5)),
    ("scissorhands", dict(history_window=12, count_chunk_steps=4, drop_tokens=1)),  # long-lived slots
    ("scissorhands", dict(history_window=6, count_chunk_steps=1, drop_tokens=2, recent_window=1)),
    ("streaming_llm", {}),
    ("streaming_llm", dict(n_sink=2, drop_tokens=3)),
    ("h2o", {}),
    ("h2o", dict(recent_window=2, drop_tokens=4)),
    ("tova", {}),
    ("random", {}),
    ("random", dict(seed=7, drop_tokens=1)),
    ("knorm", {}),
    ("knorm", dict(recent_window=2, drop_tokens=1)),
    ("snapkv", {}),
    ("snapkv", dict(window_size=4, kernel_size=3, recent_window=2, drop_tokens=3)),  # window < chunk, decode votes
    ("snapkv", dict(window_size=8, kernel_size=1)),
]
assert {c[0] for c in CASES} == set(EVICTING)


def _ids(batch, n, seed):
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "policy,params", CASES, ids=[f"{p}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for p, kw in CASES]
)
def test_left_padded_batch_matches_the_reference(model, policy, params):
    ids = _ids(2, 24, 1)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0: 5 pads, 19 tokens
    cache, calls = _run_against_reference(model, policy, 12, ids, mask, chunk=24, decode_steps=40, **params)
    assert cache.evicted_tokens > 0 and calls == 41


@pytest.mark.parametrize(
    "policy,params",
    [c for c in CASES if not c[1] or c[1].get("count_chunk_steps")],
    ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items()),
)
def test_chunked_prefill_matches_the_reference(model, policy, params):
    ids = _ids(1, 40, 2)
    cache, calls = _run_against_reference(
        model, policy, 12, ids, torch.ones_like(ids), chunk=16, decode_steps=20, **params
    )
    assert calls == 3 + 20


def _greedy_steps(model, cache, ids, mask, calls: int) -> list:
    """Forward the prompt, then greedy tokens, ``calls`` forward calls in all; per call the logits and
    every layer's slot times and policy state."""
    steps, seen_mask, nxt = [], mask, ids
    with torch.inference_mode():
        for _ in range(calls):
            out = model(nxt, attention_mask=seen_mask, cache=cache)
            steps.append(
                (out.logits.clone(), [(layer.slot_time.clone(), layer.state.clone()) for layer in cache.layers])
            )
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            seen_mask = torch.cat([seen_mask, torch.ones_like(nxt)], 1)
    return steps


def _assert_same_steps(run_a: list, run_b: list) -> None:
    """Two `_greedy_steps` runs: same logits (float tolerance), same kept slots, same statistics."""
    assert len(run_a) == len(run_b)
    for (logits_a, layers_a), (logits_b, layers_b) in zip(run_a, run_b):
        torch.testing.assert_close(logits_a, logits_b, atol=2e-5, rtol=1e-4)
        for (st_a, state_a), (st_b, state_b) in zip(layers_a, layers_b):
            assert torch.equal(st_a, st_b)
            torch.testing.assert_close(state_a, state_b, atol=1e-6, rtol=1e-5)


# snapkv is left out: its observation window (the last `window_size` queries of a call) is its rule,
# so observing more queries is another policy (test_snapkv_observes_the_last_window_size_queries).
SKIPPING = [
    (p, kw)
    for p, kw in CASES
    if POLICIES[p].needs_attention and p != "snapkv" and POLICIES[p](**kw).observed_queries(0, 40) < 40
]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(
    "policy,params", SKIPPING, ids=[f"{p}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for p, kw in SKIPPING]
)
def test_observing_only_the_needed_queries_changes_nothing(model, policy, params, padded):
    """A call hands `observe` only its last `observed_queries()` queries (the others run sdpa, the
    fresh unpadded prompt in one causal kernel): statistics, kept slots and logits equal a run in
    which every query is observed, over a 40-token prompt and 12 decode steps."""
    assert {"scissorhands", "tova"} <= {p for p, _ in SKIPPING}
    ids = _ids(2, 40, 3)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :7] = 0
    runs = []
    for observe_all in (False, True):
        cache = make_cache(policy, model, budget_tokens=12, **params)
        if observe_all:
            cache.policy.observed_queries = lambda first_query, q_len: q_len
        runs.append(_greedy_steps(model, cache, ids, mask, 13))
    _assert_same_steps(*runs)


ATTENTION_CASES = [(p, kw) for p, kw in CASES if POLICIES[p].needs_attention]


@pytest.mark.parametrize(
    "policy,params",
    ATTENTION_CASES,
    ids=[f"{p}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for p, kw in ATTENTION_CASES],
)
def test_query_chunks_sized_by_rows_change_nothing(model, policy, params, monkeypatch):
    """Explicit attention runs in query chunks whose scores stay within CHUNK_SCORE_ELEMENTS, so a
    prefill of more rows runs smaller chunks: with chunks of 5 queries (2 rows, 40-token padded
    prompt) statistics, kept slots and logits equal one chunk per call, over 12 decode steps."""
    import scissorhands.cache as cache_module

    ids = _ids(2, 40, 4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    hq = model.config.num_attention_heads
    runs, chunk_calls = [], []
    for elements in (5 * 2 * hq * 40, 1 << 30):
        monkeypatch.setattr(cache_module, "CHUNK_SCORE_ELEMENTS", elements)
        cache = make_cache(policy, model, budget_tokens=12, **params)
        calls = 0
        layer0 = cache.layers[0]
        attend_chunk = layer0._attend_chunk

        def counting(*args, **kwargs):
            nonlocal calls
            calls += 1
            return attend_chunk(*args, **kwargs)

        layer0._attend_chunk = counting
        runs.append(_greedy_steps(model, cache, ids, mask, 13))
        chunk_calls.append(calls)
    observed = POLICIES[policy](**params).observed_queries(0, 40)
    assert chunk_calls == [-(-observed // 5) + 12, (1 if observed else 0) + 12]  # prompt chunks + decode steps
    _assert_same_steps(*runs)


# ----------------------------------------------------------------------------- the key seam and the two key/window policies
def test_knorm_state_is_the_norm_of_the_key_as_computed_before_4_bit_encoding(model):
    """`init_state` sees the keys before the 4-bit codec: the state is the exact float32 norm of the key
    handed to the layer, not of its dequantized copy."""
    cache = make_cache("knorm", model, budget_tokens=8, kv_bits=4, kv_group_size=8)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, 2, 6, 16, generator=g), torch.randn(1, 2, 6, 16, generator=g)
    layer.update(k, v)
    assert torch.equal(layer.state[..., 0], torch.linalg.vector_norm(k, dim=-1))
    assert not torch.allclose(layer.state[..., 0], torch.linalg.vector_norm(layer.keys, dim=-1), atol=1e-3)
    score = cache.policy.keep_score(layer.state, layer.token_index(), layer_idx=0, budget_tokens=8)
    assert torch.equal(score.argmax(-1), torch.linalg.vector_norm(k, dim=-1).argmin(-1))  # lowest norm kept first


def test_snapkv_pools_votes_over_the_held_tokens_in_time_order():
    """Kernel 3, zero-padded: a masked slot between two held ones (evicted in simulation, or padding) is
    skipped, so its neighbours pool each other as after a real eviction."""
    p = POLICIES["snapkv"](kernel_size=3, recent_window=0)
    state = torch.tensor([3.0, 9.0, 0.0, 6.0, 5.0]).view(1, 1, 5, 1)
    token_index = torch.tensor([[[0, -2, 1, 2, -1]]])  # slot 1 evicted, slot 4 padding filler
    score = p.keep_score(state, token_index, layer_idx=0, budget_tokens=4)
    assert score[0, 0, [0, 2, 3]].tolist() == [1.0, 3.0, 2.0]  # (0+3+0)/3, (3+0+6)/3, (0+6+0)/3


def test_snapkv_pools_only_the_candidates_so_the_observation_window_lends_no_votes():
    """As the paper and kvpress's SnapKVPress pool the tokens before the observation window (zero-padded): the
    protected recent window's votes never raise the score of the candidate next to it."""
    p = POLICIES["snapkv"](kernel_size=3, recent_window=2)
    state = torch.tensor([3.0, 6.0, 9.0, 30.0, 30.0]).view(1, 1, 5, 1)
    token_index = torch.arange(5).view(1, 1, 5)  # tokens 3 and 4 are the recent window
    score = p.keep_score(state, token_index, layer_idx=0, budget_tokens=5)
    assert score[0, 0, :3].tolist() == [3.0, 6.0, 5.0]  # (0+3+6)/3, (3+6+9)/3, (6+9+0)/3: no 30 from token 3


def test_snapkv_observes_the_last_window_size_queries(model):
    cache = make_cache("snapkv", model, budget_tokens=12, window_size=4)
    layer = cache.layers[0]
    rec = layer.policy = Recorder(layer.policy, layer)
    with torch.inference_mode():
        out = model(_ids(1, 40, 6), cache=cache)
        assert [(tuple(probs.shape[:3]), first) for probs, _, first, _ in rec.log] == [((1, 2, 4), 36)]
        rec.log.clear()
        model(out.logits[:, -1:].argmax(-1), cache=cache)  # a decode step: its one query votes
    assert [(tuple(probs.shape[:3]), first) for probs, _, first, _ in rec.log] == [((1, 2, 1), 40)]


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3", None])
def test_check_int_refuses_what_is_not_a_whole_number_in_range_naming_the_field(value):
    from scissorhands.checks import check_int

    with pytest.raises(ValueError, match=rf"^max_new_tokens: expected an integer >= 1, got {re.escape(repr(value))}$"):
        check_int("max_new_tokens", value, 1)
    check_int("max_new_tokens", 1, 1)
    check_int("recent_window", None, 0, optional=True)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: __import__("replica.common.types").common.types.GenerationRequest("r", [1], -1),
            "max_new_tokens: expected an integer >= 1, got -1",
        ),
        (
            lambda: __import__("replica.common.types").common.types.EngineConfig(max_batch=-1),
            "max_batch: expected an integer >= 1 or null, got -1",
        ),
        (lambda: POLICIES["h2o"](recent_window=-1), "recent_window: expected an integer >= 0 or null, got -1"),
        (lambda: POLICIES["snapkv"](window_size=True), "window_size: expected an integer >= 1, got True"),
    ],
)
def test_the_library_and_the_engine_give_one_integer_message(make, message):
    """One integer check (scissorhands.checks.check_int) behind the library's, the engine's and the load
    generator's arguments, so every such error names its field the same way."""
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        make()


def test_scissorhands_below_threshold_is_exact_arithmetic():
    """`p * n_t < threshold` decided as one float32 comparison against the smallest float32 at or above
    `threshold / n_t`: equal to the float64 product (exact for float32 p and n_t < 2**24), also for
    probabilities placed exactly at and one float32 step below each query's threshold."""
    g = torch.Generator().manual_seed(5)
    for threshold in (1.0, 0.7, 0.5):
        pol = POLICIES["scissorhands"](threshold=threshold)
        visible = torch.rand(2, 3, 40, 37, generator=g) > 0.3
        visible[0, 0, 0] = False  # a query that sees nothing
        n_t = visible.sum(-1, keepdim=True)
        at = (threshold / n_t.clamp(min=1).double()).float()  # nearest float32 to the threshold
        probs = torch.rand(2, 3, 40, 37, generator=g) / 10
        probs[..., :5] = at.expand(-1, -1, -1, 5)
        probs[..., 5:10] = torch.nextafter(at, torch.zeros(())).expand(-1, -1, -1, 5)
        probs[..., 10:15] = torch.nextafter(at, torch.ones(())).expand(-1, -1, -1, 5)
        exact = visible & (probs.double() * n_t.double() < threshold)
        assert torch.equal(pol._below(probs, visible), exact)
        everyone = pol._below(probs, None)
        assert torch.equal(everyone, probs.double() * probs.shape[-1] < threshold)


@pytest.mark.slow
def test_embedded_snapkv_at_its_defaults_decodes_near_full_where_half_budget_drops_collapsed():
    """192 held-out tokens of SmolLM2-135M fed one token per call at ratio 5 (B = 39), float32: snapkv at its
    defaults (one token per step) stays within 10% of the full cache (measured 42.99 against 40.67); with the
    shared B // 2 drop it kept one slot outside its 19-token window, lost the sink, and read 116."""
    emb, tok = load_model("embedded", dtype=torch.float32)
    (w,) = heldout_windows(tok, 192, 1, seed=0)
    full = perplexity(emb, [w], "full")["perplexity"]
    default = perplexity(emb, [w], "snapkv", compression_ratio=5)
    half = perplexity(emb, [w], "snapkv", compression_ratio=5, policy_params={"drop_tokens": 19})
    assert (default["budget_tokens"], default["drop_tokens"]) == (39, 1)
    assert default["perplexity"] < 1.10 * full
    assert half["perplexity"] > 2 * full
