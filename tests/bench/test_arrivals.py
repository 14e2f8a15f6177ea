"""The arrivals ablation: its pieces without timing, and one quick run against real servers."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.ablate import FULL, QUICK, ArrivalsOptions
from tokenmill.bench.ablate.arrivals import (
    ArrivalPoint,
    arrivals_table,
    parse_rates,
    sustained_rate,
    verdicts,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def point(
    rate: float, met: int, requests: int = 10, failed: int = 0, scheduler: str = "static"
) -> ArrivalPoint:
    return ArrivalPoint(
        scheduler=scheduler,
        rate=rate,
        requests=requests,
        failed=failed,
        met_slos=met,
        goodput=met / 20,
        ttft_p50_s=0.25,
        ttft_p99_s=1.5 * rate,
        e2e_p50_s=2.0,
        e2e_p99_s=12.346,
        request_throughput=0.5,
        output_throughput=42.04,
    )


def test_rates_parse_to_distinct_ascending_requests_per_second():
    assert parse_rates("4, 0.5,2,1,2") == (0.5, 1.0, 2.0, 4.0)


@pytest.mark.parametrize("bad", ["0", "-1", "inf", "fast", ""])
def test_a_rate_that_is_not_finite_and_positive_is_refused(bad):
    with pytest.raises(ValueError, match="rate"):
        parse_rates(bad)


def test_sustained_rate_is_the_last_rate_before_attainment_first_drops_below_90_percent():
    points = [point(2.0, met=9), point(0.5, met=10), point(4.0, met=8), point(8.0, met=10)]
    assert sustained_rate(points) == 2.0  # 8/s met again, but 4/s already fell behind
    assert sustained_rate([point(0.5, met=8)]) == 0.0
    assert sustained_rate(points, attainment=0.8) == 8.0


def test_attainment_counts_failed_requests_as_misses():
    assert point(1.0, met=7, requests=10, failed=3).attainment == 0.7


def test_table_has_a_row_per_point_with_seconds_and_rates():
    lines = arrivals_table([point(0.5, met=10), point(4.0, met=6, failed=2)]).splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    headers = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    assert headers[:4] == ["scheduler", "rate (req/s)", "goodput (req/s)", "within SLOs"]
    cells = [cell.strip() for cell in lines[3].split("|")[1:-1]]
    assert cells == [
        *("static", "4", "0.30", "6/10 (2 failed)"),
        *("0.25 / 6.00", "2.00 / 12.35", "0.50", "42.0"),
    ]


def test_arrivals_options_refuse_unknown_or_repeated_schedulers_and_bad_objectives():
    for schedulers in [("static", "fifo"), ("static", "static"), ()]:
        with pytest.raises(ValueError, match="schedulers"):
            ArrivalsOptions(schedulers=schedulers)
    with pytest.raises(ValueError, match="tpot_slo_ms"):
        ArrivalsOptions(tpot_slo_ms=0)
    assert ArrivalsOptions().slos == {"ttft_ms": 2000.0, "tpot_ms": 100.0}


def test_sizes_take_other_rates_and_request_counts():
    sizes = FULL.with_arrivals(rates=(1.0, 3.0), requests=5)
    assert (sizes.arrival_rates, sizes.arrival_requests) == ((1.0, 3.0), 5)
    assert sizes.with_arrivals() == sizes and sizes.batch_requests == FULL.batch_requests
    with pytest.raises(ValueError, match="requests per rate"):
        FULL.with_arrivals(requests=0)


def test_full_sweep_is_the_issue_rates():
    assert FULL.arrival_rates == (0.5, 1.0, 2.0, 4.0)


def test_verdicts_compare_every_other_scheduler_with_static():
    by_scheduler = {
        "continuous": [point(r, met=10, scheduler="continuous") for r in (0.5, 1.0, 2.0)],
        "static": [point(0.5, met=9), point(1.0, met=4), point(2.0, met=0)],
        "dynamic": [point(r, met=m, scheduler="dynamic") for r, m in ((0.5, 9), (1, 9), (2, 1))],
    }
    rows = verdicts(by_scheduler, "TTFT <= 1 ms")
    assert [(r.baseline, r.candidate) for r in rows] == [
        *[("static", "continuous")] * 3,
        *[("static", "dynamic")] * 3,
    ]
    sustained, goodput, ttft = rows[:3]
    assert "within TTFT <= 1 ms" in sustained.metric
    assert (sustained.baseline_value, sustained.candidate_value) == (0.5, 2.0)
    assert (sustained.winner, sustained.margin) == ("continuous", "4.00x higher")
    assert (goodput.metric, goodput.margin) == ("goodput at 2 req/s", "higher, against 0")
    assert (ttft.metric, ttft.winner) == ("p99 TTFT at 2 req/s", "tie")  # same made-up TTFT
    assert rows[3].candidate_value == 1.0
    assert verdicts({"dynamic": by_scheduler["dynamic"]}, "TTFT <= 1 ms") == []


def test_quick_run_drives_a_real_server_at_every_rate(tokenmill_cli, tmp_path):
    """One scheduler: each server start loads the model, the slow part of the run."""
    out = tmp_path / "ablate"
    result = tokenmill_cli(
        *("bench", "ablate", "--quick", "--only", "arrivals", "--out-dir", str(out)),
        *("--schedulers", "dynamic", "--kv-cache-memory", "32MiB"),
        *("--ttft-slo-ms", "600000", "--tpot-slo-ms", "600000"),  # every request meets them
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads((out / "ablate.json").read_text())
    assert set(payload["experiments"]) == {"arrivals"}
    experiment = payload["experiments"]["arrivals"]
    assert (out / experiment["plot"]).read_bytes()[:8] == PNG_MAGIC
    points = experiment["data"]["points"]
    assert [(p["scheduler"], p["rate"]) for p in points] == [
        ("dynamic", rate) for rate in QUICK.arrival_rates
    ]
    for p in points:
        assert (p["requests"], p["failed"], p["met_slos"]) == (
            QUICK.arrival_requests,
            0,
            QUICK.arrival_requests,
        )
        assert 0 < p["ttft_p50_s"] <= p["ttft_p99_s"] <= p["e2e_p99_s"]
        assert p["output_throughput"] > 0
    top = max(QUICK.arrival_rates)
    assert experiment["data"]["sustained_rate"] == {"dynamic": top}
    assert experiment["data"]["options"]["schedulers"] == ["dynamic"]
    assert payload["rows"] == []  # nothing to compare it with
    table = (out / "ablate.md").read_text()
    assert table.strip() in result.stdout
    grid = table.split("arrivals:")[1].strip().splitlines()
    assert len(grid) == 2 + len(points) and grid[2].startswith("| dynamic ")
