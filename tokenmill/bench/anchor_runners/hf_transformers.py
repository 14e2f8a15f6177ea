"""HF transformers anchor: `generate` over static batches, greedy, every request padded on the
left to its batch's longest prompt and run to its batch's largest max_tokens (the waste a
static batch pays is part of what it measures). Only the tokens each request asked for count.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import transformers
from runner_io import load_workload, parse_args, write_result


def generate_batch(model: Any, batch: list[dict[str, Any]]) -> None:
    longest = max(len(r["prompt_token_ids"]) for r in batch)
    pad = [longest - len(r["prompt_token_ids"]) for r in batch]
    input_ids = torch.tensor(
        [[0] * p + r["prompt_token_ids"] for p, r in zip(pad, batch, strict=True)]
    )
    attention_mask = torch.tensor([[0] * p + [1] * (longest - p) for p in pad])
    new_tokens = max(r["max_tokens"] for r in batch)
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # ignore EOS, like every engine in the comparison
            do_sample=False,
            pad_token_id=0,
        )


def main() -> None:
    args = parse_args(__doc__ or "")
    torch.set_num_threads(args.threads)
    name, requests = load_workload(args.workload)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=getattr(torch, args.dtype)
    )
    model.eval()
    generate_batch(model, [{**requests[0], "max_tokens": 2}])  # warm-up
    start = time.perf_counter()
    for first in range(0, len(requests), args.batch_size):
        generate_batch(model, requests[first : first + args.batch_size])
    elapsed = time.perf_counter() - start
    write_result(
        args.out,
        "transformers",
        transformers.__version__,
        name,
        requests,
        sum(r["max_tokens"] for r in requests),
        elapsed,
        f"{args.dtype}, static batches of {args.batch_size}, threads={args.threads}",
    )


if __name__ == "__main__":
    main()
