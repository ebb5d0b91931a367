"""Copy-heavy prompts for the speculative-decoding benchmark: rewrite or extend a passage, edit code.

These are the tasks where a request's output repeats its prompt, so n-gram drafts pay.
"""

from __future__ import annotations

PASSAGES = [
    "The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed the spiral "
    "stairs, trimmed the wick and wound the clockwork that turned the great lens. Ships passing in the fog "
    "counted the flashes to know where they were, and in the morning the keeper wrote the weather in a book.",
    "Our team meets every Monday at ten to review the previous week. Each person shares what they finished, what "
    "blocked them and what they plan next. Notes are posted in the shared folder by noon, and action items are "
    "assigned an owner and a due date before the meeting ends.",
    "To make bread, mix five hundred grams of flour with ten grams of salt and seven grams of yeast. Add three "
    "hundred and fifty milliliters of warm water and knead for ten minutes. Let the dough rise for an hour, shape "
    "it into a loaf and bake it at two hundred and twenty degrees for thirty five minutes.",
    "The museum opens at nine in the morning and closes at six in the evening, except on Thursdays when it stays "
    "open until nine. Tickets cost twelve euros for adults and are free for children under twelve. Guided tours "
    "leave from the main hall every hour on the hour.",
]
CODE = [
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price "
    "* item.quantity\n    discount = 0.1 * subtotal if subtotal > 100 else 0\n    return (subtotal - discount) * "
    "(1 + tax_rate)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        "
    "self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n    def is_empty(self):\n"
    "        return len(self.items) == 0\n",
    "def read_config(path):\n    config = {}\n    with open(path) as handle:\n        for line in handle:\n"
    "            key, value = line.strip().split('=')\n            config[key] = value\n    return config\n",
]
PASSAGE_TASKS = [
    "Repeat the following text exactly, word for word:",
    "Rewrite the following text, keeping every sentence but replacing 'the' with 'that' where it makes sense:",
    "Copy the following text, then add one more sentence at the end:",
]
CODE_TASKS = [
    "Rename the first function or class in this code to have a longer name, and output the whole code:",
    "Add a short comment above each line of this code and output the whole code:",
    "Output this code unchanged, then explain it in one sentence:",
]


def copy_heavy_messages() -> list[list[dict[str, str]]]:
    """Chat conversations (one user turn each), passages first, then code, interleaved by task."""
    convs = [f"{task}\n\n{text}" for task in PASSAGE_TASKS for text in PASSAGES]
    convs += [f"{task}\n\n```python\n{code}```" for task in CODE_TASKS for code in CODE]
    return [[{"role": "user", "content": content}] for content in convs]
