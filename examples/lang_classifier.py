"""A few-shot sentiment classifier run over a batch of reviews.

Every program shares the few-shot examples, so after the first one the server serves
them from its prefix cache. Each label is a `select` over the label words, scored by
the model's log-probabilities in one request per review.

    radixmesh serve &
    python examples/lang_classifier.py [--url URL] [--api-key KEY] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys

from radixmesh.lang import RuntimeEndpoint, function, select

LABELS = ["positive", "negative"]
EXAMPLES = [
    ("The food was delicious and the staff were friendly.", "positive"),
    ("I waited an hour and the soup was cold.", "negative"),
    ("A wonderful film, I would watch it again.", "positive"),
    ("The battery died after two days. Waste of money.", "negative"),
]
REVIEWS = [
    "Absolutely loved it, best purchase this year.",
    "Terrible service, I will never come back.",
    "The hotel room was clean and the view was beautiful.",
    "It broke the first time I used it.",
]


@function
def classify(s, review: str):
    s += "Classify the sentiment of each review as positive or negative.\n\n"
    for text, label in EXAMPLES:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += f"Review: {review}\nSentiment: "
    s += select("label", choices=LABELS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a radixmesh server")
    parser.add_argument("--api-key", default=os.environ.get("RADIXMESH_API_KEY"))
    parser.add_argument("--threads", type=int, default=4, help="programs run at once")
    args = parser.parse_args(argv)
    with RuntimeEndpoint(args.url, api_key=args.api_key) as backend:
        states = classify.run_batch([{"review": review} for review in REVIEWS], backend=backend,
                                    num_threads=args.threads)
        for review, state in zip(REVIEWS, states):
            logprobs = state.get_meta_info("label")["logprobs"]
            scores = ", ".join(f"{label} {lp:.2f}" for label, lp in zip(LABELS, logprobs))
            print(f"{state['label']:>8}  {review}  (log-probs: {scores})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
