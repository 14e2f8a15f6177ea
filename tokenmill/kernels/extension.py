"""The native extension and what this CPU offers it: loaded once at import, or None.

`NATIVE` is the loaded module, or None when every op runs its torch reference: the kernels were
switched off (`TOKENMILL_KERNELS=torch`), the CPU lacks AVX2, or the build or load failed (one
warning line on stderr, never a crash). Every op reads `NATIVE` on each call, so setting it
(tests do, through `ops._NATIVE`) switches all of them at once. The AVX-512 paths inside the
extension are chosen at run time by the native code itself (`TOKENMILL_AVX512=0` keeps AVX2).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import torch

from tokenmill.kernels import build

BACKEND_ENV = "TOKENMILL_KERNELS"


def _intel_cpu() -> bool:
    """Whether Linux reports an Intel CPU (MKL's vendor check; False where unknown)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(
                line.split(":")[-1].strip() == "GenuineIntel"
                for line in cpuinfo
                if line.startswith("vendor_id")
            )
    except OSError:
        return False


# MKL takes its fast code paths on Intel CPUs only; the linear dispatch's row limits depend on it.
INTEL_CPU = _intel_cpu()


def _warn(message: str) -> None:
    print(f"tokenmill: {message}", file=sys.stderr)


def load_native() -> ModuleType | None:
    """The extension module, or None when the torch reference should run, as the environment
    (`TOKENMILL_KERNELS`) and the CPU decide now."""
    choice = os.environ.get(BACKEND_ENV, "native").strip().lower()
    if choice == "torch":
        return None
    if choice != "native":
        _warn(f"{BACKEND_ENV}={choice!r} is neither 'native' nor 'torch'; trying native")
    # The kernels are compiled for AVX2 + FMA; on an older CPU they would die on SIGILL.
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _warn("native kernels need AVX2; using the torch reference kernels")
        return None
    try:
        return build.load_extension()
    except Exception as exc:  # any build or load failure must leave a working engine
        first_line = str(exc).strip().partition("\n")[0][:160]
        reason = f"{type(exc).__name__}: {first_line}"
        _warn(
            f"native kernels unavailable ({reason}); using the torch reference kernels "
            "(details: python scripts/build_kernels.py)"
        )
        return None


NATIVE = load_native()

# The path of every bfloat16 product (csrc/bfloat16_linear.cpp): "amx", "dot" (AVX512-BF16) or
# "widen" (float32 FMAs on the widened weights), as TOKENMILL_BF16_PRODUCTS asks, else by the
# CPU's rule; None without the native kernels. A setting this CPU cannot run raises ValueError
# here, at import, rather than at the first product.
BFLOAT16_PRODUCTS_ENV = "TOKENMILL_BF16_PRODUCTS"
BFLOAT16_PRODUCTS: str | None = None if NATIVE is None else NATIVE.bfloat16_products()


def amx_available() -> bool:
    """Whether AMX tiles run here: the native kernels loaded, and the CPU has AMX and Linux let
    this process use it (asked once)."""
    return NATIVE is not None and NATIVE.amx_available()


def bfloat16_products() -> str | None:
    """The path the native bfloat16 products take ("amx", "dot" or "widen"); None without the
    native kernels."""
    return BFLOAT16_PRODUCTS


def backend() -> str:
    """Which kernels run: "native" (the extension) or "torch" (every op's reference)."""
    return "torch" if NATIVE is None else "native"
