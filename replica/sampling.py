"""Picking the next token of each running row: argmax, or sampling with temperature and top-p.

The engine calls `pick_tokens` once per forward; a row's draws come from a generator of its own, so
a request's tokens do not depend on its batch neighbours' draws.
"""

from __future__ import annotations

import math

import torch

__all__ = ["pick_tokens"]


def pick_tokens(logits: torch.Tensor, seqs: list, eos_token_id: int | None) -> torch.Tensor:
    """The next token of each row: `logits` (rows, vocab) -> (rows, 1) long.

    Argmax for greedy rows; sampled (temperature, then top-p) with the row's own generator for the
    others; EOS masked while a row that stops at EOS has fewer than `min_new_tokens` tokens.
    """
    reqs = [s.request for s in seqs]
    if all(r.greedy and (r.min_new_tokens == 0 or r.ignore_eos or eos_token_id is None) for r in reqs):
        # argmax's index (the first of tied maxima): torch.max's reduction is the faster one in bfloat16 on a CPU
        return torch.max(logits, dim=-1, keepdim=True).indices  # (rows, 1)
    out = []
    for row, seq in zip(logits.float(), seqs):  # row: (vocab,)
        r = seq.request
        if eos_token_id is not None and not r.ignore_eos and len(seq.result.output_ids) < r.min_new_tokens:
            row = row.clone()
            row[eos_token_id] = -math.inf
        if r.greedy:
            out.append(row.argmax())
            continue
        probs = torch.softmax(row / r.temperature, dim=-1)  # (vocab,)
        if r.top_p < 1:
            p_sorted, order = probs.sort(descending=True)
            outside = p_sorted.cumsum(0) - p_sorted >= r.top_p  # tokens after the nucleus is full
            p_sorted[outside] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, p_sorted)
        if seq.generator is None:
            seq.generator = torch.Generator(device=row.device)
            if r.seed is not None:
                seq.generator.manual_seed(r.seed)
            else:
                seq.generator.seed()
        out.append(torch.multinomial(probs, 1, generator=seq.generator)[0])
    return torch.stack(out).view(-1, 1).to(logits.device)  # (rows, 1)
