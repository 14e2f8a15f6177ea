"""`tokenmill bench roofline`: the machine's ceilings and where a workload's time goes."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.bench.workloads import BUILTIN_WORKLOADS
from tokenmill.cli.engine_args import add_engine_args, engine_args_from


def add_parser(kinds: argparse._SubParsersAction) -> None:
    roofline = kinds.add_parser(
        "roofline",
        help="probe the machine's ceilings, profile a workload by op class, compare the two",
    )
    roofline.add_argument(
        "--workload",
        default="single",
        help=", ".join(BUILTIN_WORKLOADS) + ", or a JSONL file of requests",
    )
    roofline.add_argument("--json", default=None, help="also write the report as JSON here")
    roofline.add_argument("--png", default=None, help="also draw the report as a PNG here")
    roofline.add_argument(
        "--no-unprofiled",
        action="store_true",
        help="skip the plain run the profiled one is compared with (about halves the time)",
    )
    roofline.add_argument(
        "--quick-probe",
        action="store_true",
        help="tiny probe sizes: a check that it runs, not ceilings to trust",
    )
    add_engine_args(roofline)
    roofline.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.bench.roofline.probe import QUICK_SIZES, ProbeSizes, probe, probe_step_reads
    from tokenmill.bench.roofline.profile import profile_workload
    from tokenmill.bench.roofline.report import RooflineReport
    from tokenmill.bench.workloads import load_workload

    requests = load_workload(ns.workload)  # a bad workload fails before the probe
    args = engine_args_from(ns)
    sizes = QUICK_SIZES if ns.quick_probe else ProbeSizes()
    ceilings = probe(sizes)
    profile = profile_workload(args, requests, ns.workload, unprofiled=not ns.no_unprofiled)
    probe_step_reads(ceilings, profile.read_bytes_per_step, sizes)
    report = RooflineReport(ceilings, profile)
    print(report.table())
    if ns.json:
        report.write_json(Path(ns.json))
    if ns.png:
        report.write_png(Path(ns.png))
    return 0
