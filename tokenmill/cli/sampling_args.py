"""The sampling flags of the commands that generate text, and the SamplingParams they make."""

from __future__ import annotations

import argparse

from tokenmill.sampling.params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.7)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--seed", type=int, default=None)


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.seed,
    )
