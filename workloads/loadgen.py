"""The load generator: static batches, closed loop (N in flight) and open loop (Poisson/gamma arrivals).

    result = asyncio.run(run_load(client, requests, LoadConfig(mode="rate", rate_req_per_s=4, num_requests=200)))
    result.metrics.ttft_s.p99_s, result.metrics.output_throughput_tok_per_s

Modes (each bounded by `num_requests` measured requests and/or `duration_s` of measurement):

* `batch`: `batch_size` requests sent at once; the next batch when all of them finished (the
  paper's static-batch setting, seen from a client).
* `concurrency`: closed loop; `concurrency` workers each send a request as soon as their previous
  one finished, so exactly N are in flight (no lockstep batches).
* `rate`: open loop; arrivals at `rate_req_per_s` with gamma-distributed gaps of shape
  `burstiness` (1 = Poisson; below 1 burstier, above 1 more regular), scheduled on absolute times
  so a late event never shifts later ones. With `max_concurrency`, an arrival that finds the cap
  reached waits for a free slot (`cap_policy: delay`, the delay is recorded) or is not sent
  (`drop`, counted as dropped). The point reports target and achieved rate.

Warm-up: the first `warmup_requests` requests, and every request sent before `warmup_s` elapsed,
are warm-up; they run like the others but are excluded from latency statistics, and the
measurement window opens after them. The window closes at the last measured token (count-bound)
or `duration_s` after it opened (duration-bound; nothing is sent after that, and the requests in
flight are waited for and recorded). Every request built is accounted for: sent (then ok or
error by kind) or dropped.

A client is anything with `async generate(request) -> GenerationResult | dict` (the router, a
fake replica in tests). Times come from `clock` (default `time.time`, the replicas' clock too).
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from cluster.engine import GenerationRequest, GenerationResult
from workloads.metrics import PointMetrics, RequestRecord, summarize

MODES = ("batch", "concurrency", "rate")
ARRIVALS = ("poisson", "gamma")
CAP_POLICIES = ("delay", "drop")
LENGTH_DISTS = ("fixed", "uniform", "normal", "lognormal")


class Client(Protocol):
    async def generate(self, request: GenerationRequest) -> GenerationResult | dict: ...


# ---------------------------------------------------------------------------- lengths and requests
@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: `fixed` (value), `uniform` (min..max inclusive), `normal`
    (mean, std) or `lognormal` (mean = the median, sigma), clipped to [min, max].

    YAML: an integer (fixed) or a mapping `{dist: uniform, min: 64, max: 512}`.
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
            v = getattr(d, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}.{k}: expected an integer >= 1, got {v!r}")
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
    """`n` requests with lengths drawn (seeded) from the two distributions.

    Prompts are windows of real text (`workloads.prompts.make_prompts`, the model's own tokenizer)
    when `tokenizer` is given; else random ids below `vocab_size` (test models without a tokenizer).
    """
    rng = np.random.default_rng(seed)
    p_len = prompt_tokens.sample(n, rng)
    o_len = output_tokens.sample(n, rng)
    prompts: list[list[int] | None] = [None] * n
    if tokenizer is not None:
        from workloads.prompts import make_prompts

        for length in sorted(set(p_len)):
            idx = [i for i, x in enumerate(p_len) if x == length]
            for i, ids in zip(idx, make_prompts(tokenizer, len(idx), length, seed=seed + length)):
                prompts[i] = list(ids)
    else:
        if vocab_size is None:
            raise ValueError("vocab_size: needed for random prompts when there is no tokenizer")
        for i, length in enumerate(p_len):
            prompts[i] = rng.integers(0, vocab_size, size=length).tolist()
    return [GenerationRequest(f"{prefix}-{i}", prompts[i], o_len[i]) for i in range(n)]


# ---------------------------------------------------------------------------- config
@dataclass
class LoadConfig:
    """One load point (see the module docstring). Errors name the field."""

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
    warmup_requests: int = 0
    warmup_s: float = 0.0
    request_timeout_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: unknown mode {self.mode!r} (accepted: {', '.join(MODES)})")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("num_requests, duration_s: give at least one bound")
        for k in ("num_requests", "batch_size", "concurrency", "max_concurrency"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{k}: expected an integer >= 1, got {v!r}")
        for k in ("duration_s", "rate_req_per_s", "request_timeout_s"):
            v = getattr(self, k)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{k}: expected a number > 0, got {v!r}")
        if not (isinstance(self.burstiness, (int, float)) and self.burstiness > 0):
            raise ValueError(f"burstiness: expected a number > 0, got {self.burstiness!r}")
        if not (isinstance(self.warmup_s, (int, float)) and self.warmup_s >= 0):
            raise ValueError(f"warmup_s: expected a number >= 0, got {self.warmup_s!r}")
        if isinstance(self.warmup_requests, bool) or not isinstance(self.warmup_requests, int) or self.warmup_requests < 0:
            raise ValueError(f"warmup_requests: expected an integer >= 0, got {self.warmup_requests!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival: unknown {self.arrival!r} (accepted: {', '.join(ARRIVALS)})")
        if self.arrival == "poisson" and self.burstiness != 1.0:
            raise ValueError("burstiness: Poisson arrivals have burstiness 1; use arrival: gamma")
        if self.cap_policy not in CAP_POLICIES:
            raise ValueError(f"cap_policy: unknown {self.cap_policy!r} (accepted: {', '.join(CAP_POLICIES)})")
        need = {"batch": "batch_size", "concurrency": "concurrency", "rate": "rate_req_per_s"}[self.mode]
        if getattr(self, need) is None:
            raise ValueError(f"{need}: required in mode {self.mode!r}")

    @property
    def target_concurrency(self) -> int | None:
        return {"batch": self.batch_size, "concurrency": self.concurrency}.get(self.mode, self.max_concurrency)


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


# ---------------------------------------------------------------------------- the generator
class _Run:
    def __init__(self, client: Client, requests: Callable[[int], GenerationRequest], config: LoadConfig,
                 clock: Callable[[], float]):
        self.client, self.requests, self.cfg, self.clock = client, requests, config, clock
        self.records: list[RequestRecord] = []
        self.issued = 0              # requests handed out (warm-up included)
        self.measured = 0            # measured requests handed out
        self.in_flight = 0
        self.start = clock()
        self.window_start: float | None = None
        self.deadline: float | None = None      # end of the duration-bound window

    # -- which request comes next, and is it warm-up?
    def next_index(self) -> tuple[int, bool] | None:
        now = self.clock()
        if self.deadline is not None and now >= self.deadline:
            return None
        warm = self.issued < self.cfg.warmup_requests or now < self.start + self.cfg.warmup_s
        if not warm:
            if self.cfg.num_requests is not None and self.measured >= self.cfg.num_requests:
                return None
            if self.window_start is None:
                self.window_start = now
                if self.cfg.duration_s is not None:
                    self.deadline = now + self.cfg.duration_s
            self.measured += 1
        i = self.issued
        self.issued += 1
        return i, warm

    async def send(self, index: int, warmup: bool, scheduled: float | None = None) -> RequestRecord:
        req = self.requests(index)
        rec = RequestRecord(req.request_id, len(req.prompt_ids), req.max_new_tokens, scheduled_time_s=scheduled,
                            warmup=warmup)
        self.records.append(rec)
        rec.send_time_s = self.clock()
        self.in_flight += 1
        try:
            res = await asyncio.wait_for(self.client.generate(req), self.cfg.request_timeout_s)
            if isinstance(res, dict):
                res = GenerationResult(**res)
            rec.output_tokens = len(res.output_ids)          # generated ids, never re-tokenized text
            rec.token_times_s = list(res.token_times_s)
            rec.error_kind, rec.error, rec.replica_id = res.error_kind, res.error, res.replica_id
        except asyncio.TimeoutError:
            rec.error_kind, rec.error = "timeout", f"no answer within {self.cfg.request_timeout_s} s"
        except Exception as e:  # noqa: BLE001 - every request ends as ok or an error of a kind
            rec.error_kind, rec.error = error_kind(e), f"{type(e).__name__}: {e}"[:2000]
        finally:
            self.in_flight -= 1
            rec.finish_time_s = self.clock()
        return rec

    async def sleep_until(self, t: float) -> None:
        delay = t - self.clock()
        if delay > 0:
            await asyncio.sleep(delay)

    # -- modes
    async def run_batch(self) -> None:
        pushed = None                    # warm-up and measured requests never share a batch
        while True:
            batch = [pushed] if pushed is not None else []
            pushed = None
            while len(batch) < self.cfg.batch_size:
                nxt = self.next_index()
                if nxt is None:
                    break
                if batch and nxt[1] != batch[0][1]:
                    pushed = nxt
                    break
                batch.append(nxt)
            if not batch:
                return
            await asyncio.gather(*(self.send(i, w) for i, w in batch))

    async def run_concurrency(self) -> None:
        async def worker():
            while (nxt := self.next_index()) is not None:
                await self.send(*nxt)
        await asyncio.gather(*(worker() for _ in range(self.cfg.concurrency)))

    async def run_rate(self) -> None:
        cfg = self.cfg
        cap = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        tasks: list[asyncio.Task] = []
        t = self.start
        chunk = 0
        while True:
            gaps = arrival_gaps_s(1024, cfg.rate_req_per_s, cfg.burstiness, seed=cfg.seed * 1_000_003 + chunk)
            chunk += 1
            for gap in gaps:
                t += float(gap)
                await self.sleep_until(t)
                nxt = self.next_index()
                if nxt is None:
                    await asyncio.gather(*tasks)
                    return
                index, warm = nxt
                if cap is not None and cap.locked() and cfg.cap_policy == "drop":
                    req = self.requests(index)
                    self.records.append(RequestRecord(req.request_id, len(req.prompt_ids), req.max_new_tokens,
                                                      scheduled_time_s=t, warmup=warm))
                    continue
                tasks.append(asyncio.ensure_future(self._capped(cap, index, warm, t)))

    async def _capped(self, cap, index, warm, scheduled) -> None:
        if cap is None:
            await self.send(index, warm, scheduled)
            return
        async with cap:
            await self.send(index, warm, scheduled)


def error_kind(exc: BaseException) -> str:
    """A short kind for an exception a client raised: `replica_died`, `oom`, `timeout` or `error`."""
    names = {type(exc).__name__} | {c.__name__ for c in type(exc).__mro__}
    cause = getattr(exc, "cause", None)
    if cause is not None:
        names |= {c.__name__ for c in type(cause).__mro__}
    if names & {"RayActorError", "ActorDiedError", "ActorUnavailableError", "ReplicaUnavailableError"}:
        return "replica_died"
    if names & {"OutOfMemoryError", "MemoryError"}:
        return "oom"
    if names & {"TimeoutError", "GetTimeoutError"}:
        return "timeout"
    return "error"


async def run_load(client: Client, requests: Callable[[int], GenerationRequest] | list[GenerationRequest],
                   config: LoadConfig, clock: Callable[[], float] = time.time) -> LoadResult:
    """Drive `client` with `config`; return every request's record and the point's metrics.

    `requests(i)` builds request `i` (warm-up included, in send order); a list is cycled, each
    use getting a unique id.
    """
    if isinstance(requests, list):
        pool = requests
        if not pool:
            raise ValueError("requests: the request list is empty")

        def requests(i: int, _pool=pool) -> GenerationRequest:
            r = _pool[i % len(_pool)]
            return GenerationRequest(f"{r.request_id}#{i}", r.prompt_ids, r.max_new_tokens, r.ignore_eos)

    run = _Run(client, requests, config, clock)
    await {"batch": run.run_batch, "concurrency": run.run_concurrency, "rate": run.run_rate}[config.mode]()
    end = run.deadline
    if end is None:                                   # count-bound: the last measured token (or answer)
        ends = [r.token_times_s[-1] if r.token_times_s else r.finish_time_s
                for r in run.records if not r.warmup and r.sent]
        end = max(ends) if ends else None
    metrics = summarize(run.records, mode=config.mode, window_start_s=run.window_start, window_end_s=end,
                        target_rate_req_per_s=config.rate_req_per_s if config.mode == "rate" else None,
                        target_concurrency=config.target_concurrency)
    return LoadResult(run.records, metrics, config, run.start, clock())
