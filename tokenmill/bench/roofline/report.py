"""The roofline report: each op class's time and share of the run, its achieved rate and that
rate's share of the machine's roof, as a table, JSON and a PNG.

A class's roof is the roofline's: its arithmetic intensity (operations per byte) times the
memory roof (DRAM bandwidth, or the cache's where one step's reads fit in it), capped by the
compute rate of its dtype. Below the ridge it is memory-bound and its
rate is in GB/s against the bandwidth; above it, compute-bound, in GFLOP/s against the dtype's
product rate. Classes that only move bytes (KV stores, norms) are memory-bound; sampling and
host time have no rate. "Time over the roof" is what a class would save running at its roof:
the gaps worth closing first.

The whole run is set against the same roofs three ways: its products' work at their dtypes'
rates (the bound a batch's compute sets), every byte it reads at the memory roof (the bound a
single stream's weight reads set), and every class at its own roof.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from tokenmill.bench.report import markdown_table, write_json
from tokenmill.bench.roofline.op_classes import CLASS_ORDER, HOST, PRODUCTS, PROFILER
from tokenmill.bench.roofline.probe import Ceilings
from tokenmill.bench.roofline.profile import ClassTime, Profile

LABEL_MIN_SHARE = 0.01  # the roofline plot names the dots of at least this share of the time
MEMORY = "memory"
COMPUTE = "compute"


@dataclass(frozen=True)
class ClassRow:
    """One class of the report, assessed against the machine's roof."""

    op_class: str
    label: str
    seconds: float
    share: float  # of the profiled run's time
    calls: int
    bound: str  # memory, compute, or "" (no rate)
    rate: float  # GB/s when memory-bound, GFLOP/s when compute-bound
    roof: float  # in the rate's unit
    gflops_per_s: float
    gbytes_per_s: float

    @property
    def unit(self) -> str:
        return {MEMORY: "GB/s", COMPUTE: "GFLOP/s"}.get(self.bound, "")

    @property
    def roof_share(self) -> float | None:
        return self.rate / self.roof if self.roof else None

    @property
    def over_roof_s(self) -> float:
        """Time above what the class would take at its roof (all of it without a rate)."""
        share = self.roof_share
        return self.seconds if share is None else self.seconds * max(0.0, 1 - share)


def assess(entry: ClassTime, ceilings: Ceilings, total_s: float) -> ClassRow:
    """`entry` against the roofline of `ceilings`."""
    seconds = entry.seconds
    gflops = entry.flops / seconds / 1e9 if seconds else 0.0
    gbytes = entry.bytes / seconds / 1e9 if seconds else 0.0
    bandwidth = ceilings.memory_gbps
    compute = ceilings.compute_gflops(entry.roof_dtype) if entry.flops else 0.0
    bound, rate, roof = "", 0.0, 0.0
    if (
        entry.flops
        and compute
        and (not entry.bytes or entry.flops / entry.bytes * bandwidth >= compute)
    ):
        bound, rate, roof = COMPUTE, gflops, compute
    elif entry.bytes and seconds:
        bound, rate, roof = MEMORY, gbytes, bandwidth
    share = seconds / total_s if total_s else 0.0
    return ClassRow(
        entry.op_class, entry.label, seconds, share, entry.calls, bound, rate, roof, gflops, gbytes
    )


@dataclass(frozen=True)
class RunBounds:
    """The whole run's time against the roofs: `seconds` (unprofiled where it ran) and what
    its products' FLOPs, its bytes, and every class would take at their roofs."""

    seconds: float
    products_s: float
    bytes_s: float
    classes_s: float

    def share(self, bound_s: float) -> float:
        """The run's rate as a share of the bound's (1: at the roof)."""
        return bound_s / self.seconds if self.seconds else 0.0


@dataclass
class RooflineReport:
    ceilings: Ceilings
    profile: Profile

    def rows(self) -> list[ClassRow]:
        """Every class, in CLASS_ORDER and by time within a class, the profiler's own time and
        host time last."""
        total = self.profile.profiled_s
        order = {name: i for i, name in enumerate((*CLASS_ORDER, PROFILER, HOST))}
        rows = [assess(entry, self.ceilings, total) for entry in self.profile.classes]
        return sorted(rows, key=lambda r: (order.get(r.op_class, len(order)), -r.seconds))

    def class_totals(self) -> dict[str, float]:
        """Seconds per class (labels summed), in report order."""
        totals: dict[str, float] = {}
        for row in self.rows():
            totals[row.op_class] = totals.get(row.op_class, 0.0) + row.seconds
        return totals

    def bounds(self) -> RunBounds:
        profile, ceilings = self.profile, self.ceilings
        products_s = 0.0
        for entry in profile.classes:
            compute = ceilings.compute_gflops(entry.roof_dtype) if entry.flops else 0.0
            if entry.op_class == PRODUCTS and compute:
                products_s += entry.flops / compute / 1e9
        total_bytes = sum(entry.bytes for entry in profile.classes)
        bytes_s = total_bytes / ceilings.memory_gbps / 1e9 if ceilings.memory_gbps else 0.0
        classes_s = sum(row.seconds - row.over_roof_s for row in self.rows())
        seconds = profile.unprofiled_s or profile.profiled_s
        return RunBounds(seconds, products_s, bytes_s, classes_s)

    def biggest_gaps(self, count: int = 3) -> list[ClassRow]:
        """The engine's: the profiler's own time is no gap a user could close."""
        rows = [row for row in self.rows() if row.op_class != PROFILER]
        return sorted(rows, key=lambda r: -r.over_roof_s)[:count]

    def table(self) -> str:
        profile = self.profile
        total = profile.profiled_s or 1.0
        engine = ", ".join(f"{k} {v}" for k, v in profile.engine.items() if v is not None)
        by_class = ", ".join(f"{name} {s / total:.1%}" for name, s in self.class_totals().items())
        paths = ", ".join(
            f"{path} {count} ({profile.step_seconds.get(path, 0.0):.2f} s)"
            for path, count in profile.steps.items()
        )
        totals = f"total: profiled {profile.profiled_s:.2f} s"
        if profile.unprofiled_s and profile.overhead is not None:
            totals += f", unprofiled {profile.unprofiled_s:.2f} s ({profile.overhead:+.1%})"
        gaps = "; ".join(f"{_name(r)} {r.over_roof_s:.2f} s" for r in self.biggest_gaps())
        b = self.bounds()
        against = (
            f"the run ({b.seconds:.2f} s) against its roofs: products at their rates "
            f"{b.products_s:.2f} s ({b.share(b.products_s):.0%}); every byte at "
            f"{self.ceilings.memory_gbps:.1f} GB/s {b.bytes_s:.2f} s ({b.share(b.bytes_s):.0%}); "
            f"every class at its roof {b.classes_s:.2f} s ({b.share(b.classes_s):.0%})"
        )
        return "\n".join(
            [
                f"roofline: workload {profile.workload}; {engine}",
                self.ceilings_table(),
                "",
                self.classes_table(),
                "",
                f"by class: {by_class}",
                f"steps by path: {paths}",
                f"{totals}; {profile.output_tokens} output tokens",
                f"biggest gaps (time over the roof): {gaps}",
                against,
                *(f"note: {note}" for note in self.ceilings.notes),
            ]
        )

    def ceilings_table(self) -> str:
        c = self.ceilings
        head = (
            f"machine: {c.threads} threads, {c.cpu_capability}, "
            f"{' '.join(c.cpu_features) or 'features unknown'}, kernels {c.kernels}; "
            f"DRAM read {c.dram_read_gbps:.1f} GB/s"
        )
        if c.step_read_gbps:
            head += (
                f"; a step's reads ({c.step_read_bytes / 2**20:.0f} MiB, the memory roof) "
                f"{c.step_read_gbps:.1f} GB/s"
            )
        rows = [
            [
                r.dtype,
                r.kernel,
                f"{r.shape} x{r.rows}",
                f"{r.in_features}x{r.out_features}",
                "skipped" if r.skipped else f"{r.gflops:.1f}",
                "" if r.skipped else f"{r.weight_gbps:.1f}",
            ]
            for r in c.rates
        ]
        headers = ["dtype", "kernel", "shape", "weight", "GFLOP/s", "weight GB/s"]
        return head + "\n" + markdown_table(headers, rows)

    def classes_table(self) -> str:
        rows = [
            [
                row.op_class,
                row.label,
                f"{row.seconds:.3f}",
                f"{row.share:.1%}",
                f"{row.calls}",
                f"{_figure(row.rate)} {row.unit}" if row.bound else "",
                _figure(row.roof) if row.bound else "",
                f"{row.roof_share:.0%}" if row.roof_share is not None else "",
            ]
            for row in self.rows()
        ]
        headers = ["class", "label", "time s", "share", "calls", "achieved", "roof", "of roof"]
        return markdown_table(headers, rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "benchmark": "roofline",
            "ceilings": dataclasses.asdict(self.ceilings),
            "profile": dataclasses.asdict(self.profile),
            "rows": [
                {**dataclasses.asdict(row), "unit": row.unit, "roof_share": row.roof_share}
                for row in self.rows()
            ],
            "bounds": dataclasses.asdict(self.bounds()),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RooflineReport:
        """The report a `to_dict` (or its JSON file) holds; the rows are derived again."""
        return cls(Ceilings.from_dict(data["ceilings"]), Profile.from_dict(data["profile"]))

    def write_json(self, path: Path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def read_json(cls, path: Path) -> RooflineReport:
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))

    def write_png(self, path: Path) -> Path:
        """Left: the classes that compute, placed by intensity and rate under the roofs of each
        dtype probed. Right: every class's share of the time, and of its roof."""
        figure = Figure(figsize=(12.0, 5.0), dpi=110)
        roofline, shares = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1.2, 1]})
        self._draw_roofline(roofline)
        self._draw_shares(shares)
        figure.suptitle(f"tokenmill roofline: {self.profile.workload}")
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path)
        return path

    def _draw_roofline(self, axes: Any) -> None:
        bandwidth = self.ceilings.memory_gbps
        rows = [r for r in self.rows() if r.gflops_per_s > 0 and r.gbytes_per_s > 0]
        intensities = [r.gflops_per_s / r.gbytes_per_s for r in rows] or [1.0]
        low, high = min(0.1, min(intensities) / 2), max(1000.0, max(intensities) * 2)
        xs = [low * (high / low) ** (i / 64) for i in range(65)]
        for dtype in ("float32", "bfloat16", "int8", "int4", "w8a8"):
            compute = self.ceilings.compute_gflops(dtype)
            if compute:
                axes.plot(xs, [min(compute, x * bandwidth) for x in xs], label=f"{dtype} roof")
        total = self.profile.profiled_s or 1.0
        labelled: list[tuple[float, float]] = []
        for row, intensity in zip(rows, intensities, strict=False):
            axes.scatter([intensity], [row.gflops_per_s], s=20 + 600 * row.seconds / total)
            if row.seconds / total < LABEL_MIN_SHARE:
                continue
            # Rows at nearly one point (a product's row buckets often are) stack their labels.
            here = (math.log10(intensity), math.log10(row.gflops_per_s))
            near = sum(abs(here[0] - x) < 2.0 and abs(here[1] - y) < 0.1 for x, y in labelled)
            labelled.append(here)
            right_edge = here[0] > math.log10(high) - 1.5  # there the label goes left of its dot
            axes.annotate(
                _name(row),
                (intensity, row.gflops_per_s),
                xytext=(-4 if right_edge else 4, 4 - 10 * near),
                textcoords="offset points",
                horizontalalignment="right" if right_edge else "left",
                fontsize=7,
            )
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("arithmetic intensity (FLOP / byte)")
        axes.set_ylabel("GFLOP/s")
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize=8)

    def _draw_shares(self, axes: Any) -> None:
        rows = self.rows()
        names = [_name(r) for r in rows]
        positions = list(range(len(rows)))
        axes.barh(positions, [100 * r.share for r in rows], label="% of run time")
        axes.barh(
            positions,
            [100 * (r.roof_share or 0.0) for r in rows],
            height=0.3,
            label="% of roof",
        )
        axes.set_yticks(positions, names, fontsize=7)
        axes.invert_yaxis()
        axes.set_xlabel("%")
        axes.grid(alpha=0.3, axis="x")
        axes.legend(fontsize=8)


def _figure(value: float) -> str:
    """A rate with the digits that matter: 1234, 12.3, 0.012."""
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def _name(row: ClassRow) -> str:
    return f"{row.op_class}: {row.label}" if row.label else row.op_class
