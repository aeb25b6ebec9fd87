"""Each token's own bytes and its name in the OpenAI API's log-probabilities, through the tokenizer's vocabulary.

A token's text is not `tokenizer.decode([id])`: a byte-level BPE token can hold part of a UTF-8 character
(SmolLM2's ``"ĠðŁĺ"`` is the bytes ``b" \\xf0\\x9f\\x98"``, the start of an emoji), which decodes alone to
U+FFFD, so alternatives that decode alike would merge and their bytes would be U+FFFD's; a SentencePiece
decoder strips a word's leading space from a lone token (``"▁true"`` and ``"true"`` both decode to
``"true"``). Here a token's bytes come from its vocabulary entry (`convert_ids_to_tokens`) through the
tokenizer's own decoder rules (`tokenizers` decoder configuration):

* ``ByteLevel`` (GPT-2, SmolLM2, Llama 3, Qwen): each character of the entry is one byte, through GPT-2's
  byte-to-unicode table (`transformers.convert_slow_tokenizer.bytes_to_unicode`, the table the ByteLevel
  pre-tokenizer encodes with);
* ``ByteFallback`` (SentencePiece conversions, Llama 2, Mistral): an entry ``<0xNN>`` is the byte NN;
  ``Replace``/``Metaspace`` turn ``▁`` into a space;
* anything else (``Fuse``, WordPiece, ...): the entry's UTF-8;
* added tokens (``<|im_end|>``): their content's UTF-8.

Names follow OpenAI: a token whose bytes are valid UTF-8 is that text; otherwise ``bytes:`` and each byte as
``\\xNN`` (``"bytes:\\xf0\\x9f\\x98"``, OpenAI's spelling in completions' `tokens` and `top_logprobs`); an id
the tokenizer does not know (a model's padded vocabulary beyond the tokenizer's) is ``token_id:N`` (vLLM's
spelling of a token by id) and has no bytes (None). Distinct ids with distinct bytes always get distinct
names.
"""

from __future__ import annotations

import codecs
import json
import re

from transformers.convert_slow_tokenizer import bytes_to_unicode

__all__ = ["TokenBytes", "bytes_name"]

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_name(data: bytes) -> str:
    """OpenAI's name of a token of `data`: its text if valid UTF-8, else ``bytes:\\xNN...``."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _decoder_types(tokenizer) -> set[str]:
    """The types of the tokenizer's `tokenizers` decoder, a Sequence's members included (empty: none known)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    todo, types = [json.loads(decoder.__getstate__())], set()
    while todo:
        d = todo.pop()
        types.add(d.get("type"))
        if d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "▁":
            types.add("Metaspace")
        todo += d.get("decoders") or []
    return types


class TokenBytes:
    """The bytes and OpenAI name of each id of one tokenizer (built once per tokenizer; cached per id).

    Args:
        tokenizer: a transformers tokenizer (fast: its `backend_tokenizer.decoder` says how an entry maps
            to bytes), or None (every id is then ``token_id:N`` without bytes).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        types = _decoder_types(tokenizer) if tokenizer is not None else set()
        self.byte_level = "ByteLevel" in types
        self.byte_fallback = "ByteFallback" in types
        self.metaspace = "Metaspace" in types
        self.byte_decoder = {c: b for b, c in bytes_to_unicode().items()} if self.byte_level else {}
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {i: t.content for i, t in added.items()}
        self._cache: dict[int, bytes | None] = {}

    def of(self, token_id: int) -> bytes | None:
        """The token's own bytes (None: the tokenizer has no entry for `token_id`)."""
        if token_id in self._cache:
            return self._cache[token_id]
        data = self._bytes(token_id)
        if len(self._cache) < 1 << 20:
            self._cache[token_id] = data
        return data

    def _bytes(self, token_id: int) -> bytes | None:
        if self.tokenizer is None:
            return None
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return None
        if self.byte_level and all(c in self.byte_decoder for c in piece):
            return bytes(self.byte_decoder[c] for c in piece)
        if self.byte_fallback and (m := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if self.metaspace:
            piece = piece.replace("▁", " ")
        return piece.encode("utf-8")

    def name(self, token_id: int) -> str:
        """OpenAI's name of the token: its text, ``bytes:\\xNN...`` when not valid UTF-8 alone, or ``token_id:N``."""
        data = self.of(token_id)
        return f"token_id:{token_id}" if data is None else bytes_name(data)

    def offsets(self, token_ids: list[int]) -> tuple[list[int], str]:
        """Each token's character offset in the UTF-8 text of the tokens' bytes, and that text.

        A token's offset is the number of characters complete before its first byte, i.e. the index of the
        character holding that byte: a token that ends inside a character (``b" \\xf0\\x9f\\x98"``) adds the
        characters it completes (``" "``), and the character is the next tokens' (which start inside it).
        Special tokens add nothing (as a reply's text skips them); invalid bytes are U+FFFD each maximal
        run, as `bytes.decode(errors="replace")` and the tokenizers' byte-level decoder write them.
        """
        special = set(getattr(self.tokenizer, "all_special_ids", None) or [])
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        offsets, parts, n = [], [], 0
        for t in token_ids:
            offsets.append(n)
            data = None if t in special else self.of(t)
            if data:
                parts.append(decoder.decode(data))
                n += len(parts[-1])
        parts.append(decoder.decode(b"", final=True))
        return offsets, "".join(parts)
