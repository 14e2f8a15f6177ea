"""The self-distilled corpus: generated once into a directory, resumed after a killed run,
reused as it is, and refused when it was made with other settings."""

from __future__ import annotations

import json

import pytest

from tokenmill.train.corpus import CONVERSATIONS, CorpusConfig, build_corpus, read_conversations

# Four prompts: the fourth is answered by sampling (seeded), the rest greedily.
CONFIG = CorpusConfig(num_prompts=4, max_tokens=6)


@pytest.fixture(scope="module")
def first_run(runner, tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    corpus = build_corpus(runner.engine(), CONFIG, directory)
    return directory, corpus


def test_every_prompt_gets_a_conversation_on_disk(first_run):
    directory, corpus = first_run
    assert len(corpus) == 4
    assert read_conversations(directory) == dict(enumerate(corpus))
    assert all(len(conversation) > 6 for conversation in corpus)


def test_a_complete_corpus_is_reused_without_generating(runner, first_run):
    directory, corpus = first_run
    before = (directory / CONVERSATIONS).read_bytes()
    engine = runner.engine()
    assert build_corpus(engine, CONFIG, directory) == corpus
    assert (directory / CONVERSATIONS).read_bytes() == before
    assert engine.scheduler.stats.num_prompt_tokens_queried == 0


def test_a_killed_run_resumes_with_only_the_missing_answers(runner, first_run, tmp_path):
    directory, corpus = first_run
    for name in ("corpus.json", CONVERSATIONS):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    lines = (tmp_path / CONVERSATIONS).read_text().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line)["index"] != 3]
    last = next(line for line in lines if json.loads(line)["index"] == 3)
    torn = last[:20]
    (tmp_path / CONVERSATIONS).write_text("".join(kept) + torn)
    assert sorted(read_conversations(tmp_path)) == [0, 1, 2]

    engine = runner.engine()
    assert build_corpus(engine, CONFIG, tmp_path) == corpus
    assert read_conversations(tmp_path) == dict(enumerate(corpus))
    assert engine.scheduler.stats.num_prompt_tokens_queried == json.loads(last)["num_prompt_tokens"]


def test_more_prompts_extend_the_corpus(runner, first_run, tmp_path):
    directory, corpus = first_run
    for name in ("corpus.json", CONVERSATIONS):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    larger = CorpusConfig(num_prompts=5, max_tokens=6)
    extended = build_corpus(runner.engine(), larger, tmp_path)
    assert extended[:4] == corpus and len(extended) == 5


def test_a_corpus_made_with_other_settings_is_refused(runner, first_run):
    directory, _ = first_run
    with pytest.raises(ValueError, match="generated with"):
        build_corpus(runner.engine(), CorpusConfig(num_prompts=4, max_tokens=7), directory)
