"""Test doubles for the HTTP service: a character tokenizer that fits the tiny model's 128-id
vocabulary (with a chat template), and a uvicorn server for an ASGI app on a free loopback port."""

from __future__ import annotations

import json
import threading
import time

from tests.waiting import free_port

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer():
    """A transformers fast tokenizer: one id per printable ASCII character (ids 0..94), then
    `<|im_start|>` 95, `<|im_end|>` 96 (EOS), `<unk>` 97; 98 ids in all (< the tiny model's 128)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(c): c - 32 for c in range(32, 127)}
    vocab.update({"<|im_start|>": 95, "<|im_end|>": 96, "<unk>": 97, "\n": 98})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def sse_events(resp):
    """The `data:` payloads of a streamed `requests` reply as they arrive (JSON decoded, `[DONE]` kept as a string)."""
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            d = line[6:].decode()
            yield d if d == "[DONE]" else json.loads(d)


class ServerThread:
    """`uvicorn` serving `app` on 127.0.0.1:<free port> in a thread; `with ServerThread(app) as url:`."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("uvicorn did not start in 20 s")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
