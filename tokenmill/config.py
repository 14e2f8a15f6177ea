"""Plain settings shared by every layer: the model's shape (read once from GGUF metadata or
config.json) and the engine's switches with their checks. Imports nothing of tokenmill."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


SLIDING_ATTENTION = "sliding_attention"  # a `layer_types` entry: the layer has the window


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters under Hugging Face's names, whatever file format they came from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # Gemma 3: "sliding_attention" layers see the last `sliding_window` tokens and rotate with
    # `rope_local_base_freq`; "full_attention" layers see everything and use `rope_theta`.
    # Mistral-style: `sliding_window` without `layer_types` applies to every layer.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: int | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention), as both the model's attention
        and the KV cache's trimming apply it."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_hidden_layers
        return tuple(
            self.sliding_window
            if i < len(self.layer_types) and self.layer_types[i] == SLIDING_ATTENTION
            else None
            for i in range(self.num_hidden_layers)
        )


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


KV_CACHE_MODES = ("none", "contiguous", "paged")
# "auto" keeps K/V in the model dtype; int8 / fp8 store 8-bit codes with a scale per token and
# KV head (tokenmill/kv/quantized.py, docs/quantization.md).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# How requests join batches (engine/admission.py): "continuous" at any step; "static" and
# "dynamic" seal a batch and run it to completion (dynamic waits up to max_wait_ms to fill it).
SCHEDULERS = ("continuous", "static", "dynamic")
# Weight quantization methods by name (tokenmill/quant/registry.py holds their implementations).
QUANTIZATION_METHODS = (
    "none",
    "int8",
    "int4",
    "gguf",
    "gptq",
    "awq",
    "smoothquant",
    "fp8",
    "nf4",
)
DECODE_LOOPS = ("native", "python")
SPECULATIVE_METHODS = ("ngram", "draft", "eagle", "medusa")
# How a draft model picks a sampled request's drafts: "argmax" (the baseline) keeps a seeded
# request's tokens those of plain decoding; "sample" draws from the draft's own distribution,
# which the target accepts far more often at a temperature.
DRAFT_SAMPLING = ("argmax", "sample")
_MEMORY_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}


def parse_memory(value: int | str, name: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string such as "2GiB", "512MiB" or "1e9"."""
    if isinstance(value, int) and not isinstance(value, bool):
        amount = value
    elif isinstance(value, str):
        text = value.strip().upper()
        number = text.rstrip("KMGIB")
        unit = text[len(number) :]
        if unit not in _MEMORY_UNITS:
            raise ValueError(f"{name} unit must be one of B, KiB, MiB, GiB, got {value!r}")
        try:
            amount = int(float(number) * _MEMORY_UNITS[unit])
        except ValueError as exc:
            raise ValueError(f"{name} must be bytes or like '2GiB', got {value!r}") from exc
    else:
        raise ValueError(f"{name} must be bytes or like '2GiB', got {value!r}")
    if amount <= 0:
        raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
    return amount


@dataclass
class EngineArgs:
    """Every engine switch, with the technique on by default and its baseline one flag away."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    kv_cache: str = "paged"
    block_size: int = 16
    kv_cache_memory: int | str = "1GiB"
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # Prefix-cache lifetimes (docs/kv-cache.md): a cached block unused for longer than
    # prefix_cache_ttl seconds is dropped from every tier (None: kept until evicted); requests
    # asking to retain their prompt's blocks may hold at most this fraction of the pool.
    prefix_cache_ttl: float | None = None
    max_retained_kv_fraction: float = 0.5
    # The disk tier of the prefix cache (docs/kv-cache.md): evicted full blocks are written to
    # files under kv_offload_dir, at most kv_offload_bytes of them, and loaded back on a hit.
    # None, the baseline: an evicted prefix is recomputed.
    kv_offload_dir: str | None = None
    kv_offload_bytes: int | str = "8GiB"
    # A model with sliding-window layers keeps only their window's blocks (one block table per
    # KV-cache group, tokenmill/kv/groups.py); False keeps one table for all layers, the baseline.
    kv_window_trimming: bool = True
    scheduler: str = "continuous"
    # scheduler="dynamic": a batch closes once max_num_seqs requests wait or the oldest has
    # waited this long.
    max_wait_ms: float = 50.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    # Weight quantization at load time (docs/quantization.md), one of QUANTIZATION_METHODS.
    quantization: str = "none"
    # "native": a decode step's layers in one C++ call when every kernel has a native version
    # (tokenmill/model/decode_loop.py); "python": layer by layer, the baseline.
    decode_loop: str = "native"
    # Keep a second copy of each float weight, laid out at engine start for batched products
    # (more weight memory): with the native kernels the packed kernel reads it (bfloat16 as the
    # tiles of its products), with TOKENMILL_KERNELS=torch oneDNN's GEMM does. False, the
    # baseline: the skinny kernel on the plain weights for a few rows, torch's GEMM beyond.
    prepack_weights: bool = True
    # glibc's malloc keeps freed tensors' pages for reuse instead of returning them to the OS,
    # process-wide from the first engine on (tokenmill/engine/host_memory.py); False leaves
    # malloc as it was, the baseline (in a fresh process: the setting cannot be undone).
    reuse_host_memory: bool = True
    # Structured outputs (docs/structured-outputs.md): fill a step's grammar token masks in a
    # background thread while the forward pass runs; False fills them in the step loop after
    # it, the baseline.
    overlap_grammar_masks: bool = True
    # Speculative decoding (docs/speculative.md); None is the baseline: one target step a token.
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None  # "draft": "self:layers=N" or a model; "eagle"/"medusa": heads
    # Weight quantization of a `draft_model` loaded from a file, as `quantization` for the target:
    # a 4-bit copy of the target drafts at nearly the 4-bit model's speed, and verification keeps
    # the target's own output.
    draft_quantization: str = "none"
    draft_sampling: str = "argmax"
    speculative_disable_batch_size: int | None = 4
    speculative_adaptive_k: bool = True
    speculative_tree: bool = True  # medusa, eagle: verify a tree of candidates, not a chain
    # medusa, eagle trees: leave out candidates whose estimated chance of acceptance (the
    # product of the drafter's probabilities down their path) is below this: each is a row of
    # the verify pass. 0, the baseline, drafts the tree's full size.
    speculative_tree_min_score: float = 0.0

    @property
    def prepack_batch_hint(self) -> int | None:
        """The rows float weights are laid out for (`Linear.prepack`); None keeps them plain."""
        return self.max_num_seqs if self.prepack_weights else None

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        _one_of("kv_cache", self.kv_cache, KV_CACHE_MODES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("scheduler", self.scheduler, SCHEDULERS)
        if not isinstance(self.kv_window_trimming, bool):
            raise ValueError(
                f"kv_window_trimming must be True or False, got {self.kv_window_trimming!r}"
            )
        if (
            not isinstance(self.max_wait_ms, int | float)
            or isinstance(self.max_wait_ms, bool)
            or not 0 <= self.max_wait_ms < float("inf")
        ):
            raise ValueError(f"max_wait_ms must be a number >= 0, got {self.max_wait_ms!r}")
        _one_of("decode_loop", self.decode_loop, DECODE_LOOPS)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _positive_int(name, getattr(self, name))
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        _one_of("quantization", self.quantization, QUANTIZATION_METHODS)
        _one_of("draft_quantization", self.draft_quantization, QUANTIZATION_METHODS)
        _check_speculation(self)
        _check_kv_tiers(self)


def _check_kv_tiers(args: EngineArgs) -> None:
    if args.prefix_cache_ttl is not None:
        args.prefix_cache_ttl = _positive_seconds("prefix_cache_ttl", args.prefix_cache_ttl)
    fraction = args.max_retained_kv_fraction
    if not _is_number(fraction) or not 0 <= fraction <= 1:
        raise ValueError(f"max_retained_kv_fraction must be in [0, 1], got {fraction!r}")
    args.kv_offload_bytes = parse_memory(args.kv_offload_bytes, "kv_offload_bytes")
    if args.kv_offload_dir is None:
        return
    if not isinstance(args.kv_offload_dir, str) or not args.kv_offload_dir:
        raise ValueError(f"kv_offload_dir must be a directory path, got {args.kv_offload_dir!r}")
    if args.kv_cache != "paged" or not args.enable_prefix_caching:
        raise ValueError("kv_offload_dir needs kv_cache='paged' with prefix caching enabled")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_seconds(name: str, value: object) -> float:
    """A finite number of seconds > 0, else a ValueError naming `name`."""
    if not _is_number(value) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _check_speculation(args: EngineArgs) -> None:
    if args.speculative_method not in ("draft", "eagle", "medusa") and args.draft_model is not None:
        raise ValueError(
            "draft_model needs speculative_method='draft' (or 'eagle' / 'medusa', for heads)"
        )
    if args.speculative_method != "draft" and args.draft_quantization != "none":
        raise ValueError("draft_quantization needs speculative_method='draft' and a draft_model")
    _one_of("draft_sampling", args.draft_sampling, DRAFT_SAMPLING)
    if args.speculative_method != "draft" and args.draft_sampling != "argmax":
        raise ValueError("draft_sampling='sample' needs speculative_method='draft'")
    if args.speculative_method is None:
        return
    _one_of("speculative_method", args.speculative_method, SPECULATIVE_METHODS)
    for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        _positive_int(name, getattr(args, name))
    if args.prompt_lookup_min > args.prompt_lookup_max:
        raise ValueError(
            f"prompt_lookup_min ({args.prompt_lookup_min}) must be <= prompt_lookup_max "
            f"({args.prompt_lookup_max})"
        )
    if args.speculative_disable_batch_size is not None:
        _positive_int("speculative_disable_batch_size", args.speculative_disable_batch_size)
    if not 0.0 <= args.speculative_tree_min_score < 1.0:
        raise ValueError(
            f"speculative_tree_min_score must be in [0, 1), got {args.speculative_tree_min_score}"
        )
    if args.kv_cache == "none":
        raise ValueError("speculative_method needs a KV cache: kv_cache='paged' or 'contiguous'")
    if args.speculative_method == "draft" and args.draft_model is None:
        raise ValueError("speculative_method='draft' needs draft_model: 'self:layers=N' or a path")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
