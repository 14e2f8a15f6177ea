"""`tokenmill router calibrate`: both models answer the routing set (greedy), each answer is
graded, and every policy's accuracy is traced against its share of large-model calls.

- cascade: every threshold between the small model's observed confidences;
- classifier: 2-fold cross-validated, so no prompt is scored by a classifier trained on it;
- random: the expected accuracy at each share, (1 - p) * small + p * large.

The cost saved is RouteLLM's measure: 1 - the least large-model share at which a policy
reaches the large model's accuracy (None when it never does), also at 50% and 80% of the gap
between the two models. Calls are not the whole cost: each model's measured seconds per prompt
(`small_cost_s`, `large_cost_s` in the records) price a policy's mix, where the cascade pays for
the small model on every prompt; `compute_saved_at_large` is 1 - that price over the large
model's alone, at the least share that reaches the large model's accuracy.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

import numpy as np

from tokenmill.gateway.classifier import train_classifier
from tokenmill.gateway.confidence import confidence
from tokenmill.gateway.embedding import packaged_embedder
from tokenmill.gateway.router_data import STOP, Item
from tokenmill.llm import LLM
from tokenmill.sampling.params import SamplingParams

RESULTS = files("tokenmill.gateway") / "data" / "router_results.jsonl"
"""`router calibrate`'s records of the packaged pair: SmolLM2 with NF4 weights (small), SmolLM2
with its float weights (large); docs/routing-and-caching.md."""


def run_models(
    items: Sequence[Item],
    small: str,
    large: str,
    max_tokens: int = 16,
    small_args: Mapping[str, object] | None = None,
    large_args: Mapping[str, object] | None = None,
) -> list[dict]:
    """One record per item: each model's answer and correctness, the small one's confidence,
    and each model's mean seconds per prompt over the whole set (one batch; the model's cost).
    `small_args`, `large_args`: each model's engine flags (e.g. a quantization)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=[STOP], logprobs=0)
    prompts = [item.prompt for item in items]
    answers, cost_s = {}, {}
    for role, model, args in (("small", small, small_args), ("large", large, large_args)):
        llm = LLM(model=model, **{"kv_cache_memory": "256MiB", **(args or {})})
        llm.generate(
            prompts[:2], params, use_tqdm=False
        )  # warm: first-call costs are not a model's
        start = time.perf_counter()
        answers[role] = llm.generate(prompts, params, use_tqdm=False)
        cost_s[role] = (time.perf_counter() - start) / len(prompts)
        del llm
    records = []
    for item, s, g in zip(items, answers["small"], answers["large"], strict=True):
        records.append(
            {
                "kind": item.kind,
                "question": item.question,
                "answers": list(item.answers),
                "small_answer": s.outputs[0].text,
                "large_answer": g.outputs[0].text,
                "small_correct": item.grade(s.outputs[0].text),
                "large_correct": item.grade(g.outputs[0].text),
                "small_mean_logprob": confidence(s, "mean"),
                "small_min_logprob": confidence(s, "min"),
                "small_cost_s": cost_s["small"],
                "large_cost_s": cost_s["large"],
            }
        )
    return records


def needs_large(record: dict) -> bool:
    return not record["small_correct"] and record["large_correct"]


def cascade_curve(records: Sequence[dict], metric: str) -> list[dict]:
    conf = np.array([r[f"small_{metric}_logprob"] for r in records])
    small = np.array([r["small_correct"] for r in records])
    large = np.array([r["large_correct"] for r in records])
    cuts = np.unique(conf)
    thresholds = [float(cuts[0]) - 1.0, *((cuts[:-1] + cuts[1:]) / 2).tolist(), 0.0]
    rows = []
    for t in thresholds:
        escalate = conf < t
        accuracy = np.where(escalate, large, small).mean()
        rows.append({"threshold": t, "large_share": escalate.mean(), "accuracy": accuracy})
    return [{k: float(v) for k, v in row.items()} for row in rows]


def classifier_curve(records: Sequence[dict], folds: int = 2, seed: int = 0) -> list[dict]:
    """Scores from classifiers that never saw the question they score (empty when a fold
    holds one label only: nothing to learn)."""
    embedder = packaged_embedder()
    order = np.random.default_rng(seed).permutation(len(records))
    scores = np.zeros(len(records))
    for fold in range(folds):
        test = order[fold::folds]
        train = np.setdiff1d(order, test)
        labels = [needs_large(records[i]) for i in train]
        if len(set(labels)) < 2:
            return []
        clf = train_classifier([records[i]["question"] for i in train], labels, embedder)
        scores[test] = clf.prob_large([records[i]["question"] for i in test])
    small = np.array([r["small_correct"] for r in records])
    large = np.array([r["large_correct"] for r in records])
    rows = []
    for t in [*np.unique(scores).tolist(), 1.01]:
        to_large = scores >= t
        rows.append(
            {
                "threshold": float(t),
                "large_share": float(to_large.mean()),
                "accuracy": float(np.where(to_large, large, small).mean()),
            }
        )
    return rows


def random_curve(records: Sequence[dict], steps: int = 10) -> list[dict]:
    small = float(np.mean([r["small_correct"] for r in records]))
    large = float(np.mean([r["large_correct"] for r in records]))
    return [
        {"threshold": p, "large_share": p, "accuracy": (1 - p) * small + p * large}
        for p in np.linspace(0, 1, steps + 1).tolist()
    ]


def share_to_reach(curve: Sequence[dict], accuracy: float) -> float | None:
    shares = [row["large_share"] for row in curve if row["accuracy"] >= accuracy - 1e-9]
    return min(shares) if shares else None


def relative_cost(policy: str, large_share: float, small_over_large: float) -> float:
    """A policy's compute at a large-model share, over the large model's alone: the cascade
    runs the small model on every prompt, the others on the prompts they keep."""
    small_runs = 1.0 if policy.startswith("cascade") else 1.0 - large_share
    return small_runs * small_over_large + large_share


def summary(records: Sequence[dict]) -> dict:
    small = float(np.mean([r["small_correct"] for r in records]))
    large = float(np.mean([r["large_correct"] for r in records]))
    costs = [(r.get("small_cost_s"), r.get("large_cost_s")) for r in records]
    priced = all(s is not None and g for s, g in costs)
    small_over_large = float(np.mean([s / g for s, g in costs])) if priced else None
    curves = {
        "cascade-mean": cascade_curve(records, "mean"),
        "cascade-min": cascade_curve(records, "min"),
        "classifier": classifier_curve(records),
        "random": random_curve(records),
    }
    policies = {}
    for name, curve in curves.items():
        if not curve:
            continue
        policies[name] = {"curve": curve, "best_accuracy": max(r["accuracy"] for r in curve)}
        for label, target in (
            ("large", large),
            ("gap80", small + 0.8 * (large - small)),
            ("gap50", small + 0.5 * (large - small)),
        ):
            share = share_to_reach(curve, target)
            policies[name][f"share_at_{label}"] = share
            policies[name][f"saved_at_{label}"] = None if share is None else 1 - share
        share = policies[name]["share_at_large"]
        policies[name]["compute_saved_at_large"] = (
            None
            if share is None or small_over_large is None
            else 1 - relative_cost(name, share, small_over_large)
        )
    return {
        "num_items": len(records),
        "small_accuracy": small,
        "large_accuracy": large,
        "small_over_large_cost": small_over_large,
        "policies": policies,
    }


def table(result: dict) -> str:
    def pct(value: float | None) -> str:
        return "  never" if value is None else f"{value:>7.0%}"

    ratio = result.get("small_over_large_cost")
    lines = [
        f"{result['num_items']} prompts: small accuracy {result['small_accuracy']:.1%}, "
        f"large accuracy {result['large_accuracy']:.1%}"
        + ("" if ratio is None else f"; a small call costs {ratio:.2f} of a large one"),
        "policy        best acc  saved@large  saved@80%gap  saved@50%gap  compute saved@large",
        "-" * 85,
    ]
    for name, p in result["policies"].items():
        lines.append(
            f"{name:<12}  {p['best_accuracy']:>8.1%}  {pct(p['saved_at_large']):>11}  "
            f"{pct(p['saved_at_gap80']):>12}  {pct(p['saved_at_gap50']):>12}  "
            f"{pct(p.get('compute_saved_at_large')):>19}"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, p in result["policies"].items():
        curve = sorted(p["curve"], key=lambda r: r["large_share"])
        ax.plot([r["large_share"] for r in curve], [r["accuracy"] for r in curve], label=name)
    ax.axhline(result["large_accuracy"], color="grey", linestyle=":", label="large model")
    ax.set_xlabel("share of requests sent to the large model")
    ax.set_ylabel("accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_records(records: Sequence[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def read_records(path: str | Path | Traversable) -> list[dict]:
    text = path.read_text() if isinstance(path, Traversable) else Path(path).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]
