"""A finished answer replayed as the outputs it was generated as."""

from __future__ import annotations

from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.gateway.transcript import Recorder, replay, steps_array
from tokenmill.request import RequestMetrics


def output(texts: list[str], tokens: list[int], done: list[bool]) -> RequestOutput:
    choices = [
        CompletionOutput(i, text, list(range(n)), None, None, "stop" if d else None)
        for i, (text, n, d) in enumerate(zip(texts, tokens, done, strict=True))
    ]
    return RequestOutput("gen", "p", [1], choices, all(done), 0, RequestMetrics(0.0))


GENERATED = [
    output(["Pa", "Ro"], [1, 1], [False, False]),
    output(["Paris", "Rome"], [2, 2], [False, True]),
    output(["Paris.", "Rome"], [3, 2], [True, True]),
]


def recorded() -> Recorder:
    recorder = Recorder()
    for out in GENERATED:
        recorder.see(out)
    return recorder


def test_a_replay_repeats_each_generated_output_under_the_new_id():
    replayed = replay(GENERATED[-1], recorded().steps, "hit")
    assert [r.request_id for r in replayed] == ["hit"] * 3
    for again, generated in zip(replayed, GENERATED, strict=True):
        assert again.outputs == generated.outputs
        assert again.finished == generated.finished


def test_an_output_that_changed_nothing_is_recorded_once():
    recorder = recorded()
    recorder.see(GENERATED[-1])
    assert len(replay(GENERATED[-1], recorder.steps, "hit")) == 3


def test_an_answer_without_steps_replays_as_its_final_output():
    assert replay(GENERATED[-1], steps_array(), "hit") == [
        RequestOutput("hit", "p", [1], GENERATED[-1].outputs, True, 0, RequestMetrics(0.0))
    ]
