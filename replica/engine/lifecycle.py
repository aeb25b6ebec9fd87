"""The core's request records: the only code that answers a request (`on_token`, `on_done`, failures) and counts
its outcome (`stats()`'s request counters, the live metrics' TTFT and TPOT). `replica.engine.core` drives it."""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Callable

import torch

from replica.common.types import OUTCOMES
from replica.engine.requests import Sequence

#: The outcomes counted as completed requests (`GenerationResult.outcome`); the others are failed ones.
COMPLETED_OUTCOMES = OUTCOMES[:2]

__all__ = ["Lifecycle", "recording"]


def recording() -> contextlib.AbstractContextManager:
    """The context of a group of live-metrics calls: a recorder error ends the group and is dropped,
    so metrics never stop serving (the requests' results and `stats()` do not depend on them)."""
    return contextlib.suppress(Exception)


class Lifecycle:
    """Answers requests and keeps the engine's counters and peaks (since `reset`).

    Args:
        clock: seconds, for every timestamp.
        metrics: live metrics (`replica.metrics.ReplicaMetrics` or `NullMetrics`).
        eos_token_id: stops a request that does not set `ignore_eos` (None: never).
        device: where the model runs (a CUDA out-of-memory empties the allocator's cache).
    """

    def __init__(self, clock: Callable[[], float], metrics, eos_token_id: int | None, device: torch.device):
        self.clock, self.metrics, self.eos_token_id, self.device = clock, metrics, eos_token_id, device
        # the step's thread counts, and so do callers' threads (a dead engine refuses `submit` in the call)
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero the counters and peaks."""
        with self.lock:
            self.counts: collections.Counter = collections.Counter()
            self.peak_bytes = 0
            self.peak_running = 0

    def add(self, counter: str, n: float = 1) -> None:
        """Add `n` to `counter` (any thread)."""
        with self.lock:
            self.counts[counter] += n

    def snapshot(self) -> dict:
        """A copy of the counters (any thread)."""
        with self.lock:
            return dict(self.counts)

    @staticmethod
    def key(seq: Sequence, counter: str) -> str:
        """The counter's key for `seq`: warm-up requests are counted apart."""
        return "warmup_" + counter if seq.request.warmup else counter

    @staticmethod
    def phase(seq: Sequence) -> str:
        return "warmup" if seq.request.warmup else "measured"

    def count(self, seq: Sequence, counter: str) -> None:
        self.add(self.key(seq, counter))

    def track_bytes(self, nbytes: int) -> None:
        self.peak_bytes = max(self.peak_bytes, int(nbytes))

    def track_running(self, running: int) -> None:
        self.peak_running = max(self.peak_running, running)

    @staticmethod
    def request_stats(counts: dict) -> dict:
        """`stats()`'s request counters, tokens, steps and phase times from a copy of `counts`."""
        out = {f"{k}_requests": counts.get(k, 0) for k in ("received", "completed", "failed")}
        out["generated_tokens"] = counts.get("tokens", 0)
        out.update({f"warmup_{k}_requests": counts.get(f"warmup_{k}", 0) for k in ("received", "completed", "failed")})
        out["warmup_generated_tokens"] = counts.get("warmup_tokens", 0)
        out.update({k: counts.get(k, 0) for k in ("decode_steps", "prefill_calls")})
        out["prefill_s"] = counts.get("prefill_s", 0.0)  # wall time in prefill phases
        out["decode_s"] = counts.get("decode_s", 0.0)  # wall time in decode steps
        return out

    def prefilled(self, group: list[Sequence], chunk: int, fwd, last: bool) -> None:
        """Count one prefill forward of `chunk` tokens of each row of `group` (`fwd`: its `Forward`); `last`: it
        picked each row's first token."""
        warm = sum(s.request.warmup for s in group)  # warm-up rows: phase "warmup", counted apart
        with recording():
            self.metrics.observe_prefill(fwd.seconds, (len(group) - warm) * chunk, warm * chunk)
            self.metrics.add_evictions(fwd.evicted_tokens)
            self.add("evicted_tokens", fwd.evicted_tokens)  # stats(): a budgeted point that evicted nothing says so
            if last:
                self.metrics.add_generated_tokens(len(group) - warm)
                self.metrics.add_generated_tokens(warm, "warmup")
        self.add("prefill_calls")

    def decoded(self, rows: list[Sequence], fwd, blocks_in_use: int) -> None:
        """Count one decode step of `rows` (`fwd`: its `Forward`), the pool holding `blocks_in_use` blocks."""
        warm = sum(s.request.warmup for s in rows)  # warm-up rows: phase "warmup", counted apart
        with recording():
            self.metrics.observe_decode_step(fwd.seconds, len(rows))
            self.metrics.add_generated_tokens(len(rows) - warm)
            self.metrics.add_generated_tokens(warm, "warmup")
            self.metrics.add_evictions(fwd.evicted_tokens)
        self.add("evicted_tokens", fwd.evicted_tokens)
        self.add("decode_steps")
        self.add("block_steps", blocks_in_use)

    def preempted(self, recomputed_tokens: int) -> None:
        """Count one preemption, whose next prefill recomputes `recomputed_tokens` tokens."""
        self.add("preemptions")
        self.add("recomputed_tokens", recomputed_tokens)
        with recording():
            self.metrics.add_preemption(recomputed_tokens)

    def score(self, seq: Sequence, score_prompt: Callable) -> bool:
        """Put the prompt's log-probabilities (`score_prompt(seq)`) in `seq`'s result; True when that ended the
        request: it asked for no new tokens (completed), or the scoring failed (it fails alone)."""
        try:
            seq.result.prompt_logprobs, seq.result.prompt_top_logprobs = score_prompt(seq)
        except Exception as e:  # noqa: BLE001 - reported on this request only
            self.fail_all([seq], e)
            return True
        if seq.request.max_new_tokens > 0:
            return False
        self.finish_scored(seq)
        return True

    def emit(self, seq: Sequence, token: int, t: float) -> bool:
        """Record one token; finish the request when done. Returns True when it finished (or its pick
        failed: `seq.sample_error`, then it fails alone and its row leaves the batch)."""
        r = seq.result
        if seq.sample_error is not None:
            self.fail(seq, "error", seq.sample_error)
            return True
        r.output_ids.append(int(token))
        r.token_times_s.append(t)
        if seq.request.logprobs is not None:
            if r.output_logprobs is None:
                r.output_logprobs, r.output_top_logprobs = [], []
            r.output_logprobs.append(seq.token_logprob)
            r.output_top_logprobs.append(seq.token_top_logprobs)
        self.count(seq, "tokens")
        if len(r.output_ids) == 1:  # the time to first token is a fact now, however the request ends
            with recording():
                self.metrics.observe_ttft(max(0.0, t - r.received_time_s), self.phase(seq))
        if seq.on_token is not None:
            try:
                seq.on_token(int(token), t)
            except Exception:  # noqa: BLE001 - a caller's callback must not stop the engine
                pass
        eos = not seq.request.ignore_eos and self.eos_token_id is not None and int(token) == self.eos_token_id
        if eos or len(r.output_ids) >= seq.request.max_new_tokens:
            self.complete(seq, "eos" if eos else "length", t)
            return True
        return False

    def complete(self, seq: Sequence, reason: str, t: float) -> None:
        """Finish `seq` as completed (`reason`: ``"eos"``, ``"length"``, or ``"stop"`` when the client had what it
        asked)."""
        seq.result.finish_reason, seq.result.finish_time_s = reason, t
        self.finished(seq)

    def finish_scored(self, seq: Sequence) -> None:
        """Finish a score-only request (no new tokens asked): its prompt's log-probabilities are its result."""
        seq.result.finish_reason, seq.result.finish_time_s = "length", self.clock()
        self.finished(seq)

    def fail(self, seq: Sequence, kind: str, message: str) -> None:
        r = seq.result
        r.error_kind, r.error, r.finish_reason, r.finish_time_s = kind, message, "error", self.clock()
        self.finished(seq)

    def finished(self, seq: Sequence) -> None:
        """Count `seq`, whose result is final, by its one classification (`GenerationResult.outcome`): completed
        (`COMPLETED_OUTCOMES`; its time per output token observed) or failed; then answer it."""
        r = seq.result
        completed = r.outcome in COMPLETED_OUTCOMES
        if completed and len(r.output_ids) > 1:
            with recording():
                tpot_s = max(0.0, r.token_times_s[-1] - r.token_times_s[0]) / (len(r.output_ids) - 1)
                self.metrics.observe_tpot(tpot_s, self.phase(seq))
        self.count(seq, "completed" if completed else "failed")
        self.done(seq)

    def fail_all(self, seqs: list[Sequence], exc: BaseException) -> None:
        """Fail `seqs` with the fault `exc` (``error_kind`` "oom" for an out-of-memory, else "error")."""
        oom = isinstance(exc, (MemoryError, torch.OutOfMemoryError))
        kind = "oom" if oom else "error"
        for seq in seqs:
            self.fail(seq, kind, f"{type(exc).__name__}: {exc}")
        if oom and self.device.type == "cuda":
            torch.cuda.empty_cache()

    @staticmethod
    def done(seq: Sequence) -> None:
        try:
            seq.on_done(seq.result)
        except Exception:  # noqa: BLE001 - a caller's callback must not stop the engine
            pass
