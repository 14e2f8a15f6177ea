"""The self-distilled corpus: the target's own answers to the chat prompts, as token ids on disk.

Generating the answers is most of what training a draft head costs, so it is done once, in
large batches through the engine, and both trainers (EAGLE and Medusa) read the same corpus.
A corpus directory holds:

- `corpus.json`: the model and the settings the answers were generated with; a run with other
  settings refuses the directory rather than mixing two corpora.
- `conversations.jsonl`: one line per finished conversation, `{"index", "token_ids",
  "num_prompt_tokens"}`, appended and flushed as each answer finishes, in no particular order.

- `features.safetensors`: the target's final hidden state at every position of every
  conversation (one forward pass each), with the token ids they belong to; the first trainer
  to need them writes them and the next reads them, while the conversations are the same.

A killed run leaves at worst a torn last line; the next run drops it and generates only the
prompts not yet answered. Raising `num_prompts` extends a corpus the same way.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenmill.engine.engine import LLMEngine
from tokenmill.model.attention import AttentionMetadata
from tokenmill.sampling.params import SamplingParams
from tokenmill.train.prompts import chat_prompts

MANIFEST = "corpus.json"
CONVERSATIONS = "conversations.jsonl"
FEATURES = "features.safetensors"


@dataclass(frozen=True)
class CorpusConfig:
    num_prompts: int = 2048
    max_tokens: int = 160  # answer length, about the chat workloads'
    sampled_every: int = 4  # every n-th prompt is answered by sampling, the rest greedily
    temperature: float = 0.7  # of the sampled answers
    seed: int = 0  # the prompts' order, and each sampled answer's seed offset

    def answer_params(self, index: int) -> SamplingParams:
        """Greedy, which is what greedy users see, except every `sampled_every`-th prompt:
        sampled, so the heads also see the target's less likely continuations."""
        sampled = self.sampled_every > 0 and index % self.sampled_every == self.sampled_every - 1
        return SamplingParams(
            temperature=self.temperature if sampled else 0.0,
            max_tokens=self.max_tokens,
            seed=self.seed * 1_000_003 + index,
        )

    def identity(self) -> dict:
        """The settings two runs must share to add to one corpus (not its size)."""
        settings = dataclasses.asdict(self)
        del settings["num_prompts"]
        return settings


def read_conversations(directory: Path) -> dict[int, list[int]]:
    """Token ids (prompt and answer) of every finished conversation, by prompt index. A torn
    last line (a killed run) is cut off the file."""
    path = directory / CONVERSATIONS
    if not path.is_file():
        return {}
    conversations: dict[int, list[int]] = {}
    good_bytes = 0
    with path.open("rb") as file:
        for line in file:
            try:
                row = json.loads(line)
                conversations[int(row["index"])] = [int(t) for t in row["token_ids"]]
            except (ValueError, KeyError, TypeError):
                break
            good_bytes += len(line)
    if good_bytes < path.stat().st_size:
        with path.open("r+b") as file:
            file.truncate(good_bytes)
    return conversations


def _check_manifest(directory: Path, model: str, config: CorpusConfig) -> None:
    manifest = directory / MANIFEST
    wanted = {"model": model, "settings": config.identity()}
    if manifest.is_file():
        found = json.loads(manifest.read_text(encoding="utf-8"))
        if found != wanted:
            raise ValueError(
                f"corpus {directory} was generated with {found}, not {wanted}; "
                "give another directory"
            )
    else:
        directory.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps(wanted, indent=1), encoding="utf-8")


def build_corpus(
    engine: LLMEngine, config: CorpusConfig, directory: Path, log: bool = False
) -> list[list[int]]:
    """The conversations of the first `config.num_prompts` prompts, in prompt order: those
    already in `directory` as they are, the rest generated now (all queued at once, so the
    engine batches up to its max_num_seqs) and appended there as they finish."""
    _check_manifest(directory, str(engine.args.model), config)
    done = read_conversations(directory)
    prompts = chat_prompts(config.num_prompts, config.seed)
    missing = [i for i in range(config.num_prompts) if i not in done]
    tokenizer = engine.tokenizer
    for index in missing:
        message = [{"role": "user", "content": prompts[index]}]
        ids = tokenizer.encode(
            tokenizer.apply_chat_template(message, True), add_special_tokens=False
        )
        engine.add_request(f"corpus-{index}", ids, config.answer_params(index))
    started, finished, tokens = time.perf_counter(), 0, 0
    with (directory / CONVERSATIONS).open("a", encoding="utf-8") as file:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if not output.finished:
                    continue
                index = int(output.request_id.removeprefix("corpus-"))
                answer = output.outputs[0].token_ids
                done[index] = [*output.prompt_token_ids, *answer]
                row = {
                    "index": index,
                    "token_ids": done[index],
                    "num_prompt_tokens": len(output.prompt_token_ids),
                }
                file.write(json.dumps(row) + "\n")
                file.flush()
                finished, tokens = finished + 1, tokens + len(answer)
                if log and finished % 64 == 0:
                    elapsed = time.perf_counter() - started
                    print(
                        f"corpus: {finished}/{len(missing)} answers, {tokens} tokens, "
                        f"{tokens / elapsed:.0f} tokens/s",
                        file=sys.stderr,
                        flush=True,
                    )
    return [done[i] for i in range(config.num_prompts)]


def target_features(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """The target's final hidden state at every position of one sequence."""
    meta = AttentionMetadata.build([len(token_ids)], [len(token_ids)], None, 16, None)
    with torch.inference_mode():
        ids = torch.tensor(token_ids, dtype=torch.long)
        hidden = model(ids, torch.arange(len(token_ids)), None, meta)
    return hidden.float().clone()  # outside inference mode: a tensor autograd may save


def corpus_features(
    model: torch.nn.Module, corpus: list[list[int]], directory: Path | None, log: bool = False
) -> list[torch.Tensor]:
    """`target_features` of every conversation: read from `directory`'s cache when it holds
    exactly these conversations, else computed (and cached there); `log` prints progress."""
    token_ids = torch.tensor([t for sequence in corpus for t in sequence], dtype=torch.int32)
    lengths = [len(sequence) for sequence in corpus]
    path = directory / FEATURES if directory is not None else None
    if path is not None and path.is_file():
        cached = load_file(str(path))
        if torch.equal(cached["token_ids"], token_ids) and cached["lengths"].tolist() == lengths:
            return list(cached["features"].split(lengths))
    features = []
    for number, sequence in enumerate(corpus, start=1):
        features.append(target_features(model, sequence))
        if log and number % 64 == 0:
            print(f"features: {number}/{len(corpus)} conversations", file=sys.stderr, flush=True)
    if path is not None:
        tensors = {
            "features": torch.cat(features),
            "token_ids": token_ids,
            "lengths": torch.tensor(lengths, dtype=torch.int64),
        }
        save_file(tensors, str(path))
    return features
