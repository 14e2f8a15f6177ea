"""The paths of the bfloat16 products (TOKENMILL_BF16_PRODUCTS: AMX tiles, AVX512-BF16 dot
products, float32 FMAs on widened weights): each gives the float32 product of the bfloat16
values rounded once, a row's bits do not depend on its batch, the widening path's AVX2 and
AVX-512 tiles give the same bits, and SmolLM2 in bfloat16 decodes alike on every path. The
library chooses its path once as it loads, so each path runs in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from tokenmill.kernels import ops

from .cases import needs_native
from .test_bfloat16 import assert_rounded_from


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# (name, TOKENMILL_BF16_PRODUCTS, TOKENMILL_AVX512, what the CPU needs or None)
PATHS = [
    ("widen-avx512", "widen", "1", None),
    ("widen-avx2", "widen", "0", None),
    ("dot", "dot", "1", "avx512_bf16"),
    ("amx", "amx", "1", "amx_bf16"),
]

# Products at 1, 3, 6, 7, 64 and 300 rows (a tile's rows, one past them, a prefill's) with N and
# K that are not whole panels or tile steps, each fifth row also alone; then SmolLM2 in bfloat16,
# greedy with the top two logprobs, over a few prompts in one batch. Saved to argv[1] with the
# path the library took.
PATH_RUN = """
import sys, torch
from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.kernels import ops
from tokenmill.loader.resolve import DEFAULT_MODEL, resolve_model
from tokenmill.sampling.params import SamplingParams
native = ops._NATIVE
gen = torch.Generator().manual_seed(0)
products = []
for rows in (1, 3, 6, 7, 64, 300):
    for n, k in ((70, 33), (33, 577), (257, 96)):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        weight = torch.randn(n, k, generator=gen).bfloat16()
        bias = torch.randn(n, generator=gen).bfloat16()
        packed = native.pack_bfloat16_weight(weight)
        together = native.bfloat16_linear(x, packed, n, bias)
        alone = torch.cat([native.bfloat16_linear(x[r : r + 1], packed, n, bias)
                           for r in range(0, rows, max(1, rows // 5))])
        products.append((x, weight, bias, together, alone))
args = EngineArgs(model=str(resolve_model(DEFAULT_MODEL)), dtype="bfloat16",
                  kv_cache_memory="32MiB")
engine = LLMEngine(args)
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
prompts = ["The capital of France is", "def quicksort(xs):", "List three prime numbers:"]
for i, prompt in enumerate(prompts):
    engine.add_request(str(i), prompt, params)
done = {}
while engine.has_unfinished_requests():
    for output in engine.step():
        if output.finished:
            done[output.request_id] = output.outputs[0]
greedy = [(done[str(i)].token_ids, [dict(p.top) for p in done[str(i)].logprobs])
          for i in range(len(prompts))]
torch.save((ops.bfloat16_products(), products, greedy), sys.argv[1])
"""


def _path_params() -> list[Any]:
    flags = cpu_flags()
    return [
        pytest.param(
            products,
            avx512,
            id=name,
            marks=pytest.mark.skipif(
                needs is not None and needs not in flags, reason=f"this CPU has no {needs}"
            ),
        )
        for name, products, avx512, needs in PATHS
    ]


@pytest.fixture(scope="module")
def path_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Any]:
    """A path's (name, products, greedy runs), each path run once per module in a process of
    its own."""
    cache: dict[tuple[str, str], Any] = {}
    directory = tmp_path_factory.mktemp("bfloat16_products")

    def run(products: str, avx512: str) -> Any:
        if (products, avx512) not in cache:
            env = {**os.environ, "TOKENMILL_BF16_PRODUCTS": products, "TOKENMILL_AVX512": avx512}
            env.setdefault("OMP_NUM_THREADS", "1")
            path = directory / f"{products}-{avx512}.pt"
            subprocess.run([sys.executable, "-c", PATH_RUN, str(path)], env=env, check=True)
            cache[products, avx512] = torch.load(path)
        return cache[products, avx512]

    return run


@needs_native
@pytest.mark.parametrize(("products", "avx512"), _path_params())
def test_each_path_rounds_the_float32_product_of_the_bfloat16_values(
    path_run, products: str, avx512: str
) -> None:
    chosen, cases, _ = path_run(products, avx512)
    assert chosen == products
    for x, weight, bias, together, _ in cases:
        assert_rounded_from(together, F.linear(x.float(), weight.float(), bias.float()))


@needs_native
@pytest.mark.parametrize(("products", "avx512"), _path_params())
def test_each_path_gives_a_row_the_same_bits_alone_and_in_a_batch(
    path_run, products: str, avx512: str
) -> None:
    _, cases, _ = path_run(products, avx512)
    for x, _, _, together, alone in cases:
        rows = x.shape[0]
        assert torch.equal(alone, together[0 : rows : max(1, rows // 5)])


@needs_native
def test_widening_tiles_give_the_same_bits_on_avx2_and_avx512(path_run) -> None:
    """Both add each output's k in order, one FMA each, and round the same way."""
    _, avx512, _ = path_run("widen", "1")
    _, avx2, _ = path_run("widen", "0")
    for wide, narrow in zip(avx512, avx2, strict=True):
        assert torch.equal(wide[3], narrow[3])


def _import_error(products: str) -> str:
    env = {**os.environ, "TOKENMILL_BF16_PRODUCTS": products}
    done = subprocess.run(
        [sys.executable, "-c", "import tokenmill.kernels.ops"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0
    return done.stderr


@needs_native
@pytest.mark.skipif(ops.amx_available(), reason="this CPU runs AMX tiles")
def test_asking_for_amx_without_it_fails_at_import() -> None:
    assert "ValueError: TOKENMILL_BF16_PRODUCTS=amx, but this CPU" in _import_error("amx")


@needs_native
def test_an_unknown_path_fails_at_import() -> None:
    assert "ValueError: TOKENMILL_BF16_PRODUCTS=fast is none of amx, dot, widen" in (
        _import_error("fast")
    )


def _greedy_params() -> list[Any]:
    return [param for param in _path_params() if param.id != "widen-avx512"]


@needs_native
@pytest.mark.parametrize(("products", "avx512"), _greedy_params())
def test_smollm2_decodes_alike_on_every_path(path_run, products: str, avx512: str) -> None:
    """Against the widening path's AVX-512 tiles: the same greedy tokens but where the two
    runs' top two are within two bfloat16 steps of a logit (1/8 nat each near SmolLM2's top
    tokens), and top logprobs that close wherever the tokens agree."""
    _, _, reference = path_run("widen", "1")
    _, _, other = path_run(products, avx512)
    for (ref_ids, ref_top), (ids, top) in zip(reference, other, strict=True):
        for at, (ref_id, token_id) in enumerate(zip(ref_ids, ids, strict=True)):
            assert abs(ref_top[at][ref_id] - top[at][token_id]) <= 0.25
            if ref_id != token_id:
                assert top[at][token_id] - top[at].get(ref_id, -float("inf")) <= 0.25
                break  # past a flip the two continue from different text
