"""Per-request records and per-point metrics of a load test (definitions: the table below and docs/load-generation.md, "Metric definitions").

| metric | definition |
|---|---|
| `ttft_s` | request sent -> first generated token |
| `tpot_s` | `(e2e - ttft) / (output_tokens - 1)`; undefined (left out) for one token |
| `itl_s` | gaps between successive tokens of one request (pooled over requests); tokens that arrive together have a gap of 0 |
| `inter_chunk_gap_s` | gaps between successive *arrivals* of tokens (a streamed chunk of several tokens is one arrival) |
| `e2e_latency_s` | request sent -> last token |
| `output_throughput_tok_per_s` | every output token produced inside the window, whichever request produced it (warm-up, measured, failed) / window length (`window_output_tokens` / `window_s`) |
| `total_throughput_tok_per_s` | (input tokens of every request whose first token came inside the window + every output token produced inside it) / window length (`window_input_tokens` + `window_output_tokens`) |
| `input_tokens`, `output_tokens` | the same counts over measured requests only (what the replicas count as measured) |
| `request_throughput_req_per_s` | measured requests that completed inside the window / window length |
| `achieved_rate_req_per_s` | (sent measured requests - 1) / (last send - first send) |
| `scheduled_rate_req_per_s` | the same over the arrival times the run drew for the measured arrivals, dropped ones included (open loop); a warning when it is more than `SCHEDULED_RATE_TOLERANCE` (10%) from the target |
| `completed_rate_req_per_s` | (completed measured requests - 1) / (last completion - first completion): the rate the replicas kept up |
| `rate_shortfall` | open loop: the sends fell below `SEND_SHORTFALL_FRACTION` (95%) of the scheduled rate, or completions below `RATE_SHORTFALL_FRACTION` (80%) of it, or fewer than 80% of the arrivals completed (a `rate shortfall:` warning says which); None for closed loops |
| `delayed_arrivals` | arrivals that found the concurrency cap reached and waited for a slot |
| `slo_attainment` | `slo_met_requests / slo_requests`: the fraction of measured arrivals (sent or dropped; failed and dropped ones miss) that meet every SLO of the point (`workloads.load.slo`: TTFT, TPOT, optionally e2e; a one-token request meets the TPOT SLO vacuously) |
| `slo_requests` | the attainment's sample count `n`: measured arrivals (= `arrivals`) |
| `goodput_req_per_s` | SLO-meeting requests that completed inside the window / window length |
| `goodput_tok_per_s` | output tokens of SLO-meeting requests produced inside the window / window length |
| `slo_ttft_s`, `slo_tpot_s`, `slo_e2e_latency_s` | the limits the point was judged by (seconds; e2e None: not checked) |

The window runs from the first measured send to the last measured token when the count ends the
run (`stop_reason` `count`), or to `duration_s` after it opened (`stop_reason` `duration`).
Output token counts are the number of generated ids a replica returned, never a re-tokenization
of text; a streamed chunk of several ids counts every id, each at the chunk's arrival time. Every
statistic uses measured requests only: not warm-up requests, not requests sent before the window
opened (so the replicas' own counts of measured requests, `replica.engine` `stats()`, cover the
same requests). The two token throughputs alone count every token produced inside the window, as GuideLLM does:
the window's mean concurrency counts every request in flight inside it (a warm-up request still running when the
window opens included), so its throughput counts what those requests produce there too (a worked example, not a
measurement: a closed loop of 4 at 100 tok/s per request whose warm-ups end inside the window produces 370 tok/s where
measured tokens alone give 267; `tests/workloads/test_loadgen.py` computes it). Every percentile (p50, p90,
p95, p99) carries its sample count `n`; a percentile `p` over fewer than `1 / (1 - p)` samples (p90 below 10, p95
below 20, p99 below 100) is flagged low-confidence, and every statistic of zero samples is None (JSON null), never NaN or 0. Goodput
never exceeds its throughput (`goodput_req_per_s <= request_throughput_req_per_s`, `goodput_tok_per_s <=
output_throughput_tok_per_s`): it counts SLO-meeting measured requests only, a subset of what throughput counts.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field, fields

import numpy as np

from workloads.load.slo import DEFAULT_SLO, SLO

#: The percentiles of every latency statistic (`LatencyStats`), as vLLM's and GuideLLM's reports give them.
PERCENTILES = (50, 90, 95, 99)
#: The percentiles flagged low-confidence below `1 / (1 - p)` samples (`low_confidence`).
FLAGGED_PERCENTILES = (90, 95, 99)
#: How far (relative) the rate of the arrival times drawn may stray from the target before a point says so.
SCHEDULED_RATE_TOLERANCE = 0.1
#: A rate point completes less than this fraction of the rate offered (or of its arrivals): a rate shortfall.
RATE_SHORTFALL_FRACTION = 0.8
#: A rate point sends less than this fraction of the rate offered: the load generator fell behind its schedule.
SEND_SHORTFALL_FRACTION = 0.95


@dataclass
class RequestRecord:
    """One request as the load generator saw it (times in seconds of the load generator's clock).

    `send_time_s` is None for an arrival that was dropped (never sent). `token_times_s[i]` is when
    output token `i` was produced (the replica's per-token timestamps).
    """

    request_id: str
    prompt_tokens: int
    max_new_tokens: int
    scheduled_time_s: float | None = None
    send_time_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    finish_time_s: float | None = None
    error_kind: str | None = None
    error: str | None = None
    warmup: bool = False
    replica_id: str | None = None
    cap_delayed: bool = False  # the arrival found the concurrency cap reached and waited
    replica_ttft_s: float | None = (
        None  # the replica's own TTFT (its clock: received -> first token), apart from ttft_s
    )
    output_tokens_source: str | None = None  # over HTTP: token_ids | usage | chunks (workloads/load/http_client.py)
    # sessions (workloads/load/sessions.py): which session and turn, the turns its session plans, the prompt tokens
    # it shares with what was sent before it, and the engine's cached prompt tokens (None: not reported)
    session_id: int | None = None
    turn: int | None = None
    session_turns: int | None = None
    expected_reuse_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    # kv_reuse: session_state: the prompt tokens its prefill took from its session's kept state (None: not reported)
    session_reused_tokens: int | None = None
    # several replicas: whether the replica that served it is its session's (None: no affinity asked)
    session_affinity_hit: bool | None = None
    output_ids: list[int] = field(default_factory=list, repr=False)  # the generated ids: the next turn's history

    @property
    def sent(self) -> bool:
        return self.send_time_s is not None

    @property
    def ok(self) -> bool:
        """Sent, no error, and one time per generated id (the load generator turns a reply without
        them into an error of kind `missing_token_times` or `token_times_mismatch`)."""
        return (
            self.sent
            and self.error_kind is None
            and self.output_tokens > 0
            and len(self.token_times_s) == self.output_tokens
        )

    @property
    def delay_s(self) -> float | None:
        """How late the request was sent after its scheduled arrival (open loop with a cap)."""
        if self.send_time_s is None or self.scheduled_time_s is None:
            return None
        return max(0.0, self.send_time_s - self.scheduled_time_s)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.send_time_s if self.ok and self.token_times_s else None

    @property
    def e2e_latency_s(self) -> float | None:
        return self.token_times_s[-1] - self.send_time_s if self.ok and self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """`(e2e - ttft) / (output_tokens - 1)`: None for a single token."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])] if self.ok else []

    @property
    def inter_chunk_gap_s(self) -> list[float]:
        arrivals = sorted(set(self.token_times_s)) if self.ok else []
        return [b - a for a, b in zip(arrivals, arrivals[1:])]


@dataclass
class LatencyStats:
    """Mean and percentiles (seconds) of one latency, with the sample count `n` and the low-confidence flag of
    each of `FLAGGED_PERCENTILES` (see `low_confidence`)."""

    n: int
    mean_s: float | None = None
    p50_s: float | None = None
    p90_s: float | None = None
    p95_s: float | None = None
    p99_s: float | None = None
    p90_low_confidence: bool = True
    p95_low_confidence: bool = True
    p99_low_confidence: bool = True

    @classmethod
    def of(cls, values) -> "LatencyStats":
        v = np.asarray([x for x in values if x is not None], dtype=np.float64)
        n = int(v.size)
        if n == 0:
            return cls(0)
        quantiles = {f"p{p}_s": float(x) for p, x in zip(PERCENTILES, np.percentile(v, PERCENTILES))}
        flags = {f"p{p}_low_confidence": low_confidence(p, n) for p in FLAGGED_PERCENTILES}
        return cls(n, float(v.mean()), **quantiles, **flags)


def low_confidence(percentile: float, n: int) -> bool:
    """True when fewer than `1 / (1 - p)` samples back percentile `p` (none lies beyond it)."""
    return n * (1 - percentile / 100) < 1 - 1e-9


#: The metadata of a `PointMetrics` field that summarizes, over the point's completed requests, the
#: `RequestRecord` attribute of the same name (a number per request, or a list pooled over requests).
PER_REQUEST = {"per_request": True}


@dataclass
class PointMetrics:
    """Everything one load point measured (units in the names; counts are requests unless named).

    A per-request latency is one property of `RequestRecord` and one field here of the same name marked
    `PER_REQUEST`: `summarize` fills every such field (an `AttributeError` there names a marked field with no
    `RequestRecord` attribute of its name), `flat` writes its keys into the record.
    """

    mode: str
    stop_reason: str | None  # which bound ended the window: `count` or `duration`
    window_start_s: float | None
    window_end_s: float | None
    window_s: float | None
    arrivals: int  # requests the schedule produced (measured ones, warm-up excluded)
    sent_requests: int  # measured requests sent
    completed_requests: int  # measured requests that finished without error
    failed_requests: int  # measured requests sent that ended in an error
    dropped_arrivals: int  # arrivals never sent (concurrency cap, drop policy)
    delayed_arrivals: int  # arrivals that waited for a slot under the concurrency cap
    warmup_requests: int
    errors_by_kind: dict
    ttft_s: LatencyStats = field(metadata=PER_REQUEST)
    tpot_s: LatencyStats = field(metadata=PER_REQUEST)
    itl_s: LatencyStats = field(metadata=PER_REQUEST)
    inter_chunk_gap_s: LatencyStats = field(metadata=PER_REQUEST)
    e2e_latency_s: LatencyStats = field(metadata=PER_REQUEST)
    arrival_delay_s: LatencyStats  # sent requests' delays behind their scheduled arrival
    input_tokens: int  # prompt tokens of measured requests whose first token came inside the window
    output_tokens: int  # output tokens of measured requests produced inside the window
    window_input_tokens: int  # prompt tokens of every request (warm-up included) whose first token came inside it
    window_output_tokens: int  # every output token produced inside the window, whichever request produced it
    output_throughput_tok_per_s: float | None
    total_throughput_tok_per_s: float | None
    request_throughput_req_per_s: float | None
    slo_requests: int  # the attainment's n: measured arrivals (sent or dropped)
    slo_met_requests: int  # of them, requests that met every SLO
    slo_attainment: float | None  # slo_met_requests / slo_requests; None without arrivals
    goodput_req_per_s: float | None  # SLO-meeting requests completed inside the window / window length
    goodput_tok_per_s: float | None  # their output tokens produced inside the window / window length
    slo_ttft_s: float  # the limits judged by (seconds)
    slo_tpot_s: float
    slo_e2e_latency_s: float | None  # None: e2e not checked
    target_rate_req_per_s: float | None = None
    achieved_rate_req_per_s: float | None = None
    scheduled_rate_req_per_s: float | None = None
    completed_rate_req_per_s: float | None = None  # (completed - 1) / (last completion - first completion)
    rate_shortfall: bool | None = None  # open loop: the rate offered was not sent or not completed (None: closed loop)
    target_concurrency: int | None = None
    achieved_peak_concurrency: int | None = None
    achieved_mean_concurrency: float | None = None
    warnings: list = field(default_factory=list)
    replica_ttft_s: LatencyStats | None = field(
        default=None, metadata=PER_REQUEST
    )  # replica's clock; summarize fills it

    def flat(self) -> dict:
        """One level of keys (`ttft_p99_s`, `ttft_n`, `ttft_p99_low_confidence`, ...) for results files: per
        latency `n`, `mean`, each of `PERCENTILES` (seconds) and each of `FLAGGED_PERCENTILES`' flags."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, LatencyStats):
                base = f.name[:-2] if f.name.endswith("_s") else f.name
                out[f"{base}_n"] = v.n
                for p in ("mean", *(f"p{q}" for q in PERCENTILES)):
                    out[f"{base}_{p}_s"] = getattr(v, f"{p}_s")
                for q in FLAGGED_PERCENTILES:
                    out[f"{base}_p{q}_low_confidence"] = getattr(v, f"p{q}_low_confidence")
            else:
                out[f.name] = v
        return out


def _concurrency(records: list[RequestRecord], start: float, end: float) -> tuple[int, float | None]:
    """(peak, time-weighted mean) of requests in flight inside [start, end], from send/finish times."""
    events = []
    for r in records:
        if r.send_time_s is not None:
            events.append((r.send_time_s, 1))
            events.append((r.finish_time_s if r.finish_time_s is not None else end, -1))
    events.sort()  # at one instant a finish (-1) comes before a send
    i, level = 0, 0
    while i < len(events) and events[i][0] < start:  # in flight when the window opens
        level += events[i][1]
        i += 1
    peak, prev, area = level, start, 0.0
    for t, d in events[i:]:
        if t > end:
            break
        area += level * (t - prev)
        prev, level = t, level + d
        peak = max(peak, level)
    area += level * (end - prev)
    return peak, (area / (end - start) if end > start else None)


def per_request_fields() -> list[str]:
    """The `PointMetrics` fields marked `PER_REQUEST`, in declaration order."""
    return [f.name for f in fields(PointMetrics) if f.metadata.get("per_request")]


def _pooled(records: list[RequestRecord], name: str):
    """The values of attribute `name` over `records`: each number, or each element of a list."""
    for r in records:
        v = getattr(r, name)
        yield from (v if isinstance(v, list) else (v,))


def _rate_shortfall_causes(
    completed: int, arrivals: int, completed_rate: float | None, achieved_rate: float | None, offered: float
) -> list[str]:
    """Why a rate point fell short of the rate `offered` (req/s, the arrival times drawn): the replicas did not
    keep up (fewer than `RATE_SHORTFALL_FRACTION` of the `arrivals` completed, or completed slower), or the load
    generator sent slower than `SEND_SHORTFALL_FRACTION` of it; empty when neither."""
    behind = []  # what fell short of the rate offered (the arrival times drawn)
    if completed < RATE_SHORTFALL_FRACTION * arrivals:
        behind.append(f"only {completed} of {arrivals} arrivals completed")
    if completed_rate is None or completed_rate < RATE_SHORTFALL_FRACTION * offered:
        behind.append(f"completed {completed_rate or 0:.3g} req/s")
    causes = []
    if behind:
        causes.append(", ".join(behind) + f" (below {RATE_SHORTFALL_FRACTION:.0%}: the replicas did not keep up)")
    if achieved_rate is not None and achieved_rate < SEND_SHORTFALL_FRACTION * offered:
        causes.append(
            f"sent {achieved_rate:.3g} req/s (below {SEND_SHORTFALL_FRACTION:.0%}: the load generator fell "
            "behind its schedule)"
        )
    return causes


def summarize(
    records: list[RequestRecord],
    *,
    mode: str,
    window_start_s: float | None,
    window_end_s: float | None,
    stop_reason: str | None = None,
    target_rate_req_per_s: float | None = None,
    target_concurrency: int | None = None,
    replica_peak_running_sequences: int | None = None,
    slo: SLO = DEFAULT_SLO,
) -> PointMetrics:
    """Metrics of one point from its request records and its measurement window (seconds of one clock).

    `slo` (`workloads.load.slo.SLO`; default MLPerf's Llama-3.1-8B server limits) judges every measured arrival for
    `slo_attainment` and the goodputs (the definitions table in the module docstring).

    `replica_peak_running_sequences` (summed over replicas, when known) adds a warning when the
    replicas ran fewer sequences at once than the target concurrency (queueing behind memory).
    The rate warning compares the achieved rate with the rate of the arrival times the run drew
    for the same requests (a small Poisson sample's rate is not the nominal rate).
    """
    measured = [r for r in records if not r.warmup]
    sent = [r for r in measured if r.sent]
    ok = [r for r in sent if r.ok]
    failed = [r for r in sent if not r.ok]
    errors = collections.Counter((r.error_kind or "empty_output") for r in failed)
    start, end = window_start_s, window_end_s
    window = (end - start) if (start is not None and end is not None) else None
    if window is not None and window <= 0:
        window = None

    def inside(t: float) -> bool:
        return start is not None and end is not None and start <= t <= end

    out_tok = sum(1 for r in ok for t in r.token_times_s if inside(t))
    in_tok = sum(r.prompt_tokens for r in ok if inside(r.token_times_s[0]))
    # the throughputs: every token event inside the window, as the window's concurrency counts every request in it
    producing = [r for r in records if r.sent and r.token_times_s]
    window_out_tok = sum(1 for r in producing for t in r.token_times_s if inside(t))
    window_in_tok = sum(r.prompt_tokens for r in producing if inside(r.token_times_s[0]))
    done_in = sum(1 for r in ok if inside(r.token_times_s[-1]))
    good = [r for r in measured if slo.met_by(r)]  # failed and dropped arrivals never meet it
    good_tok = sum(1 for r in good for t in r.token_times_s if inside(t))
    good_done_in = sum(1 for r in good if inside(r.token_times_s[-1]))

    def rate_of(times) -> float | None:
        times = sorted(times)
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) >= 2 and times[-1] > times[0] else None

    achieved_rate = rate_of(r.send_time_s for r in sent)
    scheduled = [r.scheduled_time_s for r in measured if r.scheduled_time_s is not None]  # dropped ones too
    scheduled_rate = rate_of(scheduled) if scheduled and len(scheduled) == len(measured) else None
    peak, mean_conc = (None, None)
    if start is not None and end is not None:
        peak, mean_conc = _concurrency([r for r in records if r.sent], start, end)
    delays = [r.delay_s for r in sent]
    warnings = []
    if target_concurrency is not None and peak is not None and peak < target_concurrency:
        warnings.append(f"concurrency: target {target_concurrency}, achieved peak {peak} requests in flight")
    if (
        target_concurrency is not None
        and replica_peak_running_sequences is not None
        and replica_peak_running_sequences < target_concurrency
    ):
        warnings.append(
            f"concurrency: target {target_concurrency}, the replicas ran at most "
            f"{replica_peak_running_sequences} sequences at once (the rest queued)"
        )
    if (
        target_rate_req_per_s
        and achieved_rate is not None
        and scheduled_rate is not None
        and achieved_rate < SEND_SHORTFALL_FRACTION * scheduled_rate
    ):
        warnings.append(
            f"rate: target {target_rate_req_per_s:g} req/s, achieved {achieved_rate:.3g} req/s against "
            f"{scheduled_rate:.3g} req/s in the arrival times drawn"
        )
    completed_rate = rate_of(r.token_times_s[-1] for r in ok)
    offered = scheduled_rate or target_rate_req_per_s
    rate_shortfall = None
    if target_rate_req_per_s and offered and len(measured) >= 2:
        causes = _rate_shortfall_causes(len(ok), len(measured), completed_rate, achieved_rate, offered)
        rate_shortfall = bool(causes)
        if causes:
            warnings.append(f"rate shortfall: {offered:.3g} req/s offered, " + "; ".join(causes))
    if (
        target_rate_req_per_s
        and scheduled_rate is not None
        and abs(scheduled_rate / target_rate_req_per_s - 1) > SCHEDULED_RATE_TOLERANCE
    ):
        warnings.append(
            f"scheduled rate: the {len(scheduled)} arrival times drawn span {scheduled_rate:.3g} req/s, not the target "
            f"{target_rate_req_per_s:g} req/s (a random sample of {len(scheduled)} arrivals strays from its rate by "
            f"about {1 / math.sqrt(max(1, len(scheduled) - 1)):.0%}; more requests bring it closer); the achieved "
            "rate is judged against the schedule drawn"
        )
    if len(ok) < 100:
        warnings.append(f"p99: only {len(ok)} completed requests (low confidence below 100)")

    def rate(x: float) -> float | None:
        return x / window if window else None

    return PointMetrics(
        mode=mode,
        stop_reason=stop_reason,
        window_start_s=start,
        window_end_s=end,
        window_s=window,
        arrivals=len(measured),
        sent_requests=len(sent),
        completed_requests=len(ok),
        failed_requests=len(failed),
        dropped_arrivals=sum(1 for r in measured if not r.sent),
        delayed_arrivals=sum(1 for r in sent if r.cap_delayed),
        warmup_requests=sum(1 for r in records if r.warmup),
        errors_by_kind=dict(errors),
        **{name: LatencyStats.of(_pooled(ok, name)) for name in per_request_fields()},
        arrival_delay_s=LatencyStats.of(d for d in delays if d is not None),
        input_tokens=in_tok,
        output_tokens=out_tok,
        window_input_tokens=window_in_tok,
        window_output_tokens=window_out_tok,
        output_throughput_tok_per_s=rate(window_out_tok),
        total_throughput_tok_per_s=rate(window_in_tok + window_out_tok),
        request_throughput_req_per_s=rate(done_in),
        slo_requests=len(measured),
        slo_met_requests=len(good),
        slo_attainment=len(good) / len(measured) if measured else None,
        goodput_req_per_s=rate(good_done_in),
        goodput_tok_per_s=rate(good_tok),
        slo_ttft_s=slo.ttft_s,
        slo_tpot_s=slo.tpot_s,
        slo_e2e_latency_s=slo.e2e_latency_s,
        target_rate_req_per_s=target_rate_req_per_s,
        achieved_rate_req_per_s=achieved_rate,
        scheduled_rate_req_per_s=scheduled_rate,
        completed_rate_req_per_s=completed_rate,
        rate_shortfall=rate_shortfall,
        target_concurrency=target_concurrency,
        achieved_peak_concurrency=peak,
        achieved_mean_concurrency=mean_conc,
        warnings=warnings,
    )
