"""What the completions and chat endpoints share (tokenmill/server/serving.py), tested directly
with stand-ins for the engine, the tokenizer and the client connection."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import jinja2
import pytest

from tokenmill.engine.async_engine import EngineBusyError, EngineStoppedError, RequestStream
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatMessage, CompletionRequest, ErrorResponse, Usage
from tokenmill.server.serving import (
    MAX_N,
    RETRY_AFTER_S,
    SSE_DONE,
    ClientDisconnectedError,
    EngineStreamingResponse,
    Prompt,
    ServingContext,
    chat_prompt,
    check_fits,
    collect,
    merge,
    new_id,
    sampling_params,
    sse,
    sse_error,
    submit,
    usage,
)


class FakeAsyncEngine:
    """Accepts every request unless `refuse` names an error for its prompt text; records the
    requests it was given and the ones aborted."""

    def __init__(self, max_seq_len: int = 64, refuse: dict[str, BaseException] | None = None):
        self.engine = SimpleNamespace(max_seq_len=max_seq_len, tokenizer=None)
        self.refuse = refuse or {}
        self.added: list[tuple[str, dict[str, Any]]] = []
        self.aborted: list[str] = []

    async def add_request(self, request_id: str, prompt: dict[str, Any], params) -> RequestStream:
        if prompt["prompt"] in self.refuse:
            raise self.refuse[prompt["prompt"]]
        self.added.append((request_id, prompt))
        return RequestStream(request_id, self)  # type: ignore[arg-type]

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class FakeTokenizer:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.messages: list[dict[str, Any]] = []

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        if self.error is not None:
            raise self.error
        self.messages = messages
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split("|")] + ([0] if add_special_tokens else [])


class FakeRequest:
    """A client connection: `disconnect` makes `receive()` report the client gone."""

    def __init__(self) -> None:
        self.disconnect = asyncio.Event()

    async def receive(self) -> dict[str, str]:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}


def output(finished: bool, text: str = "") -> SimpleNamespace:
    return SimpleNamespace(finished=finished, text=text)


def context(engine: FakeAsyncEngine | None = None) -> ServingContext:
    return ServingContext(engine or FakeAsyncEngine(), "tiny")  # type: ignore[arg-type]


def fields(**given: Any) -> CompletionRequest:
    return CompletionRequest(prompt="hi", **given)


def raised(call) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    return info.value


# ServingContext


def test_the_served_model_name_and_an_unnamed_model_are_accepted():
    ctx = context()
    ctx.check_model("tiny")
    ctx.check_model(None)


def test_another_model_name_is_a_404_naming_both_models():
    error = raised(lambda: context().check_model("gpt-4"))
    assert error.status_code == 404 and error.info.code == "model_not_found"
    assert "gpt-4" in error.info.message and "tiny" in error.info.message


def test_max_model_len_is_the_engines_longest_sequence():
    assert context(FakeAsyncEngine(max_seq_len=123)).max_model_len == 123


# chat_prompt


def test_chat_prompt_is_the_templated_text_and_its_ids_without_special_tokens():
    tokenizer = FakeTokenizer()
    prompt = chat_prompt(tokenizer, [ChatMessage(role="user", content="hello")])  # type: ignore[arg-type]
    assert prompt == Prompt("user:hello", [10])
    assert tokenizer.messages == [{"role": "user", "content": "hello"}]


def test_no_messages_is_a_400_on_messages():
    error = raised(lambda: chat_prompt(FakeTokenizer(), []))  # type: ignore[arg-type]
    assert error.status_code == 400 and error.info.param == "messages"


@pytest.mark.parametrize("failure", [ValueError("roles must alternate"), jinja2.TemplateError("x")])
def test_a_template_that_rejects_the_messages_is_a_400_on_messages(failure):
    tokenizer = FakeTokenizer(error=failure)
    messages = [ChatMessage(role="assistant", content="hi")]
    error = raised(lambda: chat_prompt(tokenizer, messages))  # type: ignore[arg-type]
    assert error.status_code == 400 and error.info.param == "messages"
    assert "chat template rejected" in error.info.message


# sampling_params


def test_given_fields_reach_the_sampling_params():
    params = sampling_params(
        fields(n=2, temperature=0.5, top_k=4, seed=9, stop=["."]), max_tokens=7, logprobs=3
    )
    assert (params.n, params.temperature, params.top_k, params.seed) == (2, 0.5, 4, 9)
    assert (params.stop, params.max_tokens, params.logprobs) == (["."], 7, 3)


def test_null_fields_take_the_sampling_params_defaults():
    params = sampling_params(fields(n=None, temperature=None), max_tokens=None, logprobs=None)
    default = type(params)(max_tokens=None)
    assert params == default


def test_more_than_max_n_completions_is_a_400_on_n():
    error = raised(lambda: sampling_params(fields(n=MAX_N + 1), max_tokens=4, logprobs=None))
    assert error.status_code == 400 and error.info.param == "n"


def test_a_value_sampling_params_rejects_is_a_400_naming_its_field():
    error = raised(lambda: sampling_params(fields(top_p=2.0), max_tokens=4, logprobs=None))
    assert error.status_code == 400 and error.info.param == "top_p"


# check_fits


def test_a_prompt_and_max_tokens_that_fill_the_context_exactly_fit():
    check_fits(context(FakeAsyncEngine(max_seq_len=8)), Prompt("p", [1] * 5), 3, "prompt")


def test_a_prompt_that_leaves_no_room_to_generate_is_a_400_on_the_prompt():
    ctx = context(FakeAsyncEngine(max_seq_len=8))
    error = raised(lambda: check_fits(ctx, Prompt("p", [1] * 8), None, "messages"))
    assert error.info.param == "messages" and "8 tokens" in error.info.message


def test_a_prompt_plus_max_tokens_over_the_context_is_a_400_on_max_tokens():
    ctx = context(FakeAsyncEngine(max_seq_len=8))
    error = raised(lambda: check_fits(ctx, Prompt("p", [1] * 5), 4, "prompt"))
    assert error.info.param == "max_tokens" and "9 were requested" in error.info.message


# submit


def run_submit(engine: FakeAsyncEngine, texts: list[str]) -> list[RequestStream]:
    prompts = [Prompt(text, [i + 1]) for i, text in enumerate(texts)]
    params = sampling_params(fields(), max_tokens=4, logprobs=None)
    return asyncio.run(submit(context(engine), "cmpl-1", prompts, params, "prompt"))


def test_submit_hands_every_prompt_to_the_engine_under_its_own_id():
    engine = FakeAsyncEngine()
    streams = run_submit(engine, ["a", "b"])
    assert [s.request_id for s in streams] == ["cmpl-1-0", "cmpl-1-1"]
    assert engine.added[1] == ("cmpl-1-1", {"prompt": "b", "prompt_token_ids": [2]})


def test_a_busy_engine_is_a_503_with_retry_after_and_nothing_left_running():
    engine = FakeAsyncEngine(refuse={"b": EngineBusyError("8 waiting")})
    error = raised(lambda: run_submit(engine, ["a", "b", "c"]))
    assert error.status_code == 503 and error.info.code == "server_busy"
    assert error.headers == {"Retry-After": str(RETRY_AFTER_S)}
    assert sorted(engine.aborted) == ["cmpl-1-0", "cmpl-1-2"]


def test_a_stopping_engine_is_a_503_server_shutting_down():
    engine = FakeAsyncEngine(refuse={"a": EngineStoppedError("shutting down")})
    error = raised(lambda: run_submit(engine, ["a"]))
    assert error.status_code == 503 and error.info.code == "server_shutting_down"


def test_a_prompt_the_engine_rejects_is_a_400_on_the_given_param():
    engine = FakeAsyncEngine(refuse={"a": ValueError("prompt too long")})
    error = raised(lambda: run_submit(engine, ["a"]))
    assert error.status_code == 400 and error.info.param == "prompt"


def test_any_other_engine_failure_propagates_unchanged():
    engine = FakeAsyncEngine(refuse={"a": KeyError("boom")})
    with pytest.raises(KeyError):
        run_submit(engine, ["a"])


# merge and collect


def filled_stream(engine: FakeAsyncEngine, name: str, items: list[Any]) -> RequestStream:
    stream = RequestStream(name, engine)  # type: ignore[arg-type]
    for item in items:
        stream.put(item)
    return stream


async def drain(outputs: AsyncIterator[tuple[int, Any]]) -> list[tuple[int, Any]]:
    return [item async for item in outputs]


def test_merge_tags_each_output_with_its_prompt_index_in_each_streams_order():
    engine = FakeAsyncEngine()
    first = [output(False, "a"), output(True, "ab")]
    second = [output(False, "x"), output(False, "xy"), output(True, "xyz")]
    streams = [filled_stream(engine, "r-0", first), filled_stream(engine, "r-1", second)]
    merged = asyncio.run(drain(merge(streams)))
    assert [o for i, o in merged if i == 0] == first
    assert [o for i, o in merged if i == 1] == second


def test_merge_raises_a_streams_error():
    engine = FakeAsyncEngine()
    streams = [
        filled_stream(engine, "r-0", [output(True)]),
        filled_stream(engine, "r-1", [RuntimeError("engine died")]),
    ]
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(drain(merge(streams)))


def test_collect_returns_each_streams_final_output_in_prompt_order():
    engine = FakeAsyncEngine()
    finals = [output(True, "one"), output(True, "two")]
    streams = [
        filled_stream(engine, "r-0", [output(False, "o"), finals[0]]),
        filled_stream(engine, "r-1", [finals[1]]),
    ]
    assert asyncio.run(collect(streams, FakeRequest())) == finals  # type: ignore[arg-type]


def test_collect_stops_when_the_client_disconnects():
    async def main() -> None:
        stream = filled_stream(FakeAsyncEngine(), "r-0", [output(False)])  # never finishes
        request = FakeRequest()
        request.disconnect.set()
        await collect([stream], request)  # type: ignore[arg-type]

    with pytest.raises(ClientDisconnectedError):
        asyncio.run(main())


# usage and server-sent events


def test_usage_counts_every_prompts_tokens():
    prompts = [Prompt("a", [1, 2, 3]), Prompt("b", [4])]
    assert usage(prompts, 5) == Usage(prompt_tokens=4, completion_tokens=5, total_tokens=9)


def test_sse_is_one_compact_data_line_keeping_non_ascii():
    assert sse({"text": "café", "n": 1}) == 'data: {"text":"café","n":1}\n\n'


def test_sse_leaves_out_excluded_fields_of_a_model():
    usage = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    event = sse(usage, exclude={"total_tokens", "prompt_tokens_details"})
    assert json.loads(event.removeprefix("data: ")) == {"prompt_tokens": 1, "completion_tokens": 2}


def test_sse_error_carries_an_api_errors_own_body():
    error = APIError(400, "bad n", param="n")
    body = ErrorResponse.model_validate_json(sse_error(error).removeprefix("data: "))
    assert body.error == error.info


def test_sse_error_reports_any_other_exception_as_an_internal_error():
    body = ErrorResponse.model_validate_json(sse_error(KeyError("k")).removeprefix("data: "))
    assert body.error.type == "server_error" and body.error.code == "internal_error"
    assert "KeyError" in body.error.message


# EngineStreamingResponse


def respond(events: AsyncIterator[str], streams: list[RequestStream]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def main() -> None:
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        response = EngineStreamingResponse(events, streams)
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    asyncio.run(main())
    return sent


def test_a_finished_response_sends_its_events_and_closes_its_streams():
    engine = FakeAsyncEngine()
    streams = [RequestStream("r-0", engine), RequestStream("r-1", engine)]  # type: ignore[arg-type]

    async def events() -> AsyncIterator[str]:
        yield sse({"n": 1})
        yield SSE_DONE

    sent = respond(events(), streams)
    assert sent[0]["headers"] and b"text/event-stream" in dict(sent[0]["headers"])[b"content-type"]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert body.decode() == 'data: {"n":1}\n\n' + SSE_DONE
    assert engine.aborted == ["r-0", "r-1"]


def test_a_response_that_fails_before_its_first_event_still_closes_its_streams():
    engine = FakeAsyncEngine()
    streams = [RequestStream("r-0", engine)]  # type: ignore[arg-type]

    async def events() -> AsyncIterator[str]:
        raise RuntimeError("server shutting down")
        yield ""  # an async generator

    with pytest.raises(RuntimeError):
        respond(events(), streams)
    assert engine.aborted == ["r-0"]


def test_new_ids_carry_the_prefix_and_differ():
    first, second = new_id("chatcmpl"), new_id("chatcmpl")
    assert first.startswith("chatcmpl-") and first != second
