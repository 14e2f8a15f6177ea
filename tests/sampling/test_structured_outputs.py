"""StructuredOutputsParams: exactly one constraint, checked at the edge, with a sharing key."""

from __future__ import annotations

import pytest

from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.structured_outputs import StructuredOutputsParams


@pytest.mark.parametrize(
    "fields",
    [{}, {"regex": "a+", "choice": ["x"]}, {"json_object": True, "grammar": "root ::= 'a'"}],
)
def test_exactly_one_constraint_is_required(fields):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(**fields)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"json": 3}, "json"),
        ({"regex": ""}, "regex"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", 1]}, "choice"),
        ({"grammar": b"root"}, "grammar"),
    ],
)
def test_a_malformed_field_is_named(fields, field):
    with pytest.raises(ValueError, match=f"^{field} must"):
        StructuredOutputsParams(**fields)


def test_equal_schemas_share_a_key_whatever_their_key_order():
    first = StructuredOutputsParams(json={"type": "object", "required": ["a"]})
    second = StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    assert first.key == second.key
    assert first.key != StructuredOutputsParams(json={"type": "object"}).key


def test_sampling_params_refuse_a_constraint_of_another_type():
    with pytest.raises(ValueError, match="^structured_outputs must"):
        SamplingParams(structured_outputs={"regex": "a"})
