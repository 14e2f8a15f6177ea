"""Benchmark workloads: the same token ids on every engine, so numbers compare."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int] | None
    prompt: str | None
    max_tokens: int
    # The index of the request that must finish before this one is sent (a chat session's
    # previous turn); None: sent at the start.
    after: int | None = None

    @property
    def prompt_input(self) -> str | list[int]:
        """The prompt as both LLMEngine.add_request and an OpenAI `prompt` field take it."""
        return self.prompt if self.prompt is not None else list(self.prompt_token_ids or [])


def random_token_ids(rng: random.Random, count: int) -> list[int]:
    """Ids drawn from the range every workload uses: clear of special tokens in small vocabs."""
    return [rng.randrange(100, 49000) for _ in range(count)]


def random_requests(
    seed: int, count: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int]
) -> list[BenchRequest]:
    """Per request, in this order: a prompt length, its ids, then max_tokens (both inclusive)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt = random_token_ids(rng, rng.randint(*prompt_len))
        requests.append(BenchRequest(prompt, None, rng.randint(*max_tokens)))
    return requests


@dataclass(frozen=True)
class RequestShape:
    """A kind of request: its prompt length and max_tokens ranges, both inclusive."""

    prompt_len: tuple[int, int]
    max_tokens: tuple[int, int]


def mixed_requests(
    seed: int, count: int, short: RequestShape, long: RequestShape, long_share: float
) -> list[BenchRequest]:
    """Short and long requests interleaved at random, `long_share` of them long on average.
    Per request, in this order: which kind, a prompt length, its ids, then max_tokens."""
    if not 0 <= long_share <= 1:
        raise ValueError(f"long_share must be between 0 and 1, got {long_share}")
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        shape = long if rng.random() < long_share else short
        prompt = random_token_ids(rng, rng.randint(*shape.prompt_len))
        requests.append(BenchRequest(prompt, None, rng.randint(*shape.max_tokens)))
    return requests


def batch64() -> list[BenchRequest]:
    """64 random-token prompts of 32-256 tokens, each generating 32-256 tokens."""
    return random_requests(1, 64, (32, 256), (32, 256))


def single() -> list[BenchRequest]:
    """One 32-token prompt generating 128 tokens: single-stream decode speed."""
    return [BenchRequest(random_token_ids(random.Random(0), 32), None, 128)]


PASSAGE = (
    "The old lighthouse stood at the end of the harbour wall for more than a century. Its "
    "keeper climbed the one hundred and twelve steps every evening to light the lamp, and every "
    "morning he climbed them again to put it out. Ships coming home in the dark looked for its "
    "slow white flash, two seconds on and eight seconds off, and knew that the rocks lay to the "
    "north. When the harbour closed, the town kept the lighthouse as a museum, and children now "
    "climb the same steps to look out over the sea."
)


def chatml(user: str) -> str:
    """A one-turn prompt in the default model's (SmolLM2's) chat template."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def rewrite() -> list[BenchRequest]:
    """Single stream, input-grounded: copy a 95-word passage (where prompt lookup shines)."""
    prompt = chatml(f"Repeat the following passage exactly, word for word.\n\n{PASSAGE}")
    return [BenchRequest(None, prompt, 100)]


def chat() -> list[BenchRequest]:
    """Single stream, open-ended: an everyday question the prompt holds no answer to."""
    return [BenchRequest(None, chatml("Explain how a refrigerator keeps food cold."), 128)]


CHAT_QUESTIONS = (
    "Explain how a refrigerator keeps food cold.",
    "Why is the sky blue?",
    "How do vaccines train the immune system?",
    "What makes bread rise?",
    "How does a bicycle stay upright?",
    "Why do we have seasons?",
    "How does a search engine find web pages?",
    "What causes thunder?",
)
REWRITE_INSTRUCTIONS = (
    "Repeat the following passage exactly, word for word.",
    "Copy this text exactly as it is written.",
    "Rewrite the passage below without changing a single word.",
    "Please reproduce the following paragraph verbatim.",
    "Type out this passage again, exactly.",
    "Echo the text below word for word.",
    "Return the following passage unchanged.",
    "Write this paragraph out again exactly as given.",
)


def chat8() -> list[BenchRequest]:
    """Eight streams at once, open-ended: `chat`'s question and seven other everyday ones."""
    return [BenchRequest(None, chatml(question), 128) for question in CHAT_QUESTIONS]


def rewrite8() -> list[BenchRequest]:
    """Eight streams at once, input-grounded: `rewrite`'s passage under eight instructions."""
    return [
        BenchRequest(None, chatml(f"{instruction}\n\n{PASSAGE}"), 100)
        for instruction in REWRITE_INSTRUCTIONS
    ]


def sessions(
    num_sessions: int = 32,
    turns: int = 4,
    system_tokens: int = 1500,
    user_tokens: int = 100,
    reply_tokens: int = 64,
    max_tokens: int = 32,
) -> list[BenchRequest]:
    """Chat sessions sharing a `system_tokens` system prompt, each with its own history growing
    by a user message and a (fixed, random) reply per turn. Turns interleave: every session's
    turn t, then every session's turn t + 1, each sent once its session's turn t finished.
    A pool too small for all sessions' histories shows what the prefix cache's tiers keep."""
    rng = random.Random(7)
    system = random_token_ids(rng, system_tokens)
    histories: list[list[int]] = [[] for _ in range(num_sessions)]
    requests = []
    for turn in range(turns):
        for index, history in enumerate(histories):
            history += random_token_ids(rng, user_tokens)
            after = None if turn == 0 else (turn - 1) * num_sessions + index
            requests.append(BenchRequest([*system, *history], None, max_tokens, after))
            history += random_token_ids(rng, reply_tokens)
    return requests


def tenants(
    num_tenants: int = 8,
    system_tokens: int = 1000,
    count: int = 256,
    user_tokens: tuple[int, int] = (32, 128),
    max_tokens: int = 32,
) -> list[BenchRequest]:
    """A multi-tenant service: `num_tenants` system prompts of `system_tokens` each, and `count`
    requests, each one tenant's (at random) system prompt plus its own user message. Sent at a
    Poisson rate (--request-rate), it shows whether routing keeps a tenant's prefix on the
    replica that cached it: the prefix hit rate, and TTFT."""
    rng = random.Random(11)
    systems = [random_token_ids(rng, system_tokens) for _ in range(num_tenants)]
    requests = []
    for _ in range(count):
        system = systems[rng.randrange(num_tenants)]
        user = random_token_ids(rng, rng.randint(*user_tokens))
        requests.append(BenchRequest([*system, *user], None, max_tokens))
    return requests


def long_prompts(
    count: int = 8, prompt_tokens: int = 3000, max_tokens: int = 64
) -> list[BenchRequest]:
    """A batch of long random-token prompts: where a sliding-window model's trimmed KV lets
    more requests run at once (compare `--no-kv-window-trimming`)."""
    rng = random.Random(11)
    return [
        BenchRequest(random_token_ids(rng, prompt_tokens), None, max_tokens) for _ in range(count)
    ]


BUILTIN_WORKLOADS = {
    "batch64": batch64,
    "single": single,
    "rewrite": rewrite,
    "chat": chat,
    "chat8": chat8,
    "rewrite8": rewrite8,
    "sessions": sessions,
    "tenants": tenants,
    "long8": long_prompts,
}


def load_workload(name: str) -> list[BenchRequest]:
    """A built-in name, or a JSONL file of {"prompt" or "prompt_token_ids", "max_tokens"}."""
    if name in BUILTIN_WORKLOADS:
        return BUILTIN_WORKLOADS[name]()
    path = Path(name)
    if not path.is_file():
        raise ValueError(
            f"workload must be one of {', '.join(BUILTIN_WORKLOADS)} or a JSONL file; "
            f"{path} does not exist"
        )
    requests = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ids, prompt, max_tokens = (
                row.get("prompt_token_ids"),
                row.get("prompt"),
                row["max_tokens"],
            )
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise ValueError(f"{path}:{number}: expected a JSON object with max_tokens") from exc
        if (ids is None) == (prompt is None):
            raise ValueError(f"{path}:{number}: give exactly one of prompt or prompt_token_ids")
        requests.append(BenchRequest(ids, prompt, int(max_tokens)))
    if not requests:
        raise ValueError(f"{path}: no requests in the workload file")
    return requests
