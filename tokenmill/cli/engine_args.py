"""The engine flags every command that runs a model shares, and the EngineArgs they make."""

from __future__ import annotations

import argparse
from dataclasses import fields

from tokenmill.config import (
    DECODE_LOOPS,
    DRAFT_SAMPLING,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_CACHE_MODES,
    SCHEDULERS,
    SPECULATIVE_METHODS,
    EngineArgs,
)
from tokenmill.quant.registry import quantization_choices


def add_engine_args(parser: argparse.ArgumentParser, several_models: bool = False) -> None:
    """`several_models`: `--model` may be repeated, giving a list (None when not given)."""
    defaults = EngineArgs.__dataclass_fields__
    group = parser.add_argument_group("engine")
    model_help = "a .gguf file, a Hugging Face directory, or a packaged model name"
    if several_models:
        group.add_argument(
            "--model",
            action="append",
            default=None,
            help=f"{model_help}; repeat it to serve several (default: {defaults['model'].default})",
        )
    else:
        group.add_argument("--model", default=defaults["model"].default, help=model_help)
    group.add_argument("--dtype", default="float32", choices=list(DTYPES))
    group.add_argument("--kv-cache", default="paged", choices=KV_CACHE_MODES)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--kv-cache-memory", default="1GiB", help="bytes or e.g. 2GiB")
    group.add_argument(
        "--kv-cache-dtype",
        default=defaults["kv_cache_dtype"].default,
        choices=KV_CACHE_DTYPES,
        help="auto: the model dtype; int8/fp8: 8-bit K/V, a scale per token and head",
    )
    group.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    group.add_argument(
        "--prefix-cache-ttl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="drop cached prefix blocks unused for longer, from every tier (default: never)",
    )
    group.add_argument(
        "--max-retained-kv-fraction",
        type=float,
        default=defaults["max_retained_kv_fraction"].default,
        help="most of the pool requests' cache.ttl retention may hold",
    )
    group.add_argument(
        "--kv-offload-dir",
        default=None,
        metavar="PATH",
        help="a disk tier for the prefix cache: evicted blocks are kept in files here",
    )
    group.add_argument(
        "--kv-offload-bytes",
        default=defaults["kv_offload_bytes"].default,
        help="the disk tier's budget, bytes or e.g. 8GiB (least recently used files go first)",
    )
    group.add_argument(
        "--kv-window-trimming",
        action=argparse.BooleanOptionalAction,
        default=defaults["kv_window_trimming"].default,
        help="sliding-window layers keep only their window's KV blocks (--no-: every block)",
    )
    group.add_argument("--scheduler", default="continuous", choices=SCHEDULERS)
    group.add_argument(
        "--max-wait-ms",
        type=float,
        default=defaults["max_wait_ms"].default,
        help="--scheduler dynamic: close a batch once its oldest request waited this long",
    )
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument(
        "--quantization",
        default=defaults["quantization"].default,
        choices=quantization_choices(),
        help="weight format chosen at load time (docs/quantization.md)",
    )
    group.add_argument(
        "--decode-loop",
        default=defaults["decode_loop"].default,
        choices=DECODE_LOOPS,
        help="native: a decode step's layers in one C++ call; python: layer by layer",
    )
    group.add_argument(
        "--prepack-weights",
        action=argparse.BooleanOptionalAction,
        default=defaults["prepack_weights"].default,
        help="batched products on packed copies of the float weights (more memory)",
    )
    group.add_argument(
        "--reuse-host-memory",
        action=argparse.BooleanOptionalAction,
        default=defaults["reuse_host_memory"].default,
        help="malloc keeps freed tensors' pages for the next step (no page faults refilling them)",
    )
    group.add_argument(
        "--overlap-grammar-masks",
        action=argparse.BooleanOptionalAction,
        default=defaults["overlap_grammar_masks"].default,
        help="fill structured outputs' token masks while the forward pass runs (--no-: after it)",
    )
    _add_speculative_args(parser, defaults)


def _add_speculative_args(parser: argparse.ArgumentParser, defaults: dict) -> None:
    group = parser.add_argument_group("speculative decoding (docs/speculative.md)")
    group.add_argument(
        "--speculative-method",
        default=None,
        choices=SPECULATIVE_METHODS,
        help="draft tokens and verify them in one target pass (default: off)",
    )
    group.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=defaults["num_speculative_tokens"].default,
        help="K: the most drafts a request verifies per step",
    )
    group.add_argument(
        "--prompt-lookup-min", type=int, default=defaults["prompt_lookup_min"].default
    )
    group.add_argument(
        "--prompt-lookup-max", type=int, default=defaults["prompt_lookup_max"].default
    )
    group.add_argument(
        "--draft-model",
        default=None,
        help="for --speculative-method draft: 'self:layers=N' or a model sharing the vocabulary; "
        "for eagle or medusa: a heads file (default: the ones shipped for the model)",
    )
    group.add_argument(
        "--draft-quantization",
        default=defaults["draft_quantization"].default,
        choices=quantization_choices(),
        help="weight format of a --draft-model file, e.g. int4: the target quantized as its draft",
    )
    group.add_argument(
        "--draft-sampling",
        default=defaults["draft_sampling"].default,
        choices=DRAFT_SAMPLING,
        help="sampled requests: argmax drafts (seeded output = plain decoding's) or drawn ones",
    )
    group.add_argument(
        "--speculative-disable-batch-size",
        type=int,
        default=defaults["speculative_disable_batch_size"].default,
        help="no speculation while more requests than this run",
    )
    group.add_argument(
        "--speculative-adaptive-k",
        action=argparse.BooleanOptionalAction,
        default=defaults["speculative_adaptive_k"].default,
        help="each request's K follows its acceptance",
    )
    group.add_argument(
        "--speculative-tree",
        action=argparse.BooleanOptionalAction,
        default=defaults["speculative_tree"].default,
        help="medusa, eagle: verify a tree of the drafter's top candidates, shaped by its "
        "confidence (off: its top-1 chain)",
    )
    group.add_argument(
        "--speculative-tree-min-score",
        type=float,
        default=defaults["speculative_tree_min_score"].default,
        help="medusa, eagle trees: leave out candidates the drafter gives less than this "
        "chance of acceptance (0: the tree's full size)",
    )


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """Every EngineArgs field from the flag of the same name (`--kv-cache` -> kv_cache); a
    repeatable `--model` gives its first (the default when not given)."""
    values = {field.name: getattr(ns, field.name) for field in fields(EngineArgs)}
    if values["model"] is None or isinstance(values["model"], list):
        values["model"] = (values["model"] or [EngineArgs.model])[0]
    return EngineArgs(**values)
