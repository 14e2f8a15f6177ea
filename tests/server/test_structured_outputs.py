"""response_format and structured_outputs through the official openai client and raw HTTP."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pydantic
import pytest

MODEL = "smollm2-135m-instruct"


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    species: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=40)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


ANIMALS = (
    "cat", "parrot", "goldfish", "hamster", "tortoise", "rabbit", "ferret", "gecko", "pony",
    "canary", "iguana", "beagle", "guinea pig", "axolotl", "hedgehog", "cockatiel", "chinchilla",
    "tarantula", "goat", "duck",
)  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_returns_a_validated_pydantic_object_for_varied_prompts(client, temperature):
    def parse(animal: str):
        return client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": f"Invent a pet {animal}."}],
            response_format=Pet,
            temperature=temperature,
            seed=7,
            max_tokens=64,
        )

    with ThreadPoolExecutor(len(ANIMALS)) as pool:  # at once, so the engine batches them
        completions = list(pool.map(parse, ANIMALS))
    for completion in completions:
        (choice,) = completion.choices
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)


def test_json_object_output_is_a_json_object(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a small JSON object."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=48,
    )
    (choice,) = response.choices
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")


def test_completions_regex_holds_for_every_sample(client):
    response = client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        n=8,
        temperature=1.0,
        max_tokens=12,
        extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}},
    )
    assert len(response.choices) == 8
    for choice in response.choices:
        assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", choice.text), choice.text


def test_chat_choice_holds_for_every_streamed_sample(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick a fruit."}],
        n=8,
        temperature=1.0,
        max_tokens=8,
        stream=True,
        extra_body={"structured_outputs": {"choice": ["apple", "pear", "plum"]}},
    )
    texts = [""] * 8
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert set(texts) <= {"apple", "pear", "plum"}


def bad_format(http, body: dict, param: str) -> str:
    response = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            **body,
        },
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    return error["message"]


def test_a_malformed_schema_is_a_400_naming_the_field_and_reason(http):
    schema = {"type": "object", "properties": {"a": {"type": "strin"}}}
    body = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }
    message = bad_format(http, body, "response_format")
    assert "strin" in message


def test_an_invalid_regex_is_a_400_naming_the_field(http):
    message = bad_format(http, {"structured_outputs": {"regex": "(ab"}}, "structured_outputs")
    assert "regex" in message and "parenthesis" in message


def test_an_unknown_response_format_type_is_a_400(http):
    message = bad_format(http, {"response_format": {"type": "yaml"}}, "response_format")
    assert "json_schema" in message


def test_two_constraints_at_once_are_a_400(http):
    body = {"structured_outputs": {"regex": "a", "choice": ["b"]}}
    assert "exactly one" in bad_format(http, body, "structured_outputs")


def test_an_invalid_grammar_is_a_400_on_completions(http):
    response = http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "Hi",
            "max_tokens": 4,
            "structured_outputs": {"grammar": "root ::= missing"},
        },
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "structured_outputs"
