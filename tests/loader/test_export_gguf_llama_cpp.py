"""llama.cpp reads the GGUFs `tokenmill quantize --method gguf-*` writes as tokenmill does: the
anchors' llama-server loads each file, and every greedy token it generates is tokenmill's own
greedy choice on the same file, or within a near-tie of it (llama.cpp rounds activations to
8 bits for its quantized products, tokenmill's reference path does not). The three files cover
every block type the writer makes (Q4_K, Q6_K and the Q5_0 / Q8_0 fallbacks) on both
architectures. Needs the anchors' llama.cpp build; skipped without it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.bench.llama_server import ensure_llama_server, running_llama_server
from tokenmill.bench.venvs import DEFAULT_CACHE_DIR
from tokenmill.loader.export_gguf import export_gguf

PROMPT = "The old lighthouse stood at the end of the harbour wall, and every evening its keeper"
NEW_TOKENS = 12
# Largest gap, in log-probability, between tokenmill's top token and llama.cpp's pick that
# still counts as a near-tie.
NEAR_TIE = 0.5
CASES = [
    ("smollm2-135m-instruct", "q4_k_m"),
    ("smollm2-135m-instruct", "q5_k_m"),
    ("gemma3-270m", "q4_k_m"),
    ("gemma3-270m", "q6_k"),
]


@pytest.fixture(scope="module")
def llama_server() -> Path:
    try:
        return ensure_llama_server(DEFAULT_CACHE_DIR, install=False, jobs=1)
    except ValueError:
        pytest.skip(
            f"no llama-server built in {DEFAULT_CACHE_DIR}; build it with "
            "`tokenmill bench anchors --engines llama.cpp --setup-only`"
        )


def llama_cpp_greedy(binary: Path, gguf: Path, prompt_ids: list[int], log: Path) -> list[int]:
    with running_llama_server(binary, gguf, 1, 256, 2, log) as base_url:
        response = httpx.post(
            f"{base_url}/completion",
            json={
                "prompt": prompt_ids,
                "n_predict": NEW_TOKENS,
                "temperature": 0.0,
                "top_k": 1,
                "ignore_eos": True,
                "cache_prompt": False,
                "return_tokens": True,
            },
            timeout=120,
        )
    response.raise_for_status()
    return response.json()["tokens"]


@pytest.mark.parametrize(("model", "mix"), CASES)
def test_llama_server_greedy_tokens_are_tokenmills_choices(
    llama_server: Path, model: str, mix: str, tmp_path: Path
) -> None:
    gguf = export_gguf(model, tmp_path / f"{model}-{mix}.gguf", mix)
    with LLM(str(gguf), kv_cache_memory="64MiB") as llm:
        prompt_ids = llm.tokenizer.encode(PROMPT)
        theirs = llama_cpp_greedy(llama_server, gguf, prompt_ids, tmp_path / "server.log")
        assert len(theirs) == NEW_TOKENS
        # tokenmill scores llama.cpp's continuation token by token, each given the ones before
        (scored,) = llm.generate(
            [prompt_ids + theirs], SamplingParams(max_tokens=1, prompt_logprobs=1)
        )
    for position, entry in enumerate(scored.prompt_logprobs[len(prompt_ids) :]):
        best_logprob = entry.top[0][1]
        assert entry.rank == 1 or best_logprob - entry.logprob < NEAR_TIE, (
            f"{gguf.name}: llama.cpp's token {position} ({entry.token_id}) is tokenmill's "
            f"rank {entry.rank}, {best_logprob - entry.logprob:.2f} below its top"
        )
