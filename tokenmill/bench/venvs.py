"""Virtual environments for the engines tokenmill is compared with, made on first use.

Each engine pins its own torch and friends, so each gets its own venv under a cache folder and
tokenmill's environment is never touched. A stamp file records what was installed; a changed
pin reinstalls, an unchanged one costs nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tokenmill" / "anchors"


@dataclass(frozen=True)
class VenvSpec:
    name: str
    requirements: tuple[str, ...]
    remove_after: tuple[str, ...] = ()  # packages a requirement drags in that must not stay

    def root(self, cache_dir: Path) -> Path:
        return cache_dir / self.name / "venv"

    def python(self, cache_dir: Path) -> Path:
        return self.root(cache_dir) / "bin" / "python"


def ensure_venv(spec: VenvSpec, cache_dir: Path, install: bool) -> Path:
    """The venv's python, installing the venv first if it is missing or out of date."""
    root = spec.root(cache_dir)
    stamp = root / ".tokenmill-installed"
    wanted = json.dumps(asdict(spec), sort_keys=True)
    if stamp.is_file() and stamp.read_text(encoding="utf-8") == wanted:
        return spec.python(cache_dir)
    if not install:
        raise ValueError(
            f"{spec.name}: no environment at {root}; run once without --no-install to create it"
        )
    print(f"anchors: installing {' '.join(spec.requirements)} into {root}", file=sys.stderr)
    # The venv module builds on the base interpreter, not on tokenmill's own venv.
    run_checked([sys.executable, "-m", "venv", "--clear", str(root)])
    python = spec.python(cache_dir)
    run_checked([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    run_checked([str(python), "-m", "pip", "install", *spec.requirements])
    if spec.remove_after:
        run_checked([str(python), "-m", "pip", "uninstall", "--yes", *spec.remove_after])
    stamp.write_text(wanted, encoding="utf-8")
    return python


def run_checked(command: list[str], cwd: Path | None = None) -> None:
    """Run a setup command with its output on the terminal; a failure names the command."""
    result = subprocess.run(command, cwd=cwd, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed with exit code {result.returncode}")
