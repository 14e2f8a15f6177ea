"""The calibration text: built in, split by topic, cut into the same windows on every run."""

from __future__ import annotations

from pydoc_data.topics import topics

import pytest
import torch

from tokenmill.quant.calibration import (
    split_paragraphs,
    split_text,
    text_fingerprint,
    token_windows,
)


def test_every_paragraph_lands_in_exactly_one_split():
    calibration, heldout = set(split_paragraphs("calibration")), set(split_paragraphs("heldout"))
    assert not calibration & heldout
    everything = {p for text in topics.values() for p in text.split("\n\n") if p.strip()}
    assert calibration | heldout == everything
    assert len(split_text("heldout")) < len(split_text("calibration")) / 3


def test_windows_are_deterministic_distinct_and_from_the_split(smollm):
    first = token_windows(smollm.tokenizer, "heldout", 6, 64)
    assert first.shape == (6, 64)
    assert torch.equal(first, token_windows(smollm.tokenizer, "heldout", 6, 64))
    assert len({tuple(row.tolist()) for row in first}) == 6
    decoded = smollm.tokenizer.decode(first[0].tolist())
    assert decoded.strip()[:20] in split_text("heldout")


def test_fingerprint_tells_the_splits_apart():
    assert text_fingerprint(split_text("heldout")) != text_fingerprint(split_text("calibration"))


def test_too_many_windows_is_a_clear_error(smollm):
    with pytest.raises(ValueError, match="num_samples=100000"):
        token_windows(smollm.tokenizer, "heldout", 100000, 512)


@pytest.mark.parametrize(("split", "samples", "seq_len"), [("train", 1, 8), ("heldout", 0, 8)])
def test_bad_arguments_name_the_field(smollm, split, samples, seq_len):
    with pytest.raises(ValueError, match="split|num_samples"):
        token_windows(smollm.tokenizer, split, samples, seq_len)
