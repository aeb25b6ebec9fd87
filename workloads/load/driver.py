"""The load generator's shared run: a load pattern (`workloads.load.patterns`) driving any client,
one request record each.

    result = asyncio.run(run_load(client, requests, LoadConfig(mode="rate", rate_req_per_s=4, num_requests=200)))
    result.metrics.ttft_s.p99_s, result.metrics.output_throughput_tok_per_s, result.metrics.stop_reason

Bounds: `num_requests` measured requests and/or `duration_s` of measurement (a trace also ends
with its last row). Warm-up: the first `warmup_requests` requests, and every request sent before
`warmup_s` elapsed, are warm-up; they run like the others (marked `GenerationRequest.warmup`, so
the replicas count them apart) but are excluded from the statistics, and the measurement window
opens at the first measured send. The window closes at whichever bound ends the run first: the
last measured token when the count is reached first (`stop_reason` `count`; a trace's last row
counts as the count), or `duration_s` after the window opened (`stop_reason` `duration`; nothing
is sent after it, and the requests in flight are waited for and recorded). Every request built is
accounted for: sent (then ok or error by kind) or dropped. Definitions: docs/load-generation.md.

A client (`Client`) has `async generate(request) -> GenerationResult` (a replica, the HTTP client, a
fake in tests) with one time per generated id, or `events(request)` (`StreamingClient`): an async
iterator of `StreamChunk`s ended by the request's `GenerationResult` (`ServingReplica.events`,
`OpenAIHTTPClient.events`). A chunk without `time_s` is stamped with the load generator's clock
when it arrives, and every token of a chunk gets the chunk's time. Times come from `clock`
(default `time.time`, the replicas' clock too).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from replica.common.types import GenerationRequest, GenerationResult
from replica.continuous import StreamChunk
from replica.openai_api import REPLICA_DIED, replica_death
from workloads.load.http_client import HTTPGenerationResult
from workloads.load.metrics import PointMetrics, RequestRecord, summarize
from workloads.load.patterns import LoadConfig
from workloads.load.slo import DEFAULT_SLO, SLO

__all__ = ["Client", "StreamingClient", "StreamChunk", "LoadResult", "Run", "error_kind", "run_load"]


class Client(Protocol):
    """What the load generator drives: `generate`, a whole reply with one time per generated id."""

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...


class StreamingClient(Protocol):
    """A client read chunk by chunk: `StreamChunk`s, then the request's `GenerationResult`."""

    def events(self, request: GenerationRequest) -> AsyncIterator[StreamChunk | GenerationResult]: ...


@dataclass
class LoadResult:
    """One point's run: every request's record, the metrics, and when the run started and ended (s)."""

    records: list[RequestRecord]
    metrics: PointMetrics
    config: LoadConfig
    started_s: float
    finished_s: float
    extra: dict = field(default_factory=dict)


def _replica_side(res: GenerationResult, rec: RequestRecord) -> None:
    """The reply's own figures, kept apart from the client's: over HTTP the `replica_ttft_s` the server
    sent and the count's source; from a replica, first token - received on the replica's clock."""
    if isinstance(res, HTTPGenerationResult):
        rec.output_tokens_source = res.output_tokens_source or rec.output_tokens_source
        ttft = res.replica_ttft_s
    else:
        ttft = (
            res.token_times_s[0] - res.received_time_s
            if res.token_times_s and res.received_time_s is not None
            else None
        )
    if ttft is not None:
        rec.replica_ttft_s = ttft
    # a prefix-caching engine's count of prompt tokens it did not prefill (None: the backend does not report it)
    cached = getattr(res, "cached_prompt_tokens", None)
    if cached is not None:
        rec.cached_prompt_tokens = int(cached)
    hit = getattr(res, "session_affinity_hit", None)
    if hit is not None:
        rec.session_affinity_hit = bool(hit)
    # in process: the tokens its engine took from its session's kept state (HTTP does not say; `Run.send` clears it
    # for a request of no session)
    if not isinstance(res, HTTPGenerationResult):
        rec.session_reused_tokens = int(getattr(res, "session_reused_tokens", 0) or 0)


class Run:
    """What every pattern shares: warm-up, bounds, the window, sending and recording."""

    def __init__(
        self,
        client: Client | StreamingClient,
        requests: Callable[[int], GenerationRequest],
        config: LoadConfig,
        clock: Callable[[], float],
    ):
        self.client, self.requests, self.cfg, self.clock = client, requests, config, clock
        self.records: list[RequestRecord] = []
        self.issued = 0  # requests handed out (warm-up included)
        self.measured = 0  # measured requests handed out
        self.exhausted = False  # the pattern ran out of requests (a trace's last row)
        self.start = clock()
        self.window_start: float | None = None
        self.deadline: float | None = None  # end of the duration-bound window

    @property
    def count_reached(self) -> bool:
        return self.exhausted or (self.cfg.num_requests is not None and self.measured >= self.cfg.num_requests)

    def _is_warmup(self, now: float) -> bool:
        """Whether the next request handed out at `now` is warm-up (the first `warmup_requests`, or `warmup_s`)."""
        return self.issued < self.cfg.warmup_requests or now < self.start + self.cfg.warmup_s

    def next_index(self, warmup: bool | None = None) -> tuple[int, bool] | None:
        """(index, warm-up?) of the next request to send, or None when a bound says stop or, with `warmup`, when
        the next request is not of that kind (a batch of warm-ups ends without opening the window). One clock
        read decides both."""
        now = self.clock()
        if self.deadline is not None and now >= self.deadline:
            return None
        warm = self._is_warmup(now)
        if warmup is not None and warm != warmup:
            return None
        if not warm:
            if self.count_reached:
                return None
            if self.window_start is None:
                self.window_start = now
                if self.cfg.duration_s is not None:
                    self.deadline = now + self.cfg.duration_s
            self.measured += 1
        i = self.issued
        self.issued += 1
        return i, warm

    async def send(
        self, index: int, warmup: bool, scheduled: float | None = None, cap_delayed: bool = False
    ) -> RequestRecord:
        req = self.requests(index)
        if req.warmup != warmup:
            req = dataclasses.replace(req, warmup=warmup)
        rec = RequestRecord(
            req.request_id,
            len(req.prompt_ids),
            req.max_new_tokens,
            scheduled_time_s=scheduled,
            warmup=warmup,
            cap_delayed=cap_delayed,
        )
        self.records.append(rec)
        rec.send_time_s = self.clock()
        try:
            if hasattr(self.client, "events"):
                await asyncio.wait_for(self._stream(req, rec), self.cfg.request_timeout_s)
            else:
                res = await asyncio.wait_for(self.client.generate(req), self.cfg.request_timeout_s)
                self._take_result(res, rec)
        except asyncio.TimeoutError:
            rec.error_kind, rec.error = "timeout", f"no answer within {self.cfg.request_timeout_s} s"
        except Exception as e:  # noqa: BLE001 - every request ends as ok or an error of a kind
            rec.error_kind, rec.error = error_kind(e), f"{type(e).__name__}: {e}"[:2000]
        finally:
            rec.finish_time_s = self.clock()
            if getattr(req, "session_id", None) is None:
                rec.session_reused_tokens = None
        return rec

    @staticmethod
    def _take_result(res: GenerationResult, rec: RequestRecord) -> None:
        """Fill `rec` from a whole reply; one time per generated id, else an error of a named kind."""
        if not isinstance(res, GenerationResult):
            raise TypeError(f"the client's reply is a {type(res).__name__}, not a GenerationResult")
        ids, times = res.output_ids, res.token_times_s
        rec.output_tokens = len(ids)  # generated ids, never re-tokenized text
        rec.error_kind, rec.error = res.error_kind, res.error
        rec.replica_id = res.replica_id
        _replica_side(res, rec)
        if rec.error_kind is None and ids and len(times) != len(ids):
            rec.error_kind = "missing_token_times" if not times else "token_times_mismatch"
            rec.error = f"{len(ids)} generated ids but {len(times)} token times (one per id expected)"
            return
        rec.token_times_s = list(times)
        rec.output_ids = list(ids)  # a session's next turn sends them back as its history

    async def _stream(self, req: GenerationRequest, rec: RequestRecord) -> None:
        """Consume a streamed reply: every token of a chunk gets the chunk's (arrival) time; the
        `GenerationResult` that ends it gives the error and replica (and the ids and times when
        nothing was streamed before it). A chunk with `error_kind` ends it too."""
        async for ev in self.client.events(req):
            if isinstance(ev, GenerationResult):
                if rec.output_tokens == 0:
                    self._take_result(ev, rec)
                else:
                    rec.error_kind, rec.error = ev.error_kind, ev.error
                    rec.replica_id = ev.replica_id or rec.replica_id
                    _replica_side(ev, rec)
                return
            if not isinstance(ev, StreamChunk):
                raise TypeError(f"the client's stream sent a {type(ev).__name__}, not a StreamChunk")
            t = self.clock() if ev.time_s is None else float(ev.time_s)
            rec.output_tokens += len(ev.token_ids)
            rec.output_ids.extend(ev.token_ids)
            rec.token_times_s.extend([t] * len(ev.token_ids))
            rec.replica_id = ev.replica_id or rec.replica_id
            if ev.error_kind is not None:
                rec.error_kind, rec.error = ev.error_kind, ev.error
                return

    async def sleep_until(self, t: float) -> None:
        delay = t - self.clock()
        if delay > 0:
            await asyncio.sleep(delay)

    def window_end(self) -> tuple[float | None, str]:
        """(end of the measurement window, `stop_reason`): the last measured token when the count
        was reached first, else the duration's deadline."""
        ends = [
            r.token_times_s[-1] if r.token_times_s else r.finish_time_s for r in self.records if not r.warmup and r.sent
        ]
        last = max(ends) if ends else None
        if self.count_reached and last is not None and (self.deadline is None or last <= self.deadline):
            return last, "count"
        if self.deadline is not None:
            return self.deadline, "duration"
        return last, "count"


def error_kind(exc: BaseException) -> str:
    """A short kind for an exception a client raised: `replica_died`, `oom`, `overloaded` (Serve's back-pressure: the
    queue is full, as an HTTP 429/503 is), `timeout` or `error`."""
    if replica_death(exc) is not None:  # the same test as the OpenAI API's (one list)
        return REPLICA_DIED
    names = {type(exc).__name__} | {c.__name__ for c in type(exc).__mro__}
    cause = getattr(exc, "cause", None)  # a Ray task error's own exception
    if cause is not None:
        names |= {c.__name__ for c in type(cause).__mro__}
    if names & {"OutOfMemoryError", "MemoryError"}:
        return "oom"
    if "BackPressureError" in names:
        return "overloaded"
    if names & {"TimeoutError", "GetTimeoutError"}:
        return "timeout"
    return "error"


async def run_load(
    client: Client | StreamingClient,
    requests: Callable[[int], GenerationRequest] | list[GenerationRequest],
    config: LoadConfig,
    clock: Callable[[], float] = time.time,
    *,
    slo: SLO = DEFAULT_SLO,
) -> LoadResult:
    """Drive `client` with `config`; return every request's record and the point's metrics.

    `requests(i)` builds request `i` (warm-up included, in send order); a list is cycled, each
    use getting a unique id. Build it with `config.pattern.request_source(...)` (a trace's request
    `i` then has the lengths of row `i`). `slo` (seconds; default MLPerf's Llama-3.1-8B server limits)
    judges each request for the metrics' SLO attainment and goodput. ValueError for an empty list.
    """
    if isinstance(requests, list):
        pool = requests
        if not pool:
            raise ValueError("requests: the request list is empty")

        def requests(i: int, _pool=pool) -> GenerationRequest:
            r = _pool[i % len(_pool)]
            return dataclasses.replace(r, request_id=f"{r.request_id}#{i}")

    pattern = config.pattern
    run = Run(client, requests, config, clock)
    await pattern.drive(run)
    end, stop_reason = run.window_end()
    metrics = summarize(
        run.records,
        mode=config.mode,
        window_start_s=run.window_start,
        window_end_s=end,
        stop_reason=stop_reason,
        target_rate_req_per_s=pattern.target_rate_req_per_s,
        target_concurrency=pattern.target_concurrency,
        slo=slo,
    )
    return LoadResult(run.records, metrics, config, run.start, clock())
