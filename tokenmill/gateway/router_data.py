"""The routing evaluation set: questions graded automatically, that both models can partly
solve. Arithmetic is generated from a fixed seed; the factual questions and the sentences to
classify are written here. Each item says how to grade an answer.

Each is asked as a few-shot completion ("Q: ...\nA:", stopping at the line's end), a format a
base model (the packaged Gemma 3 270M has no chat tuning) answers as well as an instruct one.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

SEED = 36


FEW_SHOT = {
    "arithmetic": "Q: What is 3 + 5?\nA: 8\nQ: What is 10 - 4?\nA: 6\nQ: What is 6 * 7?\nA: 42\n",
    "factual": "Q: What is the capital of Poland?\nA: Warsaw\n"
    "Q: Who wrote Hamlet?\nA: William Shakespeare\n",
    "sentiment": 'Q: Sentiment of "I really enjoyed the meal."?\nA: positive\n'
    'Q: Sentiment of "The room was cold and noisy."?\nA: negative\n',
}
STOP = "\n"


@dataclass(frozen=True)
class Item:
    kind: str  # arithmetic | factual | sentiment
    question: str
    answers: tuple[str, ...]  # any one of them, found in the answer, is correct

    @property
    def prompt(self) -> str:
        """The few-shot completion prompt both models answer."""
        return f"{FEW_SHOT[self.kind]}Q: {self.question}\nA:"

    def grade(self, text: str) -> bool:
        text = text.casefold()
        if self.kind == "arithmetic":
            result = text.replace(",", "").rsplit("=", 1)[-1]  # "12 - 2 = 10" answers 10
            numbers = re.findall(r"-?\d+", result)
            return bool(numbers) and numbers[0] == self.answers[0]
        if self.kind == "sentiment":
            found = re.findall(r"positive|negative", text)
            return bool(found) and found[0] == self.answers[0]
        return any(answer.casefold() in text for answer in self.answers)


FACTS = [
    ("What is the capital of France?", ("Paris",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("What is the capital of Italy?", ("Rome",)),
    ("What is the capital of Germany?", ("Berlin",)),
    ("What is the capital of Spain?", ("Madrid",)),
    ("What is the capital of Canada?", ("Ottawa",)),
    ("What is the capital of Australia?", ("Canberra",)),
    ("What is the capital of Egypt?", ("Cairo",)),
    ("What is the capital of Kenya?", ("Nairobi",)),
    ("What is the capital of Peru?", ("Lima",)),
    ("What is the capital of Norway?", ("Oslo",)),
    ("What is the capital of Portugal?", ("Lisbon",)),
    ("What is the capital of Russia?", ("Moscow",)),
    ("What is the capital of China?", ("Beijing",)),
    ("What is the capital of Argentina?", ("Buenos Aires",)),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("Who painted the Mona Lisa?", ("Leonardo", "da Vinci")),
    ("Who developed the theory of relativity?", ("Einstein",)),
    ("Who was the first person to walk on the Moon?", ("Armstrong",)),
    ("Who discovered penicillin?", ("Fleming",)),
    ("Who wrote Pride and Prejudice?", ("Austen",)),
    ("Who composed the Fifth Symphony?", ("Beethoven",)),
    ("What is the largest planet in the solar system?", ("Jupiter",)),
    ("Which planet is known as the Red Planet?", ("Mars",)),
    ("What is the chemical symbol for gold?", ("Au",)),
    ("What is the chemical symbol for sodium?", ("Na",)),
    ("What gas do plants absorb from the air?", ("carbon dioxide", "CO2")),
    ("What is the largest ocean on Earth?", ("Pacific",)),
    ("What is the longest river in Africa?", ("Nile",)),
    ("What is the hardest natural substance?", ("diamond",)),
    ("How many legs does a spider have?", ("eight", "8")),
    ("How many continents are there?", ("seven", "7")),
    ("How many days are in a leap year?", ("366",)),
    ("What is the freezing point of water in Celsius?", ("0", "zero")),
    ("What is the boiling point of water in Celsius?", ("100",)),
    ("What language is spoken in Brazil?", ("Portuguese",)),
    ("What currency is used in Japan?", ("yen",)),
    ("What is the tallest mountain in the world?", ("Everest",)),
    ("Which animal is known as the king of the jungle?", ("lion",)),
    ("What is the smallest prime number?", ("2", "two")),
]

SENTENCES = [
    ("I loved this film, it was wonderful.", "positive"),
    ("The food was cold and the service was rude.", "negative"),
    ("What a fantastic day at the beach!", "positive"),
    ("This is the worst phone I have ever owned.", "negative"),
    ("The concert was amazing and the crowd was great.", "positive"),
    ("I am disappointed with the quality of this product.", "negative"),
    ("She was delighted with her birthday present.", "positive"),
    ("The hotel room was dirty and smelled bad.", "negative"),
    ("Our team won the championship, I am so happy!", "positive"),
    ("The movie was boring and far too long.", "negative"),
    ("The staff were friendly and helpful.", "positive"),
    ("My order arrived broken and late.", "negative"),
    ("This book is a joy to read.", "positive"),
    ("I regret buying these shoes; they hurt my feet.", "negative"),
    ("The garden looks beautiful in spring.", "positive"),
    ("The software keeps crashing and losing my work.", "negative"),
    ("I had a pleasant evening with old friends.", "positive"),
    ("The lecture was confusing and poorly organised.", "negative"),
    ("Excellent value for money, highly recommended.", "positive"),
    ("The train was delayed again and nobody apologised.", "negative"),
    ("The cake was delicious and beautifully decorated.", "positive"),
    ("I hated waiting two hours in the queue.", "negative"),
    ("This update made the app faster and easier to use.", "positive"),
    ("The weather ruined our holiday.", "negative"),
    ("What a lovely surprise to see you here!", "positive"),
    ("The instructions were useless and incomplete.", "negative"),
    ("He performed brilliantly in the final.", "positive"),
    ("The soup was bland and overpriced.", "negative"),
    ("I feel great after a good night's sleep.", "positive"),
    ("The noise from the street kept me awake all night.", "negative"),
]


def routing_items() -> list[Item]:
    rng = random.Random(SEED)
    items = []
    for _ in range(50):
        op = rng.choice("+-*")
        a, b = (
            (rng.randint(2, 99), rng.randint(2, 99))
            if op != "*"
            else (
                rng.randint(2, 19),
                rng.randint(2, 19),
            )
        )
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        items.append(Item("arithmetic", f"What is {a} {op} {b}?", (str(value),)))
    items += [Item("factual", q, a) for q, a in FACTS]
    items += [Item("sentiment", f'Sentiment of "{s}"?', (label,)) for s, label in SENTENCES]
    return items
