"""Ablate experiment on batching under arrivals: `tokenmill serve` under each scheduler, driven
by `bench serve` with Poisson arrivals at rising rates.

An offline batch shows throughput, where continuous batching gains little on a compute-bound
CPU; what it buys is latency under load: a request that arrives while others run starts at the
next step instead of after the running batch. Each scheduler gets a server of its own (the
other engine flags alike) and, at each rate, the same mixed short and long requests at the
same arrival times. A request counts toward goodput if it meets both the TTFT and the TPOT
objective.
"""

from __future__ import annotations

import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tokenmill.bench.ablate.context import AblateContext, Experiment
from tokenmill.bench.ablate.sizes import AblateSizes
from tokenmill.bench.comparison import Comparison
from tokenmill.bench.plots import panel_plot
from tokenmill.bench.report import markdown_table
from tokenmill.bench.serve import ServeConfig, ServeResult, run_serve
from tokenmill.bench.tokenmill_server import running_tokenmill_server
from tokenmill.bench.workloads import BenchRequest, mixed_requests

ATTAINMENT = 0.9  # a rate is sustained while this share of its requests meets the objectives
TECHNIQUE = "batching under arrivals"


@dataclass(frozen=True)
class ArrivalPoint:
    """One scheduler at one offered rate, as its clients saw it (seconds, requests/s)."""

    scheduler: str
    rate: float
    requests: int
    failed: int
    met_slos: int
    goodput: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    request_throughput: float
    output_throughput: float  # tokens/s

    @classmethod
    def of(cls, scheduler: str, rate: float, result: ServeResult) -> ArrivalPoint:
        return cls(
            scheduler=scheduler,
            rate=rate,
            requests=result.num_requests,
            failed=result.failed,
            met_slos=result.goodput_requests or 0,
            goodput=result.goodput or 0.0,
            ttft_p50_s=result.ttft_ms.p50 / 1000,
            ttft_p99_s=result.ttft_ms.p99 / 1000,
            e2e_p50_s=result.e2el_ms.p50 / 1000,
            e2e_p99_s=result.e2el_ms.p99 / 1000,
            request_throughput=result.request_throughput,
            output_throughput=result.output_throughput,
        )

    @property
    def attainment(self) -> float:
        """The share of the requests sent that met every objective."""
        return self.met_slos / self.requests if self.requests else 0.0


def parse_rates(text: str) -> tuple[float, ...]:
    """`0.5,1,2,4` -> the offered rates in requests/s, ascending, each finite and > 0."""
    rates: set[float] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            rate = float(part)
        except ValueError as exc:
            raise ValueError(f"rates must be numbers of requests/s, got {part!r}") from exc
        if not 0 < rate < math.inf:
            raise ValueError(f"rates must be finite and > 0 requests/s, got {part!r}")
        rates.add(rate)
    if not rates:
        raise ValueError("rates needs at least one request rate, e.g. 0.5,1,2,4")
    return tuple(sorted(rates))


def sustained_rate(points: list[ArrivalPoint], attainment: float = ATTAINMENT) -> float:
    """The highest offered rate up to which every rate swept had at least `attainment` of its
    requests within the objectives; 0 if the lowest rate already had fewer."""
    sustained = 0.0
    for point in sorted(points, key=lambda p: p.rate):
        if point.attainment < attainment:
            break
        sustained = point.rate
    return sustained


def arrivals_table(points: list[ArrivalPoint]) -> str:
    """One row per scheduler and rate, in the order given."""
    headers = [
        "scheduler",
        "rate (req/s)",
        "goodput (req/s)",
        "within SLOs",
        "TTFT p50 / p99 (s)",
        "E2E p50 / p99 (s)",
        "throughput (req/s)",
        "output tok/s",
    ]
    rows = [
        [
            p.scheduler,
            f"{p.rate:g}",
            f"{p.goodput:.2f}",
            f"{p.met_slos}/{p.requests}" + (f" ({p.failed} failed)" if p.failed else ""),
            f"{p.ttft_p50_s:.2f} / {p.ttft_p99_s:.2f}",
            f"{p.e2e_p50_s:.2f} / {p.e2e_p99_s:.2f}",
            f"{p.request_throughput:.2f}",
            f"{p.output_throughput:.1f}",
        ]
        for p in points
    ]
    return markdown_table(headers, rows)


def workload(sizes: AblateSizes, seed: int) -> list[BenchRequest]:
    return mixed_requests(
        seed,
        sizes.arrival_requests,
        sizes.arrival_short,
        sizes.arrival_long,
        sizes.arrival_long_share,
    )


def arrivals(ctx: AblateContext) -> Experiment:
    sizes, options = ctx.sizes, ctx.arrivals
    points = sweep(ctx)
    by_scheduler = {s: [p for p in points if p.scheduler == s] for s in options.schedulers}
    slos = f"TTFT <= {options.ttft_slo_ms:g} ms and TPOT <= {options.tpot_slo_ms:g} ms"
    plot = panel_plot(
        ctx.out_dir / "arrivals_goodput_ttft.png",
        f"{sizes.arrival_requests} mixed requests per rate, Poisson arrivals; goodput: {slos}",
        "offered rate (requests/s)",
        {
            "goodput (requests/s)": {
                "offered rate": (list(sizes.arrival_rates), list(sizes.arrival_rates)),
                **_series(by_scheduler, lambda p: p.goodput),
            },
            "p99 TTFT (s)": _series(by_scheduler, lambda p: p.ttft_p99_s),
        },
        references=("offered rate",),
        log_x=len(sizes.arrival_rates) > 1,
    )
    data = {
        "options": options,  # schedulers, objectives, seed
        "slos": options.slos,
        "attainment": ATTAINMENT,
        "rates": sizes.arrival_rates,
        "sustained_rate": {s: sustained_rate(ps) for s, ps in by_scheduler.items()},
        "points": points,
    }
    return Experiment(verdicts(by_scheduler, slos), data, plot, arrivals_table(points))


def sweep(ctx: AblateContext) -> list[ArrivalPoint]:
    """Each scheduler's server, the rates in turn from the lowest. Every rate has a seed of its
    own for prompts and arrivals (the same for every scheduler), so no rate finds the previous
    one's prompts in the prefix cache."""
    sizes, options = ctx.sizes, ctx.arrivals
    points: list[ArrivalPoint] = []
    for scheduler in options.schedulers:
        args = replace(ctx.base, scheduler=scheduler)
        with (
            tempfile.TemporaryDirectory() as scratch,
            running_tokenmill_server(args, Path(scratch) / "serve.log") as base_url,
        ):
            for index, rate in enumerate(sizes.arrival_rates):
                seed = options.seed + index
                config = ServeConfig(base_url, request_rate=rate, seed=seed, goodput=options.slos)
                result = run_serve(config, workload(sizes, seed))
                point = ArrivalPoint.of(scheduler, rate, result)
                points.append(point)
                print(
                    f"arrivals: {scheduler} at {rate:g} req/s: {point.met_slos}/"
                    f"{point.requests} within SLOs, p99 TTFT {point.ttft_p99_s:.2f} s"
                    + (f"; first error: {result.first_error}" if result.first_error else ""),
                    file=sys.stderr,
                )
    return points


def _series(
    by_scheduler: dict[str, list[ArrivalPoint]], value: Callable[[ArrivalPoint], float]
) -> dict[str, tuple[list[float], list[float]]]:
    """One line per scheduler: `value` of its points against their rates."""
    return {
        f"scheduler={s}": ([p.rate for p in points], [value(p) for p in points])
        for s, points in by_scheduler.items()
    }


def verdicts(by_scheduler: dict[str, list[ArrivalPoint]], slos: str) -> list[Comparison]:
    """Each other scheduler against static (or the first one named): the rate it sustains, and
    goodput and p99 TTFT at the highest rate. Every scheduler's points are in ascending rate."""
    sustained = {name: sustained_rate(points) for name, points in by_scheduler.items()}
    names = list(by_scheduler)
    baseline = "static" if "static" in names else names[0]
    rows = []
    for candidate in (n for n in names if n != baseline):
        base_top, cand_top = by_scheduler[baseline][-1], by_scheduler[candidate][-1]
        top = f"{base_top.rate:g} req/s"
        rows += [
            Comparison(
                TECHNIQUE,
                f"highest rate with {ATTAINMENT:.0%} of requests within {slos}",
                "req/s",
                baseline,
                sustained[baseline],
                candidate,
                sustained[candidate],
                higher_is_better=True,
            ),
            Comparison(
                TECHNIQUE,
                f"goodput at {top}",
                "req/s",
                baseline,
                base_top.goodput,
                candidate,
                cand_top.goodput,
                higher_is_better=True,
            ),
            Comparison(
                TECHNIQUE,
                f"p99 TTFT at {top}",
                "s",
                baseline,
                base_top.ttft_p99_s,
                candidate,
                cand_top.ttft_p99_s,
                higher_is_better=False,
            ),
        ]
    return rows
