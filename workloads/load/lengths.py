"""Token lengths and the requests built from them: `LengthDist` (a validated length distribution),
`build_requests` (n requests with drawn lengths) and `requests_of_lengths` (given lengths, e.g. a
trace's rows).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import model_validator

from replica.common.rules import FrozenConfig, PositiveFloat, PositiveInt
from replica.common.types import GenerationRequest
from workloads.load.prompts import make_prompts

LENGTH_DISTS = ("fixed", "uniform", "normal", "lognormal")
#: The parameters each distribution needs.
_NEEDS = {
    "fixed": ("value",),
    "uniform": ("min", "max"),
    "normal": ("mean", "std"),
    "lognormal": ("mean", "sigma"),
    "trace": ("min", "max"),
}


class LengthDist(FrozenConfig):
    """A token-length distribution: `fixed` (value), `uniform` (min..max inclusive), `normal`
    (mean, std) or `lognormal` (mean = the median, sigma), clipped to [min, max]. Lengths are tokens.

    YAML: an integer (fixed) or a mapping `{dist: uniform, min: 64, max: 512}` (`parse`). `dist: trace`
    (made by `workloads.load.patterns.TraceLoad.length_range`, never parsed) records a trace's range;
    it cannot be sampled. A bad field raises ValueError naming it and what it accepts; `model_dump()`
    gives the mapping back. `LengthDist("uniform", min=1, max=9)`: the distribution may come first.
    """

    dist: Literal[LENGTH_DISTS + ("trace",)] = "fixed"
    value: PositiveInt | None = None
    min: PositiveInt | None = None
    max: PositiveInt | None = None
    mean: PositiveFloat | None = None
    std: PositiveFloat | None = None
    sigma: PositiveFloat | None = None

    def __init__(self, dist: str | None = None, /, **fields: Any) -> None:
        super().__init__(**fields if dist is None else {"dist": dist, **fields})

    @model_validator(mode="after")
    def _parameters(self) -> "LengthDist":
        for k in _NEEDS[self.dist]:
            if getattr(self, k) is None:
                raise ValueError(f"{k}: required for dist {self.dist!r}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"max: {self.max} is below min ({self.min})")
        return self

    @classmethod
    def parse(cls, name: str, spec: Any) -> "LengthDist":
        """`spec` (an integer or a mapping) as a distribution; ValueError naming `name`, the key and the
        accepted values."""
        if isinstance(spec, int) and not isinstance(spec, bool):
            spec = {"dist": "fixed", "value": spec}
        if not isinstance(spec, dict):
            raise ValueError(
                f"{name}: expected an integer or a mapping with 'dist' ({', '.join(LENGTH_DISTS)}), got {spec!r}"
            )
        if spec.get("dist", "fixed") not in LENGTH_DISTS:  # `trace` included: made from a trace only
            raise ValueError(f"{name}.dist: expected one of {', '.join(LENGTH_DISTS)}, got {spec['dist']!r}")
        try:
            return cls(**spec)
        except ValueError as e:  # one line per field, each named: `<name>.<field>: ...`
            raise ValueError("; ".join(f"{name}.{part}" for part in str(e).split("; "))) from None

    @property
    def upper(self) -> int:
        """The largest length it can draw (tokens; for memory budgets). ValueError when unbounded."""
        if self.dist == "fixed":
            return self.value
        if self.max is not None:
            return self.max
        raise ValueError(f"max: a {self.dist} length distribution needs 'max' to bound memory")

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        """`n` lengths drawn with `rng`, rounded and clipped to [min, max]."""
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


def build_requests(
    n: int, prompt_tokens: LengthDist, output_tokens: LengthDist, *, seed: int, **prompts
) -> list[GenerationRequest]:
    """`n` requests with lengths drawn (seeded) from the two distributions; `prompts`: `requests_of_lengths`'s
    `tokenizer`, `vocab_size`, `prefix`."""
    rng = np.random.default_rng(seed)
    p_len = prompt_tokens.sample(n, rng)
    o_len = output_tokens.sample(n, rng)
    return requests_of_lengths(p_len, o_len, seed=seed, rng=rng, **prompts)


def requests_of_lengths(
    prompt_tokens: list[int],
    output_tokens: list[int],
    *,
    seed: int,
    tokenizer=None,
    vocab_size: int | None = None,
    prefix: str = "req",
    rng: np.random.Generator | None = None,
) -> list[GenerationRequest]:
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


class RequestStream:
    """Requests drawn on demand, never cycled: ``stream(i)`` is request `i` (warm-up included) with
    lengths drawn from the two distributions and id ``<prefix>-<i>``. For a duration-bound point, which
    sends as many requests as the server answers in time.

    Requests are drawn `chunk` at a time (chunk `k` seeded by `seed` and `k`), so the same `seed` gives
    the same requests in the same order whatever the load pattern asks for first. Drawing costs about
    0.15 ms a request (real-text prompts of 128-512 tokens, 2-core EPYC), on the caller's thread: draw
    what a run will surely send first with `prepare`; later chunks are small so none stalls a run long. A prompt equal to an
    earlier one of the stream (warm-up included) is drawn again (at most `redraws` times, seeded too),
    so a server's prefix cache never sees a prompt twice; when the prompt space is too small for that
    (a few tokens over a small vocabulary), the repeat stays and is counted: `repeated` holds the
    indices of such requests, `repeats_sent` how many of them were asked for.
    """

    def __init__(
        self,
        prompt_tokens: LengthDist,
        output_tokens: LengthDist,
        *,
        seed: int,
        tokenizer=None,
        vocab_size: int | None = None,
        prefix: str = "req",
        chunk: int = 64,
        redraws: int = 16,
    ):
        if tokenizer is None and vocab_size is None:
            raise ValueError("vocab_size: needed for random prompts when there is no tokenizer")
        self.prompt_tokens, self.output_tokens = prompt_tokens, output_tokens
        self.seed, self.tokenizer, self.vocab_size, self.prefix = seed, tokenizer, vocab_size, prefix
        self.chunk, self.redraws = int(chunk), int(redraws)
        self._built: list[GenerationRequest] = []
        self._seen: set[tuple[int, ...]] = set()
        self.repeated: set[int] = set()
        self.repeats_sent = 0

    def _draw(self, n: int, seed: int, prompt_tokens: LengthDist, output_tokens: LengthDist) -> list[GenerationRequest]:
        return build_requests(
            n, prompt_tokens, output_tokens, seed=seed, tokenizer=self.tokenizer, vocab_size=self.vocab_size
        )

    def _extend(self) -> None:
        """Draw the next chunk, each prompt unseen so far where the redraws find one."""
        k = len(self._built) // self.chunk
        base = (self.seed * 1_000_003 + k) % (1 << 63)  # chunk k's own draw, the same for every caller
        for j, req in enumerate(self._draw(self.chunk, base, self.prompt_tokens, self.output_tokens)):
            i = len(self._built)
            prompt = tuple(req.prompt_ids)
            for attempt in range(1, self.redraws + 1):
                if prompt not in self._seen:
                    break
                length = LengthDist("fixed", value=len(prompt))
                again = self._draw(1, (base * 7919 + j * 131 + attempt) % (1 << 63), length, length)[0]
                prompt = tuple(again.prompt_ids)
            if prompt in self._seen:
                self.repeated.add(i)
            self._seen.add(prompt)
            self._built.append(GenerationRequest(f"{self.prefix}-{i}", list(prompt), req.max_new_tokens))

    def prepare(self, n: int) -> "RequestStream":
        """Draw the first `n` requests now (before a run, so its first sends wait for no drawing)."""
        while len(self._built) < n:
            self._extend()
        return self

    def __call__(self, i: int) -> GenerationRequest:
        while len(self._built) <= i:
            self._extend()
        if i in self.repeated:
            self.repeats_sent += 1
        return self._built[i]
