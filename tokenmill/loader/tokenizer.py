"""The text <-> token id boundary: one `Tokenizer` whatever file the model came from.

A Hugging Face directory carries a ready `tokenizer.json`. A GGUF file carries only a vocabulary
and llama.cpp's description of how to use it, so `from_gguf_metadata` rebuilds that pipeline as a
`tokenizers.Tokenizer`, following llama.cpp rather than transformers where the two disagree,
because llama.cpp is what the file was written for. BOS is added here, not by a post-processor,
so both sources share one rule for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from tokenmill.loader.chat_template import builtin_chat_template, render_chat_template

SUPPORTED_GGUF_MODELS = ("gpt2", "llama")

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Tokens that end an assistant turn in the chat formats we know; generation stops on any of them.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")

# llama.cpp's pre-tokenizer regexes. Each regex splits every piece the previous one produced.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2_SPLIT)
_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "dbrx": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    "stablelm2": (_QWEN2_SPLIT,),
}
# llama.cpp looks a whole llama3 word up in the vocabulary before merging it.
_IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe"})


class Tokenizer:
    """Encode, decode and chat-format text for one model; built by the `from_*` constructors."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        end_of_turn_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._special_ids = frozenset(
            token_id
            for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special
        )
        named_ends = (backend.token_to_id(name) for name in _END_OF_TURN_TOKENS)
        stops = {eos_token_id, *end_of_turn_ids, *named_ends}
        self.stop_token_ids = frozenset(token_id for token_id in stops if token_id is not None)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes; `ValueError` for a kind we cannot run."""
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata["tokenizer.ggml.tokens"]
        if model == "gpt2":
            backend = _byte_level_bpe(metadata)
        elif model == "llama":
            tokens = [_sentencepiece_spelling(token) for token in tokens]
            backend = _sentencepiece_bpe(metadata, tokens)
        else:
            supported = ", ".join(SUPPORTED_GGUF_MODELS)
            raise ValueError(f"unsupported GGUF tokenizer model {model!r}; supported: {supported}")
        _add_gguf_added_tokens(backend, tokens, metadata.get("tokenizer.ggml.token_type"))
        end_of_turn_ids = (
            metadata[key]
            for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if key in metadata
        )
        return cls(
            backend,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
            # llama.cpp's defaults when the key is absent: sentencepiece vocabularies want BOS.
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama")),
            chat_template=metadata.get("tokenizer.chat_template")
            or builtin_chat_template(backend.get_vocab()),
            end_of_turn_ids=end_of_turn_ids,
        )

    @classmethod
    def from_pretrained_dir(cls, path: Path) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` (if any)."""
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        bos_token_id = _config_token_id(backend, config.get("bos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag: the file's post-processor is the only record of whether BOS is wanted.
            add_bos = bos_token_id is not None and backend.encode("").ids[:1] == [bos_token_id]
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_id=_config_token_id(backend, config.get("eos_token")),
            add_bos=bool(add_bos),
            chat_template=_read_chat_template(path, config),
        )

    def save_pretrained(self, path: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json, which `from_pretrained_dir` reads."""
        path.mkdir(parents=True, exist_ok=True)
        backend = self._backend
        bos = self._token_text(self.bos_token_id)
        if self.add_bos and bos is not None and backend.post_processor is None:
            # transformers adds BOS through the file's post-processor (`encode` here adds it
            # itself and never runs one), so a file without one would lose it there.
            backend = tokenizers.Tokenizer.from_str(backend.to_str())
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, self.bos_token_id)],
            )
        backend.save(str(path / "tokenizer.json"))
        config = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_id),
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special-token text in it becomes the special token's one id."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """True for control tokens, the ones `decode(..., skip_special_tokens=True)` drops."""
        return token_id in self._special_ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for a conversation, in this model's format (ChatML if it has none);
        `tools` go to a template that renders them itself."""
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
            tools=tools,
        )

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)


def _byte_level_bpe(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """GPT-2-style BPE: regex split, bytes spelled as printable characters, ranked merges."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre == "gpt2":  # llama.cpp's converter writes both spellings
        pre = "gpt-2"
    if pre not in _PRE_TOKENIZER_SPLITS:
        supported = ", ".join(sorted(_PRE_TOKENIZER_SPLITS))
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {supported}")
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    model = models.BPE(
        vocab=_vocab(metadata["tokenizer.ggml.tokens"]),
        merges=merges,
        ignore_merges=pre in _IGNORE_MERGES_PRE,
    )
    backend = tokenizers.Tokenizer(model)
    splits = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        for pattern in _PRE_TOKENIZER_SPLITS[pre]
    ]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_spelling(token: str) -> str:
    """GGUF stores Gemma's space-run tokens with real spaces so llama.cpp can match them in raw
    text; spell them `▁▁...` again, as sentencepiece does, so they also match after normalization
    (a literal `▁` beside a space then tokenizes as the original model and transformers do)."""
    return "▁" * len(token) if token and not token.strip(" ") else token


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: Sequence[str]) -> tokenizers.Tokenizer:
    """Sentencepiece BPE: spaces become `▁`, merges follow token scores, `<0xNN>` byte fallback."""
    unknown_id = metadata.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab=_vocab(tokens),
        merges=_merges_from_scores(
            tokens, metadata["tokenizer.ggml.scores"], metadata["tokenizer.ggml.token_type"]
        ),
        unk_token=None if unknown_id is None else tokens[unknown_id],
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(model)
    # llama.cpp's default when the key is absent is to add the prefix space.
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    prefix = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return backend


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int]
) -> list[tuple[str, str]]:
    """Sentencepiece merges whichever adjacent pair forms the best-scoring token; a BPE merge
    list ranked by that score does the same. Only normal tokens are merge targets: added tokens
    are matched in the raw text before the model sees it, and byte tokens are fallback only."""
    known = set(tokens)
    ranked: list[tuple[float, int, str, str]] = []
    for token, score, token_type in zip(tokens, scores, token_types, strict=True):
        if token_type != _NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in known and right in known:
                ranked.append((-score, -cut, left, right))
    ranked.sort(key=lambda merge: merge[:2])
    return [(left, right) for _, _, left, right in ranked]


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    """Token -> id; a duplicated spelling keeps its first id, as llama.cpp's lookup does."""
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    return vocab


def _add_gguf_added_tokens(
    backend: tokenizers.Tokenizer, tokens: Sequence[str], token_types: Sequence[int] | None
) -> None:
    """Match control and user-defined tokens whole, before the model runs, as llama.cpp does.

    Control tokens are special (`skip_special_tokens` drops them); user-defined ones are not,
    because in Gemma they include `\\n` and runs of spaces, which are text a decode must keep.
    `▁` runs are matched in the normalized text, where the spaces they stand for have become `▁`.
    """
    control, user_defined = [], []
    for token, token_type in zip(tokens, token_types or [_NORMAL] * len(tokens), strict=True):
        if token_type == _CONTROL:
            control.append(AddedToken(token, special=True, normalized=False))
        elif token_type == _USER_DEFINED:
            normalized = bool(token) and not token.strip("▁")
            user_defined.append(AddedToken(token, special=False, normalized=normalized))
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)


def _config_token_id(
    backend: tokenizers.Tokenizer, token: str | Mapping[str, Any] | None
) -> int | None:
    """tokenizer_config.json spells a token as its text or as an AddedToken dict."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def _read_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """`chat_template.jinja` wins over the config entry, as in transformers."""
    template_file = path / "chat_template.jinja"
    if template_file.exists():
        return template_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template
