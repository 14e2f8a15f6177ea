"""The routing classifier: it learns which prompts need the large model, and survives a save."""

from __future__ import annotations

from tokenmill.gateway.classifier import RouteClassifier, train_classifier
from tokenmill.gateway.embedding import packaged_embedder

HARD = [f"What is {a} * {b}? Answer with the number only." for a, b in [(13, 17), (19, 14)]]
EASY = ["What is the capital of France?", "Who wrote Hamlet?", "What colour is the sky?"]


def trained() -> RouteClassifier:
    texts = [*HARD, "Multiply 18 by 16.", *EASY]
    labels = [True, True, True, False, False, False]
    return train_classifier(texts, labels, packaged_embedder())


def test_an_unseen_prompt_like_the_hard_ones_scores_higher():
    hard, easy = trained().prob_large(["What is 17 * 15?", "What is the capital of Spain?"])
    assert hard > 0.5 > easy


def test_a_saved_classifier_scores_the_same_after_loading(tmp_path):
    classifier = trained()
    classifier.save(tmp_path / "router.json")
    loaded = RouteClassifier.load(tmp_path / "router.json")
    prompts = ["What is 17 * 15?", "Who painted the Mona Lisa?"]
    assert loaded.prob_large(prompts).tolist() == classifier.prob_large(prompts).tolist()
