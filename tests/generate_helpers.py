"""Greedy generation through a KV cache, returning the step logits: the run every cache test compares."""

import torch

#: Greedy decoding that returns a dict with each step's logits (`out.logits`) besides the sequences.
GREEDY_WITH_LOGITS = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)


def greedy_generate(model, ids, cache, new_tokens, mask=None, **kw):
    """`model.generate` of `new_tokens` tokens through `cache` (mask: all ones unless given)."""
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens, **GREEDY_WITH_LOGITS, **kw)
