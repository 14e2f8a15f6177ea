"""Built-in chat templates for model files that ship none."""

from __future__ import annotations

from tokenmill.loader.chat_template import (
    GEMMA_CHAT_TEMPLATE,
    builtin_chat_template,
    render_chat_template,
)


def test_gemma_vocabulary_gets_gemma_turns_with_the_system_prompt_in_the_first_turn():
    assert builtin_chat_template({"<start_of_turn>": 105, "<end_of_turn>": 106}) is not None
    text = render_chat_template(
        GEMMA_CHAT_TEMPLATE,
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi "},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "A river?"},
        ],
        add_generation_prompt=True,
        bos_token="<bos>",
        eos_token="<eos>",
    )
    assert text == (
        "<bos><start_of_turn>user\nBe terse.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nA river?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_other_vocabularies_fall_back_to_chatml():
    assert builtin_chat_template({"<|im_start|>": 1, "<|im_end|>": 2}) is None


def test_packaged_gemma_uses_its_turn_tokens(gemma):
    ids = gemma.tokenizer.encode(
        gemma.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    )
    start, end = (gemma.tokenizer.token_to_id(t) for t in ("<start_of_turn>", "<end_of_turn>"))
    assert ids[0] == gemma.tokenizer.bos_token_id
    assert ids.count(start) == 2 and ids.count(end) == 1
