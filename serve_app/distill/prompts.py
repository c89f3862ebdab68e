"""Training data that needs no download: chat prompts composed from topics and instructions, user
prompts the target writes itself (Magpie), and plain text from the installed standard library's
docstrings.

Held-out evaluation uses topics and instructions that training never sees (``split="heldout"``).
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import sys

TOPICS = [
    "the water cycle", "photosynthesis", "black holes", "the French Revolution", "machine learning",
    "climate change", "the human heart", "volcanoes", "the stock market", "renewable energy",
    "ancient Rome", "the immune system", "quantum computing", "coral reefs", "the printing press",
    "electric cars", "the moon landing", "honey bees", "inflation", "the internet", "vaccines",
    "rainforests", "the Renaissance", "earthquakes", "DNA", "chess", "coffee", "the Olympic Games",
    "the solar system", "recycling", "sleep", "meditation", "jazz music", "the Great Wall of China",
    "dinosaurs", "social media", "electricity", "the ocean tides", "cloud computing", "nutrition",
    "public speaking", "time management", "gardening", "photography", "the Amazon river",
    "artificial intelligence ethics", "bread baking", "marathon training", "budgeting", "friendship",
    "the history of mathematics", "birds migration", "glaciers", "robots", "the human brain",
    "solar panels", "democracy", "the Silk Road", "vitamins", "video games", "recycling plastic",
    "wind turbines", "the Egyptian pyramids", "bacteria", "the theory of evolution", "mountains",
    "a job interview", "learning a new language", "the Industrial Revolution", "tea", "penguins",
    "cybersecurity", "the periodic table", "rain", "deserts", "cooking pasta", "yoga", "libraries",
]
HELDOUT_TOPICS = [
    "submarines", "the violin", "hurricanes", "origami", "the Roman alphabet", "mushrooms",
    "skyscrapers", "lighthouses", "the Arctic", "sourdough", "telescopes", "volunteering",
]
INSTRUCTIONS = [
    "Explain {t} in simple terms.", "Write a short paragraph about {t}.", "What are three facts about {t}?",
    "Give me a brief history of {t}.", "Why is {t} important?", "Describe {t} to a child.",
    "List the pros and cons of {t}.", "Write a short poem about {t}.", "Summarize what people should know about {t}.",
    "How does {t} work?", "Write a tweet about {t}.", "What are common misconceptions about {t}?",
    "Give me tips related to {t}.", "Write a short story involving {t}.", "Compare {t} with something similar.",
]
HELDOUT_INSTRUCTIONS = [
    "What would surprise a beginner about {t}?", "Teach me something interesting about {t}.",
    "Write two sentences about {t}.", "What questions do scientists still have about {t}?",
]
CODE_TASKS = [
    "Write a Python function that reverses a string.", "Write a Python function to check if a number is prime.",
    "Write a Python function that returns the factorial of n.", "Write a Python class for a stack.",
    "Write a Python function that counts words in a sentence.", "Write a Python function to merge two sorted lists.",
    "Write a Python function that computes Fibonacci numbers.",
    "Write a SQL query that selects all users older than 30.",
    "Write a Python function that removes duplicates from a list.", "Write a JavaScript function that sums an array.",
    "Write a Python function that reads a file and prints each line.", "Write a Python function for binary search.",
]


def chat_prompts(split: str = "train", seed: int = 0) -> list[str]:
    """Every (instruction, topic) pair of the split, shuffled; plus code tasks for training."""
    topics, instructions = (TOPICS, INSTRUCTIONS) if split == "train" else (HELDOUT_TOPICS, HELDOUT_INSTRUCTIONS)
    prompts = [i.format(t=t) for t in topics for i in instructions]
    if split == "train":
        prompts += CODE_TASKS
    random.Random(seed).shuffle(prompts)
    return prompts


def user_turn_prefix(tokenizer) -> str:
    """The chat template up to where a user's message starts. Sampled from there, an instruction-tuned
    model writes a plausible user prompt (Magpie, arXiv 2406.08464): diverse prompts for free."""
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return text[: text.index(marker)]


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def usable_prompts(candidates: list[str], exclude: list[str], min_words: int = 4) -> list[str]:
    """Distinct synthetic prompts, dropping short ones and any close to an excluded (held-out) prompt
    (word Jaccard >= 0.5), so that held-out evaluation stays unseen."""
    banned = [_words(e) for e in exclude]
    out, seen = [], set()
    for text in candidates:
        text = text.strip()
        words = _words(text)
        key = " ".join(sorted(words))
        if len(words) < min_words or key in seen:
            continue
        if any(len(words & b) / len(words | b) >= 0.5 for b in banned):
            continue
        seen.add(key)
        out.append(text)
    return out


def stdlib_text(max_docs: int = 2000) -> list[str]:
    """Docstrings of the installed standard library (modules, classes, functions), longest first."""
    docs: list[str] = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - platform-specific modules fail to import; skip them
            continue
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isfunction(obj)) else None
            if doc and len(doc) > 200:
                docs.append(doc)
        if module.__doc__ and len(module.__doc__) > 200:
            docs.append(module.__doc__)
        if len(docs) > 4 * max_docs:
            break
    unique = sorted(set(docs), key=len, reverse=True)
    return unique[:max_docs]

