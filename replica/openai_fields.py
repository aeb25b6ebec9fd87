"""Which OpenAI request fields each endpoint implements, and the `logprobs` parts of its replies.

Every field of a request body outside its endpoint's list (`COMPLETIONS_FIELDS`, `CHAT_FIELDS`) is
refused by name (`unsupported_field`): a client that sends `best_of` or `logit_bias` learns that
the server does not do it, instead of getting a reply that silently ignores it. A field sent as
null means its default and is never refused. `docs/serving-http.md` ("OpenAI fields supported and
refused") lists both sides.

Log-probabilities (natural logs of the model's distribution, float32, before temperature and
top-p) come from the engine (`GenerationResult.output_logprobs`, `prompt_logprobs`); this module
only lays them out as OpenAI does: completions' ``{tokens, token_logprobs, top_logprobs,
text_offset}`` and chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``, each token named and
its bytes taken through the tokenizer's vocabulary (`replica.token_bytes`).
"""

from __future__ import annotations

from replica.token_bytes import TokenBytes

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
        "user",  # the end-user id, taken as the session (GenerationRequest.session_id); it changes no output
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


def _top_dict(vocab: TokenBytes, alts: list, token_id: int, logprob: float) -> dict:
    """One position's ``{name: logprob}`` alternatives, best first, then the chosen token if not among them.
    Each id gets its own key (`TokenBytes.name`; an id whose name is taken by a better-ranked one is written
    ``token_id:N``), so no alternative is lost and no key holds a lower-ranked value."""
    out: dict[str, float] = {}
    seen: set[int] = set()
    for i, v in [*alts, (token_id, logprob)]:
        if i in seen:
            continue
        seen.add(i)
        key = vocab.name(i)
        out[key if key not in out else f"token_id:{i}"] = v
    return out


def completion_logprobs(
    vocab: TokenBytes, token_ids: list[int], logprobs: list, top: list, text_offset: list[int]
) -> dict:
    """Completions' `logprobs` object of `token_ids` (the echoed prompt first, if any, then the output).

    Args:
        vocab: the tokenizer's token bytes and names (`replica.token_bytes.TokenBytes`).
        logprobs: each token's log-probability (None for an echoed prompt's first token).
        top: each token's ``[[token_id, logprob], ...]`` alternatives, best first (None for that first token).
        text_offset: each token's character offset in the returned text (`replica.openai_api.text_offsets`).

    Returns:
        ``{"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
        "text_offset": [int]}``: tokens named as OpenAI does (their text, or ``bytes:\\xNN`` when not valid
        UTF-8 alone: `replica.token_bytes`); a position's alternatives keep one key per id, best first, and
        include the token itself (as vLLM's), so a client can tell whether it was the most likely one.
    """
    tops = [None if alts is None else _top_dict(vocab, alts, t, lp) for t, lp, alts in zip(token_ids, logprobs, top)]
    return {
        "tokens": [vocab.name(t) for t in token_ids],
        "token_logprobs": list(logprobs),
        "top_logprobs": tops,
        "text_offset": list(text_offset),
    }


def chat_logprobs(vocab: TokenBytes, token_ids: list[int], logprobs: list, top: list, top_k: int) -> dict:
    """Chat's `logprobs` object: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``, with the
    `top_k` most likely alternatives of each generated token (best first). `bytes` are each token's own
    (`replica.token_bytes`: joined over the content they rebuild its UTF-8), None for an id the tokenizer
    does not know; `token` is its text, or ``bytes:\\xNN...`` when its bytes are not valid UTF-8 alone."""

    def entry(token_id: int, lp: float) -> dict:
        data = vocab.of(token_id)
        return {"token": vocab.name(token_id), "logprob": lp, "bytes": None if data is None else list(data)}

    content = []
    for tok, lp, alts in zip(token_ids, logprobs, top):
        content.append({**entry(tok, lp), "top_logprobs": [entry(i, v) for i, v in (alts or [])[:top_k]]})
    return {"content": content}
