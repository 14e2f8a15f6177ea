"""`tokenmill bench ablate`: each technique off and on, one table, PNG plots and JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.cli.engine_args import add_engine_args, engine_args_from


def add_parser(kinds: argparse._SubParsersAction) -> None:
    ablate = kinds.add_parser(
        "ablate", help="each technique off and on: one table, PNG plots and JSON"
    )
    ablate.add_argument("--out-dir", default="bench_out/ablate")
    ablate.add_argument(
        "--quick", action="store_true", help="tiny sizes: seconds instead of ~15 minutes"
    )
    ablate.add_argument(
        "--only",
        default=None,
        help="comma-separated: kv-cache,batching,prefix-caching,chunked-prefill,kv-memory,"
        "speculative,speculative-batch,decode-loop,prepacked-weights; and arrivals, which "
        "runs only when named here",
    )
    _add_arrivals_args(ablate)
    add_engine_args(ablate)
    ablate.set_defaults(func=run)


def _add_arrivals_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "arrivals (--only arrivals): `tokenmill serve` per scheduler under Poisson arrivals"
    )
    group.add_argument(
        "--rates", default=None, help="requests/s to offer, e.g. 0.5,1,2,4 (the default)"
    )
    group.add_argument(
        "--requests-per-rate", type=int, default=None, help="requests sent at each rate (30)"
    )
    group.add_argument(
        "--schedulers",
        default="static,dynamic,continuous",
        help="one server each; the others are compared with static",
    )
    group.add_argument(
        "--ttft-slo-ms", type=float, default=2000.0, help="goodput: TTFT at most this"
    )
    group.add_argument(
        "--tpot-slo-ms", type=float, default=100.0, help="goodput: TPOT at most this"
    )
    group.add_argument("--arrivals-seed", type=int, default=0, help="of arrivals and prompts")


def run(ns: argparse.Namespace) -> int:
    from tokenmill.bench.ablate import FULL, QUICK, ArrivalsOptions, run_ablate
    from tokenmill.bench.ablate.arrivals import parse_rates

    sizes = QUICK if ns.quick else FULL
    if ns.rates is not None:
        sizes = sizes.with_arrivals(rates=parse_rates(ns.rates))
    if ns.requests_per_rate is not None:
        sizes = sizes.with_arrivals(requests=ns.requests_per_rate)
    arrivals = ArrivalsOptions(
        schedulers=tuple(s.strip() for s in ns.schedulers.split(",") if s.strip()),
        ttft_slo_ms=ns.ttft_slo_ms,
        tpot_slo_ms=ns.tpot_slo_ms,
        seed=ns.arrivals_seed,
    )
    only = ns.only.split(",") if ns.only else None
    report = run_ablate(engine_args_from(ns), sizes, Path(ns.out_dir), only, arrivals)
    print(report.table())
    print(f"wrote ablate.md, ablate.json and the plots to {ns.out_dir}", file=sys.stderr)
    return 0
