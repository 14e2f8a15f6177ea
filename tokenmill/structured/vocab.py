"""The vocabulary as xgrammar needs it: each token id's bytes, built from tokenmill's Tokenizer.

Two spellings are undone here. Byte-level BPE (GPT-2, SmolLM2) spells every byte as a printable
character (`Ġ` for a space); sentencepiece (Llama 2, Gemma) writes a space as `▁` and falls back
to `<0xNN>` tokens for single bytes. Special tokens get no bytes, so a grammar never produces
them; the end-of-turn tokens are the grammar's stop tokens. Ids past the tokenizer's vocabulary
(a model's padded lm_head rows) count as tokens no grammar allows.
"""

from __future__ import annotations

import re

import xgrammar as xgr

from tokenmill.loader.tokenizer import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable character for each byte, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


def _byte_level(token: str, decoder: dict[str, int]) -> bytes:
    if all(char in decoder for char in token):
        return bytes(decoder[char] for char in token)
    return token.encode()  # an added token, stored as plain text


def _sentencepiece(token: str) -> bytes:
    match = _BYTE_FALLBACK.fullmatch(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace("▁", " ").encode()


def encoded_vocab(tokenizer: Tokenizer) -> list[bytes]:
    """The bytes of each token id of `tokenizer`, b"" for special tokens."""
    if tokenizer.token_to_id("<0x0A>") is not None:
        spell = _sentencepiece
    elif tokenizer.token_to_id("Ġ") is not None:
        decoder = _gpt2_byte_decoder()

        def spell(token: str) -> bytes:
            return _byte_level(token, decoder)
    else:

        def spell(token: str) -> bytes:
            return token.encode()

    return [
        b"" if tokenizer.is_special(token_id) else spell(tokenizer.id_to_token(token_id))
        for token_id in range(tokenizer.vocab_size)
    ]


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer` for a model whose logits have `vocab_size` columns."""
    return xgr.TokenizerInfo(
        encoded_vocab(tokenizer),
        xgr.VocabType.RAW,
        vocab_size=max(vocab_size, tokenizer.vocab_size),
        stop_token_ids=sorted(tokenizer.stop_token_ids),
    )
