"""Chat prompts to distill a drafter from: instruction templates x topics, built offline (no dataset download).

``chat_prompts(num_held_out, seed)`` returns several thousand distinct single-turn chat conversations
(``[{"role": "user", ...}]``), split into training and held-out ones. They mix open-ended requests about a
topic (explain, list facts, write a poem, compare, ...) with the repetitive and formatted tasks where
speculation pays most (repeat or copy text, count, write code, name things). The target model's own answers to
them are the drafter's training data (``train.py``).
"""

import itertools
import random

LISTS_PER_POOL = 16  # random item lists drawn per (list template, item pool)
PAIRS = 2000  # random topic pairs to compare

TOPICS = (
    "black holes", "photosynthesis", "the French Revolution", "machine learning", "volcanoes", "honey bees",
    "the Moon", "jazz music", "climate change", "the human heart", "electricity", "the Roman Empire",
    "rainbows", "earthquakes", "the internet", "dinosaurs", "the water cycle", "vaccines", "solar panels",
    "the stock market", "coffee", "chess", "the Great Wall of China", "gravity", "DNA", "the ocean tides",
    "recycling", "the printing press", "airplanes", "bread baking", "the immune system", "Mars", "sleep",
    "the Renaissance", "electric cars", "coral reefs", "democracy", "the periodic table", "tea", "volleyball",
    "the Amazon rainforest", "penguins", "the Industrial Revolution", "magnets", "cloud computing", "yoga",
    "the pyramids of Egypt", "tornadoes", "bicycles", "the solar system", "friendship", "time management",
    "public speaking", "photography", "the theory of evolution", "bacteria", "the stomach", "wind energy",
    "the Olympic Games", "deserts", "glaciers", "smartphones", "cryptography", "the speed of light",
    "ancient Greece", "butterflies", "nutrition", "the Cold War", "robots", "music theory", "meditation",
    "the Sahara", "wolves", "mountains", "video games", "blockchain", "the moon landing", "chocolate",
    "the brain", "rivers", "soccer", "the violin", "origami", "gardening", "the alphabet", "money",
    "elephants", "lightning", "fossils", "bridges", "the telephone", "trees", "snow", "the Vikings",
    "cooking pasta", "renewable energy", "the Milky Way", "owls", "the Eiffel Tower", "sharks", "atoms",
    "writing a resume", "learning a language", "first aid", "the seasons", "pizza", "kindness", "maps",
    "the human eye", "earthworms", "the Titanic", "submarines", "hurricanes", "the piano", "ancient Rome",
    "the rain cycle", "quantum computing", "social media", "the Beatles", "Shakespeare", "the Great Barrier Reef",
    "the Internet of Things", "nuclear energy", "the human skeleton", "wind turbines", "antibiotics", "honey",
    "cheese making", "rice farming", "the Nile", "Mount Everest", "the Arctic", "the Pacific Ocean", "kangaroos",
    "octopuses", "dolphins", "bees and flowers", "spiders", "ants", "the human skin", "blood", "the lungs",
    "muscles", "exercise", "running", "swimming", "basketball", "tennis", "the guitar", "drums", "opera",
    "painting", "sculpture", "architecture", "skyscrapers", "trains", "rockets", "satellites", "the telescope",
    "microscopes", "the wheel", "fire", "the calendar", "clocks", "writing systems", "libraries", "newspapers",
    "radio", "television", "cinema", "animation", "comic books", "fairy tales", "mythology", "Greek gods",
    "the Silk Road", "the Aztecs", "the Maya", "the Inca", "samurai", "knights", "castles", "pirates",
    "the United Nations", "elections", "taxes", "banks", "inflation", "supply and demand", "startups",
    "marketing", "teamwork", "leadership", "negotiation", "budgeting", "saving money", "cooking rice",
    "baking cookies", "making coffee", "vegetarian food", "spices", "salt", "sugar", "water", "oxygen", "carbon",
    "plastic", "glass", "steel", "wood", "paper", "cotton", "silk", "batteries", "lasers", "semiconductors",
    "computer memory", "operating systems", "programming", "databases", "encryption", "passwords",
    "artificial intelligence", "neural networks", "search engines", "email", "video calls", "online shopping",
    "remote work", "cities", "villages", "farms", "forests", "wetlands", "caves", "islands", "beaches", "storms",
    "fog", "clouds", "the sun", "comets", "asteroids", "Jupiter", "Saturn's rings", "the Big Bang", "time",
    "memory", "dreams", "emotions", "happiness", "stress", "habits", "motivation", "creativity", "curiosity",
    "patience", "honesty", "courage", "gratitude", "forgiveness", "family", "childhood", "old age", "pets",
    "cats", "dogs", "horses", "birds", "fish", "frogs", "turtles", "whales", "bats", "insects", "flowers",
    "mushrooms", "cactuses", "seeds", "soil", "volcanic islands", "tsunamis", "droughts", "floods",
)
AUDIENCES = ("a five-year-old", "a high school student", "a software engineer", "my grandmother", "a tourist",
             "a busy manager")
FORMS = ("haiku", "limerick", "short story", "news headline", "motivational quote", "product description",
         "short speech", "diary entry", "dialogue between two friends", "riddle", "song chorus", "step-by-step guide")
TOPIC_TEMPLATES = (
    "How does {} work?",
    "What is the history of {}?",
    "What would the world be like without {}?",
    "Write five questions a student might ask about {}.",
    "Explain {} in simple terms.",
    "Write a short paragraph about {}.",
    "Give me three interesting facts about {}.",
    "What is {}? Answer in two sentences.",
    "Describe {} to a ten-year-old.",
    "Write a short poem about {}.",
    "List five words related to {}, separated by commas.",
    "Why is {} important? Keep it brief.",
    "Summarize what you know about {} in three bullet points.",
    "What are the pros and cons of {}?",
    "Write a short story that involves {}.",
    "How would you teach {} to a beginner?",
    "Give a one-sentence definition of {}.",
    "Write a title and a short introduction for an article about {}.",
    "Tell me a fun fact about {}.",
    "What are common misconceptions about {}?",
    "Write a short blog post about {}.",
    "What are three ways {} affects everyday life?",
    "Give me a quick overview of {}.",
    "What should everyone know about {}?",
    "Write a short quiz with answers about {}.",
    "Tell me something surprising about {}.",
    "How has {} changed over time?",
    "What are the most important facts about {}?",
)
ITEM_POOLS = (
    ("apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "peach", "pear", "plum", "kiwi", "melon"),
    ("red", "green", "blue", "yellow", "purple", "orange", "black", "white", "pink", "brown", "gray", "teal"),
    ("cat", "dog", "horse", "rabbit", "mouse", "tiger", "lion", "bear", "fox", "deer", "owl", "frog"),
    ("Paris", "London", "Tokyo", "Rome", "Berlin", "Madrid", "Cairo", "Lima", "Oslo", "Delhi", "Seoul", "Lagos"),
    ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"),
    ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"),
)
LIST_TEMPLATES = (
    "Repeat this list {n} times: {items}.",
    "Write this list {n} times, one per line: {items}.",
    "Sort these words alphabetically: {items}.",
    "Write each of these words in capital letters: {items}.",
    "Number these items: {items}.",
)
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.", "All that glitters is not gold.",
    "A journey of a thousand miles begins with a single step.", "The early bird catches the worm.",
    "Practice makes perfect.", "Knowledge is power.", "The sun rises in the east and sets in the west.",
    "Water boils at one hundred degrees Celsius.", "Every cloud has a silver lining.",
    "Actions speak louder than words.", "Time flies when you are having fun.", "Honesty is the best policy.",
)
SENTENCE_TEMPLATES = (
    "Copy this sentence {n} times: {s}",
    "Repeat the following sentence {n} times: {s}",
    "Rewrite this sentence in the past tense: {s}",
    "Explain the meaning of this sentence: {s}",
    "Translate this sentence into French: {s}",
)
COUNTING_TEMPLATES = (
    "Write the numbers from {a} to {b}, separated by commas.",
    "Count from {a} to {b}.",
    "Count down from {b} to {a}.",
    "List the even numbers between {a} and {b}.",
    "Write the multiplication table of {a}.",
)
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "returns the largest element of a list",
    "counts the vowels in a string", "computes the factorial of n", "returns the n-th Fibonacci number",
    "sorts a list of numbers", "removes duplicates from a list", "checks whether a word is a palindrome",
    "converts Celsius to Fahrenheit", "returns the average of a list", "merges two dictionaries",
    "counts the words in a sentence", "finds the smallest number in a list", "returns the square of each item",
)
CODE_TEMPLATES = (
    "Write a Python function that {}.",
    "Write a Python function that {}, with a docstring.",
    "Write a JavaScript function that {}.",
    "Show me how to write a function that {} in Python, and explain it.",
)
CATEGORIES = ("programming languages", "planets", "musical instruments", "famous scientists", "vegetables",
              "board games", "sports", "rivers", "painters", "birds", "computer parts", "countries in Europe")
CATEGORY_TEMPLATES = (
    "Name three {} and one feature of each.",
    "List five {}.",
    "Name two {} and compare them.",
)
COUNTRIES = ("Italy", "Japan", "Canada", "Brazil", "Kenya", "Norway", "Egypt", "Mexico", "India", "Spain",
             "Germany", "Australia", "Peru", "Greece", "Chile", "Sweden")
QUESTION_TEMPLATES = (
    "What is the capital of {}? Answer in one sentence.",
    "What language is spoken in {}?",
    "Tell me about the history of {} in a few sentences.",
    "What food is {} famous for?",
)


def _list_prompts(rng: random.Random) -> list[str]:
    prompts = []
    for template, pool in itertools.product(LIST_TEMPLATES, ITEM_POOLS):
        for _ in range(LISTS_PER_POOL):
            items = rng.sample(pool, rng.randint(3, min(8, len(pool))))
            prompts.append(template.format(n=rng.choice(("two", "three")), items=", ".join(items)))
    return prompts


def all_prompts(seed: int = 0) -> list[str]:
    """Every user message the templates produce (several thousand), deduplicated, in a seeded random order."""
    rng = random.Random(seed)
    prompts = [t.format(topic) for t, topic in itertools.product(TOPIC_TEMPLATES, TOPICS)]
    prompts += [f"Explain {topic} to {who}." for topic, who in itertools.product(TOPICS, AUDIENCES)]
    prompts += [f"Write a {form} about {topic}." for topic, form in itertools.product(TOPICS, FORMS)]
    prompts += [f"Compare {a} and {b}." for a, b in (rng.sample(TOPICS, 2) for _ in range(PAIRS))]
    prompts += _list_prompts(rng)
    prompts += [t.format(n=n, s=s)
                for t, s, n in itertools.product(SENTENCE_TEMPLATES, SENTENCES, ("twice", "three times"))]
    prompts += [t.format(a=a, b=b) for t in COUNTING_TEMPLATES for a, b in ((1, 20), (1, 40), (5, 30), (10, 50),
                                                                           (3, 25), (20, 60), (2, 12), (7, 35))]
    prompts += [t.format(task) for t, task in itertools.product(CODE_TEMPLATES, CODE_TASKS)]
    prompts += [t.format(c) for t, c in itertools.product(CATEGORY_TEMPLATES, CATEGORIES)]
    prompts += [t.format(c) for t, c in itertools.product(QUESTION_TEMPLATES, COUNTRIES)]
    prompts = list(dict.fromkeys(prompts))
    rng.shuffle(prompts)
    return prompts


def chat_prompts(num_held_out: int, seed: int = 0) -> tuple[list[list[dict[str, str]]], list[list[dict[str, str]]]]:
    """(training, held-out) single-turn chat conversations: every prompt of ``all_prompts(seed)``, the last
    ``num_held_out`` of them held out."""
    prompts = all_prompts(seed)
    if not 0 < num_held_out < len(prompts):
        raise ValueError(f"chat_prompts: num_held_out={num_held_out}: expected 0 < num_held_out < {len(prompts)} "
                         "(the prompts the templates make)")
    chats = [[{"role": "user", "content": p}] for p in prompts]
    return chats[:-num_held_out], chats[-num_held_out:]
