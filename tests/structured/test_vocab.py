"""The token bytes xgrammar sees must spell exactly what the tokenizer decodes."""

from __future__ import annotations

from tokenmill.structured.vocab import encoded_vocab, tokenizer_info

TEXT = 'Ünïcode, "quotes", tabs\tand\nnewlines: {"a": [1, 2.5e-3]} ✓'


def test_byte_level_tokens_spell_the_text_they_encode(smollm):
    tokenizer = smollm.tokenizer
    vocab = encoded_vocab(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert b"".join(vocab[i] for i in ids) == TEXT.encode()


def test_sentencepiece_tokens_spell_the_text_they_encode_byte_fallback_included(gemma):
    tokenizer = gemma.tokenizer
    vocab = encoded_vocab(tokenizer)
    text = TEXT + " 𓀀"  # a character outside Gemma's vocabulary: spelled by byte tokens
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(vocab[i] for i in ids) == text.encode()


def test_special_tokens_have_no_bytes(smollm):
    tokenizer = smollm.tokenizer
    vocab = encoded_vocab(tokenizer)
    assert vocab[tokenizer.token_to_id("<|im_end|>")] == b""


def test_padded_logit_columns_are_covered(smollm):
    info = tokenizer_info(smollm.tokenizer, smollm.tokenizer.vocab_size + 64)
    assert info.vocab_size == smollm.tokenizer.vocab_size + 64
