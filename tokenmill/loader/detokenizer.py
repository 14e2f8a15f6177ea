"""Turn a stream of generated token ids into a stream of text deltas.

Decoding one token at a time is wrong twice over: a character can span several byte tokens, and
a token's text can depend on its neighbours (sentencepiece drops a leading space at the start of
a decode). So each step decodes a short window of recent tokens and emits only the characters
past what was already emitted, holding back what later tokens could still change:

- a trailing U+FFFD, which may be the first bytes of a character (byte-level BPE);
- a trailing run of `<0xNN>` byte-fallback tokens: their decoder turns the *whole* run into
  U+FFFDs if any byte in it is invalid, so even a finished character in it is not final until a
  normal token ends the run.

Together the deltas and `flush()` spell exactly `tokenizer.decode(output_ids)`. The window starts
at the first output token, not in the prompt: prompt context cannot change that text, and where it
would change the stream (a decoder that strips the first leading space, or a prompt ending
mid-character) it would only break the equality.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tokenmill.loader.tokenizer import Tokenizer

# A window this long is cut back to `_KEEP_TOKENS`; both bound the cost of a step's decode.
_MAX_WINDOW_TOKENS = 16
_KEEP_TOKENS = 4
_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalDetokenizer:
    """Decode one request's output tokens as they arrive, never splitting a character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []
        # How many characters of `decode(self._window)` are already emitted.
        self._emitted_in_window = 0
        self._deltas: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._deltas)

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """The text `new_ids` completes; empty while a character is still incomplete."""
        self._window.extend(new_ids)
        settled = len(self._window)
        while settled and self._continues_byte_run(self._window[settled - 1]):
            settled -= 1
        settled_text = self._decode(self._window[:settled])
        complete = len(settled_text.rstrip(_REPLACEMENT))
        delta = settled_text[self._emitted_in_window : complete]
        self._emitted_in_window = max(self._emitted_in_window, complete)
        if len(self._window) > _MAX_WINDOW_TOKENS:
            self._shrink_window()
        return self._record(delta)

    def flush(self) -> str:
        """At the end of generation, whatever was held back: it can no longer change."""
        window_text = self._decode(self._window)
        delta = window_text[self._emitted_in_window :]
        self._emitted_in_window = len(window_text)
        return self._record(delta)

    def _shrink_window(self) -> None:
        """Drop old tokens at a cut the decode cannot see: before a normal token, and where the
        kept tail decodes to exactly the end of the window's text (less a stripped space)."""
        window_text = self._decode(self._window)
        for cut in range(len(self._window) - _KEEP_TOKENS, 0, -1):
            if self._continues_byte_run(self._window[cut]):
                continue
            tail_text = self._decode(self._window[cut:])
            dropped = len(window_text) - len(tail_text)
            if window_text.endswith(tail_text) and dropped <= self._emitted_in_window:
                self._window = self._window[cut:]
                self._emitted_in_window -= dropped
                return

    def _continues_byte_run(self, token_id: int) -> bool:
        """A byte-fallback token, or a special token the decode drops (bytes join across it)."""
        if self._skip_special_tokens and self._tokenizer.is_special(token_id):
            return True
        return _BYTE_TOKEN.fullmatch(self._tokenizer.id_to_token(token_id)) is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _record(self, delta: str) -> str:
        if delta:
            self._deltas.append(delta)
        return delta
