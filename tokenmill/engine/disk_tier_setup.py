"""Opening the prefix cache's disk tier for an engine: the directory's identity is the model,
its weight format, the KV dtypes and shapes and the KV-cache groups a block file holds, so
blocks written under any other is refused."""

from __future__ import annotations

from pathlib import Path

from tokenmill.config import EngineArgs
from tokenmill.kv.disk_tier import DiskTier
from tokenmill.kv.groups import KVGroups
from tokenmill.loader.model_loader import LoadedModel


def open_disk_tier(
    args: EngineArgs, loaded: LoadedModel, groups: KVGroups, block_bytes: int
) -> DiskTier | None:
    """None without `kv_offload_dir`. A block file holds one pool block: its tokens' KV in one
    group's layers (every layer without window trimming) and a draft model's own KV,
    `block_bytes` in all."""
    if args.kv_offload_dir is None:
        return None
    config = loaded.config
    identity = {
        "model": str(Path(loaded.path).resolve()),
        "architecture": config.architecture,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "quantization": args.quantization,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "draft_model": args.draft_model if args.speculative_method in ("draft", "eagle") else None,
        "block_payload_bytes": block_bytes,
        "kv_groups": [[list(g.layers), g.window] for g in groups.groups],
    }
    return DiskTier(
        args.kv_offload_dir,
        int(args.kv_offload_bytes),
        identity,
        args.block_size,
        block_bytes,
        cache_ttl_s=args.prefix_cache_ttl,
        max_retained_fraction=args.max_retained_kv_fraction,
    )
