"""The reference our engine is measured against: transformers' own `generate` (sdpa attention +
`DynamicCache`), static batches of left-padded prompts, each batch run to its longest output.

Used by `workloads/bench_serving.py` (part 2) and `cluster/gpu_check.py` (engine vs generate), so
both compare the engine with the same baseline. Imports torch and transformers only (never Ray).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from cluster.engine import GenerationRequest
from scissorhands import ATTN_IMPLEMENTATION


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_generate(model, requests: Sequence[GenerationRequest], batch: int, *, device: str | torch.device = "cpu",
                 deadline: float | None = None, on_batch: Callable[[], None] | None = None) -> dict:
    """Greedy `model.generate` over `requests`, `batch` at a time, after a 2-token warm-up.

    Args:
        model: a causal LM on `device`; its attention implementation is set to sdpa for the run and
            back to scissorhands' own afterwards.
        requests: prompts (token ids) and `max_new_tokens` each; EOS is ignored, so every batch runs
            to its longest `max_new_tokens`.
        batch: requests per `generate` call.
        device: where the model lives (CUDA is synchronised around the timed part).
        deadline: `time.time()` after which no further batch starts (`finished` is then False).
        on_batch: called after each batch (a progress bar's update).

    Returns:
        `wall_s` and `cpu_s` (this process) of the timed part; `output_tokens`, the useful tokens (what
        each finished request asked for); `output_tok_per_s`, `output_tok_per_cpu_s`;
        `completed_requests`; `finished`; `outputs` (request id -> generated ids, `max_new_tokens` long).
    """
    device = torch.device(device)
    model.set_attn_implementation("sdpa")
    try:
        warm = torch.tensor([requests[0].prompt_ids[:32]], device=device)
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
        outputs, finished, useful = {}, True, 0
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, len(requests), batch):
            if deadline is not None and time.time() > deadline:
                finished = False
                break
            chunk = requests[i:i + batch]
            width = max(len(r.prompt_ids) for r in chunk)
            # (b, width) left-padded prompts and their mask, as a transformers user batches them
            ids = torch.tensor([[0] * (width - len(r.prompt_ids)) + r.prompt_ids for r in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in chunk],
                                device=device)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, cache=DynamicCache(config=model.config),
                                     max_new_tokens=max(r.max_new_tokens for r in chunk), do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
            for r, row in zip(chunk, out[:, width:].tolist()):
                outputs[r.request_id] = row[:r.max_new_tokens]      # useful tokens: what the request asked for
                useful += r.max_new_tokens
            if on_batch is not None:
                on_batch()
        _sync(device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return {"finished": finished, "wall_s": wall, "cpu_s": cpu, "output_tokens": useful,
            "output_tok_per_s": useful / wall if wall else None,
            "output_tok_per_cpu_s": useful / cpu if cpu else None,
            "completed_requests": len(outputs), "outputs": outputs}
