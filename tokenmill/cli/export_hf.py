"""`tokenmill export-hf`: write a GGUF model as a Hugging Face directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser("export-hf", help="write a GGUF model as a Hugging Face dir")
    export.add_argument("model", help="a .gguf file or packaged model name")
    export.add_argument("out_dir")
    export.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.loader.export import export_hf

    out = export_hf(ns.model, Path(ns.out_dir))
    print(f"wrote {out}", file=sys.stderr)
    return 0
