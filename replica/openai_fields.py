"""Which OpenAI request fields each endpoint implements, and the `logprobs` parts of its replies.

Every field of a request body outside its endpoint's list (`COMPLETIONS_FIELDS`, `CHAT_FIELDS`) is
refused by name (`unsupported_field`): a client that sends `best_of` or `logit_bias` learns that
the server does not do it, instead of getting a reply that silently ignores it. A field sent as
null means its default and is never refused. `docs/serving-http.md` ("OpenAI fields supported and
refused") lists both sides.

Log-probabilities (natural logs of the model's distribution, float32, before temperature and
top-p) come from the engine (`GenerationResult.output_logprobs`, `prompt_logprobs`); this module
only lays them out as OpenAI does: completions' ``{tokens, token_logprobs, top_logprobs,
text_offset}`` and chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``.
"""

from __future__ import annotations

__all__ = [
    "CHAT_FIELDS",
    "COMPLETIONS_FIELDS",
    "REFUSED_FIELDS",
    "chat_logprobs",
    "completion_logprobs",
    "unsupported_field",
]

_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",  # 1 only
        "stream",
        "stream_options",  # include_usage
        "user",  # an end-user id for the caller's own bookkeeping; it changes no output
        "ignore_eos",  # vLLM's extension
        "min_tokens",  # vLLM's extension
    }
)
#: The fields `POST /v1/completions` implements.
COMPLETIONS_FIELDS = _COMMON | {"prompt", "logprobs", "echo"}
#: The fields `POST /v1/chat/completions` implements.
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
#: OpenAI fields known to be refused (documentation and tests; any other unknown field is refused too).
REFUSED_FIELDS = (
    "best_of",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "suffix",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "parallel_tool_calls",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "service_tier",
    "store",
    "metadata",
    "web_search_options",
)


def unsupported_field(body: dict, chat: bool) -> str | None:
    """The first field of `body` (in its order) that the endpoint does not implement, or None.
    A field whose value is null is never refused (null is the default)."""
    accepted = CHAT_FIELDS if chat else COMPLETIONS_FIELDS
    return next((k for k, v in body.items() if k not in accepted and v is not None), None)


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list, top: list, text_offset_start: int = 0) -> dict:
    """Completions' `logprobs` object of `token_ids` (the echoed prompt first, if any, then the output).

    Args:
        logprobs: each token's log-probability (None for an echoed prompt's first token).
        top: each token's ``[[token_id, logprob], ...]`` alternatives (None for that first token).

    Returns:
        ``{"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
        "text_offset": [int]}``: a token's alternatives include the token itself (as vLLM's), so a
        client can tell whether it was the most likely one; `text_offset` counts characters of the
        tokens' texts from `text_offset_start`.
    """
    tokens = [_token_text(tokenizer, t) for t in token_ids]
    tops: list[dict | None] = []
    for tok, lp, alts in zip(token_ids, logprobs, top):
        if alts is None:
            tops.append(None)
            continue
        d = {_token_text(tokenizer, i): v for i, v in alts}
        d.setdefault(_token_text(tokenizer, tok), lp)
        tops.append(d)
    offsets, at = [], text_offset_start
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list, top: list, top_k: int) -> dict:
    """Chat's `logprobs` object: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``,
    with the `top_k` most likely alternatives of each generated token (best first)."""

    def entry(token_id: int, lp: float) -> dict:
        s = _token_text(tokenizer, token_id)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for tok, lp, alts in zip(token_ids, logprobs, top):
        content.append({**entry(tok, lp), "top_logprobs": [entry(i, v) for i, v in (alts or [])[:top_k]]})
    return {"content": content}
