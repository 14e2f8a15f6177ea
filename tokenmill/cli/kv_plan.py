"""`tokenmill kv-plan`: the KV memory math for a model, without loading its weights: bytes per
token per KV-cache group, and how many tokens and full-length requests a pool holds, with window
trimming and without."""

from __future__ import annotations

import argparse

from tokenmill.config import DTYPES, KV_CACHE_DTYPES, EngineArgs, parse_dtype, parse_memory

DEFAULTS = EngineArgs.__dataclass_fields__


def add_parser(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "kv-plan", help="KV bytes per token and requests a pool holds, trimmed and not"
    )
    plan.add_argument("--model", default=DEFAULTS["model"].default)
    plan.add_argument("--dtype", default="float32", choices=list(DTYPES))
    plan.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    plan.add_argument("--block-size", type=int, default=DEFAULTS["block_size"].default)
    plan.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    plan.add_argument("--kv-cache-memory", default="1GiB", help="bytes or e.g. 2GiB")
    plan.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.kv.plan import kv_plan, layer_bytes_per_token
    from tokenmill.loader.model_loader import load_model_config

    config = load_model_config(ns.model)
    dtype = parse_dtype(ns.dtype)
    memory = parse_memory(ns.kv_cache_memory)
    for name in ("block_size", "max_model_len"):
        value = getattr(ns, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    max_len = min(
        ns.max_model_len or config.max_position_embeddings, config.max_position_embeddings
    )
    per_layer = layer_bytes_per_token(config, dtype, ns.kv_cache_dtype)
    print(f"model: {ns.model} ({config.num_hidden_layers} layers, KV {ns.kv_cache_dtype})")
    print(f"kv_cache_memory: {memory} bytes, block_size {ns.block_size}, max_model_len {max_len}")
    print(f"K and V per token and layer: {per_layer} bytes")
    for trimming in (False, True):
        plan = kv_plan(config, dtype, ns.kv_cache_dtype, ns.block_size, memory, max_len, trimming)
        print(f"\nwindow trimming {'on' if trimming else 'off'}:")
        for g, group in enumerate(plan.groups.groups):
            window = "full" if group.window is None else f"window {group.window}"
            print(
                f"  group {g}: {len(group.layers)} layers, {window}: "
                f"{per_layer * len(group.layers)} bytes per token held"
            )
        requests = plan.full_length_requests
        print(f"  pool: {plan.num_blocks} blocks of {plan.block_bytes} bytes")
        print(f"  bytes per token of a {max_len}-token request: {plan.bytes_per_token}")
        print(f"  full-length requests held: {requests} ({requests * max_len} tokens)")
    return 0
