"""`tokenmill router calibrate` and `tokenmill router train`: measure the routing policies on the
auto-graded set (tokenmill/gateway/router_data.py), and train the routing classifier."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenmill.config import QUANTIZATION_METHODS


def add_parser(commands: argparse._SubParsersAction) -> None:
    router = commands.add_parser("router", help="calibrate routing policies; train the classifier")
    actions = router.add_subparsers(dest="router_command", required=True)
    calibrate = actions.add_parser(
        "calibrate", help="accuracy against large-model share for cascade, classifier, random"
    )
    calibrate.add_argument("--small", default="smollm2-135m-instruct")
    calibrate.add_argument(
        "--small-quantization",
        choices=QUANTIZATION_METHODS,
        default="nf4",
        help="the small model's weights (default nf4: the cheap, lossy configuration)",
    )
    calibrate.add_argument("--large", default="smollm2-135m-instruct")
    calibrate.add_argument(
        "--large-quantization",
        choices=QUANTIZATION_METHODS,
        default="none",
        help="the large model's weights (default none: the float weights, the strong one)",
    )
    calibrate.add_argument("--max-tokens", type=int, default=16)
    calibrate.add_argument(
        "--results",
        default=None,
        help="reuse a results.jsonl from an earlier run instead of running the models",
    )
    calibrate.add_argument("--out-dir", default="router-calibration")
    calibrate.set_defaults(func=run_calibrate)
    train = actions.add_parser("train", help="train the classifier on calibration results")
    train.add_argument(
        "--results",
        default=None,
        help="results.jsonl from `router calibrate` (default: the packaged run, SmolLM2 NF4 / "
        "float)",
    )
    train.add_argument("--out", default="router-classifier.json")
    train.set_defaults(func=run_train)


def run_calibrate(ns: argparse.Namespace) -> int:
    from tokenmill.gateway import calibration
    from tokenmill.gateway.router_data import routing_items

    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if ns.results:
        records = calibration.read_records(ns.results)
    else:
        records = calibration.run_models(
            routing_items(),
            ns.small,
            ns.large,
            ns.max_tokens,
            {"quantization": ns.small_quantization},
            {"quantization": ns.large_quantization},
        )
        calibration.write_records(records, out / "results.jsonl")
    result = calibration.summary(records)
    (out / "curves.json").write_text(json.dumps(result, indent=1))
    calibration.plot(result, out / "curves.png")
    print(calibration.table(result))
    print(f"wrote {'' if ns.results else 'results.jsonl, '}curves.json, curves.png in {out}")
    return 0


def run_train(ns: argparse.Namespace) -> int:
    from tokenmill.gateway.calibration import RESULTS, needs_large, read_records
    from tokenmill.gateway.classifier import train_classifier
    from tokenmill.gateway.embedding import packaged_embedder

    records = read_records(ns.results or RESULTS)
    labels = [needs_large(r) for r in records]
    classifier = train_classifier([r["question"] for r in records], labels, packaged_embedder())
    classifier.save(ns.out)
    print(f"trained on {len(records)} questions ({sum(labels)} need the large model): {ns.out}")
    return 0
