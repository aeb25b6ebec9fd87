"""The peer side of ``bench.kvpress_parity``: kvpress's presses score the same windows, in kvpress's own virtualenv.

    <kvpress venv>/bin/python bench/kvpress_peer.py job.json out.json

Runs as a plain script under the interpreter of the virtualenv ``make kvpress-parity`` builds (kvpress 0.5.5 pins
transformers < 5.3, older than ours), so it imports torch, transformers and kvpress only, never a module of this
repository. The protocol is kvpress's own pipeline (``KVPressTextGenerationPipeline._forward``): the prefix is run
through the base model under the press (``with press(model): model.model(prefix, past_key_values=DynamicCache())``,
compressed once, at the end of each layer's prefill), then the tail is fed in one call at its true positions
(``position_ids`` from the uncompressed prefix length, as ``generate_answer`` passes them).

Job (JSON): ``model_dir`` (a local transformers folder), ``dtype`` (``float32`` or ``bfloat16``), ``threads``,
``windows`` (lists of token ids), ``prefix_tokens``, ``runs`` (``[{"label", "press", "params"}]``, ``press`` a
kvpress class name or ``null`` for no press). Output (JSON): ``versions`` and, per run label and window,
``nll_sum`` (nats) over the tail's ``tokens_scored`` predictions and ``kept_tokens`` (layer 0 after the prefix).
"""

from __future__ import annotations

import json
import sys


def score_window(model, press, ids, prefix_tokens: int, torch, DynamicCache) -> dict:
    """Tail NLL of one window ``ids`` (token ids) after its first ``prefix_tokens`` were compressed by ``press``."""
    x = torch.tensor([ids])  # (1, n)
    prefix, tail, targets = x[:, :prefix_tokens], x[:, prefix_tokens:-1], x[:, prefix_tokens + 1 :]
    cache = DynamicCache()
    with torch.inference_mode():
        if press is None:
            model.model(input_ids=prefix, past_key_values=cache)
        else:
            with press(model):
                model.model(input_ids=prefix, past_key_values=cache)
        kept = cache.get_seq_length()
        pos = torch.arange(prefix_tokens, prefix_tokens + tail.shape[1])[None]  # true positions
        logits = model(input_ids=tail, past_key_values=cache, position_ids=pos).logits.float()
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    return {"nll_sum": float(-logp.double().sum()), "tokens_scored": int(targets.shape[1]), "kept_tokens": int(kept)}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: kvpress_peer.py job.json out.json", file=sys.stderr)
        return 2
    from importlib.metadata import version

    import kvpress  # third-party, present only in kvpress's own virtualenv
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    job = json.loads(open(argv[0], encoding="utf-8").read())
    torch.set_num_threads(int(job["threads"]))
    model = AutoModelForCausalLM.from_pretrained(
        job["model_dir"], dtype=getattr(torch, job["dtype"]), attn_implementation="sdpa"
    ).eval()
    out = {
        "versions": {
            "kvpress": version("kvpress"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "runs": {},
    }
    for run in job["runs"]:
        press = None if run["press"] is None else getattr(kvpress, run["press"])(**run["params"])
        out["runs"][run["label"]] = [
            score_window(model, press, w, job["prefix_tokens"], torch, DynamicCache) for w in job["windows"]
        ]
        print(f"kvpress_peer: {run['label']} done", file=sys.stderr, flush=True)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
