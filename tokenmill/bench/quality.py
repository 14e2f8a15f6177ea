"""How far a model's next-token distributions are from a reference's on held-out windows:
perplexity, KL(P_ref || P_model) position by position, and how often both put the same token
first. With a quantized KV cache, the model reads its keys and values back from such a cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.kv.layout import allocate_kv_caches, slot_mapping
from tokenmill.model.attention import MAX_DECODE_QUERY, AttentionMetadata

WINDOWS_PER_PASS = 4  # held-out windows per forward pass, bounding the logits' memory


@dataclass(frozen=True)
class Quality:
    perplexity: float
    kl_divergence: float  # nats, mean over positions
    top1_agreement: float  # fraction of positions where both models rank the same token first


def window_log_probs(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities `[num_windows, seq_len, vocab]`, each window its own
    sequence from position 0, in one forward pass without a KV cache."""
    count, seq_len = windows.shape
    meta = AttentionMetadata.build([seq_len] * count, [seq_len] * count, None, 16, None)
    with torch.inference_mode():
        hidden = model(windows.reshape(-1), torch.arange(seq_len).repeat(count), None, meta)
        logits = model.compute_logits(hidden).float()
    return F.log_softmax(logits, dim=-1).view(count, seq_len, -1)


def cached_window_log_probs(
    model: nn.Module, windows: torch.Tensor, kv_cache_dtype: str, block_size: int = 16
) -> torch.Tensor:
    """`window_log_probs` with K and V kept in a paged cache of `kv_cache_dtype`: the first
    token alone, then chunks of MAX_DECODE_QUERY tokens, which attend token by token through
    the decode path as generation does, so every score reads keys and values back from it."""
    count, seq_len = windows.shape
    blocks = -(-seq_len // block_size)
    caches = allocate_kv_caches(
        model.config, count * blocks, block_size, torch.float32, kv_cache_dtype
    )
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(count)]
    logits: list[torch.Tensor] = []
    start = 0
    with torch.inference_mode():
        while start < seq_len:
            stop = min(start + MAX_DECODE_QUERY, seq_len) if start else 1
            slots = [s for table in tables for s in slot_mapping(table, block_size, start, stop)]
            meta = AttentionMetadata.build(
                [stop - start] * count, [stop] * count, tables, block_size, slots
            )
            ids, positions = windows[:, start:stop], torch.arange(start, stop).repeat(count)
            hidden = model(ids.reshape(-1), positions, caches, meta)
            logits.append(model.compute_logits(hidden).float().view(count, stop - start, -1))
            start = stop
    return F.log_softmax(torch.cat(logits, dim=1), dim=-1)


def measure_quality(
    reference: nn.Module, model: nn.Module, windows: torch.Tensor, kv_cache_dtype: str = "auto"
) -> Quality:
    """`model`'s perplexity on `windows` [n, seq_len], and its next-token distributions
    against `reference`'s at every position; with a quantized `kv_cache_dtype`, `model` reads
    its keys and values from such a cache."""
    nll = kl = agree = 0.0
    for part in windows.split(WINDOWS_PER_PASS):
        ref = window_log_probs(reference, part)
        if kv_cache_dtype != "auto":
            ours = cached_window_log_probs(model, part, kv_cache_dtype)
        else:
            ours = ref if model is reference else window_log_probs(model, part)
        nll -= ours[:, :-1].gather(-1, part[:, 1:, None]).sum().item()
        kl += (ref.exp() * (ref - ours)).sum().item()
        agree += (ref.argmax(-1) == ours.argmax(-1)).sum().item()
    positions = windows.numel()
    return Quality(
        perplexity=float(torch.tensor(nll / (positions - windows.shape[0])).exp()),
        kl_divergence=kl / positions,
        top1_agreement=agree / positions,
    )
