"""`bench roofline`'s profile on a tiny real run: every kernel class found, the classes adding
up to the run, and each step's path (native decode loop or Python layers) counted."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.bench.roofline import op_classes
from tokenmill.bench.roofline.profile import NATIVE_PATH, PYTHON_PATH, Profile, profile_workload
from tokenmill.bench.workloads import BenchRequest
from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.kernels import op_timer, ops
from tokenmill.sampling.params import SamplingParams

REQUESTS = [
    BenchRequest([500, 600, 700, 800, 900, 1000], None, 6),
    BenchRequest([1200, 1300, 1400], None, 4),
]
DECODE_STEPS = 5  # both requests prefill in one step, then decode until the longer one ends


def _profile(loaded: Any, unprofiled: bool, **engine: Any) -> Profile:
    args = EngineArgs(kv_cache_memory="32MiB", **engine)
    return profile_workload(args, REQUESTS, "tiny", unprofiled, use_tqdm=False, loaded=loaded)


@pytest.fixture(scope="module")
def native(smollm) -> Profile:
    return _profile(smollm, unprofiled=True)


@pytest.fixture(scope="module")
def python_layers(smollm) -> Profile:
    return _profile(smollm, unprofiled=False, decode_loop="python")


def _seconds(profile: Profile, op_class: str) -> float:
    return sum(c.seconds for c in profile.classes if c.op_class == op_class)


@pytest.mark.parametrize("name", ["native", "python_layers"])
def test_kernel_classes_fit_inside_the_run_and_host_time_is_the_rest(name, request):
    profile = request.getfixturevalue(name)
    kernels = sum(c.seconds for c in profile.classes if c.op_class != op_classes.HOST)
    host = _seconds(profile, op_classes.HOST)
    assert 0 < kernels <= profile.profiled_s
    assert host > 0
    assert kernels + host == pytest.approx(profile.profiled_s, rel=1e-9)


def test_the_profilers_own_bookkeeping_is_not_counted_as_host_time(native):
    (bookkeeping,) = [c for c in native.classes if c.op_class == op_classes.PROFILER]
    assert 0 < bookkeeping.seconds < native.profiled_s
    assert native.classes[-1].op_class == op_classes.HOST


@pytest.mark.parametrize("name", ["native", "python_layers"])
def test_every_class_of_prefill_and_decode_is_found(name, request):
    found = {c.op_class for c in request.getfixturevalue(name).classes}
    expected = {
        op_classes.PRODUCTS,
        op_classes.ATTENTION_PREFILL,
        op_classes.ATTENTION_DECODE,
        op_classes.KV_STORE,
        op_classes.NORMS,
        op_classes.SAMPLING,
    }
    assert expected <= found
    assert op_classes.OTHER not in found


def test_decode_steps_take_the_native_loop_and_the_prefill_the_python_layers(native):
    assert native.steps == {NATIVE_PATH: DECODE_STEPS, PYTHON_PATH: 1}


def test_without_the_native_loop_every_step_runs_the_python_layers(python_layers):
    assert python_layers.steps == {NATIVE_PATH: 0, PYTHON_PATH: 1 + DECODE_STEPS}


@pytest.mark.parametrize("name", ["native", "python_layers"])
def test_each_step_reads_the_layers_weights_once(name, request, smollm):
    """The layers' products count every weight's bytes once per step, on either path."""
    layer_bytes = sum(
        linear.weight.nbytes
        for layer in smollm.model.layers
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    )
    profile = request.getfixturevalue(name)
    products = [
        c for c in profile.classes if c.op_class == op_classes.PRODUCTS and "layers" in c.label
    ]
    assert sum(c.bytes for c in products) == layer_bytes * (1 + DECODE_STEPS)


def test_a_steps_reads_are_at_least_the_layers_weights(native, smollm):
    layer_bytes = sum(
        linear.weight.nbytes
        for layer in smollm.model.layers
        for linear in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    )
    assert layer_bytes < native.read_bytes_per_step


def test_profiling_adds_little_to_the_run(native):
    """A loose bound: the machine is shared while tests run; quiet runs stay within a few %."""
    assert native.unprofiled_s is not None
    assert native.profiled_s < 1.5 * native.unprofiled_s + 0.2


def test_the_loops_kernels_take_no_more_than_the_loops_call(smollm):
    calls: list[tuple[dict[str, float], float]] = []

    class LoopRecorder:
        def op(self, *args: Any) -> None:
            pass

        def decode_loop(self, owner, args, op_seconds, seconds) -> None:
            calls.append((op_seconds, seconds))

    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), smollm)
    engine.add_request("a", [500, 600, 700], SamplingParams(max_tokens=4, ignore_eos=True))
    op_timer.install(LoopRecorder())
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        op_timer.install(None)
    assert len(calls) == 3 and ops.backend() == "native"
    for op_seconds, seconds in calls:
        assert set(op_seconds) == {
            "norm",
            "qkv",
            "rotary",
            "store_kv",
            "attention",
            "o",
            "gate_up",
            "activation",
            "down",
        }
        assert all(s > 0 for s in op_seconds.values())
        assert sum(op_seconds.values()) <= seconds
