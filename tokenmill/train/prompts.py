"""The chat prompts the draft heads are trained on: a varied, deterministic set that ships with
tokenmill.

Real chat mixes questions, explanations, how-tos, lists, stories, advice, comparisons and work
on a text the user pastes in. The set is built from those kinds of request, each a few phrasings
over a few hundred everyday subjects, sometimes with a style instruction ("in three sentences"),
plus rewrites and summaries of short given passages. `chat_prompts` picks them in a seeded
order, distinct; none is a benchmark workload's own prompt (tests/train/test_prompts.py holds
that), so a head is not measured on what it was trained on.
"""

from __future__ import annotations

import random
from functools import cache

SUBJECTS = (
    # nature and science
    "the water cycle",
    "photosynthesis",
    "volcanoes",
    "the moon",
    "black holes",
    "bees",
    "earthquakes",
    "tides",
    "rainbows",
    "thunderstorms",
    "glaciers",
    "deserts",
    "rainforests",
    "coral reefs",
    "the ozone layer",
    "climate change",
    "gravity",
    "magnets",
    "electricity",
    "atoms",
    "DNA",
    "evolution",
    "the immune system",
    "the human brain",
    "the human heart",
    "digestion",
    "bones",
    "muscles",
    "sleep",
    "dreams",
    "memory",
    "the five senses",
    "sound waves",
    "light",
    "the speed of light",
    "friction",
    "static electricity",
    "clouds",
    "snowflakes",
    "hurricanes",
    "tornadoes",
    "the solar system",
    "Mars",
    "Jupiter",
    "comets",
    "stars",
    "galaxies",
    "the Big Bang",
    "dinosaurs",
    "whales",
    "octopuses",
    "sharks",
    "penguins",
    "elephants",
    "ants",
    "butterflies",
    "migrating birds",
    "owls",
    "wolves",
    "mushrooms",
    "trees",
    "cactuses",
    "seeds",
    "soil",
    "rivers",
    "oceans",
    "mountains",
    "caves",
    # everyday life
    "coffee",
    "tea",
    "bread baking",
    "cooking pasta",
    "making soup",
    "breakfast",
    "vegetables",
    "drinking water",
    "a healthy diet",
    "exercise",
    "running",
    "swimming",
    "cycling",
    "yoga",
    "meditation",
    "stress",
    "friendship",
    "moving to a new city",
    "a first job",
    "job interviews",
    "public speaking",
    "writing a CV",
    "budgeting",
    "saving money",
    "credit cards",
    "renting a flat",
    "cleaning the house",
    "laundry",
    "houseplants",
    "gardening",
    "composting",
    "recycling",
    "keeping a journal",
    "reading more books",
    "learning a language",
    "learning to draw",
    "playing the piano",
    "the guitar",
    "jazz",
    "classical music",
    "photography",
    "board games",
    "chess",
    "camping",
    "hiking",
    "packing for a trip",
    "travelling by train",
    "airports",
    "time zones",
    "jet lag",
    "birthdays",
    "weddings",
    "pets",
    "cats",
    "dogs",
    "a new puppy",
    "goldfish",
    "raising children",
    "homework",
    "exams",
    "note taking",
    "time management",
    "procrastination",
    "habits",
    "morning routines",
    "working from home",
    "teamwork",
    "meetings",
    "writing emails",
    "giving feedback",
    "negotiating a salary",
    "starting a small business",
    # technology
    "the internet",
    "email",
    "passwords",
    "smartphones",
    "batteries",
    "solar panels",
    "wind turbines",
    "electric cars",
    "3D printing",
    "GPS",
    "Wi-Fi",
    "cloud storage",
    "backups",
    "computer viruses",
    "machine learning",
    "neural networks",
    "databases",
    "spreadsheets",
    "programming",
    "Python lists",
    "Python dictionaries",
    "recursion",
    "sorting algorithms",
    "binary search",
    "version control",
    "unit tests",
    "APIs",
    "web browsers",
    "search engines",
    "social media",
    "video games",
    "robots",
    "satellites",
    "microwave ovens",
    "refrigerators",
    "washing machines",
    "light bulbs",
    "the telephone",
    "the printing press",
    "the steam engine",
    # history, society and culture
    "the Roman Empire",
    "ancient Egypt",
    "the pyramids",
    "the Vikings",
    "the Middle Ages",
    "castles",
    "knights",
    "the Renaissance",
    "the Industrial Revolution",
    "the Silk Road",
    "the Olympic Games",
    "democracy",
    "elections",
    "taxes",
    "inflation",
    "the stock market",
    "banks",
    "money",
    "trade",
    "cities",
    "villages",
    "libraries",
    "museums",
    "newspapers",
    "languages",
    "writing systems",
    "maps",
    "calendars",
    "clocks",
    "bridges",
    "roads",
    "trains",
    "airplanes",
    "ships",
    "lighthouses",
    "bicycles",
    "football",
    "tennis",
    "the marathon",
    "theatre",
    "films",
    "poetry",
    "fairy tales",
    "mythology",
    "painting",
    "architecture",
    # maths and thinking
    "prime numbers",
    "fractions",
    "percentages",
    "probability",
    "statistics",
    "geometry",
    "algebra",
    "negative numbers",
    "infinity",
    "binary numbers",
    "logic puzzles",
    "critical thinking",
    "making decisions",
    "solving problems",
    "creativity",
    "curiosity",
)
SUBJECT_PROMPTS = (
    # explanations
    "Explain {s} to a ten-year-old.",
    "Explain {s} in simple terms.",
    "Can you walk me through {s}?",
    "What is the basic idea behind {s}?",
    "I never understood {s}. Can you help?",
    "Give me a beginner's introduction to {s}.",
    # questions and facts
    "What are three interesting facts about {s}?",
    "What is the history of {s}?",
    "Why is {s} important?",
    "What do most people get wrong about {s}?",
    "What should everyone know about {s}?",
    "Tell me something surprising about {s}.",
    "What are the most common questions about {s}?",
    # lists and how-tos
    "Give me some tips related to {s}.",
    "List five things to know before getting started with {s}.",
    "What are the main steps to get better at {s}?",
    "Make a short checklist about {s}.",
    "What are some common mistakes with {s}, and how can I avoid them?",
    "How can I teach a friend about {s}?",
    # writing
    "Write a short paragraph about {s}.",
    "Write a short poem about {s}.",
    "Write a short story that involves {s}.",
    "Write a haiku about {s}.",
    "Write a short blog post introduction about {s}.",
    "Write a fun quiz with three questions about {s}.",
    "Describe {s} as if you were a tour guide.",
    # opinions and comparisons
    "What are the pros and cons of {s}?",
    "How has {s} changed over the last hundred years?",
    "What might the future of {s} look like?",
    "Is {s} overrated? Give a balanced view.",
    "How would you summarise {s} in one paragraph?",
)
PAIR_PROMPTS = (
    "Compare {a} and {b}.",
    "What is the difference between {a} and {b}?",
    "What do {a} and {b} have in common?",
    "Write a short story that connects {a} and {b}.",
    "Which is more interesting to learn about, {a} or {b}? Explain why.",
)
ADVICE_PROMPTS = (
    "How do I stay motivated when learning something new?",
    "How can I sleep better?",
    "What is a good way to start exercising again after a long break?",
    "How do I make new friends as an adult?",
    "How can I be more productive in the morning?",
    "How should I prepare for a job interview?",
    "What is a simple weekly meal plan for a busy person?",
    "How can I stop checking my phone so often?",
    "How do I write a polite email declining an invitation?",
    "How can I save money on groceries?",
    "What are good questions to ask at the end of an interview?",
    "How do I keep a conversation going with someone I just met?",
    "How can I get better at remembering names?",
    "What should I do if I feel overwhelmed at work?",
    "How do I plan a small birthday party?",
    "How can I make my small flat feel bigger?",
    "How do I choose a good book to read?",
    "How can I help a friend who is feeling down?",
    "What is a good routine for studying for exams?",
    "How do I start learning to code?",
    "How do I apologise to a colleague after an argument?",
    "What are some cheap hobbies I could try?",
    "How can I drink more water during the day?",
    "How do I keep my houseplants alive?",
    "How should I organise my desk?",
    "What can I cook with rice, eggs and a few vegetables?",
    "How do I ask my manager for a raise?",
    "How can I be a better listener?",
    "What should I pack for a weekend hiking trip?",
    "How do I get over a fear of public speaking?",
)
STYLE_SUFFIXES = (
    "",
    "",
    "",
    " Keep it brief.",
    " Answer in three sentences.",
    " Use bullet points.",
    " Use a friendly tone.",
    " Keep it under 100 words.",
    " Give an example.",
    " Explain it step by step.",
)
PASSAGES = (
    "Every spring the river floods the low fields beside the village. For centuries farmers "
    "planted only after the water went down, because the flood left behind a layer of rich "
    "mud. A dam built upstream in the last century ended the floods, and the farmers now buy "
    "fertiliser instead.",
    "The café on the corner opens at six every morning. Its owner bakes the bread herself, and "
    "the first customers are usually nurses coming off the night shift at the hospital. By "
    "noon the bread is gone, and she closes the doors at two to start again the next day.",
    "Honeybees communicate through a dance. A forager that finds flowers returns to the hive "
    "and walks in a figure of eight, waggling its body along the middle line. The angle of "
    "that line tells the other bees the direction of the flowers, and the length of the "
    "waggle tells them the distance.",
    "Our team will move to the new office on the third floor next Monday. Please pack your "
    "desks by Friday afternoon and label every box with your name. The movers arrive on "
    "Saturday morning, and the network will be down until Sunday evening.",
    "The first bicycles had no pedals. Riders sat on a wooden frame between two wheels and "
    "pushed themselves along with their feet. Pedals came later, attached to the front wheel, "
    "which grew larger and larger until the chain drive made the modern bicycle possible.",
    "Maria started running two years ago, a little each morning before work. At first she "
    "could barely manage a kilometre. Last month she finished her first half marathon, slower "
    "than most but smiling the whole way, and she has already signed up for the next one.",
    "Bread rises because yeast eats the sugars in the flour and releases carbon dioxide. The "
    "gas is trapped by a stretchy network of gluten, which forms when the dough is kneaded. "
    "Baking sets the network, and the bubbles stay behind as the soft holes in the crumb.",
    "The library will extend its opening hours during the exam period. From the first of May "
    "it will open at eight and close at midnight on weekdays. Group study rooms must be "
    "booked online, and each booking may last at most three hours.",
    "A lighthouse keeper's work changed little for a hundred years: trim the wick, polish the "
    "lens, wind the clockwork that turned the light. Electricity and automation ended the job "
    "in most countries by the end of the twentieth century.",
    "Octopuses have three hearts and blue blood. Two hearts pump blood through the gills and "
    "the third pumps it around the body. Their blood is blue because it carries oxygen with "
    "copper rather than iron, which works better in cold water with little oxygen.",
    "The new update makes the app start faster and fixes a bug that logged some users out. "
    "It also adds a dark mode, which you can turn on in the settings. If you notice any "
    "problems after updating, please contact our support team.",
    "Tom forgot his umbrella on the day the storm arrived. He ran from the bus stop to the "
    "office, arrived soaked, and spent the morning in borrowed clothes from the lost and "
    "found box. Since then he keeps a spare umbrella under his desk.",
)
PASSAGE_PROMPTS = (
    "Summarise the following text in one sentence.",
    "Summarise this in two or three sentences.",
    "Rewrite the following text in a more formal tone.",
    "Rewrite this text so that a child could understand it.",
    "Turn the following text into a list of bullet points.",
    "Rewrite the following paragraph in the past tense.",
    "What is the main idea of this text?",
    "Write three questions a reader might ask about this text.",
    "Give this text a good title and explain your choice.",
    "Rewrite the following text to make it shorter.",
    "Translate this text into simpler English.",
    "Continue this text with one more paragraph.",
)
STORY_PROMPTS = (
    "Write a short story about {a} who finds {b}.",
    "Tell a bedtime story about {a} and {b}.",
    "Write a funny short story where {a} loses {b}.",
)
CHARACTERS = (
    "a curious cat",
    "a young inventor",
    "an old fisherman",
    "a lost robot",
    "a shy dragon",
    "a brave mouse",
    "a tired teacher",
    "a clever fox",
    "a lonely astronaut",
    "a baker",
    "a little girl",
    "a retired detective",
    "a talking tree",
    "a penguin",
    "a wizard",
)
OBJECTS = (
    "a secret map",
    "a golden key",
    "a magic hat",
    "a message in a bottle",
    "an old diary",
    "a tiny door",
    "a broken clock",
    "a mysterious egg",
    "a lost umbrella",
    "a shiny stone",
)


@cache
def _all_prompts() -> tuple[str, ...]:
    """Every prompt the set can hold, in a fixed order (seeded per family)."""
    rng = random.Random(0)
    prompts = [
        template.format(s=subject) + rng.choice(STYLE_SUFFIXES)
        for subject in SUBJECTS
        for template in SUBJECT_PROMPTS
    ]
    for _ in range(len(SUBJECTS) * len(PAIR_PROMPTS) // 2):
        a, b = rng.sample(SUBJECTS, 2)
        prompts.append(rng.choice(PAIR_PROMPTS).format(a=a, b=b))
    prompts += [advice + suffix for advice in ADVICE_PROMPTS for suffix in STYLE_SUFFIXES[2:]]
    prompts += [f"{task}\n\n{text}" for text in PASSAGES for task in PASSAGE_PROMPTS]
    prompts += [
        story.format(a=character, b=thing)
        for story in STORY_PROMPTS
        for character in CHARACTERS
        for thing in OBJECTS
    ]
    return tuple(dict.fromkeys(prompts))  # distinct, first occurrence kept


def chat_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct prompts in a seeded order (at most `num_chat_prompts()`)."""
    available = list(_all_prompts())
    if not 0 < count <= len(available):
        raise ValueError(f"count must be between 1 and {len(available)}, got {count}")
    random.Random(seed).shuffle(available)
    return available[:count]


def num_chat_prompts() -> int:
    return len(_all_prompts())
