"""The native kernels against their torch references, and the fallback to those references."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F
from torch.utils import cpp_extension

from tokenmill.kernels import build, extension, float_linear, ops

# Bounds: both sides accumulate in float32 but in different orders, so they differ by rounding
# only; for these sizes that is ~1e-7 relative, well inside the bounds below.
LINEAR_MAX_RELATIVE_ERROR = 1e-5  # max |native - F.linear| / max |F.linear|
ATTENTION_MAX_ABS_ERROR = 1e-5

needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)


@pytest.fixture
def reloaded_ops(monkeypatch: pytest.MonkeyPatch):
    """Makes the import-time backend choice (`extension.load_native`) again under the test's
    patches and returns `ops` running on it; the real choice is restored afterwards."""

    def reload():
        monkeypatch.setattr(extension, "NATIVE", extension.load_native())
        return ops

    return reload


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@needs_native
@pytest.mark.parametrize("k", [1, 7, 8, 9, 64, 577])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_linear_matches_f_linear_for_odd_shapes(k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(k)
    for m in range(1, ops.SKINNY_MAX_ROWS + 1):
        n = int(torch.randint(1, 70, (1,), generator=gen))
        x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        bias = torch.randn(n, generator=gen) if with_bias else None
        out = ops._NATIVE.linear(x, weight, bias)
        assert relative_error(out, F.linear(x, weight, bias)) < LINEAR_MAX_RELATIVE_ERROR, (m, n)


@needs_native
def test_linear_keeps_leading_dims_and_uses_torch_for_wide_batches() -> None:
    weight, bias = torch.randn(33, 20), torch.randn(33)
    skinny = torch.randn(2, 3, 20)
    wide = torch.randn(ops.SKINNY_MAX_ROWS + 1, 20)
    assert ops.linear(skinny, weight, bias).shape == (2, 3, 33)
    assert relative_error(ops.linear(skinny, weight, bias), F.linear(skinny, weight, bias)) < 1e-5
    assert torch.equal(ops.linear(wide, weight, bias), F.linear(wide, weight, bias))


needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch was built without oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, ops.SKINNY_MAX_ROWS + 1, 100, ops.PREPACKED_MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(70, 33, generator=gen), torch.randn(rows, 33, generator=gen)
    bias = torch.randn(70, generator=gen) if with_bias else None
    prepacked = ops.prepack_linear_weight(weight, 64)
    assert prepacked is not None
    out = ops.linear(x.view(1, rows, 33), weight, bias, prepacked)
    assert out.shape == (1, rows, 70)
    assert relative_error(out[0], F.linear(x, weight, bias)) < LINEAR_MAX_RELATIVE_ERROR


def assert_prepacked_serves_only_inference_batches_up_to_its_limit(
    linear_ops, calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`calls` collects the row counts the prepacked kernel saw. Its limit is PREPACKED_MAX_ROWS
    where MKL's GEMM is ahead past it (Intel CPUs), none elsewhere; both are set here (in
    `float_linear`, which owns the limit)."""
    weight = torch.randn(40, 24)
    prepacked = linear_ops.prepack_linear_weight(weight, 64)
    wide = torch.randn(linear_ops.PREPACKED_MAX_ROWS + 1, 24)
    monkeypatch.setattr(float_linear, "FLOAT32_PREPACKED_MAX_ROWS", linear_ops.PREPACKED_MAX_ROWS)
    assert torch.equal(linear_ops.linear(wide, weight, None, prepacked), F.linear(wide, weight))
    trained = torch.randn(40, 24, requires_grad=True)
    linear_ops.linear(trained, weight, None, prepacked).sum().backward()  # autograd: torch's GEMM
    assert trained.grad is not None
    linear_ops.linear(torch.randn(40, 24), weight, None, prepacked)
    assert calls == [40]
    monkeypatch.setattr(float_linear, "FLOAT32_PREPACKED_MAX_ROWS", sys.maxsize)
    out = linear_ops.linear(wide, weight, None, prepacked)
    assert calls == [40, wide.shape[0]]
    assert relative_error(out, F.linear(wide, weight)) < LINEAR_MAX_RELATIVE_ERROR
    assert linear_ops.prepack_linear_weight(weight.half(), 64) is None


@pytest.fixture
def onednn_rows(monkeypatch: pytest.MonkeyPatch, reloaded_ops):
    """`ops` under torch's kernels, and the row counts its oneDNN products see."""
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    torch_ops = reloaded_ops()
    calls: list[int] = []
    onednn = torch.ops.mkldnn._linear_pointwise

    def counting(x, *args):
        calls.append(x.shape[0])
        return onednn(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting)
    return torch_ops, calls


@needs_onednn
def test_onednn_prepacked_weight_serves_only_inference_batches_up_to_its_limit(
    onednn_rows, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_prepacked_serves_only_inference_batches_up_to_its_limit(*onednn_rows, monkeypatch)


@needs_onednn
def test_onednn_takes_exactly_the_rows_past_torch_plain_max_rows(onednn_rows) -> None:
    torch_ops, calls = onednn_rows
    weight = torch.randn(40, 24)
    prepacked = torch_ops.prepack_linear_weight(weight, 64)
    for rows in range(1, 6):
        x = torch.randn(rows, 24)
        out = torch_ops.linear(x, weight, None, prepacked)
        torch.testing.assert_close(out, F.linear(x, weight))
    assert calls == list(range(torch_ops.TORCH_PLAIN_MAX_ROWS + 1, 6))


@needs_native
def test_native_prepacked_weight_serves_only_inference_batches_up_to_its_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    native = ops._NATIVE

    class Counting:
        def __getattr__(self, name: str):
            return getattr(native, name)

        def packed_linear(self, x, *args):
            calls.append(x.shape[0])
            return native.packed_linear(x, *args)

    monkeypatch.setattr(ops, "_NATIVE", Counting())
    assert_prepacked_serves_only_inference_batches_up_to_its_limit(ops, calls, monkeypatch)


@needs_native
@pytest.mark.parametrize("k", [1, 7, 64, 577])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_packed_linear_matches_f_linear_for_odd_shapes(k: int, with_bias: bool) -> None:
    """Row counts of the narrow tiles, around the 6-row chunk, the 12-row zmm tile and the 96-row
    pass; N around the 16-output panel and the narrow tiles' groups of panels."""
    gen = torch.Generator().manual_seed(k)
    for m in (1, 2, 3, 4, 5, 6, 7, 9, 12, 33, 95, 96, 97, 200, ops.PREPACKED_MAX_ROWS):
        for n in (1, 15, 16, 17, 70, 129):
            x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
            bias = torch.randn(n, generator=gen) if with_bias else None
            out = ops._NATIVE.packed_linear(x, ops._NATIVE.pack_linear_weight(weight), n, bias)
            expected = F.linear(x, weight, bias)
            assert relative_error(out, expected) < LINEAR_MAX_RELATIVE_ERROR, (m, n)


@needs_native
def test_native_packed_linear_gives_a_row_the_same_bits_at_any_batch_size() -> None:
    """Every row count (narrow tiles, the 6-row tile, several passes) computes each output with
    the same FMAs in the same order, so a request decodes identically alone and in a batch."""
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(70, 200, generator=gen), torch.randn(70, generator=gen)
    x = torch.randn(130, 200, generator=gen)
    packed = ops._NATIVE.pack_linear_weight(weight)
    full = ops._NATIVE.packed_linear(x, packed, 70, bias)
    for start, m in ((0, 1), (5, 2), (9, 3), (20, 4), (31, 6), (50, 9), (40, 13), (3, 100)):
        rows = x[start : start + m].contiguous()
        assert torch.equal(
            ops._NATIVE.packed_linear(rows, packed, 70, bias), full[start : start + m]
        )


@needs_native
def test_native_packed_linear_rejects_a_weight_it_did_not_pack() -> None:
    weight, x = torch.randn(40, 24), torch.randn(40, 24)
    with pytest.raises(RuntimeError, match="pack_linear_weight"):
        ops._NATIVE.packed_linear(x, weight, 40, None)
    with pytest.raises(RuntimeError, match="n does not match"):
        ops._NATIVE.packed_linear(x, ops._NATIVE.pack_linear_weight(weight), 20, None)
    with pytest.raises(RuntimeError, match="disagree on K"):
        ops._NATIVE.packed_linear(
            torch.randn(40, 23), ops._NATIVE.pack_linear_weight(weight), 40, None
        )


def random_paged_batch(
    seq_lens: list[int], heads: int, kv_heads: int, head_dim: int = 64, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, a cache with spare blocks, shuffled (non-contiguous) block tables, and lengths."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    shuffled = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.long)
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = torch.tensor([shuffled.pop() for _ in range(count)])
    q = torch.randn(len(seq_lens), heads, head_dim)
    return q, kv_cache, tables, torch.tensor(seq_lens)


@needs_native
@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(6, 6), (9, 3), (8, 1)], ids=["mha", "gqa3", "all-to-one"]
)
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_native_paged_attention_matches_gather_path(heads: int, kv_heads: int, batch: int) -> None:
    torch.manual_seed(batch * heads)
    edge_lens = [15, 16, 17, 1, 32, 33, 100]  # around block boundaries, then multi-block
    seq_lens = [
        edge_lens[i] if i < len(edge_lens) else random.randint(1, 200) for i in range(batch)
    ]
    q, kv_cache, tables, lens = random_paged_batch(seq_lens, heads, kv_heads)
    scale = q.shape[-1] ** -0.5
    out = ops._NATIVE.paged_decode_attention(q, kv_cache, tables, lens, scale)
    expected = ops.paged_decode_attention_reference(q, kv_cache, tables, lens, scale)
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 500])
@pytest.mark.parametrize("copies", [1, 2], ids=["7-sequences", "14-sequences"])
def test_native_paged_attention_sliding_window_matches_reference(window: int, copies: int) -> None:
    """With 2 threads, 7 sequences run as one work item per KV head, 14 as one per sequence."""
    torch.manual_seed(window)
    q, kv_cache, tables, lens = random_paged_batch([1, 15, 16, 17, 33, 100, 190] * copies, 4, 2)
    out = ops._NATIVE.paged_decode_attention(q, kv_cache, tables, lens, 0.2, window)
    expected = ops.paged_decode_attention_reference(q, kv_cache, tables, lens, 0.2, window)
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window"),
    [(9, 3, 64, 16, None), (4, 1, 256, 16, 512), (6, 2, 64, 32, 700), (8, 1, 64, 8, None)],
    ids=["smollm2", "gemma3-local", "blocks-of-32", "blocks-of-8"],
)
@pytest.mark.parametrize("copies", [1, 8], ids=["one-per-kv-head", "one-per-sequence"])
def test_native_paged_attention_merges_a_long_context_in_partitions(
    heads: int, kv_heads: int, head_dim: int, block_size: int, window: int | None, copies: int
) -> None:
    """Contexts past 512 tokens run in 512-token partitions whose sums merge at the end: one
    token past the first cut, several cuts, one just short of a cut. 1 copy runs each
    partition of each KV head as its own work item, 8 copies (2 threads) a sequence per item."""
    torch.manual_seed(head_dim + block_size)
    q, kv_cache, tables, lens = random_paged_batch(
        [513, 1500, 1024, 2047, 100] * copies, heads, kv_heads, head_dim, block_size
    )
    out = ops._NATIVE.paged_decode_attention(q, kv_cache, tables, lens, 0.125, window or 0)
    expected = ops.paged_decode_attention_reference(q, kv_cache, tables, lens, 0.125, window)
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
def test_native_paged_attention_gives_a_long_context_the_same_bits_alone_and_in_a_batch() -> None:
    """Partitions are cut by a sequence's own length, never by the batch's size, so a request
    decodes identically alone (a work item per partition) and beside 15 others (per sequence)."""
    torch.manual_seed(4)
    q, kv_cache, tables, lens = random_paged_batch(
        [3000, *torch.randint(1, 2500, (15,)).tolist()], 9, 3
    )
    full = ops._NATIVE.paged_decode_attention(q, kv_cache, tables, lens, 0.125)
    for row in range(len(lens)):
        alone = ops._NATIVE.paged_decode_attention(
            q[row : row + 1], kv_cache, tables[row : row + 1], lens[row : row + 1], 0.125
        )
        assert torch.equal(alone[0], full[row])


def test_sliding_window_reference_attends_to_exactly_the_last_positions() -> None:
    """Against a softmax written out by hand over the window's keys alone."""
    torch.manual_seed(1)
    q, kv_cache, tables, lens = random_paged_batch([37], 2, 1, head_dim=8, block_size=4)
    out = ops.paged_decode_attention_reference(q, kv_cache, tables, lens, 0.5, window=10)
    keys, values = (ops.gather_blocks(half, tables[0])[27:37, 0] for half in kv_cache)
    weights = torch.softmax(q[0] @ keys.T * 0.5, dim=-1)
    torch.testing.assert_close(out[0], weights @ values)


@needs_native
def test_native_paged_attention_accepts_int32_tables_and_odd_head_dim() -> None:
    torch.manual_seed(0)
    q, kv_cache, tables, lens = random_paged_batch([5, 12, 3], 4, 2, head_dim=13, block_size=5)
    out = ops._NATIVE.paged_decode_attention(q, kv_cache, tables.int(), lens.int(), 0.3)
    expected = ops.paged_decode_attention_reference(q, kv_cache, tables, lens, 0.3)
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
def test_native_paged_attention_rejects_lengths_past_the_block_table() -> None:
    q, kv_cache, tables, _ = random_paged_batch([16], 2, 1)
    with pytest.raises(RuntimeError, match="outside"):
        ops._NATIVE.paged_decode_attention(q, kv_cache, tables, torch.tensor([17]), 1.0)


STORE_KV_BACKENDS = [
    pytest.param(ops.store_kv_reference, id="reference"),
    pytest.param(lambda *args: ops._NATIVE.store_kv(*args), id="native", marks=needs_native),
]


@pytest.mark.parametrize("store", STORE_KV_BACKENDS)
def test_store_kv_writes_exactly_the_named_slots(store) -> None:
    """k and v are column slices of one merged projection, as the model hands them over."""
    torch.manual_seed(9)
    kv_heads, head_dim, block_size = 2, 8, 4
    kv_cache = torch.randn(2, 5, block_size, kv_heads, head_dim)
    before = kv_cache.clone()
    slots = torch.tensor([13, 2, 7, 19])
    qkv = torch.randn(4, 3 * kv_heads * head_dim)
    _, k, v = (t.view(4, kv_heads, head_dim) for t in qkv.split(kv_heads * head_dim, dim=-1))
    store(kv_cache, slots, k, v)

    for slot, key, value in zip(slots.tolist(), k, v, strict=True):
        block, offset = divmod(slot, block_size)
        assert torch.equal(kv_cache[0, block, offset], key)
        assert torch.equal(kv_cache[1, block, offset], value)
    untouched = torch.ones(5 * block_size, dtype=torch.bool)
    untouched[slots] = False
    flat = kv_cache.view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat[:, untouched], before.view(2, -1, kv_heads, head_dim)[:, untouched])


@needs_native
def test_native_store_kv_rejects_slots_outside_the_cache() -> None:
    kv_cache = torch.zeros(2, 3, 4, 1, 8)
    k = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside"):
        ops._NATIVE.store_kv(kv_cache, torch.tensor([12]), k, k)


@needs_native
def test_loading_again_reuses_the_built_library() -> None:
    library = build.BUILD_DIR / f"{build.EXTENSION_NAME}.so"
    built_at = library.stat().st_mtime_ns
    build.load_extension()
    assert library.stat().st_mtime_ns == built_at


@needs_native
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load() -> None:
    """torch waits for its build lock without end; a build killed midway leaves one behind."""
    stale = build.BUILD_DIR / build.TORCH_LOCK_FILE
    stale.touch()
    load = "from tokenmill.kernels.build import load_extension; load_extension()"
    try:
        result = subprocess.run(
            [sys.executable, "-c", load], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_builds_run_the_pinned_ninja_whatever_path_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ninja versions do not share a build log: alternating them rebuilt everything."""
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin"]))
    build._put_ninja_on_path()
    assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")


def test_env_var_torch_selects_the_reference_kernels(
    monkeypatch: pytest.MonkeyPatch, reloaded_ops
) -> None:
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    torch_ops = reloaded_ops()
    assert torch_ops.backend() == "torch"
    x, weight = torch.randn(3, 10), torch.randn(7, 10)
    assert torch.equal(torch_ops.linear(x, weight), F.linear(x, weight))
    q, kv_cache, tables, lens = random_paged_batch([20, 3], 4, 2)
    assert torch.equal(
        torch_ops.paged_decode_attention(q, kv_cache, tables, lens, 0.125),
        torch_ops.paged_decode_attention_reference(q, kv_cache, tables, lens, 0.125),
    )


def test_failed_build_warns_once_and_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, reloaded_ops, tmp_path, capsys
) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error deliberately broken\n")

    def load_broken_source() -> None:
        # Its own name: reusing the real one would make torch rebuild the real extension later.
        cpp_extension.load(
            name="tokenmill_broken", sources=[str(broken)], build_directory=str(tmp_path)
        )

    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)
    monkeypatch.setattr(build, "load_extension", load_broken_source)
    fallback_ops = reloaded_ops()
    warning_lines = capsys.readouterr().err.strip().splitlines()
    assert len(warning_lines) == 1 and "torch reference" in warning_lines[0]
    assert fallback_ops.backend() == "torch"
    x, weight, bias = torch.randn(1, 9), torch.randn(5, 9), torch.randn(5)
    assert torch.equal(fallback_ops.linear(x, weight, bias), F.linear(x, weight, bias))
