"""The load generator: load patterns (listed classes) driving any client, one request record each.

    result = asyncio.run(run_load(client, requests, LoadConfig(mode="rate", rate_req_per_s=4, num_requests=200)))
    result.metrics.ttft_s.p99_s, result.metrics.output_throughput_tok_per_s, result.metrics.stop_reason

Load patterns (`LOAD_PATTERNS`, one class each; `LoadConfig.mode` names one):

* `batch` (`BatchLoad`): `batch_size` requests sent at once; the next batch when all of them
  finished (the paper's static-batch setting, seen from a client).
* `concurrency` (`ConcurrencyLoad`): closed loop; `concurrency` workers each send a request as
  soon as their previous one finished, so exactly N are in flight (no lockstep batches).
* `rate` (`RateLoad`): open loop; arrivals at `rate_req_per_s` with gamma-distributed gaps of
  shape `burstiness` (1 = Poisson; below 1 burstier, above 1 more regular).
* `trace` (`TraceLoad`): open loop replaying a trace file (CSV or JSONL) of arrival time, prompt
  tokens and output tokens, in the column layout of the public Azure LLM inference traces
  (`TIMESTAMP`, `ContextTokens`, `GeneratedTokens`) or ours (`arrival_time_s`, `prompt_tokens`,
  `output_tokens`); arrival offsets are multiplied by `trace_time_scale` (0.5 = twice as fast).

Open-loop patterns yield `Arrival`s (when to send, and what: the lengths of a trace row); they
are scheduled on absolute times so a late event never shifts later ones. With `max_concurrency`,
an arrival that finds the cap reached waits for a free slot (`cap_policy: delay`; counted as
delayed) or is not sent (`drop`, counted as dropped). A new pattern is one class registered in
`LOAD_PATTERNS`; warm-up, bounds, the window and the records are shared (`_Run`).

Bounds: `num_requests` measured requests and/or `duration_s` of measurement (a trace also ends
with its last row). Warm-up: the first `warmup_requests` requests, and every request sent before
`warmup_s` elapsed, are warm-up; they run like the others (marked `GenerationRequest.warmup`, so
the replicas count them apart) but are excluded from the statistics, and the measurement window
opens at the first measured send. The window closes at whichever bound ends the run first: the
last measured token when the count is reached first (`stop_reason` `count`; a trace's last row
counts as the count), or `duration_s` after the window opened (`stop_reason` `duration`; nothing
is sent after it, and the requests in flight are waited for and recorded). Every request built is
accounted for: sent (then ok or error by kind) or dropped. Definitions: docs/load-generation.md.

A client has `async generate(request) -> GenerationResult | dict` (the router, a replica, a fake
in tests) with one time per generated id, or `stream(request)`: an async iterator of chunks
(`StreamChunk`, or dicts/objects with `token_ids` or `token_id` and optionally `time_s`,
`error_kind`, `error`, `replica_id`; a last `{"result": ...}` as `ServingReplica.stream` sends);
a chunk without `time_s` is stamped with the load generator's clock when it arrives, and every
token of a chunk gets the chunk's time. Times come from `clock` (default
`time.time`, the replicas' clock too).
"""
from __future__ import annotations

import asyncio
import csv
import dataclasses
import json
import math
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, AsyncIterator, Callable, ClassVar, Iterator, Protocol

import numpy as np

from replica.engine import GenerationRequest, GenerationResult
from replica.openai_api import REPLICA_DIED, replica_death
from scissorhands.checks import check_int
from workloads.load.metrics import PointMetrics, RequestRecord, summarize

ARRIVALS = ("poisson", "gamma")
CAP_POLICIES = ("delay", "drop")
LENGTH_DISTS = ("fixed", "uniform", "normal", "lognormal")


class Client(Protocol):
    """What the load generator drives: `generate` (a whole reply, one time per generated id); a
    client that also has `stream(request)` (an async iterator of chunks) is read chunk by chunk."""

    async def generate(self, request: GenerationRequest) -> GenerationResult | dict: ...


class StreamingClient(Protocol):
    def stream(self, request: GenerationRequest) -> AsyncIterator[dict]: ...


# ---------------------------------------------------------------------------- lengths and requests
@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: `fixed` (value), `uniform` (min..max inclusive), `normal`
    (mean, std) or `lognormal` (mean = the median, sigma), clipped to [min, max].

    YAML: an integer (fixed) or a mapping `{dist: uniform, min: 64, max: 512}`. `dist: trace`
    (made by `TraceLoad.length_range`, never parsed) records a trace's range; it cannot be sampled.
    """

    dist: str = "fixed"
    value: int | None = None
    min: int | None = None
    max: int | None = None
    mean: float | None = None
    std: float | None = None
    sigma: float | None = None

    @classmethod
    def parse(cls, name: str, spec: Any) -> "LengthDist":
        """Raises ValueError naming `name` and the accepted forms."""
        if isinstance(spec, int) and not isinstance(spec, bool):
            spec = {"dist": "fixed", "value": spec}
        if not isinstance(spec, dict):
            raise ValueError(f"{name}: expected an integer or a mapping with 'dist' ({', '.join(LENGTH_DISTS)}), got {spec!r}")
        unknown = sorted(set(spec) - {"dist", "value", "min", "max", "mean", "std", "sigma"})
        if unknown:
            raise ValueError(f"{name}: unknown key(s) {unknown} (accepted: dist, value, min, max, mean, std, sigma)")
        d = cls(**spec)
        if d.dist not in LENGTH_DISTS:
            raise ValueError(f"{name}.dist: unknown distribution {d.dist!r} (accepted: {', '.join(LENGTH_DISTS)})")
        need = {"fixed": ("value",), "uniform": ("min", "max"), "normal": ("mean", "std"), "lognormal": ("mean", "sigma")}
        for k in need[d.dist]:
            if getattr(d, k) is None:
                raise ValueError(f"{name}.{k}: required for dist {d.dist!r}")
        for k in ("value", "min", "max"):
            check_int(f"{name}.{k}", getattr(d, k), 1, optional=True)
        if d.min is not None and d.max is not None and d.min > d.max:
            raise ValueError(f"{name}: min ({d.min}) > max ({d.max})")
        return d

    @property
    def upper(self) -> int:
        """The largest length it can draw (for memory budgets)."""
        if self.dist == "fixed":
            return self.value
        if self.max is not None:
            return self.max
        raise ValueError(f"a {self.dist} length distribution needs 'max' to bound memory")

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        if self.dist == "trace":
            raise ValueError("a trace's lengths come from its rows (TraceLoad.requests), not from sampling")
        if self.dist == "fixed":
            x = np.full(n, self.value, dtype=np.float64)
        elif self.dist == "uniform":
            x = rng.integers(self.min, self.max + 1, size=n).astype(np.float64)
        elif self.dist == "normal":
            x = rng.normal(self.mean, self.std, size=n)
        else:
            x = rng.lognormal(math.log(self.mean), self.sigma, size=n)
        lo, hi = self.min or 1, self.max or (1 << 31)
        return [int(v) for v in np.clip(np.rint(x), lo, hi)]


def build_requests(n: int, prompt_tokens: LengthDist, output_tokens: LengthDist, *, seed: int, tokenizer=None,
                   vocab_size: int | None = None, prefix: str = "req") -> list[GenerationRequest]:
    """`n` requests with lengths drawn (seeded) from the two distributions (see `requests_of_lengths`)."""
    rng = np.random.default_rng(seed)
    p_len = prompt_tokens.sample(n, rng)
    o_len = output_tokens.sample(n, rng)
    return requests_of_lengths(p_len, o_len, seed=seed, tokenizer=tokenizer, vocab_size=vocab_size, prefix=prefix,
                               rng=rng)


def requests_of_lengths(prompt_tokens: list[int], output_tokens: list[int], *, seed: int, tokenizer=None,
                        vocab_size: int | None = None, prefix: str = "req",
                        rng: np.random.Generator | None = None) -> list[GenerationRequest]:
    """Request `i` has a prompt of `prompt_tokens[i]` tokens and asks for `output_tokens[i]`.

    Prompts are windows of real text (`workloads.load.prompts.make_prompts`, the model's own tokenizer)
    when `tokenizer` is given; else random ids below `vocab_size` (test models without a tokenizer).
    ValueError when the two lists differ in length or `vocab_size` is missing.
    """
    if len(prompt_tokens) != len(output_tokens):
        raise ValueError(f"output_tokens: {len(output_tokens)} lengths for {len(prompt_tokens)} prompts")
    n = len(prompt_tokens)
    rng = rng if rng is not None else np.random.default_rng(seed)
    prompts: list[list[int] | None] = [None] * n
    if tokenizer is not None:
        from workloads.load.prompts import make_prompts

        for length in sorted(set(prompt_tokens)):
            idx = [i for i, x in enumerate(prompt_tokens) if x == length]
            for i, ids in zip(idx, make_prompts(tokenizer, len(idx), length, seed=seed + length)):
                prompts[i] = list(ids)
    else:
        if vocab_size is None:
            raise ValueError("vocab_size: needed for random prompts when there is no tokenizer")
        for i, length in enumerate(prompt_tokens):
            prompts[i] = rng.integers(0, vocab_size, size=length).tolist()
    return [GenerationRequest(f"{prefix}-{i}", prompts[i], int(output_tokens[i])) for i in range(n)]


# ---------------------------------------------------------------------------- traces
#: Accepted trace column layouts: (arrival time, prompt tokens, output tokens).
TRACE_LAYOUTS: tuple[tuple[str, str, str], ...] = (
    ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),          # Azure LLM inference traces (2023, 2024)
    ("arrival_time_s", "prompt_tokens", "output_tokens"),         # ours
)
_TIMESTAMP = re.compile(r"(?P<base>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(?P<frac>\d+))?(?P<tz>Z|[+-]\d\d:?\d\d)?")


@dataclass(frozen=True)
class TraceRow:
    """One trace request: `arrival_s` after the trace's first arrival, its prompt and output lengths (tokens)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def _timestamp_s(value: Any) -> tuple[int, float]:
    """A trace time as (whole seconds, fraction): a number of seconds, or an ISO date-time such as
    the Azure traces' ``2023-11-16 18:15:46.6805900`` (every fractional digit kept)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        whole = math.floor(value)
        return int(whole), float(value) - whole
    text = str(value).strip()
    try:
        x = float(text)
        return int(math.floor(x)), x - math.floor(x)
    except ValueError:
        pass
    m = _TIMESTAMP.fullmatch(text)
    if not m:
        raise ValueError(f"not a number of seconds or an ISO date-time: {text!r}")
    tz = m["tz"] or ""
    base = datetime.fromisoformat(m["base"] + ("+00:00" if tz in ("", "Z") else tz))
    return int(base.timestamp()), float("0." + m["frac"]) if m["frac"] else 0.0


def read_trace(path: str | Path) -> list[TraceRow]:
    """The rows of a trace file, arrival times relative to the first row (seconds).

    `.csv` with a header row, or `.jsonl` (one object per line); the columns of one of
    `TRACE_LAYOUTS`. Rows must be in arrival order. ValueError naming `trace_path` for a missing
    file, and the file, row and column for a missing column, an unreadable time, a length below 1
    or an arrival earlier than the row before.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace_path: no such file {str(path)!r}")
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    elif path.suffix.lower() in (".jsonl", ".json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        raise ValueError(f"trace_path: {str(path)!r} is neither .csv nor .jsonl")
    if not rows:
        raise ValueError(f"trace_path: {str(path)!r} has no rows")
    keys = set(rows[0])
    layout = next((lay for lay in TRACE_LAYOUTS if set(lay) <= keys), None)
    if layout is None:
        raise ValueError(f"trace_path: {str(path)!r} has columns {sorted(keys)}; expected one of "
                         + " or ".join("(" + ", ".join(lay) + ")" for lay in TRACE_LAYOUTS))
    t_col, p_col, o_col = layout
    out: list[TraceRow] = []
    first: tuple[int, float] | None = None
    prev = -math.inf
    for i, row in enumerate(rows, 1):
        where = f"trace {path.name}, row {i}"
        try:
            whole, frac = _timestamp_s(row[t_col])
        except ValueError as e:
            raise ValueError(f"{where}, {t_col}: {e}") from None
        first = first or (whole, frac)
        arrival = (whole - first[0]) + (frac - first[1])
        if arrival < prev:
            raise ValueError(f"{where}, {t_col}: earlier than the row before (rows must be in arrival order)")
        prev = arrival
        lengths = []
        for col in (p_col, o_col):
            try:
                v = float(row[col])
            except (TypeError, ValueError):
                v = math.nan
            if not (math.isfinite(v) and v == int(v) and v >= 1):
                raise ValueError(f"{where}, {col}: expected an integer >= 1, got {row[col]!r}")
            lengths.append(int(v))
        out.append(TraceRow(arrival, lengths[0], lengths[1]))
    return out


# ---------------------------------------------------------------------------- config
@dataclass
class LoadConfig:
    """One load point (see the module docstring and each pattern's class). Errors name the field."""

    mode: str
    num_requests: int | None = None
    duration_s: float | None = None
    batch_size: int | None = None
    concurrency: int | None = None
    rate_req_per_s: float | None = None
    arrival: str = "poisson"
    burstiness: float = 1.0
    max_concurrency: int | None = None
    cap_policy: str = "delay"
    trace_path: str | None = None
    trace_time_scale: float = 1.0
    warmup_requests: int = 0
    warmup_s: float = 0.0
    request_timeout_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in LOAD_PATTERNS:
            raise ValueError(f"mode: unknown load pattern {self.mode!r} (accepted: {', '.join(LOAD_PATTERNS)})")
        pattern = LOAD_PATTERNS[self.mode]
        if self.num_requests is None and self.duration_s is None and not pattern.bounded:
            raise ValueError("num_requests, duration_s: give at least one bound")
        for k in ("num_requests", "batch_size", "concurrency", "max_concurrency"):
            check_int(k, getattr(self, k), 1, optional=True)
        for k in ("duration_s", "rate_req_per_s", "request_timeout_s", "trace_time_scale"):
            v = getattr(self, k)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v > 0):
                raise ValueError(f"{k}: expected a number > 0, got {v!r}")
        if not (isinstance(self.burstiness, (int, float)) and self.burstiness > 0):
            raise ValueError(f"burstiness: expected a number > 0, got {self.burstiness!r}")
        if not (isinstance(self.warmup_s, (int, float)) and self.warmup_s >= 0):
            raise ValueError(f"warmup_s: expected a number >= 0, got {self.warmup_s!r}")
        check_int("warmup_requests", self.warmup_requests, 0)
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival: unknown {self.arrival!r} (accepted: {', '.join(ARRIVALS)})")
        if self.arrival == "poisson" and self.burstiness != 1.0:
            raise ValueError("burstiness: Poisson arrivals have burstiness 1; use arrival: gamma")
        if self.cap_policy not in CAP_POLICIES:
            raise ValueError(f"cap_policy: unknown {self.cap_policy!r} (accepted: {', '.join(CAP_POLICIES)})")
        for need in pattern.requires:
            if getattr(self, need) is None:
                raise ValueError(f"{need}: required in mode {self.mode!r}")
        pattern(self).check()

    @property
    def pattern(self) -> "LoadPattern":
        return LOAD_PATTERNS[self.mode](self)

    @property
    def target_concurrency(self) -> int | None:
        return self.pattern.target_concurrency

    @property
    def target_rate_req_per_s(self) -> float | None:
        return self.pattern.target_rate_req_per_s


def arrival_gaps_s(n: int, rate_req_per_s: float, burstiness: float, seed: int) -> np.ndarray:
    """`n` gaps between arrivals: gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate."""
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate_req_per_s * burstiness), size=n)


@dataclass
class LoadResult:
    records: list[RequestRecord]
    metrics: PointMetrics
    config: LoadConfig
    started_s: float
    finished_s: float
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- load patterns
@dataclass(frozen=True)
class Arrival:
    """What an open-loop pattern asks for: send the next request `at_s` seconds after the run
    started; `prompt_tokens`/`output_tokens` are the lengths it must have (a trace row), or None."""

    at_s: float
    prompt_tokens: int | None = None
    output_tokens: int | None = None


class LoadPattern:
    """How requests are sent. Subclasses set `name` and `requires` (the `LoadConfig` fields they
    need) and implement `drive(run)` with the shared `_Run` (`next_index`, `send`, `sleep_until`);
    register the class in `LOAD_PATTERNS`. `bounded`: the pattern ends by itself (a trace), so
    neither `num_requests` nor `duration_s` is required."""

    name: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()
    bounded: ClassVar[bool] = False

    def __init__(self, config: LoadConfig):
        self.cfg = config

    @property
    def target_concurrency(self) -> int | None:
        """Requests in flight the pattern aims for (None: not a concurrency target)."""
        return None

    @property
    def target_rate_req_per_s(self) -> float | None:
        """Nominal arrival rate (None: not an open loop at a rate)."""
        return None

    def check(self) -> None:
        """Raise ValueError naming the field when the config cannot run (called by `LoadConfig`)."""

    def requests(self, n: int | None = None, prompt_tokens: LengthDist | None = None,
                 output_tokens: LengthDist | None = None, *, seed: int = 0, tokenizer=None,
                 vocab_size: int | None = None, prefix: str = "req") -> list[GenerationRequest]:
        """The requests to send (`run_load` cycles them): `n` with lengths drawn from the two
        distributions (`build_requests`); a pattern that brings its own lengths overrides this."""
        if n is None or prompt_tokens is None or output_tokens is None:
            raise ValueError(f"prompt_tokens, output_tokens: mode {self.name!r} needs length distributions")
        return build_requests(n, prompt_tokens, output_tokens, seed=seed, tokenizer=tokenizer,
                              vocab_size=vocab_size, prefix=prefix)

    async def drive(self, run: "_Run") -> None:
        raise NotImplementedError


class BatchLoad(LoadPattern):
    """`batch_size` requests at once; the next batch when all finished. Warm-up and measured
    requests never share a batch."""

    name = "batch"
    requires = ("batch_size",)

    @property
    def target_concurrency(self) -> int | None:
        return self.cfg.batch_size

    async def drive(self, run: "_Run") -> None:
        pushed = None
        while True:
            batch = [pushed] if pushed is not None else []
            pushed = None
            while len(batch) < self.cfg.batch_size:
                nxt = run.next_index()
                if nxt is None:
                    break
                if batch and nxt[1] != batch[0][1]:
                    pushed = nxt
                    break
                batch.append(nxt)
            if not batch:
                return
            await asyncio.gather(*(run.send(i, w) for i, w in batch))


class ConcurrencyLoad(LoadPattern):
    """Closed loop: `concurrency` workers, each sending its next request when its previous one ended."""

    name = "concurrency"
    requires = ("concurrency",)

    @property
    def target_concurrency(self) -> int | None:
        return self.cfg.concurrency

    async def drive(self, run: "_Run") -> None:
        async def worker():
            while (nxt := run.next_index()) is not None:
                await run.send(*nxt)
        await asyncio.gather(*(worker() for _ in range(self.cfg.concurrency)))


class OpenLoop(LoadPattern):
    """Open loop: sends at the times `arrivals()` yields, whatever the replies; with
    `max_concurrency` an arrival that finds the cap reached waits (`delay`) or is dropped (`drop`)."""

    @property
    def target_concurrency(self) -> int | None:
        return self.cfg.max_concurrency

    def arrivals(self) -> Iterator[Arrival]:
        """When to send what, in order (offsets from the run's start)."""
        raise NotImplementedError

    async def drive(self, run: "_Run") -> None:
        cfg = self.cfg
        cap = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        tasks: list[asyncio.Task] = []
        for arrival in self.arrivals():
            t = run.start + arrival.at_s
            await run.sleep_until(t)
            nxt = run.next_index()
            if nxt is None:
                break
            index, warm = nxt
            full = cap is not None and cap.locked()
            if full and cfg.cap_policy == "drop":
                req = run.requests(index)
                run.records.append(RequestRecord(req.request_id, len(req.prompt_ids), req.max_new_tokens,
                                                 scheduled_time_s=t, warmup=warm))
                continue
            tasks.append(asyncio.ensure_future(self._send(run, cap, index, warm, t, full)))
        else:
            run.exhausted = True
        await asyncio.gather(*tasks)

    @staticmethod
    async def _send(run: "_Run", cap, index: int, warm: bool, scheduled: float, waited: bool) -> None:
        if cap is None:
            await run.send(index, warm, scheduled)
            return
        async with cap:
            await run.send(index, warm, scheduled, cap_delayed=waited)


class RateLoad(OpenLoop):
    """Arrivals at `rate_req_per_s` with gamma gaps of shape `burstiness` (1: Poisson), seeded by `seed`."""

    name = "rate"
    requires = ("rate_req_per_s",)

    @property
    def target_rate_req_per_s(self) -> float | None:
        return self.cfg.rate_req_per_s

    def arrivals(self) -> Iterator[Arrival]:
        cfg, t, chunk = self.cfg, 0.0, 0
        while True:
            for gap in arrival_gaps_s(1024, cfg.rate_req_per_s, cfg.burstiness, seed=cfg.seed * 1_000_003 + chunk):
                t += float(gap)
                yield Arrival(t)
            chunk += 1


class TraceLoad(OpenLoop):
    """Replays `trace_path` (`read_trace`): row `i` is sent `arrival_s * trace_time_scale` after the
    run started, with the row's prompt and output lengths (build the requests with `requests()`).
    The trace's last row ends the run (as the count would), if no other bound came first."""

    name = "trace"
    requires = ("trace_path",)
    bounded = True

    def __init__(self, config: LoadConfig):
        super().__init__(config)
        self._rows: list[TraceRow] | None = None

    @property
    def rows(self) -> list[TraceRow]:
        if self._rows is None:
            self._rows = read_trace(self.cfg.trace_path)
        return self._rows

    @property
    def target_rate_req_per_s(self) -> float | None:
        rows = self.rows
        span = (rows[-1].arrival_s - rows[0].arrival_s) * self.cfg.trace_time_scale
        return (len(rows) - 1) / span if len(rows) > 1 and span > 0 else None

    def check(self) -> None:
        self.rows                                      # noqa: B018 - reads and checks the file now

    def length_range(self) -> tuple[LengthDist, LengthDist]:
        """The trace's prompt and output lengths as `LengthDist(dist="trace", min, max)` (for memory
        budgets and records; not to be sampled)."""
        p = [r.prompt_tokens for r in self.rows]
        o = [r.output_tokens for r in self.rows]
        return LengthDist("trace", min=min(p), max=max(p)), LengthDist("trace", min=min(o), max=max(o))

    def arrivals(self) -> Iterator[Arrival]:
        for row in self.rows:
            yield Arrival(row.arrival_s * self.cfg.trace_time_scale, row.prompt_tokens, row.output_tokens)

    def requests(self, n: int | None = None, prompt_tokens: LengthDist | None = None,
                 output_tokens: LengthDist | None = None, *, seed: int = 0, tokenizer=None,
                 vocab_size: int | None = None, prefix: str = "trace") -> list[GenerationRequest]:
        """One request per row, with the row's lengths (prompts as in `requests_of_lengths`); `n` and
        the distributions are not used (the trace gives the lengths)."""
        rows = self.rows
        return requests_of_lengths([r.prompt_tokens for r in rows], [r.output_tokens for r in rows], seed=seed,
                                   tokenizer=tokenizer, vocab_size=vocab_size, prefix=prefix)


#: Every load pattern by `LoadConfig.mode`; a new pattern is one class and one line here.
LOAD_PATTERNS: dict[str, type[LoadPattern]] = {p.name: p for p in (BatchLoad, ConcurrencyLoad, RateLoad, TraceLoad)}


# ---------------------------------------------------------------------------- the shared run
@dataclass
class StreamChunk:
    """One streamed piece of a reply: the token ids it carries, when it arrived (None: stamp it on
    arrival), and an error that ends the stream."""

    token_ids: list[int] = field(default_factory=list)
    time_s: float | None = None
    error_kind: str | None = None
    error: str | None = None
    replica_id: str | None = None


def _get(obj: Any, key: str, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def _replica_side(res: Any, rec: RequestRecord) -> None:
    """The reply's own figures, kept apart from the client's: `replica_ttft_s` as sent (over HTTP), else
    first token - received on the replica's clock (a replica's result); `output_tokens_source`."""
    rec.output_tokens_source = _get(res, "output_tokens_source") or rec.output_tokens_source
    ttft = _get(res, "replica_ttft_s")
    times, received = _get(res, "token_times_s") or [], _get(res, "received_time_s")
    if ttft is None and received is not None and times:
        ttft = times[0] - received
    if ttft is not None:
        rec.replica_ttft_s = ttft


class _Run:
    """What every pattern shares: warm-up, bounds, the window, sending and recording."""

    def __init__(self, client: Client | StreamingClient, requests: Callable[[int], GenerationRequest], config: LoadConfig,
                 clock: Callable[[], float]):
        self.client, self.requests, self.cfg, self.clock = client, requests, config, clock
        self.records: list[RequestRecord] = []
        self.issued = 0              # requests handed out (warm-up included)
        self.measured = 0            # measured requests handed out
        self.exhausted = False       # the pattern ran out of requests (a trace's last row)
        self.start = clock()
        self.window_start: float | None = None
        self.deadline: float | None = None      # end of the duration-bound window

    @property
    def count_reached(self) -> bool:
        return self.exhausted or (self.cfg.num_requests is not None and self.measured >= self.cfg.num_requests)

    def next_index(self) -> tuple[int, bool] | None:
        """(index, warm-up?) of the next request to send, or None when a bound says stop."""
        now = self.clock()
        if self.deadline is not None and now >= self.deadline:
            return None
        warm = self.issued < self.cfg.warmup_requests or now < self.start + self.cfg.warmup_s
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

    async def send(self, index: int, warmup: bool, scheduled: float | None = None,
                   cap_delayed: bool = False) -> RequestRecord:
        req = self.requests(index)
        if req.warmup != warmup:
            req = dataclasses.replace(req, warmup=warmup)
        rec = RequestRecord(req.request_id, len(req.prompt_ids), req.max_new_tokens, scheduled_time_s=scheduled,
                            warmup=warmup, cap_delayed=cap_delayed)
        self.records.append(rec)
        rec.send_time_s = self.clock()
        try:
            if hasattr(self.client, "stream"):
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
        return rec

    @staticmethod
    def _take_result(res: Any, rec: RequestRecord) -> None:
        """Fill `rec` from a whole reply; one time per generated id, else an error of a named kind."""
        ids = list(_get(res, "output_ids") or [])
        times = list(_get(res, "token_times_s") or [])
        rec.output_tokens = len(ids)                      # generated ids, never re-tokenized text
        rec.error_kind, rec.error = _get(res, "error_kind"), _get(res, "error")
        rec.replica_id = _get(res, "replica_id")
        _replica_side(res, rec)
        if rec.error_kind is None and ids and len(times) != len(ids):
            rec.error_kind = "missing_token_times" if not times else "token_times_mismatch"
            rec.error = f"{len(ids)} generated ids but {len(times)} token times (one per id expected)"
            return
        rec.token_times_s = times

    async def _stream(self, req: GenerationRequest, rec: RequestRecord) -> None:
        """Consume a streamed reply: every token of a chunk gets the chunk's (arrival) time.

        A chunk carries `token_ids` (or one `token_id`, as `ServingReplica.stream` sends); a chunk
        with `result` (a whole reply, its last event) gives the error and replica, and the ids and
        times when nothing was streamed before it."""
        async for chunk in self.client.stream(req):
            result = _get(chunk, "result")
            if result is not None:
                if rec.output_tokens == 0:
                    self._take_result(result, rec)
                else:
                    rec.error_kind, rec.error = _get(result, "error_kind"), _get(result, "error")
                    rec.replica_id = _get(result, "replica_id") or rec.replica_id
                    _replica_side(result, rec)
                return
            t = _get(chunk, "time_s")
            t = self.clock() if t is None else float(t)
            one = _get(chunk, "token_id")
            ids = [one] if one is not None else list(_get(chunk, "token_ids") or [])
            rec.output_tokens += len(ids)
            rec.token_times_s.extend([t] * len(ids))
            rec.replica_id = _get(chunk, "replica_id") or rec.replica_id
            for k in ("replica_ttft_s", "output_tokens_source"):
                if _get(chunk, k) is not None:
                    setattr(rec, k, _get(chunk, k))
            if _get(chunk, "error_kind") is not None:
                rec.error_kind, rec.error = _get(chunk, "error_kind"), _get(chunk, "error")
                return

    async def sleep_until(self, t: float) -> None:
        delay = t - self.clock()
        if delay > 0:
            await asyncio.sleep(delay)

    def window_end(self) -> tuple[float | None, str]:
        """(end of the measurement window, `stop_reason`): the last measured token when the count
        was reached first, else the duration's deadline."""
        ends = [r.token_times_s[-1] if r.token_times_s else r.finish_time_s
                for r in self.records if not r.warmup and r.sent]
        last = max(ends) if ends else None
        if self.count_reached and last is not None and (self.deadline is None or last <= self.deadline):
            return last, "count"
        if self.deadline is not None:
            return self.deadline, "duration"
        return last, "count"


def error_kind(exc: BaseException) -> str:
    """A short kind for an exception a client raised: `replica_died`, `oom`, `timeout` or `error`."""
    if replica_death(exc) is not None:                 # the same test as the OpenAI API's (one list)
        return REPLICA_DIED
    names = {type(exc).__name__} | {c.__name__ for c in type(exc).__mro__}
    cause = getattr(exc, "cause", None)
    if cause is not None:
        names |= {c.__name__ for c in type(cause).__mro__}
    if names & {"OutOfMemoryError", "MemoryError"}:
        return "oom"
    if names & {"TimeoutError", "GetTimeoutError"}:
        return "timeout"
    return "error"


async def run_load(client: Client | StreamingClient, requests: Callable[[int], GenerationRequest] | list[GenerationRequest],
                   config: LoadConfig, clock: Callable[[], float] = time.time) -> LoadResult:
    """Drive `client` with `config`; return every request's record and the point's metrics.

    `requests(i)` builds request `i` (warm-up included, in send order); a list is cycled, each
    use getting a unique id. Build the list with `config.pattern.requests(...)`: a trace's request
    `i` then has the lengths of row `i`.
    """
    if isinstance(requests, list):
        pool = requests
        if not pool:
            raise ValueError("requests: the request list is empty")

        def requests(i: int, _pool=pool) -> GenerationRequest:
            r = _pool[i % len(_pool)]
            return dataclasses.replace(r, request_id=f"{r.request_id}#{i}")

    pattern = config.pattern
    run = _Run(client, requests, config, clock)
    await pattern.drive(run)
    end, stop_reason = run.window_end()
    metrics = summarize(run.records, mode=config.mode, window_start_s=run.window_start, window_end_s=end,
                        stop_reason=stop_reason, target_rate_req_per_s=pattern.target_rate_req_per_s,
                        target_concurrency=pattern.target_concurrency)
    return LoadResult(run.records, metrics, config, run.start, clock())
