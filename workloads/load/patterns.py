"""Load patterns: how requests are sent (`LOAD_PATTERNS`, one class each; `LoadConfig.mode` names one),
and what a suite sweeping each one needs.

* `batch` (`BatchLoad`): `batch_size` requests sent at once; the next batch when all of them
  finished (the paper's static-batch setting, seen from a client).
* `concurrency` (`ConcurrencyLoad`): closed loop; `concurrency` workers each send a request as
  soon as their previous one finished, so exactly N are in flight (no lockstep batches).
* `rate` (`RateLoad`): open loop; arrivals at `rate_req_per_s` with gamma-distributed gaps of
  shape `burstiness` (1 = Poisson; below 1 burstier, above 1 more regular).
* `trace` (`TraceLoad`): open loop replaying a trace file (`workloads.load.traces.read_trace`);
  arrival offsets are multiplied by `trace_time_scale` (0.5 = twice as fast).

Open-loop patterns yield `Arrival`s (when to send, and what: the lengths of a trace row); they
are scheduled on absolute times so a late event never shifts later ones. With `max_concurrency`,
an arrival that finds the cap reached waits for a free slot (`cap_policy: delay`; counted as
delayed) or is not sent (`drop`, counted as dropped). Warm-up, bounds, the window and the records
are shared (`workloads.load.driver`).

A new pattern is one class registered in `LOAD_PATTERNS`: its `drive(run)`, the `LoadConfig` fields
it `requires`, and, for suites, the class attributes of the "suite" block of `LoadPattern` (the
`LoadConfig` field a point's load sets, where the loads come from, the suite fields it copies or
forbids, the record column it fills). A suite's `mode` is a pattern's name or one of `MODE_ALIASES` (`capacity`:
the `rate` pattern at the rates a search picks, `workloads.serving.capacity`).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Literal, Protocol

import numpy as np
from pydantic import field_validator, model_validator

from replica.common.rules import FrozenConfig, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, need_one_of
from replica.common.types import GenerationRequest
from workloads.load.lengths import LengthDist, RequestStream, requests_of_lengths
from workloads.load.metrics import RequestRecord
from workloads.load.sessions import (
    PlannedSession,
    SessionSource,
    SessionSpec,
    longest_session_tokens,
    plan_sessions,
)
from workloads.load.traces import TraceRow, read_trace

ARRIVALS = ("poisson", "gamma")
CAP_POLICIES = ("delay", "drop")
#: `LoadConfig` fields every suite point takes from its suite unchanged.
SHARED_SUITE_FIELDS = ("num_requests", "duration_s", "warmup_requests", "warmup_s", "request_timeout_s")


# ---------------------------------------------------------------------------- config
class LoadConfig(FrozenConfig):
    """One load point (see the module docstring and each pattern's class); times in seconds.

    A bad field raises ValueError naming the field and the accepted values; `model_dump()` is its
    record form.
    """

    mode: str
    num_requests: PositiveInt | None = None
    duration_s: PositiveFloat | None = None
    batch_size: PositiveInt | None = None
    concurrency: PositiveInt | None = None
    rate_req_per_s: PositiveFloat | None = None
    arrival: Literal[ARRIVALS] = "poisson"
    burstiness: PositiveFloat = 1.0
    max_concurrency: PositiveInt | None = None
    cap_policy: Literal[CAP_POLICIES] = "delay"
    trace_path: str | None = None
    trace_time_scale: PositiveFloat = 1.0
    sessions: SessionSpec | None = None
    session_rate_per_s: PositiveFloat | None = None
    warmup_requests: NonNegativeInt = 0
    warmup_s: NonNegativeFloat = 0.0
    request_timeout_s: PositiveFloat | None = None
    seed: int = 0

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, mode: str) -> str:
        if mode not in LOAD_PATTERNS:
            raise ValueError(f"mode: unknown load pattern {mode!r} (accepted: {', '.join(LOAD_PATTERNS)})")
        return mode

    @model_validator(mode="after")
    def _runnable(self) -> "LoadConfig":
        pattern_cls = LOAD_PATTERNS[self.mode]
        if not pattern_cls.bounded:
            need_one_of(self, "num_requests", "duration_s")
        if self.arrival == "poisson" and self.burstiness != 1.0:
            raise ValueError("burstiness: Poisson arrivals have burstiness 1; use arrival: gamma")
        for need in pattern_cls.requires:
            if getattr(self, need) is None:
                raise ValueError(f"{need}: required in mode {self.mode!r}")
        self.pattern.check()
        return self

    @functools.cached_property
    def pattern(self) -> "LoadPattern":
        """This config's pattern (one per config: a trace is read once)."""
        return LOAD_PATTERNS[self.mode](self)

    @property
    def target_concurrency(self) -> int | None:
        return self.pattern.target_concurrency

    @property
    def target_rate_req_per_s(self) -> float | None:
        return self.pattern.target_rate_req_per_s


def arrival_gaps_s(n: int, rate_req_per_s: float, burstiness: float, seed: int) -> np.ndarray:
    """`n` gaps between arrivals (s): gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate."""
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate_req_per_s * burstiness), size=n)


@dataclass(frozen=True)
class Arrival:
    """What an open-loop pattern asks for: send the next request `at_s` seconds after the run
    started; `prompt_tokens`/`output_tokens` are the lengths it must have (a trace row), or None."""

    at_s: float
    prompt_tokens: int | None = None
    output_tokens: int | None = None


# ---------------------------------------------------------------------------- load patterns
class SharedRun(Protocol):
    """What a pattern's `drive` uses of the shared run (`workloads.load.driver.Run`): the next request
    to send, sending it, waiting, and the records (a dropped arrival is recorded by the pattern)."""

    start: float  # the run's start on its clock (s)
    exhausted: bool  # set by a pattern that ran out of requests (a trace's last row)
    records: list[RequestRecord]
    requests: Callable[[int], GenerationRequest]

    def next_index(self, warmup: bool | None = None) -> tuple[int, bool] | None: ...
    async def send(
        self, index: int, warmup: bool, scheduled: float | None = None, cap_delayed: bool = False
    ) -> RequestRecord: ...
    async def sleep_until(self, t: float) -> None: ...


class LoadPattern:
    """How requests are sent. Subclasses set `name` and `requires` (the `LoadConfig` fields they
    need) and implement `drive(run)` with the shared `workloads.load.driver.Run` (`next_index`,
    `send`, `sleep_until`); register the class in `LOAD_PATTERNS`. `bounded`: the pattern ends by
    itself (a trace), so neither `num_requests` nor `duration_s` is required.

    What a suite sweeping the pattern needs (read by `workloads.serving.suite.ServingSuite`; the
    suite is any object with these attributes):

    * `load_field`: the `LoadConfig` field a point's load sets; `integer_loads`: it takes integers.
    * `loads_from`: the suite field the points' loads come from: `loads` (a list, one point each,
      described by `loads_are`) or a single field (a trace's `trace_time_scale`: one point).
    * `suite_fields`: suite fields copied into every point's `LoadConfig`, beside `SHARED_SUITE_FIELDS`.
    * `suite_forbids`: suite fields that must not be given.
    * `record_column`: the record column the point's load fills (None: none).
    """

    name: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()
    bounded: ClassVar[bool] = False
    # ---- what a suite needs
    load_field: ClassVar[str] = ""
    integer_loads: ClassVar[bool] = True
    loads_from: ClassVar[str] = "loads"
    loads_are: ClassVar[str] = ""
    suite_fields: ClassVar[tuple[str, ...]] = ()
    suite_forbids: ClassVar[tuple[str, ...]] = ()
    record_column: ClassVar[str | None] = None

    def __init__(self, config: LoadConfig):
        self.cfg = config

    @property
    def target_concurrency(self) -> int | None:
        """Requests in flight the pattern aims for (None: not a concurrency target)."""
        return None

    @property
    def target_rate_req_per_s(self) -> float | None:
        """Nominal arrival rate (req/s; None: not an open loop at a rate)."""
        return None

    def check(self) -> None:
        """Raise ValueError naming the field when the config cannot run (called by `LoadConfig`)."""

    def request_source(
        self,
        prompt_tokens: LengthDist | None,
        output_tokens: LengthDist | None,
        *,
        seed: int,
        tokenizer=None,
        vocab_size: int | None = None,
        prefix: str = "req",
    ) -> Callable[[int], GenerationRequest]:
        """What `run_load` asks for request `i`: drawn on demand (`RequestStream`), never cycled, so a
        point sends no prompt twice however many requests its duration lets through; a pattern that brings
        its own lengths overrides this."""
        if prompt_tokens is None or output_tokens is None:
            raise ValueError(f"prompt_tokens, output_tokens: mode {self.name!r} needs length distributions")
        return RequestStream(
            prompt_tokens, output_tokens, seed=seed, tokenizer=tokenizer, vocab_size=vocab_size, prefix=prefix
        )

    async def drive(self, run: SharedRun) -> None:
        raise NotImplementedError

    # ---- a suite's view (options: a `MODE_ALIASES` entry's)
    @classmethod
    def suite_defaults(cls, data: dict, **options) -> dict:
        """The suite's raw mapping before validation, with what the pattern supplies itself filled in
        (a trace's lengths); ValueError naming a field given that the pattern forbids."""
        for k in cls.suite_forbids:
            if data.get(k) is not None:
                raise ValueError(f"{k}: not used in mode {data.get('mode')}")
        return data

    @classmethod
    def check_suite(cls, suite: Any, mode: str, **options) -> None:
        """ValueError naming the suite field when `suite` cannot sweep this pattern (the points'
        `LoadConfig`s are checked apart, by building them)."""
        if cls.loads_from != "loads":
            return
        if not suite.loads:
            raise ValueError(f"loads: mode {mode} needs a non-empty list of {cls.loads_are}")
        if cls.integer_loads and any(v != int(v) for v in suite.loads):
            raise ValueError(f"loads: mode {mode} needs integers, got {list(suite.loads)}")
        if list(suite.loads) != sorted(suite.loads):
            raise ValueError("loads: must increase (a series stops raising the load at saturation)")

    @classmethod
    def point_loads(cls, suite: Any, **options) -> list[float | None]:
        """The load of each point of a series, in order."""
        value = getattr(suite, cls.loads_from)
        return list(value) if cls.loads_from == "loads" else [value]

    @classmethod
    def point_config(
        cls, suite: Any, load: float | None, *, seed: int, max_batch: int | None = None, **options
    ) -> LoadConfig:
        """The `LoadConfig` of the suite's point at `load` (`max_batch`: a batch the replicas sized)."""
        kw: dict[str, Any] = {k: getattr(suite, k) for k in SHARED_SUITE_FIELDS + cls.suite_fields}
        kw[cls.load_field] = int(load) if cls.integer_loads else float(load)
        return LoadConfig(mode=cls.name, seed=seed, **kw)

    @classmethod
    def record_columns(cls, load: float | None, max_batch_size: int | None = None, **options) -> dict:
        """The record columns of every pattern (`RECORD_COLUMNS`), this pattern's filled with the load."""
        out = dict.fromkeys(RECORD_COLUMNS)
        if cls.record_column is not None:
            out[cls.record_column] = load
        return out


class BatchLoad(LoadPattern):
    """`batch_size` requests at once; the next batch when all finished. Warm-up and measured
    requests never share a batch. Option `sized_by_memory` (a suite's `max_batch` mode): one point
    whose batch is the most sequences the replicas' KV memory limit holds, `rounds` batches of it."""

    name = "batch"
    requires = ("batch_size",)
    load_field = "batch_size"
    loads_are = "batch sizes"
    record_column = "batch_size"

    @property
    def target_concurrency(self) -> int | None:
        return self.cfg.batch_size

    async def drive(self, run: SharedRun) -> None:
        while True:
            batch: list[tuple[int, bool]] = []
            while len(batch) < self.cfg.batch_size:
                # a batch is all warm-up or all measured: a measured index asked for while the warm-ups run would
                # open the window early, so the batch ends where the kind changes (or a bound stops the run)
                nxt = run.next_index(batch[0][1] if batch else None)
                if nxt is None:
                    break
                batch.append(nxt)
            if not batch:
                return
            await asyncio.gather(*(run.send(i, w) for i, w in batch))

    @classmethod
    def check_suite(cls, suite: Any, mode: str, sized_by_memory: bool = False, **options) -> None:
        if not sized_by_memory:
            return super().check_suite(suite, mode)
        if suite.target is not None:
            raise ValueError(
                f"target: mode {mode} needs our replicas' memory model; use concurrency, rate or serving-batch"
            )
        if suite.loads:
            raise ValueError(f"loads: not used in mode {mode} (the batch is found from the memory limit)")
        need_one_of(
            suite,
            "kv_memory_limit",
            "kv_memory_limit_bytes",
            "kv_memory_fraction",
            what=f"mode {mode} needs a KV memory limit (or a fraction of device memory)",
        )
        if suite.prompt_tokens.dist != "fixed" or suite.new_tokens.dist != "fixed":
            raise ValueError(f"prompt_tokens, new_tokens: mode {mode} needs fixed lengths (integers)")

    @classmethod
    def point_loads(cls, suite: Any, sized_by_memory: bool = False, **options) -> list[float | None]:
        return [None] if sized_by_memory else super().point_loads(suite)

    @classmethod
    def point_config(
        cls,
        suite: Any,
        load: float | None,
        *,
        seed: int,
        max_batch: int | None = None,
        sized_by_memory: bool = False,
        **options,
    ) -> LoadConfig:
        if not sized_by_memory:
            return super().point_config(suite, load, seed=seed)
        kw = {k: getattr(suite, k) for k in SHARED_SUITE_FIELDS}
        kw.update(batch_size=max_batch, num_requests=max_batch * suite.rounds, duration_s=None)
        return LoadConfig(mode=cls.name, seed=seed, **kw)

    @classmethod
    def record_columns(
        cls, load: float | None, max_batch_size: int | None = None, sized_by_memory: bool = False, **options
    ) -> dict:
        return super().record_columns(max_batch_size if sized_by_memory else load)


class ConcurrencyLoad(LoadPattern):
    """Closed loop: `concurrency` workers, each sending its next request when its previous one ended."""

    name = "concurrency"
    requires = ("concurrency",)
    load_field = "concurrency"
    loads_are = "concurrencies"
    record_column = "concurrency"

    @property
    def target_concurrency(self) -> int | None:
        return self.cfg.concurrency

    async def drive(self, run: SharedRun) -> None:
        async def worker():
            while (nxt := run.next_index()) is not None:
                await run.send(*nxt)

        await asyncio.gather(*(worker() for _ in range(self.cfg.concurrency)))


def _capacity_defaults(data: dict, suffix: str) -> dict:
    """A capacity suite's raw mapping (a serving suite's `mode: capacity`, `workloads.serving.capacity`), checked:
    the search picks its rates, so no `loads` or `saturation`, and it needs its `capacity:` bracket (fields ending in
    `suffix`: ``req_per_s``, or ``sessions_per_s`` with a ``sessions:`` block). ValueError naming the field."""
    mode = data.get("mode")
    if data.get("loads") is not None:
        raise ValueError(
            f"loads: not used in mode {mode} (the search picks its rates from capacity: a grid from "
            f"min_rate_{suffix} to max_rate_{suffix} at its resolution)"
        )
    if data.get("saturation") is not None:
        raise ValueError(f"saturation: not used in mode {mode} (a probe passes or fails on its SLO attainment)")
    if data.get("capacity") is None:
        unit = "req/s" if suffix == "req_per_s" else "sessions/s"
        raise ValueError(
            f"capacity: mode {mode} needs the rate bracket to search, e.g. capacity: {{min_rate_{suffix}: 0.1, "
            f"max_rate_{suffix}: 2.0}} ({unit}; optional target_attainment (0.99), resolution (0.1), max_probes)"
        )
    return data


class _CapacitySearched:
    """A load pattern a capacity search drives: under the search (`capacity_search`) the `capacity:` grid gives the
    loads (`workloads.serving.capacity.CapacitySearch.grid`) and the pattern's own load checks do not apply."""

    @classmethod
    def check_suite(cls, suite: Any, mode: str, capacity_search: bool = False, **options) -> None:
        if not capacity_search:
            super().check_suite(suite, mode)

    @classmethod
    def point_loads(cls, suite: Any, capacity_search: bool = False, **options) -> list[float | None]:
        return list(suite.capacity.grid()) if capacity_search else super().point_loads(suite)


class OpenLoop(LoadPattern):
    """Open loop: sends at the times `arrivals()` yields, whatever the replies; with
    `max_concurrency` an arrival that finds the cap reached waits (`delay`) or is dropped (`drop`)."""

    @property
    def target_concurrency(self) -> int | None:
        return self.cfg.max_concurrency

    def arrivals(self) -> Iterator[Arrival]:
        """When to send what, in order (offsets from the run's start)."""
        raise NotImplementedError

    async def drive(self, run: SharedRun) -> None:
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
                run.records.append(
                    RequestRecord(
                        req.request_id, len(req.prompt_ids), req.max_new_tokens, scheduled_time_s=t, warmup=warm
                    )
                )
                continue
            tasks.append(asyncio.ensure_future(self._send(run, cap, index, warm, t, full)))
        else:
            run.exhausted = True
        await asyncio.gather(*tasks)

    @staticmethod
    async def _send(run: SharedRun, cap, index: int, warm: bool, scheduled: float, waited: bool) -> None:
        if cap is None:
            await run.send(index, warm, scheduled)
            return
        async with cap:
            await run.send(index, warm, scheduled, cap_delayed=waited)


class RateLoad(_CapacitySearched, OpenLoop):
    """Arrivals at `rate_req_per_s` with gamma gaps of shape `burstiness` (1: Poisson), seeded by `seed`."""

    name = "rate"
    requires = ("rate_req_per_s",)
    load_field = "rate_req_per_s"
    integer_loads = False
    loads_are = "request rates (req/s)"
    suite_fields = ("arrival", "burstiness", "max_concurrency", "cap_policy")
    record_column = "request_rate"

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

    # ---- option `capacity_search` (a serving suite's `capacity` mode): the rates come from the suite's
    # `capacity:` grid (`workloads.serving.capacity.CapacitySearch.grid`), the search picks which of them run
    @classmethod
    def suite_defaults(cls, data: dict, capacity_search: bool = False, **options) -> dict:
        if not capacity_search:
            return super().suite_defaults(data)
        return _capacity_defaults(data, "req_per_s")


class TraceLoad(OpenLoop):
    """Replays `trace_path` (`read_trace`): row `i` is sent `arrival_s * trace_time_scale` after the
    run started, with the row's prompt and output lengths (build the requests with `requests()`).
    The trace's last row ends the run (as the count would), if no other bound came first. A suite
    in this mode gives neither loads nor lengths: its one point per series runs at its `trace_time_scale`."""

    name = "trace"
    requires = ("trace_path",)
    bounded = True
    load_field = "trace_time_scale"
    integer_loads = False
    loads_from = "trace_time_scale"
    suite_fields = ("trace_path", "max_concurrency", "cap_policy")
    suite_forbids = ("prompt_tokens", "new_tokens", "loads")

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
        self.rows  # reads and checks the file now

    def length_range(self) -> tuple[LengthDist, LengthDist]:
        """The trace's prompt and output lengths as `LengthDist(dist="trace", min, max)` (for memory
        budgets and records; not to be sampled)."""
        p = [r.prompt_tokens for r in self.rows]
        o = [r.output_tokens for r in self.rows]
        return LengthDist("trace", min=min(p), max=max(p)), LengthDist("trace", min=min(o), max=max(o))

    def arrivals(self) -> Iterator[Arrival]:
        for row in self.rows:
            yield Arrival(row.arrival_s * self.cfg.trace_time_scale, row.prompt_tokens, row.output_tokens)

    def requests(self, **prompts) -> list[GenerationRequest]:
        """One request per row, with the row's lengths; `prompts`: `requests_of_lengths`'s keywords
        (`seed`, `tokenizer`, `vocab_size`, `prefix`; prefix "trace" unless given)."""
        rows = self.rows
        prompts.setdefault("seed", 0)
        prompts.setdefault("prefix", "trace")
        return requests_of_lengths([r.prompt_tokens for r in rows], [r.output_tokens for r in rows], **prompts)

    def request_source(
        self, prompt_tokens=None, output_tokens=None, *, seed: int, **prompts
    ) -> Callable[[int], GenerationRequest]:
        """Request `i` is row `i` (`requests`); the trace ends with its last row, so none is sent twice. The
        length distributions are not used (the trace gives the lengths)."""
        return self.requests(seed=seed, **prompts).__getitem__

    @classmethod
    def suite_defaults(cls, data: dict, **options) -> dict:
        """The trace's rows give arrivals and lengths: the suite's `prompt_tokens`/`new_tokens` are its range."""
        for k in cls.suite_forbids:
            if data.get(k) is not None:
                raise ValueError(f"{k}: not used in mode trace (the trace's rows give arrivals and lengths)")
        if data.get("trace_path") is None:
            raise ValueError("trace_path: mode trace needs a trace file (CSV or JSONL, docs/load-generation.md)")
        cfg = LoadConfig(
            mode="trace", trace_path=str(data["trace_path"]), trace_time_scale=data.get("trace_time_scale", 1.0)
        )
        prompt, new = cfg.pattern.length_range()
        return {**data, "prompt_tokens": prompt, "new_tokens": new}


class SessionsLoad(_CapacitySearched, LoadPattern):
    """Multi-turn sessions (`workloads.load.sessions`): session starts arrive at `session_rate_per_s` with gamma gaps
    of shape `burstiness` (1: Poisson), seeded by `seed`, or at a session trace's start times (then the load is the
    trace's `trace_time_scale` and the rate is unused: give loads [1]); each session then sends its turns one after
    another, turn k once turn k-1's answer came back and the turn's think time passed. A turn that fails ends its
    session. The run ends when every session ended (or a bound came first). Warm-up: the first `warmup_requests`
    turns handed out (their sessions are left out of the per-session figures)."""

    name = "sessions"
    requires = ("sessions", "session_rate_per_s")
    bounded = True
    load_field = "session_rate_per_s"
    integer_loads = False
    loads_are = "session start rates (sessions/s)"
    suite_fields = ("sessions", "arrival", "burstiness")
    suite_forbids = ("prompt_tokens", "trace_path")
    record_column = "session_rate"

    def plan(self, new_tokens: LengthDist | None) -> list[PlannedSession]:
        """The point's sessions (`workloads.load.sessions.plan_sessions`, seeded by the config's `seed`)."""
        return plan_sessions(self.cfg.sessions, new_tokens, self.cfg.seed)

    def check(self) -> None:
        if self.cfg.sessions.trace_path is not None:
            self.plan(None)  # reads and checks the trace now

    def request_source(
        self, prompt_tokens=None, output_tokens=None, *, seed: int, tokenizer=None, vocab_size=None, prefix="req"
    ) -> SessionSource:
        """A `SessionSource` over `plan(output_tokens)` (the answers' lengths; `prompt_tokens` is not used: a turn's
        prompt is its conversation so far), its texts seeded by `seed`."""
        return SessionSource(
            self.plan(output_tokens),
            self.cfg.sessions,
            seed=seed,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            prefix=prefix,
        )

    def start_times_s(self, sessions: list[PlannedSession]) -> list[float]:
        """Each session's start (s after the run started): a trace's offsets, else the arrival process's."""
        if all(s.start_s is not None for s in sessions):
            return [s.start_s for s in sessions]
        gaps = arrival_gaps_s(len(sessions), self.cfg.session_rate_per_s, self.cfg.burstiness, self.cfg.seed)
        return [float(t) for t in np.cumsum(gaps)]

    async def drive(self, run: SharedRun) -> None:
        source = run.requests
        if not isinstance(source, SessionSource):
            raise TypeError("mode sessions needs its own request source (LoadConfig.pattern.request_source)")
        sessions = source.sessions

        async def one(session: PlannedSession, start_s: float) -> None:
            at = run.start + start_s
            await run.sleep_until(at)
            history = source.opening(session)
            answered_s = at
            for k, turn in enumerate(session.turns):
                if k:
                    at = answered_s + turn.think_s  # the user reads the answer, then writes
                    await run.sleep_until(at)
                nxt = run.next_index()
                if nxt is None:
                    return
                index, warm = nxt
                expected = source.expected_reuse_tokens(session, k, history)
                req = source.assign(index, session, k, history)
                rec = await run.send(index, warm, at)
                rec.session_id, rec.turn, rec.session_turns = session.index, k, len(session.turns)
                rec.expected_reuse_tokens = expected
                if rec.ok and any(i < 0 for i in rec.output_ids):  # an HTTP reply of text without its token ids
                    rec.error_kind = "missing_token_ids"
                    rec.error = (
                        "the reply carried text without token ids; a session's next turn sends the answer's ids "
                        "back (our server sends them; vLLM with extra_body {return_token_ids: true})"
                    )
                if not rec.ok:
                    return  # the conversation cannot go on without the answer
                answered_s = rec.finish_time_s
                history = list(req.prompt_ids) + rec.output_ids

        await asyncio.gather(*(one(s, t) for s, t in zip(sessions, self.start_times_s(sessions))))
        run.exhausted = True

    # ---- option `capacity_search` (a serving suite's `mode: capacity` with a `sessions:` block): the session start
    # rates come from the suite's `capacity:` grid, in sessions/s; a probe passes on its session SLO attainment
    @classmethod
    def suite_defaults(cls, data: dict, capacity_search: bool = False, **options) -> dict:
        """The sessions give the prompts: the suite's `prompt_tokens` is the range of a turn's prompt (turn 0's
        shortest to the last turn's longest); `new_tokens` is each answer's length (a trace's range for a trace).
        In a capacity search (`capacity_search`), drawn sessions only: a trace's start times fix the rate."""
        if capacity_search:
            _capacity_defaults(data, "sessions_per_s")
            trace = data.get("sessions").get("trace_path") if isinstance(data.get("sessions"), dict) else None
            if trace is not None or getattr(data.get("sessions"), "trace_path", None) is not None:
                raise ValueError(
                    "sessions.trace_path: a capacity search varies the session start rate, and a trace's start times "
                    "fix it; give drawn sessions (users, turns, message_tokens) or use mode sessions"
                )
        for k in cls.suite_forbids:
            if data.get(k) is not None:
                raise ValueError(f"{k}: not used in mode sessions (each turn's prompt is the conversation so far)")
        if data.get("sessions") is None:
            raise ValueError(
                "sessions: mode sessions needs the sessions, e.g. sessions: {users: 4, turns: 3, message_tokens: 32, "
                "think_time_s: 0.5, system_prompt_tokens: 64} (or trace_path: a multi-turn trace)"
            )
        try:
            spec = data["sessions"] if isinstance(data["sessions"], SessionSpec) else SessionSpec(**data["sessions"])
        except ValueError as e:
            raise ValueError("; ".join(f"sessions.{part}" for part in _error_lines(e))) from None
        except TypeError:
            raise ValueError(f"sessions: expected a mapping, got {data['sessions']!r}") from None
        layers = spec.system_prompt_tokens + spec.group_context_tokens
        if spec.trace_path is not None:
            if data.get("new_tokens") is not None:
                raise ValueError("new_tokens: not used with sessions.trace_path (the trace gives each answer's length)")
            try:
                planned = plan_sessions(spec, None, 0)
            except ValueError as e:
                raise ValueError(str(e)) from None
            outs = [t.output_tokens for s in planned for t in s.turns]
            new = LengthDist("trace", min=min(outs), max=max(outs))
            first = min(s.turns[0].message_tokens for s in planned)
        else:
            if data.get("new_tokens") is None:
                raise ValueError("new_tokens: mode sessions needs each answer's length (an integer or a distribution)")
            new = data["new_tokens"]
            new = new if isinstance(new, LengthDist) else LengthDist.parse("new_tokens", new)
            planned = []
            first = spec.message_tokens.min or spec.message_tokens.value or 1
        longest, whole = longest_session_tokens(spec, planned, new)
        if spec.max_prompt_tokens is not None and longest > spec.max_prompt_tokens:
            raise ValueError(
                f"sessions.max_prompt_tokens: the last turn's prompt reaches {longest} tokens (system + context + "
                f"every earlier message and answer + its message), above the budget of {spec.max_prompt_tokens}"
            )
        prompt = LengthDist("trace", min=max(1, layers + first), max=longest)
        return {**data, "sessions": spec, "prompt_tokens": prompt, "new_tokens": new, "session_tokens": whole}

    @classmethod
    def record_columns(cls, load: float | None, max_batch_size: int | None = None, **options) -> dict:
        return super().record_columns(load)


def _error_lines(e: ValueError) -> list[str]:
    """A pydantic error as `field: message` lines (a plain ValueError: its text)."""
    errors = getattr(e, "errors", None)
    if not callable(errors):
        return [str(e)]
    return [
        ".".join(str(x) for x in err["loc"]) + ": " + str(err["msg"]).removeprefix("Value error, ")
        if err["loc"]
        else str(err["msg"]).removeprefix("Value error, ")
        for err in errors()
    ]


#: Every load pattern by `LoadConfig.mode`; a new pattern is one class and one line here.
LOAD_PATTERNS: dict[str, type[LoadPattern]] = {
    p.name: p for p in (BatchLoad, ConcurrencyLoad, RateLoad, TraceLoad, SessionsLoad)
}
#: The record columns the patterns fill (`LoadPattern.record_column`), in a fixed order.
RECORD_COLUMNS: tuple[str, ...] = tuple(p.record_column for p in LOAD_PATTERNS.values() if p.record_column)
#: A suite's modes that are not a pattern's own name: mode -> (pattern, options of its suite methods).
MODE_ALIASES: dict[str, tuple[str, dict]] = {
    "serving-batch": ("batch", {}),
    "max_batch": ("batch", {"sized_by_memory": True}),
    "capacity": ("rate", {"capacity_search": True}),  # Poisson rates a search picks (workloads.serving.capacity)
}
#: Patterns a suite reaches through their aliases only (`batch` is the static-batch suites' mode).
ALIAS_ONLY: frozenset[str] = frozenset({"batch"})
#: Every suite mode: mode -> (pattern class, options).
MODES: dict[str, tuple[type[LoadPattern], dict]] = {
    **{n: (p, {}) for n, p in LOAD_PATTERNS.items() if n not in ALIAS_ONLY},
    **{m: (LOAD_PATTERNS[n], opts) for m, (n, opts) in MODE_ALIASES.items()},
}


def mode_pattern(mode: str, sessions: bool = False) -> tuple[type[LoadPattern], dict]:
    """The pattern and options a suite's `mode` sweeps (`MODES`); `mode: capacity` with a ``sessions:`` block
    (`sessions`) searches session start rates: the sessions pattern at the rates the search picks."""
    pattern, options = MODES[mode]
    if options.get("capacity_search") and sessions:
        return SessionsLoad, options
    return pattern, options
