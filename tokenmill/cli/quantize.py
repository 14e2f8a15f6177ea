"""`tokenmill quantize`: write a quantized checkpoint that tokenmill loads directly."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.loader.export_gguf import GGUF_MIX_METHODS
from tokenmill.quant.registry import QUANT_METHODS


def add_parser(commands: argparse._SubParsersAction) -> None:
    quantize = commands.add_parser(
        "quantize", help="write a quantized checkpoint that tokenmill loads directly"
    )
    quantize.add_argument(
        "--method",
        required=True,
        choices=[*QUANT_METHODS, *GGUF_MIX_METHODS],
        help="gguf-q4_k_m / gguf-q5_k_m / gguf-q6_k: write OUT as a k-quant .gguf file "
        "(from a .gguf model)",
    )
    quantize.add_argument("--bits", type=int, default=None, help="the method's only one if unset")
    quantize.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="inputs per scale: 32, 64 or 128 (int4 default 32, nf4 64; int8 per channel)",
    )
    quantize.add_argument(
        "--calib-samples",
        type=int,
        default=None,
        help="gptq, awq, smoothquant: calibration windows of 512 tokens (default 64)",
    )
    quantize.add_argument(
        "--act-order",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gptq: round inputs by decreasing activation energy (default on)",
    )
    quantize.add_argument(
        "--alpha", type=float, default=None, help="smoothquant: migration strength (0.5)"
    )
    quantize.add_argument("model", help="a .gguf file, a Hugging Face directory or package name")
    quantize.add_argument("out_dir", help="the checkpoint directory (a .gguf file for gguf-*)")
    quantize.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    import torch

    from tokenmill.loader.model_loader import load_model
    from tokenmill.loader.quantized_checkpoint import save_quantized
    from tokenmill.quant.registry import quant_method

    if ns.method in GGUF_MIX_METHODS:
        from tokenmill.loader.export_gguf import export_gguf

        out = export_gguf(ns.model, Path(ns.out_dir), GGUF_MIX_METHODS[ns.method])
        print(f"wrote {out}", file=sys.stderr)
        return 0
    options = {
        key: getattr(ns, key)
        for key in ("bits", "group_size", "calib_samples", "act_order", "alpha")
    }
    method = quant_method(ns.method, **{k: v for k, v in options.items() if v is not None})
    loaded = load_model(ns.model, torch.float32, method)
    out = save_quantized(loaded, method, Path(ns.out_dir))
    print(f"wrote {out}", file=sys.stderr)
    return 0
