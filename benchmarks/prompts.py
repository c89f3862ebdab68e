"""Benchmark prompts: input-grounded (the answer repeats or edits the input) and open-ended chat."""

GROUNDED = [
    "Repeat this code exactly, then add a docstring to each function:\n\n"
    "def mean(xs):\n    return sum(xs) / len(xs)\n\n"
    "def variance(xs):\n    m = mean(xs)\n    return sum((x - m) ** 2 for x in xs) / len(xs)\n\n"
    "def std(xs):\n    return variance(xs) ** 0.5\n",
    "Rename the variable `data` to `records` in this code and show the full result:\n\n"
    "def load(path):\n    data = []\n    with open(path) as f:\n        for line in f:\n"
    "            data.append(line.strip())\n    return data\n\n"
    "def count(data):\n    return len(data)\n",
    "Fix the spelling mistakes in this paragraph and repeat it:\n\n"
    "The quick brown fox jumpd over the lazy dog. It was a sunny day and the fox was verry happy. "
    "The dog did not notice, because it was sleepng under a big tree near the river.",
    "Convert this list to a numbered list, keeping every item:\n\n"
    "- apples\n- bananas\n- cherries\n- dates\n- elderberries\n- figs\n- grapes\n- honeydew melon\n",
]

OPEN_ENDED = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a weekend trip in the mountains.",
    "What are the benefits of regular exercise?",
]

SUITES = {"grounded": GROUNDED, "open": OPEN_ENDED}


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
