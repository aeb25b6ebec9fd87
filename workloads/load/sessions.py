"""Multi-turn sessions for the load generator (`workloads.load.patterns.SessionsLoad`, mode ``sessions``).

A session is one user's conversation of `turns` turns. Turn k's prompt is the conversation so far, token ids
concatenated (the serving path sends token ids, never chat messages, so no chat template is applied)::

    system prompt (shared by every user) + group context (shared by the users of a group)
      + message_0 + answer_0 + ... + message_{k-1} + answer_{k-1} + message_k

where `answer_j` is the ids the server generated for turn j, so turn k is sent only after turn k-1's answer came
back, plus a think time. Messages, the system prompt and the contexts are windows of the project's load-test
text (`workloads.load.prompts.prompts_for`; random ids for test models without a tokenizer), seeded so every
series at one load gets the same sessions, messages and think times (the answers are each series' own).

Sessions come from a `SessionSpec`: drawn (`users`, `turns`, `message_tokens`, `think_time_s`), or replayed from a
multi-turn trace (`read_session_trace`: Mooncake-style JSONL with AIPerf's session fields, docs/load-generation.md).

Per turn the record carries `expected_reuse_tokens`: the prompt tokens the turn shares with what was sent before
it (turn 0: the system prompt when an earlier session sent it, and the group context when an earlier session of
its group did; turn k > 0: the whole previous turn's prompt and its answer), token-level, beside the engine's
`cached_prompt_tokens` where the backend reports it (None otherwise; a prefix cache of whole blocks reports at most
the expected reuse rounded down to its block).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import field_validator, model_validator

from replica.common.rules import FrozenConfig, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from replica.common.types import GenerationRequest
from workloads.load.lengths import LengthDist
from workloads.load.metrics import LatencyStats, RequestRecord
from workloads.load.prompts import prompts_for
from workloads.load.slo import SLO

THINK_DISTS = ("fixed", "uniform", "exponential")
#: The parameters each think time distribution takes (seconds).
_THINK_PARAMETERS = {"fixed": ("value",), "uniform": ("min", "max"), "exponential": ("mean",)}


class ThinkTime(FrozenConfig):
    """Think time between a turn's answer and the user's next message (seconds): `fixed` (value), `uniform`
    (min..max) or `exponential` (mean). YAML: a number (fixed) or a mapping. A negative or missing field raises
    ValueError naming it."""

    dist: Literal[THINK_DISTS] = "fixed"
    value: NonNegativeFloat | None = None
    min: NonNegativeFloat | None = None
    max: NonNegativeFloat | None = None
    mean: NonNegativeFloat | None = None

    @model_validator(mode="before")
    @classmethod
    def _number(cls, data: Any) -> Any:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return {"dist": "fixed", "value": data}
        if not isinstance(data, (dict, ThinkTime)):
            raise ValueError(
                f"expected seconds >= 0 (a number) or a mapping {{dist: {' | '.join(THINK_DISTS)}, ...}}, got {data!r}"
            )
        return data

    @model_validator(mode="after")
    def _parameters(self) -> "ThinkTime":
        need = _THINK_PARAMETERS[self.dist]
        for k in need:
            if getattr(self, k) is None:
                raise ValueError(f"{k}: required for think time dist {self.dist!r}")
        for k in sorted(set(_THINK_PARAMETERS["uniform"] + ("value", "mean")) - set(need)):
            if getattr(self, k) is not None:  # silently ignored, it would mislead the reader of the suite
                raise ValueError(f"{k}: not used by think time dist {self.dist!r} (it takes {', '.join(need)})")
        if self.dist == "uniform" and self.min > self.max:
            raise ValueError(f"max: {self.max} is below min ({self.min})")
        return self

    def sample(self, n: int, rng: np.random.Generator) -> list[float]:
        """`n` think times (s) drawn with `rng`."""
        if self.dist == "fixed":
            return [float(self.value)] * n
        if self.dist == "uniform":
            return [float(x) for x in rng.uniform(self.min, self.max, size=n)]
        return [float(x) for x in rng.exponential(self.mean, size=n)]


class SessionSpec(FrozenConfig):
    """A suite's ``sessions:`` block (tokens and seconds). Drawn: `users` sessions of `turns` turns, each turn a new
    user message of `message_tokens` (an integer or a length distribution) and `think_time_s` before it; or
    `trace_path`, a multi-turn trace (`read_session_trace`) whose rows give sessions, lengths and think times
    (offsets x `trace_time_scale`). Shared prefix layers: `system_prompt_tokens` for every user, and
    `group_context_tokens` per group of `group_size` consecutive users. `max_prompt_tokens`: a turn's prompt budget
    (optional): every prefix layer, and every turn's prompt, must fit it.

    Raises ValueError naming the field: a negative think time, a prefix layer longer than `max_prompt_tokens`, a
    drawn spec without users/turns/message_tokens, or a trace spec with them.
    """

    users: PositiveInt | None = None
    turns: PositiveInt | None = None
    message_tokens: LengthDist | None = None
    think_time_s: ThinkTime = ThinkTime(value=0.0)
    system_prompt_tokens: NonNegativeInt = 0
    group_context_tokens: NonNegativeInt = 0
    group_size: PositiveInt = 1
    trace_path: str | None = None
    trace_time_scale: PositiveFloat = 1.0
    max_prompt_tokens: PositiveInt | None = None

    @field_validator("message_tokens", mode="before")
    @classmethod
    def _length(cls, v: Any) -> Any:
        return v if v is None or isinstance(v, LengthDist) else LengthDist.parse("message_tokens", v)

    @model_validator(mode="after")
    def _complete(self) -> "SessionSpec":
        drawn = ("users", "turns", "message_tokens")
        if self.trace_path is None:
            for k in drawn:
                if getattr(self, k) is None:
                    raise ValueError(f"{k}: required for drawn sessions (or give trace_path)")
            self.message_tokens.upper  # noqa: B018 - bounded, for the context check
            if "trace_time_scale" in self.model_fields_set:
                raise ValueError("trace_time_scale: only used with trace_path (drawn sessions start at the loads)")
        else:
            for k in drawn:
                if getattr(self, k) is not None:
                    raise ValueError(f"{k}: not used with trace_path (the trace's rows give sessions and lengths)")
        if self.max_prompt_tokens is not None:
            for k in ("system_prompt_tokens", "group_context_tokens"):
                if getattr(self, k) > self.max_prompt_tokens:
                    raise ValueError(
                        f"{k}: {getattr(self, k)} tokens is longer than a turn's prompt budget "
                        f"(max_prompt_tokens: {self.max_prompt_tokens})"
                    )
            layers = self.system_prompt_tokens + self.group_context_tokens
            if layers >= self.max_prompt_tokens:
                raise ValueError(
                    f"group_context_tokens: the prefix layers (system {self.system_prompt_tokens} + group context "
                    f"{self.group_context_tokens} tokens) leave no room for a message in max_prompt_tokens "
                    f"({self.max_prompt_tokens})"
                )
        return self


@dataclass(frozen=True)
class PlannedTurn:
    """One turn: its new user message and answer lengths (tokens), and the think time before it (s; 0 for turn 0)."""

    message_tokens: int
    output_tokens: int
    think_s: float


@dataclass(frozen=True)
class PlannedSession:
    """One session: `index` (start order), `group` (which group context it shares), `start_s` (a trace's offset;
    None: the suite's arrival process places it), its turns."""

    index: int
    group: int
    start_s: float | None
    turns: tuple[PlannedTurn, ...]


def _finite_number(v: Any) -> bool:
    """Whether a trace field is a finite JSON number (JSON's true/false and Python's NaN/Infinity are not)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _trace_turn(line: str, where: str) -> tuple[dict, str, list[int]]:
    """One trace row: (the object, its `session_id`, [input_length, output_length]); ValueError naming `where` and the
    field when the row is not a JSON object of a session's turn."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object (one turn: session_id, input_length, ...), got {row!r}")
    if row.get("session_id") is None:
        raise ValueError(f"{where}, session_id: required (every row is a turn of a session)")
    lengths = []
    for col in ("input_length", "output_length"):
        v = row.get(col)
        if not _finite_number(v) or v != int(v) or v < 1:
            raise ValueError(f"{where}, {col}: expected an integer >= 1, got {v!r}")
        lengths.append(int(v))
    return row, str(row["session_id"]), lengths


def read_session_trace(path: str | Path) -> list[PlannedSession]:
    """A multi-turn trace, Mooncake-style JSONL as AIPerf replays sessions: one object per turn with `session_id`,
    `input_length` (the turn's new input tokens; the history is added by the load generator), `output_length`,
    and either `timestamp` (ms; a session's first turn: its start) or `delay` (ms after the previous turn's answer:
    a later turn). Sessions ordered by start, offsets from the first start (s).

    Raises:
        ValueError: naming ``trace_path`` and the row and field: a missing file, a turn (a `delay` row) whose
            `session_id` has no first turn before it (a missing session), a negative `delay` or `timestamp`, a
            second first turn of one session, a length below 1, a row that is not a JSON object, a number that is
            not finite or is a boolean.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sessions.trace_path: no such file {str(path)!r}")
    starts: dict[str, float] = {}
    turns: dict[str, list[PlannedTurn]] = defaultdict(list)
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"sessions.trace_path: {path.name}, row {i}"
        row, sid, lengths = _trace_turn(line, where)
        if "timestamp" in row:
            if sid in starts:
                raise ValueError(f"{where}, timestamp: session {sid!r} already started (later turns give delay)")
            ts = row["timestamp"]
            if not _finite_number(ts) or ts < 0:
                raise ValueError(f"{where}, timestamp: expected milliseconds >= 0, got {ts!r}")
            starts[sid] = float(ts) / 1000.0
            turns[sid].append(PlannedTurn(lengths[0], lengths[1], 0.0))
        elif "delay" in row:
            if sid not in starts:
                raise ValueError(
                    f"{where}, session_id: turn refers to session {sid!r}, which has no first turn (a row with "
                    "timestamp) before it"
                )
            d = row["delay"]
            if not _finite_number(d) or d < 0:
                raise ValueError(f"{where}, delay: a think time must be milliseconds >= 0, got {d!r}")
            turns[sid].append(PlannedTurn(lengths[0], lengths[1], float(d) / 1000.0))
        else:
            raise ValueError(f"{where}: expected timestamp (a session's first turn) or delay (a later turn)")
    if not starts:
        raise ValueError(f"sessions.trace_path: {str(path)!r} has no rows")
    first = min(starts.values())
    order = sorted(starts, key=lambda s: (starts[s], list(starts).index(s)))
    return [PlannedSession(k, k, starts[s] - first, tuple(turns[s])) for k, s in enumerate(order)]


def plan_sessions(spec: SessionSpec, new_tokens: LengthDist | None, seed: int) -> list[PlannedSession]:
    """The sessions a point runs: a trace's (groups of `group_size` in start order), or drawn with `seed` from the
    spec and `new_tokens` (answer lengths): the same seed gives the same sessions, lengths and think times."""
    if spec.trace_path is not None:
        return [
            PlannedSession(s.index, s.index // spec.group_size, s.start_s * spec.trace_time_scale, s.turns)
            for s in read_session_trace(spec.trace_path)
        ]
    if new_tokens is None:
        raise ValueError("new_tokens: drawn sessions need the answers' length distribution")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(spec.users):
        msg = spec.message_tokens.sample(spec.turns, rng)
        ans = new_tokens.sample(spec.turns, rng)
        think = [0.0] + spec.think_time_s.sample(spec.turns - 1, rng)
        out.append(PlannedSession(i, i // spec.group_size, None, tuple(map(PlannedTurn, msg, ans, think))))
    return out


def longest_session_tokens(
    spec: SessionSpec, sessions: list[PlannedSession], new_tokens: LengthDist | None
) -> tuple[int, int]:
    """(the longest last-turn prompt, the longest whole session) in tokens: a session's last turn's prompt is every
    layer, message and earlier answer, and with its own answer the whole conversation sits in one sequence. Drawn
    sessions at the upper bound of every drawn length; a trace's exactly."""
    layers = spec.system_prompt_tokens + spec.group_context_tokens
    if spec.trace_path is None:
        whole = layers + spec.turns * (spec.message_tokens.upper + new_tokens.upper)
        return whole - new_tokens.upper, whole
    whole = [layers + sum(t.message_tokens + t.output_tokens for t in s.turns) for s in sessions]
    return max(w - s.turns[-1].output_tokens for w, s in zip(whole, sessions)), max(whole)


class SessionSource:
    """The requests of a sessions point. `opening(session)` is the prefix of its turn 0 (system prompt + group
    context ids); `assign(index, session, turn, history)` builds turn `turn`'s request from `history` (the previous
    prompt + its answer ids, or the opening) + the turn's message, and makes it request `index` of the run
    (`source(index)`, what `workloads.load.driver.Run.send` asks for). Message `k` of session `s` is drawn from
    `seed`, `s` and `k` alone, so every series gets the same messages whatever the timing."""

    def __init__(
        self,
        sessions: list[PlannedSession],
        spec: SessionSpec,
        *,
        seed: int,
        tokenizer=None,
        vocab_size: int | None = None,
        prefix: str = "req",
    ):
        if tokenizer is None and vocab_size is None:
            raise ValueError("vocab_size: needed for random prompts when there is no tokenizer")
        self.sessions, self.spec, self.seed = sessions, spec, int(seed)
        self.tokenizer, self.vocab_size, self.prefix = tokenizer, vocab_size, prefix
        self._assigned: dict[int, GenerationRequest] = {}
        self._groups: dict[int, list[int]] = {}
        self._system = self._text(spec.system_prompt_tokens, 1)
        first_of_group: dict[int, int] = {}
        for s in sessions:
            first_of_group.setdefault(s.group, s.index)
        self._first_of_group = first_of_group

    def _text(self, n: int, salt: int) -> list[int]:
        if n == 0:
            return []
        return list(prompts_for(self.tokenizer, self.vocab_size, 1, n, (self.seed * 1_000_003 + salt) % (1 << 63))[0])

    def opening(self, session: PlannedSession) -> list[int]:
        """Turn 0's prefix: the system prompt, then the session's group context (token ids)."""
        if session.group not in self._groups:
            self._groups[session.group] = self._text(self.spec.group_context_tokens, -1 - session.group)
        return self._system + self._groups[session.group]

    def message(self, session: PlannedSession, turn: int) -> list[int]:
        """The user message of `turn` (token ids), from the seed, the session and the turn alone."""
        return self._text(session.turns[turn].message_tokens, 1_000 + 1_009 * session.index + turn)

    def expected_reuse_tokens(self, session: PlannedSession, turn: int, history: list[int]) -> int:
        """Prompt tokens turn `turn` shares with what was sent before it (the module docstring)."""
        if turn > 0:
            return len(history)
        shared = self.spec.system_prompt_tokens if session.index > 0 else 0
        if self._first_of_group.get(session.group) != session.index:
            shared += self.spec.group_context_tokens
        return shared

    def session_key(self, session: PlannedSession) -> str:
        """The engine's `GenerationRequest.session_id` of `session`'s turns (unique within the source's prefix)."""
        return f"{self.prefix}-s{session.index}"

    def assign(self, index: int, session: PlannedSession, turn: int, history: list[int]) -> GenerationRequest:
        """Request `index`: `history` + the turn's message, asking for the turn's answer length."""
        req = GenerationRequest(
            f"{self.prefix}-s{session.index}-t{turn}",
            list(history) + self.message(session, turn),
            session.turns[turn].output_tokens,
            session_id=self.session_key(session),
        )
        self._assigned[index] = req
        return req

    def __call__(self, index: int) -> GenerationRequest:
        return self._assigned[index]


# ---------------------------------------------------------------------------- per turn and per session
def session_metrics(records: list[RequestRecord], slo: SLO, window_s: float | None) -> dict:
    """Per-turn and per-session figures of a sessions point (records with `session_id`; warm-up sessions, those
    with a warm-up turn, left out).

    A session meets the SLO when every one of its planned turns was sent and meets it (`SLO.met_by`); a turn that
    failed ends its session (later turns are not sent), which misses. Keys: ``sessions`` (measured sessions),
    ``sessions_slo_met``, ``session_slo_attainment`` (met / sessions), ``session_goodput_per_s`` (met / window,
    sessions/s), ``expected_reuse_tokens`` and ``cached_prompt_tokens`` (sums; cached None when any turn's backend
    did not report it), and ``turns``: per turn index `k` a mapping of ``turn``, ``n``, ``ttft_p50_s``,
    ``ttft_p99_s``, ``tpot_p50_s``, ``tpot_p99_s``, ``slo_attainment``, ``expected_reuse_tokens_mean`` and
    ``cached_prompt_tokens_mean`` (None when not reported).
    """
    by_session: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in records:
        if r.session_id is not None:
            by_session[r.session_id].append(r)
    measured = {s: rs for s, rs in by_session.items() if not any(r.warmup for r in rs)}
    met = sum(
        1
        for rs in measured.values()
        if rs[0].session_turns is not None and len(rs) == rs[0].session_turns and all(slo.met_by(r) for r in rs)
    )
    turns: dict[int, list[RequestRecord]] = defaultdict(list)
    for rs in measured.values():
        for r in rs:
            turns[r.turn].append(r)
    rows = []
    for k in sorted(turns):
        rs = turns[k]
        ttft = LatencyStats.of([r.ttft_s for r in rs if r.ttft_s is not None])
        tpot = LatencyStats.of([r.tpot_s for r in rs if r.tpot_s is not None])
        cached = [r.cached_prompt_tokens for r in rs]
        rows.append(
            {
                "turn": k,
                "n": len(rs),
                "ttft_p50_s": ttft.p50_s,
                "ttft_p99_s": ttft.p99_s,
                "tpot_p50_s": tpot.p50_s,
                "tpot_p99_s": tpot.p99_s,
                "slo_attainment": sum(slo.met_by(r) for r in rs) / len(rs),
                "expected_reuse_tokens_mean": float(np.mean([r.expected_reuse_tokens or 0 for r in rs])),
                "cached_prompt_tokens_mean": None if any(c is None for c in cached) else float(np.mean(cached)),
            }
        )
    all_turns = [r for rs in measured.values() for r in rs]
    cached_all = [r.cached_prompt_tokens for r in all_turns]
    return {
        "sessions": len(measured),
        "sessions_slo_met": met,
        "session_slo_attainment": met / len(measured) if measured else None,
        "session_goodput_per_s": met / window_s if window_s else None,
        "expected_reuse_tokens": sum(r.expected_reuse_tokens or 0 for r in all_turns),
        "cached_prompt_tokens": None if not all_turns or any(c is None for c in cached_all) else int(sum(cached_all)),
        "turns": rows,
    }
