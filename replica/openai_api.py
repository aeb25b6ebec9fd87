"""The OpenAI-compatible HTTP API over engine backends (FastAPI; no Ray here, `cluster.serve_app` deploys it).

    app = build_app({"smollm2-135m-instruct:full": backend, ...}, tokenizer, context_tokens=8192)

`build_app` is the thin constructor of an `OpenAIServer` (the backends, the configuration, the per-model counts
of requests in flight, one method per route) and returns its FastAPI app.

Endpoints (OpenAI's API reference; `ignore_eos` and `min_tokens` as vLLM names them):

* `POST /v1/completions`: `prompt` as text or a list of token ids;
* `POST /v1/chat/completions`: `messages` (roles `CHAT_ROLES`: system, user, assistant) through the
  tokenizer's chat template;
* both with `stream` true (Server-Sent Events: one `data:` event per token as soon as the engine
  decoded it, `data: [DONE]` last; with `stream_options.include_usage` a final chunk carries
  `usage`) or false (one JSON reply with `usage`);
* `GET /v1/models` (one id per cache configuration, policy/ratio/budget as metadata), `GET /health`.

Parameters: `model`, `max_tokens`, `temperature` (0 = greedy, the default), `top_p`, `seed`, `stop`
(a string or a list; the text stops before it, `finish_reason: "stop"`), `n` (only 1),
`ignore_eos`, `min_tokens`, `stream_options.include_usage`, `user` (the session: `GenerationRequest.session_id`,
so a conversation's turns reuse its kept KV cache under `kv_reuse: session_state`). Every chunk and reply also carries
`token_ids` (the generated ids of that chunk, an extension: load generators count tokens from
ids, never from text) and, in the last chunk / the reply, `scissorhands` (replica-side times:
`replica_ttft_s`, `received_time_s`, `first_token_time_s`, `replica_id`).

The request header `X-Scissorhands-Phase` (`PHASE_HEADER`: ``warmup`` or ``measured``, the
default) marks a load generator's warm-up request (`workloads.load.http_client` sends it): the engine
counts it apart (`GenerationRequest.warmup`: the ``warmup_*`` stats, ``phase="warmup"`` live
metrics), so the server-side figures of a point cover the same requests as the client's. Any
other value is a 400 naming the header.

A chat without `max_tokens` (or `max_completion_tokens`) runs to EOS or the end of the context (capped at what
the KV memory limit holds for it alone); a completion without it gets 16. With `api_key`, every request
but `GET /health` needs `Authorization: Bearer <key>` (401 otherwise; `/openapi.json` and unknown paths
included), and the `/docs` and `/redoc` pages are off. A body over `max_body_bytes` gets 413 before
it is parsed; bodies are parsed and prompts tokenized on a worker thread, never on the event loop.

Errors are OpenAI's error JSON `{"error": {"message", "type", "param", "code"}}`: 400 naming the
field (`param`) for a wrong type or value, a prompt + `max_tokens` beyond the context, or a request
that can never fit the KV memory limit, or a chat role outside `CHAT_ROLES`; 404 for an unknown model or
path, 405 for a wrong method; 429 with `Retry-After` when a model already has `max_pending_requests`
requests in flight; 503 with `Retry-After` when the backend sheds load (Ray Serve's back-pressure). A stream whose backend fails or dies mid-way
ends with an error event (`data: {"error": ...}`) and `[DONE]`, never a hang. A client that
disconnects mid-stream cancels its request; the backend aborts it (`ContinuousBatchingEngine.abort`).

A backend is anything with `metadata` (dict), `check(prompt_tokens, max_new_tokens, logprobs=False) -> str | None`
(why the request can never be served, or None; a `replica.common.types.Refusal` gives its `kind`, which picks the
error code, a plain string is a KV memory refusal; ``logprobs=True``, asked only of a request wanting log-probabilities,
lets a backend without them refuse it with kind ``unsupported``: 400 naming ``logprobs`` or ``echo``) and `stream(GenerationRequest)`, an async iterator
of `{"token_id", "time_s"}` events ending with one `{"result": GenerationResult fields}`
(`replica.continuous.ServingReplica.stream`). A backend may also have `max_new_tokens_for(prompt_tokens, most)` (the
longest request it serves, in one call instead of a bisection over `check`) and `finish(request_id)`: the request's text
hit a stop string, so it ends as completed (``finish_reason: "stop"``) rather than aborted when its stream closes;
without it the stream is only closed (the replica counts the request aborted).
"""

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from replica.common.session_affinity import keeps_session_state
from replica.common.types import MAX_LOGPROBS, GenerationRequest
from replica.openai_fields import chat_logprobs, completion_logprobs, unsupported_field
from replica.openvino_settings import eviction_from_policy
from replica.token_bytes import TokenBytes

__all__ = [
    "Backend",
    "ReplicaBackend",
    "OpenAIServer",
    "build_app",
    "ApiError",
    "ApiKey",
    "IncrementalDetokenizer",
    "PHASE_HEADER",
    "REPLICA_DIED",
    "replica_death",
    "text_offsets",
]

RETRY_AFTER_S = 1
#: Request bodies larger than this (bytes) are answered 413 before any parsing (`build_app`'s `max_body_bytes`):
#: a full context of 8,192 tokens is under 100 kB as text or as token ids.
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: `max_tokens` of a completion that does not give it (OpenAI's and vLLM's default); chat runs to EOS or the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: The largest `max_tokens` tried for a chat without it when the model's context is unknown (the backend's
#: `check` then finds the longest that fits).
UNKNOWN_CONTEXT_MAX_TOKENS = 1 << 20
#: The environment variable of the service's API key (`cluster.serve_app --api-key`'s default; vLLM's is VLLM_API_KEY).
API_KEY_ENV = "SCISSORHANDS_API_KEY"
#: The paths served without the API key when one is set (liveness, for health checks and load balancers).
OPEN_PATHS = frozenset({"/health"})
#: The chat message roles accepted (`messages[].role`); tool and function messages need tools, which are refused.
CHAT_ROLES = ("system", "user", "assistant")
#: Request header carrying the load generator's phase of a request (`replica.common.metric_labels.PHASES`).
PHASE_HEADER = "X-Scissorhands-Phase"


class Backend(Protocol):
    metadata: dict

    async def check(self, prompt_tokens: int, max_new_tokens: int, logprobs: bool = False) -> str | None: ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[dict]: ...


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ApiKey:
    """An API key kept only as its SHA-256 digest: it never travels in clear to a Serve replica, a log or a
    record, and a bearer token is compared with it in constant time (`hmac.compare_digest`)."""

    def __init__(self, key: str):
        if not isinstance(key, str) or not key:
            raise ValueError("api_key: expected a non-empty string")
        self.sha256 = hashlib.sha256(key.encode()).digest()

    def matches(self, token: str) -> bool:
        return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self.sha256)

    def __repr__(self) -> str:
        return "ApiKey(<redacted>)"


class ReplicaBackend:
    """A `ServingReplica` in this process as a backend (tests, and the body of each Serve replica)."""

    def __init__(self, replica, metadata: dict):
        self.replica, self.metadata = replica, metadata

    async def check(self, prompt_tokens: int, max_new_tokens: int, logprobs: bool = False) -> str | None:
        return await self.replica.check(prompt_tokens, max_new_tokens, logprobs)

    async def max_new_tokens_for(self, prompt_tokens: int, most: int) -> int:
        return await self.replica.max_new_tokens_for(prompt_tokens, most)

    def stream(self, request: GenerationRequest) -> AsyncIterator[dict]:
        return self.replica.stream(request)

    async def finish(self, request_id: str) -> None:
        self.replica.finish(request_id)


def cache_metadata(engine_config: dict, budget_tokens: int | None, model_spec: str) -> dict:
    """`/v1/models` metadata of one cache configuration. OpenVINO's eviction (engine ``openvino``, policy
    ``openvino_eviction``) shows what its pipeline runs, as a sweep record does: ``budget_tokens`` its
    ``max_cache_size`` (tokens, rounded up to 32-token blocks), ``policy_params`` its ``start_size``,
    ``recent_size``, ``max_cache_size`` and ``aggregation_mode`` (`replica.openvino_settings.eviction_from_policy`),
    and ``openvino_max_cache_size_rounding`` (the ratio's rounding in words; None when the size was given)."""
    policy, engine = engine_config.get("policy", "full"), engine_config.get("engine", "ours")
    params, extra = engine_config.get("policy_params", {}), {}
    if engine == "openvino" and policy == "openvino_eviction":
        params, rounding = eviction_from_policy(
            params, engine_config.get("compression_ratio"), engine_config.get("max_length_tokens")
        )
        budget_tokens, extra = params["max_cache_size"], {"openvino_max_cache_size_rounding": rounding}
    return {
        "policy": policy,
        "compression_ratio": engine_config.get("compression_ratio"),
        "budget_tokens": budget_tokens,  # None for the full cache and under budget: per_request
        "budget": engine_config.get("budget", "fixed") if policy != "full" else None,
        "kv_layout": engine_config.get("kv_layout", "preallocated"),
        "policy_params": params,
        "kv_memory_limit_bytes": engine_config.get("kv_memory_limit_bytes"),
        "model_spec": model_spec,
        "engine": engine,  # the backend that serves it (replica.backends)
        **extra,
        # kv_reuse: shared_prefix turns the prefix cache on (EngineConfig), whether or not the knob was given
        "enable_prefix_caching": bool(engine_config.get("enable_prefix_caching", False))
        or engine_config.get("kv_reuse") == "shared_prefix",
        "kv_reuse": engine_config.get("kv_reuse", "none"),  # session_state, shared_prefix: turns go to its replica
    }


def reports_cached_tokens(metadata: dict) -> bool:
    """Whether replies of this cache configuration carry ``usage.prompt_tokens_details.cached_tokens``: our engine
    with the prefix cache on (`EngineConfig.enable_prefix_caching`, or ``kv_reuse: shared_prefix``) or a session's
    kept state (``kv_reuse: session_state``) counts them; with it off, and on OpenVINO
    GenAI's backend (whose pipeline reports no per-request cached tokens), ``prompt_tokens_details`` is null, as
    vLLM sends it when prefix caching is off."""
    keeps = keeps_session_state(metadata.get("kv_reuse"), metadata.get("enable_prefix_caching"))
    return keeps and metadata.get("engine", "ours") == "ours"


def _usage(prompt_tokens: int, completion_tokens: int, result: dict | None, cached: bool) -> dict:
    """OpenAI's ``usage`` object; `cached`: add ``prompt_tokens_details.cached_tokens`` (the request's prompt tokens
    its prefills took from the prefix cache, `GenerationResult.cached_prompt_tokens`), else null."""
    details = None
    if cached and result is not None:
        details = {"cached_tokens": int(result.get("cached_prompt_tokens") or 0)}
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }


# ---------------------------------------------------------------------------- request parsing
def _field(body: dict, name: str, kinds: tuple, default: Any, *, check=None, accepted: str = "") -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise ApiError(400, f"{name}: expected {accepted or '/'.join(k.__name__ for k in kinds)}, got {v!r}", name)
    if check is not None and not check(v):
        raise ApiError(400, f"{name}: expected {accepted}, got {v!r}", name)
    return v


def _parse_common(body: dict, chat: bool = False) -> dict:
    """The sampling and length fields of both endpoints (raises ApiError naming the field): a field the
    endpoint does not implement (`replica.openai_fields`), a wrong type or a value out of range."""
    refused = unsupported_field(body, chat)
    if refused is not None:
        raise ApiError(
            400, f"{refused}: this server does not implement the field {refused!r} (docs/serving-http.md)", refused
        )
    echo = False if chat else _field(body, "echo", (bool,), False, accepted="a boolean")
    low = 0 if echo else 1  # echo with max_tokens 0 scores the prompt only
    max_tokens = _field(body, "max_tokens", (int,), None, check=lambda v: v >= low, accepted=f"an integer >= {low}")
    if "max_completion_tokens" in body and max_tokens is None:
        max_tokens = _field(
            body, "max_completion_tokens", (int,), None, check=lambda v: v >= 1, accepted="an integer >= 1"
        )
    n = _field(body, "n", (int,), 1, check=lambda v: v == 1, accepted="1 (one choice per request)")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop: expected a non-empty string or a list of them, got {body.get('stop')!r}", "stop")
    stream_options = _field(body, "stream_options", (dict,), {}, accepted="an object")
    return dict(
        max_tokens=max_tokens,
        n=n,
        stop=stop,
        temperature=float(
            _field(body, "temperature", (int, float), 0.0, check=lambda v: 0 <= v <= 2, accepted="a number in [0, 2]")
        ),
        top_p=float(
            _field(body, "top_p", (int, float), 1.0, check=lambda v: 0 < v <= 1, accepted="a number in (0, 1]")
        ),
        seed=_field(body, "seed", (int,), None, check=lambda v: -(2**63) <= v < 2**64, accepted="a 64-bit integer"),
        ignore_eos=_field(body, "ignore_eos", (bool,), False, accepted="a boolean"),
        min_tokens=_field(body, "min_tokens", (int,), 0, check=lambda v: v >= 0, accepted="an integer >= 0"),
        # OpenAI's end-user id doubles as the conversation's: the engine's kv_reuse: session_state keys on it
        user=_field(body, "user", (str,), None, check=lambda v: bool(v), accepted="a non-empty string"),
        echo=echo,
        **_parse_logprobs(body, chat, echo),
        stream=_field(body, "stream", (bool,), False, accepted="a boolean"),
        include_usage=bool(_field(stream_options, "include_usage", (bool,), False, accepted="a boolean")),
    )


def _parse_logprobs(body: dict, chat: bool, echo: bool) -> dict:
    """`logprobs` (alternatives per generated token, None: none asked) and `prompt_logprobs` (echo's)."""
    top = f"an integer in [0, {MAX_LOGPROBS}]"
    if chat:
        want = _field(body, "logprobs", (bool,), False, accepted="a boolean")
        k = _field(body, "top_logprobs", (int,), None, check=lambda v: 0 <= v <= MAX_LOGPROBS, accepted=top)
        if k is not None and not want:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        return dict(logprobs=(k or 0) if want else None, prompt_logprobs=None)
    k = _field(body, "logprobs", (int,), None, check=lambda v: 0 <= v <= MAX_LOGPROBS, accepted=top)
    return dict(logprobs=k, prompt_logprobs=(k or 0) if echo else None)


class IncrementalDetokenizer:
    """Text deltas of a growing list of generated ids, at a constant cost per token, cut at stop strings.

    Decodes a bounded window of the ids, as vLLM's detokenizer does: `ids[prefix_offset:read_offset]` were
    emitted already and are kept as context (a decoder's merges and leading-space rules see their left
    neighbours), `ids[read_offset:]` are new. The window's new text is taken when it grew and does not end
    in an incomplete UTF-8 character (U+FFFD: its other bytes are in tokens still to come). So `text` is
    the whole output's `decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`, built
    without decoding it again.

    Stop strings: the text ends before the earliest occurrence of any of them (`stopped` is then True);
    a tail of complete characters that could still begin one is held back, so the deltas always add up to
    `text`, streamed or not.
    """

    #: How far back from the end an incomplete character is looked for (a UTF-8 character has 4 bytes at most).
    MAX_PENDING_TOKENS = 4
    #: Tokens without text (special ones) the window keeps before starting again after them.
    MAX_SILENT_TOKENS = 16

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""  # complete characters decoded so far (cut at a stop string)
        self.sent = 0  # characters of `text` already returned as deltas
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _read(self, final: bool) -> None:
        """Append the window's new complete text to `text` and move the offsets past it."""
        n = len(self.ids)
        if self.read_offset >= n:
            return
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text, end = self._decode(self.ids[self.prefix_offset :]), n
        if not final and new_text.endswith("\ufffd"):
            # an incomplete character at the end: take the text up to the last complete one, if any
            new_text, end = prefix_text, self.read_offset
            for cut in range(n - 1, max(self.read_offset, n - self.MAX_PENDING_TOKENS) - 1, -1):
                text = self._decode(self.ids[self.prefix_offset : cut])
                if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
                    new_text, end = text, cut
                    break
        if len(new_text) > len(prefix_text):
            self.text += new_text[len(prefix_text) :]
            # the next window starts where this text was complete: a clean boundary for every decoder
            self.prefix_offset, self.read_offset = self.read_offset, end
        elif new_text == prefix_text and end == n:
            self.read_offset = n  # ids without text (special tokens): read, kept as context up to a bound
            if self.read_offset - self.prefix_offset > self.MAX_SILENT_TOKENS:
                self.prefix_offset = self.read_offset

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Add generated ids; return the text that is now certain (`final`: the output ended, flush all)."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        self._read(final)
        tail = self.text[self.sent :]  # a stop string never starts in emitted text: it was held back
        hits = [k for s in self.stop if (k := tail.find(s)) >= 0]
        if hits:
            self.text = self.text[: self.sent + min(hits)]
            self.stopped = final = True
        end = len(self.text) if final else self.sent + self._held_from(tail)
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    def _held_from(self, tail: str) -> int:
        """Where the part of `tail` that could begin a stop string starts (`len(tail)`: none)."""
        longest = max((len(s) for s in self.stop), default=1) - 1
        for i in range(max(0, len(tail) - longest), len(tail)):
            if any(s.startswith(tail[i:]) for s in self.stop):
                return i
        return len(tail)


# ---------------------------------------------------------------------------- the app
def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class BearerAuth:
    """ASGI middleware: a request to any path but `OPEN_PATHS` without `Authorization: Bearer <key>` gets
    401, an unknown path included (plain ASGI, so streams pass through untouched)."""

    def __init__(self, asgi, key: ApiKey):
        self.asgi, self.key = asgi, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not self.key.matches(token.strip()):
                refusal = ApiError(
                    401,
                    "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await _error_response(refusal)(scope, receive, send)
        await self.asgi(scope, receive, send)


async def _api_error(request, exc: ApiError):
    return _error_response(exc)


async def _http_error(request, exc: StarletteHTTPException):  # an unknown path (404), a wrong method (405)
    route = f"{request.method} {request.url.path}"
    message = {404: f"Invalid URL ({route})", 405: f"Method not allowed ({route})"}.get(exc.status_code)
    return _error_response(ApiError(exc.status_code, message or str(exc.detail), headers=exc.headers))


async def _validation_error(request, exc):
    return _error_response(ApiError(400, f"invalid request: {exc.errors()}"))


async def _any_error(request, exc):  # never a bare 500 page
    return _error_response(ApiError(500, f"{type(exc).__name__}: {exc}", type_="internal_error"))


def _parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _pick_model(body: dict, served: dict) -> str:
    m = body.get("model")
    if not isinstance(m, str):
        raise ApiError(400, f"model: expected a string (one of {', '.join(served)}), got {m!r}", "model")
    if m not in served:
        raise ApiError(
            404,
            f"model: the model {m!r} does not exist (served: {', '.join(served)})",
            "model",
            code="model_not_found",
        )
    return m


def _prompt_ids(body: dict, tokenizer) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if tokenizer is None:
            raise ApiError(400, "prompt: this server has no tokenizer; send token ids", "prompt")
        ids = tokenizer(p, add_special_tokens=False)["input_ids"]
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        ids = p
    else:
        raise ApiError(400, f"prompt: expected a string or a list of token ids, got {p!r}"[:300], "prompt")
    if not ids:
        raise ApiError(400, "prompt: the prompt is empty", "prompt")
    vocab = getattr(tokenizer, "vocab_size", None) if tokenizer is not None else None
    if vocab is not None and any(t < 0 or t >= len(tokenizer) for t in ids):
        raise ApiError(400, f"prompt: token ids must be in [0, {len(tokenizer)})", "prompt")
    return list(ids)


def _chat_ids(body: dict, tokenizer) -> list[int]:
    msgs = body.get("messages")
    if (
        not isinstance(msgs, list)
        or not msgs
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        )
    ):
        raise ApiError(400, "messages: expected a non-empty list of {role, content} strings", "messages")
    for i, m in enumerate(msgs):
        if m["role"] not in CHAT_ROLES:
            raise ApiError(
                400,
                f"messages.[{i}].role: expected one of {', '.join(CHAT_ROLES)}, got {m['role']!r}"[:300],
                f"messages.[{i}].role",
            )
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "messages: this model's tokenizer has no chat template", "messages")
    out = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in msgs], add_generation_prompt=True, tokenize=True
    )
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def _warmup_of(request: Request) -> bool:
    phase = request.headers.get(PHASE_HEADER, "measured").strip().lower()
    if phase not in ("measured", "warmup"):
        raise ApiError(400, f"{PHASE_HEADER}: expected warmup or measured, got {phase!r}", PHASE_HEADER)
    return phase == "warmup"


def _generation_request(rid: str, ids: list[int], max_tokens: int, opts: dict, warmup: bool) -> GenerationRequest:
    try:
        return GenerationRequest(
            rid,
            ids,
            max_tokens,
            ignore_eos=opts["ignore_eos"],
            temperature=opts["temperature"],
            top_p=opts["top_p"],
            seed=opts["seed"],
            min_new_tokens=opts["min_tokens"],
            warmup=warmup,
            logprobs=opts["logprobs"],
            prompt_logprobs=opts["prompt_logprobs"],
            session_id=opts["user"],
        )
    except ValueError as e:  # a range the request itself checks: the field is the message's first word
        raise ApiError(400, str(e), str(e).split(":")[0]) from None


# ---------------------------------------------------------------------------- the server
class OpenAIServer:
    """The OpenAI-compatible service over `backends` (model id -> backend) with `tokenizer` (a transformers
    tokenizer with a chat template for `/v1/chat/completions`): its configuration, its per-model counts of
    requests in flight and its tokenizer thread, one method per route (`health`, `models`, `completions`,
    `chat_completions`) and `app()`, the FastAPI app routing to them.

    Args:
        context_tokens: the model's context (prompt + max_tokens must fit; None: unchecked here, the
            backend's `check` still refuses). A chat without `max_tokens` generates up to it.
        max_pending_requests: per model, requests in flight beyond which new ones get 429.
        owner: `owned_by` of every model in `/v1/models`.
        api_key: when given, every request but `OPEN_PATHS` (`/health`) needs `Authorization: Bearer <key>`
            (else 401, code `invalid_api_key`), and the `/docs` and `/redoc` pages are off.
        max_body_bytes: larger request bodies get 413 before they are parsed.

    Bodies are parsed and prompts tokenized on one worker thread (as vLLM's tokenizer executor), so a
    long prompt never stalls the event loop that streams other requests' tokens.
    """

    def __init__(
        self,
        backends: dict[str, Backend],
        tokenizer,
        *,
        context_tokens: int | None = None,
        max_pending_requests: int = 256,
        owner: str = "scissorhands-bench",
        api_key: "ApiKey | str | None" = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        self.backends, self.tokenizer = backends, tokenizer
        self.context_tokens, self.max_pending_requests = context_tokens, max_pending_requests
        self.owner, self.max_body_bytes = owner, max_body_bytes
        self.key = ApiKey(api_key) if isinstance(api_key, str) else api_key
        self.pending = {m: 0 for m in backends}  # requests in flight per model
        self.created = int(time.time())
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openai-api-parse")
        self.vocab = TokenBytes(tokenizer)  # each token's own bytes and name in log-probabilities

    def app(self) -> FastAPI:
        """The FastAPI app: the routes, OpenAI's error JSON for every error, the bearer check with a key."""
        # with a key, only /health is open: the schema needs the key and the docs pages are off (their
        # browser pages fetch the schema without a bearer token, so they could not work)
        app = FastAPI(
            title="scissorhands-bench OpenAI-compatible API",
            docs_url=None if self.key is not None else "/docs",
            redoc_url=None if self.key is not None else "/redoc",
        )
        if self.key is not None:
            app.add_middleware(BearerAuth, key=self.key)
        app.add_exception_handler(ApiError, _api_error)
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_exception_handler(Exception, _any_error)
        app.get("/health")(self.health)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        return app

    # ------------------------------------------------------------------------ routes
    async def health(self):
        return {"status": "ok", "models": list(self.backends)}

    async def models(self):
        return {
            "object": "list",
            "data": [
                {
                    "id": m,
                    "object": "model",
                    "created": self.created,
                    "owned_by": self.owner,
                    "max_model_len": self.context_tokens,  # vLLM's name for the context
                    "metadata": b.metadata,
                }
                for m, b in self.backends.items()
            ],
        }

    async def completions(self, request: Request):
        return await self.handle(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self.handle(request, chat=True)

    # ------------------------------------------------------------------------ one request
    async def handle(self, request: Request, chat: bool):
        """One completion or chat request: read and parse it, check its length, open the backend's stream, and
        answer it whole (JSON) or as Server-Sent Events."""
        raw = await self.read_body(request)
        warmup = _warmup_of(request)
        model, opts, ids = await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, self.parse, raw, chat)
        backend = self.backends[model]
        await self.check_logprobs(backend, opts, len(ids), chat)
        meta = getattr(backend, "metadata", None) or {}
        max_tokens = await self.checked_max_tokens(backend, opts["max_tokens"], len(ids), chat)
        if self.pending[model] >= self.max_pending_requests:
            raise _retry_later(
                429,
                f"model {model!r} has {self.pending[model]} requests in flight (the bound); retry later",
                "rate_limit_error",
                "queue_full",
            )
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        req = _generation_request(rid, ids, max_tokens, opts, warmup)
        seen: dict = {}  # the result event, for its log-probabilities
        events, first = await self.open_events(backend, model, req, seen)
        detok = IncrementalDetokenizer(self.tokenizer, opts["stop"]) if self.tokenizer is not None else None
        obj = "chat.completion" if chat else "text_completion"
        if not opts["stream"]:
            try:
                reply = await _until_disconnected(
                    request,
                    _collect(
                        first, events, detok, rid, obj, model, self.created, chat, len(ids), reports_cached_tokens(meta)
                    ),
                )
                if opts["logprobs"] is not None or opts["echo"]:  # on the worker thread: a long echoed prompt
                    await asyncio.get_running_loop().run_in_executor(  # is detokenized token by token
                        self.tokenize_pool,
                        _add_logprobs,
                        reply,
                        seen.get("result"),
                        ids,
                        opts,
                        self.tokenizer,
                        self.vocab,
                        chat,
                    )
                return JSONResponse(reply)
            finally:
                await events.aclose()
        return StreamingResponse(
            _sse(
                first,
                events,
                detok,
                rid,
                obj + (".chunk" if chat else ""),
                model,
                chat,
                len(ids),
                opts["include_usage"],
                reports_cached_tokens(meta),
            ),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    def too_large(self, size: str) -> ApiError:
        return ApiError(
            413,
            f"the request body is {size} bytes, more than this server's limit of {self.max_body_bytes} bytes",
            code="request_too_large",
        )

    async def read_body(self, request: Request) -> bytes:
        """The raw body, refused (413) as soon as it is known to exceed `max_body_bytes`."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self.too_large(declared)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self.too_large(f"over {size}")
            chunks.append(chunk)
        return b"".join(chunks)

    def parse(self, raw: bytes, chat: bool) -> tuple:
        """Body -> (model, options, prompt ids): the JSON, the fields, the chat template and tokenization
        (on the worker thread; raises ApiError naming the field)."""
        body = _parse_json(raw)
        model = _pick_model(body, self.backends)
        opts = _parse_common(body, chat)
        wants_logprobs = opts["logprobs"] is not None or opts["echo"]
        if wants_logprobs and opts["stream"]:
            raise ApiError(400, "stream: logprobs and echo are answered whole only (stream: false)", "stream")
        if wants_logprobs and opts["stop"]:
            raise ApiError(400, "stop: logprobs and echo are not served together with stop strings", "stop")
        return model, opts, _chat_ids(body, self.tokenizer) if chat else _prompt_ids(body, self.tokenizer)

    async def check_logprobs(self, backend, opts: dict, prompt_tokens: int, chat: bool) -> None:
        """A request asking log-probabilities (``logprobs``, ``top_logprobs``, ``echo``) of a backend that gives
        none is refused: 400 naming the field it used (the backend's `check` with ``logprobs=True`` answers a
        `Refusal` of kind ``unsupported``); a backend's other refusals are `checked_max_tokens`' to name."""
        if opts["logprobs"] is None and not opts["echo"]:
            return
        why = await backend.check(prompt_tokens, 1, logprobs=True)
        if getattr(why, "kind", None) != "unsupported":
            return
        param = "logprobs" if opts["logprobs"] is not None or chat else "echo"
        raise ApiError(400, f"{param}: {why}; accepted: {param} absent (or false) on this model", param)

    async def checked_max_tokens(self, backend, max_tokens: int | None, prompt_tokens: int, chat: bool) -> int:
        """The request's `max_tokens` (its default when not given), refused (400 naming `max_tokens`) when the
        prompt and it exceed the context (`context_length_exceeded`) or the backend can never serve it (its
        `check`: the refusal's kind picks the code, a plain reason is `kv_memory_limit`)."""
        if max_tokens is None:
            max_tokens = (
                await self.default_max_tokens(backend, prompt_tokens) if chat else DEFAULT_COMPLETION_MAX_TOKENS
            )
        if self.context_tokens is not None and prompt_tokens + max_tokens > self.context_tokens:
            raise ApiError(
                400,
                f"max_tokens: the prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                f"the model's context of {self.context_tokens} tokens",
                "max_tokens",
                code="context_length_exceeded",
            )
        why = await backend.check(prompt_tokens, max(1, max_tokens))
        if why is not None:
            raise ApiError(
                400,
                f"max_tokens: {why}",
                "max_tokens",
                code="context_length_exceeded" if getattr(why, "kind", None) == "context" else "kv_memory_limit",
            )
        return max_tokens

    async def default_max_tokens(self, backend, prompt_tokens: int) -> int:
        """A chat without `max_tokens` runs to EOS or the end of the context (OpenAI's and vLLM's rule),
        capped at what the KV memory limit holds for it alone: the backend's `max_new_tokens_for` in one call, or
        the longest its `check` accepts (a backend without it)."""
        context = self.context_tokens
        hi = context - prompt_tokens if context is not None else UNKNOWN_CONTEXT_MAX_TOKENS
        if hi >= 1 and hasattr(backend, "max_new_tokens_for"):
            return max(1, await backend.max_new_tokens_for(prompt_tokens, hi))
        if hi < 1 or await backend.check(prompt_tokens, hi) is None:
            return max(1, hi)
        lo = 0  # the longest known to fit (0: none yet); hi does not fit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if await backend.check(prompt_tokens, mid) is None else (lo, mid)
        return max(1, lo)  # 0: not even one token fits; the check below names why

    async def open_events(self, backend, model: str, req: GenerationRequest, seen: dict) -> tuple:
        """The request's events (counted in flight until they end or close) and the first of them; an error before
        the first token is raised as JSON (`_backend_error`, `_result_error`)."""
        # `pending` is released in the wrapper's `finally`: when the events are exhausted, closed (a stop
        # string, the end of a stream), or garbage-collected (a client gone before its body started)
        events = _Stoppable(
            _counted(
                _keeping_result(backend.stream(req), seen),
                lambda: self.pending.__setitem__(model, self.pending[model] - 1),
            ),
            getattr(backend, "finish", None),
            req.request_id,
        )
        self.pending[model] += 1
        try:
            first = await events.__anext__()  # an error before the first token is answered as JSON
        except BaseException as e:  # noqa: BLE001 - every failure before the first token is answered as JSON
            raise _backend_error(e) from None
        if "result" in first and first["result"].get("error_kind"):
            await events.aclose()
            raise _result_error(first["result"])
        return events, first


def build_app(
    backends: dict[str, Backend],
    tokenizer,
    *,
    context_tokens: int | None = None,
    max_pending_requests: int = 256,
    owner: str = "scissorhands-bench",
    api_key: "ApiKey | str | None" = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI app of an `OpenAIServer` over `backends` (model id -> backend) with `tokenizer`; the
    arguments as `OpenAIServer`'s."""
    server = OpenAIServer(
        backends,
        tokenizer,
        context_tokens=context_tokens,
        max_pending_requests=max_pending_requests,
        owner=owner,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
    )
    return server.app()


#: The one error kind / code of a request whose replica process died under it (killed, crashed, OOM-killed,
#: lost with its node): the API's error `code` (a 503 before the first token, the last SSE event after
#: it), the HTTP client's and the load generator's `error_kind` (`workloads.load.http_client`, `workloads.load.driver`).
REPLICA_DIED = "replica_died"
#: Exception classes (by name: this module does not import Ray) that mean the replica died or cannot be
#: reached: Ray's actor errors and Serve's unavailable-replica/deployment errors.
REPLICA_DEATH_ERRORS = frozenset(
    {
        "RayActorError",
        "ActorDiedError",
        "ActorUnavailableError",
        "ReplicaUnavailableError",
        "DeploymentUnavailableError",
    }
)


def replica_death(exc: BaseException | None) -> BaseException | None:
    """The exception in `exc`'s chain (itself, `cause` of a Ray task error, `__cause__`, `__context__`)
    that says its replica died (`REPLICA_DEATH_ERRORS`), or None."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        if {c.__name__ for c in type(e).__mro__} & REPLICA_DEATH_ERRORS:
            return e
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return None


def _retry_later(status: int, message: str, type_: str, code: str) -> ApiError:
    """A transient error (a full queue, a dead replica, device memory), answered with `Retry-After`."""
    return ApiError(status, message, type_=type_, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def _backend_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    names = {c.__name__ for c in type(e).__mro__}
    if "BackPressureError" in names:
        return _retry_later(503, f"the model's queue is full; retry later ({e})", "server_overloaded", "queue_full")
    died = replica_death(e)
    if died is not None:
        return _retry_later(
            503,
            f"the model's replica is unavailable ({type(died).__name__}); retry later",
            "server_error",
            REPLICA_DIED,
        )
    if isinstance(e, StopAsyncIteration):
        return ApiError(500, "the backend ended the stream without a result", type_="server_error")
    return ApiError(500, f"{type(e).__name__}: {e}"[:1000], type_="server_error")


def _result_error(result: dict) -> ApiError:
    kind = result.get("error_kind")
    if kind == "rejected":
        return ApiError(400, f"max_tokens: {result.get('error')}", "max_tokens", code="kv_memory_limit")
    if kind == "oom":
        return _retry_later(503, f"the replica ran out of device memory: {result.get('error')}", "server_error", "oom")
    return ApiError(500, f"{kind}: {result.get('error')}", type_="server_error", code=kind)


def _finish_reason(result: dict | None, stopped: bool) -> str | None:
    if stopped:
        return "stop"
    if result is None:
        return None
    return {"eos": "stop", "length": "length"}.get(result.get("finish_reason"), result.get("finish_reason"))


def _replica_times(result: dict) -> dict:
    times = result.get("token_times_s") or []
    recv = result.get("received_time_s")
    return {
        "replica_id": result.get("replica_id"),
        "received_time_s": recv,
        "first_token_time_s": times[0] if times else None,
        "replica_ttft_s": (times[0] - recv) if times and recv is not None else None,
    }


#: Seconds before asking again for the client's disconnect when the server answered something else.
DISCONNECT_POLL_S = 0.25


async def _disconnect(request) -> None:
    """Return once the client of `request` (its body already read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _until_disconnected(request, work):
    """`work`'s result, unless the client disconnects first (a timeout, a cancelled call): then `work` is
    cancelled, so the request's events close and the backend aborts it, and a 499 is raised (never sent)."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - nobody reads the answer
        pass
    raise ApiError(499, "the client closed the connection", type_="client_closed")


async def _collect(first, events, detok, rid, obj, model, created, chat, prompt_tokens, cached=False) -> dict:
    ids: list[int] = []
    result = None
    stopped = False
    ev = first
    while True:
        if "result" in ev:
            result = ev["result"]
            break
        ids.append(ev["token_id"])
        if detok is not None:
            detok.add([ev["token_id"]])
            if detok.stopped:
                stopped = True
                await events.stop()  # the request ended as the client asked: completed, not aborted
                break
        try:
            ev = await events.__anext__()
        except StopAsyncIteration:
            break
    if result is not None and result.get("error_kind"):
        raise _result_error(result)
    if detok is not None and not stopped:
        detok.add([], final=True)  # an incomplete character at the very end is text too
        stopped = detok.stopped  # that last text may complete a stop string
    text = detok.text if detok is not None else ""
    choice = {"index": 0, "finish_reason": _finish_reason(result, stopped), "token_ids": ids}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice.update(text=text, logprobs=None)
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(prompt_tokens, len(ids), result, cached),
        "scissorhands": _replica_times(result) if result else None,
    }


class _Stoppable:
    """A request's events, and the one way to end them because the client has what it asked (a stop string):
    `stop()` asks the backend to finish the request as completed (`finish`, when it has one), then closes the
    events; `aclose()` alone (a disconnect, an error) aborts it."""

    def __init__(self, events, finish, request_id: str):
        self.events, self.finish, self.request_id = events, finish, request_id

    def __aiter__(self):
        return self

    def __anext__(self):
        return self.events.__anext__()

    async def aclose(self) -> None:
        await self.events.aclose()

    async def stop(self) -> None:
        if self.finish is not None:
            try:
                await self.finish(self.request_id)
            except Exception:  # noqa: BLE001 - the close below still ends it (counted aborted)
                pass
        await self.aclose()


async def _keeping_result(events: AsyncIterator[dict], seen: dict):
    """`events`, keeping the result event's fields in ``seen["result"]`` (closing `events` when closed)."""
    it = events.__aiter__()
    try:
        async for ev in it:
            if "result" in ev:
                seen["result"] = ev["result"]
            yield ev
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


def text_offsets(tokenizer, vocab: TokenBytes, token_ids: list[int], start: int = 0) -> tuple[list[int], str]:
    """Each token's character offset in the text of `token_ids` (plus `start`), and that text.

    The text is built as a reply's is (`IncrementalDetokenizer`: special tokens skipped, no clean-up of
    spaces). Where the tokens' own bytes (`TokenBytes.offsets`) decode to that same text (byte-level and
    plain vocabularies), a token's offset is the index of the character holding its first byte, so
    ``text[offset[i]:offset[i + 1]]`` are the characters token i completes. Otherwise (a decoder that rewrites
    text, as SentencePiece's first-space strip) it is the length of the text the detokenizer had complete
    before the token. Either way the slices between offsets rebuild the text, in order.
    """
    if tokenizer is None:
        return [start] * len(token_ids), ""
    detok = IncrementalDetokenizer(tokenizer, [])
    offsets = []
    for t in token_ids:
        offsets.append(start + len(detok.text))
        detok.add([t])
    detok.add([], final=True)
    by_bytes, text = vocab.offsets(token_ids)
    if text == detok.text:
        offsets = [start + o for o in by_bytes]
    return offsets, detok.text


def _add_logprobs(
    reply: dict, result: dict | None, prompt_ids: list[int], opts: dict, tokenizer, vocab: TokenBytes, chat: bool
) -> None:
    """Put the `logprobs` object (and echo's prompt text) into a whole reply's choice."""
    choice = reply["choices"][0]
    out_ids = choice["token_ids"]
    result = result or {}
    lps = (result.get("output_logprobs") or [])[: len(out_ids)]
    tops = (result.get("output_top_logprobs") or [])[: len(out_ids)]
    if chat:
        choice["logprobs"] = chat_logprobs(vocab, out_ids, lps, tops, opts["logprobs"])
        return
    ids, all_lps, all_tops, offsets, prompt_text = out_ids, lps, tops, [], ""
    if opts["echo"]:
        # the prompt's text as the output's is built, so that every offset indexes the returned text
        offsets, prompt_text = text_offsets(tokenizer, vocab, prompt_ids)
        choice["text"] = prompt_text + choice["text"]
        ids = prompt_ids + out_ids
        all_lps = (result.get("prompt_logprobs") or [None] * len(prompt_ids)) + lps
        all_tops = (result.get("prompt_top_logprobs") or [None] * len(prompt_ids)) + tops
    if opts["logprobs"] is not None:
        out_offsets, _ = text_offsets(tokenizer, vocab, out_ids, len(prompt_text))
        choice["logprobs"] = completion_logprobs(vocab, ids, all_lps, all_tops, offsets + out_offsets)


def _sse_event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _counted(events: AsyncIterator[dict], release):
    """`events`, calling `release()` once when they end, fail, or are closed (then closing `events`:
    the backend aborts an unfinished request)."""
    it = events.__aiter__()
    try:
        async for ev in it:
            yield ev
    finally:
        release()
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


async def _sse(first, events, detok, rid, obj, model, chat, prompt_tokens, include_usage, cached=False):
    """The SSE body: one chunk per token as it arrives; an error event if the backend fails."""
    created = int(time.time())
    n = 0
    result = None
    stopped = False

    def chunk(delta_text: str | None, token_ids: list[int], finish: str | None, extra: dict | None = None) -> bytes:
        c = {"index": 0, "finish_reason": finish, "token_ids": token_ids}
        if chat:
            c["delta"] = {} if delta_text is None else {"content": delta_text}
        else:
            c.update(text=delta_text or "", logprobs=None)
        body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [c]}
        if extra:
            body.update(extra)
        return _sse_event(body)

    try:
        if chat:
            yield _sse_event(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                }
            )
        ev = first
        while True:
            if "result" in ev:
                result = ev["result"]
                break
            n += 1
            text = detok.add([ev["token_id"]]) if detok is not None else ""
            if detok is not None and detok.stopped:
                stopped = True
                # the token that completed the stop string is counted in usage: its id goes out even without text
                await events.stop()  # the request ended as the client asked: completed, not aborted
                yield chunk(text, [ev["token_id"]], None)
                break
            yield chunk(text, [ev["token_id"]], None)
            ev = await events.__anext__()
        if result is not None and result.get("error_kind"):
            raise _result_error(result)
        tail = detok.add([], final=True) if detok is not None and not stopped else ""
        stopped = stopped or (detok is not None and detok.stopped)  # the flushed text may complete a stop
        yield chunk(
            tail if not chat or tail else None,
            [],
            _finish_reason(result, stopped),
            {"scissorhands": _replica_times(result)} if result else None,
        )
        if include_usage:
            yield _sse_event(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": _usage(prompt_tokens, n, result, cached),
                }
            )
    except Exception as e:  # noqa: BLE001 - a stream ends with an error event, never a hang
        err = e if isinstance(e, ApiError) else _backend_error(e)
        yield _sse_event(err.body())
    finally:
        try:
            await events.aclose()  # a disconnect or a stop string aborts the request
        except Exception:  # noqa: BLE001
            pass
    yield b"data: [DONE]\n\n"
