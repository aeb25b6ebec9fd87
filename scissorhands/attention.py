"""The ``scissorhands`` attention implementation for transformers.

Registered under one name with both ``AttentionInterface`` and ``AttentionMaskInterface`` (the
official seams; no model code is patched). With a ``BudgetedCache`` it hands the layer the
attention probabilities its policy needs and masks with the layer's own per-slot times (kept
slots are not contiguous positions, so the 2-D causal mask transformers builds would be wrong).
With any other cache, or none, it computes ordinary causal attention, so a model switched to
``attn_implementation="scissorhands"`` gives the same outputs as with ``"sdpa"``.

:func:`explicit_attention` is the one place that computes attention probabilities explicitly: the
budgeted layer hands them to its policy, and the persistence analysis (``workloads/quality/persistence.py``)
folds them into its pivotal sets.
"""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTN_IMPLEMENTATION = "scissorhands"

# The budgeted layer whose update() ran last in this thread; the attention function of the same layer
# (called right after update in the same forward) picks it up. Thread-local so replicas and tests
# running models in several threads never mix caches.
_ACTIVE = threading.local()


def set_active_layer(layer) -> None:
    """Mark ``layer`` (a ``BudgetedLayer`` whose ``update`` just ran) as waiting for its attention."""
    _ACTIVE.layer = layer


def active_layer(layer_idx: int):
    """The budgeted layer waiting for the attention of ``layer_idx`` in this thread, if any."""
    layer = getattr(_ACTIVE, "layer", None)
    if layer is not None and layer.layer_idx == layer_idx and layer._pending_q is not None:
        return layer
    return None


def explicit_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None, visible: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Attention with explicit probabilities, per query head, grouped by the KV head they share.

    Args:
        query: ``(batch_size, num_heads, q_len, head_dim)``; query head ``h = kv * group + j`` reads
            KV head ``kv`` (grouped-query attention, ``group = num_heads // num_kv_heads``).
        keys: ``(batch_size, num_kv_heads, num_slots, head_dim)``.
        values: ``(batch_size, num_kv_heads, num_slots, head_dim_v)``, or None to skip the output.
        visible: ``(batch_size, num_kv_heads, q_len, num_slots)`` bool (True = the query attends the
            slot), or None when every slot is visible to every query.
        scaling: softmax scale.
    Returns:
        ``(output, probs)``: output ``(batch_size, num_heads, q_len, head_dim_v)`` in the values' dtype
        (None without values); probs ``(batch_size, num_kv_heads, group, q_len, num_slots)`` float32, the
        softmax of each query head in float32, zero for every slot of a query that sees nothing.
    """
    b, hq, qc, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    group = hq // hkv
    fp32 = query.dtype == torch.float32  # else scale the float32 scores, not the query
    qg = (query * scaling if fp32 else query).reshape(b, hkv, group * qc, d)  # (b, hkv, g * q_c, d)
    if fp32:
        scores = torch.matmul(qg, keys.transpose(-1, -2))  # (b, hkv, g * q_c, S)
    else:
        # keys @ q^T, transposed after: oneDNN's bfloat16 batched matmul copies a transposed view of keys whose
        # slots are a slice of the layer's buffer (timings: docs/performance.md, "Measurements behind the library and cluster code")
        scores = torch.matmul(keys, qg.transpose(-1, -2)).transpose(-1, -2)  # (b, hkv, g * q_c, S)
    scores = scores.to(torch.float32, memory_format=torch.contiguous_format).view(b, hkv, group, qc, n)
    if not fp32:
        scores.mul_(scaling)
    if visible is not None:
        scores.masked_fill_(~visible[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (b, hkv, g, q_c, S)
    if visible is not None:  # padded queries see nothing
        seen = visible[:, :, None].any(-1, keepdim=True)  # (b, hkv, 1, q_c, 1)
        if not bool(seen.all()):
            probs = torch.where(seen, probs, probs.new_zeros(()))
    if values is None:
        return None, probs
    out = torch.matmul(probs.view(b, hkv, group * qc, n).to(values.dtype), values)  # (b, hkv, g * q_c, d_v)
    return out.view(b, hq, qc, -1), probs


def padding_mask_function(batch_size: int, q_length: int, kv_length: int, attention_mask=None, **kwargs):
    """Mask interface: pass the 2-D padding mask ``(batch_size, tokens_seen)`` through (bool) or None."""
    return attention_mask


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A reusable buffer of ``shape`` for this thread, valid until the next ``scratch(name, ...)`` call here.

    Per-chunk tensors of a prefill (scores of up to ``CHUNK_SCORE_ELEMENTS``) are reused instead of
    allocated afresh: a fresh multi-megabyte tensor comes from new pages of memory and the page faults of
    its first write can cost more than the arithmetic (timings: docs/performance.md, "Measurements behind the library and cluster code")."""
    buffers = getattr(_ACTIVE, "scratch", None)
    if buffers is None:
        buffers = _ACTIVE.scratch = {}
    numel = 1
    for n in shape:
        numel *= n
    key = (name, torch.is_inference_mode_enabled())  # an inference tensor cannot be written outside
    buf = buffers.get(key)
    if buf is None or buf.dtype != dtype or buf.device != torch.device(device) or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def causal_attention_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of a fresh prompt (query ``i`` sees keys ``0..i``) with sdpa's fused kernel, and the
    log-sum-exp of each query's scores where the kernel returns it.

    Args:
        query: ``(batch_size, num_heads, q_len, head_dim)``; keys, values: ``(batch_size, num_kv_heads,
            q_len, head_dim)`` (grouped-query attention when ``num_kv_heads < num_heads``).
    Returns:
        ``(output, lse)``: output ``(batch_size, num_heads, q_len, head_dim_v)``, the same numbers as
        ``scaled_dot_product_attention(..., is_causal=True)`` (the full cache's prefill); lse
        ``(batch_size, num_heads, q_len)`` float32, ``log(sum_j exp(scaling * q.k_j))`` over the visible
        keys, from the CPU flash kernel, or None on other devices.
    """
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, keys, values, 0.0, True, scale=scaling
        )
        return out, lse
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, is_causal=True, scale=scaling, enable_gqa=query.shape[1] != keys.shape[1]
    )
    return out, None


def causal_probs(query: torch.Tensor, keys: torch.Tensor, scaling: float, lse: torch.Tensor | None) -> torch.Tensor:
    """Attention probabilities of the last ``q_c`` queries of a causal prompt prefix, without the output.

    Args:
        query: ``(batch_size, num_heads, q_c, head_dim)``, the queries at token indices ``e - q_c .. e - 1``.
        keys: ``(batch_size, num_kv_heads, e, head_dim)``, keys ``0 .. e - 1`` (the ones they can see).
        lse: ``(batch_size, num_heads, q_c)`` float32 log-sum-exp of each query's scaled scores (from
            :func:`causal_attention_lse`): the probabilities are then ``exp(score - lse)``, one pass, no
            softmax; None computes the softmax.
    Returns:
        ``(batch_size, num_kv_heads, group, q_c, e)`` float32 probabilities of each query head (query head
        ``kv * group + j``), zero for the keys after the query; the same numbers as
        :func:`explicit_attention` up to float rounding. With ``lse`` a :func:`scratch` buffer: valid until
        the next call in this thread.
    """
    e, qc = keys.shape[2], query.shape[2]
    if lse is None:
        visible = torch.ones(qc, e, dtype=torch.bool, device=query.device)
        visible[:, e - qc :] = ~torch.ones(qc, qc, dtype=torch.bool, device=query.device).triu(1)
        return explicit_attention(query, keys, None, visible.expand(query.shape[0], keys.shape[1], qc, e), scaling)[1]
    return next(causal_probs_chunks(query, keys, scaling, lse, qc, qc))[2]


def causal_probs_chunks(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, lse: torch.Tensor, chunk_queries: int, matmul_queries: int
):
    """The probabilities of :func:`causal_probs` for the last ``q_o`` queries of a causal prompt, chunk by chunk.

    Args:
        query: ``(batch_size, num_heads, q_o, head_dim)``, the queries at token indices ``L - q_o .. L - 1``.
        keys: ``(batch_size, num_kv_heads, L, head_dim)``; lse: ``(batch_size, num_heads, q_o)`` float32.
        chunk_queries: queries per yielded chunk (its float32 passes stay in the CPU's cache).
        matmul_queries: queries per score matmul in a low-precision dtype (a multiple of ``chunk_queries``):
            a bfloat16 ``bmm`` of a few queries runs several times slower per score than one of a hundred
            (timings: docs/performance.md, "Measurements behind the library and cluster code"), so its scores are computed for ``matmul_queries`` at
            once, in the model dtype, and each chunk reads its slice. float32 runs ``baddbmm`` per chunk (no such effect).
    Yields:
        ``(s, e, probs)``: queries ``[s, e)`` counted from the first of ``query`` and their probabilities
        ``(batch_size, num_kv_heads, group, e - s, L - q_o + e)`` float32 over the keys they can see, in a
        :func:`scratch` buffer valid until the next chunk.
    """
    b, hq, q_o, d = query.shape
    if q_o == 0:
        return
    hkv, length = keys.shape[1], keys.shape[2]
    group = hq // hkv
    first = length - q_o  # token index of query 0
    low_precision = query.dtype != torch.float32
    if low_precision:
        keys = keys.contiguous()  # (b, hkv, L, d): a strided batch slows bmm
        matmul_queries = max(chunk_queries, matmul_queries // chunk_queries * chunk_queries)
    neg_lse = lse.neg().view(b, hkv, group, q_o, 1)
    for ms in range(0, q_o, matmul_queries if low_precision else q_o):
        me = min(q_o, ms + matmul_queries) if low_precision else q_o
        if low_precision:  # (b * hkv, g * q_m, first + me) scores, model dtype
            mq = me - ms
            qg = query[:, :, ms:me].reshape(b * hkv, group * mq, d)
            kt = keys[:, :, : first + me].reshape(b * hkv, first + me, d).transpose(-1, -2)
            low = torch.bmm(
                qg, kt, out=scratch("scores", (b * hkv, group * mq, first + me), query.dtype, query.device)
            ).view(b, hkv, group, mq, first + me)
        for s in range(ms, me, chunk_queries):
            e = min(me, s + chunk_queries)
            qc, n = e - s, first + e
            probs = scratch("probs", (b, hkv, group, qc, n), torch.float32, query.device)
            if low_precision:  # -lse + scaling * q.k, float32
                torch.add(neg_lse[:, :, :, s:e], low[:, :, :, s - ms : e - ms, :n], alpha=scaling, out=probs)
            else:  # -lse + scaling * q.k in one call
                torch.baddbmm(
                    neg_lse[:, :, :, s:e].reshape(b * hkv, group * qc, 1),
                    query[:, :, s:e].reshape(b * hkv, group * qc, d),
                    keys[:, :, :n].reshape(b * hkv, n, d).transpose(-1, -2),
                    alpha=scaling,
                    out=probs.view(b * hkv, group * qc, n),
                )
            future = torch.ones(qc, qc, dtype=torch.bool, device=query.device).triu(1)  # (q_c, q_c) key after query
            probs[..., n - qc :].masked_fill_(future, float("-inf"))
            yield s, e, probs.exp_()


def scissorhands_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention forward.

    Args:
        query: ``(batch_size, num_heads, q_len, head_dim)``.
        key, value: ``(batch_size, num_kv_heads, kv_len, head_dim)`` as returned by the cache.
        attention_mask: ``(batch_size, tokens_seen)`` bool padding mask from ``padding_mask_function``,
            or a 4-D additive/bool mask a caller prepared, or None.
    Returns:
        ``((batch_size, q_len, num_heads, head_dim), None)``.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer = active_layer(getattr(module, "layer_idx", -1))
    if layer is not None:
        return layer.attend(query, attention_mask, scaling), None
    return _causal_attention(query, key, value, attention_mask, scaling, dropout if module.training else 0.0), None


def _causal_attention(query, key, value, attention_mask, scaling, dropout):
    """Plain causal attention for caches we do not own; the last ``q_len`` keys are the queries'."""
    b, hq, q_len, _ = query.shape
    kv_len = key.shape[-2]
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask[..., :kv_len]
    else:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
        mask = torch.arange(kv_len, device=query.device)[None, :] <= q_pos[:, None]  # (q, kv)
        mask = mask[None, None]
        if attention_mask is not None:
            pad = attention_mask[:, -kv_len:].to(torch.bool)  # (b, kv)
            mask = mask & pad[:, None, None, :]
            # a padded query sees nothing; let it see itself so the softmax stays finite
            mask = mask | _self_mask(q_len, kv_len, query.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=key.shape[1] != hq
    )
    return out.transpose(1, 2).contiguous()


def _self_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """``(1, 1, q_len, kv_len)`` bool, True where a query meets its own key."""
    m = torch.zeros(q_len, kv_len, dtype=torch.bool, device=device)
    m[torch.arange(q_len), torch.arange(kv_len - q_len, kv_len)] = True
    return m[None, None]


def register() -> None:
    """Register the attention function and its mask function under ``ATTN_IMPLEMENTATION``."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, scissorhands_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask_function)


register()
