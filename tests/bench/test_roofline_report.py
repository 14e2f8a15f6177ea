"""`bench roofline`'s report: each class against its roof, the table, the JSON round trip, the
PNG and the command's flags."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.roofline import op_classes
from tokenmill.bench.roofline.probe import Ceilings, ProductRate
from tokenmill.bench.roofline.profile import ClassTime, Profile
from tokenmill.bench.roofline.report import COMPUTE, MEMORY, RooflineReport, assess


def _ceilings() -> Ceilings:
    """A machine of 10 GB/s with float32 products at 100 GFLOP/s."""
    rate = ProductRate("float32", "torch", "prefill", 100, 1000, 1000, 4_000_000, seconds=0.002)
    return Ceilings(2, "AVX512", ["avx2"], "native", 10.0, [rate], ["a note"])


def _profile() -> Profile:
    classes = [
        ClassTime(op_classes.PRODUCTS, "float32 layers x1", "float32", 1.0, 30, 2e9, 1e9),
        ClassTime(op_classes.PRODUCTS, "float32 layers x129-512", "float32", 1.0, 30, 50e9, 1e8),
        ClassTime(op_classes.NORMS, "rms norm", "", 0.5, 60, 0.0, 2e9),
        ClassTime(op_classes.SAMPLING, "sampler", "", 0.1, 5, 0.0, 0.0),
        ClassTime(op_classes.HOST, "", seconds=0.4),
    ]
    return Profile("tiny", {"dtype": "float32"}, 10, 2.9, 3.0, {"python layers": 5}, {}, classes)


def test_a_product_below_the_ridge_is_memory_bound_in_bytes_per_second():
    row = assess(_profile().classes[0], _ceilings(), 3.0)
    assert row.bound == MEMORY and row.unit == "GB/s"
    assert row.rate == pytest.approx(1.0) and row.roof == pytest.approx(10.0)
    assert row.roof_share == pytest.approx(0.1)
    assert row.over_roof_s == pytest.approx(0.9)


def test_a_product_above_the_ridge_is_compute_bound_against_its_dtypes_rate():
    row = assess(_profile().classes[1], _ceilings(), 3.0)
    assert row.bound == COMPUTE and row.unit == "GFLOP/s"
    assert row.rate == pytest.approx(50.0) and row.roof == pytest.approx(100.0)


def test_sampling_and_host_time_have_no_rate_and_count_whole_as_gap():
    rows = RooflineReport(_ceilings(), _profile()).rows()
    host = rows[-1]
    assert host.op_class == op_classes.HOST and host.bound == "" and host.roof_share is None
    assert host.over_roof_s == host.seconds and host.share == pytest.approx(0.4 / 3.0)


def test_the_table_names_every_class_the_totals_and_the_biggest_gaps():
    table = RooflineReport(_ceilings(), _profile()).table()
    for name in ("products", "norms & activations", "sampling", "host (between kernels)"):
        assert name in table
    assert "profiled 3.00 s, unprofiled 2.90 s (+3.4%)" in table
    assert "biggest gaps (time over the roof): products: float32 layers x1 0.90 s" in table
    assert "note: a note" in table


def test_memory_rows_take_the_step_sized_buffers_rate_where_it_was_measured():
    ceilings = _ceilings()
    ceilings.step_read_bytes, ceilings.step_read_gbps = 100_000_000, 40.0
    row = assess(_profile().classes[0], ceilings, 3.0)
    assert row.bound == MEMORY and row.roof == pytest.approx(40.0)
    assert (
        "a step's reads (95 MiB, the memory roof) 40.0 GB/s"
        in RooflineReport(ceilings, _profile()).table()
    )


def test_the_run_is_set_against_its_products_its_bytes_and_every_class_at_its_roof():
    bounds = RooflineReport(_ceilings(), _profile()).bounds()
    assert bounds.seconds == pytest.approx(2.9)  # the unprofiled run
    assert bounds.products_s == pytest.approx(52e9 / 100e9)
    assert bounds.bytes_s == pytest.approx(3.1e9 / 10e9)
    # 1 GB at 10 GB/s, 50 GFLOP at 100 GFLOP/s, 2 GB at 10 GB/s; sampling and host: none
    assert bounds.classes_s == pytest.approx(0.1 + 0.5 + 0.2)
    assert bounds.share(bounds.classes_s) == pytest.approx(0.8 / 2.9)
    table = RooflineReport(_ceilings(), _profile()).table()
    assert "the run (2.90 s) against its roofs: products at their rates 0.52 s (18%)" in table


def test_the_json_round_trips(tmp_path):
    report = RooflineReport(_ceilings(), _profile())
    path = tmp_path / "roofline.json"
    report.write_json(path)
    again = RooflineReport.read_json(path)
    assert again == report
    payload = json.loads(path.read_text())
    assert payload["rows"][0]["unit"] == "GB/s"
    assert payload["bounds"]["classes_s"] == pytest.approx(0.8)


def test_the_png_is_drawn(tmp_path):
    path = RooflineReport(_ceilings(), _profile()).write_png(tmp_path / "roofline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_profiles_a_workload_file_and_writes_json_and_png(
    tokenmill_cli, tiny_workload, tmp_path
):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    result = tokenmill_cli(
        *("bench", "roofline", "--workload", str(tiny_workload), "--quick-probe"),
        *("--no-unprofiled", "--json", str(out), "--png", str(png), "--kv-cache-memory", "32MiB"),
    )
    assert result.returncode == 0, result.stderr
    assert "attention decode" in result.stdout and "DRAM read" in result.stdout
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "roofline"
    assert payload["profile"]["unprofiled_s"] is None
    assert png.stat().st_size > 0


def test_the_command_rejects_a_missing_workload_before_loading_anything(tokenmill_cli, tmp_path):
    result = tokenmill_cli("bench", "roofline", "--workload", str(tmp_path / "none.jsonl"))
    assert result.returncode != 0
    assert "does not exist" in result.stderr
