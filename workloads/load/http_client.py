"""A load-generator client for any OpenAI-compatible server (ours: `cluster.serve_app`; vLLM, SGLang, TGI).

    client = OpenAIHTTPClient("http://127.0.0.1:8000/v1", "smollm2-135m-instruct:scissorhands-x5")
    result = await client.generate(GenerationRequest("r0", prompt_ids, 64))      # or: async for ev in client.events(...)
    await client.close()

It implements the load generator's client interface (`workloads.load.driver`): `generate(request)`
returns an `HTTPGenerationResult` (a `GenerationResult`) with one time per output token; `events(request)`
yields `StreamChunk`s (`token_ids`, `time_s`) and ends with the `HTTPGenerationResult` (errors, counts).

What it sends: `POST {base}/completions` with the prompt as token ids (no re-tokenization on the
server), `max_tokens`, `stream: true`, `stream_options.include_usage`, `ignore_eos`, and the
request's sampling (`temperature`, `top_p`, `seed`, `min_tokens` when set). `endpoint="chat"`
sends the prompt as text through `/chat/completions` instead (needs `tokenizer` to decode it).
A warm-up request (`GenerationRequest.warmup`, set by the load generator) carries the header
`X-Scissorhands-Phase: warmup` (`PHASE_HEADER`), so our server counts it apart (the replica's
``warmup_*`` stats and ``phase="warmup"`` live metrics) and a point's server-side figures cover
the same requests as the client's; other servers ignore an unknown header.

Timestamps: each SSE event is stamped with `clock()` (default `time.time`, the load generator's
clock) when its line arrives; every token of an event gets that time (a chunk of k tokens adds
k - 1 gaps of 0 to the ITL). Client-side TTFT is then first event arrival - send; the server's
own figure, when it sends one (our server: `scissorhands.replica_ttft_s` in the last chunk), is
kept apart as `replica_ttft_s`.

Counting output tokens (`output_tokens_source` on the result):
* `token_ids`: the chunks carry the generated ids (our server, vLLM with `return_token_ids`);
* `usage`: no ids; one token per non-empty chunk, and the server's final `usage.completion_tokens`
  is the count: missing tokens get the last chunk's time, their ids are `-1` (placeholders);
* `chunks`: neither ids nor usage: one token per non-empty chunk (an estimate, said in the record).

The bearer token: `api_key`, else `$SCISSORHANDS_API_KEY` (the key `make serve` reads), else `$OPENAI_API_KEY`
(what vLLM's benchmark and OpenAI's SDK read) (`env_api_key`); it is never written to a record or a log.
Text is never re-tokenized.

Errors become named kinds, never exceptions: `bad_request` (400), `unknown_model` (404),
`overloaded` (429/503), `http_<status>`, `replica_died` (the server's error `code` says the replica
died: our server's last SSE event when it died mid-stream, or its 503 when it died before the first
token), `oom` (our server's 503 whose `code` is `oom`: the replica ran out of device memory, a point's `oom`
status, not a refusal for load), `server_error` (any other error event inside a stream), `stream_truncated` (the stream ended
without `[DONE]`), `connection_error`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from replica.common.types import GenerationRequest, GenerationResult
from replica.continuous import StreamChunk
from replica.openai_api import API_KEY_ENV, PHASE_HEADER, REPLICA_DIED

__all__ = ["OpenAIHTTPClient", "HTTPGenerationResult"]


@dataclass
class HTTPGenerationResult(GenerationResult):
    """A `GenerationResult` measured over HTTP: `token_times_s` are client-side arrival times."""

    replica_ttft_s: float | None = None  # the server's own TTFT (its clock), when it reports one
    output_tokens_source: str | None = None  # token_ids | usage | chunks
    http_status: int | None = None
    usage_completion_tokens: int | None = None  # the server's own count, when it sends `usage`
    # the server's usage.prompt_tokens_details.cached_tokens (OpenAI's); None when it does not say, never a made-up 0
    cached_prompt_tokens: int | None = None


def _status_kind(status: int, code: str | None = None) -> str:
    """The error kind of an HTTP error reply: `replica_died` whatever the status when the server's error
    `code` says so (ours answers 503 when the replica died before the first token), else by status."""
    if code == REPLICA_DIED:
        return REPLICA_DIED
    if code == "oom":  # our server's 503 when the replica ran out of device memory: not a refusal for load
        return "oom"
    return {400: "bad_request", 404: "unknown_model", 429: "overloaded", 503: "overloaded"}.get(
        status, f"http_{status}"
    )


def _reply_error(status: int, text: str) -> tuple[str, str]:
    """(error kind, message) of an HTTP error reply whose body is `text` (OpenAI's error JSON, or anything)."""
    try:
        err = json.loads(text)["error"]
        msg, code = err["message"], err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        msg, code = text[:500], None
    return _status_kind(status, code), f"HTTP {status}: {msg}"


def _event_error(error) -> tuple[str, str]:
    """(error kind, message) of a stream's error event (`data: {"error": ...}`)."""
    err = error if isinstance(error, dict) else {"message": str(error)}
    return REPLICA_DIED if err.get("code") == REPLICA_DIED else "server_error", str(err.get("message"))


def _choice_ids(choice: dict) -> tuple[list[int], bool]:
    """(the token ids of one streamed choice, whether the server sent ids): without ids, a chunk with text is one
    token (id -1)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return [int(i) for i in ids], True
    delta = choice.get("delta") or {}
    text = choice.get("text") if "text" in choice else delta.get("content")
    return ([-1] if text else []), False


def _read_usage_and_times(ev: dict, final: HTTPGenerationResult, usage_tokens: int | None) -> int | None:
    """The completion tokens of the event's `usage` (else `usage_tokens`, the last seen); its cached prompt tokens
    (``usage.prompt_tokens_details.cached_tokens``), the replica's TTFT and id of its `scissorhands` extension kept
    in `final`."""
    if isinstance(ev.get("usage"), dict) and ev["usage"].get("completion_tokens") is not None:
        usage_tokens = int(ev["usage"]["completion_tokens"])
    details = ev["usage"].get("prompt_tokens_details") if isinstance(ev.get("usage"), dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    # JSON `true` is a Python int, and a negative count is no count: both are "not reported", never a made-up figure
    if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
        final.cached_prompt_tokens = cached
    if isinstance(ev.get("scissorhands"), dict):
        final.replica_ttft_s = ev["scissorhands"].get("replica_ttft_s")
        final.replica_id = ev["scissorhands"].get("replica_id") or final.replica_id
    return usage_tokens


#: Where a client finds its bearer token when it is given none, in order: ours (`cluster.serve_app --api-key`'s
#: default), then the one vLLM's benchmark and OpenAI's SDK read.
API_KEY_ENVS = (API_KEY_ENV, "OPENAI_API_KEY")


def env_api_key() -> str | None:
    """The bearer token of the first of `API_KEY_ENVS` set to a non-empty value; None when none is."""
    return next((os.environ[k] for k in API_KEY_ENVS if os.environ.get(k)), None)


class OpenAIHTTPClient:
    """Streams completions from an OpenAI-compatible server (see the module docstring).

    Args:
        base_url: `http://HOST:PORT/v1`.
        model: the served model id.
        endpoint: `completions` (token-id prompts) or `chat` (text through the chat template).
        tokenizer: decodes prompt ids to text for `chat`.
        api_key: sent as a bearer token; None: `env_api_key()` (no token when that is None too).
        clock: seconds (default `time.time`).
        extra_body: more JSON fields for every request (e.g. `{"return_token_ids": true}` for vLLM).
        connect_timeout_s: for opening the connection (the load generator bounds the whole request).
        session_per_request: a new connection per request (as vLLM's benchmark client does), for callers
            that run each point on a new event loop and never call `close`; else one pooled session.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        endpoint: str = "completions",
        tokenizer=None,
        api_key: str | None = None,
        clock: Callable[[], float] = time.time,
        extra_body: dict | None = None,
        connect_timeout_s: float = 30.0,
        max_connections: int = 1024,
        session_per_request: bool = False,
    ):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"target: expected http://HOST:PORT/v1, got {base_url!r}")
        if endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint: expected completions or chat, got {endpoint!r}")
        if endpoint == "chat" and tokenizer is None:
            raise ValueError("tokenizer: the chat endpoint sends text; give the tokenizer that decodes the prompts")
        self.base_url, self.model, self.endpoint = base_url.rstrip("/"), model, endpoint
        self.tokenizer, self.api_key, self.clock = tokenizer, api_key if api_key is not None else env_api_key(), clock
        self.extra_body = dict(extra_body or {})
        self.connect_timeout_s, self.max_connections = connect_timeout_s, max_connections
        self.session_per_request = session_per_request
        self.replica_id = base_url
        self._session = None
        self._loop = None

    async def _get_session(self):
        import asyncio

        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
                connector=aiohttp.TCPConnector(limit=self.max_connections),
            )
            self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    def headers(self, request: GenerationRequest) -> dict:
        """HTTP headers of `request`: the bearer token, and `PHASE_HEADER` for a warm-up request."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if getattr(request, "warmup", False):
            headers[PHASE_HEADER] = "warmup"
        return headers

    def body(self, request: GenerationRequest) -> tuple[str, dict]:
        """(url, JSON body) of `request`."""
        body: dict = {
            "model": self.model,
            "max_tokens": request.max_new_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": bool(request.ignore_eos),
            "temperature": float(getattr(request, "temperature", 0.0)),
        }
        if getattr(request, "top_p", 1.0) != 1.0:
            body["top_p"] = request.top_p
        if getattr(request, "seed", None) is not None:
            body["seed"] = request.seed
        if getattr(request, "min_new_tokens", 0):
            body["min_tokens"] = request.min_new_tokens
        if getattr(request, "session_id", None) is not None:
            body["user"] = request.session_id  # the server's session (docs/serving-http.md)
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": self.tokenizer.decode(request.prompt_ids)}]
            url = f"{self.base_url}/chat/completions"
        else:
            body["prompt"] = list(request.prompt_ids)
            url = f"{self.base_url}/completions"
        body.update(self.extra_body)
        return url, body

    async def events(self, request: GenerationRequest) -> AsyncIterator[StreamChunk | HTTPGenerationResult]:
        """Yield one `StreamChunk` per SSE event that carries tokens (`token_ids`, `time_s` at arrival),
        then the request's `HTTPGenerationResult` without ids (the chunks carried them): its
        `http_status`, the count's source, `replica_ttft_s` and, on failure, an error of a named kind.
        Tokens the server's `usage` counts beyond the chunks' come as one more chunk before it."""
        import aiohttp

        url, body = self.body(request)
        headers = self.headers(request)
        final = HTTPGenerationResult(request.request_id, len(request.prompt_ids), replica_id=self.replica_id)

        def failed(kind: str, error: str) -> HTTPGenerationResult:
            final.error_kind, final.error, final.finish_reason = kind, error[:2000], "error"
            return final

        counted = 0
        usage_tokens = None
        saw_ids = False
        last_t = None
        own = None
        try:
            if self.session_per_request:
                session = own = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
                )
            else:
                session = await self._get_session()
            async with session.post(url, json=body, headers=headers) as resp:
                final.http_status = resp.status
                if resp.status != 200:
                    yield failed(*_reply_error(resp.status, await resp.text()))
                    return
                done = False
                async for raw in resp.content:  # one line at a time, as it arrives
                    t = self.clock()
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    try:
                        ev = json.loads(data)
                    except ValueError:
                        yield failed("bad_event", f"not JSON: {data[:200]!r}")
                        return
                    if "error" in ev:
                        yield failed(*_event_error(ev["error"]))
                        return
                    usage_tokens = _read_usage_and_times(ev, final, usage_tokens)
                    for choice in ev.get("choices") or []:
                        n_ids, with_ids = _choice_ids(choice)
                        saw_ids = saw_ids or with_ids
                        if n_ids:
                            counted += len(n_ids)
                            last_t = t
                            yield StreamChunk(n_ids, t)
                if not done:
                    yield failed("stream_truncated", "the stream ended without [DONE]")
                    return
        except aiohttp.ClientError as e:
            yield failed("connection_error", f"{type(e).__name__}: {e}")
            return
        finally:
            if own is not None:
                await own.close()
        final.output_tokens_source = "token_ids" if saw_ids else "usage" if usage_tokens is not None else "chunks"
        uncounted = usage_tokens - counted if final.output_tokens_source == "usage" else 0
        if uncounted > 0 and last_t is not None:
            yield StreamChunk([-1] * uncounted, last_t)  # several tokens in one chunk
        final.usage_completion_tokens = usage_tokens
        final.finish_time_s = self.clock()
        final.finish_reason = "length" if max(counted, usage_tokens or 0) >= request.max_new_tokens else "stop"
        yield final

    async def generate(self, request: GenerationRequest) -> HTTPGenerationResult:
        """The whole reply as one result (one client-side time per token)."""
        ids: list[int] = []
        times: list[float] = []
        async for ev in self.events(request):
            if isinstance(ev, StreamChunk):
                ids.extend(ev.token_ids)
                times.extend([ev.time_s] * len(ev.token_ids))
                continue
            ev.output_ids, ev.token_times_s = ids, times
            ev.finish_time_s = ev.finish_time_s or self.clock()
            return ev
        raise RuntimeError("the stream ended without a result")  # events() always ends with one
